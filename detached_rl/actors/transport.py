"""Ray transport: actor names and namespaces, waiting with timeouts, and the weight-chunk wire format.

Actors find each other only by name and namespace (`attach`), never by handles passed
around by a driver, so makers and trainers may start in any order and in separate jobs. A
namespace left out is the caller's own Ray namespace when the driver set one, else `detached_rl`
(`resolve_namespace`).
Every wait here has a timeout. Weight chunks travel as raw byte arrays (`put_chunk`): each
chunk is `ray.put` once and the same reference goes to every maker.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import ray
import torch

from detached_rl.core.chunk_codec import decode_chunk, encode_chunk
from detached_rl.core.namespace import DEFAULT_NAMESPACE
from detached_rl.core.weight_sync import ApplyResult, WeightUpdate

logger = logging.getLogger(__name__)



def _anonymous(namespace: str) -> bool:
    """True for the namespace Ray makes up for a driver that named none (`ray.init()`): a random uuid4."""
    try:
        parsed = uuid.UUID(namespace)
    except ValueError:
        return False
    return parsed.version == 4 and str(parsed) == namespace


def default_namespace() -> str:
    """Where actors meet when no namespace is given: the Ray job's namespace when one was set, else
    `DEFAULT_NAMESPACE`. In a driver that is its `ray.init(namespace=...)`; inside an actor, the namespace of
    the driver that created it (Ray reports the job's, not the actor's own `.options(namespace=...)`)."""
    if ray.is_initialized():
        current = ray.get_runtime_context().namespace
        if current and not _anonymous(current):
            return current
    return DEFAULT_NAMESPACE


def resolve_namespace(namespace: str | None) -> str:
    """`namespace`, or `default_namespace()` when it is None or empty."""
    return namespace or default_namespace()


def get_all(refs: Sequence[Any], timeout: float) -> list[Any]:
    """`ray.get` of every ref within `timeout`; on errors, raise the first only after all were retrieved.

    A plain `ray.get(list)` raises at the first failed ref and leaves the others unretrieved, so Ray
    later logs their errors as unhandled (a second traceback on the user's terminal).
    """
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
    results: list[Any] = []
    first_error: BaseException | None = None
    for ref in refs:
        if ref not in ready:
            continue
        try:
            results.append(ray.get(ref))
        except Exception as error:  # noqa: BLE001 - raised below, after every ref was retrieved
            first_error = first_error or error
    if first_error is not None:
        raise first_error
    if pending:
        raise ray.exceptions.GetTimeoutError(f"{len(pending)} of {len(refs)} calls did not finish within "
                                             f"{timeout:.0f} s")
    return results


def attach(name: str, namespace: str | None = None, timeout: float = 60.0, poll_interval: float = 0.2):
    """The handle of the named actor, waiting up to `timeout` s for it to exist
    (namespace: `resolve_namespace`)."""
    namespace = resolve_namespace(namespace)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no actor named {name!r} in Ray namespace {namespace!r} after {timeout:.1f} s "
                    "(is it started, and in this namespace?)"
                ) from None
            time.sleep(poll_interval)


def put_chunk(chunk: dict[str, torch.Tensor]) -> Any:
    """`ray.put` a weight chunk in the wire format of `core.chunk_codec` (shared by
    every maker without copies)."""
    return ray.put(encode_chunk(chunk))


def fetch_chunk(ref: Any, timeout: float) -> dict[str, torch.Tensor]:
    """`ray.get` a chunk stored by `put_chunk` as tensors viewing the object store's memory (read-only)."""
    return decode_chunk(ray.get(ref, timeout=timeout))


def ray_fetch(timeout: float) -> Callable[[Any], dict[str, torch.Tensor]]:
    """A chunk fetcher for `WeightReceiver.receive`: `fetch_chunk` with `timeout`."""
    return lambda ref: fetch_chunk(ref, timeout)


def send_weight_update(maker: str, update: WeightUpdate, namespace: str) -> Future:
    """Send `update` to the maker named `maker`; a future of its acknowledgement
    (`LookupError` if no such actor)."""
    try:
        handle = ray.get_actor(maker, namespace=namespace)
    except ValueError:
        raise LookupError(f"no maker named {maker!r} in namespace {namespace!r}") from None
    return handle.apply_weight_update.remote(update).future()


def dispatch_weight_update(update: WeightUpdate, makers: Sequence[str], namespace: str, timeout: float
                           ) -> dict[str, ApplyResult | BaseException]:
    """Send the same update (the same chunk refs) to every maker at once and wait (at most `timeout` s in all)
    for each maker's acknowledgement or error."""
    pending: dict[str, Future] = {}
    results: dict[str, ApplyResult | BaseException] = {}
    for name in makers:
        try:
            pending[name] = send_weight_update(name, update, namespace)
        except LookupError as error:
            results[name] = error
    deadline = time.monotonic() + timeout
    for name, future in pending.items():
        try:
            results[name] = future.result(timeout=max(deadline - time.monotonic(), 0.01))
        except Exception as error:  # noqa: BLE001 - that maker's result
            results[name] = error
    return results
