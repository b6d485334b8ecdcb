"""The YAML run config: defaults, overrides, refusals that name the key, factories."""

import pickle

import pytest
import yaml

from detached_rl.config import (
    ConfigError,
    RunConfig,
    dump_config,
    load_config,
    maker_factory,
    trainer_factory,
)


def test_defaults_work_and_sampling_is_shared():
    config = load_config()
    assert isinstance(config, RunConfig) and config.namespace == "detached_rl"
    # One sampling, at the top: the launch code hands it to the makers (maker_config)
    # and the trainer's learner.
    assert config.maker_config.sampling is config.sampling
    assert config.maker.sampling is None and config.ppo.sampling is None and config.grpo.sampling is None


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("namespace: exp1\nsampling: {max_new_tokens: 12, temperature: 0.7}\n"
                    "trainer: {train_batch_size: 16}\nppo: {actor_optimizer: {lr: 1e-6, betas: "
                    "[0.9, 0.95]}}\n")
    config = load_config(path, ["trainer.train_batch_size=32", "model.lora={r: 4, target_modules: [q_proj]}",
                                "ppo.kl_coef=0.05"])
    assert config.namespace == "exp1" and config.trainer.train_batch_size == 32
    assert config.sampling.max_new_tokens == 12 and config.maker_config.sampling.temperature == 0.7
    assert config.ppo.actor_optimizer.lr == 1e-6 and config.ppo.actor_optimizer.betas == (0.9, 0.95)
    assert config.model.lora.r == 4 and config.model.lora.target_modules == ("q_proj",)
    assert config.ppo.kl_coef == 0.05
    # What dump writes, load reads back the same.
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(config))
    assert load_config(again).to_dict() == config.to_dict()
    dumped = yaml.safe_load(dump_config(config))
    assert dumped["sampling"]["temperature"] == 0.7
    assert all("sampling" not in dumped[section] for section in ("maker", "ppo", "grpo"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["maker.bogus=1"], "maker.bogus: unknown key"),
        (["bogus=1"], "bogus: unknown key"),
        (["maker.sampling.top_k=3"], "maker.sampling: unknown key"),
        (["ppo.sampling.temperature=0.5"], "ppo.sampling: unknown key"),
        (["grpo.sampling={max_new_tokens: 8}"], "grpo.sampling: unknown key"),
        (["sampling.max_new_tokens=8", "grpo.overlong_buffer=8"], "grpo: overlong_buffer must be in"),
        (["ppo.advantage_estimator=vtrace"], "ppo.advantage_estimator: must be one of"),
        (["grpo.advantage_estimator=gae"], "grpo.advantage_estimator: must be one of"),
        (["grpo.policy_loss=nope"], "grpo.policy_loss: must be one of"),
        (["maker.push_policy=random"], "maker.push_policy: must be one of"),
        (["sampling.top_p=2"], "sampling.top_p: must be in"),
        (["trainer.train_batch_size=abc"], "trainer.train_batch_size: expected an integer"),
        (["trainer.train_batch_size=1.5"], "trainer.train_batch_size: expected an integer"),
        (["model.reference=maybe"], "model.reference: expected true or false"),
        (["ppo.actor_optimizer.betas=[0.9]"], "ppo.actor_optimizer.betas: expected 2 items"),
        (["ppo.actor_optimizer.lr=fast"], "ppo.actor_optimizer.lr: expected a number"),
        (["task.reward=vibes"], "task.reward: 'vibes' is neither 'module:function', "
                                "'path/to/file.py:function' nor a built-in reward"),
        (["trainer=3"], "trainer: expected a mapping"),
        (["noequals"], "expected key.path=value"),
        (["trainer_group.strategy=zero9"], "trainer_group.strategy: must be one of"),
        (["trainer_group.world_size=2"], "trainer_group.world_size: must be 1 with strategy 'naive'"),
        (["trainer_group.strategy=ddp", "trainer_group.world_size=0"],
         "trainer_group.world_size: must be an int >= 1"),
        (["trainer_group.placement_strategy=RANDOM"], "trainer_group.placement_strategy: must be one of"),
        (["trainer_group.num_cpus_per_rank=0"],
         "trainer_group.num_cpus_per_rank: must be > 0 when num_gpus_per_rank is 0"),
    ],
)
def test_bad_values_are_refused_with_the_dotted_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(None, overrides)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_factories_are_picklable_and_build_the_configured_models():
    config = load_config(None, ["algorithm=ppo", "model.policy=tiny", "model.lora={r: 4}",
                                "sampling.max_new_tokens=4"])
    build_trainer_models = pickle.loads(pickle.dumps(trainer_factory(config)))
    actor, critic = build_trainer_models()
    assert any("lora_A" in name for name, _ in actor.model.named_parameters())
    models = pickle.loads(pickle.dumps(maker_factory(config)))()
    assert models.reference is not None and models.critic is not None
    assert len(config.prompts().next_batch(3)) == 3


