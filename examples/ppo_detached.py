"""PPO with named detached actors on a local Ray cluster: 2 makers feed 1 trainer (tiny random models).

    .venv/bin/python examples/ppo_detached.py --steps 5

Makers and the trainer find each other by name in the namespace; the trainer pushes chunked
full-weight updates back after every step and stops the makers at the end.
"""

from __future__ import annotations

import argparse
import os

import ray

from detached_rl import DetachedPPOTrainer, ExperienceMakerHolder
from detached_rl.maker import MakerConfig, MakerModels
from detached_rl.models import Actor, Critic, FunctionReward, SamplingConfig, tiny_causal_lm
from detached_rl.models.scalar_heads import backbone_of
from detached_rl.ppo import PPOConfig
from detached_rl.prompts import CyclingPrompts
from detached_rl.rewards import numeric_answer_reward
from detached_rl.tasks import addition_problems
from detached_rl.trainer import TrainerConfig

SAMPLING = SamplingConfig(max_new_tokens=8)


def trainer_models() -> tuple[Actor, Critic]:
    """Policy and critic the trainer optimises."""
    policy, tokenizer = tiny_causal_lm("llama", seed=0)
    return Actor(policy, tokenizer), Critic(backbone_of(tiny_causal_lm("llama", seed=1)[0]))


def maker_models() -> MakerModels:
    """Policy, critic, reference and reward on a maker (weights come from the trainer)."""
    actor, critic = trainer_models()
    reference = Actor(*tiny_causal_lm("llama", seed=0))
    return MakerModels(actor=actor, critic=critic, reference=reference,
                       reward=FunctionReward(numeric_answer_reward, actor.tokenizer))


def main() -> None:
    """Run the example."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--address", default=None, help="join a running cluster (default: start a local one)")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=args.address, namespace="detached_rl", include_dashboard=False, log_to_driver=False)
    trainer = DetachedPPOTrainer.options(name="trainer_0").remote(
        "trainer_0", trainer_models, TrainerConfig(train_batch_size=8, max_staleness=2), PPOConfig(sampling=SAMPLING, kl_coef=0.01)
    )
    prompts = CyclingPrompts(addition_problems(64))
    makers = [
        ExperienceMakerHolder.options(name=f"maker_{i}").remote(
            f"maker_{i}", ["trainer_0"], maker_models, prompts, MakerConfig(experience_batch_size=4, sampling=SAMPLING)
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
    print(f"trainer: {summary['steps']} steps in {summary['seconds']:.1f} s, buffer {summary['buffer']['size']} left, "
          f"accounting ok: {summary['buffer']['accounting_ok']}")
    ray.shutdown()


if __name__ == "__main__":
    main()
