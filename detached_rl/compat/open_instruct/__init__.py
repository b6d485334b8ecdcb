"""Coming from open-instruct: its GRPO learner actor and driver step, thin over `DetachedGRPOTrainer`.

A migration path, not the primary API (see docs/coming-from-open-instruct.md). What open-instruct's
`grpo_fast.py` names, this module names alike:

* `PolicyTrainerRayProcess`: a learner rank with open-instruct's constructor and methods
  (`from_pretrained`, `setup_model_update_group`, `step`, `broadcast_to_vllm`, `update_ref_policy`,
  `save_model`, `save_checkpoint_state`). It *is* a GRPO trainer actor (`GRPOTrainerShell`): its
  replay buffer takes the makers' pushes, and `step()` is one `TrainerCore.train_step` on them.
  "vLLM engines" are this project's makers (`ExperienceMakerHolder`, any generation backend).
* `ModelGroup`: the ranks, named `<name>_<rank>` so that makers find them.
* `one_training_step`: the driver's step: `step` on every rank, the Polyak reference update, the
  periodic `save_model`, and the ranks' metrics aggregated under open-instruct's names
  (token-weighted where open-instruct weights by tokens), with tokens/s and the learner's MFU.
* `ExperimentConfig`, `ModelConfig`, `StreamingDataLoaderConfig`, `VLLMConfig`: the fields of
  open-instruct's configs this layer reads, with open-instruct's defaults; their own config objects
  work too (fields are read by name, missing ones take these defaults).
"""

from __future__ import annotations

from detached_rl.compat.open_instruct.config import (
    ADVANTAGE_NORMALIZATIONS,
    DEEPSPEED_STAGES,
    KL_ESTIMATORS,
    ExperimentConfig,
    ModelConfig,
    StreamingDataLoaderConfig,
    VLLMConfig,
    grpo_config_from,
    load_policy,
    maker_config_from,
    rank_batch_size,
    sampling_from,
    strategy_from,
    trainer_config_from,
)
from detached_rl.compat.open_instruct.driver import (
    LEARNER_PEAK_FLOPS,
    TOKEN_WEIGHTED_METRICS,
    average_rank_metrics,
    compute_token_weights,
    learner_mfu,
    maybe_save_checkpoint,
    one_training_step,
    training_step_metrics,
)
from detached_rl.compat.open_instruct.group import ModelGroup, bundle_index
from detached_rl.compat.open_instruct.keys import (
    NUM_PARAMS,
    PEAK_FLOPS,
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    SEQUENCE_TOKENS,
    TOKEN_COUNT,
)
from detached_rl.compat.open_instruct.learner import (
    ObservedGRPOLearner,
    SequenceRatioStats,
    batch_lengths,
    matmul_dtype,
    open_instruct_step_metrics,
    polyak_update_ref_policy,
)
from detached_rl.compat.open_instruct.process import (
    CHECKPOINT_COMPLETE_MARKER,
    PolicyTrainerProcess,
    PolicyTrainerRayProcess,
    StepsDone,
)

__all__ = [
    "ADVANTAGE_NORMALIZATIONS", "CHECKPOINT_COMPLETE_MARKER", "DEEPSPEED_STAGES", "ExperimentConfig",
    "KL_ESTIMATORS", "LEARNER_PEAK_FLOPS", "ModelConfig", "ModelGroup", "NUM_PARAMS", "ObservedGRPOLearner",
    "PEAK_FLOPS", "PROMPT_LENGTHS", "PolicyTrainerProcess", "PolicyTrainerRayProcess", "RESPONSE_LENGTHS",
    "SEQUENCE_TOKENS", "SequenceRatioStats", "StepsDone", "StreamingDataLoaderConfig", "TOKEN_COUNT",
    "TOKEN_WEIGHTED_METRICS", "VLLMConfig", "average_rank_metrics", "batch_lengths", "bundle_index",
    "compute_token_weights", "grpo_config_from", "learner_mfu", "load_policy", "maker_config_from",
    "matmul_dtype", "maybe_save_checkpoint", "one_training_step", "open_instruct_step_metrics",
    "polyak_update_ref_policy", "rank_batch_size", "sampling_from", "strategy_from", "trainer_config_from",
    "training_step_metrics",
]
