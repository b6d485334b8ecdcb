"""The maker side, Ray-free: `ExperienceMaker` (generate, score, tag), the pusher, and scoring services."""
