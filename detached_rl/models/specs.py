"""Whether a model spec names something loadable here, answered without importing torch (refused quickly)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from detached_rl.models.hub import hub_problem, is_hub_id


def model_spec_problem(spec: str, revision: str | None = None) -> str | None:
    """Why `spec` names no loadable model on this machine, or None when it does (a Hub id at `revision`:
    cached, or on a Hub this machine reaches)."""
    if spec == "smollm2" or spec == "tiny":
        return None
    if spec.startswith("tiny-"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model_type = spec.removeprefix("tiny-") or "llama"
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return (f"{spec!r}: {model_type!r} is not a causal-LM model_type of transformers "
                    "(e.g. tiny-llama, tiny-qwen2, tiny-gpt2)")
        return None
    path = Path(spec)
    if not path.exists() and is_hub_id(spec):
        return hub_problem(spec, revision)
    if not path.is_dir():
        return (f"{spec!r} is neither 'smollm2', 'tiny[-<model_type>]', an existing model directory nor a "
                "Hugging Face Hub id ('org/name')")
    if not (path / "config.json").is_file():
        return f"{spec!r} is a directory without config.json, not a Hugging Face model directory"
    return None


# `model.reward_head`: a reward model's trained head (a sequence classifier's), or a new random one.
REWARD_HEADS = ("trained", "fresh")

# The package each attention kernel needs beyond torch and transformers.
ATTENTION_PACKAGES = {"flash_attention_2": "flash_attn"}


def attention_problem(kernel: str) -> str | None:
    """Why the attention kernel `kernel` (`model.attn_implementation`) cannot run here, or None."""
    package = ATTENTION_PACKAGES.get(kernel)
    if package is not None and importlib.util.find_spec(package) is None:
        return (f"{kernel!r} needs the {package.replace('_', '-')} package, which is not installed here "
                f"(`pip install {package.replace('_', '-')}`, on a CUDA machine); 'sdpa' needs nothing")
    return None
