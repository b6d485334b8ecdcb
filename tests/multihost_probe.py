"""A long-lived Ray driver on one host for the multi-host tests: reads one JSON call per line on stdin,
answers one JSON line on stdout. Connected once, it asks actors directly (a call to an actor on its own host
needs no link), and saves the tests a process start and a Ray connection per question.

Calls: {"actor": name, "method": m, "args": [...], "timeout": s, "fresh": bool} -> {"ok": result} or
{"error": text}; {"rows": namespace} -> the actor table's rows (`detached_rl.cli.placing.ActorRow`).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys

import ray

HANDLES: dict[str, object] = {}  # found once: a lookup needs the head, a call to a local actor does not


def answer(request: dict) -> dict:
    """The result of one call, or the error's first line."""
    try:
        if "rows" in request:  # the actor table of a namespace (state, placed, required resources)
            from detached_rl.cli.placing import actor_rows

            return {"ok": [row.__dict__ for row in actor_rows(request["rows"]) or []]}
        if request.get("fresh") or request["actor"] not in HANDLES:
            HANDLES[request["actor"]] = ray.get_actor(request["actor"],
                                                      namespace=request.get("namespace", "detached_rl"))
        handle = HANDLES[request["actor"]]
        result = ray.get(getattr(handle, request["method"]).remote(*request.get("args", [])),
                         timeout=request.get("timeout", 10))
        return {"ok": result}
    except Exception as error:  # noqa: BLE001 - every error is an answer
        text = str(error).strip().splitlines()
        return {"error": f"{type(error).__name__}: {text[0] if text else ''}"}


def main() -> None:
    """Connect to the cluster named on the command line and answer calls until stdin closes; a call that hangs
    (Ray waiting on a lost node) is answered as timed out and left behind in its thread."""
    ray.init(address=sys.argv[1], namespace="detached_rl", log_to_driver=False)
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=32)
    for line in sys.stdin:
        if line.strip():
            request = json.loads(line)
            try:
                reply = pool.submit(answer, request).result(timeout=request.get("timeout", 10) + 5)
            except concurrent.futures.TimeoutError:
                reply = {"error": "TimeoutError: the call hung"}
            print(json.dumps(reply, default=str), flush=True)
    os._exit(0)  # threads stuck in Ray calls would keep the process


if __name__ == "__main__":
    main()
