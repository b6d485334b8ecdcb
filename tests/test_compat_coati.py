"""coati/ray users' own code on `detached_rl.compat.coati`: the seed's DetachedPPOTrainer example as written,
coati's mmmt_prompt.py flow (2 makers x 2 DDP trainers, LoRA-only updates, saves), and the
argument translation without Ray."""

from __future__ import annotations

import os
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModel, AutoModelForCausalLM

from detached_rl.algorithms.ppo import PPOLearner
from detached_rl.compat import coati
from detached_rl.compat.coati.rounds import CoatiSession, training_batch
from detached_rl.models import Actor, Critic, LoraSettings, apply_lora, tiny_causal_lm
from detached_rl.models.lora import lora_backend
from detached_rl.models.scalar_heads import backbone_of
from detached_rl.strategies import DDPStrategy, NaiveStrategy
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore
from tests import conftest
from tests.helpers import LowTokenReward, make_experience

PROMPTS = [f"{a}+{b}=" for a in range(4) for b in range(4)]
LORA = LoraSettings(r=4, alpha=8)


# ------------------------------------------------------------ models the factories return (picklable by name)
def policy(lora: bool = False) -> Actor:
    """A tiny llama policy (seed 0), with LoRA when asked."""
    model, tokenizer = tiny_causal_lm("llama", seed=0)
    if lora:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = apply_lora(model, LORA)
    return Actor(model, tokenizer)


def value_model(lora: bool = False) -> Critic:
    """A tiny llama critic (seed 1), its backbone with LoRA when asked."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        critic = Critic(backbone_of(tiny_causal_lm("llama", seed=1)[0]))
        if lora:
            critic.backbone = apply_lora(critic.backbone, LORA)
    return critic


def maker_models(lora: bool = False) -> tuple:
    """coati's maker model_fn: (actor, critic, reward model, initial model)."""
    return policy(lora), value_model(lora), LowTokenReward(), policy(False)


def trainer_models(lora: bool = False) -> tuple:
    """coati's trainer model_fn: (actor, critic)."""
    return policy(lora), value_model(lora)


def string_batches() -> DataLoader:
    """Plain-string prompts, 4 a batch."""
    return DataLoader(PROMPTS, batch_size=4, shuffle=True)


def full_bytes() -> int:
    """Bytes of a full update of policy and critic (float32)."""
    return sum(p.numel() * 4 for model in trainer_models() for p in model.state_dict().values())


# ---------------------------------------------------------------- translation, no Ray
def test_trainer_settings_translate_coati_arguments() -> None:
    config, ppo = coati.trainer_settings(train_batch_size=4, buffer_limit=16, eps_clip=0.1, value_clip=0.3,
                                         update_lora_weights=True)
    assert (config.train_batch_size, config.buffer_max_samples, config.weight_sync) == (4, 64, "lora")
    assert (ppo.clip_low, ppo.clip_high, ppo.value_clip) == (0.1, None, 0.3)
    unlimited, _ = coati.trainer_settings(buffer_limit=0)
    assert unlimited.buffer_max_samples == TrainerConfig().buffer_max_samples
    with pytest.raises(ValueError, match="buffer_limit"):
        coati.trainer_settings(buffer_limit=-1)


def test_generate_kwargs_of_mmmt_prompt_become_sampling() -> None:
    sampling, max_length = coati.sampling_from_generate_kwargs(dict(
        max_length=512, do_sample=True, temperature=1.0, top_k=50, pad_token_id=0, eos_token_id=2,
        use_cache=True))
    assert (sampling.top_k, sampling.temperature, sampling.do_sample,
            sampling.stop_token_ids) == (50, 1.0, True, (2,))
    assert max_length == 512
    with pytest.raises(ValueError, match="repetition_penalty"):
        coati.sampling_from_generate_kwargs({"repetition_penalty": 1.2})
    with pytest.raises(ValueError, match="num_beams"):
        coati.sampling_from_generate_kwargs({"num_beams": 4})


