"""PPO with named detached actors on a local Ray cluster: 2 makers feed 1 trainer, from the shared YAML
config.

    .venv/bin/python examples/ppo_detached.py --steps 5 [--config examples/jobs/tiny.yaml] [--set
    ppo.kl_coef=0.05]

The same `RunConfig` the CLI reads: makers and the trainer find each other by name in its
namespace; the trainer pushes chunked full-weight updates back after every step and stops
the makers at the end.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ray

from detached_rl import DetachedPPOTrainer, ExperienceMakerHolder
from detached_rl.cli import jobs
from detached_rl.config import load_config, maker_factory, trainer_factory

DEFAULT_CONFIG = Path(__file__).parent / "jobs" / "tiny.yaml"


def main() -> None:
    """Run the example."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--address", default=None, help="join a running cluster (default: start a local one)")
    args = parser.parse_args()
    config = load_config(args.config, args.set)
    if args.address:
        jobs.connect(args.address, config.namespace)
    else:
        jobs.init_local_ray(config.namespace, include_dashboard=False, log_to_driver=False)  # on 127.0.0.1
    trainer = DetachedPPOTrainer.options(name="trainer_0").remote(
        "trainer_0", trainer_factory(config), config.trainer, config.algorithm_config, config.namespace,
        sampling=config.sampling,
    )
    makers = [
        ExperienceMakerHolder.options(name=f"maker_{i}").remote(
            f"maker_{i}", ["trainer_0"], maker_factory(config), config.prompts(), config.maker_config,
            config.namespace
        )
        for i in range(2)
    ]
    runs = [maker.run.remote() for maker in makers]
    summary = ray.get(trainer.fit.remote(args.steps), timeout=600)
    for status in ray.get(runs, timeout=600):
        print(f"{status['name']}: version {status['policy_version']}, {status['samples_made']} samples, "
              f"{status['tokens_per_s']:.0f} tokens/s, pushes {status['push']['acked_pushes']} acked")
    for metrics in ray.get(trainer.metrics.remote()):
        print(f"step {metrics['policy_version']:.0f}: reward {metrics['reward/mean']:.3f} "
              f"policy loss {metrics['loss/policy']:+.4f} value loss {metrics['loss/value']:.4f} "
              f"sync {metrics['weight_sync/bytes'] / 2**20:.2f} MiB in {metrics['weight_sync/push_s']:.3f} s")
    print(f"trainer: {summary['steps']} steps in {summary['seconds']:.1f} s, buffer "
          f"{summary['buffer']['size']} left, accounting ok: {summary['buffer']['accounting_ok']}")
    ray.shutdown()


if __name__ == "__main__":
    main()
