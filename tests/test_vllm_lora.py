"""LoRA keep mode of the vLLM backend on a real engine (CPU): one vLLM adapter per version, not merged.

A trainer (a peft LoRA model, r=8, trained with AdamW) sends real `WeightUpdate`s through a `WeightReceiver`
over the backend's sink; the float32 engine must then generate what the trainer's model generates. Skipped
where `vllm` does not import (install recipe: docs/vllm-notes.md).
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

from detached_rl.generation.vllm import vllm_available

if not vllm_available():
    pytest.skip("vllm is not importable (optional; see docs/vllm-notes.md for the install recipe)",
                allow_module_level=True)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from detached_rl.core.sampling import SamplingConfig, process_logits, token_log_probs  # noqa: E402
from detached_rl.generation.hf import HFGenerationBackend  # noqa: E402
from detached_rl.generation.vllm import VLLMBackend, VLLMLoraSink  # noqa: E402
from detached_rl.models.actor import Actor  # noqa: E402
from detached_rl.models.loaders import tiny_causal_lm  # noqa: E402
from detached_rl.models.lora import LoraSettings, apply_lora, lora_config_dict, lora_state_dict  # noqa: E402
from detached_rl.weights.receiver import WeightReceiver  # noqa: E402
from detached_rl.weights.update import WeightUpdateError, build_weight_update  # noqa: E402

from .helpers import ObjectStore  # noqa: E402

LOG_PROB_TOLERANCE = 1e-3  # float32 engine vs the trainer's float32 recompute
KEPT = 2
SETTINGS = LoraSettings(r=8, alpha=16, target_modules=("q_proj", "v_proj", "gate_proj", "down_proj"))
PROMPTS = ["hello world", "the cat sat on", "one two three four", "abc"]
GREEDY = SamplingConfig(max_new_tokens=12, do_sample=False)
SAMPLED = SamplingConfig(max_new_tokens=12, temperature=0.9, top_k=40)


def lora_policy(settings: LoraSettings = SETTINGS):
    """A tiny llama (head size 32, which vLLM's CPU attention needs) with a LoRA adapter."""
    model, tokenizer = tiny_causal_lm("llama", seed=0, hidden_size=128, intermediate_size=256)
    torch.manual_seed(0)
    return apply_lora(model, settings), tokenizer


class Trainer:
    """The trainer's side: a LoRA model trained with AdamW on fixed token
    sequences, and the updates it sends."""

    def __init__(self, model) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
        self.batch = torch.randint(3, model.config.vocab_size, (4, 16),
                                   generator=torch.Generator().manual_seed(0))
        self.store = ObjectStore()

    def step(self, steps: int = 2) -> None:
        self.model.train()
        for _ in range(steps):
            loss = self.model(input_ids=self.batch, labels=self.batch).loss
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
        self.model.eval()

    def update(self, version: int, kind: str = "lora", state=None, **metadata):
        state = state if state is not None else (lora_state_dict(self.model) if kind == "lora"
                                                 else self.model.state_dict())
        metadata = {"trainer_run": "run-a", "lora": lora_config_dict(self.model)} | metadata
        return build_weight_update({"actor": state}, version, self.store.put, chunk_bytes=200_000, kind=kind,
                                   metadata={key: value for key, value in metadata.items()
                                             if value is not None})[0]


@pytest.fixture(scope="module")
def setup():
    model, tokenizer = lora_policy()
    backend = VLLMBackend.from_actor(Actor(copy.deepcopy(model), tokenizer), dtype="float32",
                                     max_model_len=256,
                                     lora_versions_kept=KEPT)
    trainer = Trainer(model)
    receiver = WeightReceiver({"actor": backend.weight_sink}, version=-1)  # -1: not synced, as a maker starts
    prompts = [torch.tensor(tokenizer(text)["input_ids"]) for text in PROMPTS]
    yield backend, trainer, receiver, prompts
    backend.close()


def greedy(backend, prompts) -> list[list[int]]:
    return [ids.tolist() for ids in backend.generate(prompts, GREEDY).response_ids]


def assert_serves(backend, model, prompts) -> list[list[int]]:
    """vLLM's greedy output equals the HF model's, and its sampled log-probs are the model's recompute."""
    served = greedy(backend, prompts)
    assert served == greedy(HFGenerationBackend(model, backend.pad_token_id, backend.eos_token_ids), prompts)
    torch.manual_seed(1)
    out = backend.generate(prompts, SAMPLED)
    for prompt, response, log_probs in zip(prompts, out.response_ids, out.log_probs, strict=True):
        sequence = torch.cat([prompt, response]).unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=sequence).logits[0, prompt.numel() - 1 : -1].float()
        recomputed = token_log_probs(process_logits(logits, SAMPLED), response)
        torch.testing.assert_close(log_probs, recomputed, atol=LOG_PROB_TOLERANCE, rtol=0)
    return served