def test_batches_become_prompts() -> None:
    left = {"input_ids": torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]]),
            "attention_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])}
    assert coati.batch_prompts(left, pad_token_id=None) == ([[5, 6], [7, 8, 9, 10]], 4)
    right = torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]])
    assert coati.batch_prompts(right, pad_token_id=0) == ([[5, 6], [7]], 4)
    assert coati.batch_prompts(torch.tensor([3, 4]), pad_token_id=0) == ([[3, 4]], 2)
    assert coati.batch_prompts(["a", "b"], pad_token_id=0) == (["a", "b"], None)
    assert coati.batch_prompts("a", pad_token_id=0) == (["a"], None)
    with pytest.raises(ValueError, match="input_ids"):
        coati.batch_prompts({"ids": torch.tensor([1])}, pad_token_id=0)
    with pytest.raises(ValueError, match="row 1"):
        coati.batch_prompts(torch.tensor([[5, 6], [0, 0]]), pad_token_id=0)
    with pytest.raises(ValueError, match="pad_token_id"):
        coati.batch_prompts(right, pad_token_id=None)


def test_workingloop_iterates_like_coati() -> None:
    batches, count = coati.dataloader_batches(lambda: [1, 2, 3], num_steps=5)
    assert count == 5
    assert [next(batches) for _ in range(5)] == [1, 2, 3, 1, 2]
    batches, count = coati.dataloader_batches(lambda: [1, 2], num_epochs=2)
    assert (list(batches), count) == ([1, 2, 1, 2], 4)
    with pytest.raises(ValueError, match="len"):
        coati.dataloader_batches(lambda: iter([1]), num_epochs=1)


def test_receivers_and_env_follow_coati(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [coati.get_receivers_per_sender(i, 2, 2, False) for i in range(2)] == [[0], [1]]
    assert [coati.get_receivers_per_sender(i, 1, 3, False) for i in range(1)] == [[0, 1, 2]]
    assert [coati.get_receivers_per_sender(i, 3, 1, False) for i in range(3)] == [[0], [0], [0]]
    for variable in coati.COATI_ENV.values():
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(ValueError, match="RANK"):
        coati.get_strategy_from_args("ddp")
    coati.set_dist_env({"rank": "1", "local_rank": "0", "world_size": "2", "master_port": "29511",
                        "master_addr": "127.0.0.1"})
    strategy = coati.get_strategy_from_args("ddp")
    assert isinstance(strategy, DDPStrategy) and (strategy.rank, strategy.world_size) == (1, 2)
    for variable in coati.COATI_ENV.values():
        monkeypatch.delenv(variable)
    with pytest.raises(ValueError, match="env_info lacks"):
        coati.set_dist_env({"rank": "0"})
    with pytest.raises(TypeError, match="strategy_fn must return"):
        coati.build_strategy(lambda: "naive")
    with pytest.raises(TypeError, match="strategy_fn must be"):
        coati.build_strategy(NaiveStrategy())


def test_maker_models_translate_the_four_tuple() -> None:
    models = coati.maker_models(lambda: (policy(), value_model(), lambda prompt, response: 1.0, policy()),
                                0.0)
    assert models.reference is None and hasattr(models.reward, "score_detailed")
    assert coati.maker_models(partial(maker_models, False), 0.1).reference is not None
    with pytest.raises(ValueError, match="LoRA adapter"):
        coati.maker_models(partial(maker_models, False), 0.1, lora=True)
    with pytest.raises(ValueError, match="model_fn must return"):
        coati.maker_models(lambda: (policy(), value_model()), 0.1)


def test_saves_load_with_from_pretrained_and_torch_load(tmp_path) -> None:
    actor = policy(lora=True)
    coati.save_model(actor.model, actor.tokenizer, tmp_path / "actor")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "actor")
    assert lora_backend(loaded) is None
    coati.save_model(actor.model, actor.tokenizer, tmp_path / "actor.pt")
    state = torch.load(tmp_path / "actor.pt")
    assert set(state) == set(loaded.state_dict())
    critic = value_model(lora=True)
    coati.save_critic(critic, tmp_path / "critic")
    assert isinstance(AutoModel.from_pretrained(tmp_path / "critic"), torch.nn.Module)
    assert set(torch.load(tmp_path / "critic" / coati.VALUE_HEAD_FILE)) == {"weight", "bias"}


