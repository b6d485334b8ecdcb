"""The `maker.vllm` section: validation naming the field, YAML, overrides, the CLI flag, the engine's
environment.

None of this needs vLLM installed: the section and the backend's factory import it only to build an engine.
"""

import os
import sys

import pytest

from detached_rl.cli.main import _config, _run_config, build_parser
from detached_rl.config import ConfigError, dump_config, load_config
from detached_rl.generation.vllm_config import (
    VLLMConfig,
    apply_engine_environment,
    engine_environment,
    model_head_size,
)
from detached_rl.models.loaders import tiny_causal_lm


@pytest.mark.parametrize(("field", "value", "message"), [
    ("dtype", "int8", "maker.vllm.dtype must be one of"),
    ("kv_cache_gb", 0, "maker.vllm.kv_cache_gb must be an integer >= 1"),
    ("kv_cache_gb", 1.5, "maker.vllm.kv_cache_gb must be an integer >= 1"),
    ("max_model_len", 0, "maker.vllm.max_model_len must be an integer >= 1"),
    ("max_num_seqs", True, "maker.vllm.max_num_seqs must be an integer >= 1"),
    ("seed", -1, "maker.vllm.seed must be an integer >= 0"),
    ("lora_versions_kept", 0, "maker.vllm.lora_versions_kept must be an integer >= 1"),
    ("enforce_eager", "yes", "maker.vllm.enforce_eager must be true or false"),
    ("gpu_memory_utilization", 0.0, r"maker.vllm.gpu_memory_utilization must be in \(0, 1\]"),
    ("gpu_memory_utilization", 1.5, r"maker.vllm.gpu_memory_utilization must be in \(0, 1\]"),
])
def test_bad_values_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        VLLMConfig(**{field: value})


def test_defaults_and_backend_kwargs():
    config = VLLMConfig()
    assert (config.dtype, config.kv_cache_gb, config.lora_versions_kept) == ("auto", 1, None)
    # no run: the servable version and the one before
    assert config.backend_kwargs()["lora_versions_kept"] == 2
    assert VLLMConfig(lora_versions_kept=5).backend_kwargs()["lora_versions_kept"] == 5


def test_section_loads_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "vllm.yaml"
    path.write_text("maker: {backend: vllm, vllm: {dtype: float32, enforce_eager: false}}\n")
    config = load_config(path, ["maker.vllm.kv_cache_gb=2", "maker.backend_options={max_num_seqs: 8}"])
    assert config.maker.backend == "vllm"
    assert (config.maker.vllm.dtype, config.maker.vllm.kv_cache_gb, config.maker.vllm.enforce_eager) == (
        "float32", 2, False)
    kwargs = config.maker_config.backend_kwargs()
    assert (kwargs["dtype"], kwargs["kv_cache_gb"], kwargs["max_num_seqs"]) == ("float32", 2, 8)
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(config))
    assert load_config(again).to_dict() == config.to_dict()


@pytest.mark.parametrize(("overrides", "message"), [
    (["maker.vllm.dtype=int8"], "maker.vllm.dtype: must be one of"),
    (["maker.vllm.kv_cache_gb=0"], "maker.vllm.kv_cache_gb: must be an integer >= 1"),
    (["maker.vllm.bogus=1"], "maker.vllm.bogus: unknown key"),
    (["maker.vllm.enforce_eager=3"], "maker.vllm.enforce_eager: expected true or false"),
    (["maker.backend=vllm", "maker.backend_options={kv_cache: 1}"],
     r"maker.backend_options: \['kv_cache'\] are not options of backend 'vllm'"),
    (["maker.backend=vllm", "maker.backend_options={dtype: int8}"], "maker.vllm.dtype: must be one of"),
    (["maker.backend=tgi"], r"maker.backend: must be one of \['auto', 'hf', 'vllm'\]"),
])
def test_bad_values_in_config_files_name_the_dotted_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_lora_versions_kept_follows_the_runs_max_staleness():
    assert load_config(None, ["trainer.max_staleness=4"]).maker_config.vllm.lora_versions_kept == 5
    unbounded = load_config(None, ["trainer.max_staleness=null"])
    assert unbounded.maker_config.vllm.lora_versions_kept is None  # unbounded staleness: 2 (see above)
    kept = load_config(None, ["trainer.max_staleness=4", "maker.vllm.lora_versions_kept=2"])
    assert kept.maker_config.vllm.lora_versions_kept == 2  # set explicitly: kept as set


def test_run_and_maker_commands_take_backend_and_vllm_overrides():
    args = build_parser().parse_args(["run", "--backend", "vllm", "--model", "tiny", "--set",
                                      "maker.vllm.kv_cache_gb=2"])
    config = _run_config(args)
    assert config.maker.backend == "vllm" and config.maker.vllm.kv_cache_gb == 2
    # run.yaml's trainer.max_staleness 1 reaches the makers as the adapter versions a vLLM engine keeps.
    assert config.maker_config.vllm.lora_versions_kept == config.trainer.max_staleness + 1 == 2
    assert _run_config(build_parser().parse_args(["run"])).maker.backend == "auto"
    args = build_parser().parse_args(["maker", "--name", "m0", "--trainers", "t0", "--backend", "vllm",
                                      "--set", "maker.vllm.dtype=float32"])
    config = _config(args)
    assert config.maker.backend == "vllm" and config.maker.vllm.dtype == "float32"
    with pytest.raises(ConfigError, match="maker.backend: must be one of"):
        _config(build_parser().parse_args(["maker", "--name", "m0", "--trainers", "t0", "--backend", "tgi"]))


