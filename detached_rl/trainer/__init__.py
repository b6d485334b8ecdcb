"""The trainer side, Ray-free: `TrainerCore` (buffer, learner, weight updates, checkpoints) and its config."""