class Recorder:
    """A coati callback writing down its hooks."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, hook: str):
        if not hook.startswith("on_"):
            raise AttributeError(hook)
        return lambda *args: self.calls.append((hook, *[a for a in args if isinstance(a, int)]))


def test_an_actors_request_is_read_from_its_ray_options() -> None:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from detached_rl.compat.placement import PlacementCheckedActorClass, actor_request

    assert actor_request({"num_gpus": 1, "max_concurrency": 2}) == {"GPU": 1.0}
    assert actor_request({"num_cpus": 2, "resources": {"node:a": 0.5}, "memory": 1e9}) == {
        "CPU": 2.0, "node:a": 0.5, "memory": 1e9}
    in_group = PlacementGroupSchedulingStrategy(None)
    assert actor_request({"num_gpus": 1, "scheduling_strategy": in_group}) is None
    checked = PlacementCheckedActorClass(object(), "coati trainer").options(name="t", num_gpus=1)
    checked = checked.options(num_cpus=2)
    assert checked.given == {"name": "t", "num_gpus": 1, "num_cpus": 2} and checked.role == "coati trainer"


def test_coati_fit_rounds_rerun_batches_and_push_at_round_ends() -> None:
    """coati's fit(total_steps=4, update_steps=2, train_epochs=2): 2 rounds x (2 fresh + 2 re-run batches)."""
    actor, critic = trainer_models()
    recorder = Recorder()
    session = CoatiSession(coati.Callbacks([recorder]))
    core = session.install(TrainerCore("t", PPOLearner(actor, critic, NaiveStrategy(device="cpu")),
                                       TrainerConfig(train_batch_size=2)))
    samples = [make_experience(reward=float(i), values=torch.zeros(2)) for i in range(8)]
    core.push_experience(samples)
    trained: list[list[float]] = []
    pushed: list[int] = []
    original = core.learner.train_step

    def train_step(experiences, policy_version=None):
        trained.append(sorted(float(e.reward) for e in experiences))
        return original(experiences, policy_version)

    core.learner.train_step = train_step
    session.rounds = coati.CoatiRounds(update_steps=2, train_epochs=2)
    core.fit(8, put=lambda chunk: chunk,
             send_update=lambda update, makers: pushed.append(update.manifest.version)
             or {}, update_steps=1, push_when=session.push_when)
    first, second = trained[:4], trained[4:]
    assert sorted(first[2:]) == sorted(first[:2]) and sorted(second[2:]) == sorted(second[:2])
    assert not set(map(tuple, first)) & set(map(tuple, second))  # each round its own fresh batches
    assert len(core.buffer) == 0 and core.policy_version == 8
    assert [m.get("weight_sync/version") for m in core.history if "weight_sync/version" in m] == [4.0, 8.0]
    assert all({"actor_loss", "critic_loss"} <= set(m) for m in core.history)
    hooks = [call for call in recorder.calls if call[0] not in ("on_batch_start", "on_batch_end")]
    assert hooks[:4] == [("on_episode_start", 0), ("on_epoch_start", 0), ("on_epoch_end", 0),
                         ("on_epoch_start", 1)]
    assert ("on_update_start",) in hooks and hooks[-1] == ("on_episode_end", 1)
    assert sum(call[0] == "on_batch_end" for call in recorder.calls) == 8


def coati_experience() -> SimpleNamespace:
    """coati's own `Experience` (coati is not installed: its fields): one batch of padded sequences."""
    return SimpleNamespace(sequences=torch.ones(2, 5, dtype=torch.long), action_log_probs=torch.zeros(2, 3),
                           values=torch.zeros(2), reward=torch.zeros(2), advantages=torch.zeros(2),
                           attention_mask=torch.ones(2, 5), action_mask=torch.ones(2, 3, dtype=torch.bool))


def test_training_step_takes_experience_and_refuses_anything_else_naming_element_and_field() -> None:
    actor, critic = trainer_models()
    core = CoatiSession().install(TrainerCore("t", PPOLearner(actor, critic, NaiveStrategy(device="cpu")),
                                              TrainerConfig(train_batch_size=2)))
    good = [make_experience(values=torch.zeros(2)), make_experience(values=torch.zeros(2))]
    assert training_batch(good, core) == good and training_batch(tuple(good), core) == good
    assert training_batch(good[0], core) == [good[0]]
    refusal = (r"^training_step: experience\[0\] is coati's batched Experience \(SimpleNamespace with "
               r"sequences, action_log_probs, attention_mask, action_mask\), which this trainer does not")
    with pytest.raises(TypeError, match=refusal):
        training_batch([coati_experience()], core)
    with pytest.raises(ValueError, match="^training_step: experience is empty"):
        training_batch([], core)
    with pytest.raises(ValueError, match=r"^training_step: experience at index 1 of 2 .*: expected an "
                                         r"Experience \(exactly that class\), got SimpleNamespace$"):
        training_batch([good[0], SimpleNamespace(prompt_ids=torch.ones(2))], core)
    with pytest.raises(ValueError, match=r"^training_step: .*Experience\.reward: has non-finite values"):
        training_batch([make_experience(reward=float("nan"), values=torch.zeros(2))], core)
    assert core.policy_version == 0 and len(core.buffer) == 0


