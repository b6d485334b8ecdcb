"""The replay buffer's door: what a push must be to be stored, the error that refuses it, and its answer.

A push is stored whole or refused whole. It is refused (`RejectedPushError`, counted as `rejected_invalid`,
nothing stored or remembered), in this order, when it holds more samples or bytes than an empty buffer could
take (whether or not its samples are stale or repeats); when an element is not exactly an `Experience` (a
subclass could override `validate` or the properties the buffer reads) or fails `Experience.validate` (a
missing field included) or the buffer's own rules (version, sequence length, same optional fields); and, in a
grouped buffer (`group_size`), when it is not whole groups: every group id exactly `group_size` times with one
policy version (`group_size` 1 also allows no group id), no group partly a repeat, no group id already in the
buffer. Makers push each batch, whole groups, in one push, so a group is never split across pushes; a training
step then always finds whole groups (eviction removes whole groups too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from detached_rl.core.experience import Experience
from detached_rl.core.experience_checks import (
    TOKEN_FIELDS,
    ExperienceValidationError,
    short_repr,
)

# How a refusal of samples newer than the trainer's weights reads: the maker that pushed them is ahead of its
# trainer (it took weights its trainer never sent) and registers again when it sees this.
NEWER_THAN_TRAINER = "is newer than the trainer's current version"


@dataclass(frozen=True)
class AppendResult:
    """The acknowledgement of one push."""

    accepted: int  # stored in the buffer
    duplicates: int  # ids already seen, skipped
    dropped_stale: int  # received, but too old on arrival
    evicted: int  # older samples dropped to make room ("evict_oldest")
    full: bool  # refused for capacity ("refuse"): nothing changed, retry later
    size: int  # buffer size after the push
    nbytes: int  # buffer bytes after the push
    current_version: int = -1  # the trainer's policy version the push was judged against
    # The oldest policy version a batch pushed next may carry and still be trained rather than dropped as
    # stale, estimated by the trainer from its version, its step in progress and the samples queued before
    # it (None: no staleness bound). Makers wait for weights this new before they generate the next batch.
    oldest_useful_version: int | None = None

    @property
    def received(self) -> int:
        """New samples this push added to the accounting (stored or dropped as stale)."""
        return self.accepted + self.dropped_stale


class RejectedPushError(ValueError):
    """A push refused as a whole; `index` and `field` name the offending experience and field when known."""

    def __init__(self, message: str, index: int | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.index = index
        self.field = field


def check_int(name: str, value: Any, minimum: int) -> int:
    """`value` when it is an int (not a bool) >= `minimum`; else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_push_size(count: int, nbytes: int | None, max_samples: int, max_bytes: int) -> None:
    """Refuse a push of `count` samples (`nbytes` bytes, None: not yet counted)
    an empty buffer cannot take."""
    if count > max_samples or (nbytes is not None and nbytes > max_bytes):
        size = f"{count} samples" if nbytes is None else f"{count} samples ({nbytes} bytes)"
        raise RejectedPushError(
            f"push of {size} can never fit, even in an empty buffer (max_samples={max_samples}, "
            f"max_bytes={max_bytes}): split it (whole groups per push)"
        )


