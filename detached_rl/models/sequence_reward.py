"""A trained reward model: a `...ForSequenceClassification` checkpoint with one label (the format OpenRLHF's
and TRL's reward trainers write), scoring what the policy wrote with its own tokenizer.

`load_reward_model` reads the checkpoint's config first: a one-label sequence classifier loads with its
trained head (`SequenceClassifierReward`); a causal LM or any other head-less backbone is refused with the
reason, unless `model.reward_head: fresh` asks for a new random scalar head on it (`RewardModel`, what the
seeds' demo did).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from detached_rl.core.decoding import decode_batch
from detached_rl.models import hub
from detached_rl.models._forward import disable_dropout
from detached_rl.models.loaders import ensure_pad_token, load_causal_lm, seeded, smollm2_dir
from detached_rl.models.scalar_heads import Critic, RewardModel, backbone_of
from detached_rl.models.specs import REWARD_HEADS


class SequenceClassifierReward(nn.Module):
    """Scores each prompt + response as its sequence classifier scores that text (`logits[:, 0]`).

    The policy's tokenizer decodes the batch (special tokens dropped: the text of the policy's chat template
    and the response); the reward model's tokenizer encodes that text again, so a reward model with another
    vocabulary than the policy's works. Texts longer than `max_length` tokens are truncated at the end
    (None: none are).
    """

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase,
                 policy_tokenizer: PreTrainedTokenizerBase, max_length: int | None = None) -> None:
        super().__init__()
        labels = int(getattr(model.config, "num_labels", 0))
        if labels != 1:
            raise ValueError(f"a reward model has one label (a scalar score); this classifier has {labels}")
        self.model = disable_dropout(model)
        self.tokenizer = ensure_pad_token(tokenizer)
        if self.model.config.pad_token_id is None:  # the classifier reads the last token that is not padding
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.policy_tokenizer = policy_tokenizer
        self.max_length = max_length

    def texts(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
              response_mask: torch.Tensor) -> list[str]:
        """The text each row is scored on: its decoded prompt followed by its decoded response."""
        prompts, responses = decode_batch(self.policy_tokenizer, sequences, attention_mask, response_mask)
        return [prompt + response for prompt, response in zip(prompts, responses, strict=True)]

    def score_texts(self, texts: list[str]) -> torch.Tensor:
        """The classifier's score of each text [B], float32, where the model's weights are."""
        encoded = self.tokenizer(texts, padding=True, truncation=self.max_length is not None,
                                 max_length=self.max_length, return_tensors="pt")
        device = next(self.model.parameters()).device
        with torch.no_grad():
            logits = self.model(input_ids=encoded["input_ids"].to(device),
                                attention_mask=encoded["attention_mask"].to(device)).logits
        return logits[:, 0].float()

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
              metadata: list[dict[str, Any]] | None = None) -> torch.Tensor:
        """Rewards [B] on the device of `sequences` (the `RewardScorer` interface)."""
        return self.score_texts(self.texts(sequences, attention_mask, response_mask)).to(sequences.device)


def _checkpoint(spec: str) -> str:
    """Where `from_pretrained` finds `spec` (the packaged SmolLM2's directory for `smollm2`)."""
    return str(smollm2_dir()) if spec == "smollm2" else spec


def is_sequence_classifier(config: Any) -> bool:
    """Whether a model config names a sequence-classification head (its `architectures`)."""
    names = getattr(config, "architectures", None) or []
    return any(name.endswith("ForSequenceClassification") for name in names)


def load_reward_model(spec: str, policy_tokenizer: PreTrainedTokenizerBase, reward_head: str = "trained",
                      seed: int = 0, revision: str | None = None, trust_remote_code: bool = False,
                      attn_implementation: str | None = None) -> nn.Module:
    """The reward model `spec` names (a Hub id at `revision`, a directory, or a shortcut): its trained
    classifier, or with `reward_head="fresh"` a new seeded scalar head on its backbone."""
    if reward_head not in REWARD_HEADS:
        raise ValueError(f"model.reward_head must be one of {REWARD_HEADS}, got {reward_head!r}")
    if reward_head == "fresh":
        backbone, _ = load_causal_lm(spec, seed=seed, revision=revision, trust_remote_code=trust_remote_code,
                                     attn_implementation=attn_implementation)
        with seeded(seed):  # a seeded head: the same config gives the same reward model
            return RewardModel(backbone_of(backbone)).eval()
    if spec == "tiny" or spec.startswith("tiny-"):
        raise ValueError(f"model.reward_model: {spec!r} is a random causal LM, not a trained reward model; "
                         "set model.reward_head: fresh for a new random scalar head on it")
    path = _checkpoint(spec)
    options = dict(revision=revision, trust_remote_code=trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(path, **options)
    except OSError as error:
        problem = hub.load_error(spec, revision, error) if hub.is_hub_id(spec) else error
        raise ValueError(f"model.reward_model: {problem}") from error
    if not is_sequence_classifier(config):
        kinds = ", ".join(getattr(config, "architectures", None) or ["no architecture named"])
        raise ValueError(f"model.reward_model: {spec!r} is a {kinds} checkpoint, not a sequence classifier "
                         "with a trained score head (...ForSequenceClassification, one label); set "
                         "model.reward_head: fresh for a new random scalar head on its backbone")
    model = AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn_implementation, **options)
    tokenizer = AutoTokenizer.from_pretrained(path, **options)
    return SequenceClassifierReward(model, tokenizer, policy_tokenizer).eval()


def critic_from_reward_model(spec: str, revision: str | None = None, trust_remote_code: bool = False,
                             attn_implementation: str | None = None) -> Critic | None:
    """A critic that starts as the reward model `spec` (OpenRLHF's default): its backbone, and its score head
    as the value head; None when `spec` is no sequence classifier (the critic is then a new head on it)."""
    if spec == "tiny" or spec.startswith("tiny-"):
        return None
    options = dict(revision=revision, trust_remote_code=trust_remote_code)
    if not is_sequence_classifier(AutoConfig.from_pretrained(_checkpoint(spec), **options)):
        return None
    classifier = AutoModelForSequenceClassification.from_pretrained(
        _checkpoint(spec), dtype=torch.float32, attn_implementation=attn_implementation, **options)
    head = getattr(classifier, "score", None) or getattr(classifier, "classifier", None)
    if not isinstance(head, nn.Linear) or head.out_features != 1:
        raise ValueError(f"model.critic: {spec!r} has no one-label linear score head to start a value head "
                         "from")
    return Critic(backbone_of(classifier), head=head)