# ---------------------------------------------------------------- on Ray
@pytest.fixture(scope="module")
def gpu_cluster(cluster_marker):
    """This module's cluster, declaring 4 logical GPUs: coati's examples ask num_gpus=1 per actor (a CPU build
    of torch keeps the models on the CPU)."""
    import ray

    from detached_rl.cli.jobs import init_local_ray

    previous = os.environ.get(conftest.CLUSTER_MARKER)
    os.environ[conftest.CLUSTER_MARKER] = cluster_marker
    try:
        init_local_ray("coati_tests", num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False,
                       runtime_env={"env_vars": {"PYTHONPATH": str(conftest.ROOT), "OMP_NUM_THREADS": "1"}})
    finally:
        if previous is None:
            os.environ.pop(conftest.CLUSTER_MARKER, None)
        else:
            os.environ[conftest.CLUSTER_MARKER] = previous
    yield ray
    ray.shutdown()


def my_strategy():
    """The seed's `my_strategy()`: here a naive strategy on the actor's device."""
    return coati.get_strategy_from_args("naive")


my_actor, my_critic = policy, value_model


@pytest.fixture(scope="module")
def unit_trainer(gpu_cluster):
    """A trainer without makers for the buffer methods; the seed test asks for it so that it starts beside its
    actors."""
    return coati.DetachedPPOTrainer.options(name="trainer_unit").remote(
        experience_maker_holder_name_list=[], strategy_fn=my_strategy, model_fn=trainer_models,
        train_batch_size=2)


def test_seed_004_example_as_written(gpu_cluster, unit_trainer, tmp_path) -> None:
    ray = gpu_cluster
    from detached_rl.compat.coati import ExperienceMakerHolder

    makers = [ExperienceMakerHolder.options(name=f"maker_{i}", num_gpus=1).remote(
        detached_trainer_name_list=["trainer_0"], strategy_fn=my_strategy, model_fn=maker_models,
        max_new_tokens=6, do_sample=True, top_k=50) for i in range(2)]

    # ---- seed 004, as written (fit's step counts shrunk from 1000/100/2 for a test) ----
    from detached_rl.compat.coati import DetachedPPOTrainer
    trainer = DetachedPPOTrainer.options(
        name="trainer_0", num_gpus=1
    ).remote(
        experience_maker_holder_name_list=["maker_0", "maker_1"],
        strategy_fn=lambda: my_strategy(),
        model_fn=lambda: (my_actor(), my_critic()),
        train_batch_size=8,
        eps_clip=0.2,
        value_clip=0.4,
        eval_performance=True,
    )
    # Sync initial model weights to experience makers
    ray.get(trainer.sync_models_to_remote_makers.remote())
    loops = [maker.workingloop.remote(string_batches, num_steps=100) for maker in makers]
    # Start training
    ray.get(trainer.fit.remote(total_steps=2, update_steps=1, train_epochs=2))
    # Save models
    ray.get(trainer.strategy_save_actor.remote(str(tmp_path / "actor_checkpoint"), only_rank0=True))
    # ---- end of the example ----

    statuses = ray.get(loops, timeout=120)  # the trainer stopped its makers at the end of fit
    history = ray.get(trainer.metrics.remote())
    assert len(history) == 4 and all({"actor_loss", "critic_loss"} <= set(m) for m in history)
    assert [m["weight_sync/version"] for m in history if "weight_sync/version" in m] == [2.0, 4.0]
    assert {s["policy_version"] for s in statuses} == {4} and all(s["batches"] >= 1 for s in statuses)
    assert ray.get(trainer.buffer_get_length.remote()) >= 0
    AutoModelForCausalLM.from_pretrained(tmp_path / "actor_checkpoint")
    for handle in [trainer, *makers]:
        ray.kill(handle)


