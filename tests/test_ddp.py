"""The DDP strategies (torch DDP, ColossalAI's TorchDDPPlugin): two gloo ranks in spawned processes train in
lock-step and agree through collectives.

On the CPU with `--device cuda` too: gloo reduces host tensors, and two NCCL ranks cannot share the one GPU a
test machine may have (the GPU path of a group runs in the Ray trainer-group tests when there are GPUs
enough).
"""

from __future__ import annotations

import ipaddress
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from detached_rl.models import Actor, LoraSettings, apply_lora, tiny_causal_lm
from detached_rl.strategies import DDPStrategy, NaiveStrategy, colossalai_available, make_strategy
from detached_rl.strategies.ddp import find_free_port, node_address
from detached_rl.strategies.optim import OptimizerConfig

WORLD_SIZE = 2
TIMEOUT_S = 120.0  # a hung collective fails the test instead of blocking CI
STEPS = 3
ROWS, PROMPT, RESPONSE = 2, 4, 4
OPTIM = OptimizerConfig(lr=1e-2, max_grad_norm=1.0)


def _batch(rank: int, step: int, vocab: int) -> torch.Tensor:
    """Rank- and step-specific token ids: every rank trains on different data."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(3, vocab, (ROWS, PROMPT + RESPONSE), generator=generator)


def _loss(model: torch.nn.Module, sequences: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the response tokens; every row has the same number of them."""
    mask = torch.ones(sequences.shape[0], RESPONSE, dtype=torch.long)
    return -model(sequences, torch.ones_like(sequences), mask).mean()


def _train(strategy, model: torch.nn.Module,
           batches: list[torch.Tensor]) -> tuple[torch.nn.Module, list[float]]:
    """Prepare `model` and take one optimizer step per batch; returns the prepared model and grad norms."""
    model, optimizer, _ = strategy.prepare_training(model, OPTIM)
    norms = []
    for sequences in batches:
        strategy.backward(_loss(model, sequences), model, optimizer)
        norms.append(strategy.optimizer_step(optimizer, model, OPTIM.max_grad_norm))
    return model, norms


def _params(model: torch.nn.Module, only_trainable: bool = False) -> dict[str, torch.Tensor]:
    return {
        name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad
        or not only_trainable
    }