def adapter_dirs(sink: VLLMLoraSink) -> list[str]:
    return sorted(os.listdir(sink.root))


def test_the_engine_serves_lora_with_adapters_sized_for_the_rank_and_the_versions_kept(setup):
    backend, trainer, receiver, prompts = setup
    sink = backend.lora_sink
    assert isinstance(sink, VLLMLoraSink) and backend.weight_sink is sink
    lora = backend.llm.llm_engine.vllm_config.lora_config
    assert (lora.max_lora_rank, lora.max_loras, lora.max_cpu_loras) == (8, KEPT, KEPT + 1)
    # version 0: the actor's own
    assert sink.adapter_ids == [1] and backend.llm.llm_engine.list_loras() == {1}
    assert set(sink.layout()) == set(trainer.model.state_dict())
    assert sink.root.startswith("/dev/shm/")
    assert_serves(backend, trainer.model, prompts)


def test_lora_updates_between_training_steps_serve_what_the_trainer_computes(setup):
    backend, trainer, receiver, prompts = setup
    sink = backend.lora_sink
    # The first update is full (version 0 again: adapter id 1 is replaced in place, after the new one loaded).
    trainer.step()
    assert receiver.receive(trainer.update(0, "full"), trainer.store.fetch).applied
    assert sink.adapter_ids == [1] and len(adapter_dirs(sink)) == 1
    outputs = [assert_serves(backend, trainer.model, prompts)]
    reloads = sink.reloads
    for version in range(1, 6):
        trainer.step()
        result = receiver.receive(trainer.update(version), trainer.store.fetch)
        assert result.applied and receiver.version == version
        outputs.append(assert_serves(backend, trainer.model, prompts))
        kept = list(range(max(0, version - KEPT + 1) + 1, version + 2))
        assert sink.adapter_ids == kept and backend.llm.llm_engine.list_loras() == set(kept)
        assert len(adapter_dirs(sink)) == len(kept)
        assert sink.serving_request.lora_int_id == version + 1
    assert sink.reloads == reloads  # LoRA-only updates leave the engine's base weights alone
    assert len({str(output) for output in outputs}) > 3  # training changed what is generated
    assert receiver.fingerprint == receiver.refresh_fingerprint()

    # A full update with a changed base (a trainer that resumed from another checkpoint) reloads it too.
    with torch.no_grad():
        for name, tensor in trainer.model.named_parameters():
            if "base_layer" in name or "embed_tokens" in name:
                tensor.add_(0.05 * torch.randn_like(tensor))
    assert receiver.receive(trainer.update(6, "full"), trainer.store.fetch).applied
    assert sink.reloads == reloads + 1 and sink.adapter_ids == [6, 7]
    assert assert_serves(backend, trainer.model, prompts) != outputs[-1]


def corrupt(trainer, version: int, what: str):
    """A LoRA update for `version` that the receiver must refuse, and the error it must give."""
    if what == "checksum":
        update = trainer.update(version)
        specs = list(update.manifest.tensors)
        specs[3] = dataclasses.replace(specs[3], checksum=specs[3].checksum ^ 1)
        return dataclasses.replace(update,
                                   manifest=dataclasses.replace(update.manifest, tensors=tuple(specs))), \
            "checksum mismatch"
    if what == "shape":
        update = trainer.update(version)
        specs = list(update.manifest.tensors)
        specs[0] = dataclasses.replace(specs[0], shape=(specs[0].shape[0] + 1, *specs[0].shape[1:]))
        return dataclasses.replace(update,
                                   manifest=dataclasses.replace(update.manifest, tensors=tuple(specs))), \
            "shape mismatch"
    if what == "rank":  # the adapter of a rank-16 trainer
        wider = lora_policy(dataclasses.replace(SETTINGS, r=16, alpha=32))[0]
        return trainer.update(version, state=lora_state_dict(wider),
                              lora=lora_config_dict(wider)), "shape mismatch"
    if what == "rank_in_config":
        return trainer.update(version, lora={**lora_config_dict(trainer.model), "r": 16}), "LoRA r is 16"
    if what == "alpha":
        return trainer.update(version,
                              lora={**lora_config_dict(trainer.model), "alpha": 8}), "LoRA alpha is 8"
    assert what == "no_config"
    return trainer.update(version, lora=None), r"metadata\['lora'\]"


