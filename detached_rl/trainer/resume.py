"""Resuming a trainer: its checkpointed replay buffer merged with the pushes it
acknowledged since it started."""

from __future__ import annotations

from typing import Any


def merge_buffer_states(restored: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """A replay buffer `state_dict` holding `restored`'s samples, then `live`'s that `restored` does not know.

    `live` is the state of the buffer a trainer filled before it loaded its checkpoint: every sample in it
    was acknowledged to a maker, so none is dropped, even where the two exceed the buffer's capacity
    (the buffer then refuses pushes until training drains it). A live sample whose id the checkpoint
    already knows (a push retried after the trainer came back) counts as a duplicate; the other
    counters add up, so the buffer's accounting still holds.
    """
    known = set(restored["seen_ids"]) | {item["experience"]["id"] for item in restored["samples"]}
    added = [item for item in live["samples"] if item["experience"]["id"] not in known]
    repeated = [item["experience"] for item in live["samples"] if item["experience"]["id"] in known]
    added_ids = {item["experience"]["id"] for item in added}

    counts = {name: value + live["counts"].get(name, 0) for name, value in restored["counts"].items()}
    counts["received"] -= len(repeated)
    counts["duplicates"] += len(repeated)
    by_maker = dict(restored["received_by_maker"])
    for maker, value in live["received_by_maker"].items():
        by_maker[maker] = by_maker.get(maker, 0) + value
    for experience in repeated:
        by_maker[experience["maker"]] -= 1
    return {
        **restored,
        "samples": [*restored["samples"], *added],
        "queue": [*restored["queue"], *(sample_id for sample_id in live["queue"] if sample_id in added_ids)],
        "seen_ids": [*restored["seen_ids"],
                     *(sample_id for sample_id in live["seen_ids"] if sample_id not in known)],
        "counts": counts,
        "dropped": {reason: value + live["dropped"].get(reason, 0)
                    for reason, value in restored["dropped"].items()},
        "received_by_maker": {maker: value for maker, value in by_maker.items() if value},
    }