def test_a_request_the_cluster_can_never_place_is_refused_at_once(gpu_cluster) -> None:
    """coati's usage example asks num_gpus=1 per actor: on a cluster without that many GPUs Ray would leave
    the actor pending and `sync_models_to_remote_makers` would never return; `.remote()` refuses at once."""
    from detached_rl.compat.coati import DetachedPPOTrainer, ExperienceMakerHolder
    from detached_rl.core.resources import UnplaceableError

    with pytest.raises(UnplaceableError, match=r"^coati trainer too_big asks for 5 GPU; the cluster has 4$"):
        DetachedPPOTrainer.options(name="too_big", num_gpus=5).remote(
            experience_maker_holder_name_list=[], strategy_fn=my_strategy, model_fn=trainer_models)
    with pytest.raises(UnplaceableError, match=r"^coati maker too_big asks for 9 CPU; the cluster has 8$"):
        ExperienceMakerHolder.options(num_gpus=1).options(name="too_big", num_cpus=9).remote(
            detached_trainer_name_list=["trainer_0"], strategy_fn=my_strategy, model_fn=maker_models)
    with pytest.raises(UnplaceableError, match="asks for 1 bogus; the cluster has 0"):
        DetachedPPOTrainer.options(resources={"bogus": 1}).remote([], my_strategy, trainer_models)
    named = {actor["name"] for actor in gpu_cluster.util.list_named_actors(all_namespaces=True)}
    assert "too_big" not in named


def test_buffer_methods_and_training_step(gpu_cluster, unit_trainer) -> None:
    ray, trainer = gpu_cluster, unit_trainer
    sample = partial(make_experience, values=torch.zeros(2))
    ray.get(trainer.buffer_append.remote(sample()))
    ray.get(trainer.buffer_extend.remote([sample(), sample(), sample()]))
    assert ray.get(trainer.buffer_get_length.remote()) == 2  # batches of train_batch_size, as coati counted
    losses = ray.get(trainer.training_step.remote([sample(), sample()]))
    assert set(losses) == {"actor_loss", "critic_loss"}
    with pytest.raises(TypeError, match="experience\\[0\\] is coati's batched Experience"):
        ray.get(trainer.training_step.remote([coati_experience()]))
    assert all(torch.isfinite(torch.tensor(list(losses.values()))))
    ray.kill(trainer)


