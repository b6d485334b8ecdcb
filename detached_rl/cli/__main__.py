"""`python -m detached_rl.cli`: the `detached-rl` console script."""

from detached_rl.cli.main import main

raise SystemExit(main())
