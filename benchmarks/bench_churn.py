"""Churn: maker hosts join and vanish every ~2 minutes of a 10-minute run (issue 37 item 4).

    .venv/bin/python benchmarks/bench_churn.py                                  # 600 s, an event every 120 s
    .venv/bin/python benchmarks/bench_churn.py --duration 240 --every 80        # shorter

Needs root (the multi-host harness, `tests/hosts/`). Hosts on one bridge, every node started with plain
`ray start`: h0 (resource trainer_host) with its link shaped to `--uplink` Mbit/s (20), where
`detached-rl trainer` is typed; h1..h3 start with a maker each (`detached-rl maker` typed on its own host,
placed there by label), their links cycling through `--maker-rates` (100, 20, 5 Mbit/s) with `--delay` ms
and `--loss` %. Every `--every` s one fresh host joins (its node started, then its maker job typed) and
the oldest maker host vanishes, alternately its node killed (SIGKILL) and its link cut for good. The tiny
job, with its updates relayed (`trainer.weight_relay_min_bytes=0`), so vanishing relays are part of it.
After `--duration` s the trainer is stopped as a user would (`stop`), and the makers stop with it.

Printed and written to benchmarks/results/churn.json: per departure, the seconds until the trainer's
`status` names the maker (`makers_silent` or `makers_lost`); per join, the seconds from its job typed to
its registration, its registration pull (bytes, seconds) and the seconds to its first batch made, with
that batch's version against the trainer's at joining; steps trained; the ledger once stopped
(received = trained + in buffer + dropped by reason; per surviving maker what the trainer received equals
what the maker was told was taken plus what the trainer dropped as stale; per departed maker at least
what it was told before it left).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_swarm import add_link_arguments  # noqa: E402
from bench_thin_links import save  # noqa: E402

from tests.hosts import Hosts, LinkCharacter  # noqa: E402  (bench_thin_links put the repository on the path)
from tests.hosts.network import NetworkError, require_tools  # noqa: E402
from tests.multihost import Probe, tiny_config_path  # noqa: E402

TRAINER, FIRST = 0, 3  # the trainer's host; makers on hosts 1..FIRST at the start
NAME = "churn"


class Churn:
    """One churn run on `hosts`: the trainer, the makers, the events and what was measured of them."""

    def __init__(self, hosts: Hosts, args: argparse.Namespace) -> None:
        self.hosts, self.args = hosts, args
        self.probe: Probe | None = None
        self.live: list[int] = []  # maker hosts serving, oldest first
        self.departures: list[dict[str, Any]] = []
        self.joins: list[dict[str, Any]] = []
        self.jobs: list[subprocess.Popen[str]] = []

    def ask(self, actor: str, method: str) -> Any:
        assert self.probe is not None
        return self.probe.ask(actor, method)

    def start_maker(self, index: int) -> float:
        """`detached-rl maker` typed on host `index`; returns when it was typed (the job returns once the
        maker is started)."""
        typed = time.monotonic()
        job = self.hosts.popen(index, [
            "detached-rl", "maker", "--name", f"m{index}", "--trainers", NAME, "--address",
            self.hosts.head_address, "--config", tiny_config_path(),
            "--set", f"maker.label_selector={{host: h{index}}}"])
        self.jobs.append(job)
        out, _ = job.communicate(timeout=300)
        if job.returncode != 0:
            raise RuntimeError(f"the maker job on h{index} exited {job.returncode}: {out[-2000:]}")
        self.live.append(index)
        return typed

    def start(self) -> None:
        """The trainer job on h0, then one maker job per first host."""
        trainer = self.hosts.popen(TRAINER, [
            "detached-rl", "trainer", "--name", NAME, "--steps", "1000000",
            "--address", self.hosts.head_address,
            "--config", tiny_config_path(), "--set", "trainer_group.resources={trainer_host: 1}",
            "--set", "trainer.weight_relay_min_bytes=0", *sum((["--set", s] for s in self.args.set), [])])
        self.jobs.append(trainer)
        out, _ = trainer.communicate(timeout=300)
        if trainer.returncode != 0:
            raise RuntimeError(f"the trainer job exited {trainer.returncode}: {out[-2000:]}")
        self.probe = Probe(self.hosts, TRAINER)
        for index in range(1, FIRST + 1):
            self.start_maker(index)

    def depart(self, cut: bool) -> dict[str, Any]:
        """The oldest maker host vanishes: its link cut for good, or its node killed."""
        index = self.live.pop(0)
        name = f"m{index}"
        pushed = self.ask(name, "status")["push"]
        told = pushed["per_trainer"].get(NAME, {}).get("accepted", 0)
        if cut:
            self.hosts.link(index, False)
        else:
            self.hosts.kill_node(index, signal.SIGKILL)
        row = {"maker": name, "host": index, "how": "link cut" if cut else "node killed",
               "at": time.monotonic(), "accepted_before": told, "named_after_s": None,
               "dropped_stale_before": pushed["dropped_stale_by_trainer"]}
        self.departures.append(row)
        return row

    def join(self, index: int) -> dict[str, Any]:
        """A fresh host joins: its Ray node, then its maker job."""
        version = self.ask(NAME, "status")["policy_version"]
        started = time.monotonic()
        self.hosts.start_node(index)
        node_s = time.monotonic() - started
        typed = self.start_maker(index)
        row = {"maker": f"m{index}", "host": index, "trainer_version_at_join": version,
               "node_start_s": node_s, "typed": typed, "first_batch_s": None}
        self.joins.append(row)
        return row

    def watch(self) -> None:
        """Note what the events wait for: departures named by the trainer, joiners' first batches."""
        status = self.ask(NAME, "status")
        named = {**status.get("makers_lost", {}), **status.get("makers_silent", {})}
        now = time.monotonic()
        for row in self.departures:
            if row["named_after_s"] is None and row["maker"] in named:
                row["named_after_s"] = now - row["at"]
                row["named_as"] = str(named[row["maker"]])[:200]
        for row in self.joins:
            if row["first_batch_s"] is None:
                maker = self.ask(row["maker"], "status")
                if maker.get("first_batch_version") is not None:
                    row["first_batch_s"] = now - row["typed"]
                    row["first_batch_version"] = maker["first_batch_version"]
                    row["registration_pull"] = maker.get("registration_pull")
                    row.update(maker.get("joined") or {})

    def stop(self) -> dict[str, Any]:
        """Stop the trainer as a user would; once it and the makers stopped, the ledger."""
        self.ask(NAME, "stop")
        stopping = time.monotonic()
        while self.ask(NAME, "status")["state"] != "stopped":
            if time.monotonic() - stopping > 180:
                raise RuntimeError("the trainer did not stop within 180 s")
            time.sleep(1)
        stopped_s = time.monotonic() - stopping
        deadline = time.monotonic() + 120
        while not all(self.ask(f"m{i}", "status")["state"] == "stopped" for i in self.live):
            if time.monotonic() > deadline:
                raise RuntimeError("the makers did not stop within 120 s of the trainer")
            time.sleep(1)
        buffer = self.ask(NAME, "buffer_stats")
        status = self.ask(NAME, "status")
        per_maker = buffer["per_maker"]
        survivors = {}
        for index in self.live:
            pushed = self.ask(f"m{index}", "status")["push"]
            taken = pushed["per_trainer"][NAME]["accepted"] + pushed["dropped_stale_by_trainer"]
            survivors[f"m{index}"] = {"received": per_maker.get(f"m{index}", {}).get("received", 0),
                                      "told_taken": taken,
                                      "dropped_stale": pushed["dropped_stale_by_trainer"],
                                      "link_mbit": self.hosts.rates_mbit.get(index)}
        departed = {row["maker"]: {"received": per_maker.get(row["maker"], {}).get("received", 0),
                                   "told_before": row["accepted_before"],
                                   "dropped_stale_before": row["dropped_stale_before"],
                                   "link_mbit": self.hosts.rates_mbit.get(row["host"])}
                    for row in self.departures}
        dropped = sum(buffer["dropped"].values())
        return {"stopped_after_s": stopped_s, "steps": status.get("steps"),
                "policy_version": status["policy_version"], "received": buffer["received"],
                "trained": buffer["sampled"], "in_buffer": buffer["in_buffer"], "dropped": buffer["dropped"],
                "adds_up": buffer["received"] == buffer["sampled"] + buffer["in_buffer"] + dropped
                and bool(buffer["accounting_ok"]),
                "survivors": survivors, "departed": departed,
                "survivors_add_up": all(s["received"] == s["told_taken"] for s in survivors.values()),
                "departed_add_up": all(d["received"] >= d["told_before"] for d in departed.values()),
                "weight_push": {k: v for k, v in status.get("weight_push", {}).items() if k != "relay_tree"}}

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
        self.hosts.run(TRAINER, ["detached-rl", "stop", "--force", "--address", self.hosts.head_address],
                       check=False, timeout=120)
        for job in self.jobs:
            if job.poll() is None:
                job.kill()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Fresh hosts, one churn run: its figures."""
    events = max(0, int((args.duration - 1) // args.every))
    count = 1 + FIRST + events
    rates = {i: args.maker_rates[(i - 1) % len(args.maker_rates)] for i in range(1, count)}
    character = LinkCharacter(args.delay, 0.0, args.loss / 100)
    links = {} if character.plain else {i: character for i in range(1, count)}
    with Hosts(count, rates_mbit={TRAINER: args.uplink, **rates}, links=links, start_with="ray start",
               resources={TRAINER: {"trainer_host": 1}}, cpus={TRAINER: 3, **{i: 1 for i in range(1, count)}},
               labels={i: {"host": f"h{i}"} for i in range(count)},
               bare=set(range(FIRST + 1, count))) as hosts:
        churn = Churn(hosts, args)
        try:
            churn.start()
            begun = time.monotonic()
            first_version = churn.ask(NAME, "status")["policy_version"]
            print(f"hosts up ({hosts.network.emulation or 'no'} link emulation), trainer at "
                  f"v{first_version}, makers on h1..h{FIRST}; {events} joins and departures, "
                  f"one every {args.every:g} s",
                  flush=True)
            for event in range(events):
                while time.monotonic() < begun + (event + 1) * args.every:
                    churn.watch()
                    time.sleep(0.5)
                joined = churn.join(FIRST + 1 + event)
                left = churn.depart(cut=event % 2 == 1)
                print(f"t={time.monotonic() - begun:.0f} s: {joined['maker']} joined (node up in "
                      f"{joined['node_start_s']:.0f} s); {left['maker']} vanished ({left['how']})",
                      flush=True)
            # the last departure is given a minute to be named, however late the events ran
            while time.monotonic() < max(begun + args.duration, churn.departures[-1]["at"] + 60
                                         if churn.departures else 0):
                churn.watch()
                time.sleep(0.5)
            churn.watch()
            ledger = churn.stop()
            return {"duration_s": time.monotonic() - begun, "first_version": first_version,
                    "departures": [{k: v for k, v in r.items() if k != "at"} for r in churn.departures],
                    "joins": [{k: v for k, v in r.items() if k != "typed"} for r in churn.joins],
                    "ledger": ledger}
        finally:
            churn.close()


def report(result: dict[str, Any]) -> None:
    """The run as a few lines."""
    ledger = result["ledger"]
    print(f"\n{result['duration_s']:.0f} s; trained v{result['first_version']} -> "
          f"v{ledger['policy_version']}; the trainer stopped "
          f"{ledger['stopped_after_s']:.0f} s after it was asked to")
    for row in result["departures"]:
        named = "never" if row["named_after_s"] is None else f"{row['named_after_s']:.1f} s"
        print(f"  {row['maker']} ({row['how']}): named in status after {named}")
    for row in result["joins"]:
        first = "never" if row["first_batch_s"] is None else f"{row['first_batch_s']:.1f} s"
        print(f"  {row['maker']} joined at trainer v{row['trainer_version_at_join']}: first batch {first} "
              f"after its job was typed, {row.get('first_batch_after_s')} s after its registration (at "
              f"v{row.get('registered_version')}; pull {row.get('registration_pull')}), made with "
              f"v{row.get('first_batch_version')}")
    print(f"  ledger: {ledger['received']} received = {ledger['trained']} trained + {ledger['in_buffer']} in "
          f"buffer + {ledger['dropped']} dropped: {'adds up' if ledger['adds_up'] else 'DOES NOT ADD UP'}; "
          f"survivors {'add up' if ledger['survivors_add_up'] else 'DO NOT ADD UP'} {ledger['survivors']}; "
          f"departed {'add up' if ledger['departed_add_up'] else 'DO NOT ADD UP'} {ledger['departed']}")
    print(f"  weight push: {ledger['weight_push']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds from the first makers to stop")
    parser.add_argument("--every", type=float, default=120.0, help="seconds between join-and-leave events")
    add_link_arguments(parser)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "churn.json")
    args = parser.parse_args()
    args.plot = None
    if args.every <= 0 or args.duration <= 0:
        parser.error("--duration and --every are positive seconds")
    try:
        require_tools()
    except NetworkError as error:
        sys.exit(f"bench_churn: {error}")
    result = run(args)
    print(json.dumps(result, default=str), flush=True)
    report(result)
    save(args, [result], None)


if __name__ == "__main__":
    main()
