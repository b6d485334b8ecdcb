"""What a model is: actor (policy), critic, reward model, LoRA, and the loaders (Hub ids, directories,
shortcuts)."""

from detached_rl.core.lazy import lazy_exports

# Public name -> its module, imported on first use (importing the package loads no torch).
_LAZY = {
    "SamplingConfig": "detached_rl.core.sampling",
    "process_logits": "detached_rl.core.sampling",
    "Actor": "detached_rl.models.actor",
    "reference_sampling": "detached_rl.models.actor",
    "load_causal_lm": "detached_rl.models.loaders",
    "load_hub_model": "detached_rl.models.loaders",
    "load_model_dir": "detached_rl.models.loaders",
    "load_smollm2": "detached_rl.models.loaders",
    "minilm_dir": "detached_rl.models.loaders",
    "smollm2_dir": "detached_rl.models.loaders",
    "tiny_causal_lm": "detached_rl.models.loaders",
    "tiny_tokenizer": "detached_rl.models.loaders",
    "LoraSettings": "detached_rl.models.lora_settings",
    "apply_lora": "detached_rl.models.lora",
    "count_parameters": "detached_rl.models.lora",
    "load_lora_state_dict": "detached_rl.models.lora",
    "lora_config_dict": "detached_rl.models.lora",
    "lora_state_dict": "detached_rl.models.lora",
    "merged_model": "detached_rl.models.lora",
    "FunctionReward": "detached_rl.models.reward",
    "RetokenizingRewardModel": "detached_rl.models.reward",
    "RewardScorer": "detached_rl.models.reward",
    "Critic": "detached_rl.models.scalar_heads",
    "RewardModel": "detached_rl.models.scalar_heads",
}
__getattr__ = lazy_exports(__name__, _LAZY)

__all__ = sorted(_LAZY)
