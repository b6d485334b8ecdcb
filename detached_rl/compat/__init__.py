"""Migration paths from the systems detached-rl replaces: their class names, keyword signatures and metric
names, thin over this project's own actors (whose names stay the primary, documented API).

* `detached_rl.compat.coati`: ColossalChat's `coati/ray` — `DetachedPPOTrainer`, `ExperienceMakerHolder`
  (docs/coming-from-coati.md).
* `detached_rl.compat.open_instruct`: open-instruct's `PolicyTrainerRayProcess` and `one_training_step`.
* `detached_rl.compat.colossalchat`: ColossalChat's distributed GRPO (`launch_distributed`, its data format).

Nothing is imported here: each module imports Ray and its models only when a migration uses it.
"""
