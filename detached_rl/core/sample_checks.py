"""The settings of the trainer's sample-provenance check (`algorithms.provenance`); torch-free: the run
config loads without torch."""

from __future__ import annotations

from dataclasses import dataclass, field

#: The honest bounds by engine dtype (torch's name, no "torch."). Measured on the default job's model and
#: sampling (benchmarks/bench_provenance.py, docs/performance.md "Provenance"): float32 engines (HF, vLLM)
#: agree with a float32 recompute to <= 1.2e-5 a token over a sample; a bf16 vLLM engine to 0.038 (median),
#: 0.095 (max of 16 samples); one token's gap reaches 1.2 (a rounding flip near a tie).
DEFAULT_BOUNDS = {"float32": 0.02, "float64": 0.02, "bfloat16": 0.25, "float16": 0.25}


@dataclass
class ProvenanceConfig:
    """How a trainer checks that on-version samples come from the policy they name, and what it does when not.

    `bounds`: the largest honest gap (mean |log-prob difference| a token over a sample) by the dtype of the
    engine that made the sample or of the trainer, whichever is narrower; an engine of unknown dtype gets the
    largest bound; a sample of n < `min_tokens` valid tokens gets its bound times sqrt(min_tokens / n). A
    maker with `quarantine_after` samples outside their bound among its last `window` checked
    ones is quarantined: its pushes are refused, its samples in the buffer dropped.
    """

    check: bool = True
    bounds: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BOUNDS))
    quarantine_after: int = 4
    window: int = 64
    min_tokens: int = 8

    def __post_init__(self) -> None:
        for dtype, bound in self.bounds.items():
            if isinstance(bound, bool) or not isinstance(bound, int | float) or not 0 < bound < float("inf"):
                raise ValueError(f"ProvenanceConfig.bounds[{dtype!r}] must be a finite number > 0, "
                                 f"got {bound!r}")
        if not self.bounds:
            raise ValueError("ProvenanceConfig.bounds must name at least one dtype")
        for name in ("quarantine_after", "window", "min_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ProvenanceConfig.{name} must be an int >= 1, got {value!r}")
        if self.quarantine_after > self.window:
            raise ValueError(f"ProvenanceConfig.quarantine_after ({self.quarantine_after}) must be <= window "
                             f"({self.window})")

    def bound_for(self, engine: str, own_engine: str) -> float:
        """The honest gap bound of a sample from `engine` ("<backend>:<dtype>") checked by `own_engine`."""
        largest = max(self.bounds.values())
        return max(self.bounds.get(_dtype(name), largest) for name in (engine, own_engine))


def _dtype(engine: str) -> str:
    """The dtype of an engine tag ("vllm:bfloat16" and "hf:autocast-bfloat16" -> "bfloat16")."""
    return engine.rpartition(":")[2].removeprefix("autocast-")
