"""A trained reward model (issue 47.3): a one-label sequence-classification checkpoint scores exactly what
`AutoModelForSequenceClassification` scores for the same text, with its own tokenizer (another vocabulary
than the policy's too); a head-less backbone is refused unless a fresh head is asked for; PPO through `run`
with a reward model whose score head is all zeros trains on rewards of exactly 0."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForSequenceClassification,
)

from detached_rl.config.factories import build_reward
from detached_rl.config.loading import load_config
from detached_rl.models.loaders import minilm_dir, tiny_causal_lm, tiny_tokenizer
from detached_rl.models.scalar_heads import RewardModel
from detached_rl.models.sequence_reward import SequenceClassifierReward, load_reward_model
from tests.conftest import ROOT
from tests.test_run_sockets import console_script, plain_environment

TEXTS = [("user\nWhat is 2 + 3?\nassistant\n", "2 + 3 = 5\nAnswer: 5"),
         ("user\nName a colour.\nassistant\n", "Blue, the colour of a clear sky at noon."),
         ("user\nSay hi.\nassistant\n", "hi")]


def save_classifier(path: Path, head: float | None, labels: int = 1) -> Path:
    """A tiny llama sequence classifier with `labels` labels saved as a checkpoint (score weights all `head`,
    or seeded random), with the tiny tokenizer."""
    tokenizer = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_labels=labels,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(3)
    model = LlamaForSequenceClassification(config)
    if head is not None:
        with torch.no_grad():
            model.score.weight.fill_(head)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def batch(policy_tokenizer, texts=TEXTS):
    """A left-padded prompt batch and right-padded responses, as a maker collates them."""
    prompts = [policy_tokenizer(p, add_special_tokens=False).input_ids for p, _ in texts]
    responses = [policy_tokenizer(r, add_special_tokens=False).input_ids for _, r in texts]
    p_len, r_len, pad = max(map(len, prompts)), max(map(len, responses)), policy_tokenizer.pad_token_id
    rows = [[pad] * (p_len - len(p)) + p + r + [pad] * (r_len - len(r))
            for p, r in zip(prompts, responses, strict=True)]
    attention = [[0] * (p_len - len(p)) + [1] * (len(p) + len(r)) + [0] * (r_len - len(r))
                 for p, r in zip(prompts, responses, strict=True)]
    response_mask = [[1] * len(r) + [0] * (r_len - len(r)) for r in responses]
    return torch.tensor(rows), torch.tensor(attention), torch.tensor(response_mask)


def reference_scores(path: Path | str, texts: list[str]) -> list[float]:
    """What the checkpoint scores for each text alone, as transformers' own class scores it."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return [model(**tokenizer(text, return_tensors="pt")).logits[0, 0].item() for text in texts]


def test_a_trained_classifier_scores_what_transformers_scores_for_the_same_text(tmp_path):
    path = save_classifier(tmp_path / "rm", head=None)
    policy_tokenizer = tiny_tokenizer()
    reward = load_reward_model(str(path), policy_tokenizer)
    assert isinstance(reward, SequenceClassifierReward)
    sequences, attention, response_mask = batch(policy_tokenizer)
    texts = reward.texts(sequences, attention, response_mask)
    assert texts == [p + r for p, r in TEXTS]
    scores = reward.score(sequences, attention, response_mask)
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, torch.tensor(reference_scores(path, texts)), atol=1e-5, rtol=1e-5)
    assert len(set(scores.tolist())) == 3  # a trained head: the texts are told apart


