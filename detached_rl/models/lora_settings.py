"""`LoraSettings`: how LoRA is added to a model, as plain data (torch-free: the run config holds it).

The one LoRA settings type: `apply_lora` (`detached_rl.models.lora`) takes it, the run config's `model.lora`
is one, and so is what `detached-rl check` applies. Its defaults are the library's; the main job's recipe
(`detached_rl/config/run.yaml`) sets its own rank and targets over them.
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("peft", "loralib")
BIAS_MODES = ("none", "all", "lora_only")
ALL_LINEAR = "all-linear"  # every Linear (and Conv1D) layer but the output head, as peft names it


@dataclass
class LoraSettings:
    """How to add LoRA to a model; `None` fields are resolved from the model by `apply_lora`."""

    backend: str = "peft"
    r: int = 8
    alpha: float = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None
    bias: str = "none"
    modules_to_save: tuple[str, ...] | None = None
    fan_in_fan_out: bool | None = None
    merged_enable: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"LoraSettings.backend must be one of {BACKENDS}, got {self.backend!r}")
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoraSettings.r must be an int >= 1, got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoraSettings.alpha must be > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoraSettings.dropout must be in [0, 1), got {self.dropout!r}")
        if self.bias not in BIAS_MODES:
            raise ValueError(f"LoraSettings.bias must be one of {BIAS_MODES}, got {self.bias!r}")
        for field in ("target_modules", "modules_to_save"):
            names = getattr(self, field)
            if names is None:
                continue
            if isinstance(names, str) or not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(
                    f"LoraSettings.{field} must be a non-empty sequence of module names, got {names!r}"
                )
            setattr(self, field, tuple(names))
        if self.modules_to_save is not None and self.backend != "peft":
            raise ValueError("LoraSettings.modules_to_save is only supported by the peft backend")
        if self.merged_enable is not None:
            if self.backend != "loralib":
                raise ValueError("LoraSettings.merged_enable is only supported by the loralib backend")
            self.merged_enable = tuple(bool(e) for e in self.merged_enable)
            if not any(self.merged_enable):
                raise ValueError(
                    f"LoraSettings.merged_enable must enable at least one part, got {self.merged_enable}"
                )

    @property
    def scaling(self) -> float:
        """Factor applied to B·A: alpha / r."""
        return self.alpha / self.r
