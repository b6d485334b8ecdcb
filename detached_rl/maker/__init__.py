"""The maker side, Ray-free: `ExperienceMaker` (generate, score, tag), `MakerLoop` and the pusher."""
