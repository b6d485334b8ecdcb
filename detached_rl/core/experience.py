"""Experience: one generated response with everything a trainer needs, and its padded batch form.

Wire format: one `Experience` per response, ragged (no padding). Tensors are 1-D and on
the CPU when they travel; ids are int64, float fields are any floating dtype.
Token-aligned fields (`log_probs`, `values`, `ref_log_probs`, `advantages`, `returns`,
a per-token `reward`) have one entry per response token: entry t belongs to
`response_ids[t]` (its log-prob given the prompt and `response_ids[:t]`).

Batch format (`ExperienceBatch`, built by `collate` on the trainer): prompts are
left-padded to the longest prompt, responses right-padded to the longest response, so
every response starts at column `prompt_len` of `sequences`. `collate(..., device=)` pads on
the host (in pinned memory when the batch goes to a CUDA device) and copies the batch over once.

Numeric guards (`Experience.validate`): float fields are trained in float32 (`TRAINING_DTYPE`, `collate`
casts to it), so every value must be finite there, not only in the dtype it travels in (1e300 in
float64 is inf in float32), and within a bound that keeps sums, squares and normalisations finite:
rewards within `max_abs_reward`, values/returns/advantages within `ESTIMATE_SCALE` times that,
log-probs within `LOG_PROB_BOUND`. Strings (`id`, `maker`, `group_id`) are at most `MAX_NAME_BYTES`
of UTF-8; strings and `info` count in `nbytes`, the replay buffer's budget unit.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from detached_rl.core.devices import pin_for, to_device

TOKEN_FIELDS = ("values", "ref_log_probs", "advantages", "returns")
"""Optional per-response-token float fields, present on all samples of a batch or none."""

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LOG_PROB_SLACK = 1e-4  # log-probs are <= 0; allow float rounding above zero.

TRAINING_DTYPE = torch.float32
"""The dtype `collate` casts every float field to: the one its values must be finite in."""
DEFAULT_MAX_ABS_REWARD = 1e4
"""The replay buffer's default bound on |reward| (`TrainerConfig.max_abs_reward`)."""
MAX_ABS_REWARD_LIMIT = 1e8
"""The largest `max_abs_reward` allowed, and `validate`'s default: with it, the largest estimate
(`ESTIMATE_SCALE` times it) squared and summed over a batch's tokens stays far inside float32."""
ESTIMATE_SCALE = 1e6
"""values, returns and advantages may be this many times `max_abs_reward` (a return sums many rewards)."""
LOG_PROB_BOUND = 1e4
"""|log-prob| bound: the smallest float32 probability is e^-104; beyond 1e4 a log-prob is garbage that only
overflows KL terms (k2 squares it)."""
MAX_NAME_BYTES = 256
"""UTF-8 bytes allowed in `id`, `group_id` and `maker` (a uuid hex id is 32)."""


