"""Models: offline loaders, Actor generation and log-probs, Critic, RewardModel, reward adapters."""

import pytest
import torch

from detached_rl import Experience, collate
from detached_rl.generation import HFGenerationBackend
from detached_rl.generation.base import left_pad
from detached_rl.models import (
    Actor,
    Critic,
    FunctionReward,
    RetokenizingRewardModel,
    RewardModel,
    SamplingConfig,
    load_causal_lm,
    load_model_dir,
    minilm_dir,
    process_logits,
    reference_sampling,
    tiny_causal_lm,
    tiny_tokenizer,
)
from detached_rl.models.scalar_heads import backbone_of, last_token_index

from .helpers import lane_device, model_device, needs_minilm, tiny_lm

ARCHITECTURES = ["llama", "gpt2", "opt", "bloom", "gpt_neox", "qwen2", "mistral"]
SAMPLINGS = [
    SamplingConfig(max_new_tokens=10),
    SamplingConfig(max_new_tokens=10, temperature=0.7, top_k=20, top_p=0.9),
    SamplingConfig(max_new_tokens=10, temperature=1.2, top_p=0.95, min_p=0.1),
    SamplingConfig(max_new_tokens=10, do_sample=False),
]
PROMPTS = ["What is 3 + 4?", "hi", "a much longer prompt with many more tokens in it"]


def generate(actor, prompts, sampling):
    return HFGenerationBackend.from_actor(actor).generate_text(prompts, sampling)


def batch_of(output, pad_token_id):
    """The generated rows as a padded batch on the test device (where the models are)."""
    exps = [
        Experience(p, r, lp, torch.tensor(0.0))
        for p, r, lp in zip(output.prompt_ids, output.response_ids, output.log_probs, strict=True)
    ]
    return collate(exps, pad_token_id).to(lane_device())


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_tiny_model_of_each_architecture_generates(model_type):
    model, tokenizer = tiny_lm(model_type)
    assert model.config.model_type == model_type
    assert model.config.vocab_size == len(tokenizer)
    assert sum(p.numel() for p in model.parameters()) < 500_000
    torch.manual_seed(0)
    out = generate(Actor(model, tokenizer), PROMPTS[:2], SamplingConfig(max_new_tokens=4))
    assert [len(r) for r in out.response_ids] == [4, 4]


def test_tiny_models_are_deterministic_per_seed():
    a, _ = tiny_causal_lm("llama", seed=1)
    b, _ = tiny_causal_lm("llama", seed=1)
    c, _ = tiny_causal_lm("llama", seed=2)
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_tiny_tokenizer_round_trip_and_chat_template(kind):
    tokenizer = tiny_tokenizer(kind)
    text = "What is 12 + 30? héllo"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id} == {0, 1, 2}
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    if kind == "char":
        assert len(tokenizer("abc")["input_ids"]) == 3


