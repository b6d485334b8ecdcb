"""Ray-free data and protocols: experience, replay buffer, weight-update protocol and
codec, checkpoints, prompts."""