@pytest.mark.parametrize("what", ["checksum", "shape", "rank", "rank_in_config", "alpha", "no_config"])
def test_a_refused_update_leaves_the_previous_version_serving(setup, what):
    backend, trainer, receiver, prompts = setup
    sink = backend.lora_sink
    version, ids, before = receiver.version, sink.adapter_ids, greedy(backend, prompts)
    fingerprint = receiver.fingerprint
    trainer.step()  # the update would change the outputs
    update, message = corrupt(trainer, version + 1, what)
    with pytest.raises(WeightUpdateError, match=message):
        receiver.receive(update, trainer.store.fetch)
    assert receiver.version == version and receiver.consistent and sink.adapter_ids == ids
    assert greedy(backend, prompts) == before and receiver.refresh_fingerprint() == fingerprint
    # ... and the next good update still applies.
    assert receiver.receive(trainer.update(version + 1), trainer.store.fetch).applied
    after = greedy(backend, prompts)
    assert after != before and after == greedy(HFGenerationBackend(trainer.model, backend.pad_token_id,
                                                                   backend.eos_token_ids), prompts)


def test_an_adapter_that_cannot_be_registered_leaves_the_engine_on_the_previous_version(setup):
    backend, trainer, receiver, prompts = setup
    sink = backend.lora_sink
    version, ids, before = receiver.version, sink.adapter_ids, greedy(backend, prompts)
    served = {key: tensor.clone() for key, tensor in sink.state().items() if "lora_" in key}
    kept = adapter_dirs(sink)
    root, blocker = sink.root, sink.root + "-blocker"
    open(blocker, "w").close()
    sink.root = os.path.join(blocker, "adapters")  # under a file: the next adapter's directory cannot be made
    try:
        trainer.step()
        with pytest.raises(WeightUpdateError, match="swap failed"):
            receiver.receive(trainer.update(version + 1), trainer.store.fetch)
    finally:
        sink.root = root
        os.remove(blocker)
    assert sink.adapter_ids == ids and adapter_dirs(sink) == kept and greedy(backend, prompts) == before
    state = sink.state()
    # the mirror holds what is served
    assert all(torch.equal(state[key], tensor) for key, tensor in served.items())
    # The sink put everything back (SinkUnchanged): the receiver still serves the previous version, and the
    # next LoRA update applies.
    assert receiver.consistent and receiver.servable_version == version
    assert receiver.receive(trainer.update(version + 1), trainer.store.fetch).applied and receiver.consistent
    assert_serves(backend, trainer.model, prompts)


def test_keep_mode_refuses_an_adapter_vllm_cannot_serve_before_starting_an_engine():
    model, tokenizer = lora_policy(LoraSettings(backend="loralib", r=8, alpha=16, target_modules=("q_proj",),
                                                merged_enable=(True,)))
    with pytest.raises(ValueError, match="loralib MergedLinear .*use lora_mode: merge"):
        VLLMBackend.from_actor(Actor(model, tokenizer), dtype="float32")
    with pytest.raises(ValueError, match="lora_versions_kept must be an int >= 1"):
        VLLMBackend.from_actor(Actor(model, tokenizer), lora_versions_kept=0)


def test_merge_mode_still_serves_lora_policies(setup):
    model, tokenizer = lora_policy()
    # One engine per process (vLLM's distributed state is process-wide): refused while keep mode's runs.
    with pytest.raises(RuntimeError, match="already runs in this process"):
        VLLMBackend.from_actor(Actor(copy.deepcopy(model), tokenizer), lora_mode="merge", dtype="float32")
    setup[0].close()  # runs last in this module; the fixture's own close is then a no-op
    backend = VLLMBackend.from_actor(Actor(copy.deepcopy(model), tokenizer), lora_mode="merge",
                                     dtype="float32",
                                     max_model_len=256)
    try:
        assert backend.lora_sink is None
        trainer = Trainer(model)
        receiver = WeightReceiver({"actor": backend.weight_sink}, version=0)
        prompts = [torch.tensor(tokenizer(text)["input_ids"]) for text in PROMPTS]
        trainer.step()
        assert receiver.receive(trainer.update(1), trainer.store.fetch).applied
        assert_serves(backend, trainer.model, prompts)
        with pytest.raises(WeightUpdateError, match="LoRA alpha is 8"):
            receiver.receive(trainer.update(2, lora={**lora_config_dict(model), "alpha": 8}),
                             trainer.store.fetch)
    finally:
        backend.close()
