"""`MakerConfig`: how a maker generates and talks to trainers (torch-free: part of the run config).

Re-exported by `detached_rl.maker.experience_maker`, where it was defined before.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from detached_rl.core.labels import check_label_selector
from detached_rl.core.limits import (
    DEFAULT_MAX_VERSION_JUMP,
    DEFAULT_MAX_WEIGHT_CHANGE,
    check_float_dtype,
    check_stall_s,
)
from detached_rl.core.resources import check_amount, check_resources
from detached_rl.core.sampling import SamplingConfig
from detached_rl.generation.registry import GENERATION_BACKENDS, LORA_MODES
from detached_rl.generation.vllm_config import VLLMConfig, vllm_config_with

# What a maker asks its LoRA trainers for when it registers (`MakerConfig.first_update`).
FIRST_UPDATES = ("adapter", "full")
PUSH_POLICIES = ("round_robin", "least_full")  # how a maker picks the trainer of its next push
# How long a maker waits for its trainers and scorer groups to appear by name when it starts
# (`ExperienceMakerHolder`'s attach_timeout_s).
ATTACH_TIMEOUT_S = 120.0


@dataclass
class MakerConfig:
    """How a maker generates and talks to trainers."""

    experience_batch_size: int = 8  # prompts per generation batch
    group_size: int = 1  # responses per prompt (GRPO groups)
    # None: SamplingConfig() (RunConfig hands its one `sampling` in here).
    sampling: SamplingConfig | None = None
    max_pushes_in_flight: int = 2
    push_policy: str = "round_robin"
    # A call that is no transfer (registering, asking a trainer) fails after this long; so does a push once
    # its trainer answers but is not receiving it.
    push_timeout_s: float = 60.0
    weight_timeout_s: float = 300.0  # the same for weight RPCs (registering) and waits for fresh weights
    # Transfers never time out while bytes arrive: a weight fetch (a push of experience) fails only after
    # this many seconds without a new piece, and again after half that (docs/operations.md, "Thin links").
    weight_stall_timeout_s: float = 30.0
    push_stall_timeout_s: float = 30.0
    weight_sync_mode: str = "staged"  # or "in_place" for models too large to stage twice
    weight_cast_dtype: str | None = None  # e.g. "bfloat16": cast incoming weights
    # With a LoRA trainer: "adapter" registers with the fingerprint of the base this maker loaded on its own
    # host and, when it is the trainer's, takes only adapters from the first update on (the base is verified
    # before anything is served; a maker with another base gets the whole model). "full": ask for the whole
    # model first.
    first_update: str = "adapter"
    # A pushed update may move the weights at most this many versions ahead; a bigger jump, a rollback or
    # another trainer run is taken only when the maker registers with its trainers (an explicit reset).
    max_version_jump: int = DEFAULT_MAX_VERSION_JUMP
    # A pushed update may change a tensor by at most this much relative to it (RMS of the change over the
    # tensor's RMS, floored at 0.01): an optimizer step moves weights by about its learning rate.
    # None: no bound.
    max_weight_change: float | None = DEFAULT_MAX_WEIGHT_CHANGE
    # A maker waiting for newer weights that got none this long registers with its trainers again and takes
    # what they offer (e.g. a trainer resumed from a checkpoint); not where updates came at a known pace and
    # stopped: that wait ends by the stall rule instead (the one wait policy, `maker/wait_policy.py`).
    resync_after_s: float = 30.0
    # Tag each sample with the weights' fingerprint (costs a checksum).
    record_weights_fingerprint: bool = False
    lora_mode: str = "keep"  # LoRA policies: "keep" the adapters, or "merge" W = W0 + scaling*B*A on update
    backend: str = "hf"  # generation backend, a name in `detached_rl.generation.GENERATION_BACKENDS`
    # Keyword arguments of the backend's factory; with backend "vllm" laid over the `vllm` section.
    backend_options: dict[str, Any] = field(default_factory=dict)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # engine settings when `backend` is "vllm"
    # Generate the next batch only once the last push is accepted: less overlap, but samples are fresher
    # (a maker is then never more than one batch ahead of the trainer's buffer).
    wait_for_ack: bool = False
    # Before generating, wait (up to `weight_timeout_s`) for weights new enough that the batch will not be
    # dropped as stale by the time the trainer reaches it (trainers with `max_staleness` say how new in
    # their acknowledgements). Off: generate with whatever weights are there, and waste batches that go stale.
    wait_for_fresh_weights: bool = True
    # Ray restarts a maker actor whose process died this many times (-1: always); the restarted maker
    # re-attaches to its trainers by name and takes their current weights before generating.
    max_restarts: int = 3
    # Seed the sampler before each batch with (seed, batch index): a maker then makes the same experience
    # from the same weights and prompts, run after run. None: unseeded.
    seed: int | None = None
    # Scorer groups (their actor-name prefixes) that serve a role instead of a local model; see `scorers`.
    reward_scorer: str | None = None
    reference_scorer: str | None = None
    critic_scorer: str | None = None
    scorer_timeout_s: float = 120.0  # one answer of a scorer, per attempt
    scorer_attempts: int = 3  # tries (on the group's other workers) before a scorer is reported down
    # Custom Ray resources the maker actor asks for (e.g. {"maker_node": 1} to place it on such a node).
    resources: dict[str, float] = field(default_factory=dict)
    # Node labels the maker's node must carry (Ray's label_selector, e.g. {"role": "maker"} for nodes started
    # with `ray start --labels role=maker`; conditions "v", "!v", "in(a,b)", "!in(a,b)").
    label_selector: dict[str, str] = field(default_factory=dict)
    # GPUs (fractions of one allowed, e.g. 0.25: makers sharing a GPU) and CPUs the maker actor asks Ray for.
    # Its models go to the GPU Ray gives it; with num_gpus 0 they stay on the CPU even where GPUs are visible.
    num_gpus: float = 0.0
    num_cpus: float = 1.0

    @property
    def answer_lag(self) -> int:
        """Pushes a maker leaves unanswered while it makes its next batch: that batch is made with the answer
        to the push this many before its own (0 with `wait_for_ack`)."""
        return 0 if self.wait_for_ack else self.max_pushes_in_flight - 1

    def __post_init__(self) -> None:
        for name in ("experience_batch_size", "group_size", "max_pushes_in_flight", "max_version_jump"):
            if getattr(self, name) < 1:
                raise ValueError(f"MakerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.push_policy not in PUSH_POLICIES:
            raise ValueError(
                f"MakerConfig.push_policy must be one of {PUSH_POLICIES}, got {self.push_policy!r}")
        if self.weight_sync_mode not in ("staged", "in_place"):
            raise ValueError(
                f"MakerConfig.weight_sync_mode must be 'staged' or 'in_place', got {self.weight_sync_mode!r}")
        if self.first_update not in FIRST_UPDATES:
            raise ValueError(
                f"MakerConfig.first_update must be one of {FIRST_UPDATES}, got {self.first_update!r}")
        if self.lora_mode not in LORA_MODES:
            raise ValueError(f"MakerConfig.lora_mode must be one of {LORA_MODES}, got {self.lora_mode!r}")
        if self.backend not in GENERATION_BACKENDS:
            raise ValueError(
                f"MakerConfig.backend must be one of {sorted(GENERATION_BACKENDS)}, got {self.backend!r}")
        if self.backend in ("vllm", "auto"):
            # Unknown or bad options are refused here, by name.
            vllm_config_with(self.vllm, self.backend_options)
        check_resources(self.resources, "MakerConfig.resources")
        check_label_selector(self.label_selector, "MakerConfig.label_selector")
        check_amount(self.num_gpus, "MakerConfig.num_gpus", gpu=True)
        check_amount(self.num_cpus, "MakerConfig.num_cpus")
        if self.scorer_attempts < 1:
            raise ValueError(f"MakerConfig.scorer_attempts must be >= 1, got {self.scorer_attempts}")
        if self.max_weight_change is not None and not 0 < self.max_weight_change < math.inf:
            raise ValueError(f"MakerConfig.max_weight_change must be > 0 and finite, or None; got "
                             f"{self.max_weight_change}")
        for name in ("push_timeout_s", "weight_timeout_s", "scorer_timeout_s", "resync_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MakerConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("weight_stall_timeout_s", "push_stall_timeout_s"):
            check_stall_s(f"MakerConfig.{name}", getattr(self, name))
        check_float_dtype(self.weight_cast_dtype, "MakerConfig.weight_cast_dtype")

    def backend_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the backend's factory: `backend_options` (vLLM: over the `vllm` section)."""
        if self.backend in ("vllm", "auto"):
            return dataclasses.asdict(vllm_config_with(self.vllm, self.backend_options))
        return dict(self.backend_options)

    @property
    def scorers(self) -> dict[str, str]:
        """Role -> scorer group name, for the roles served by scorer groups instead of local models."""
        named = {"reward": self.reward_scorer, "reference": self.reference_scorer,
                 "critic": self.critic_scorer}
        return {role: name for role, name in named.items() if name}
