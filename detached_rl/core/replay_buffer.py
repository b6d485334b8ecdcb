"""Replay buffer: a bounded, thread-safe queue of experiences that lives inside a trainer, handed out oldest
policy first, then in arrival order.

Accounting holds at all times: every received sample is in exactly one place, so
`received == sampled + in_buffer + sum(dropped.values())`. A sample counts as `sampled`
once it has been handed out `max_reuse` times; `dropped` is keyed by reason ("stale",
"evicted", "cleared"). Duplicates (ids already seen, e.g. a retried push) are counted
apart, are not part of `received`, and are never stored twice.

The door (`append`): a push is stored whole or refused whole (`RejectedPushError`); what it checks, in
which order, is in `detached_rl.core.buffer_door`.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from detached_rl.core.buffer_door import (
    NEWER_THAN_TRAINER,
    AppendResult,
    RejectedPushError,
    check_groups,
    check_int,
    check_push,
    check_push_size,
)
from detached_rl.core.buffer_stats import describe, summary
from detached_rl.core.experience import Experience
from detached_rl.core.limits import DEFAULT_MAX_ABS_REWARD, check_max_abs_reward
from detached_rl.core.staleness import is_stale

# The door's names, importable from here too: the buffer raises the error, makers and trainers read the rest.
__all__ = ["DROP_REASONS", "NEWER_THAN_TRAINER", "OVERFLOW_POLICIES", "AppendResult", "RejectedPushError",
           "ReplayBuffer", "check_max_abs_reward"]

OVERFLOW_POLICIES = ("refuse", "evict_oldest")
DROP_REASONS = ("stale", "evicted", "cleared", "quarantined")
_COUNTERS = ("received", "sampled", "times_handed_out", "duplicates", "refused_full", "rejected_invalid")
_STATE_FORMAT = 1


@dataclass
class _Entry:
    experience: Experience
    nbytes: int
    score: float
    uses: int = 0

    def sampling_key(self) -> tuple[int, int]:
        """Its place in the sampling order: not handed out yet, the oldest policy first (trained while it
        still can be), then reused ones as handed out; ties keep arrival order (groups stay together)."""
        return (1, 0) if self.uses else (0, self.experience.policy_version)


class ReplayBuffer:
    """Bounded (samples and bytes), thread-safe queue of experiences with staleness, dedupe and accounting."""

    def __init__(
        self,
        *,
        max_samples: int = 4096,
        max_bytes: int = 1 << 30,
        max_staleness: int | None = None,
        max_reuse: int = 1,
        overflow: str = "refuse",
        vocab_size: int | None = None,
        dedupe_window: int = 1_000_000,
        max_sequence_length: int | None = None,
        max_abs_reward: float = DEFAULT_MAX_ABS_REWARD,
        group_size: int | None = None,
    ) -> None:
        self.max_samples = check_int("max_samples", max_samples, minimum=1)
        self.max_bytes = check_int("max_bytes", max_bytes, minimum=1)
        self.max_staleness = None if max_staleness is None else check_int("max_staleness", max_staleness, 0)
        self.max_reuse = check_int("max_reuse", max_reuse, minimum=1)
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
        self.overflow = overflow
        self.vocab_size = None if vocab_size is None else check_int("vocab_size", vocab_size, minimum=1)
        self.dedupe_window = check_int("dedupe_window", dedupe_window, minimum=0)
        # Longest prompt + response the trainer's model can take (its max_position_embeddings).
        self.max_sequence_length = (None if max_sequence_length is None
                                    else check_int("max_sequence_length", max_sequence_length, minimum=2))
        # Pushed rewards beyond it are refused (see `Experience.validate` for the other float fields' bounds).
        self.max_abs_reward = check_max_abs_reward("max_abs_reward", max_abs_reward)
        # Samples per group (GRPO's responses per prompt): pushes must be whole groups. None: no group rule.
        self.group_size = None if group_size is None else check_int("group_size", group_size, minimum=1)
        if self.group_size is not None and self.group_size > self.max_samples:
            raise ValueError(f"group_size {self.group_size} exceeds max_samples {self.max_samples}: "
                             "no group could ever be stored")

        self._cond = threading.Condition()
        # The same entries in two orders: `_queue` is the sampling order (`sampling_key`: the oldest
        # policy first; reused samples move to its back), `_arrivals` the arrival order (eviction, peek).
        self._queue: OrderedDict[str, _Entry] = OrderedDict()
        self._arrivals: OrderedDict[str, _Entry] = OrderedDict()
        self._seen_ids: OrderedDict[str, None] = OrderedDict()
        self._nbytes = 0
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._dropped = dict.fromkeys(DROP_REASONS, 0)
        self._received_by_maker: dict[str, int] = {}

    def __len__(self) -> int:
        """Number of samples in the buffer."""
        with self._cond:
            return len(self._queue)

    @property
    def nbytes(self) -> int:
        """Bytes held by the samples in the buffer (tensors, strings and info: `Experience.nbytes`)."""
        with self._cond:
            return self._nbytes

    def append(self, experiences: Sequence[Experience], current_version: int) -> AppendResult:
        """Add one push all-or-nothing; with "refuse", a push that does not fit returns `full=True`."""
        check_int("current_version", current_version, minimum=0)
        experiences = list(experiences)
        with self._cond:
            try:
                sizes = self._check_push(experiences, current_version)
                repeats = {exp.id for exp in experiences if self._is_duplicate(exp.id)}
                check_groups(experiences, repeats, self.group_size,
                             lambda: {entry.experience.group_id for entry in self._arrivals.values()})
            except RejectedPushError:
                self._counts["rejected_invalid"] += 1
                raise
            fresh = [exp for exp in experiences if exp.id not in repeats]
            stale = [exp for exp in fresh if self._too_stale(exp.policy_version, current_version)]
            stale_ids = {exp.id for exp in stale}
            entries = [_Entry(exp, sizes[exp.id], exp.score) for exp in fresh if exp.id not in stale_ids]
            push_bytes = sum(entry.nbytes for entry in entries)

            # Samples that are stale now would be dropped at the next sample anyway; dropping
            # them first keeps them from causing a refusal.
            self._drop_stale(current_version)
            evicted = 0
            if not self._fits(len(entries), push_bytes):
                if self.overflow == "refuse":
                    self._counts["refused_full"] += 1
                    return AppendResult(
                        accepted=0, duplicates=0, dropped_stale=0, evicted=0, full=True,
                        size=len(self._queue), nbytes=self._nbytes, current_version=current_version,
                    )
                while not self._fits(len(entries), push_bytes):
                    evicted += self._evict_oldest()

            for exp in experiences:
                self._remember(exp.id)
            for exp in fresh:
                self._counts["received"] += 1
                self._received_by_maker[exp.maker] = self._received_by_maker.get(exp.maker, 0) + 1
            self._counts["duplicates"] += len(experiences) - len(fresh)
            self._dropped["stale"] += len(stale)
            last = next(reversed(self._queue.values()), None)
            keys = [entry.sampling_key() for entry in ([last] if last else []) + entries]
            for entry in entries:
                self._queue[entry.experience.id] = entry
                self._arrivals[entry.experience.id] = entry
                self._nbytes += entry.nbytes
            if keys != sorted(keys):  # a late push of older weights goes ahead of newer samples
                self._sort_queue()
            if entries:
                self._cond.notify_all()
            return AppendResult(
                accepted=len(entries),
                duplicates=len(experiences) - len(fresh),
                dropped_stale=len(stale),
                evicted=evicted,
                full=False,
                size=len(self._queue),
                nbytes=self._nbytes,
                current_version=current_version,
            )

    def sample(self, count: int, current_version: int | None = None,
               timeout: float = 0.0) -> list[Experience]:
        """Hand out the `count` oldest samples, waiting up to `timeout` s for
        enough; `[]` if there are not."""
        check_int("count", count, minimum=1)
        if count > self.max_samples:
            raise ValueError(f"count {count} exceeds max_samples {self.max_samples}: it could "
                             "never be served")
        if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout >= 0):
            raise ValueError(f"timeout must be a finite number >= 0, got {timeout!r}")
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._drop_stale(current_version)
                if len(self._queue) >= count:
                    return self._hand_out(count)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._cond.wait(remaining)

    def wait_for(self, count: int, current_version: int | None = None, timeout: float = 0.0) -> int:
        """Drop stale samples, wait up to `timeout` s until `count` are available; returns how many are."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._drop_stale(current_version)
                remaining = deadline - time.monotonic()
                if len(self._queue) >= count or remaining <= 0:
                    return len(self._queue)
                self._cond.wait(remaining)

    def sampling_versions(self) -> list[int]:
        """The policy versions of the samples in the buffer, in the order they are handed out."""
        with self._cond:
            return [entry.experience.policy_version for entry in self._queue.values()]

    def experiences(self, start: int = 0, count: int | None = None) -> list[Experience]:
        """The samples in arrival order from `start` (up to `count`), without removing them."""
        with self._cond:
            entries = list(self._arrivals.values())
        end = None if count is None else start + count
        return [entry.experience for entry in entries[start:end]]

    def take(self, max_count: int, current_version: int | None = None) -> list[Experience]:
        """Hand out up to `max_count` of the oldest samples at once, without waiting."""
        check_int("max_count", max_count, minimum=0)
        with self._cond:
            self._drop_stale(current_version)
            return self._hand_out(min(max_count, len(self._queue)))

    def clear(self) -> None:
        """Drop every sample in the buffer (counted as "cleared"); remembered ids stay remembered."""
        with self._cond:
            self._dropped["cleared"] += len(self._queue)
            self._queue.clear()
            self._arrivals.clear()
            self._nbytes = 0

    def drop_maker(self, maker: str, reason: str = "quarantined") -> int:
        """Drop every sample of `maker` in the buffer, counted under `reason`; returns how many."""
        with self._cond:
            ids = [key for key, entry in self._arrivals.items() if entry.experience.maker == maker]
            for key in ids:
                self._remove(key, reason)
            return len(ids)

    def stats(self) -> dict[str, Any]:
        """Return sizes, counters, staleness histogram, per-maker counts and
        reward statistics (JSON-ready)."""
        with self._cond:
            entries = list(self._queue.values())
            counts = dict(self._counts)
            dropped = dict(self._dropped)
            received_by_maker = dict(self._received_by_maker)
            nbytes = self._nbytes
            accounting_ok = self._accounting_ok()
        versions = Counter(entry.experience.policy_version for entry in entries)
        in_buffer_by_maker = Counter(entry.experience.maker for entry in entries)
        return {
            "size": len(entries),
            "bytes": nbytes,
            "max_samples": self.max_samples,
            "max_bytes": self.max_bytes,
            "max_staleness": self.max_staleness,
            "max_reuse": self.max_reuse,
            **counts,
            "dropped": dropped,
            "in_buffer": len(entries),
            "accounting_ok": accounting_ok,
            "staleness": {str(version): n for version, n in sorted(versions.items())},
            "per_maker": {
                maker: {"received": n, "in_buffer": in_buffer_by_maker.get(maker, 0)}
                for maker, n in sorted(received_by_maker.items())
            },
            "reward": summary([entry.score for entry in entries]),
        }

    def peek(
        self,
        count: int = 5,
        maker: str | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> list[dict[str, Any]]:
        """Describe the newest `count` samples matching the filters, newest first, without touching them."""
        check_int("count", count, minimum=0)
        matches: list[_Entry] = []
        with self._cond:
            for entry in reversed(self._arrivals.values()):
                if len(matches) >= count:
                    break
                if maker is not None and entry.experience.maker != maker:
                    continue
                if min_reward is not None and entry.score < min_reward:
                    continue
                if max_reward is not None and entry.score > max_reward:
                    continue
                matches.append(entry)
        # Describing (and decoding) happens outside the lock so inspection never stalls training.
        return [describe(entry.experience, entry.score, entry.uses, decode) for entry in matches]

    def state_dict(self) -> dict[str, Any]:
        """Return everything needed to restore the buffer exactly (samples as tensors, counters, seen ids)."""
        with self._cond:
            return {
                "format": _STATE_FORMAT,
                "samples": [
                    {"experience": _copy_fields(entry.experience), "uses": entry.uses}
                    for entry in self._arrivals.values()
                ],
                "queue": list(self._queue),
                "seen_ids": list(self._seen_ids),
                "counts": dict(self._counts),
                "dropped": dict(self._dropped),
                "received_by_maker": dict(self._received_by_maker),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the buffer's contents with a `state_dict`; this buffer's configuration is kept."""
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"unknown replay buffer state format {state.get('format')!r}, expected "
                             f"{_STATE_FORMAT}")
        arrivals: OrderedDict[str, _Entry] = OrderedDict()
        for item in state["samples"]:
            exp = Experience(**_copy_fields(item["experience"]))
            arrivals[exp.id] = _Entry(exp, exp.nbytes(), exp.score, uses=int(item["uses"]))
        if sorted(state["queue"]) != sorted(arrivals):
            raise ValueError("replay buffer state is inconsistent: queue ids differ from sample ids")
        counts = {name: int(state["counts"][name]) for name in _COUNTERS}
        dropped = {reason: int(state["dropped"].get(reason, 0)) for reason in DROP_REASONS}  # older: fewer
        if counts["received"] != counts["sampled"] + len(arrivals) + sum(dropped.values()):
            raise ValueError("replay buffer state is inconsistent: received != sampled + in_buffer + dropped")
        seen_ids = state["seen_ids"][-self.dedupe_window :] if self.dedupe_window else []
        with self._cond:
            self._arrivals = arrivals
            self._queue = OrderedDict((sample_id, arrivals[sample_id]) for sample_id in state["queue"])
            self._sort_queue()  # a state saved before the buffer sampled oldest policy first
            self._seen_ids = OrderedDict.fromkeys(seen_ids)
            self._nbytes = sum(entry.nbytes for entry in arrivals.values())
            self._counts = counts
            self._dropped = dropped
            self._received_by_maker = {str(k): int(v) for k, v in state["received_by_maker"].items()}
            self._cond.notify_all()

    # Helpers below expect the lock to be held.

    def _check_push(self, experiences: list[Experience], current_version: int) -> dict[str, int]:
        """Refuse a push the door does not let in (`buffer_door`); return each sample's bytes."""
        # Size first, over the whole push: stale or repeated samples never make an oversized push pass.
        check_push_size(len(experiences), None, self.max_samples, self.max_bytes)
        buffered = next(iter(self._arrivals.values())).experience if self._arrivals else None
        check_push(experiences, current_version, vocab_size=self.vocab_size,
                   max_abs_reward=self.max_abs_reward,
                   max_sequence_length=self.max_sequence_length, buffered=buffered)
        sizes = {exp.id: exp.nbytes() for exp in experiences}
        check_push_size(len(experiences), sum(sizes.values()), self.max_samples, self.max_bytes)
        return sizes

    def _evict_oldest(self) -> int:
        """Drop the oldest sample and, in a grouped buffer, the rest of its group
        (which arrived right after it)."""
        sample_id, entry = next(iter(self._arrivals.items()))
        self._remove(sample_id, reason="evicted")
        evicted, group_id = 1, entry.experience.group_id
        while self.group_size is not None and group_id is not None and self._arrivals:
            next_id, following = next(iter(self._arrivals.items()))
            if following.experience.group_id != group_id:
                break
            self._remove(next_id, reason="evicted")
            evicted += 1
        return evicted

    def _is_duplicate(self, sample_id: str) -> bool:
        # Ids in the buffer count too, in case the dedupe window is smaller than the buffer.
        return sample_id in self._seen_ids or sample_id in self._arrivals

    def _remember(self, sample_id: str) -> None:
        if self.dedupe_window == 0:
            return
        if sample_id in self._seen_ids:
            self._seen_ids.move_to_end(sample_id)
            return
        self._seen_ids[sample_id] = None
        while len(self._seen_ids) > self.dedupe_window:
            self._seen_ids.popitem(last=False)

    def _too_stale(self, policy_version: int, current_version: int | None) -> bool:
        return is_stale(policy_version, current_version, self.max_staleness)

    def _drop_stale(self, current_version: int | None) -> None:
        if self.max_staleness is None or current_version is None:
            return
        for sample_id, entry in list(self._arrivals.items()):
            if self._too_stale(entry.experience.policy_version, current_version):
                self._remove(sample_id, reason="stale")

    def _sort_queue(self) -> None:
        """Put `_queue` in sampling order (it always is between calls; Timsort is near-linear on it)."""
        self._queue = OrderedDict(sorted(self._queue.items(), key=lambda kv: kv[1].sampling_key()))

    def _fits(self, count: int, nbytes: int) -> bool:
        return len(self._queue) + count <= self.max_samples and self._nbytes + nbytes <= self.max_bytes

    def _remove(self, sample_id: str, reason: str | None) -> None:
        """Take a sample out of the buffer: dropped for `reason`, or sampled when `reason` is None."""
        entry = self._arrivals.pop(sample_id)
        self._queue.pop(sample_id, None)
        self._nbytes -= entry.nbytes
        if reason is None:
            self._counts["sampled"] += 1
        else:
            self._dropped[reason] += 1

    def _hand_out(self, count: int) -> list[Experience]:
        handed_out = []
        for _ in range(count):
            sample_id, entry = self._queue.popitem(last=False)
            entry.uses += 1
            self._counts["times_handed_out"] += 1
            handed_out.append(entry.experience)
            if entry.uses >= self.max_reuse:
                self._remove(sample_id, reason=None)
            else:
                self._queue[sample_id] = entry  # to the back, so the others get their turn first
        return handed_out

    def _accounting_ok(self) -> bool:
        in_buffer = len(self._queue)
        return self._counts["received"] == self._counts["sampled"] + in_buffer + sum(self._dropped.values())


def _copy_fields(exp: Experience | dict[str, Any]) -> dict[str, Any]:
    """Deep-copy an experience's fields into a dict (tensors keep their dtype)."""
    values = exp if isinstance(exp, dict) else {f.name: getattr(exp, f.name) for f in fields(exp)}
    return {
        name: value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
        for name, value in values.items()
    }

