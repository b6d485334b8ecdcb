"""Every tensor the library creates follows its inputs' (or its strategy's) device.

On the CPU a constructor that forgets `device=` is invisible: the tensor lands on the CPU, where
the inputs are. Two CPU-runnable checks make it visible:

* inputs on `meta` (shapes, dtypes and devices without data): a pure tensor function must return
  `meta` tensors; a constructor without `device=` makes a CPU tensor and the function either fails
  (mixing CPU and meta) or returns it;
* inputs on the CPU while tensor constructors default to `meta` (`with torch.device("meta")`), for
  functions that read data (`unique`, `nonzero`, `.tolist()`, which `meta` cannot run): every output
  must be on the CPU with the same values as outside the block; a constructor without `device=`
  makes a meta tensor, which leaks into the outputs or fails the first data read.

The same functions run on a CUDA device where there is one (the `cuda` cases; skipped here).
"""

from __future__ import annotations

import pytest
import torch

from detached_rl import Experience, collate, uncollate
from detached_rl.algorithms.advantages import (
    AdvantageInputs,
    AdvantageSettings,
    compute_gae,
    get_advantage_estimator,
    group_advantages,
    rewards_to_go,
    scores_at_last_token,
)
from detached_rl.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss
from detached_rl.algorithms.grpo import overlong_penalty
from detached_rl.algorithms.kl import KL_KINDS, kl_estimate
from detached_rl.algorithms.losses import policy_loss, truncated_importance_weight, value_loss
from detached_rl.algorithms.masks import broadcast_to_tokens, masked_mean, masked_sum, masked_whiten
from detached_rl.algorithms.ppo import TokenWeightedMeans, micro_batches
from detached_rl.core.devices import host_floats, pin_for, to_device
from detached_rl.core.sampling import SamplingConfig, entropy_from_logits, process_logits, token_log_probs
from detached_rl.models import FunctionReward
from detached_rl.models._forward import position_ids_from_mask
from detached_rl.models.loaders import tiny_causal_lm, tiny_tokenizer
from detached_rl.models.scalar_heads import last_token_index
from detached_rl.scorer.core import Scorer
from detached_rl.scorer.requests import ScoreRequest
from detached_rl.strategies import DDPStrategy

META = torch.device("meta")
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                      reason="no CUDA device here; the GPU lane runs it"))
B, T, V = 4, 5, 11


def token_batch(device: torch.device | str) -> dict[str, torch.Tensor]:
    """[B, T] token-level tensors with ragged masks (one row empty), on `device`."""
    generator = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    tensors = {
        "log_probs": -torch.rand(B, T, generator=generator),
        "old_log_probs": -torch.rand(B, T, generator=generator),
        "ref_log_probs": -torch.rand(B, T, generator=generator),
        "advantages": torch.randn(B, T, generator=generator),
        "values": torch.randn(B, T, generator=generator),
        "returns": torch.randn(B, T, generator=generator),
        "rewards": torch.randn(B, T, generator=generator),
        "scores": torch.randn(B, generator=generator),
        "logits": torch.randn(B, T, V, generator=generator),
        "tokens": torch.randint(0, V, (B, T), generator=generator),
        "mask": mask,
    }
    return {name: t.to(device) for name, t in tensors.items()}