def _scenarios(strategy: DDPStrategy) -> dict[str, Any]:
    """Everything the 2-rank tests check, run once per rank (one spawn keeps the module fast)."""
    rank = strategy.rank
    results: dict[str, Any] = {}

    # Full model; each rank starts from a different init, which DDP replaces by rank 0's.
    model, tokenizer = tiny_causal_lm("llama", seed=rank)
    batches = [_batch(rank, step, len(tokenizer)) for step in range(STEPS)]
    trained, norms = _train(strategy, Actor(model, tokenizer), batches)
    results["train"] = {
        "wrapped": strategy.unwrap(trained) is not trained,
        "unwrapped_is_actor": type(strategy.unwrap(trained)) is Actor,
        "params": _params(strategy.unwrap(trained)),
        "norms": norms,
    }

    lora_model = apply_lora(tiny_causal_lm("llama", seed=0)[0], LoraSettings(r=4))
    lora, optimizer, _ = strategy.prepare_training(Actor(lora_model, tokenizer), OPTIM)
    initial = _params(strategy.unwrap(lora), only_trainable=True)
    for sequences in batches[:2]:
        strategy.backward(_loss(lora, sequences), lora, optimizer)
        grads = {name: p.grad.clone() for name, p in strategy.unwrap(lora).named_parameters()
                 if p.grad is not None}
        strategy.optimizer_step(optimizer, lora, OPTIM.max_grad_norm)
    results["lora"] = {
        "wrapped": strategy.unwrap(lora) is not lora,
        "trainable": sorted(n for n, p in strategy.unwrap(lora).named_parameters() if p.requires_grad),
        "grads": grads,
        "initial": initial,
        "params": _params(strategy.unwrap(lora), only_trainable=True),
    }

    frozen = tiny_causal_lm("llama", seed=0)[0].requires_grad_(False)
    prepared = strategy.prepare_model(frozen)
    results["frozen"] = {"same_object": prepared is frozen,
                         "unwrap_same": strategy.unwrap(prepared) is frozen}

    # Checkpoint round trip through the strategy: a freshly prepared model and
    # optimizer get the trained state.
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        lora_state = _params(strategy.unwrap(lora), only_trainable=True)
        strategy.save_checkpoint(f"{directory}/ckpt", lora, optimizer, extra={"step": 2})
        fresh = apply_lora(tiny_causal_lm("llama", seed=0)[0], LoraSettings(r=4))
        fresh, fresh_optimizer, _ = strategy.prepare_training(Actor(fresh, tokenizer), OPTIM)
        extra = strategy.load_checkpoint(f"{directory}/ckpt", fresh, fresh_optimizer)
        restored = _params(strategy.unwrap(fresh), only_trainable=True)
        results["checkpoint"] = {
            "extra": extra,
            "equal": all(torch.equal(restored[k], v) for k, v in lora_state.items()),
            "optimizer_steps": [int(st["step"]) for st in fresh_optimizer.state_dict()["state"].values()][:1],
        }

    results["share"] = [strategy.gradient_share(1.0 if rank == 0 else 3.0), strategy.gradient_share(2.0)]

    # A strategy that shards weights: every rank joins the gather, rank 0 alone builds and pushes the update.
    from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner
    from detached_rl.trainer.core import TrainerCore

    strategy.shards_weights = True
    try:
        core = TrainerCore(f"t{rank}",
                           GRPOLearner(Actor(*tiny_causal_lm("llama", seed=0)), strategy, GRPOConfig()))
        core.weights.makers.update({f"maker_{rank}", f"maker_{rank + 2}"})
        puts: list[int] = []
        update, _ = core.weights.snapshot(lambda chunk: puts.append(len(chunk)) or len(puts))
        results["sharded"] = {"makers": core.weights.makers_of_this_rank(), "puts": sum(puts),
                              "specs": len(update.manifest.tensors), "pushes": core.weights.pushes_weights}
        del core
    finally:
        del strategy.shards_weights

    results["all_true"] = [strategy.all_true(True), strategy.all_true(rank == 0),
                           strategy.all_true(rank == 1)]
    metrics = {"loss": 1.0, "kl": 0.5, "tokens": 10.0, "num_samples": 2.0}
    if rank == 1:
        # Another insertion order: keys are matched by name.
        metrics = {"num_samples": 4.0, "tokens": 30.0, "kl": 1.5, "loss": 4.0}
    results["reduced"] = strategy.reduce_metrics(metrics, weight=1.0 if rank == 0 else 3.0)
    try:
        strategy.reduce_metrics({"loss": 1.0, f"only_on_rank_{rank}": 1.0}, weight=1.0)
    except ValueError as error:
        results["mismatch"] = str(error)
    results["broadcast"] = [
        strategy.broadcast_object({"from": rank, "list": [rank] * 3} if rank == 0 else None),
        strategy.broadcast_object(f"rank {rank}", src=1),
    ]
    results["gathered"] = strategy.all_gather_object({"rank": rank})
    if rank == 1:
        time.sleep(0.5)
    start = time.monotonic()
    strategy.barrier()
    results["barrier_wait_s"] = time.monotonic() - start
    results["listening"] = (strategy.master_port, listening_sockets())
    return results


