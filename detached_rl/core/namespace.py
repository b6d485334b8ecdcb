"""The Ray namespace detached-rl's actors live in unless the user names another."""

DEFAULT_NAMESPACE = "detached_rl"
