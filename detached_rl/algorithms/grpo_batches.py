"""Batches of whole groups for the GRPO family, and dynamic sampling (DAPO): drop
groups that teach nothing."""

from __future__ import annotations

from collections.abc import Callable

from detached_rl.core.experience import Experience


def group_ids_of(experiences: list[Experience]) -> list[str]:
    """Each sample's group id (a sample without one is a group of its own)."""
    return [e.group_id if e.group_id is not None else f"single:{e.id}" for e in experiences]


def split_groups(experiences: list[Experience]) -> list[list[Experience]]:
    """Experiences grouped by group id, in order of first appearance."""
    groups: dict[str, list[Experience]] = {}
    for exp, gid in zip(experiences, group_ids_of(experiences), strict=True):
        groups.setdefault(gid, []).append(exp)
    return list(groups.values())


def draw_groups(sample: Callable[[int], list[Experience]], size: int, rounds: int, dynamic_sampling: bool
                ) -> tuple[list[Experience], dict[str, float]]:
    """Draw `size` samples of whole groups; with `dynamic_sampling` drop groups whose rewards are all equal.

    `sample(count)` returns `count` experiences from the buffer (waiting as needed). Dynamic
    sampling keeps drawing until the batch is full or `rounds` draws were made, then returns
    what it has (possibly nothing new: the caller skips an empty batch).
    """
    kept: list[list[Experience]] = []
    seen = dropped = 0
    for _ in range(rounds):
        missing = size - sum(len(g) for g in kept)
        if missing <= 0:
            break
        for group in split_groups(sample(missing)):
            seen += 1
            scores = [e.score for e in group]
            if dynamic_sampling and len(group) > 1 and max(scores) - min(scores) < 1e-9:
                dropped += 1
                continue
            kept.append(group)
    experiences = [e for g in kept for e in g][:size]
    sizes = sorted({len(g) for g in split_groups(experiences)})
    if len(sizes) > 1:
        raise ValueError(
            f"a GRPO batch of {size} samples holds groups of sizes {sizes}: "
            "trainer.train_batch_size must be a multiple of the makers' group_size, or advantages would use "
            "part of a group"
        )
    return experiences, {"dynamic_sampling/groups_seen": float(seen),
                         "dynamic_sampling/dropped_fraction": dropped / seen if seen else 0.0}