def listening_sockets() -> list[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on, from /proc (IPv4 and IPv6)."""
    inodes = set()
    for descriptor in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{descriptor}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN, owned by this process
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                # /proc prints each 32-bit word of the address in host (little-endian) byte order.
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.append((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found


def _rank_main(target: Callable[[DDPStrategy], Any], rank: int, world_size: int, port: int, out: mp.Queue,
               name: str = "ddp") -> None:
    """Child process: join the group, run `target`, report (rank, ok, pickled result or traceback)."""
    torch.set_num_threads(1)
    strategy = make_strategy(name, rank=rank, world_size=world_size, master_addr="127.0.0.1",
                             master_port=port,
                             backend="gloo", timeout_s=60.0)
    try:
        out.put((rank, True, pickle.dumps(target(strategy))))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        strategy.destroy()


def run_ranks(target: Callable[[DDPStrategy], Any], world_size: int = WORLD_SIZE,
              strategy: str = "ddp") -> list[Any]:
    """Run `target(strategy)` on `world_size` spawned gloo ranks; returns each rank's result, by rank."""
    context = mp.get_context("spawn")
    out = context.Queue()
    port = find_free_port()
    processes = [
        context.Process(target=_rank_main, args=(target, rank, world_size, port, out, strategy), daemon=True)
        for rank in range(world_size)
    ]
    results: dict[int, Any] = {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for process in processes:
            process.start()
        while len(results) < world_size:
            try:
                rank, ok, payload = out.get(timeout=0.5)
            except queue.Empty:
                crashed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if crashed:
                    pytest.fail(f"a rank died without reporting (exit codes {crashed})")
                if time.monotonic() > deadline:
                    pytest.fail(f"ranks did not finish within {TIMEOUT_S:.0f}s")
                continue
            if not ok:
                pytest.fail(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
    finally:
        finished = len(results) == world_size  # else some rank may be stuck in a collective: stop it now
        for process in processes:
            process.join(timeout=10 if finished else 0)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        out.close()
    return [results[rank] for rank in range(world_size)]


NO_COLOSSALAI = "colossalai is not installed (`make colossalai` installs it beside torch)"


@pytest.fixture(scope="module", params=[
    "ddp",
    pytest.param("colossalai_ddp",
                 marks=pytest.mark.skipif(not colossalai_available(), reason=NO_COLOSSALAI)),
])
def ranks(request) -> list[dict[str, Any]]:
    return run_ranks(_scenarios, strategy=request.param)


def test_ranks_train_to_identical_parameters_equal_to_one_process_on_all_data(ranks):
    first, second = (r["train"] for r in ranks)
    assert first["wrapped"] and second["wrapped"]
    assert first["unwrapped_is_actor"] and second["unwrapped_is_actor"]
    assert first["params"].keys() == second["params"].keys()
    assert all(torch.equal(first["params"][k], second["params"][k]) for k in first["params"])
    assert first["norms"] == second["norms"]

    # One process, rank 0's init, both ranks' rows per step: the mean loss over the union.
    actor = Actor(*tiny_causal_lm("llama", seed=0))
    initial = _params(actor)
    vocab = len(actor.tokenizer)
    batches = [torch.cat([_batch(r, step, vocab) for r in range(WORLD_SIZE)]) for step in range(STEPS)]
    reference, norms = _train(NaiveStrategy("cpu"), actor, batches)
    assert norms == pytest.approx(first["norms"], rel=1e-5)
    for name, expected in _params(reference).items():
        torch.testing.assert_close(first["params"][name], expected, rtol=0, atol=1e-5, msg=name)
    assert any(not torch.equal(initial[k], v) for k, v in first["params"].items())


def test_checkpoints_round_trip_model_and_optimizer(ranks):
    for r in ranks:
        assert r["checkpoint"] == {"extra": {"step": 2}, "equal": True, "optimizer_steps": [2]}


def test_gradient_share_weights_each_rank_by_its_part_of_all_data(ranks):
    assert [r["share"] for r in ranks] == [[0.5, 1.0], [1.5, 1.0]]


def test_with_sharded_weights_only_rank_zero_builds_and_pushes_to_every_maker(ranks):
    first, second = (r["sharded"] for r in ranks)
    assert first["makers"] == ["maker_0", "maker_1", "maker_2", "maker_3"] and second["makers"] == []
    assert first["pushes"] and not second["pushes"]
    assert first["puts"] > 0 and first["specs"] >= first["puts"] and second["puts"] == second["specs"] == 0


def test_all_true_is_false_when_any_rank_says_false(ranks):
    assert [r["all_true"] for r in ranks] == [[True, False, False]] * WORLD_SIZE


def test_reduce_metrics_weights_means_and_sums_counts(ranks):
    expected = {"kl": (0.5 + 1.5 * 3) / 4, "loss": (1.0 + 4.0 * 3) / 4, "num_samples": 6.0, "tokens": 40.0}
    for result in ranks:
        assert list(result["reduced"]) == sorted(expected)
        assert result["reduced"] == pytest.approx(expected)


def test_reduce_metrics_refuses_different_keys_on_every_rank(ranks):
    assert all("different metric keys" in r.get("mismatch", "") for r in ranks)


def test_broadcast_object_and_barrier(ranks):
    assert [r["broadcast"] for r in ranks] == [[{"from": 0, "list": [0, 0, 0]}, "rank 1"]] * WORLD_SIZE
    assert [r["gathered"] for r in ranks] == [[{"rank": 0}, {"rank": 1}]] * WORLD_SIZE
    assert ranks[0]["barrier_wait_s"] > 0.3  # rank 0 waited for the sleeping rank 1


def test_the_group_store_listens_on_master_addr_only(ranks):
    port, listening = ranks[0]["listening"]
    assert ("127.0.0.1", port) in listening
    for rank in ranks:  # gloo's own sockets too: nothing of a rank listens on every interface
        assert all(not ipaddress.ip_address(address).is_unspecified for address, _ in rank["listening"][1])


def test_frozen_models_are_not_wrapped(ranks):
    assert all(r["frozen"] == {"same_object": True, "unwrap_same": True} for r in ranks)


def test_lora_trains_under_ddp_with_only_adapter_gradients(ranks):
    first, second = (r["lora"] for r in ranks)
    assert first["wrapped"]
    assert first["trainable"] and all("lora_" in name for name in first["trainable"])
    assert sorted(first["grads"]) == first["trainable"]
    for key in ("grads", "params"):
        assert all(torch.equal(first[key][k], second[key][k]) for k in first[key])
    assert any(not torch.equal(first["initial"][k], first["params"][k]) for k in first["params"])


def test_a_group_of_one_process_trains_and_its_collectives_are_identities():
    strategy = DDPStrategy(0, 1, "127.0.0.1", find_free_port(), backend="gloo", timeout_s=30)
    try:
        strategy.setup()
        strategy.setup()  # idempotent
        model, tokenizer = tiny_causal_lm("llama", seed=0)
        trained, norms = _train(strategy, Actor(model, tokenizer), [_batch(0, 0, len(tokenizer))])
        assert isinstance(trained, DistributedDataParallel) and norms[0] > 0
        assert strategy.unwrap(trained) is trained.module
        assert strategy.all_true(True) and not strategy.all_true(False)
        assert strategy.reduce_metrics({"loss": 2.0, "tokens": 7.0},
                                       weight=3.0) == {"loss": 2.0, "tokens": 7.0}
        assert strategy.broadcast_object([1, 2]) == [1, 2]
        strategy.barrier()
        del trained  # a DDP model must not outlive its process group (see DDPStrategy.destroy)
    finally:
        strategy.destroy()
    assert not dist.is_initialized()
    strategy.destroy()  # nothing left to destroy


def test_a_master_addr_that_is_not_this_machines_is_refused_by_rank_zero():
    strategy = DDPStrategy(0, 1, "203.0.113.7", find_free_port(), backend="gloo", timeout_s=30)  # TEST-NET-3
    with pytest.raises(RuntimeError, match="cannot listen on DDPStrategy.master_addr '203.0.113.7'"):
        strategy.setup()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"world_size": 0}, "world_size"),
        ({"rank": 2}, "rank"),
        ({"rank": -1}, "rank"),
        ({"master_addr": ""}, "master_addr"),
        ({"master_port": 0}, "master_port"),
        ({"master_port": 70000}, "master_port"),
        ({"backend": "mpi"}, "backend"),
        ({"timeout_s": 0}, "timeout_s"),
        # Without CUDA, nccl itself is refused; with CUDA, nccl is fine and a CPU device is what is refused.
        ({"device": "cpu", "backend": "nccl"} if torch.cuda.is_available()
         else {"device": "cuda:0", "backend": "nccl"},
         "device" if torch.cuda.is_available() else "backend"),
    ],
)
def test_bad_arguments_are_named(kwargs, argument):
    args = {"rank": 0, "world_size": 2, "master_addr": "127.0.0.1", "master_port": 29500, **kwargs}
    with pytest.raises(ValueError, match=argument):
        DDPStrategy(**args)


def test_make_strategy_and_address_helpers():
    strategy = make_strategy("ddp", rank=1, world_size=2, master_addr="10.0.0.1", master_port=29500)
    assert isinstance(strategy, DDPStrategy) and (strategy.rank, strategy.world_size) == (1, 2)
    assert not strategy.is_rank_zero and strategy.name == "ddp"
    ipaddress.ip_address(node_address())
    port = find_free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