class ExperienceValidationError(ValueError):
    """A malformed experience; `field` names the offending field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"Experience.{field_name}: {message}")
        self.field = field_name


def new_experience_id() -> str:
    """Return a fresh unique experience id."""
    return uuid.uuid4().hex


@dataclass
class Experience:
    """One response to one prompt, scored, tagged with the policy version that produced it."""

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    log_probs: torch.Tensor
    reward: torch.Tensor
    policy_version: int = 0
    maker: str = ""
    id: str = field(default_factory=new_experience_id)
    values: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    group_id: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def response_length(self) -> int:
        """Number of response tokens."""
        return int(self.response_ids.numel())

    @property
    def score(self) -> float:
        """The sequence-level reward: the scalar reward, or the sum of a per-token reward (summed in float64)."""
        return float(self.reward.detach().to(torch.float64).sum())

    def nbytes(self) -> int:
        """Bytes the sample holds: its tensors, its strings (UTF-8) and its `info` (as JSON); the buffer's budget unit."""
        total = 0
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
            elif isinstance(value, str):
                total += len(value.encode("utf-8", "surrogatepass"))
        return total + _info_nbytes(self.info)

    def validate(self, vocab_size: int | None = None, max_abs_reward: float = MAX_ABS_REWARD_LIMIT) -> Experience:
        """Check shapes, dtypes, values and sizes; raise `ExperienceValidationError` naming the bad field.

        Rewards must lie within `max_abs_reward` (the trainer's `trainer.max_abs_reward`), values, returns and
        advantages within `ESTIMATE_SCALE` times it, log-probs within `LOG_PROB_BOUND`; all finite in float32.
        """
        if not (isinstance(max_abs_reward, int | float) and 0 < max_abs_reward <= MAX_ABS_REWARD_LIMIT):
            raise ValueError(f"max_abs_reward must be in (0, {MAX_ABS_REWARD_LIMIT:g}], got {max_abs_reward!r}")
        # A sample built without __init__ (deleted attribute, pickled by another version of this class) may lack
        # a field; fields with a default would silently read the class attribute.
        present = vars(self)
        for f in fields(self):
            if f.name not in present:
                raise ExperienceValidationError(f.name, "is missing (every field must be set; None where optional)")
        _check_ids(self.prompt_ids, "prompt_ids", vocab_size)
        _check_ids(self.response_ids, "response_ids", vocab_size)
        length = self.response_length
        _check_token_floats(self.log_probs, "log_probs", length, _LOG_PROBS)
        if bool((self.log_probs > _LOG_PROB_SLACK).any()):
            raise ExperienceValidationError("log_probs", "log-probabilities must be <= 0")
        _check_tensor(self.reward, "reward")
        reward_bound = _Bound(max_abs_reward, "max_abs_reward (trainer.max_abs_reward)")
        if self.reward.dim() == 0:
            _check_floats(self.reward, "reward", reward_bound)
        else:
            _check_token_floats(self.reward, "reward", length, reward_bound, what="a scalar or")
        estimate_bound = _Bound(max_abs_reward * ESTIMATE_SCALE, f"{ESTIMATE_SCALE:g} x max_abs_reward")
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if name == "ref_log_probs":
                _check_reference_log_probs(value, length)
            else:
                _check_token_floats(value, name, length, estimate_bound)
        if isinstance(self.policy_version, bool) or not isinstance(self.policy_version, int):
            raise ExperienceValidationError("policy_version", f"must be an int, got {self.policy_version!r}")
        if self.policy_version < 0:
            raise ExperienceValidationError("policy_version", f"must be >= 0, got {self.policy_version}")
        if not isinstance(self.maker, str):
            raise ExperienceValidationError("maker", f"must be a str, got {type(self.maker).__name__}")
        _check_name(self.maker, "maker")
        if not isinstance(self.id, str) or not self.id:
            raise ExperienceValidationError("id", f"must be a non-empty str, got {short_repr(self.id)}")
        _check_name(self.id, "id")
        if self.group_id is not None:
            if not isinstance(self.group_id, str):
                raise ExperienceValidationError("group_id", f"must be a str or None, got {short_repr(self.group_id)}")
            _check_name(self.group_id, "group_id")
        if not isinstance(self.info, dict):
            raise ExperienceValidationError("info", f"must be a dict, got {type(self.info).__name__}")
        _check_info(self.info)
        known = {f.name for f in fields(self)}
        unknown = sorted(name for name in vars(self) if name not in known)
        if unknown:
            raise ExperienceValidationError(unknown[0], f"unknown field (known: {sorted(known)})")
        return self

    def to(self, device: torch.device | str) -> Experience:
        """Return a copy with every tensor moved to `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor)
            else getattr(self, f.name)
            for f in fields(self)
        }
        return Experience(**moved)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict (tensors as lists)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.tolist() if isinstance(value, torch.Tensor) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Experience:
        """Rebuild an experience from `to_dict` output; unknown keys are refused."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ExperienceValidationError(unknown[0], f"unknown field (known: {sorted(known)})")
        kwargs = dict(data)
        for name in ("prompt_ids", "response_ids"):
            if name in kwargs:
                kwargs[name] = torch.tensor(kwargs[name], dtype=torch.long)
        for name in ("log_probs", "reward", *TOKEN_FIELDS):
            if kwargs.get(name) is not None:
                kwargs[name] = torch.tensor(kwargs[name], dtype=torch.float32)
        return cls(**kwargs)