def test_engine_environment_is_set_only_where_unset(monkeypatch):
    config = VLLMConfig(kv_cache_gb=3)
    wanted = engine_environment(config)
    assert wanted == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    for key in wanted:
        monkeypatch.setenv(key, "placeholder")  # recorded, so teardown restores this process's environment
        monkeypatch.delenv(key)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # the user's own setting wins
    applied = apply_engine_environment(config)
    assert applied == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert apply_engine_environment(config) == {}


def test_head_size_of_the_tiny_models():
    # the default tiny llama: too small for vLLM on CPU
    assert model_head_size(tiny_causal_lm("llama")[0]) == 16
    assert model_head_size(tiny_causal_lm("llama", hidden_size=128, intermediate_size=256)[0]) == 32


def test_run_with_vllm_where_it_is_not_installed_says_how_to_install(monkeypatch, capsys):
    from detached_rl.cli.main import main

    monkeypatch.setitem(sys.modules, "vllm", None)  # `vllm` found nowhere, as where it is not installed
    assert main(["run", "--backend", "vllm", "--model", "tiny", "--no-progress"]) == 2  # before Ray starts
    error = capsys.readouterr().err
    assert "maker.backend 'vllm' needs the vllm package" in error
    assert "pip install 'detached-rl[vllm]'" in error


def test_auto_backend_falls_back_to_hf_where_vllm_cannot_serve_the_policy():
    """The default job's `maker.backend: auto` on a policy vLLM's CPU attention cannot run (head size 16), or
    where vllm is not installed: the HF backend, and the maker says so."""
    from detached_rl.core.prompts import CyclingPrompts
    from detached_rl.generation.hf import HFGenerationBackend
    from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig, MakerModels
    from detached_rl.models.actor import Actor
    from detached_rl.models.loaders import tiny_causal_lm
    from detached_rl.rewards.tasks import addition_problems

    from .helpers import LowTokenReward

    maker = ExperienceMaker("m", MakerModels(actor=Actor(*tiny_causal_lm("llama")), reward=LowTokenReward()),
                            CyclingPrompts(addition_problems(4)), MakerConfig(backend="auto"))
    assert isinstance(maker.backend, HFGenerationBackend)
    assert maker.backend_name == "hf" and maker.status()["backend"] == "hf"


def test_auto_decides_from_the_models_config_before_it_imports_vllm():
    """A tiny maker (head size 16) on CPU falls back to HF without importing vLLM (7 s of CPU a process);
    the head sizes it decides from are those of the installed vLLM's CPU attention."""
    import subprocess

    probe = ("import sys\n"
             "from detached_rl.generation.vllm_config import build_auto_backend\n"
             "from detached_rl.models.actor import Actor\n"
             "from detached_rl.models.loaders import tiny_causal_lm\n"
             "backend = build_auto_backend(Actor(*tiny_causal_lm('llama')))\n"
             "print(backend.engine.split(':')[0], 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["hf", "False"], out.stdout
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from detached_rl.generation.vllm_config import VLLM_CPU_HEAD_SIZES

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == VLLM_CPU_HEAD_SIZES


def test_work_directories_of_gone_processes_are_removed(tmp_path):
    """A maker killed without close() leaves its RAM-backed directory; the next engine's start removes it."""
    import subprocess
    import sys

    from detached_rl.generation.vllm import WORKDIR_PREFIX, process_tag, remove_orphaned_workdirs

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True,
                          check=True)
    namespace = process_tag().partition(".")[0]
    dead = tmp_path / f"{WORKDIR_PREFIX}{namespace}.{int(gone.stdout)}-abc"
    mine = tmp_path / f"{WORKDIR_PREFIX}{process_tag()}-def"
    alive = tmp_path / f"{WORKDIR_PREFIX}{namespace}.1-ghi"  # pid 1 always runs
    # the same dead pid in another pid namespace (another host sharing /dev/shm): not ours to judge
    elsewhere = tmp_path / f"{WORKDIR_PREFIX}{int(namespace) + 1}.{int(gone.stdout)}-jkl"
    older = tmp_path / f"{WORKDIR_PREFIX}{int(gone.stdout)}-mno"  # named by pid alone, before namespaces
    other = tmp_path / "something-else"
    for path in (dead, mine, alive, elsewhere, older, other):
        (path / "adapters").mkdir(parents=True)
    assert sorted(remove_orphaned_workdirs(str(tmp_path))) == sorted([str(dead), str(older)])
    assert not dead.exists() and mine.exists() and alive.exists() and elsewhere.exists() and other.exists()
