"""Weight chunks in pieces on a real local Ray node: stored once, pulled a few pieces at a time, joined
exactly; a piece that never arrives fails the fetch (a stall), naming the update and the host."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from detached_rl.core.chunk_codec import encode_chunk
from detached_rl.core.transfer import TransferStalled
from detached_rl.core.wire_compression import CompressedPiece
from detached_rl.weights.ray_wire import PiecedChunk, fetch_chunk, node_ip, put_chunk, tracked_fetch
from detached_rl.weights.update import WeightManifest, WeightUpdate

pytestmark = pytest.mark.ray


def weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"w": torch.randn(700, 300, generator=generator),
            "b": torch.randn(300, generator=generator).half(), "step": torch.tensor(3)}


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("compression", ["none", "zlib"])
def test_a_chunk_in_pieces_comes_back_exactly_by_either_path(ray_cluster, compression) -> None:
    ray = ray_cluster
    original = weights()
    stored = put_chunk(original, piece_bytes=64 * 1024, compression=compression)
    piece = ray.get(stored.refs[0])
    assert isinstance(piece, CompressedPiece) == (compression == "zlib")
    assert isinstance(stored, PiecedChunk) and len(stored.refs) == -(-stored.total_bytes // (64 * 1024))
    assert stored.host == node_ip()
    assert_same(fetch_chunk(stored, timeout=30), original)  # this node's: one `get`
    far = dataclasses.replace(stored, host="10.0.0.99")  # as seen from another node: the windowed pull
    assert_same(fetch_chunk(far, timeout=30), original)
    assert_same(fetch_chunk(ray.put(encode_chunk(original)), timeout=30), original)  # a raw chunk ref


def test_a_piece_that_never_arrives_fails_the_update_as_stalled(ray_cluster) -> None:
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    def never(seconds: float) -> None:
        time.sleep(seconds)

    stored = put_chunk(weights(), piece_bytes=64 * 1024)
    blocked = never.remote(120)  # an object that does not come within the test: a dead link's piece
    refs = list(stored.refs)
    refs[len(refs) // 2] = blocked
    chunk = PiecedChunk(stored.layout, tuple(refs), "10.213.0.1")
    manifest = WeightManifest(version=7, kind="full", tensors=(), num_chunks=1,
                              total_bytes=stored.total_bytes)
    update = WeightUpdate(manifest, [chunk])
    seen = []
    fetch = tracked_fetch([update], stall_s=1.0, track=seen.append)
    with pytest.raises(TransferStalled) as failed:  # (the piece would come after 120 s: no hang)
        fetch(chunk)
    progress = seen[0]
    assert 0 < progress.done < progress.total  # the pieces before the blocked one arrived
    message = str(failed.value)
    for part in ("weight update v7 (full)", "from trainer at 10.213.0.1", "stall interval 1 s", "Mbit/s"):
        assert part in message, (part, message)
    ray.cancel(blocked, force=True)


def test_a_push_in_pieces_arrives_whole_and_its_progress_is_shown_meanwhile(ray_cluster, monkeypatch) -> None:
    import detached_rl.actors.transport as transport
    import detached_rl.weights.ray_wire as ray_wire

    payload = {"experiences": [weights(), weights()], "note": "é"}
    stored = dataclasses.replace(transport.put_payload(payload, piece_bytes=100_000), host="10.213.0.2")
    incoming = transport.IncomingPushes()
    seen = []
    real_wait = ray_wire._wait_local

    def wait_and_look(refs: list, timeout: float) -> list:  # the real wait; a look at the progress first
        seen.append(incoming.progress("m"))
        return real_wait(refs, timeout)

    monkeypatch.setattr(ray_wire, "_wait_local", wait_and_look)
    got = incoming.pull(stored, "m", 5.0)
    assert got["note"] == "é" and all(torch.equal(got["experiences"][1][k], v) for k, v in weights().items())
    assert len(seen) >= len(stored.refs) > 1 and seen[0]["host"] == node_ip()
    first = seen[0]["transfers"][0]
    assert first["total"] == stored.total_bytes and "experience push" in first["what"]
    assert "maker 'm'" in first["what"]
    assert seen[-1]["transfers"][0]["done"] > first["done"]
    assert incoming.progress("m")["transfers"] == []  # over


def test_a_trainer_takes_a_push_in_pieces_and_says_how_the_pushes_from_a_maker_arrive(ray_cluster) -> None:
    from detached_rl.actors.trainer import DetachedGRPOTrainer
    from detached_rl.actors.transport import put_payload
    from detached_rl.algorithms.grpo import GRPOConfig
    from detached_rl.models import SamplingConfig
    from detached_rl.trainer.config import TrainerConfig

    from .helpers import gpu_options, make_experience, tiny_policy

    ray = ray_cluster
    trainer = DetachedGRPOTrainer.options(name="pieces_trainer", namespace="detached_rl_tests",
                                          **gpu_options("trainer")).remote(
        "pieces_trainer", tiny_policy, TrainerConfig(train_batch_size=4),
        GRPOConfig(sampling=SamplingConfig(max_new_tokens=6)), namespace="detached_rl_tests")
    pushed = [make_experience(id=f"pieces-{i}", maker="m", group_id="g") for i in range(4)]
    payload = put_payload(pushed, piece_bytes=512)  # many pieces, pulled by the trainer
    assert len(payload.refs) > 2
    result = ray.get(trainer.push_experience_pieces.remote(payload, "m", 10.0), timeout=120)
    assert result.accepted == 4 and ray.get(trainer.buffer_length.remote(), timeout=30) == 4
    again = ray.get(trainer.push_experience_pieces.remote(put_payload(pushed), "m", 10.0), timeout=60)
    assert again.duplicates == 4  # the same ids: stored once
    answer = ray.get(trainer.push_progress.remote("m"), timeout=30)
    assert answer == {"host": node_ip(), "transfers": []}
    ray.kill(trainer)