def test_a_reward_model_with_another_vocabulary_reads_the_text_with_its_own_tokenizer(tmp_path):
    """A BERT classifier (WordPiece, 30,522 tokens) for a policy with a byte-level tokenizer of 262."""
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification.from_pretrained(minilm_dir(), num_labels=1)
    model.save_pretrained(tmp_path / "bert-rm")
    AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(tmp_path / "bert-rm")
    policy_tokenizer = tiny_tokenizer()
    reward = load_reward_model(str(tmp_path / "bert-rm"), policy_tokenizer)
    assert len(reward.tokenizer) != len(policy_tokenizer)
    sequences, attention, response_mask = batch(policy_tokenizer)
    scores = reward.score(sequences, attention, response_mask)
    expected = reference_scores(tmp_path / "bert-rm", [p + r for p, r in TEXTS])
    torch.testing.assert_close(scores, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_a_zero_head_scores_exactly_zero_and_the_config_builds_it(tmp_path):
    path = save_classifier(tmp_path / "zero-rm", head=0.0)
    config = load_config(None, ["model.policy=tiny", f"model.reward_model={path}"])
    reward = build_reward(config.model, config.task, tiny_tokenizer())
    assert isinstance(reward, SequenceClassifierReward)
    assert reward.score(*batch(tiny_tokenizer())).tolist() == [0.0, 0.0, 0.0]


def test_a_critic_named_as_a_reward_model_starts_as_it(tmp_path):
    """OpenRLHF's default: the critic's value at a text's last token is the reward model's score of it."""
    from detached_rl.config.factories import build_critic

    path = save_classifier(tmp_path / "rm", head=None)
    critic = build_critic(load_config(None, ["model.policy=tiny", f"model.critic={path}"]).model)
    classifier = AutoModelForSequenceClassification.from_pretrained(path)
    torch.testing.assert_close(critic.head.weight, classifier.score.weight)
    text = "user\nWhat is 2 + 3?\nassistant\n2 + 3 = 5"
    ids = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt")
    with torch.no_grad():
        value = critic.token_values(ids.input_ids, ids.attention_mask)[0, -1]
    torch.testing.assert_close(value, torch.tensor(reference_scores(path, [text])[0]), atol=1e-5, rtol=1e-5)
    assert build_critic(load_config(None, ["model.policy=tiny"]).model).head.weight.shape == (1, 64)


def test_a_head_less_backbone_is_refused_unless_a_fresh_head_is_asked_for(tmp_path):
    model, tokenizer = tiny_causal_lm("llama", seed=4)
    model.save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match=r"'.*lm' is a LlamaForCausalLM checkpoint, not a sequence "
                                         r"classifier.*model.reward_head: fresh"):
        load_reward_model(str(tmp_path / "lm"), tokenizer)
    with pytest.raises(ValueError, match="'tiny' is a random causal LM, not a trained reward model"):
        load_reward_model("tiny", tokenizer)
    assert isinstance(load_reward_model(str(tmp_path / "lm"), tokenizer, reward_head="fresh"), RewardModel)
    with pytest.raises(ValueError, match="a reward model has one label .* this classifier has 2"):
        load_reward_model(str(save_classifier(tmp_path / "two", head=None, labels=2)), tokenizer)
    with pytest.raises(Exception, match="model.reward_head: .*must be one of"):
        load_config(None, ["model.reward_head=random"])


# The issue 47 bar's command end to end (make test-e2e); its code paths are tested above in make test.
@pytest.mark.ray
@pytest.mark.e2e
def test_ppo_through_run_with_a_zero_head_reward_model_trains_on_rewards_of_exactly_zero(tmp_path):
    """The issue's bar: a random head gives rewards far from 0; this one's are exactly 0 in the metrics."""
    path = save_classifier(tmp_path / "zero-rm", head=0.0)
    home = tmp_path / "home"
    home.mkdir()
    command = [*console_script(), "run", "--config", str(ROOT / "examples" / "jobs" / "tiny.yaml"),
               "--steps", "2", "--makers", "1", "--name", "rm", "--no-progress",
               "--set", f"model.reward_model={path}", "--set", "task.eval_size=8",
               "--set", "run.eval_every=0"]
    done = subprocess.run(command, env=plain_environment(home), cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, start_new_session=True)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    metrics = tmp_path / "runs" / "rm" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [row for row in rows if "reward/mean" in row]  # PPO's: the reward model's scores, before the KL
    assert len(steps) == 2
    assert all(row["reward/mean"] == 0.0 and row["reward/std"] == 0.0 for row in steps), steps
