"""The driver of `detached-rl run`: it starts the actors, grades, trains, exports and always cleans up.

A maker whose process dies is restarted by Ray (`maker.max_restarts`): it re-attaches, takes the
newest weights and resumes its prompt cursor (saved under `maker_state/` when the cluster is this
machine alone). One that dies for good is reported and left out; the run ends with its evaluation,
summary and export as long as the trainer finishes and one maker is left.

On a cluster of several machines the actors may run on other hosts than this driver; the run directory
is this driver's all the same: metrics, TensorBoard, the plot, eval.json and summary.json are written here
from what the actors answer, and the adapter and merged model come back from the trainer as files
(`export_policy`) and are written here too. Only the makers' prompt cursors are not kept there.
`placed` (a joined cluster): the actors go where `trainer_group`/`maker` `resources` and `label_selector`
say; on the embedded cluster those are ignored (one node has none of them).
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from detached_rl.cli.held_out import HeldOutCurve, describe, split_evenly
from detached_rl.cli.reporting import MetricsRecorder, evaluation_row
from detached_rl.cli.run_report import progress_line, write_report
from detached_rl.cli.run_setup import (
    ActorDied,
    RunError,
    RunInterrupted,
    RunResult,
    default_run_name,
    run_gpus,
)
from detached_rl.config import RunConfig, dump_config
from detached_rl.core.text import first_line


def actor_death_reason(error: BaseException) -> str:
    """One line on why an actor died: what its constructor raised, else the first line of Ray's message."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return type(error).__name__
    if getattr(error, "actor_init_failed", False) and len(lines) > 1:  # Ray's message ends with the traceback
        return f"its constructor raised {lines[-1]}"
    return lines[0]


