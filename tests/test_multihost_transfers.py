"""Deadlines that tell slow from dead (issue 29.2), across hosts: a trainer job on h0, a maker job on h1
behind a 5 Mbit/s link, full weight updates (a model of about 2.4 MB, policy and critic: about 5 MB an
update, 8 s on that link), a stall interval of 3 s on both sides, pieces of 64 KiB (0.1 s each there).

(a) every full update takes longer than the stall interval and completes; (b) h1's cable is unplugged in the
middle of one: the maker's receive fails (naming the update, the trainer's host and a stall shorter than 2x
the interval) while it keeps serving the version before, the trainer's push fails naming the maker and its
host, and once the cable is back the maker gets newer weights.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from .hosts import Hosts
from .multihost import hosts_fixture, tiny_config_path
from .test_multihost_faults import Probe, ok, wait_for

pytestmark = [pytest.mark.multihost, pytest.mark.e2e]

TRAINER, MAKER = 0, 1
RATE_MBIT = 5
STALL_S = 3.0
hosts = hosts_fixture(2, rates_mbit={MAKER: RATE_MBIT},
                      resources={TRAINER: {"trainer_host": 1}, MAKER: {"maker_host": 1}})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama, wider than `tiny` (2.4 MB) so that a full update outlasts the stall interval on
    the link; saved where every host reads it (/tmp is shared but for each host's /tmp/drl-hostfs)."""
    from detached_rl.models import tiny_causal_lm

    path = tmp_path_factory.mktemp("wide-tiny")
    model, tokenizer = tiny_causal_lm(hidden_size=160, intermediate_size=320)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def job(hosts: Hosts, index: int, model: Path, *args: str) -> None:
    """Start a trainer or maker job from host `index`, as a user types it; it returns once the actors run."""
    command = ["detached-rl", *args, "--address", hosts.head_address, "--config", tiny_config_path(),
               "--set", f"model.policy={model}", "--set", f"maker.weight_stall_timeout_s={STALL_S}",
               "--set", f"trainer.weight_stall_timeout_s={STALL_S}"]
    done = hosts.run(index, command, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def served(probe: Probe) -> int:
    """The version the maker serves (-1 when it does not answer)."""
    status = probe.call("m", "status", timeout=20)
    return -1 if isinstance(status, Exception) else status.get("policy_version") or -1


def test_a_slow_full_update_completes_and_an_unplugged_one_fails_fast_naming_it(hosts: Hosts,
                                                                                 model_dir: Path) -> None:
    started = time.monotonic()
    job(hosts, TRAINER, model_dir, "trainer", "--name", "t", "--steps", "100000",
        "--set", "trainer_group.resources={trainer_host: 1}", "--set", "trainer.weight_sync=full",
        "--set", "trainer.weight_piece_bytes=65536")
    job(hosts, MAKER, model_dir, "maker", "--name", "m", "--trainers", "t",
        "--set", "maker.resources={maker_host: 1}")
    h0, h1 = Probe(hosts, TRAINER), Probe(hosts, MAKER)
    try:
        # (a) Full updates across 5 Mbit/s, each longer than the stall interval, complete.
        wait_for("the maker serving version 2", lambda: served(h0) >= 2, 150)
        rows = [row for row in ok(h0.call("t", "metrics")) if "weight_sync/bytes" in row]
        update_bytes = rows[-1]["weight_sync/bytes"]
        transfer_s = update_bytes * 8 / (RATE_MBIT * 1e6)  # at best, at the link's rate
        pushes = [round(row["weight_sync/push_s"], 1) for row in rows]
        print(f"(a) full updates of {update_bytes / 1e6:.2f} MB: at least {transfer_s:.1f} s each at "
              f"{RATE_MBIT} Mbit/s (stall interval {STALL_S:g} s); push seconds {pushes}; at "
              f"{time.monotonic() - started:.0f} s")
        assert transfer_s > 2 * STALL_S, "the update would not outlast the stall interval"
        trainer = ok(h0.call("t", "status"))
        assert trainer["last_error"] is None and trainer["weight_push"]["failed"] == 0, trainer
        assert ok(h0.call("m", "status"))["last_error"] is None

        # (b) h1 unplugged in the middle of an update.
        def mid_transfer() -> dict[str, Any] | None:
            answer = h1.call("m", "transfer_progress", timeout=5)
            if isinstance(answer, Exception) or answer.get("version") is None:
                return None
            return answer if 0 < answer["done"] < 0.6 * answer["total"] else None

        progress = wait_for("an update half way to the maker", mid_transfer, 60, poll=0.2)
        before = ok(h1.call("m", "status"))["policy_version"]
        hosts.link(MAKER, False)
        cut = time.monotonic()
        version = progress["version"]
        print(f"(b) unplugged h1 with v{version} at {progress['done'] / 1e6:.2f} of "
              f"{progress['total'] / 1e6:.2f} MB; the maker served v{before}")

        def maker_failed() -> dict[str, Any] | None:
            status = h1.call("m", "status", timeout=5)  # a call on h1 itself: needs no link
            if isinstance(status, Exception) or "stalled" not in (status.get("last_error") or ""):
                return None
            return status

        maker = wait_for("the maker's receive failing", maker_failed, 30, poll=0.2)
        error = maker["last_error"]
        print(f"maker, {time.monotonic() - cut:.1f} s after the cut: {error}")
        assert f"weight update v{version} (full)" in error and hosts.host(TRAINER).address in error, error
        stalled_for = float(re.search(r"no progress for ([\d.]+) s \(stall interval", error).group(1))
        assert stalled_for <= 2 * STALL_S, error
        assert maker["policy_version"] < version and maker["policy_version"] >= before, maker

        def trainer_failed() -> str | None:  # the queue's latest failure (`last_error` from the next step)
            status = h0.call("t", "status", timeout=5)
            text = "" if isinstance(status, Exception) else (status["weight_push"]["failures"].get("m") or "")
            return text if f"v{version} (full) to maker 'm'" in text else None

        trainer_error = wait_for("the trainer's push failing", trainer_failed, 30, poll=0.2)
        print(f"trainer, {time.monotonic() - cut:.1f} s after the cut: {trainer_error}")
        assert hosts.host(MAKER).address in trainer_error, trainer_error
        assert ok(h1.call("m", "status"))["policy_version"] < version  # still the version before
        hosts.link(MAKER, True)
        print(f"plugged back after {time.monotonic() - cut:.1f} s")

        newer = wait_for("newer weights on the maker", lambda: served(h0) > version and served(h0), 120)
        print(f"the maker serves v{newer} (> v{version}) at {time.monotonic() - started:.0f} s")
    finally:
        hosts.link(MAKER, True)
        for probe in (h0, h1):
            probe.close()
        hosts.run(TRAINER, ["detached-rl", "stop", "--force", "--address", hosts.head_address], timeout=120,
                  check=False)