def test_mmmt_prompt_flow(gpu_cluster, tmp_path) -> None:
    """coati's examples/ray/mmmt_prompt.py, translated only where its model and strategy helpers were: 2
    makers, 2 DDP trainers, LoRA on actor and critic with LoRA-only updates, saves."""
    ray = gpu_cluster
    from detached_rl.compat.coati import DetachedPPOTrainer, ExperienceMakerHolder, get_receivers_per_sender
    from detached_rl.strategies.ddp import find_free_port

    num_makers = num_trainers = 2
    experience_batch_size, experience_steps, update_steps, train_epochs, train_batch_size = 2, 2, 1, 1, 2
    master_addr = "127.0.0.1"
    trainer_port = str(find_free_port())
    env_info_trainers = [{"local_rank": "0", "rank": str(rank), "world_size": str(num_trainers),
                          "master_port": trainer_port, "master_addr": master_addr}
                         for rank in range(num_trainers)]
    maker_port = str(find_free_port())
    env_info_makers = [{"local_rank": "0", "rank": str(rank), "world_size": str(num_makers),
                        "master_port": maker_port, "master_addr": master_addr} for rank in range(num_makers)]
    tokenizer = policy().tokenizer

    experience_holder_refs = [
        ExperienceMakerHolder.options(name=f"maker{i}", num_gpus=1, max_concurrency=2).remote(
            detached_trainer_name_list=[
                f"trainer{x}"
                for x in get_receivers_per_sender(i, num_makers, num_trainers, allow_idle_sender=False)],
            strategy_fn=partial(coati.get_strategy_from_args, "naive"),
            model_fn=partial(maker_models, True),
            env_info=env_info_maker,
            kl_coef=0.1,
            debug=False,
            update_lora_weights=True,
            max_length=24, do_sample=True, temperature=1.0, top_k=50,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            eval_performance=True, use_cache=True,
        )
        for i, env_info_maker in enumerate(env_info_makers)
    ]
    trainer_refs = [
        DetachedPPOTrainer.options(name=f"trainer{i}", num_gpus=1, max_concurrency=2).remote(
            experience_maker_holder_name_list=[
                f"maker{x}"
                for x in get_receivers_per_sender(i, num_trainers, num_makers, allow_idle_sender=True)],
            strategy_fn=partial(coati.get_strategy_from_args, "ddp"),
            model_fn=partial(trainer_models, True),
            env_info=env_info_trainer,
            train_batch_size=train_batch_size,
            buffer_limit=16,
            eval_performance=True,
            debug=False,
            update_lora_weights=True,
        )
        for i, env_info_trainer in enumerate(env_info_trainers)
    ]
    dataset_size = experience_batch_size * 4

    def build_dataloader():
        def tokenize_fn(texts):
            return dict(tokenizer(texts, return_tensors="pt", max_length=12, padding="max_length",
                                  truncation=True))
        return DataLoader(dataset=PROMPTS, batch_size=dataset_size, shuffle=True, collate_fn=tokenize_fn)

    wait_tasks = [ref.workingloop.remote(build_dataloader, num_steps=experience_steps)
                  for ref in experience_holder_refs]
    total_steps = experience_batch_size * experience_steps * num_makers // (num_trainers * train_batch_size)
    for trainer_ref in trainer_refs:
        wait_tasks.append(trainer_ref.fit.remote(total_steps, update_steps, train_epochs))
    ray.get(wait_tasks, timeout=240)

    # the saves of coati's train_prompts_on_ray; rank 1 with only_rank0 writes nothing
    for rank, trainer in enumerate(trainer_refs):
        ray.get([trainer.strategy_save_actor.remote(str(tmp_path / f"actor{rank}"), only_rank0=True),
                 trainer.strategy_save_actor.remote(str(tmp_path / f"actor{rank}.pt")),
                 trainer.strategy_save_critic.remote(str(tmp_path / f"critic{rank}.pt")),
                 trainer.strategy_save_actor_optim.remote(str(tmp_path / f"actor_optim{rank}.pt")),
                 trainer.strategy_save_critic_optim.remote(str(tmp_path / f"critic_optim{rank}.pt"))])
    assert not (tmp_path / "actor1").exists()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "actor0")
    model.load_state_dict(torch.load(tmp_path / "actor1.pt"))
    assert set(torch.load(tmp_path / "critic0.pt")) == set(value_model(lora=True).state_dict())
    assert torch.load(tmp_path / "actor_optim0.pt")["state"]
    assert torch.load(tmp_path / "critic_optim1.pt")["state"]

    histories = [ray.get(trainer.metrics.remote()) for trainer in trainer_refs]
    assert all(len(history) == total_steps for history in histories)
    assert all({"actor_loss", "critic_loss"} <= set(m) for history in histories for m in history)
    pushes = [m for history in histories for m in history if "weight_sync/bytes" in m]
    # LoRA-only, actor and critic
    assert pushes and max(m["weight_sync/bytes"] for m in pushes) < full_bytes() / 4
    versions = {ray.get(maker.status.remote())["policy_version"] for maker in experience_holder_refs}
    assert versions == {total_steps}
    for handle in [*trainer_refs, *experience_holder_refs]:
        ray.kill(handle)


def test_dataloader_batches_carry_the_sampling_their_width_leaves() -> None:
    from detached_rl.core.prompts import PromptBatch
    from detached_rl.core.sampling import SamplingConfig

    short = SamplingConfig(max_new_tokens=3)
    seen: list = []

    def fit(prompts: list, width: int | None) -> SamplingConfig | None:
        seen.append((prompts, width))
        return short if width else None

    prompts = coati.DataloaderPrompts(iter([torch.tensor([[0, 5, 6]]), ["a"]]), 0, fit)
    batch = prompts.next_batch(8)
    assert isinstance(batch, PromptBatch) and batch.sampling == short and batch[0].prompt == [5, 6]
    assert prompts.next_batch(8).sampling is None and seen[-1] == (["a"], None)
    with pytest.raises(RuntimeError, match="ran out"):
        prompts.next_batch(8)