def test_load_causal_lm_specs(tmp_path):
    model, tokenizer = tiny_lm("gpt2")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_causal_lm(str(tmp_path))
    loaded.to(model_device(model))
    ids = torch.tensor([[5, 6, 7]], device=model_device(model))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded_tokenizer.pad_token_id == tokenizer.pad_token_id
    assert load_causal_lm("tiny-opt")[0].config.model_type == "opt"
    with pytest.raises(ValueError, match="nonexistent"):
        load_causal_lm("nonexistent")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_dir(tmp_path / "missing")


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "opt"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "warped", "min-p", "greedy"])
def test_recomputed_log_probs_equal_behaviour_log_probs(model_type, sampling):
    model, tokenizer = tiny_lm(model_type)
    actor = Actor(model, tokenizer)
    torch.manual_seed(0)
    out = generate(actor, PROMPTS, sampling)
    assert [len(p) for p in out.prompt_ids] == [len(p) for p in actor.encode_prompts(PROMPTS)]
    batch = batch_of(out, tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed = actor.log_probs(batch.sequences, batch.attention_mask, batch.response_mask, sampling)
    assert torch.allclose(recomputed, batch.log_probs, atol=1e-5)
    assert bool((batch.log_probs <= 0).all())


def test_log_probs_match_a_prefix_by_prefix_forward():
    """log_probs[t] is log p(response[t] | prompt + response[:t]), checked one unpadded prefix at a time."""
    model, tokenizer = tiny_lm("llama")
    actor = Actor(model, tokenizer)
    torch.manual_seed(0)
    batch = batch_of(generate(actor, PROMPTS, SamplingConfig(max_new_tokens=5)), tokenizer.pad_token_id)
    with torch.no_grad():
        lp = actor.log_probs(batch.sequences, batch.attention_mask, batch.response_mask)
        for row in range(batch.size):
            tokens = batch.sequences[row][batch.attention_mask[row].bool()]
            prompt_len = len(tokens) - int(batch.response_mask[row].sum())
            for t in range(int(batch.response_mask[row].sum())):
                logits = model(tokens[None, : prompt_len + t]).logits[0, -1]
                expected = logits.log_softmax(-1)[tokens[prompt_len + t]]
                assert lp[row, t].item() == pytest.approx(expected.item(), abs=1e-5)


def test_warped_log_probs_put_all_mass_on_kept_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]], device=lane_device())
    # top_k=3 keeps 2.0, 1.0, 0.5; top_p=0.7 of those (at T=1) keeps 2.0 and 1.0:
    # softmax([2, 1, .5]) = [.629, .231, .140]; ascending cumsum .140, .371, 1 -> drop
    # cum <= .3 -> .5 dropped.
    warped = process_logits(logits, SamplingConfig(top_k=3, top_p=0.7))
    assert torch.isinf(warped[0, 2:]).all() and torch.isfinite(warped[0, :2]).all()
    assert warped.softmax(-1)[0, :2].sum().item() == pytest.approx(1.0)
    # min_p=0.2 first (vLLM's order): p = softmax = [.607, .223, .135, .030, .004] keeps p >= .2 * .607,
    # the first three; top_p=0.7 over those renormalised keeps 2.0 and 1.0 as above. The kept tokens'
    # log-probs are renormalised: log(e^2 / (e^2 + e^1)) = -0.3133.
    warped = process_logits(logits, SamplingConfig(min_p=0.2, top_p=0.7))
    assert torch.isinf(warped[0, 2:]).all() and torch.isfinite(warped[0, :2]).all()
    assert warped.log_softmax(-1)[0, 0].item() == pytest.approx(-0.31326, abs=1e-5)
    assert torch.isinf(process_logits(logits, SamplingConfig(min_p=0.2))[0, 3:]).all()
    assert torch.equal(process_logits(logits, SamplingConfig(temperature=2.0)), logits / 2)
    assert torch.equal(process_logits(logits, SamplingConfig(do_sample=False, temperature=2.0)), logits)


def test_generation_stops_at_stop_tokens():
    model, tokenizer = tiny_lm("llama")
    actor = Actor(model, tokenizer)
    half = tuple(range(len(tokenizer) // 2))
    torch.manual_seed(0)
    out = generate(actor, PROMPTS, SamplingConfig(max_new_tokens=20, stop_token_ids=half))
    for response, log_probs, finished in zip(out.response_ids, out.log_probs, out.finished, strict=True):
        assert len(response) == len(log_probs) >= 1
        stops = [i for i, tok in enumerate(response.tolist()) if tok in half]
        if finished:
            assert stops == [len(response) - 1]  # ends with exactly one stop token
        else:
            assert stops == [] and len(response) == 20
    assert any(out.finished)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=0.0), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=1.0), "min_p"),
        (dict(min_p=-0.1), "min_p"),
    ],
)
def test_sampling_config_refuses_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingConfig.{field}"):
        SamplingConfig(**kwargs)


def test_actor_refuses_mismatched_shapes_and_empty_prompts():
    model, tokenizer = tiny_lm("llama")
    actor = Actor(model, tokenizer)
    device = model_device(model)
    seq = torch.ones(2, 6, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="attention_mask shape"):
        actor.log_probs(seq, torch.ones(2, 5, device=device), torch.ones(2, 3, device=device))
    with pytest.raises(ValueError, match="response_mask shape"):
        actor.log_probs(seq, torch.ones(2, 6, device=device), torch.ones(2, 6, device=device))
    with pytest.raises(ValueError, match="no tokens"):
        actor.encode_prompts([[]])
    with pytest.raises(ValueError, match="empty"):
        left_pad([torch.tensor([1]), torch.tensor([], dtype=torch.long)], 0)


