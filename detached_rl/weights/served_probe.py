"""Served-adapter proof: does a maker's engine serve the weights of the version it names?

A maker checks what arrives (checksums, base fingerprint, version bounds); an engine may still serve
something else (an adapter cached under a reused id, verl #7495; the base model, verl PR #3821). So after
each swap the maker reads back what its engine serves: the log-probs of a fixed probe text under the
served version (`probe_ids`; HF: a forward of the served model, vLLM: the prompt log-probs of a request
carrying the served adapter), and every push carries them for its version (`PROBE_KEY` in the first
sample's `info`). The trainer computes the same probe with its own weights of each version (`ProbeBook`)
and refuses a push whose probe is further from its own than the engine's honest bound
(`ProvenanceConfig.bound_for`, the mean per-token gap): the maker is named, counted and asked to
register again. A served policy within that bound of the trainer's is not told apart (nor worth it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

#: The `Experience.info` key of a push's served-adapter proof: {"version": v, "log_probs": [...]}.
PROBE_KEY = "served_probe"
#: Natural text (not random ids: a bf16 engine's error grows on unlikely tokens), the default task's shape.
PROBE_TEXT = ("Question: Tom has 12 apples and buys 30 more. How many apples does he have now?\n"
              "Answer: 12 + 30 = 42. The answer is 42.")
#: What a refusal for a served-adapter mismatch says (the maker recognises it and registers again).
SERVED_MISMATCH = "serves another policy than the"
#: Versions whose probes a trainer keeps (a push names a version at most `max_staleness` old).
KEPT_VERSIONS = 16


def probe_ids(tokenizer: Any) -> torch.Tensor:
    """The probe's token ids [T] (no chat template: the same ids on every side)."""
    return torch.tensor(tokenizer(PROBE_TEXT)["input_ids"], dtype=torch.long)


def model_probe(model: torch.nn.Module, ids: torch.Tensor) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1 under a causal LM (raw logits, temperature 1), as floats."""
    device = next(model.parameters()).device
    training = model.training
    model.eval()  # a LoRA or model dropout would make the probe a random draw
    try:
        with torch.no_grad():
            logits = model(input_ids=ids[None].to(device)).logits[0, :-1].float()
    finally:
        model.train(training)
    return logits.log_softmax(-1).gather(-1, ids[1:].to(device)[:, None])[:, 0].cpu().tolist()


def probe_gap(served: Sequence[float], expected: Sequence[float]) -> float:
    """Mean |served - expected| over the probe's tokens (inf when they are not the same length)."""
    if len(served) != len(expected) or not expected:
        return float("inf")
    return sum(abs(float(a) - float(b)) for a, b in zip(served, expected, strict=True)) / len(expected)


def proof_of(experiences: Sequence[Any]) -> dict[str, Any] | None:
    """The served-adapter proof a push carries (its first sample's `info[PROBE_KEY]`), if any."""
    info = getattr(experiences[0], "info", None) if experiences else None
    proof = info.get(PROBE_KEY) if isinstance(info, dict) else None
    return proof if isinstance(proof, dict) else None


class ProbeBook:
    """A trainer's probes of its recent versions, and the makers whose engines did not serve them."""

    def __init__(self, probe: Callable[[], list[float]], kept: int = KEPT_VERSIONS) -> None:
        self._probe = probe
        self._kept = kept
        self._probes: OrderedDict[int, list[float]] = OrderedDict()
        self.mismatches: dict[str, dict[str, Any]] = {}  # maker -> its latest mismatch and the pushes refused

    def record(self, version: int) -> None:
        """Probe the trainer's current weights as `version` (call with them in place)."""
        self._probes[version] = self._probe()
        self._probes.move_to_end(version)
        while len(self._probes) > self._kept:
            self._probes.popitem(last=False)

    def restart(self, version: int) -> None:
        """Forget every probe (the weights were replaced, e.g. a checkpoint loaded) and record `version`."""
        self._probes.clear()
        self.record(version)

    def check(self, maker: str, proof: dict[str, Any] | None, bound: float, samples: int) -> str | None:
        """Why a push of `samples` from `maker` carrying `proof` is refused (its engine serves another policy
        than the version it names), counted; None when it proves its version or carries no proof to check."""
        if proof is None:
            return None
        version, served = proof.get("version"), proof.get("log_probs")
        expected = self._probes.get(version) if isinstance(version, int) else None
        if expected is None or not isinstance(served, list):
            return None
        gap = probe_gap(served, expected)
        if gap <= bound:
            return None
        entry = self.mismatches.setdefault(maker, {"refused_pushes": 0, "refused_samples": 0})
        entry.update(version=version, gap=gap, bound=bound)
        entry["refused_pushes"] += 1
        entry["refused_samples"] += samples
        return (f"maker {maker!r} {SERVED_MISMATCH} v{version} it names: its engine's probe "
                f"log-probs are {gap:.3g} a token from the trainer's (honest bound {bound:.3g}); its samples "
                "are refused until it serves the trainer's weights (it registers again)")
