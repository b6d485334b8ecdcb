"""What `Experience.validate` checks: shapes, dtypes, value bounds and sizes, and the error naming the field.

Numeric guards: float fields are trained in float32 (`TRAINING_DTYPE`, `collate` casts to it), so every value
must be finite there, not only in the dtype it travels in (1e300 in float64 is inf in float32), and within a
bound that keeps sums, squares and normalisations finite: rewards within `max_abs_reward`,
values/returns/advantages within `ESTIMATE_SCALE` times that, log-probs within `LOG_PROB_BOUND`. Strings
(`id`, `maker`, `group_id`) are at most `MAX_NAME_BYTES` of UTF-8; `info` is JSON data of at most
`MAX_INFO_BYTES`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from detached_rl.core.limits import DEFAULT_MAX_ABS_REWARD as DEFAULT_MAX_ABS_REWARD
from detached_rl.core.limits import MAX_ABS_REWARD_LIMIT

TOKEN_FIELDS = ("values", "ref_log_probs", "advantages", "returns")
"""Optional per-response-token float fields, present on all samples of a batch or none."""

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LOG_PROB_SLACK = 1e-4  # log-probs are <= 0; allow float rounding above zero.

TRAINING_DTYPE = torch.float32
"""The dtype `collate` casts every float field to: the one its values must be finite in."""
ESTIMATE_SCALE = 1e6
"""values, returns and advantages may be this many times `max_abs_reward` (a return sums many rewards)."""
LOG_PROB_BOUND = 1e4
"""|log-prob| bound: the smallest float32 probability is e^-104; beyond 1e4 a log-prob is garbage that only
overflows KL terms (k2 squares it)."""
MAX_NAME_BYTES = 256
"""UTF-8 bytes allowed in `id`, `group_id` and `maker` (a uuid hex id is 32)."""
MAX_INFO_BYTES = 64 * 1024
"""JSON bytes allowed in `info`: decoded text and reward components fit easily;
megabytes do not belong here."""


class CheckedSample(Protocol):
    """What the checks read of a sample: `Experience`'s fields (a dataclass's) and its response length."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    log_probs: torch.Tensor
    reward: torch.Tensor
    policy_version: int
    maker: str
    id: str
    values: torch.Tensor | None
    ref_log_probs: torch.Tensor | None
    advantages: torch.Tensor | None
    returns: torch.Tensor | None
    group_id: str | None
    info: dict[str, Any]

    @property
    def response_length(self) -> int:
        """Number of response tokens."""
        ...


Sample = TypeVar("Sample", bound=CheckedSample)


