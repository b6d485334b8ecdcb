"""The `detached-rl` console script and the jobs it starts: run, ppo-on-ray, status, inspect, stop."""
