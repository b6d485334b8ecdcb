"""Scorers without Ray: merged batches answer as separate ones, makers with
scorers make the same experience."""

import threading
import time

import pytest
import torch

from detached_rl.core.prompts import CyclingPrompts
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig, MakerModels
from detached_rl.models import Actor, SamplingConfig, tiny_causal_lm
from detached_rl.scorer.batching import RequestBatcher
from detached_rl.scorer.core import Scorer
from detached_rl.scorer.requests import ScoreAnswer, ScoreRequest, ScoreRequestError, merge_requests
from detached_rl.scorer.service import LocalScoring
from detached_rl.weights.update import WeightUpdateError, build_weight_update, restrict_update

from .helpers import (
    LowTokenReward,
    ObjectStore,
    arithmetic_prompts,
    lane_device,
    model_device,
    naive_strategy,
    tiny_actor_critic,
    tiny_lm,
    tiny_maker_models,
)

SAMPLING = SamplingConfig(max_new_tokens=6)


def request(prompt_lengths=(3, 5), response_lengths=(4, 2), seed=0, vocab=200):
    """A padded request: left-padded prompts, right-padded responses."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(prompt_lengths)
    p, r = max(prompt_lengths), max(response_lengths)
    sequences = torch.zeros(rows, p + r, dtype=torch.long)
    attention = torch.zeros(rows, p + r, dtype=torch.long)
    response = torch.zeros(rows, r, dtype=torch.long)
    for row, (pl, rl) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        sequences[row, p - pl : p + rl] = torch.randint(3, vocab, (pl + rl,), generator=generator)
        attention[row, p - pl : p + rl] = 1
        response[row, :rl] = 1
    return ScoreRequest(sequences, attention, response, [{} for _ in range(rows)])


@pytest.fixture(scope="module")
def models():
    actor, critic = tiny_actor_critic(seed=0)
    return {"reference": actor, "critic": critic, "reward": LowTokenReward()}


@pytest.mark.parametrize("role", ["reference", "critic", "reward"])
def test_one_forward_pass_over_merged_requests_answers_as_separate_passes(models, role):
    scorer = Scorer(role, models[role], SAMPLING, device=lane_device())
    if role == "critic":
        scorer.receiver._version = 0  # as if synced: this test is about batching
    first, second = request(seed=1), request((7,), (6,), seed=2)
    merged = scorer.answer([first, second])
    alone = [scorer.answer([first])[0], scorer.answer([second])[0]]
    assert [a.batched_requests for a in merged] == [2, 2] and scorer.batches == 3
    for together, separate, asked in zip(merged, alone, (first, second), strict=True):
        if role == "reward":
            assert together.rewards.shape == (asked.size,)
            torch.testing.assert_close(together.rewards, separate.rewards, atol=1e-5, rtol=0)
        else:
            assert together.token_scores.shape == tuple(asked.response_mask.shape)
            torch.testing.assert_close(together.token_scores, separate.token_scores, atol=1e-5, rtol=0)


def test_merge_pads_prompts_on_the_left_and_responses_on_the_right():
    merged = merge_requests([request((2,), (1,)), request((4,), (3,))])
    assert merged.sequences.shape == (2, 7) and merged.response_mask.shape == (2, 3)
    assert merged.attention_mask[0].tolist() == [0, 0, 1, 1, 1, 0, 0]
    assert merged.response_mask[0].tolist() == [1, 0, 0]


@pytest.mark.parametrize(("change", "field"), [
    (lambda r: setattr(r, "sequences", r.sequences.float()), "sequences"),
    (lambda r: setattr(r, "attention_mask", r.attention_mask[:, 1:]), "attention_mask"),
    (lambda r: setattr(r, "response_mask", r.response_mask * 2), "response_mask"),
    (lambda r: setattr(r, "response_mask", r.response_mask[:1]), "response_mask"),
    (lambda r: setattr(r, "metadata", [{}]), "metadata"),
    (lambda r: setattr(r, "metadata", "x"), "metadata"),
])
def test_malformed_requests_are_refused_naming_the_field(models, change, field):
    bad = request()
    change(bad)
    scorer = Scorer("reward", models["reward"], device=lane_device())
    with pytest.raises(ScoreRequestError, match=field):
        scorer.answer([bad])
    assert scorer.batches == 0


def test_batcher_merges_concurrent_requests_and_keeps_a_bad_one_from_spoiling_others(models):
    scorer = Scorer("reference", models["reference"], SAMPLING, device=lane_device())
    batcher = RequestBatcher(scorer.answer, max_batch_rows=64, max_wait_s=0.2)
    answers: list[ScoreAnswer] = []
    threads = [threading.Thread(target=lambda s=s: answers.append(batcher.submit(request(seed=s)).result(30)))
               for s in range(4)]
    for thread in threads:
        thread.start()
    bad = request()
    bad.sequences = bad.sequences.float()
    with pytest.raises(ScoreRequestError, match="sequences"):
        batcher.submit(bad)
    for thread in threads:
        thread.join(30)
    batcher.close()
    assert len(answers) == 4 and scorer.requests == 4
    assert scorer.batches < 4, "concurrent requests within max_wait_s should share forward passes"


def test_batcher_gives_every_request_of_a_failed_batch_the_error():
    def boom(requests):
        raise RuntimeError("model fell over")

    batcher = RequestBatcher(boom, max_wait_s=0.05)
    futures = [batcher.submit(request()) for _ in range(3)]
    for future in futures:
        with pytest.raises(RuntimeError, match="fell over"):
            future.result(10)
    batcher.close()


def full_update(store, seed=3):
    """A trainer-shaped PPO update (actor/ and critic/ tensors) of models built from `seed`."""
    actor, critic = tiny_actor_critic(seed=seed)
    update, _ = build_weight_update({"actor": actor.model.state_dict(), "critic": critic.state_dict()},
                                    version=0, put=store.put, chunk_bytes=2**16)
    return update, critic


def test_restrict_update_keeps_one_model_and_fetches_only_its_chunks():
    store = ObjectStore()
    update, _ = full_update(store)
    restricted, fetch = restrict_update(update, ["critic"], store.fetch)
    assert {s.name.partition("/")[0] for s in restricted.manifest.tensors} == {"critic"}
    assert restricted.manifest.num_chunks == len(restricted.chunk_refs) < update.manifest.num_chunks
    for ref in restricted.chunk_refs:
        assert set(fetch(ref)) <= {s.name for s in restricted.manifest.tensors}


def test_critic_scorer_takes_the_critic_part_of_an_update_and_waits_for_the_version_asked():
    store = ObjectStore()
    update, trained_critic = full_update(store)
    _, critic = tiny_actor_critic(seed=0)
    scorer = Scorer("critic", critic, device=lane_device())
    with pytest.raises(TimeoutError, match="holds weights v-1; a request needs v0"):
        scorer.wait_for_version(0, timeout=0.1)
    result = scorer.apply_weight_update(update, store.fetch)
    assert result.applied and scorer.version == 0
    for key, value in trained_critic.state_dict().items():
        assert torch.equal(critic.state_dict()[key], value)
    asked = request()
    asked.min_version = 0
    on_device = (t.to(model_device(trained_critic)) for t in (asked.sequences, asked.attention_mask,
                                                               asked.response_mask))
    torch.testing.assert_close(scorer.answer([asked])[0].token_scores, trained_critic(*on_device).cpu())
    # A bad update is refused whole; the scorer keeps serving v0.
    bad, _ = full_update(store, seed=4)
    object.__setattr__(bad.manifest, "version", 1)
    store.objects[bad.chunk_refs[-1]] = {}
    with pytest.raises(WeightUpdateError):
        scorer.apply_weight_update(bad, store.fetch)
    assert scorer.version == 0


def test_reference_and_reward_scorers_take_no_weight_updates(models):
    with pytest.raises(ValueError, match="no trained weights"):
        Scorer("reward", models["reward"], device=lane_device()).apply_weight_update(None, None)


def synced_maker(models: MakerModels, scoring=None, seed=11):
    """A maker given the weights of a trainer built from seed 0 (actor and critic)."""
    maker = ExperienceMaker("maker_0", models, CyclingPrompts(arithmetic_prompts()),
                            MakerConfig(experience_batch_size=3, group_size=2, sampling=SAMPLING, seed=seed),
                            naive_strategy(), scoring)
    store = ObjectStore()
    actor, critic = tiny_actor_critic(seed=0)
    states = {"actor": actor.model.state_dict()}
    if models.critic is not None or (scoring is not None and "critic" in scoring.roles):
        states["critic"] = critic.state_dict()  # PPO: the trainer's updates carry its critic
    update, _ = build_weight_update(states, version=0, put=store.put)
    maker.apply_weight_update(update, store.fetch)
    if scoring is not None and "critic" in scoring.roles:
        scoring.scorers["critic"].apply_weight_update(update, store.fetch)
    return maker


def test_a_maker_with_scorers_makes_the_experience_a_maker_with_local_models_makes():
    local = synced_maker(tiny_maker_models(seed=5))
    _, critic = tiny_actor_critic(seed=5)
    scoring = LocalScoring({
        "critic": Scorer("critic", critic, SAMPLING, device=lane_device()),
        "reference": Scorer("reference", Actor(*tiny_lm("llama", seed=5)), SAMPLING, device=lane_device()),
        "reward": Scorer("reward", LowTokenReward(), device=lane_device()),
    })
    only_policy = MakerModels(actor=tiny_actor_critic(seed=5)[0])
    remote = synced_maker(only_policy, scoring)
    assert remote.critic is None and remote.reference is None and remote.reward is None
    for _ in range(2):
        expected, got = local.make_experience(), remote.make_experience()
        assert len(expected) == len(got) == 6
        for a, b in zip(expected, got, strict=True):
            assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.response_ids, b.response_ids)
            torch.testing.assert_close(a.log_probs, b.log_probs)
            for name in ("values", "ref_log_probs"):
                torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-5, rtol=0)
            torch.testing.assert_close(a.reward, b.reward)
            assert b.info["critic_version"] == 0 and a.info["kl"] == pytest.approx(b.info["kl"], abs=1e-5)


def test_a_seeded_maker_repeats_its_experience_and_an_unscored_maker_is_refused():
    first, second = synced_maker(tiny_maker_models(seed=5)), synced_maker(tiny_maker_models(seed=5))
    for a, b in zip(first.make_experience(), second.make_experience(), strict=True):
        assert torch.equal(a.response_ids, b.response_ids)
    with pytest.raises(ValueError, match="has no reward"):
        synced_maker(MakerModels(actor=tiny_actor_critic(seed=5)[0]))


def test_a_slow_role_does_not_hold_the_generation_lock():
    """Remote answers are collected after the lock: a weight swap can happen while a scorer thinks."""
    scoring = LocalScoring({"reward": Scorer("reward", LowTokenReward(), device=lane_device())})
    maker = synced_maker(MakerModels(actor=tiny_actor_critic(seed=5)[0]), scoring)
    original = scoring.submit
    held = []

    def submit(request, roles=None):
        pending = original(request, roles)

        def collect(timeout):
            held.append(maker.generation_lock.locked())
            time.sleep(0.05)
            return pending(timeout)
        return collect

    scoring.submit = submit
    maker.make_experience()
    assert held == [False]


TOP_K = SamplingConfig(max_new_tokens=6, top_k=2, temperature=0.7)


def outside_top_k_request(actor: Actor) -> ScoreRequest:
    """A one-row request whose last response token is the model's least likely one
    there (far outside any top-k)."""
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        first = int(actor.model(prompt.to(lane_device())).logits[0, -1].argmax())
        sequence = torch.tensor([[5, 6, 7, 8, first]])
        worst = int(actor.model(sequence.to(lane_device())).logits[0, -1].argmin())
    sequences = torch.tensor([[5, 6, 7, 8, first, worst]])
    return ScoreRequest(sequences, torch.ones_like(sequences), torch.ones(1, 2, dtype=torch.long))


def test_a_reference_scorer_gives_a_token_outside_its_top_k_a_finite_log_prob():
    actor = Actor(*tiny_causal_lm("llama", seed=0)).to(lane_device())
    request = outside_top_k_request(actor)
    answer = Scorer("reference", actor, TOP_K, device=lane_device()).answer([request])[0]
    assert bool(torch.isfinite(answer.token_scores).all()), answer.token_scores
    # The temperature-scaled full distribution: temperature 0.7, no top-k.
    expected = actor.log_probs(*(t.to(lane_device()) for t in (request.sequences, request.attention_mask,
                                                               request.response_mask)),
                               SamplingConfig(max_new_tokens=6, temperature=0.7)).cpu()
    assert torch.allclose(answer.token_scores, expected, atol=1e-5)
