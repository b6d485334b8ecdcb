"""Chaos: a tiny-model GRPO fit runs for a few minutes while a random maker is killed (SIGKILL) every ~20 s.

    .venv/bin/python benchmarks/chaos.py --duration 180 --kill-every 20

One local Ray cluster bound to 127.0.0.1; one trainer and `--makers` makers (Ray restarts a
killed maker: `max_restarts=-1`; it resumes its prompt cursor from its state file, re-attaches
by name and pulls the trainer's current weights before it generates). The script polls every
actor's status every 0.2 s and prints, at the end:

* steps completed, kills and restarts;
* samples **produced** (handed by makers to their pushers; a killed maker's count is read just
  before the kill), **received** and **trained** by the trainer, left **in the buffer**, and
  **dropped with a reason** (trainer: stale, evicted; makers: rejected, failed, stopped);
* samples that were **in flight when a maker was killed** (pushed, not yet acknowledged): how
  many arrived anyway and how many were lost with that reason;
* **lost without a reason** (goal 0) and **double counted** (goal 0), and whether the
  trainer's accounting identity `received = trained + in_buffer + dropped` held;
* the **longest training stall** (longest gap between two training steps) and the median gap.

JSON goes to `benchmarks/results/chaos.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from detached_rl.cli.jobs import init_local_ray
from detached_rl.config import load_config, maker_factory, trainer_factory

CONFIG = [
    "algorithm=grpo", "model.policy=tiny", "task.name=addition", "task.train_size=256",
    "sampling.max_new_tokens=8", "maker.experience_batch_size=2", "maker.group_size=4",
    "maker.max_pushes_in_flight=1", "maker.wait_for_ack=true", "maker.max_restarts=-1",
    "trainer.train_batch_size=8", "trainer.buffer_max_samples=32", "trainer.max_staleness=4",
    "trainer.batch_timeout_s=120", "trainer.stop_makers_at_end=false",
    # The job measured in docs/operations.md, where the defaults (the main job's) differ.
    "model.lora=null", "sampling.temperature=1.0", "maker.backend=hf", "trainer.weight_sync=full",
    "trainer.overlap_weight_push=false", "grpo.actor_optimizer.lr=1e-6", "grpo.kl_coef=0",
    "grpo.loss_agg=null", "grpo.micro_batch_size=8", "grpo.autocast_dtype=null",
]
PUSH_OUTCOMES = ("accepted", "duplicates", "dropped_stale_by_trainer")


def unacknowledged(push: dict[str, Any]) -> int:
    """Samples handed to the pusher that have no outcome yet (in flight or waiting for a retry)."""
    settled = sum(push[key] for key in PUSH_OUTCOMES) + sum(push["dropped"].values())
    return push["samples_pushed"] - settled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of training (default 180)")
    parser.add_argument("--kill-every", type=float, default=20.0,
                        help="mean seconds between kills (default 20)")
    parser.add_argument("--makers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "chaos.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    config = load_config(None, CONFIG)
    init_local_ray("chaos", num_cpus=args.makers + 2, include_dashboard=False, log_to_driver=False,
                   runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    import ray

    from detached_rl.actors.maker import ExperienceMakerHolder
    from detached_rl.actors.trainer import DetachedGRPOTrainer

    state_dir = Path(tempfile.mkdtemp(prefix="chaos-"))
    trainer = DetachedGRPOTrainer.options(name="chaos_trainer").remote(
        "chaos_trainer", trainer_factory(config), config.trainer, config.algorithm_config, "chaos",
        sampling=config.sampling)
    names = [f"chaos_maker_{i}" for i in range(args.makers)]
    makers = {
        name: ExperienceMakerHolder.options(name=name, max_restarts=-1).remote(
            name, ["chaos_trainer"], maker_factory(config), config.prompts(i, args.makers),
            config.maker_config, "chaos",
            state_path=str(state_dir / name))
        for i, name in enumerate(names)
    }
    ray.get([m.start.remote() for m in makers.values()], timeout=300)
    ray.get(trainer.start_fit.remote(10**9), timeout=300)

    last_seen: dict[tuple[str, int], dict[str, Any]] = {}  # (maker, pid) -> last status of that process
    killed: list[dict[str, Any]] = []
    step_times: list[float] = []
    last_version = -1
    start = time.monotonic()
    next_kill = start + rng.uniform(0.75, 1.25) * args.kill_every
    while time.monotonic() - start < args.duration:
        version = ray.get(trainer.policy_version.remote(), timeout=30)
        if version != last_version:
            step_times.append(time.monotonic())
            last_version = version
        for name, handle in makers.items():
            try:
                status = ray.get(handle.status.remote(), timeout=2)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue  # restarting
            if status.get("push"):
                last_seen[(name, status["pid"])] = status
        if time.monotonic() >= next_kill:
            victim = rng.choice(names)
            try:
                status = ray.get(makers[victim].status.remote(), timeout=5)
                os.kill(status["pid"], signal.SIGKILL)
                if status.get("push"):
                    last_seen[(victim, status["pid"])] = status
                killed.append({"maker": victim, "pid": status["pid"],
                               "at_s": round(time.monotonic() - start, 1),
                               "unacknowledged": unacknowledged(status["push"]) if status.get("push") else 0})
                print(f"[{time.monotonic() - start:6.1f} s] killed {victim} (pid {status['pid']}) at "
                      f"step {version}",
                      flush=True)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # still restarting from the previous kill: try the next time
            next_kill = time.monotonic() + rng.uniform(0.75, 1.25) * args.kill_every
        time.sleep(0.2)

    ray.get(trainer.stop.remote(), timeout=30)
    for handle in makers.values():
        ray.get(handle.stop.remote(), timeout=120)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        statuses = {name: ray.get(h.status.remote(), timeout=30) for name, h in makers.items()}
        trainer_status = ray.get(trainer.status.remote(), timeout=30)
        if trainer_status["state"] != "training" and all(s["state"] != "running" for s in statuses.values()):
            break
        time.sleep(0.5)
    for name, status in statuses.items():
        last_seen[(name, status["pid"])] = status
    buffer = ray.get(trainer.buffer_stats.remote(), timeout=30)
    restarts = sum(1 for (name, pid), s in last_seen.items() if s.get("restarted"))

    pushes = [s["push"] for s in last_seen.values()]
    produced = sum(p["samples_pushed"] for p in pushes)
    maker_dropped = {reason: sum(p["dropped"].get(reason, 0) for p in pushes)
                     for reason in ("rejected", "failed",
                                                                                            "stopped")}
    in_flight_at_kill = sum(k["unacknowledged"] for k in killed)
    expected_without_kills = produced - sum(maker_dropped.values()) - in_flight_at_kill
    arrived_anyway = buffer["received"] - expected_without_kills
    lost_mid_push = min(max(in_flight_at_kill - arrived_anyway, 0), in_flight_at_kill)
    lost_unexplained = max(produced - buffer["received"] - sum(maker_dropped.values()) - lost_mid_push, 0)
    double_counted = max(buffer["received"] - produced, 0)
    gaps = [b - a for a, b in zip(step_times, step_times[1:], strict=False)]
    report = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "duration_s": args.duration, "kill_every_s": args.kill_every, "makers": args.makers,
        "steps_completed": trainer_status["policy_version"], "kills": len(killed), "restarts": restarts,
        "samples": {
            "produced": produced, "received_by_trainer": buffer["received"], "trained": buffer["sampled"],
            "in_buffer": buffer["size"], "dropped_at_trainer": buffer["dropped"],
            "dropped_at_makers": maker_dropped,
            "duplicates_refused": buffer["duplicates"],
            "in_flight_at_kill": in_flight_at_kill, "in_flight_arrived": in_flight_at_kill - lost_mid_push,
            "lost_with_reason_maker_killed_mid_push": lost_mid_push,
            "lost_without_reason": lost_unexplained, "double_counted": double_counted,
        },
        "trainer_accounting_ok": buffer["accounting_ok"],
        "longest_stall_s": round(max(gaps), 2) if gaps else None,
        "median_step_s": round(statistics.median(gaps), 3) if gaps else None,
        "kill_log": killed,
        "trainer_last_error": trainer_status["last_error"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    samples = report["samples"]
    rows = [
        ("steps completed", report["steps_completed"]),
        ("makers killed / restarted", f"{len(killed)} / {restarts}"),
        ("samples produced", produced), ("received by the trainer", samples["received_by_trainer"]),
        ("trained", samples["trained"]), ("in the buffer at the end", samples["in_buffer"]),
        ("dropped at the trainer", ", ".join(f"{k} {v}" for k, v in buffer["dropped"].items())),
        ("dropped at makers", ", ".join(f"{k} {v}" for k, v in maker_dropped.items())),
        ("duplicates refused (retries)", samples["duplicates_refused"]),
        ("in flight when killed: arrived / lost (reason: maker killed mid-push)",
         f"{samples['in_flight_arrived']} / {lost_mid_push}"),
        ("lost without a reason (goal 0)", lost_unexplained), ("double counted (goal 0)", double_counted),
        ("trainer accounting identity holds", buffer["accounting_ok"]),
        ("longest training stall",
         f"{report['longest_stall_s']} s (median step {report['median_step_s']} s)"),
    ]
    width = max(len(label) for label, _ in rows)
    print(f"\nchaos run: {args.duration:.0f} s, {args.makers} makers, a kill every ~{args.kill_every:.0f} s, "
          f"{os.cpu_count()} CPUs")
    for label, value in rows:
        print(f"  {label.ljust(width)}  {value}")
    ray.kill(trainer)
    for handle in makers.values():
        ray.kill(handle, no_restart=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