def test_grpo_run_config_builds_a_critic_free_setup():
    config = load_config(None, ["model.policy=tiny", "algorithm=grpo", "grpo.algorithm=dapo",
                                "maker.group_size=4", "task.reward=numeric_answer"])
    assert config.algorithm_config.clip_high == config.grpo.clip_high == 0.28
    assert config.algorithm_config.algorithm == "dapo"
    from detached_rl.models import Actor

    assert isinstance(trainer_factory(config)(), Actor)
    models = maker_factory(config)()
    assert models.critic is None and models.reference is None
    with pytest.raises(ConfigError, match="algorithm"):
        load_config(None, ["algorithm=sac"])


def test_trainer_group_section_loads_from_yaml(tmp_path):
    path = tmp_path / "group.yaml"
    path.write_text("trainer_group: {strategy: colossalai_ddp, world_size: 4, placement_strategy: SPREAD}\n")
    group = load_config(path).trainer_group
    assert (group.strategy, group.world_size, group.placement_strategy) == ("colossalai_ddp", 4, "SPREAD")
    assert group.strategy_options() == {"backend": None, "timeout_s": 300.0}


def test_the_run_sampling_reaches_the_trainers_learner():
    from detached_rl.algorithms.grpo import GRPOLearner
    from detached_rl.core.sampling import SamplingConfig

    from .helpers import naive_strategy

    config = load_config(None, ["model.policy=tiny", "algorithm=grpo", "sampling.temperature=0.5",
                                "sampling.max_new_tokens=9"])
    learner = GRPOLearner(trainer_factory(config)(), naive_strategy(), config.algorithm_config,
                          sampling=config.sampling)  # as the trainer shells build it
    assert learner.sampling is config.sampling and learner.sampling.temperature == 0.5
    assert GRPOLearner(trainer_factory(config)(), naive_strategy(), config.grpo).sampling == SamplingConfig()


def _config_imports(path) -> set[str]:
    """The `detached_rl.config` modules a file imports anywhere, `if TYPE_CHECKING:`
    blocks and functions included."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        found.update(name for name in names if name.startswith("detached_rl.config."))
    return found


def test_the_config_package_has_no_import_cycle_not_even_for_type_hints():
    from pathlib import Path

    import detached_rl.config as package

    folder = Path(package.__file__).parent
    graph = {f"detached_rl.config.{path.stem}": _config_imports(path) for path in folder.glob("*.py")
             if path.stem != "__init__"}
    # RunConfig is data (built with the plain-data conversion alone): the factories build from it.
    assert graph["detached_rl.config.schema"] == {"detached_rl.config.convert"}
    assert graph["detached_rl.config.convert"] == set()
    assert "detached_rl.config.schema" in graph["detached_rl.config.factories"]

    def reaches(start: str, target: str, seen: frozenset = frozenset()) -> bool:
        return any(n == target or n not in seen and reaches(n, target, seen | {n})
                   for n in graph.get(start, ()))

    assert [module for module in graph if reaches(module, module)] == []


def _leaves(data: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key path of nested mappings down to a value that is no mapping."""
    return [path for key, value in data.items()
            for path in (_leaves(value, (*prefix, key)) if isinstance(value, dict) else [(*prefix, key)])]


def test_the_recipe_states_only_where_the_main_job_departs_from_the_library_defaults():
    """run.yaml holds each main-job value once: a setting of a class below the config layer that differs from
    that class's default (so no value is stated twice, and none is a copy)."""
    import dataclasses

    from detached_rl.config import main_job
    from detached_rl.config.schema import main_job_section

    recipe = main_job()
    assert {"sampling", "maker", "trainer", "grpo"} <= set(recipe)  # the recipe is not empty
    for path in _leaves(recipe):
        section = type(getattr(RunConfig(), path[0]))
        job, library = main_job_section(section, path[0]), section()
        for key in path[1:-1]:
            job, library = getattr(job, key), getattr(library, key)
        assert dataclasses.is_dataclass(job), path
        assert not type(job).__module__.startswith("detached_rl.config."), f"{path}: the config's own class"
        assert getattr(job, path[-1]) != getattr(library, path[-1]), f"{'.'.join(path)} states the default"


def test_runconfig_and_every_command_start_from_the_recipe_file(tmp_path, monkeypatch):
    """The recipe is loaded, not a copy: a value changed in the file is what `RunConfig()` and `load_config`
    give."""
    from detached_rl.config import schema

    defaults = RunConfig()
    assert defaults == load_config()
    assert defaults.model.lora.r == 16 and defaults.sampling.max_new_tokens == 40
    assert (defaults.algorithm, defaults.model.policy, defaults.task.name, defaults.maker.backend) == (
        "grpo", "smollm2", "word_problems", "auto")
    changed = tmp_path / "run.yaml"
    changed.write_text(schema.RECIPE.read_text().replace("max_new_tokens: 40", "max_new_tokens: 24"))
    monkeypatch.setattr(schema, "RECIPE", changed)
    schema._recipe.cache_clear()
    try:
        assert RunConfig().sampling.max_new_tokens == load_config().sampling.max_new_tokens == 24
    finally:
        schema._recipe.cache_clear()