MAX_INFO_BYTES = 64 * 1024  # decoded text and reward components fit easily; megabytes of it do not belong here


@dataclass(frozen=True)
class _Bound:
    """The largest magnitude a float field may hold, and the setting it comes from (for the message)."""

    limit: float
    source: str


_LOG_PROBS = _Bound(LOG_PROB_BOUND, "LOG_PROB_BOUND: no sampled token is that unlikely")


def short_repr(value: Any, limit: int = 60) -> str:
    """repr of a pushed value for a message, cut to about `limit` characters (a refused id may be megabytes)."""
    text = repr(value[: limit + 1] if isinstance(value, str | bytes) else value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def _check_name(value: str, name: str) -> None:
    # Characters never outnumber UTF-8 bytes: a 20 MB string is refused before it is encoded.
    if len(value) > MAX_NAME_BYTES:
        raise ExperienceValidationError(name, f"is {len(value)} characters long, over the {MAX_NAME_BYTES}-byte limit")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as error:
        raise ExperienceValidationError(name, f"is not valid UTF-8 text: {error.reason}") from None
    if size > MAX_NAME_BYTES:
        raise ExperienceValidationError(name, f"is {size} bytes as UTF-8, over the {MAX_NAME_BYTES}-byte limit")


def _info_nbytes(info: Any) -> int:
    try:
        return len(json.dumps(info, allow_nan=True))  # ASCII (non-ASCII is escaped): characters are bytes
    except (TypeError, ValueError):  # an unvalidated sample (a restored state): count its text form
        return len(repr(info))


def _check_info(info: dict[str, Any]) -> None:
    if any(not isinstance(key, str) for key in info):
        raise ExperienceValidationError("info", "keys must be strings")
    try:
        size = len(json.dumps(info, allow_nan=True))
    except (TypeError, ValueError) as error:
        raise ExperienceValidationError("info", f"must hold JSON data (str, numbers, lists, dicts): {error}") from None
    if size > MAX_INFO_BYTES:
        raise ExperienceValidationError("info", f"is {size} bytes as JSON, over the {MAX_INFO_BYTES}-byte limit")


def _check_tensor(value: Any, name: str) -> None:
    """A dense tensor with data: sparse, other non-strided and meta tensors are refused before anything reads them."""
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
            name, f"has a value of magnitude {magnitude:.3g}, which is inf in {TRAINING_DTYPE} (the training dtype)")
    if magnitude > bound.limit:
        raise ExperienceValidationError(
            name, f"has a value of magnitude {magnitude:.3g}, over the limit {bound.limit:g} ({bound.source})")


def _check_token_floats(value: Any, name: str, length: int, bound: _Bound, what: str = "") -> None:
    _check_tensor(value, name)
    if value.dim() != 1 or value.numel() != length:
        expected = f"{what} a 1-D tensor of length {length}".strip()
        raise ExperienceValidationError(
            name, f"must be {expected} (one per response token), got shape {tuple(value.shape)}"
        )
    _check_floats(value, name, bound)


def _check_reference_log_probs(value: Any, length: int) -> None:
    # Reference log-probs come from the temperature-scaled full distribution (`models.reference_sampling`), which
    # gives every token the policy can sample a finite log-prob; -inf means a reference scored with top-k/top-p.
    # (Replay buffers checkpointed before this rule load unchecked; the trainers leave -inf out of the KL.)
    _check_tensor(value, "ref_log_probs")
    if value.dtype in _FLOAT_DTYPES and bool((value == float("-inf")).any()):
        raise ExperienceValidationError(
            "ref_log_probs", "has -inf values: reference log-probs must be scored on the temperature-scaled full "
                             "distribution (no top-k/top-p; detached_rl.models.reference_sampling), where every "
                             "token the policy can sample has a finite log-prob")
    _check_token_floats(value, "ref_log_probs", length, _LOG_PROBS)