def check_push(
    experiences: list[Experience],
    current_version: int,
    *,
    vocab_size: int | None,
    max_abs_reward: float,
    max_sequence_length: int | None,
    buffered: Experience | None,
) -> None:
    """Refuse a push with an element that is not a valid `Experience` this trainer can train on.

    `buffered`: a sample already in the buffer (None: it is empty), whose optional fields every pushed sample
    must share.
    """
    ids_in_push: set[str] = set()
    # Samples that may meet in one training batch must carry the same optional fields (collate needs it).
    reference = buffered
    whose = "the buffer's samples" if buffered is not None else "this push's first"
    for index, exp in enumerate(experiences):
        # Exactly the class (Ray delivers the class that was sent): a subclass could override `validate`, or
        # the properties and `nbytes` the buffer and `collate` read after it.
        if type(exp) is not Experience:
            where = _where(index, len(experiences), exp)
            raise RejectedPushError(
                f"{where}: expected an Experience (exactly that class), got {type(exp).__name__}", index)
        try:
            exp.validate(vocab_size, max_abs_reward=max_abs_reward)
            if exp.policy_version > current_version:
                raise ExperienceValidationError(
                    "policy_version",
                    f"{exp.policy_version} {NEWER_THAN_TRAINER} {current_version}",
                )
            total = exp.prompt_ids.numel() + exp.response_length
            if max_sequence_length is not None and total > max_sequence_length:
                raise ExperienceValidationError(
                    "response_ids", f"prompt + response is {total} tokens, over the trainer model's limit of "
                                    f"{max_sequence_length}")
            if exp.id in ids_in_push:
                raise ExperienceValidationError("id", "appears twice in this push")
            reference = reference or exp
            _check_same_fields(exp, reference, whose)
        except ExperienceValidationError as err:
            where = _where(index, len(experiences), exp)
            raise RejectedPushError(f"{where}: {err}", index, err.field) from err
        ids_in_push.add(exp.id)


def check_groups(
    experiences: list[Experience],
    repeats: set[str],
    group_size: int | None,
    buffered_groups: Callable[[], set[str | None]],
) -> None:
    """Refuse a push that is not whole groups of `group_size` (see the module docstring).

    `repeats`: the ids of the push already received; `buffered_groups()`: the group ids in the buffer.
    """
    if group_size is None:
        return
    members: dict[str, list[int]] = {}
    for index, exp in enumerate(experiences):
        if exp.group_id is not None:
            members.setdefault(exp.group_id, []).append(index)
        elif group_size > 1:
            _refuse_group(experiences, index, f"is missing: this trainer trains whole groups of {group_size} "
                                              "samples that share a group_id")
    in_buffer = buffered_groups() if members else set()
    for group_id, indices in members.items():
        group = [experiences[index] for index in indices]
        name, first = short_repr(group_id), indices[0]
        if len(group) != group_size:
            _refuse_group(experiences, first, f"group {name} appears {len(group)} times in this push; this "
                                              f"trainer trains whole groups of {group_size} (a maker "
                                              "pushes each group whole, in one push)")
        if len({exp.policy_version for exp in group}) > 1:
            _refuse_group(experiences, first, f"the samples of group {name} carry different policy versions "
                                              "(one policy version generates a group)")
        known = sum(exp.id in repeats for exp in group)
        if known == len(group):
            continue  # a retried group: counted as duplicates
        if known:
            _refuse_group(experiences, first, f"group {name} is partly a repeat of an earlier push ({known} "
                                              f"of its {len(group)} samples were received before)")
        if group_id in in_buffer:
            _refuse_group(experiences, first, f"group {name} is already in the buffer from an earlier push")


def _check_same_fields(exp: Experience, reference: Experience, whose: str) -> None:
    """Refuse `exp` when it carries an optional per-token field `reference` lacks, or lacks one it has."""
    for name in TOKEN_FIELDS:
        has, expected = getattr(exp, name) is not None, getattr(reference, name) is not None
        if has != expected:
            raise ExperienceValidationError(
                name,
                f"{'present' if has else 'absent'} here but {'absent' if has else 'present'} on {whose} "
                      "(every maker of a trainer must send the same fields)")


def _refuse_group(experiences: list[Experience], index: int, message: str) -> NoReturn:
    error = ExperienceValidationError("group_id", message)
    raise RejectedPushError(f"{_where(index, len(experiences), experiences[index])}: {error}", index,
                            error.field)


def _where(index: int, total: int, exp: Any) -> str:
    return (
        f"experience at index {index} of {total} "
        f"(id {short_repr(getattr(exp, 'id', None))}, maker {short_repr(getattr(exp, 'maker', None))})"
    )
