"""What a model is: actor (policy), critic, reward model, LoRA, and offline loaders."""

import os

# Nothing in this package may reach the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from detached_rl.core.sampling import SamplingConfig, process_logits  # noqa: E402
from detached_rl.models.actor import Actor, reference_sampling  # noqa: E402
from detached_rl.models.loaders import (  # noqa: E402
    load_causal_lm,
    load_model_dir,
    load_smollm2,
    minilm_dir,
    smollm2_dir,
    tiny_causal_lm,
    tiny_tokenizer,
)
from detached_rl.models.lora import (  # noqa: E402
    LoraSettings,
    apply_lora,
    count_parameters,
    load_lora_state_dict,
    lora_config_dict,
    lora_state_dict,
    merged_model,
)
from detached_rl.models.reward import FunctionReward, RetokenizingRewardModel, RewardScorer  # noqa: E402
from detached_rl.models.scalar_heads import Critic, RewardModel  # noqa: E402

__all__ = [
    "Actor",
    "Critic",
    "FunctionReward",
    "LoraSettings",
    "RetokenizingRewardModel",
    "RewardModel",
    "RewardScorer",
    "SamplingConfig",
    "apply_lora",
    "count_parameters",
    "load_causal_lm",
    "load_model_dir",
    "load_lora_state_dict",
    "load_smollm2",
    "lora_config_dict",
    "lora_state_dict",
    "merged_model",
    "minilm_dir",
    "process_logits",
    "reference_sampling",
    "smollm2_dir",
    "tiny_causal_lm",
    "tiny_tokenizer",
]