def test_log_probs_give_gradients_to_the_model():
    model, tokenizer = tiny_lm("llama")
    actor = Actor(model, tokenizer)
    batch = batch_of(generate(actor, PROMPTS, SamplingConfig(max_new_tokens=4)), tokenizer.pad_token_id)
    actor.log_probs(batch.sequences, batch.attention_mask, batch.response_mask).sum().backward()
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0


def test_critic_values_align_with_the_state_before_each_response_token():
    model, tokenizer = tiny_lm("llama")
    critic = Critic(backbone_of(model))
    torch.manual_seed(0)
    batch = batch_of(generate(Actor(model, tokenizer), PROMPTS, SamplingConfig(max_new_tokens=4)), 0)
    with torch.no_grad():
        values = critic(batch.sequences, batch.attention_mask, batch.response_mask)
        assert values.shape == batch.response_mask.shape and values.dtype == torch.float32
        assert bool((values[batch.response_mask == 0] == 0).all())
        row = 1
        tokens = batch.sequences[row][batch.attention_mask[row].bool()]
        prompt_len = len(tokens) - int(batch.response_mask[row].sum())
        for t in range(int(batch.response_mask[row].sum())):
            prefix = tokens[None, : prompt_len + t]
            expected = critic.token_values(prefix, torch.ones_like(prefix))[0, -1]
            assert values[row, t].item() == pytest.approx(expected.item(), abs=1e-5)
    critic(batch.sequences, batch.attention_mask, batch.response_mask).sum().backward()
    assert critic.head.weight.grad is not None


def test_reward_model_reads_the_last_real_token_under_any_padding():
    model, _ = tiny_lm("gpt2")
    reward_model = RewardModel(backbone_of(model))
    device = model_device(model)
    ids, mask = left_pad([torch.tensor([5, 6, 7, 8], device=device), torch.tensor([9, 10], device=device)],
                         pad_token_id=0)
    right = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]], device=device)
    assert last_token_index(mask).tolist() == [3, 3]
    assert last_token_index((right != 0).long()).tolist() == [3, 1]
    with torch.no_grad():
        alone = reward_model(torch.tensor([[9, 10]], device=device),
                             torch.ones(1, 2, dtype=torch.long, device=device))
        padded_left = reward_model.score(ids, mask)
        padded_right = reward_model.score(right, (right != 0).long())
    assert padded_left.shape == (2,)
    assert padded_left[1].item() == pytest.approx(alone.item(), abs=1e-5)
    assert padded_right[1].item() == pytest.approx(alone.item(), abs=1e-5)


def test_function_reward_decodes_texts_and_passes_metadata():
    tokenizer = tiny_tokenizer()
    seen = []

    def grade(prompt, response, answer):
        seen.append((prompt, response))
        correct = float(response.strip() == str(answer))
        return {"reward": correct + 0.1, "correct": correct}

    exps = [
        Experience(torch.tensor(tokenizer(p)["input_ids"]), torch.tensor(tokenizer(r)["input_ids"]),
                   torch.full((len(tokenizer(r)["input_ids"]),), -1.0), torch.tensor(0.0))
        for p, r in [("What is 3 + 4?", " 7"), ("Hi there", " 5<|im_end|>")]
    ]
    batch = collate(exps, tokenizer.pad_token_id)
    scorer = FunctionReward(grade, tokenizer)
    rewards, parts = scorer.score_detailed(batch.sequences, batch.attention_mask, batch.response_mask,
                                           [{"answer": 7}, {"answer": 4}])
    assert seen == [("What is 3 + 4?", " 7"), ("Hi there", " 5")]
    assert rewards.tolist() == pytest.approx([1.1, 0.1]) and parts == [{"correct": 1.0}, {"correct": 0.0}]
    plain = FunctionReward(lambda prompt, response: len(response), tokenizer)
    assert plain.score(batch.sequences, batch.attention_mask, batch.response_mask).tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="non-finite"):
        FunctionReward(lambda p, r: float("nan"), tokenizer).score(batch.sequences, batch.attention_mask,
                                                                 batch.response_mask)
    with pytest.raises(ValueError, match="'reward' key"):
        FunctionReward(lambda p, r: {"x": 1.0}, tokenizer).score(batch.sequences, batch.attention_mask,
                                                               batch.response_mask)


