"""Experience: validation names the bad field; collate / uncollate round-trip."""

import pytest
import torch

from detached_rl import Experience, ExperienceValidationError, collate, uncollate

from .helpers import make_experience as make


def test_valid_experience_passes_and_ids_are_unique():
    a, b = make().validate(), make().validate()
    assert a.id != b.id and len(a.id) == 32
    assert a.response_length == 2 and a.score == 1.0
    # 3 + 2 int64 ids, 2 float32 log-probs, 1 float32 reward, the 32-byte id and info as JSON ("{}").
    assert a.nbytes() == 5 * 8 + 2 * 4 + 4 + 32 + 2


@pytest.mark.parametrize(
    ("kwargs", "field", "text"),
    [
        (dict(response=()), "response_ids", "empty"),
        (dict(prompt=()), "prompt_ids", "empty"),
        (dict(log_probs=torch.tensor([-0.1])), "log_probs", "length 2"),
        (dict(log_probs=torch.tensor([-0.1, float("nan")])), "log_probs", "non-finite"),
        (dict(log_probs=torch.tensor([-0.1, 0.5])), "log_probs", "<= 0"),
        (dict(log_probs=torch.tensor([-1, -2])), "log_probs", "floating"),
        (dict(reward=float("inf")), "reward", "non-finite"),
        (dict(reward=[1.0, 2.0, 3.0]), "reward", "scalar or"),
        (dict(values=torch.zeros(3)), "values", "length 2"),
        (dict(ref_log_probs=torch.tensor([-0.5, float("nan")])), "ref_log_probs", "non-finite"),
        (dict(ref_log_probs=torch.tensor([-0.5, float("inf")])), "ref_log_probs", "non-finite"),
        (dict(ref_log_probs=torch.tensor([-0.5, float("-inf")])), "ref_log_probs", "full distribution"),
        (dict(values=torch.tensor([0.0, float("-inf")])), "values", "non-finite"),
        (dict(advantages=torch.zeros(2, 1)), "advantages", r"shape \(2, 1\)"),
        (dict(policy_version=-1), "policy_version", ">= 0"),
        (dict(policy_version=1.5), "policy_version", "int"),
        (dict(maker=3), "maker", "str"),
        (dict(id=""), "id", "non-empty"),
        (dict(info=[1]), "info", "dict"),
        (dict(group_id=7), "group_id", "str or None"),
    ],
)
def test_validate_names_the_bad_field(kwargs, field, text):
    with pytest.raises(ExperienceValidationError, match=text) as info:
        make(**kwargs).validate()
    assert info.value.field == field
    assert f"Experience.{field}" in str(info.value)


def test_validate_ids_dtype_shape_and_vocab():
    exp = make()
    exp.prompt_ids = exp.prompt_ids.int()
    with pytest.raises(ExperienceValidationError, match="prompt_ids: dtype"):
        exp.validate()
    exp = make()
    exp.response_ids = exp.response_ids.view(1, 2)
    with pytest.raises(ExperienceValidationError, match="response_ids: must be 1-D"):
        exp.validate()
    with pytest.raises(ExperienceValidationError, match="response_ids: has token ids >= vocab size 9"):
        make().validate(vocab_size=9)
    with pytest.raises(ExperienceValidationError, match="prompt_ids: has negative"):
        make(prompt=(1, -1)).validate()


def test_collate_layout():
    a = make(prompt=(5, 6, 7), response=(8, 9), reward=1.0, policy_version=3, maker="m0", group_id="g")
    b = make(prompt=(4,), response=(1, 2, 3), reward=[0.5, 0.0, 0.25], policy_version=4, maker="m1")
    batch = collate([a, b], pad_token_id=0)
    assert batch.prompt_length == 3 and batch.size == 2
    assert batch.sequences.tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 4, 1, 2, 3]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch.response_ids.tolist() == [[8, 9, 0], [1, 2, 3]]
    # A scalar reward sits on the last response token.
    assert batch.token_rewards.tolist() == [[0.0, 1.0, 0.0], [0.5, 0.0, 0.25]]
    assert batch.scores.tolist() == [1.0, 0.75]
    assert batch.log_probs[0, 2] == 0 and batch.log_probs[1, 2] == pytest.approx(-0.3)
    assert batch.policy_versions.tolist() == [3, 4] and batch.makers == ["m0", "m1"]
    assert batch.group_ids == ["g", None] and batch.num_response_tokens == 5
    assert batch.values is None


def test_collate_refuses_mixed_optional_fields_and_empty():
    with pytest.raises(ExperienceValidationError, match="values"):
        collate([make(values=torch.zeros(2)), make()])
    with pytest.raises(ValueError, match="empty"):
        collate([])


def test_uncollate_round_trip():
    exps = [
        make(prompt=(5, 6, 7), response=(8, 9), values=torch.tensor([0.1, 0.2]), info={"text": "x"}),
        make(prompt=(4,), response=(1, 2, 3), reward=[0.5, 0.0, 0.25], values=torch.tensor([1.0, 2, 3])),
    ]
    back = uncollate(collate(exps, pad_token_id=0))
    for original, restored in zip(exps, back, strict=True):
        assert restored.id == original.id and restored.info == original.info
        for name in ("prompt_ids", "response_ids", "log_probs", "reward", "values"):
            assert torch.equal(getattr(restored, name), getattr(original, name)), name
        assert restored.ref_log_probs is None
        restored.validate()


def test_dict_round_trip_and_unknown_field():
    exp = make(policy_version=2, info={"answer": 7})
    back = Experience.from_dict(exp.to_dict())
    assert back.id == exp.id and torch.equal(back.response_ids, exp.response_ids)
    assert torch.allclose(back.log_probs, exp.log_probs) and back.info == {"answer": 7}
    data = exp.to_dict()
    data["bogus"] = 1
    with pytest.raises(ExperienceValidationError, match="bogus"):
        Experience.from_dict(data)


def test_select_rows_trims_unused_padding():
    a = make(prompt=(5, 6, 7), response=(8, 9))
    b = make(prompt=(4,), response=(1, 2, 3), reward=[0.5, 0.0, 0.25])
    c = make(prompt=(3, 3), response=(2,))
    batch = collate([a, b, c], pad_token_id=0)
    sub = batch.select([1, 2])
    assert sub.prompt_length == 2 and sub.ids == [b.id, c.id]
    assert sub.sequences.tolist() == [[0, 4, 1, 2, 3], [3, 3, 2, 0, 0]]
    assert sub.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert sub.token_rewards.tolist() == [[0.5, 0.0, 0.25], [1.0, 0.0, 0.0]]
    back = uncollate(sub)
    assert torch.equal(back[0].prompt_ids, b.prompt_ids) and torch.equal(back[1].response_ids, c.response_ids)
    only_a = batch.select(torch.tensor([0]))
    assert only_a.sequences.tolist() == [[5, 6, 7, 8, 9]] and only_a.log_probs.shape == (1, 2)


def test_reference_log_probs_are_finite_for_every_sampled_token():
    """Reference log-probs come from the temperature-scaled full distribution (`reference_sampling`), where
    every token has a finite log-prob: -inf is a reference scored with top-k/top-p, refused by field."""
    with pytest.raises(ExperienceValidationError, match="reference_sampling") as info:
        make(ref_log_probs=torch.tensor([-0.5, float("-inf")])).validate()
    assert info.value.field == "ref_log_probs"
