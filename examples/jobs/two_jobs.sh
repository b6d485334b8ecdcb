#!/usr/bin/env bash
# Two-job walkthrough: a cluster bound to loopback, a trainer job, a maker job, an inspection
# through the Ray client, then a graceful stop. Run from the repository root after `make install`.
set -euo pipefail
export PATH="$PWD/.venv/bin:$PATH"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0   # keep Ray on 127.0.0.1 instead of the machine's address
export RAY_AUTH_MODE=disabled                # no token auth from a stray ~/.ray/auth_token
CONFIG=examples/jobs/tiny.yaml

ray start --head --node-ip-address=127.0.0.1 --port=6379 --ray-client-server-port=10001 \
    --dashboard-host=127.0.0.1 --disable-usage-stats

# 1. The trainer, as its own job (it outlives this command).
detached-rl trainer --config "$CONFIG" --name trainer_0 --steps 200 --address 127.0.0.1:6379
# 2. A maker, from another process; it attaches to trainer_0 by name (either may start first).
detached-rl maker --config "$CONFIG" --name maker_0 --trainers trainer_0 --address 127.0.0.1:6379
# The same through Ray Jobs instead:
#   ray job submit --address http://127.0.0.1:8265 -- "$PWD/.venv/bin/detached-rl" maker \
#       --config "$PWD/$CONFIG" --name maker_1 --trainers trainer_0 --address 127.0.0.1:6379

sleep 15
# 3. Look inside the running trainer's buffer from a Ray client.
detached-rl status --address ray://127.0.0.1:10001
detached-rl inspect trainer_0 --last 3 --address ray://127.0.0.1:10001
detached-rl export trainer_0 runs/buffer.jsonl --address 127.0.0.1:6379

# 4. Drain and stop every actor of the namespace, then the cluster.
detached-rl stop --address 127.0.0.1:6379
ray stop
