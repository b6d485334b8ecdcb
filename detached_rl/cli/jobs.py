"""What the CLI's cluster commands do: start named actors (trainer, maker, scorer groups) and stop them.

Plain functions over a connected Ray driver (local, `ray start --head` cluster, or a Ray client at
`ray://host:port`); the CLI adds argument parsing and one-line errors. Joining a cluster is in
`cli/cluster.py`, looking at its actors in `cli/inspection.py`; their names are kept here too.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from detached_rl.cli.cluster import (
    CONNECT_TIMEOUT_VARIABLE,
    DEFAULT_CONNECT_TIMEOUT,
    LOCAL_CLUSTER_VARIABLE,
    LOCAL_HOST,
    LOOPBACK_HOSTS,
    JobError,
    check_reachable,
    connect,
    connect_timeout,
    first_line,
    init_local_ray,
)
from detached_rl.cli.inspection import (
    DEFAULT_STATUS_TIMEOUT,
    ROLES,
    actor_names,
    actor_table,
    all_status,
    export,
    format_inspection,
    format_status,
    handle_of,
    inspect,
    status_of,
)
from detached_rl.cli.placing import (
    PLACEMENT_TIMEOUT_VARIABLE,
    placement_timeout,
    take_over_restarting,
    wait_placed,
)

if TYPE_CHECKING:
    from detached_rl.config import RunConfig

__all__ = [
    "CONNECT_TIMEOUT_VARIABLE", "DEFAULT_CONNECT_TIMEOUT", "DEFAULT_START_TIMEOUT", "DEFAULT_STATUS_TIMEOUT",
    "LOCAL_CLUSTER_VARIABLE", "LOCAL_HOST", "LOOPBACK_HOSTS", "PLACEMENT_TIMEOUT_VARIABLE", "ROLES",
    "JobError", "actor_names", "actor_table", "all_status", "check_placeable", "check_reachable", "connect",
    "connect_timeout", "export", "first_line", "format_inspection", "format_status", "handle_of",
    "init_local_ray", "inspect", "placement_timeout", "start_maker", "start_scorers", "start_trainer",
    "status_of", "stop",
]

DEFAULT_START_TIMEOUT = 600.0


def check_placeable(requests: dict[str, dict[str, float]]) -> None:
    """Refuse at once, as a JobError naming the role and the resources, what the cluster can never place."""
    from detached_rl.actors.launch import check_placeable as check
    from detached_rl.core.resources import UnplaceableError

    try:
        check(requests)
    except UnplaceableError as error:
        raise JobError(str(error)) from None


def _started_in_time(refs: list[Any], what: str, request: dict[str, float], timeout: float) -> list[Any]:
    """The answers of the first calls to new actors; if they do not come within `timeout`, a JobError naming
    `what` and the resources it asked for (an actor Ray cannot place yet never answers)."""
    import ray

    from detached_rl.actors.transport import get_all
    from detached_rl.core.resources import describe

    try:
        return get_all(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        free = ray.available_resources()
        left = describe({k: free.get(k, 0.0) for k in sorted({"CPU", "GPU", *request})})
        raise JobError(f"{what} (asking for {describe(request)}) did not start within {timeout:.0f} s; the "
                       f"cluster has {left} free") from None


def start_trainer(config: RunConfig, name: str, total_steps: int, update_steps: int,
                  timeout: float = DEFAULT_START_TIMEOUT, **checkpointing: Any) -> list[str]:
    """Create a detached, named trainer (or trainer group), start `fit` in the background; the rank names.

    PPO or GRPO by `config.algorithm`. With `config.trainer_group` asking for more than one rank
    or a distributed strategy, the ranks are `<name>_0` ... in one placement group. A request the
    cluster can never place is refused at once; placing and starting take at most `timeout` s.
    """
    import ray

    from detached_rl.actors.launch import launch_requests, launch_trainers, trainer_names_of, trainer_request

    names = trainer_names_of(config, name)
    for rank_name in names:
        _refuse_existing(rank_name, config.namespace)
    check_placeable(launch_requests(config, trainer=name))
    deadline = time.monotonic() + timeout
    try:
        handles = launch_trainers(config, name, timeout=timeout)
    except ray.exceptions.RayTaskError as error:  # a group rank's own error (e.g. a strategy that needs CUDA)
        raise JobError(f"trainer group {name!r} did not start: {first_line(error.cause)}") from None
    except TimeoutError as error:  # a group that could not be placed
        raise JobError(str(error)) from None
    try:
        if len(names) == 1:  # a group's ranks were placed with their placement group
            wait_placed(f"trainer {name!r}", name, config.namespace, trainer_request(config),
                        min(placement_timeout(), timeout))
        _started_in_time([h.start_fit.remote(total_steps, update_steps, **checkpointing) for h in handles],
                         f"trainer {name!r}", trainer_request(config), max(1.0, deadline - time.monotonic()))
    except JobError:
        stop(names, config.namespace, force=True, timeout=10)  # detached: it would wait for resources forever
        raise
    return names


def start_maker(config: RunConfig, name: str, trainers: list[str], num_batches: int | None,
                state_dir: str | None = None, shard: tuple[int, int] = (0, 1),
                timeout: float = DEFAULT_START_TIMEOUT) -> Any:
    """Create a detached, named experience maker feeding `trainers` and start it in the background.

    With `state_dir`, the maker saves its prompt cursor and counters to `<state_dir>/<name>` after
    every pushed batch and resumes from there when it (or a successor under its name) starts.
    `shard` = (index, count): the maker takes that share of the prompts. A request the cluster can
    never place is refused at once; one not placed within `placement_timeout()` s fails saying why (e.g. a
    restarting maker waits for the same resources); starting takes at most `timeout` s in all (then the maker
    is removed). A maker Ray is restarting under `name` (lost with its node) is removed first: this job
    serves under its name; a live one is refused.
    """
    import ray

    from detached_rl.actors.launch import launch_maker, launch_requests, maker_request

    if not trainers:
        raise JobError("a maker needs --trainers (comma-separated trainer names)")
    check_placeable(launch_requests(config, makers=[name]))
    wait = min(placement_timeout(), timeout)
    if take_over_restarting(name, config.namespace):
        logging.getLogger(__name__).warning(
            "maker %r was restarting (its process or node was lost): this job takes its name over", name)
    _refuse_existing(name, config.namespace)
    deadline = time.monotonic() + timeout
    handle = launch_maker(config, name, trainers, shard,
                          state_path=str(Path(state_dir).resolve() / name) if state_dir else None)
    try:
        wait_placed(f"maker {name!r}", name, config.namespace, maker_request(config), wait)
        _started_in_time([handle.start.remote(num_batches)], f"maker {name!r}", maker_request(config),
                         max(1.0, deadline - time.monotonic()))
    except JobError:
        ray.kill(handle, no_restart=True)  # detached: it would otherwise wait for resources, and run, forever
        raise
    return handle


def start_scorers(config: RunConfig, trainers: list[str], timeout: float | None = None) -> list[str]:
    """Start the scorer groups the makers' config names (`maker.<role>_scorer`); returns the worker names.

    Each group is shaped and placed by `config.scorers.<role>`; a critic group takes its weights
    from `trainers`. A group whose first worker already runs is left as it is (shared by makers).
    Groups the cluster can never place are refused at once, before any starts; each group's
    placement waits at most `timeout` s (and its `timeout_s`).
    """
    import ray

    from detached_rl.actors.launch import launch_requests, launch_scorer_group
    from detached_rl.actors.scorer import scorer_names

    started: list[str] = []
    missing = []
    for role, prefix in config.maker.scorers.items():
        group = getattr(config.scorers, role)
        try:
            ray.get_actor(scorer_names(prefix, group.num_workers)[0], namespace=config.namespace)
        except ValueError:
            missing.append(role)
    check_placeable(launch_requests(config, scorer_roles=missing))
    deadline = None if timeout is None else time.monotonic() + timeout
    for role in missing:
        prefix = config.maker.scorers[role]
        names = scorer_names(prefix, getattr(config.scorers, role).num_workers)
        if role == "critic" and not trainers:
            raise JobError("a critic scorer group needs the trainer names (its weights come from them)")
        left = None if deadline is None else max(1.0, deadline - time.monotonic())
        try:
            launch_scorer_group(config, role, trainers, timeout=left)
        except ray.exceptions.RayTaskError as error:
            raise JobError(f"scorer group {prefix!r} ({role}) did not start: {first_line(error.cause)}") \
                from None
        except TimeoutError as error:
            raise JobError(str(error)) from None
        started.extend(names)
    return started


def _refuse_existing(name: str, namespace: str) -> None:
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return
    raise JobError(f"an actor named {name!r} already runs in namespace {namespace!r} (stop it first)")


def stop(names: list[str], namespace: str, force: bool, timeout: float) -> list[str]:
    """Stop actors (the makers, then the trainers): drain gracefully, then kill; returns what was stopped.

    Each wave is asked to stop all at once and waited for under one deadline: the ranks of a trainer group
    step together, so a rank asked alone would wait for its peers until the deadline."""
    import ray

    names = names or actor_names(namespace)
    rows = {name: status_of(name, namespace) for name in names}
    waves = ([name for name in names if rows[name].get("role") != "trainer"],
             [name for name in names if rows[name].get("role") == "trainer"])
    stopped = []
    for wave in waves:
        if not force:
            _drain([name for name in wave if rows[name].get("state") not in ("dead", "unresponsive")],
                   rows, namespace, timeout)
        for name in wave:
            ray.kill(handle_of(name, namespace), no_restart=True)
            stopped.append(name)
    _remove_placement_groups_of(stopped, namespace)
    return stopped


def _drain(names: list[str], rows: dict[str, dict[str, Any]], namespace: str, timeout: float) -> None:
    """Ask `names` to stop, wait until none runs, and shut the trainers down, all within `timeout` s; an
    actor that does not is logged (it is killed next)."""
    import ray

    deadline = time.monotonic() + timeout
    log = logging.getLogger(__name__)
    asked = {name: handle_of(name, namespace).stop.remote() for name in names}
    draining = []
    for name, reference in asked.items():
        try:
            ray.get(reference, timeout=max(0.0, deadline - time.monotonic()))
            draining.append(name)
        except Exception as error:  # noqa: BLE001 - killed next, and said so
            log.warning("%s did not stop gracefully: %s", name, first_line(error))
    while draining and time.monotonic() < deadline:
        draining = [name for name in draining
                    if status_of(name, namespace).get("state") in ("running", "training")]
        if draining:
            time.sleep(0.2)
    if draining:
        log.warning("%s still running after %.0f s: killed", ", ".join(draining), timeout)
    trainers = {name: handle_of(name, namespace).shutdown.remote() for name in names
                if rows[name].get("role") == "trainer" and name not in draining}
    for name, reference in trainers.items():
        try:
            ray.get(reference, timeout=max(0.0, deadline - time.monotonic()))
        except Exception as error:  # noqa: BLE001 - killed next, and said so
            log.warning("%s did not shut down gracefully: %s", name, first_line(error))


def _remove_placement_groups_of(stopped: list[str], namespace: str) -> None:
    """Remove the placement group of each actor group (trainer ranks, scorer workers) left without workers."""
    from detached_rl.actors.group import remove_placement_groups_left_empty

    remove_placement_groups_left_empty(stopped, actor_names(namespace))