class JobRunner:
    """Drives one run on a connected Ray driver; `run()` returns a `RunResult` and always cleans up."""

    def __init__(self, config: RunConfig, output: Path, echo: Callable[[str], None] = print,
                 interrupted: threading.Event | None = None, placed: bool = False) -> None:
        from detached_rl.actors.launch import trainer_names_of

        self.config = config
        self.name = config.run.name or default_run_name(config)
        self.directory = output / self.name
        self.echo = echo
        self.trainer_name = f"{self.name}-trainer"  # the trainer, or the prefix of a trainer group's ranks
        self.trainer_names = trainer_names_of(config, self.trainer_name)
        self.maker_names = [f"{self.name}-maker-{i}" for i in range(config.run.makers)]
        self.handles: dict[str, Any] = {}
        self.dead_makers: dict[str, str] = {}  # maker name -> why it died for good (Ray will not restart it)
        self._status_calls: dict[str, Any] = {}  # maker name -> its `status` call not yet answered
        self.deadline = time.monotonic() + config.run.timeout_s
        self.job_started = time.monotonic()  # `run` sets it again as it starts
        self.interrupted = interrupted or threading.Event()  # set by Ctrl-C / SIGTERM (see `run_job`)
        self.placed = placed  # the config's resources and node labels choose the actors' nodes

    # ------------------------------------------------------------------ helpers
    def _remaining(self, cap: float | None = None) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RunError(f"the run exceeded run.timeout_s={self.config.run.timeout_s:.0f} s")
        return min(left, cap) if cap is not None else left

    def _get(self, refs: Any, what: str, cap: float | None = None) -> Any:
        """`ray.get` bounded by `cap` and the run's deadline, in one-second slices so Ctrl-C is noticed."""
        import ray

        deadline = time.monotonic() + self._remaining(cap)
        try:
            while True:
                if self.interrupted.is_set():
                    raise RunInterrupted(f"interrupted while waiting for {what}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RunError(f"{what} did not answer in time")
                try:
                    return ray.get(refs, timeout=min(1.0, left))
                except ray.exceptions.GetTimeoutError:
                    continue
        except ray.exceptions.RayActorError as error:
            raise ActorDied(f"{what}: an actor died ({actor_death_reason(error)})") from None
        except ray.exceptions.RayTaskError as error:
            cause = error.cause if getattr(error, "cause", None) is not None else error
            raise RunError(f"{what} failed: {type(cause).__name__}: {str(cause).splitlines()[0]}") from None

    # ------------------------------------------------------------------ phases
    def start_actors(self) -> None:
        """Create the named trainer (or trainer group) and makers, refusing names in use in the namespace."""
        import ray

        from detached_rl.actors.launch import (
            check_labels,
            check_placeable,
            launch_maker,
            launch_requests,
            launch_selectors,
            launch_trainers,
            maker_request,
            trainer_request,
        )
        from detached_rl.core.resources import UnplaceableError, describe

        config = self.config
        for name in [*self.trainer_names, *self.maker_names]:
            try:
                ray.get_actor(name, namespace=config.namespace)
            except ValueError:
                continue
            raise RunError(f"an actor named {name!r} already exists in namespace {config.namespace!r}; "
                           "choose another run.name")
        try:
            names = (self.trainer_name, self.maker_names)
            check_placeable(launch_requests(config, *names, detached=self.placed))
            if self.placed:
                check_labels(launch_selectors(config, *names))
        except UnplaceableError as error:
            raise RunError(str(error)) from None
        if config.model.policy == "smollm2":
            from detached_rl.models.loaders import smollm2_dir

            smollm2_dir()  # convert the packaged GGUF once here, not three times at once in the actors
        # Owned by this driver (not detached): they end with the run, also when it is killed.
        try:
            ranks = launch_trainers(config, self.trainer_name, timeout=self._remaining(900), detached=False,
                                    threads=config.run.trainer_threads, placed=self.placed)
        except (TimeoutError, ray.exceptions.RayTaskError) as error:  # a group not placed, or a rank failed
            cause = getattr(error, "cause", None) or error
            raise RunError(f"trainer group {self.trainer_name!r} did not start: {first_line(cause)}") \
                from None
        self.handles.update(zip(self.trainer_names, ranks, strict=True))
        state_dir = self.directory / "maker_state" if single_machine_cluster() else None
        for index, name in enumerate(self.maker_names):
            shard = (index, len(self.maker_names))
            self.handles[name] = launch_maker(config, name, self.trainer_names, shard,
                                              state_path=str(state_dir / name) if state_dir else None,
                                              detached=False, threads=config.run.maker_threads,
                                              nice=config.run.maker_nice, placed=self.placed)
        # Bounded by the run's deadline: actors the cluster cannot place yet never answer.
        trainer, maker = (describe(ask(config, self.placed)) for ask in (trainer_request, maker_request))
        placed = f"placing and loading the trainer ({trainer}) and the makers ({maker} each)"
        versions = self._get([self.handles[n].sync.remote() for n in self.maker_names], placed, cap=900)
        if any(v < 0 for v in versions):
            raise RunError(f"makers did not receive the trainer's weights (versions {versions})")

    def live_makers(self) -> list[str]:
        """The makers not known to have died for good."""
        return [name for name in self.maker_names if name not in self.dead_makers]

    def _dead_for_good(self, name: str) -> bool:
        """True when Ray's actor table shows maker `name` dead and not restarting; recorded and reported once.

        Through a Ray client, where the table cannot be read, a maker is never taken for dead.
        """
        from detached_rl.cli.inspection import actor_table

        if name in self.dead_makers:
            return True
        entry = actor_table(self.config.namespace).get(name)
        if entry is None or entry["state"] != "DEAD":
            return False
        reason = entry["death_cause"] or "no cause recorded"
        self.dead_makers[name] = f"{reason} (after {entry['restarts']} restarts)"
        self.echo(f"warning: maker {name!r} died and will not be restarted ({self.dead_makers[name]}); "
                  "the run goes on without it")
        return True

    def evaluate(self, label: str, recorder: MetricsRecorder | None = None) -> list[dict[str, Any]]:
        """Grade the held-out split, shared by the live makers; every answer comes from one policy version,
        recorded as an evaluation row at that version's step when `recorder` is given.

        A maker that dies during the evaluation is left out (once dead for good) and the split graded again.
        """
        problems = self.config.eval_problems()
        start = time.perf_counter()
        while True:
            names = self.live_makers()
            if not names:
                raise RunError(f"held-out evaluation ({label}): no maker left ({self._dead_summary()})")
            chunks = split_evenly(problems, len(names))
            try:
                calls = [self.handles[n].evaluate.remote(c) for n, c in zip(names, chunks, strict=False)]
                parts = self._get(calls, f"held-out evaluation ({label})")
                break
            except ActorDied:
                if not any(self._dead_for_good(n) for n in names):
                    self._wait_while_restarting(names, f"held-out evaluation ({label})")
        results = [r for part in parts for r in part]
        versions = sorted({r["policy_version"] for r in results})
        if len(versions) != 1:
            raise RunError(f"held-out evaluation ({label}) mixed policy versions {versions}")
        row = evaluation_row(results, time.perf_counter() - start, label,
                             job_seconds=time.monotonic() - self.job_started)
        if recorder is not None:
            recorder.record(versions[0], row)
        self.echo(f"held-out {label}: {describe(row)}")
        return results

    def train(self, recorder: MetricsRecorder) -> dict[str, Any]:
        """Start `fit` and the makers; poll progress into the bar and the recorder until the trainer ends."""
        from tqdm import tqdm

        config = self.config
        ranks = [self.handles[name] for name in self.trainer_names]
        trainer = ranks[0]  # rank 0's steps and metrics stand for the group's (the ranks step together)
        self._get([rank.start_fit.remote(config.run.steps) for rank in ranks], "starting the trainer", cap=60)
        maker_runs = [self.handles[n].run.remote() for n in self.maker_names]
        started = time.monotonic()
        recorded = 0
        bar = tqdm(total=config.run.steps, desc="training", unit="step", disable=not config.run.progress,
                   dynamic_ncols=True, file=sys.stderr)
        curve = HeldOutCurve(config.eval_problems(), config.run.eval_every, config.run.steps, self.echo,
                             self.job_started)
        try:
            while True:
                statuses = self._get([rank.status.remote() for rank in ranks], "trainer status", cap=60)
                status = self._group_status(statuses)
                new = status["steps"] - recorded
                rows = self._get(trainer.metrics.remote(last=new), "trainer metrics", cap=60) if new > 0 \
                    else []
                maker_status = self._maker_status()
                if not self.live_makers():
                    raise RunError(f"every maker died: {self._dead_summary()}")
                versions = {n: s.get("policy_version") for n, s in maker_status.items()}
                for row in rows:
                    step = int(row["policy_version"])
                    if step <= recorded:
                        continue
                    row = {**row, "time/elapsed": time.monotonic() - started, "maker_versions": versions}
                    recorder.record(step, row)
                    recorded = step
                    elapsed = time.monotonic() - started
                    bar.set_postfix_str(progress_line(row, status, elapsed, versions), refresh=False)
                    bar.update(step - bar.n)
                curve.poll(recorded, {n: self.handles[n] for n in self.live_makers()}, recorder)
                if status["state"] in ("done", "stopped", "failed"):
                    break
                for name, state in maker_status.items():  # a maker ending while the trainer trains has failed
                    if state.get("state") not in (None, "running") and state.get("last_error"):
                        raise RunError(f"maker {name!r} stopped: {state['last_error']}")
                if self.interrupted.wait(config.run.poll_interval_s):
                    raise RunInterrupted("interrupted during training")
        finally:
            bar.close()
        if status["state"] == "failed":
            raise RunError(f"the trainer failed: {status['last_error']}")
        curve.collect(recorder, timeout=self._remaining(300))
        # The trainer pushed the final weights and stopped the makers; their `run` calls return.
        maker_final = [self._maker_result(name, ref)
                       for name, ref in zip(self.maker_names, maker_runs, strict=True)]
        self._sync_laggards(maker_final, int(status["policy_version"]))
        return {"trainer": status, "trainers": statuses, "makers": maker_final,
                "seconds": time.monotonic() - started}

    @staticmethod
    def _group_status(statuses: list[dict[str, Any]]) -> dict[str, Any]:
        """The trainer's status from its ranks': rank 0's, failed if one failed, done once all are done."""
        status = {**statuses[0], "samples_trained": sum(s["samples_trained"] for s in statuses)}
        failed = [s for s in statuses if s["state"] == "failed"]
        if failed:
            status.update(state="failed", last_error=f"{failed[0]['name']}: {failed[0]['last_error']}")
        elif any(s["state"] not in ("done", "stopped", "failed") for s in statuses):
            status["state"] = "training"
        return status

    def _maker_result(self, name: str, run_ref: Any) -> dict[str, Any]:
        """What a maker's `run` returned; for a maker Ray restarted (its first `run` died with it), its
        status once the restarted process, which resumed by itself, has been stopped by the trainer; for one
        that died for good, a row saying so."""
        import ray

        if name in self.dead_makers:
            return self._dead_row(name)
        try:
            return self._get(run_ref, f"stopping maker {name!r}", cap=300)
        except ActorDied:
            pass
        except ray.exceptions.RayError as error:
            raise RunError(f"maker {name!r}: {error}") from None
        deadline = time.monotonic() + self._remaining(300)
        while time.monotonic() < deadline:
            if self._dead_for_good(name):
                return self._dead_row(name)
            with contextlib.suppress(ActorDied):  # a status call that met the process dying: ask again
                state = self._get(self.handles[name].status.remote(), f"maker {name!r} status", cap=60)
                if state.get("state") != "running":
                    return state
            if self.interrupted.wait(0.5):
                raise RunInterrupted("interrupted while stopping the makers")
        raise RunError(f"maker {name!r} did not stop after the trainer finished")

    def _dead_row(self, name: str) -> dict[str, Any]:
        return {"name": name, "state": "dead", "last_error": self.dead_makers[name]}

    def _dead_summary(self) -> str:
        return "; ".join(f"{name}: {reason}" for name, reason in self.dead_makers.items())

    def _wait_while_restarting(self, names: Sequence[str], what: str) -> None:
        """Wait until each maker in `names` answers `status` again or is dead for good (by the deadline)."""
        for name in names:
            while not self._dead_for_good(name):
                try:
                    self._get(self.handles[name].status.remote(), f"{what}: maker {name!r} status", cap=60)
                    break
                except ActorDied:
                    if self.interrupted.wait(0.5):
                        raise RunInterrupted(f"interrupted during {what}") from None

    def _sync_laggards(self, makers: list[dict[str, Any]], version: int) -> None:
        """Bring a live maker that does not serve the final weights (`version`) up to them, so the held-out
        evaluation after training answers with one policy version."""
        behind = [row["name"] for row in makers
                  if row.get("state") != "dead" and row.get("policy_version") != version and row.get("name")]
        if behind:
            self._get([self.handles[n].sync.remote() for n in behind], f"syncing makers {behind}", cap=300)

    def _maker_status(self) -> dict[str, dict[str, Any]]:
        """Each live maker's status; one that has not answered yet (slow, or being restarted by Ray) is shown
        without a version and asked again only once its pending call answers: it never holds up the others."""
        import ray

        for name in self.live_makers():
            if name not in self._status_calls:
                self._status_calls[name] = self.handles[name].status.remote()
        calls = dict(self._status_calls)
        ray.wait(list(calls.values()), num_returns=len(calls), timeout=1.0)
        out = {}
        for name, ref in calls.items():
            if not ray.wait([ref], timeout=0)[0]:
                out[name] = {"policy_version": None, "error": "no answer yet"}
                continue
            del self._status_calls[name]
            try:
                out[name] = ray.get(ref)
            except Exception as error:  # noqa: BLE001 - a failed status answer must not end the run
                if isinstance(error, ray.exceptions.RayActorError):
                    self._dead_for_good(name)
                out[name] = {"policy_version": None, "error": str(error)}
        return out

    def export(self) -> dict[str, str]:
        """Write the adapter and the merged model under the run directory."""
        from detached_rl.models.export import ADAPTER_DIR, MERGED_DIR, write_files

        rank_0 = self.handles[self.trainer_names[0]]
        files = self._get(rank_0.export_policy.remote(), "exporting the policy", cap=600)
        write_files(files, self.directory)
        out = {}
        for kind in (ADAPTER_DIR, MERGED_DIR):
            if (self.directory / kind).is_dir():
                out[kind] = str(self.directory / kind)
        return out

    def shutdown(self) -> None:
        """Kill every actor this run created (nothing worth draining by then) and a group's placement."""
        import ray

        from detached_rl.actors.group import remove_placement_group_of
        from detached_rl.actors.launch import uses_trainer_group

        for handle in self.handles.values():
            with contextlib.suppress(Exception):  # already gone
                ray.kill(handle, no_restart=True)
        if self.handles and uses_trainer_group(self.config):
            remove_placement_group_of(self.trainer_name)
        self.handles.clear()

    # ------------------------------------------------------------------ the whole job
    def run(self) -> RunResult:
        """Start, evaluate, train, evaluate, export, report; the actors are gone when it returns or raises."""
        import ray

        self.config = config = run_gpus(self.config, ray.cluster_resources().get("GPU", 0.0))
        start = self.job_started = time.monotonic()
        if self.directory.exists() and any(self.directory.iterdir()):
            raise RunError(f"the run directory {self.directory} exists and is not empty; choose another "
                           "run.name")
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "config.yaml").write_text(dump_config(config))
        variant = config.algorithm_config.algorithm if config.algorithm == "grpo" else "ppo"
        adapter = f"LoRA r={config.model.lora.r}" if config.model.lora else "full"
        self.echo(f"run {self.name!r}: {config.algorithm}/{variant} on {config.model.policy} ({adapter}), "
                  f"task {config.task.dataset or config.task.name}, {config.run.steps} steps, "
                  f"{self._trainer_note()} + {config.run.makers} makers "
                  f"({config.maker.backend} generation) "
                  f"in namespace {config.namespace!r}{self._gpu_note()}; writing {self.directory}")
        try:
            self.start_actors()
            actors = ", ".join([*self.trainer_names, *self.maker_names])
            self.echo(f"actors up in {time.monotonic() - start:.1f} s: {actors}")
            with MetricsRecorder(self.directory) as recorder:
                before = self.evaluate("before training", recorder)
                trained = self.train(recorder)
                after = self.evaluate("after training", recorder)
            # The evaluation is on disk before the export: a failed export cannot lose it.
            evaluations = json.dumps({"before": before, "after": after}, indent=1)
            (self.directory / "eval.json").write_text(evaluations)
            files = self.export()
        finally:
            self.shutdown()
        return write_report(self.name, self.directory, config, (before, after), trained, files,
                            time.monotonic() - start, self.dead_makers, self.echo)

    def _trainer_note(self) -> str:
        group = self.config.trainer_group
        return "1 trainer" if len(self.trainer_names) == 1 and group.strategy == "naive" else \
            f"a trainer group of {group.world_size} ranks ({group.strategy})"

    def _gpu_note(self) -> str:
        trainer, maker = self.config.trainer_group.num_gpus_per_rank, self.config.maker.num_gpus
        return f" (GPUs: trainer {trainer:g}, each maker {maker:g})" if trainer or maker else ""


def single_machine_cluster() -> bool:
    """True when the Ray cluster is one node, this driver's: its actors share this machine's file system."""
    import ray

    try:
        nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
        return nodes == [ray.get_runtime_context().get_node_id()]
    except Exception:  # noqa: BLE001 - a Ray client may not answer: take the cluster for several machines
        return False