@dataclass
class ExperienceBatch:
    """A padded batch of experiences. B = batch size, P = longest prompt, R = longest response.

    `sequences` [B, P+R] holds left-padded prompts then right-padded responses;
    `attention_mask` [B, P+R] marks real tokens; `response_mask` [B, R] marks response
    tokens. Token fields are [B, R] float32, 0 at padding. A scalar reward sits at the
    last response token of `token_rewards`; `scores` [B] is each sequence's total reward.
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_length: int
    log_probs: torch.Tensor
    token_rewards: torch.Tensor
    scores: torch.Tensor
    scalar_reward: torch.Tensor
    policy_versions: torch.Tensor
    ids: list[str]
    makers: list[str]
    group_ids: list[str | None]
    infos: list[dict[str, Any]]
    values: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None  # trainer-side: the proximal policy's log-probs
    loss_weights: torch.Tensor | None = None  # trainer-side: per-token loss weights (importance weights)

    @property
    def size(self) -> int:
        """Number of sequences."""
        return int(self.sequences.shape[0])

    @property
    def response_ids(self) -> torch.Tensor:
        """[B, R] response token ids (padding where `response_mask` is 0)."""
        return self.sequences[:, self.prompt_length :]

    @property
    def num_response_tokens(self) -> int:
        """Count of valid response tokens in the batch."""
        return int(self.response_mask.sum())

    def select(self, rows: Sequence[int] | torch.Tensor) -> ExperienceBatch:
        """The sub-batch of the given rows, with padding columns no row uses trimmed away."""
        positions = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        index = torch.as_tensor(positions, dtype=torch.long, device=self.sequences.device)
        used_prompt_columns = self.attention_mask[index, : self.prompt_length].any(0)
        # Both trim bounds in one device-to-host transfer: the first prompt column any row uses
        # (prompts are never empty) and the longest response.
        prompt_start, response_length = torch.stack(
            [used_prompt_columns.int().argmax(), self.response_mask[index].sum(1).max()]).tolist()
        response_length = max(response_length, 1)
        end = self.prompt_length + response_length
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                picked[f.name] = [value[i] for i in positions]
            elif f.name in ("sequences", "attention_mask"):
                picked[f.name] = value[index, prompt_start:end]
            elif isinstance(value, torch.Tensor) and value.dim() == 2:
                picked[f.name] = value[index, :response_length]
            elif isinstance(value, torch.Tensor):
                picked[f.name] = value[index]
            else:
                picked[f.name] = value
        picked["prompt_length"] = self.prompt_length - prompt_start
        return ExperienceBatch(**picked)

    def to(self, device: torch.device | str) -> ExperienceBatch:
        """Return a copy with every tensor moved to `device` (from the host to CUDA: pinned, non-blocking)."""
        return ExperienceBatch(
            **{
                f.name: to_device(getattr(self, f.name), device) if isinstance(getattr(self, f.name), torch.Tensor)
                else getattr(self, f.name)
                for f in fields(self)
            }
        )


def collate(experiences: Sequence[Experience], pad_token_id: int = 0,
            device: torch.device | str | None = None) -> ExperienceBatch:
    """Pad a list of experiences into one batch (prompts left-padded, responses right-padded).

    The batch is padded where the experiences are (the host, for experiences off the wire) and
    then moved to `device` in one copy per tensor; for a CUDA `device` it is padded in pinned
    memory and copied without blocking. None: it stays where the experiences are.
    """
    if len(experiences) == 0:
        raise ValueError("collate: experiences is empty")
    for name in TOKEN_FIELDS:
        present = [getattr(e, name) is not None for e in experiences]
        if any(present) and not all(present):
            raise ExperienceValidationError(name, "present on some experiences of the batch but not all")
    batch_size = len(experiences)
    prompt_len = max(e.prompt_ids.numel() for e in experiences)
    response_len = max(e.response_length for e in experiences)
    where = experiences[0].prompt_ids.device
    on = {"device": where, "pin_memory": where.type == "cpu" and pin_for(device)}
    sequences = torch.full((batch_size, prompt_len + response_len), pad_token_id, dtype=torch.long, **on)
    attention_mask = torch.zeros((batch_size, prompt_len + response_len), dtype=torch.long, **on)
    response_mask = torch.zeros((batch_size, response_len), dtype=torch.long, **on)
    log_probs = torch.zeros((batch_size, response_len), **on)
    token_rewards = torch.zeros((batch_size, response_len), **on)
    optional = {
        name: torch.zeros((batch_size, response_len), **on) if getattr(experiences[0], name) is not None else None
        for name in TOKEN_FIELDS
    }
    for row, exp in enumerate(experiences):
        p, r = exp.prompt_ids.numel(), exp.response_length
        sequences[row, prompt_len - p : prompt_len] = exp.prompt_ids
        sequences[row, prompt_len : prompt_len + r] = exp.response_ids
        attention_mask[row, prompt_len - p : prompt_len + r] = 1
        response_mask[row, :r] = 1
        log_probs[row, :r] = exp.log_probs.float()
        if exp.reward.dim() == 0:
            token_rewards[row, r - 1] = exp.reward.float()
        else:
            token_rewards[row, :r] = exp.reward.float()
        for name, target in optional.items():
            if target is not None:
                target[row, :r] = getattr(exp, name).float()
    batch = ExperienceBatch(
        sequences=sequences,
        attention_mask=attention_mask,
        response_mask=response_mask,
        prompt_length=prompt_len,
        log_probs=log_probs,
        token_rewards=token_rewards,
        scores=token_rewards.sum(dim=1),
        scalar_reward=torch.tensor([e.reward.dim() == 0 for e in experiences], device=where),
        policy_versions=torch.tensor([e.policy_version for e in experiences], dtype=torch.long, device=where),
        ids=[e.id for e in experiences],
        makers=[e.maker for e in experiences],
        group_ids=[e.group_id for e in experiences],
        infos=[dict(e.info) for e in experiences],
        **optional,
    )
    return batch if device is None else batch.to(device)


def uncollate(batch: ExperienceBatch) -> list[Experience]:
    """Split a padded batch back into ragged experiences (inverse of `collate`)."""
    out = []
    # Per-row lengths and flags read back once (not one device sync per row); tensors stay on the batch's device.
    prompt_lengths = batch.attention_mask[:, : batch.prompt_length].sum(1).tolist()
    response_lengths = batch.response_mask.sum(1).tolist()
    scalar_rewards = batch.scalar_reward.tolist()
    policy_versions = batch.policy_versions.tolist()
    for row in range(batch.size):
        r, p = response_lengths[row], prompt_lengths[row]
        prompt_ids = batch.sequences[row, batch.prompt_length - p : batch.prompt_length]  # left-padded
        if scalar_rewards[row]:
            reward = batch.token_rewards[row, r - 1].clone()
        else:
            reward = batch.token_rewards[row, :r].clone()
        optional = {
            name: getattr(batch, name)[row, :r].clone() if getattr(batch, name) is not None else None
            for name in TOKEN_FIELDS
        }
        out.append(
            Experience(
                prompt_ids=prompt_ids.clone(),
                response_ids=batch.response_ids[row, :r].clone(),
                log_probs=batch.log_probs[row, :r].clone(),
                reward=reward,
                policy_version=int(policy_versions[row]),
                maker=batch.makers[row],
                id=batch.ids[row],
                group_id=batch.group_ids[row],
                info=dict(batch.infos[row]),
                **optional,
            )
        )
    return out
