"""Staleness rules in one place: when a sample is too old to train, and which weights a maker's next batch
needs.

A sample made with weights of version v is trained at version t only if `t - v <= max_staleness`
(`is_stale`); the replay buffer drops the rest. Pacing answers each acknowledged push with the oldest
version the maker's next batch may carry (`GenerationLedger`, `paced_version`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


def is_stale(policy_version: int, current_version: int | None, max_staleness: int | None) -> bool:
    """Whether a sample of `policy_version` is too old to train at `current_version` (no bound: never)."""
    if max_staleness is None or current_version is None:
        return False
    return current_version - policy_version > max_staleness


def oldest_useful_version(policy_version: int, step_in_progress: bool, queued: int, train_batch_size: int,
                          max_staleness: int, update_steps: int = 1) -> int:
    """The oldest policy version a batch pushed now can carry and still be trained (not dropped as stale).

    The batch is trained at version `policy_version + step_in_progress + queued // train_batch_size`
    (the step under way, then the full batches queued before it) and may then be `max_staleness` old.
    The answer is capped at the version the step under way produces (rounded down to a multiple of
    `update_steps`, the versions makers receive): queued samples may themselves go stale and be dropped,
    so only that version is sure to come without more samples, and a maker waiting for it never waits
    for samples that only it could provide. Trainers now answer with `GenerationLedger` (`paced_version`),
    which counts only samples that will be trained, those promised by other makers too, and needs no cap;
    this rule stays as the reference it replaced (tests/test_pacing.py).
    """
    trained_at = policy_version + int(step_in_progress) + queued // train_batch_size
    surely_reached = policy_version + int(step_in_progress)
    surely_pushed = surely_reached - surely_reached % update_steps
    return max(0, min(trained_at - max_staleness, surely_pushed))


def paced_version(policy_version: int, step_in_progress: bool, ahead: int, samples_per_version: int,
                  max_staleness: int, update_steps: int = 1) -> int:
    """The oldest policy version a batch can carry and still be trained behind `ahead` samples that will be.

    The batch is trained at version `policy_version + step_in_progress + ahead // samples_per_version`
    and may then be `max_staleness` old; the answer is rounded down to a multiple of `update_steps` (the
    versions makers receive), so the samples ahead reach it. `ahead` counts only samples that will be
    trained (`fresh_samples`), buffered or promised by other makers (`GenerationLedger`).
    """
    oldest = policy_version + int(step_in_progress) + ahead // samples_per_version - max_staleness
    return max(0, oldest - oldest % update_steps)


def fresh_samples(versions: Iterable[int], version: int, train_batch_size: int, max_staleness: int) -> int:
    """How many buffered samples (their policy versions, in sampling order) are trained, not dropped as stale.

    Sampling starts at `version` and moves one version on per `train_batch_size` samples; a sample more than
    `max_staleness` versions older than the version it comes up at is dropped as stale instead.
    """
    fresh = 0
    for sample_version in versions:
        if not is_stale(sample_version, version + fresh // train_batch_size, max_staleness):
            fresh += 1
    return fresh


class GenerationLedger:
    """The batches a trainer's answers told makers to generate next, counted by later answers (admission).

    A maker is promised one batch per acknowledged push (its next one, with weights at least as new as the
    answer and as its push) and, when it is admitted (`admit`), one per batch it makes before its first
    answer comes back (its pipeline). A push settles its maker's oldest promise. A promise whose batch has
    not come by the version its last sample was due to be trained at no longer counts (the maker is late or
    gone). Not thread-safe: the trainer calls it under its push lock.
    """

    def __init__(self, train_batch_size: int, max_staleness: int) -> None:
        self.train_batch_size = train_batch_size
        self.max_staleness = max_staleness
        # in the order promised: (maker, samples, the version they will carry, the version the last one is
        # due to be trained at)
        self._promised: list[tuple[str, int, int, int]] = []

    @property
    def in_flight(self) -> int:
        """Samples promised and not pushed yet."""
        return sum(samples for _, samples, _, _ in self._promised)

    def acknowledge(self, maker: str | None, samples: int, full: bool, policy_version: int,
                    step_in_progress: bool, buffered: Iterable[int], update_steps: int = 1,
                    samples_per_version: int | None = None, pushed_version: int = 0) -> int:
        """The oldest weights `maker`'s next batch can come from and be trained (`paced_version`), after its
        push of `samples` (`full`: refused for room) made with weights of `pushed_version`.

        `buffered`: the policy versions of the samples in the buffer after the push, in the order they are
        sampled. Ahead of the maker's next batch it counts those and every promised batch (the maker's own
        earlier ones too), less what will be dropped as stale (`fresh_samples`). `samples_per_version`: what
        a step takes from the buffer, if more than `train_batch_size` (dynamic sampling draws again for the
        groups it drops).
        """
        self._expire(policy_version)
        oldest = next((i for i, promise in enumerate(self._promised) if promise[0] == maker), None)
        if oldest is not None and not full:
            del self._promised[oldest]  # this push is the batch its maker's oldest promise was for
        # a push refused for room comes again: its own promise is not ahead of it
        skip = oldest if full else None
        answer, due = self._next(policy_version, step_in_progress, list(buffered), update_steps,
                                 samples_per_version, skip)
        if maker is not None and not full and samples > 0:
            self._promised.append((maker, samples, max(answer, pushed_version), due(samples)))
        return answer

    def admit(self, maker: str, samples: int, batches: int, policy_version: int, step_in_progress: bool,
              buffered: Iterable[int], update_steps: int = 1, samples_per_version: int | None = None
              ) -> list[int]:
        """The oldest weights each of the first `batches` batches of `samples` a maker is about to make can
        come from and be trained (they are made before the first push's answer comes back); each is promised.
        A maker admitted again (it registered again) drops its earlier promises first."""
        self._expire(policy_version)
        self._promised = [promise for promise in self._promised if promise[0] != maker]
        state = (policy_version, step_in_progress, list(buffered), update_steps, samples_per_version)
        answers = []
        for _ in range(batches if samples > 0 else 0):
            answer, due = self._next(*state)
            self._promised.append((maker, samples, answer, due(samples)))
            answers.append(answer)
        return answers

    def _expire(self, policy_version: int) -> None:
        """Forget the promises due before `policy_version` (their batches are late: the maker may be gone)."""
        self._promised = [promise for promise in self._promised if promise[3] >= policy_version]

    def _next(self, policy_version: int, step_in_progress: bool, buffered: list[int], update_steps: int,
              samples_per_version: int | None, skip: int | None = None) -> tuple[int, Callable[[int], int]]:
        """The answer for a batch made next, behind the buffered and the promised samples (but the promise at
        index `skip`), and when a batch of n samples made with it is due to be trained (a function of n)."""
        size = max(self.train_batch_size, samples_per_version or 0)
        start = policy_version + int(step_in_progress)
        versions = list(buffered)
        for index, (_, count, version, _) in enumerate(self._promised):
            if index != skip:
                versions += [version] * count
        ahead = fresh_samples(versions, start, size, self.max_staleness)
        answer = paced_version(policy_version, step_in_progress, ahead, size, self.max_staleness,
                               update_steps)
        return answer, lambda samples: start + (ahead + samples - 1) // size
