"""Looking at the actors of a namespace: list, status, the actor table, a trainer's buffer, its export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from detached_rl.cli.cluster import JobError, first_line

DEFAULT_STATUS_TIMEOUT = 10.0


def actor_names(namespace: str) -> list[str]:
    """Names of the live named actors in `namespace`."""
    import ray

    actors = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in actors if a["namespace"] == namespace)


def handle_of(name: str, namespace: str) -> Any:
    """The named actor's handle, or a JobError naming it and listing what exists."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        known = ", ".join(actor_names(namespace)) or "none"
        raise JobError(f"no actor named {name!r} in namespace {namespace!r} (actors there: {known})") \
            from None


def status_of(name: str, namespace: str, timeout: float = DEFAULT_STATUS_TIMEOUT) -> dict[str, Any]:
    """An actor's status, or a row saying why it did not answer."""
    import ray

    try:
        return ray.get(handle_of(name, namespace).status.remote(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        return {"name": name, "role": "?", "state": "unresponsive",
                "last_error": f"no answer within {timeout:.0f} s"}
    except ray.exceptions.RayActorError as error:
        return {"name": name, "role": "?", "state": "dead", "last_error": first_line(error)}


def all_status(namespace: str) -> list[dict[str, Any]]:
    """Status rows of every named actor in the namespace, then of named actors that died there (not replaced).

    Actors removed on purpose (`ray.kill`, as `detached-rl stop` does) are gone, not dead: not listed.
    """
    live = actor_names(namespace)
    table = actor_table(namespace)
    rows = []
    for name in live:
        if table.get(name, {}).get("state") == "RESTARTING":
            rows.append({"name": name, "role": table[name]["role"], "state": "restarting",
                         "last_error": table[name]["death_cause"]})
        else:
            rows.append(status_of(name, namespace))
    for name, entry in sorted(table.items()):
        if name not in live and entry["state"] == "DEAD" and not entry["killed_on_purpose"]:
            rows.append({"name": name, "role": entry["role"], "state": "dead",
                         "last_error": entry["death_cause"], "restarts": entry["restarts"]})
    return rows


ROLES = {"MakerShell": "maker", "CoatiMakerHolder": "maker", "ExperienceMakerHolder": "maker",
         "PPOTrainerShell": "trainer", "GRPOTrainerShell": "trainer", "ScorerWorker": "scorer"}


def actor_table(namespace: str) -> dict[str, dict[str, Any]]:
    """The newest actor of each name in `namespace` in Ray's actor table (dead ones too): state, role, cause.

    Reads the GCS directly (Ray's state API needs the dashboard); through a Ray client, where that
    is not possible, it returns {} and `status` shows live actors only.
    """
    try:
        from ray.core.generated import common_pb2, gcs_pb2

        from detached_rl.actors.ray_seam import gcs_actor_table

        table = gcs_actor_table()
    except Exception:  # noqa: BLE001 - a Ray client, or a Ray whose internals moved: live actors only
        return {}
    newest: dict[str, dict[str, Any]] = {}
    for data in table:
        if data.ray_namespace != namespace or not data.name:
            continue
        died = data.death_cause.actor_died_error_context if data.HasField("death_cause") else None
        cause = died.error_message if died is not None else ""
        ray_kill = common_pb2.ActorDiedErrorContext.Reason.RAY_KILL
        killed_on_purpose = died is not None and died.reason == ray_kill
        entry = {"state": gcs_pb2.ActorTableData.ActorState.Name(data.state),
                 "role": ROLES.get(data.class_name, data.class_name or "?"),
                 "death_cause": cause.split(". ")[0] if cause else "", "killed_on_purpose": killed_on_purpose,
                 "restarts": int(data.num_restarts),
                 "started": int(data.start_time)}
        if data.name not in newest or entry["started"] >= newest[data.name]["started"]:
            newest[data.name] = entry
    return newest


def format_status(rows: list[dict[str, Any]]) -> str:
    """Status rows as an aligned table."""
    if not rows:
        return "no detached-rl actors in this namespace"
    header = ("name", "role", "state", "version", "steps", "buffer", "samples/s", "last error")
    table = [header]
    for row in rows:
        trainer = row.get("role") == "trainer"
        buffer = f"{row.get('buffer_size', 0)}/{row.get('buffer_max_samples', '?')}" if trainer else "-"
        steps = str(row.get("steps" if trainer else "batches", ""))
        if trainer and row.get("skipped_steps"):
            steps += f" ({row['skipped_steps']} skipped)"
        behind = row.get("makers_behind") or {}
        if trainer and behind:  # makers trailing by more than max_staleness versions (the trainer goes on)
            steps += " (behind: " + ", ".join(f"{m} by {lag}" for m, lag in sorted(behind.items())) + ")"
        silent = row.get("makers_silent") or {}
        if trainer and silent:  # makers that stopped answering (host gone, link cut): the trainer goes on
            steps += " (silent: " + ", ".join(f"{m}: {why}" for m, why in sorted(silent.items())) + ")"
        quarantined = (row.get("provenance") or {}).get("quarantined") or {}
        if trainer and quarantined:  # makers whose samples were not made by the policy they name
            steps += " (quarantined: " + ", ".join(sorted(quarantined)) + ")"
        refused = row.get("reward_refused") or {}
        if not trainer and refused:  # samples whose reward raised, timed out or was no finite number
            steps += " (reward refused: " + ", ".join(f"{n} {why}" for why, n in sorted(refused.items()))
            steps += ")"
        version = str(row.get("policy_version", ""))
        pending = (row.get("weight_updates") or {}).get("pending_version")
        if pending is not None:  # verified, swapped in when the batch under way ends
            version += f" (v{pending} next)"
        rate = row.get("samples_per_s") or 0.0
        table.append((
            str(row.get("name", "?")), str(row.get("role", "?")), str(row.get("state", "?")),
            version, str(steps), buffer, f"{rate:.1f}",
            first_line(row.get("last_error") or "")[:60],
        ))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
                     for r in table)


def inspect(name: str, namespace: str, last: int, maker: str | None,
            min_reward: float | None) -> dict[str, Any]:
    """Buffer statistics and the newest samples (decoded) of a trainer."""
    import ray

    handle = handle_of(name, namespace)
    try:
        stats = ray.get(handle.buffer_stats.remote(), timeout=DEFAULT_STATUS_TIMEOUT)
        samples = ray.get(handle.buffer_peek.remote(last, maker, min_reward), timeout=DEFAULT_STATUS_TIMEOUT)
    except AttributeError:
        raise JobError(f"{name!r} is not a trainer (it has no replay buffer)") from None
    return {"name": name, "stats": stats, "samples": samples}


def format_inspection(report: dict[str, Any]) -> str:
    """An inspection report as text."""
    stats = report["stats"]
    reward = stats["reward"]
    lines = [
        f"{report['name']}: {stats['size']} samples / {stats['max_samples']}, "
        f"{stats['bytes'] / 2**20:.2f} MiB "
        f"(received {stats['received']}, sampled {stats['sampled']}, dropped {stats['dropped']}, "
        f"duplicates {stats['duplicates']}, accounting {'ok' if stats['accounting_ok'] else 'BROKEN'})",
        "staleness (policy version: samples): " + (
            ", ".join(f"v{v}: {n}" for v, n in stats["staleness"].items()) or "-"),
        "per maker: " + (", ".join(f"{m}: {c['in_buffer']} in buffer / {c['received']} received"
                                   for m, c in stats["per_maker"].items()) or "-"),
        "reward: " + ("-" if reward["mean"] is None else
                      f"mean {reward['mean']:.3f} std {reward['std']:.3f} min {reward['min']:.3f} "
                      f"max {reward['max']:.3f}"),
    ]
    for sample in report["samples"]:
        lines.append(f"- [{sample['maker']} v{sample['policy_version']} reward {sample['score']:.3f}] "
                     f"{sample.get('prompt_text', '')!r} -> {sample.get('response_text', '')!r}")
    return "\n".join(lines)


def export(name: str, namespace: str, path: Path, page: int = 256) -> int:
    """Write a trainer's buffer to JSONL (or Parquet for a .parquet path); returns the number of samples."""
    import ray

    handle = handle_of(name, namespace)
    rows: list[dict[str, Any]] = []
    start = 0
    while True:
        batch = ray.get(handle.buffer_export.remote(start, page), timeout=60)
        rows.extend(batch)
        start += len(batch)
        if len(batch) < page:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise JobError("writing Parquet needs pyarrow (pip install pyarrow); use a .jsonl path "
                           "instead") from None
        for row in rows:
            row["info"] = json.dumps(row["info"])
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with path.open("w") as handle_out:
            for row in rows:
                handle_out.write(json.dumps(row) + "\n")
    return len(rows)