class ExperienceValidationError(ValueError):
    """A malformed experience; `field` names the offending field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"Experience.{field_name}: {message}")
        self.field = field_name


def short_repr(value: Any, limit: int = 60) -> str:
    """repr of a pushed value for a message, cut to about `limit` characters (a
    refused id may be megabytes)."""
    text = repr(value[: limit + 1] if isinstance(value, str | bytes) else value)
    return text if len(text) <= limit else f"{text[:limit]}..."


@dataclass(frozen=True)
class _Bound:
    """The largest magnitude a float field may hold, and the setting it comes from (for the message)."""

    limit: float
    source: str


_LOG_PROBS = _Bound(LOG_PROB_BOUND, "LOG_PROB_BOUND: no sampled token is that unlikely")


def validate_experience(exp: Sample, vocab_size: int | None, max_abs_reward: float) -> Sample:
    """`Experience.validate`: raise `ExperienceValidationError` naming the first
    bad field; else return `exp`."""
    if not (isinstance(max_abs_reward, int | float) and 0 < max_abs_reward <= MAX_ABS_REWARD_LIMIT):
        raise ValueError(f"max_abs_reward must be in (0, {MAX_ABS_REWARD_LIMIT:g}], got {max_abs_reward!r}")
    # A sample built without __init__ (deleted attribute, pickled by another version of this class) may lack
    # a field; fields with a default would silently read the class attribute.
    present = vars(exp)
    for f in fields(exp):
        if f.name not in present:
            raise ExperienceValidationError(f.name,
                                            "is missing (every field must be set; None where optional)")
    _check_ids(exp.prompt_ids, "prompt_ids", vocab_size)
    _check_ids(exp.response_ids, "response_ids", vocab_size)
    length = exp.response_length
    _check_token_floats(exp.log_probs, "log_probs", length, _LOG_PROBS)
    if bool((exp.log_probs > _LOG_PROB_SLACK).any()):
        raise ExperienceValidationError("log_probs", "log-probabilities must be <= 0")
    _check_tensor(exp.reward, "reward")
    reward_bound = _Bound(max_abs_reward, "max_abs_reward (trainer.max_abs_reward)")
    if exp.reward.dim() == 0:
        _check_floats(exp.reward, "reward", reward_bound)
    else:
        _check_token_floats(exp.reward, "reward", length, reward_bound, what="a scalar or")
    estimate_bound = _Bound(max_abs_reward * ESTIMATE_SCALE, f"{ESTIMATE_SCALE:g} x max_abs_reward")
    for name in TOKEN_FIELDS:
        value = getattr(exp, name)
        if value is None:
            continue
        if name == "ref_log_probs":
            _check_reference_log_probs(value, length)
        else:
            _check_token_floats(value, name, length, estimate_bound)
    if isinstance(exp.policy_version, bool) or not isinstance(exp.policy_version, int):
        raise ExperienceValidationError("policy_version", f"must be an int, got {exp.policy_version!r}")
    if exp.policy_version < 0:
        raise ExperienceValidationError("policy_version", f"must be >= 0, got {exp.policy_version}")
    if not isinstance(exp.maker, str):
        raise ExperienceValidationError("maker", f"must be a str, got {type(exp.maker).__name__}")
    _check_name(exp.maker, "maker")
    if not isinstance(exp.id, str) or not exp.id:
        raise ExperienceValidationError("id", f"must be a non-empty str, got {short_repr(exp.id)}")
    _check_name(exp.id, "id")
    if exp.group_id is not None:
        if not isinstance(exp.group_id, str):
            raise ExperienceValidationError("group_id",
                                            f"must be a str or None, got {short_repr(exp.group_id)}")
        _check_name(exp.group_id, "group_id")
    if not isinstance(exp.info, dict):
        raise ExperienceValidationError("info", f"must be a dict, got {type(exp.info).__name__}")
    _check_info(exp.info)
    known = {f.name for f in fields(exp)}
    unknown = sorted(name for name in vars(exp) if name not in known)
    if unknown:
        raise ExperienceValidationError(unknown[0], f"unknown field (known: {sorted(known)})")
    return exp


def _check_name(value: str, name: str) -> None:
    # Characters never outnumber UTF-8 bytes: a 20 MB string is refused before it is encoded.
    if len(value) > MAX_NAME_BYTES:
        raise ExperienceValidationError(name,
                                        f"is {len(value)} characters long, over the "
                                        f"{MAX_NAME_BYTES}-byte limit")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as error:
        raise ExperienceValidationError(name, f"is not valid UTF-8 text: {error.reason}") from None
    if size > MAX_NAME_BYTES:
        raise ExperienceValidationError(name,
                                        f"is {size} bytes as UTF-8, over the {MAX_NAME_BYTES}-byte limit")


def _check_info(info: dict[str, Any]) -> None:
    if any(not isinstance(key, str) for key in info):
        raise ExperienceValidationError("info", "keys must be strings")
    try:
        size = len(json.dumps(info, allow_nan=True))
    except (TypeError, ValueError) as error:
        raise ExperienceValidationError("info",
                                        "must hold JSON data (str, numbers, lists, "
                                        f"dicts): {error}") from None
    if size > MAX_INFO_BYTES:
        raise ExperienceValidationError("info",
                                        f"is {size} bytes as JSON, over the {MAX_INFO_BYTES}-byte limit")


def _check_tensor(value: Any, name: str) -> None:
    """A dense tensor with data: sparse, other non-strided and meta tensors are refused
    before anything reads them."""
    if not isinstance(value, torch.Tensor):
        raise ExperienceValidationError(name, f"must be a tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise ExperienceValidationError(name, f"must be a dense (strided) tensor, got layout {value.layout}")
    if value.is_meta:
        raise ExperienceValidationError(name, "is a meta tensor (a shape without data)")


def _check_ids(value: Any, name: str, vocab_size: int | None) -> None:
    _check_tensor(value, name)
    if value.dim() != 1:
        raise ExperienceValidationError(name, f"must be 1-D, got shape {tuple(value.shape)}")
    if value.dtype != torch.long:
        raise ExperienceValidationError(name, f"dtype must be torch.int64, got {value.dtype}")
    if value.numel() == 0:
        raise ExperienceValidationError(name, "is empty")
    if bool((value < 0).any()):
        raise ExperienceValidationError(name, "has negative token ids")
    if vocab_size is not None and bool((value >= vocab_size).any()):
        raise ExperienceValidationError(name, f"has token ids >= vocab size {vocab_size}")


def _check_floats(value: torch.Tensor, name: str, bound: _Bound) -> None:
    if value.dtype not in _FLOAT_DTYPES:
        raise ExperienceValidationError(name, f"dtype must be floating point, got {value.dtype}")
    if not bool(torch.isfinite(value).all()):
        raise ExperienceValidationError(name, "has non-finite values (NaN or inf)")
    finite = value.detach()[torch.isfinite(value)]
    if not finite.numel():
        return
    magnitude = float(finite.to(torch.float64).abs().max())
    if not bool(torch.isfinite(finite.to(TRAINING_DTYPE)).all()):
        raise ExperienceValidationError(
            name,
            f"has a value of magnitude {magnitude:.3g}, which is inf in {TRAINING_DTYPE} (the "
            "training dtype)")
    if magnitude > bound.limit:
        raise ExperienceValidationError(
            name,
            f"has a value of magnitude {magnitude:.3g}, over the limit {bound.limit:g} ({bound.source})")


def _check_token_floats(value: Any, name: str, length: int, bound: _Bound, what: str = "") -> None:
    _check_tensor(value, name)
    if value.dim() != 1 or value.numel() != length:
        expected = f"{what} a 1-D tensor of length {length}".strip()
        raise ExperienceValidationError(
            name, f"must be {expected} (one per response token), got shape {tuple(value.shape)}"
        )
    _check_floats(value, name, bound)


def _check_reference_log_probs(value: Any, length: int) -> None:
    # Reference log-probs come from the temperature-scaled full distribution (`models.reference_sampling`),
    # which gives every token the policy can sample a finite log-prob; -inf means a reference scored with
    # top-k/top-p. (Replay buffers checkpointed before this rule load unchecked; the trainers
    # leave -inf out of the KL.)
    _check_tensor(value, "ref_log_probs")
    if value.dtype in _FLOAT_DTYPES and bool((value == float("-inf")).any()):
        raise ExperienceValidationError(
            "ref_log_probs",
            "has -inf values: reference log-probs must be scored on the temperature-scaled full "
                             "distribution (no top-k/top-p; detached_rl.models.reference_sampling), "
                             "where every token the policy can sample has a finite log-prob")
    _check_token_floats(value, "ref_log_probs", length, _LOG_PROBS)
