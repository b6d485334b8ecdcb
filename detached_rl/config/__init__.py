"""Typed run configuration: the schema (`schema`), YAML and override loading (`loading`),
model factories (`factories`)."""

from detached_rl.config.factories import maker_factory, scorer_factory, trainer_factory
from detached_rl.config.loading import (
    dump_config,
    from_dict,
    load_config,
    merge_mappings,
    parse_override,
    read_yaml,
)
from detached_rl.config.schema import (
    ALGORITHMS,
    TASK_REWARDS,
    TASKS,
    ConfigError,
    LoraConfig,
    ModelConfig,
    RunConfig,
    RunSection,
    ScorersConfig,
    TaskConfig,
)

__all__ = [
    "ALGORITHMS", "TASKS", "TASK_REWARDS", "ConfigError", "LoraConfig", "ModelConfig", "RunConfig",
    "RunSection",
    "ScorersConfig", "TaskConfig", "dump_config", "from_dict", "load_config", "merge_mappings",
    "parse_override",
    "maker_factory", "read_yaml", "scorer_factory", "trainer_factory",
]