def pure_outputs(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the data-independent tensor functions return for the batch `x` (any device, meta included)."""
    mask, lp = x["mask"], x["log_probs"]
    sampling = SamplingConfig(temperature=0.7, top_k=4, top_p=0.8)
    out = {
        "position_ids_from_mask": position_ids_from_mask(mask),
        "last_token_index": last_token_index(mask),
        "process_logits": process_logits(x["logits"], sampling),
        "token_log_probs": token_log_probs(x["logits"], x["tokens"]),
        "entropy_from_logits": entropy_from_logits(process_logits(x["logits"], sampling)),
        "masked_sum": masked_sum(lp, mask, dim=-1),
        "masked_mean": masked_mean(lp, mask),
        "broadcast_to_tokens": broadcast_to_tokens(x["scores"], mask),
        "rewards_to_go": rewards_to_go(x["rewards"], mask, gamma=0.9),
        "rewards_to_go_undiscounted": rewards_to_go(x["rewards"], mask),
        "scores_at_last_token": scores_at_last_token(x["scores"], mask),
        "group_advantages_by_size": group_advantages(x["scores"], group_size=2),
        "group_advantages_by_ids": group_advantages(x["scores"], group_ids=["a", "b", "a", "c"],
                                                    method="rloo"),
        "truncated_importance_weight": truncated_importance_weight(x["old_log_probs"], lp, 2.0, mask),
        "overlong_penalty": overlong_penalty(mask.sum(1), 5, 2, 1.0),
    }
    out.update(zip(("gae_advantages", "gae_returns"), compute_gae(x["rewards"], x["values"], mask, 1.0, 0.95),
                   strict=True))
    for kind in KL_KINDS:
        out[f"kl_{kind}"] = kl_estimate(lp, x["ref_log_probs"], kind)
    for mode in LOSS_AGG_MODES:
        out[f"aggregate_{mode}"] = aggregate_loss(lp, mask, mode)
    loss, stats = policy_loss(lp, x["old_log_probs"], x["advantages"], mask, clip_high=0.28, dual_clip=3.0,
                              weights=x["values"].abs())
    out["policy_loss"] = loss
    out.update({f"policy_{k}": v for k, v in stats.items()})
    loss, stats = value_loss(x["values"], x["returns"], x["returns"] + 0.1, mask, clip=0.2)
    out["value_loss"] = loss
    out.update({f"value_{k}": v for k, v in stats.items()})
    return out


def test_pure_tensor_functions_return_tensors_on_their_inputs_device():
    outputs = pure_outputs(token_batch(META))
    assert {name: t.device for name, t in outputs.items() if t.device != META} == {}
    assert len(outputs) > 30


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_pure_tensor_functions_give_the_cpu_values_on_any_device(device):
    want = pure_outputs(token_batch("cpu"))
    got = pure_outputs(token_batch(device))
    for name, value in got.items():
        assert value.device.type == torch.device(device).type, name
        torch.testing.assert_close(value.cpu(), want[name], msg=name)


def experiences(n: int = 5) -> list[Experience]:
    """Ragged host experiences in two groups, some with values (all or none per
    batch) and per-token rewards."""
    out = []
    for i in range(n):
        prompt, response = 2 + i % 3, 1 + (i * 2) % 4
        reward = torch.full((response,), 0.5) if i == 1 else torch.tensor(float(i))
        out.append(Experience(torch.arange(3, 3 + prompt), torch.arange(20, 20 + response),
                              -torch.rand(response),
                              reward, policy_version=i, group_id="ab"[i % 2], values=torch.randn(response)))
    return out


def batch_tensors(batch) -> dict[str, torch.Tensor]:
    return {name: value for name, value in vars(batch).items() if isinstance(value, torch.Tensor)}


def test_collate_pads_on_the_host_and_moves_the_batch_to_the_device_it_is_given():
    batch = collate(experiences(), pad_token_id=0, device=META)
    tensors = batch_tensors(batch)
    assert "values" in tensors and {name: t.device for name, t in tensors.items() if t.device != META} == {}
    assert not pin_for("cpu") and not pin_for(None) and pin_for("cuda:0")


def test_select_uncollate_and_metrics_build_nothing_off_the_batch_device():
    exps = experiences()
    batch = collate(exps, pad_token_id=0)
    rows = [3, 1]
    want_select = batch_tensors(batch.select(rows))
    want_back = uncollate(batch)
    with torch.device(META):  # a tensor built without device= lands on meta
        sub = batch.select(torch.tensor(rows, device="cpu"))
        back = uncollate(batch)
        sums = TokenWeightedMeans()
        sums.add({"a": torch.tensor(2.0, device="cpu"), "b": 1.0}, 3.0)
        sums.add({"a": torch.tensor(4.0, device="cpu")}, 1.0)
        means = sums.means()
        floats = host_floats({"x": torch.tensor(1.5, device="cpu"), "y": 2})
    for name, value in batch_tensors(sub).items():
        assert value.device.type == "cpu", name
        assert torch.equal(value, want_select[name]), name
    assert sub.ids == [exps[3].id, exps[1].id] and sub.prompt_length == 3  # the longer prompt is 3
    for got, want in zip(back, want_back, strict=True):
        assert got.to_dict() == want.to_dict()
    assert [e.to_dict() for e in back] == [e.to_dict() for e in exps]
    assert means == {"a": 2.5, "b": 1.0} and floats == {"x": 1.5, "y": 2.0}


def test_micro_batches_draw_their_order_from_the_cpu_generator_and_weigh_tokens_on_the_host():
    batch = collate(experiences(6), pad_token_id=0)
    torch.manual_seed(0)
    want = [(m.ids, w, t, last) for m, w, t, last in micro_batches(batch, 2, 4, 3)]
    torch.manual_seed(0)
    with torch.device(META):
        got = [(m.ids, w, t, last) for m, w, t, last in micro_batches(batch, 2, 4, 3)]
    assert got == want and len(got) == 6
    tokens = batch.response_mask.sum(1).tolist()
    for ids, weight, mini_tokens, _ in got:
        assert weight == pytest.approx(sum(tokens[batch.ids.index(i)] for i in ids) / mini_tokens)


def test_data_dependent_advantages_stay_on_their_inputs_device():
    x = token_batch("cpu")
    mask = x["mask"][:3]  # no empty row: every sequence has a last token
    inputs = AdvantageInputs(mask=mask, scores=x["scores"][:3], token_rewards=x["rewards"][:3],
                             group_ids=["g", None, "g"])
    names = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
    want = {name: get_advantage_estimator(name)(inputs, AdvantageSettings()) for name in names}
    with torch.device(META):
        got = {name: get_advantage_estimator(name)(inputs, AdvantageSettings()) for name in names}
        whitened = masked_whiten(x["advantages"], x["mask"])
        by_tensor_ids = group_advantages(x["scores"], group_ids=torch.tensor([7, 3, 7, 3], device="cpu"))
    for name, pair in got.items():
        for value, expected in zip(pair, want[name], strict=True):
            assert value.device.type == "cpu", name
            torch.testing.assert_close(value, expected, msg=name)
    torch.testing.assert_close(whitened, masked_whiten(x["advantages"], x["mask"]))
    torch.testing.assert_close(by_tensor_ids, group_advantages(x["scores"], group_size=None,
                                                               group_ids=[7, 3, 7, 3]))


def hits(prompt: str, response: str) -> float:
    return float(response.count("a"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_function_rewards_and_scorers_answer_on_the_inputs_device_and_the_host(device):
    tokenizer = tiny_tokenizer()
    reward = FunctionReward(hits, tokenizer)
    batch = collate(experiences(3), tokenizer.pad_token_id)
    args = (batch.sequences, batch.attention_mask, batch.response_mask)
    want = reward.score(*args)
    with torch.device(META):
        assert reward.score(*args).device.type == "cpu"
    on_device = [to_device(t, device) for t in args]
    got = reward.score(*on_device)
    assert got.device.type == torch.device(device).type and torch.equal(got.cpu(), want)
    scorer = Scorer("reward", reward, device=torch.device(device))
    answers = scorer.answer([ScoreRequest(*args), ScoreRequest(*(t[1:] for t in args))])
    assert [a.rewards.device.type for a in answers] == ["cpu", "cpu"]
    assert torch.equal(answers[0].rewards, want) and torch.equal(answers[1].rewards, want[1:])


def test_ddp_collectives_use_the_cpu_under_gloo_and_the_rank_gpu_under_nccl():
    args = {"rank": 0, "world_size": 1, "master_addr": "127.0.0.1", "master_port": 29500}
    assert DDPStrategy(**args, backend="gloo").collective_device == torch.device("cpu")
    # A CUDA model under gloo: gloo reduces host tensors.
    assert DDPStrategy(**args, backend="gloo", device="cuda:0").collective_device == torch.device("cpu")
    if torch.cuda.is_available():
        strategy = DDPStrategy(**args, backend="nccl")
        assert strategy.collective_device == strategy.device and strategy.device.type == "cuda"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here; the GPU lane runs it")
def test_host_batches_go_to_cuda_through_pinned_memory_and_back_once():
    exps = experiences()
    host = collate(exps, pad_token_id=0)
    device = torch.device("cuda", torch.cuda.current_device())
    batch = collate(exps, pad_token_id=0, device=device)
    for name, value in batch_tensors(batch).items():
        assert value.device == device, name
        assert torch.equal(value.cpu(), batch_tensors(host)[name]), name
    moved = host.to(device)
    assert all(t.device == device for t in batch_tensors(moved).values())
    assert not host.sequences.is_pinned()  # the caller's host tensors are left as they were
    assert [e.to_dict() for e in uncollate(batch.select([4, 0]))] == [e.to_dict() for e in (exps[4], exps[0])]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here; the GPU lane runs it")
def test_building_a_seeded_model_leaves_the_cuda_generator_alone():
    torch.cuda.manual_seed(123)
    state = torch.cuda.get_rng_state()
    first, _ = tiny_causal_lm("llama", seed=5)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    second, _ = tiny_causal_lm("llama", seed=5)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here; the GPU lane runs it")
def test_a_local_rank_beyond_the_visible_gpus_means_the_current_one(monkeypatch):
    from detached_rl.strategies.ddp import _default_device

    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))
    assert _default_device("nccl") == torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert _default_device("nccl") == torch.device("cuda", 0)
