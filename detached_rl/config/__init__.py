"""Typed run configuration: the schema and the main job's recipe (`schema`, `run.yaml`), YAML and override
loading (`loading`, `convert`), model factories (`factories`). Importing it loads no torch."""

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
    ModelConfig,
    RunConfig,
    RunSection,
    ScorersConfig,
    TaskConfig,
    main_job,
)

__all__ = [
    "ALGORITHMS", "TASKS", "TASK_REWARDS", "ConfigError", "ModelConfig", "RunConfig",
    "RunSection",
    "ScorersConfig", "TaskConfig", "dump_config", "from_dict", "load_config", "merge_mappings",
    "parse_override",
    "main_job", "maker_factory", "read_yaml", "scorer_factory", "trainer_factory",
]