@needs_minilm
def test_packaged_minilm_scores_policy_text_through_its_own_tokenizer():
    from transformers import AutoTokenizer

    reward_model = RewardModel.from_pretrained(minilm_dir()).to(lane_device())
    assert reward_model.backbone.config.model_type == "bert"
    policy_tokenizer = tiny_tokenizer()
    scorer = RetokenizingRewardModel(reward_model, AutoTokenizer.from_pretrained(minilm_dir()),
                                     policy_tokenizer)
    exps = [
        Experience(torch.tensor(policy_tokenizer(p)["input_ids"]),
                   torch.tensor(policy_tokenizer(r)["input_ids"]),
                   torch.full((len(policy_tokenizer(r)["input_ids"]),), -1.0), torch.tensor(0.0))
        for p, r in [("What is 3 + 4?", " The answer is 7."), ("Say hi", " hi")]
    ]
    batch = collate(exps, policy_tokenizer.pad_token_id).to(lane_device())
    rewards = scorer.score(batch.sequences, batch.attention_mask, batch.response_mask)
    assert rewards.shape == (2,) and torch.isfinite(rewards).all() and rewards[0] != rewards[1]


@pytest.mark.parametrize("model_type", ["gpt2", "opt"])
def test_actor_forward_is_deterministic_in_train_mode(model_type):
    model, tokenizer = tiny_lm(model_type, seed=0)
    actor = Actor(model, tokenizer).train()
    sequences = torch.tensor([[5, 6, 7, 8, 9, 10]], device=model_device(model))
    mask, response_mask = torch.ones_like(sequences), torch.ones(1, 3, device=sequences.device)
    with torch.no_grad():
        first = actor.log_probs(sequences, mask, response_mask)
        assert torch.equal(first, actor.log_probs(sequences, mask, response_mask))
        assert torch.allclose(first, actor.eval().log_probs(sequences, mask, response_mask), atol=1e-6)


def test_entropy_of_uniform_and_filtered_distributions():
    from detached_rl.core.sampling import entropy_from_logits

    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(torch.log(torch.tensor(4.0)).item())
    filtered = torch.tensor([0.0, 0.0, float("-inf"), float("-inf")])
    assert entropy_from_logits(filtered).item() == pytest.approx(torch.log(torch.tensor(2.0)).item())
    model, tokenizer = tiny_lm("llama")
    actor = Actor(model, tokenizer)
    sequences = torch.tensor([[5, 6, 7, 8, 9]], device=model_device(model))
    response_mask = torch.tensor([[1, 1, 0]], device=sequences.device)
    lp, entropy = actor.log_probs(sequences, torch.ones_like(sequences), response_mask, return_entropy=True)
    assert entropy.shape == lp.shape and entropy[0, 2] == 0
    assert 0 < entropy[0, 0] <= torch.log(torch.tensor(float(len(tokenizer)))) + 1e-4


def test_entropy_of_filtered_logits_has_finite_gradients():
    """Top-k/top-p filtered logits are -inf: the entropy ignores them and its gradient stays finite."""
    from detached_rl.core.sampling import entropy_from_logits

    logits = torch.tensor([[1.0, 2.0, float("-inf")], [0.5, float("-inf"), float("-inf")]],
                          requires_grad=True)
    entropy = entropy_from_logits(logits)
    entropy.sum().backward()
    expected = entropy_from_logits(torch.tensor([[1.0, 2.0]]))
    torch.testing.assert_close(entropy[0], expected[0])
    assert entropy[1].item() == 0.0
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2] == 0


def test_reference_sampling_keeps_the_temperature_and_drops_the_filters():
    top_k, plain = SamplingConfig(max_new_tokens=6, top_k=2,
                                  temperature=0.7), SamplingConfig(max_new_tokens=6)
    assert reference_sampling(top_k) == SamplingConfig(max_new_tokens=6, temperature=0.7)
    assert reference_sampling(SamplingConfig(top_p=0.9, do_sample=False)).top_p == 1.0
    assert reference_sampling(plain) is plain and reference_sampling(None) is None
