"""Models by Hugging Face Hub id (issue 47.1), fed offline as a user's machine would hold them: a Hub cache
laid out as `huggingface_hub` writes it (`tests/hub_cache.py`) under a temporary `HF_HOME`, read with
`HF_HUB_OFFLINE=1` by the real loading code, in fresh processes started the way a user starts them (the
cache location and the offline switch are read when huggingface_hub is imported)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from detached_rl.models.hub import is_hub_id
from tests.hub_cache import put_in_hub_cache
from tests.test_run_sockets import console_script, plain_environment

REPO = "acme/tiny-llama"
COMMIT = "3f2c" * 10  # the snapshot's commit (40 hex digits, as the Hub names them)
SEED = 7


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF_HOME whose Hub cache holds a tiny random llama as `acme/tiny-llama` (main, tag v1: COMMIT)."""
    from detached_rl.models.loaders import tiny_causal_lm

    root = tmp_path_factory.mktemp("hub")
    model, tokenizer = tiny_causal_lm("llama", seed=SEED)
    model.save_pretrained(root / "source")
    tokenizer.save_pretrained(root / "source")
    put_in_hub_cache(root / "home", REPO, root / "source", COMMIT, refs=("main", "v1"))
    return root / "home"


def environment(home: Path, hf_home: Path, offline: bool = True) -> dict[str, str]:
    """A user's plain shell with `HF_HOME` set, offline (`HF_HUB_OFFLINE=1`) or not."""
    env = {key: value for key, value in plain_environment(home).items()
           if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "HF_HUB_CACHE")}
    env["HF_HOME"] = str(hf_home)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


LOAD = """
import json, sys
from detached_rl.models.loaders import load_causal_lm, load_tokenizer
from detached_rl.weights.update import state_fingerprint
spec, revision = sys.argv[1], sys.argv[2] or None
try:
    model, tokenizer = load_causal_lm(spec, revision=revision)
except ValueError as error:
    print(json.dumps({"error": str(error)}))
else:
    ids = load_tokenizer(spec, revision=revision)("12 + 7 =").input_ids
    print(json.dumps({"weights": state_fingerprint({"model": model.state_dict()}), "ids": ids,
                      "tokens": tokenizer("12 + 7 =").input_ids}))
"""


def load(tmp_path: Path, hf_home: Path, spec: str, revision: str = "", offline: bool = True) -> dict:
    """`load_causal_lm(spec, revision=...)` in a fresh process: its weights' fingerprint and a prompt's
    tokens, or the error."""
    done = subprocess.run([sys.executable, "-c", LOAD, spec, revision],
                          env=environment(tmp_path, hf_home, offline), cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("spec", "hub"), [
    ("Qwen/Qwen2.5-0.5B-Instruct", True), ("gpt2", True), ("acme/tiny-llama", True), ("org/name.v2", True),
    ("./models/mine", False), ("/abs/path", False), ("a/b/c", False), ("../up", False), ("org/", False),
    ("name with space", False),
])
def test_hub_ids_are_told_from_paths(spec: str, hub: bool) -> None:
    assert is_hub_id(spec) is hub


def test_a_hub_id_loads_from_the_cache_offline_as_the_model_it_holds(tmp_path: Path, hub_home: Path) -> None:
    """By id, by branch, tag and commit: the weights and tokenizer are the ones in the cache, bit for bit."""
    from detached_rl.models.loaders import tiny_causal_lm
    from detached_rl.weights.update import state_fingerprint

    model, tokenizer = tiny_causal_lm("llama", seed=SEED)
    expected = state_fingerprint({"model": model.state_dict()})
    ids = tokenizer("12 + 7 =").input_ids
    for revision in ("", "main", "v1", COMMIT):
        loaded = load(tmp_path, hub_home, REPO, revision)
        assert loaded.get("ids") == ids == loaded.get("tokens"), loaded
        assert loaded["weights"] == expected, revision


def test_a_revision_not_in_the_cache_is_refused_naming_the_id_and_revision(tmp_path: Path,
                                                                             hub_home: Path) -> None:
    error = load(tmp_path, hub_home, REPO, "v2")["error"]
    assert "'acme/tiny-llama' at revision 'v2' is not in the Hugging Face cache" in error, error
    assert "HF_HUB_OFFLINE" in error and str(hub_home / "hub") in error, error


def refused(tmp_path: Path, hf_home: Path, *args: str, offline: bool = True,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`detached-rl run ...` from an empty directory; must exit 2 (refused before anything starts)."""
    env = {**environment(tmp_path, hf_home, offline), **(extra_env or {})}
    done = subprocess.run([*console_script(), "run", *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, (done.stdout[-2000:], done.stderr[-2000:])
    return done


def test_run_refuses_an_id_not_in_the_cache_offline_naming_it(tmp_path: Path, hub_home: Path) -> None:
    done = refused(tmp_path, hub_home, "--model", "acme/missing", "--steps", "2")
    assert "model.policy: 'acme/missing' is not in the Hugging Face cache" in done.stderr, done.stderr
    assert "HF_HUB_OFFLINE is set" in done.stderr and "hf download acme/missing" in done.stderr, done.stderr
    done = refused(tmp_path, hub_home, "--model", REPO, "--set", "model.revision=v2")
    assert "'acme/tiny-llama' at revision 'v2'" in done.stderr, done.stderr


def test_run_online_says_when_the_hub_cannot_be_reached(tmp_path: Path, hub_home: Path) -> None:
    """Online (no HF_HUB_OFFLINE) with a Hub that refuses connections (HF_ENDPOINT on a closed local port):
    an id that is not cached is refused saying the Hub cannot be reached; a cached one needs no Hub."""
    closed = {"HF_ENDPOINT": "http://127.0.0.1:9"}
    done = refused(tmp_path, hub_home, "--model", "acme/missing", offline=False, extra_env=closed)
    assert "'acme/missing' is not in the Hugging Face cache" in done.stderr, done.stderr
    assert "the Hub cannot be reached" in done.stderr and "ConnectError" in done.stderr, done.stderr


# The issue 47 bar's command end to end (make test-e2e); its code paths are tested above in make test.
@pytest.mark.ray
@pytest.mark.e2e
def test_run_trains_a_model_given_by_hub_id_offline(tmp_path: Path, hub_home: Path) -> None:
    """The issue's bar: `detached-rl run --model ORG/NAME --steps 2` from an empty directory, with the model
    only in the Hub cache and HF_HUB_OFFLINE=1, trains and saves its adapter."""
    home = tmp_path / "home"
    home.mkdir()
    command = [*console_script(), "run", "--model", REPO, "--steps", "2", "--makers", "1", "--name", "hub",
               "--no-progress", "--set", "task.name=addition", "--set", "sampling.max_new_tokens=8",
               "--set", "task.eval_size=8", "--set", "run.eval_every=0", "--set", "trainer.max_staleness=0"]
    done = subprocess.run(command, env=environment(home, hub_home), cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, start_new_session=True)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    run = tmp_path / "runs" / "hub"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in steps if "loss/policy_avg" in row] == [1, 2]
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert "model:\n  policy: acme/tiny-llama" in (run / "config.yaml").read_text()
