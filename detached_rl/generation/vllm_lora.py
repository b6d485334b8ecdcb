"""LoRA "keep" mode for `VLLMBackend`: the engine serves the plain base weights and one vLLM adapter per
version.

The trainer's LoRA model state-dict keys split in two (`KeepModeLayout`): the adapter's A and B of each
adapted Linear, and everything else, the base, which the engine loads under the plain HF names
(`...q_proj.base_layer.weight` -> `...q_proj.weight`) through the same in-place reload as a full update.

`VLLMLoraSink` keeps a host mirror of the LoRA model (a `ModuleWeightSink`), so `layout`/`state` are
the trainer's keys. `commit` of version v writes the mirror's A/B in peft adapter format
(`base_model.model.<module>.lora_A.weight`, no adapter name) and an adapter_config.json to a fresh
directory under a RAM-backed root (/dev/shm) and registers it with the engine as adapter id v+1
(`LLMEngine.add_lora`, which loads and validates it before anything else changes); a full update (or
any base key written) then also reloads the base. Only after both succeed does the served version
switch; `generate` pins every request of a batch to it, so no row runs without an adapter (vLLM
0.32 gives wrong results for adapter-less rows batched with adapter rows: docs/vllm-notes.md §4).
The last `versions_kept` adapters stay registered; older ones are removed with `remove_lora` and
their directories deleted.

Why a directory and not memory: vLLM 0.32 loads adapters only from a path (`LoRARequest.lora_path`,
`PEFTHelper.from_local_dir`, `LoRAModel.from_local_checkpoint`); serving tensors from memory means
replacing the worker's private `_load_adapter`. A tmpfs directory uses the public API only and costs
one small file write per update (the adapter, not the base).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import loralib
import peft
from peft.tuners.lora import Linear as PeftLinear
from peft.tuners.lora import LoraLayer as PeftLoraLayer
from torch import Tensor, nn

from detached_rl.models.lora import check_lora_update, lora_backend, lora_config_dict
from detached_rl.weights.sink import ModuleWeightSink, SinkCommit, SinkUnchanged, TensorLayout

__all__ = ["KeepModeLayout", "VLLMLoraSink", "engine_lora_rank"]

# The `max_lora_rank` values vLLM 0.32 accepts (`vllm.config.lora.MaxLoRARanks`).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
PEFT_PREFIX = "base_model.model."


def engine_lora_rank(r: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds rank `r`."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"LoRA rank {r} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def _refuse(what: str) -> ValueError:
    return ValueError(f"lora_mode 'keep' with the vLLM backend does not support {what}; use lora_mode: merge")


@dataclass(frozen=True)
class KeepModeLayout:
    """How a LoRA model's state-dict keys split into the engine's plain base weights
    and a peft-format adapter."""

    plain_names: dict[str, str]  # trainer key -> HF name the engine loads (every key but the adapter's)
    adapter_names: dict[str, str]  # trainer key of an A or B -> peft adapter key
    config: dict[str, Any]  # `lora_config_dict` of the model: what updates' metadata["lora"] must match
    adapter_config: dict[str, Any]  # the adapter_config.json vLLM reads
    hf_model: nn.Module  # the model inside the LoRA wrapper (its HF config builds the engine)

    @classmethod
    def from_lora_model(cls, model: nn.Module) -> KeepModeLayout:
        """The layout of a peft or loralib LoRA model; ValueError naming what keep mode cannot serve."""
        backend = lora_backend(model)
        if backend is None:
            raise ValueError("KeepModeLayout needs a model with LoRA modules")
        config = lora_config_dict(model)
        if config["bias"] != "none":
            raise _refuse(f"bias={config['bias']!r} (trained biases)")
        if config["modules_to_save"]:
            raise _refuse(f"modules_to_save={config['modules_to_save']}")
        if config["fan_in_fan_out"]:
            raise _refuse("fan_in_fan_out (Conv1D layers, e.g. GPT-2)")
        key_of = {id(tensor): key for key, tensor in reversed(model.state_dict(keep_vars=True).items())}
        if backend == "peft":
            adapters, hf_model, use_rslora = _peft_adapters(model, key_of)
        else:
            adapters, hf_model, use_rslora = _loralib_adapters(model, key_of), model, False
        plain: dict[str, str] = {}
        for key in model.state_dict(keep_vars=True):
            if key in adapters:
                continue
            if "lora_" in key:
                raise _refuse(f"the LoRA tensor {key!r}")
            if backend == "peft":
                if not key.startswith(PEFT_PREFIX):
                    raise _refuse(f"the state-dict key {key!r} (not under {PEFT_PREFIX!r})")
                plain[key] = key.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
            else:
                plain[key] = key
        if len(set(plain.values())) != len(plain):
            raise ValueError("KeepModeLayout: two state-dict keys map to the same plain weight name")
        adapter_config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config["r"], "lora_alpha": config["alpha"],
            "target_modules": list(config["target_modules"]), "bias": "none", "use_rslora": use_rslora,
            "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
        }
        return cls(plain, adapters, config, adapter_config, hf_model)


def _peft_adapters(model: nn.Module, key_of: dict[int, str]) -> tuple[dict[str, str], nn.Module, bool]:
    """(trainer key -> peft adapter key, the HF model, use_rslora) of a peft model keep mode can serve."""
    if not isinstance(model, peft.PeftModel):
        raise _refuse(f"peft LoRA layers outside a PeftModel ({type(model).__name__})")
    if len(model.peft_config) != 1:
        raise _refuse(f"{len(model.peft_config)} peft adapters ({sorted(model.peft_config)})")
    (name, config), = model.peft_config.items()
    for field in ("use_dora", "lora_bias", "rank_pattern", "alpha_pattern", "layer_replication"):
        if getattr(config, field, None):
            raise _refuse(f"peft LoraConfig.{field}={getattr(config, field)!r}")
    adapters: dict[str, str] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, PeftLoraLayer):
            continue
        if not isinstance(module, PeftLinear):
            raise _refuse(f"LoRA on a {type(module).__name__} (module {module_name!r})")
        if list(module.active_adapters) != [name] or module.merged or name in module.lora_variant:
            raise _refuse(f"module {module_name!r}: active adapters {module.active_adapters}, "
                          f"merged={module.merged}, variants {sorted(module.lora_variant)}")
        for part in ("lora_A", "lora_B"):
            tensor = getattr(module, part)[name].weight
            adapters[key_of[id(tensor)]] = f"{module_name}.{part}.weight"
    return adapters, model.get_base_model(), bool(config.use_rslora)


def _loralib_adapters(model: nn.Module, key_of: dict[int, str]) -> dict[str, str]:
    """trainer key -> peft adapter key of a loralib model keep mode can serve
    (plain `loralib.Linear` only)."""
    adapters: dict[str, str] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, loralib.LoRALayer):
            continue
        if isinstance(module, loralib.MergedLinear):
            raise _refuse(f"loralib MergedLinear (module {module_name!r})")
        if not isinstance(module, loralib.Linear):
            raise _refuse(f"loralib {type(module).__name__} (module {module_name!r})")
        if module.fan_in_fan_out or module.merged:
            raise _refuse(f"module {module_name!r} with fan_in_fan_out={module.fan_in_fan_out}, "
                          f"merged={module.merged}")
        for part in ("lora_A", "lora_B"):
            adapters[key_of[id(getattr(module, part))]] = f"{PEFT_PREFIX}{module_name}.{part}.weight"
    return adapters


@dataclass(frozen=True)
class _Adapter:
    """One registered vLLM adapter: the request that serves it and its directory."""

    request: Any  # vllm.lora.request.LoRARequest (load_inplace=False: it must not reload on every step)
    path: str


class VLLMLoraSink:
    """A `WeightSink` serving a LoRA policy in keep mode: base weights in the
    engine, one adapter per version."""

    def __init__(self, model: nn.Module, layout: KeepModeLayout, llm: Any,
                 reload: Callable[[Iterator[tuple[str, Tensor]]], None], root: str,
                 versions_kept: int) -> None:
        if versions_kept < 1:
            raise ValueError(f"lora_versions_kept must be >= 1, got {versions_kept}")
        self.mirror = ModuleWeightSink(model)
        self.spec = layout
        self.llm = llm
        self.reload = reload
        self.root = root
        self.versions_kept = versions_kept
        self.reloads = 0
        self._kept: dict[int, _Adapter] = {}  # adapter id -> adapter, oldest registration first
        self._current: _Adapter | None = None
        # the current adapter's A/B (trainer keys), to undo a failed commit
        self._served: dict[str, Tensor] = {}
        self._serial = itertools.count()
        os.makedirs(root, exist_ok=True)

    def layout(self) -> Mapping[str, TensorLayout]:
        return self.mirror.layout()

    def state(self) -> Mapping[str, Tensor]:
        return self.mirror.state()

    def stage(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return self.mirror.stage(tensors)

    def write(self, tensors: Mapping[str, Tensor]) -> None:
        self.mirror.write(tensors)

    def check_update(self, kind: str, metadata: Mapping[str, Any]) -> None:
        """Refuse an update whose adapter config (metadata["lora"]) is not this
        adapter's, or a LoRA one without it."""
        check_lora_update(self.spec.config, kind, metadata, "vLLM LoRA adapter")

    @property
    def serving_request(self) -> Any:
        """The `LoRARequest` every request of the next batch carries (the current version's adapter)."""
        if self._current is None:
            raise RuntimeError("VLLMLoraSink: no adapter registered yet (call start)")
        return self._current.request

    @property
    def adapter_ids(self) -> list[int]:
        """The adapter ids this sink keeps registered, oldest first (the current one last)."""
        return list(self._kept)

    def start(self, version: int = 0) -> None:
        """Load the mirror's base into the engine and register its adapter as
        `version` (once, at start-up)."""
        self.push_base()
        self._switch(version, reload_base=False)

    def commit(self, update: SinkCommit) -> None:
        """Register the written adapter as `update.version` (reloading the base if
        any base key was written)."""
        reload_base = update.kind == "full" or any(key not in self.spec.adapter_names for key in update.keys)
        self._switch(update.version, reload_base)

    def push_base(self) -> None:
        """Load the mirror's base weights, under their plain HF names, into the engine."""
        state = self.mirror.state()
        self.reload(iter([(name, state[key]) for key, name in self.spec.plain_names.items()]))
        self.reloads += 1

    def close(self) -> None:
        """Remove every adapter from the engine and delete their directories."""
        for adapter_id in list(self._kept):
            self.llm.llm_engine.remove_lora(adapter_id)
        self._kept.clear()
        self._current = None
        shutil.rmtree(self.root, ignore_errors=True)

    def _switch(self, version: int, reload_base: bool) -> None:
        """Register the mirror's adapter as `version` (then reload the base);
        serve it only if all succeeded."""
        try:
            adapter, replaced = self._register(version)
            if reload_base:
                try:
                    self.push_base()
                except Exception:
                    if replaced is None:
                        self.llm.llm_engine.remove_lora(adapter.request.lora_int_id)
                        shutil.rmtree(adapter.path, ignore_errors=True)
                    raise
        except Exception as error:
            self.mirror.write(self._served)  # the mirror's adapter goes back to the one served
            if reload_base:  # the mirror's base holds the refused update's (and the engine's may, in part)
                raise
            serving = self._current.request.lora_int_id - 1 if self._current is not None else None
            raise SinkUnchanged(f"adapter v{version} not registered, v{serving} still serves: "
                                f"{type(error).__name__}: {error}") from error
        adapter_id = adapter.request.lora_int_id
        self._kept.pop(adapter_id, None)
        if replaced is not None:
            shutil.rmtree(replaced.path, ignore_errors=True)
        self._kept[adapter_id] = adapter
        self._current = adapter
        state = self.mirror.state()
        self._served = {key: state[key].detach().clone() for key in self.spec.adapter_names}
        while len(self._kept) > self.versions_kept:
            oldest = next(iter(self._kept))
            evicted = self._kept.pop(oldest)
            self.llm.llm_engine.remove_lora(oldest)
            shutil.rmtree(evicted.path, ignore_errors=True)

    def _register(self, version: int) -> tuple[_Adapter, _Adapter | None]:
        """Write the mirror's adapter to a new directory and have the engine load it as id `version + 1`.

        Returns the adapter and the kept one it replaced under the same id (a trainer resumed at an older
        version, or the first full update after start-up), which vLLM swaps only once the new one loaded.
        """
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        adapter_id = version + 1
        if adapter_id < 1:
            raise ValueError(f"VLLMLoraSink: version {version} has no adapter id (versions start at 0)")
        # unique: vLLM's prefix cache keys blocks by adapter name and path
        name = f"v{version}-{next(self._serial)}"
        path = os.path.join(self.root, name)
        state = self.mirror.state()
        tensors = {peft_key: state[key].detach().to("cpu").contiguous().clone()
                   for key, peft_key in self.spec.adapter_names.items()}
        os.makedirs(path)
        try:
            save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
            with open(os.path.join(path, "adapter_config.json"), "w") as file:
                json.dump(self.spec.adapter_config, file)
            replaced = self._kept.get(adapter_id)
            request = LoRARequest(name, adapter_id, path)
            loading = LoRARequest(name, adapter_id, path,
                                  load_inplace=True) if replaced is not None else request
            if not self.llm.llm_engine.add_lora(loading):
                raise RuntimeError(f"vLLM did not add adapter {adapter_id} ({path})")
        except Exception:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return _Adapter(request, path), replaced