def test_one_lora_settings_type_for_the_config_the_models_and_check():
    """`model.lora` is the `LoraSettings` that `apply_lora` takes (no second LoRA settings type)."""
    import detached_rl.config as config_package
    from detached_rl.models.lora_settings import LoraSettings

    assert isinstance(RunConfig().model.lora, LoraSettings) and not hasattr(config_package, "LoraConfig")
    lora = load_config(None, ["model.lora.bias=lora_only", "model.lora.dropout=0.1"]).model.lora
    assert (lora.bias, lora.dropout, lora.r) == ("lora_only", 0.1, 16)  # every LoraSettings field is a key
    with pytest.raises(ConfigError, match="model.lora.backend: must be one of"):
        load_config(None, ["model.lora.backend=qlora"])


def test_the_config_loads_no_torch():
    """Importing the config, building `RunConfig()` and loading overrides imports neither torch nor Ray."""
    import subprocess
    import sys

    code = ("import sys; import detached_rl.config.schema; "
            "from detached_rl.config import RunConfig, load_config, dump_config; "
            "dump_config(RunConfig()); load_config(None, ['trainer_group.strategy=ddp', "
            "'grpo.advantage_estimator=rloo', 'maker.backend=vllm', 'model.lora.r=4']); "
            "print(sorted(m for m in ('torch', 'ray', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_a_section_given_in_part_keeps_the_rest_of_the_main_jobs_defaults():
    from detached_rl.config import from_dict

    config = from_dict(RunConfig, {"maker": {"group_size": 4}, "grpo": {"algorithm": "dapo"}})
    assert (config.maker.group_size, config.maker.backend, config.maker.wait_for_ack) == (4, "auto", True)
    assert config.grpo.kl_coef == 0.1 and config.grpo.clip_high == 0.28  # the preset fills what neither says
    assert load_config(None, ["task.name=addition"]).task.reward == "numeric_answer"  # the task's own reward


def test_trainer_and_maker_without_a_config_build_the_job_run_builds(monkeypatch):
    from detached_rl.actors.launch import launch_requests, maker_arguments
    from detached_rl.cli.main import _config, _run_config, build_parser

    # not loaded
    monkeypatch.setattr("detached_rl.models.specs.model_spec_problem", lambda spec, revision=None: None)
    parser = build_parser()
    run = _run_config(parser.parse_args(["run"]))
    trainer = _config(parser.parse_args(["trainer", "--name", "t"]))
    maker = _config(parser.parse_args(["maker", "--name", "m", "--trainers", "t"]))
    assert trainer == maker == run == RunConfig()
    assert launch_requests(trainer, "t", ["m"]) == launch_requests(run, "t", ["m"])
    made, ran = (maker_arguments(c, "m", ["t"]) for c in (maker, run))
    assert made["config"] == ran["config"] and made["model_factory"].args == ran["model_factory"].args


def test_a_decaying_schedule_spans_the_run_unless_its_length_is_given():
    config = load_config(None, ["run.steps=30", "grpo.actor_optimizer.schedule=cosine"])
    assert config.grpo.actor_optimizer.total_steps == 30
    config = load_config(None, ["run.steps=30", "grpo.actor_optimizer.schedule=linear",
                                "grpo.actor_optimizer.total_steps=12"])
    assert config.grpo.actor_optimizer.total_steps == 12
    constant = load_config(None, ["grpo.actor_optimizer.schedule=constant"])
    assert constant.grpo.actor_optimizer.total_steps is None


def test_the_torch_free_names_are_what_the_code_runs():
    """Each name a config may pick resolves to what runs it, and the dtype names are torch's floating ones."""
    import torch

    from detached_rl.algorithms.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, estimator_uses_critic
    from detached_rl.core.limits import FLOAT_DTYPES
    from detached_rl.generation.registry import GENERATION_BACKENDS, backend_factory
    from detached_rl.strategies.base import Strategy
    from detached_rl.strategies.registry import STRATEGIES

    assert all(callable(ADVANTAGE_ESTIMATORS[name]) for name in ADVANTAGE_ESTIMATORS)
    assert all(callable(POLICY_LOSSES[name]) for name in POLICY_LOSSES)
    assert [name for name in ADVANTAGE_ESTIMATORS if estimator_uses_critic(name)] == ["gae"]
    assert all(issubclass(STRATEGIES[name], Strategy) for name in STRATEGIES)
    assert all(callable(backend_factory(name)) for name in GENERATION_BACKENDS)
    assert all(getattr(torch, name).is_floating_point for name in FLOAT_DTYPES)
    with pytest.raises(ConfigError, match="maker.weight_cast_dtype: 'int8' is not a floating torch dtype"):
        load_config(None, ["maker.weight_cast_dtype=int8"])
