"""open-instruct's learner and driver step over this project's GRPO trainer: the aggregation, the Polyak
update and the config translation without Ray; then open-instruct's driver loop on a local Ray cluster (two
learner ranks, one maker): `step`, `update_ref_policy`, `broadcast_to_vllm`, `save_checkpoint_state`,
`save_model`, a restart that resumes from the saved state and steps again."""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import pickle
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import ray
import torch

from detached_rl.actors.transport import resolve_namespace
from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner
from detached_rl.compat.open_instruct import (
    CHECKPOINT_COMPLETE_MARKER,
    PEAK_FLOPS,
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    SEQUENCE_TOKENS,
    ExperimentConfig,
    ModelConfig,
    ModelGroup,
    ObservedGRPOLearner,
    PolicyTrainerProcess,
    PolicyTrainerRayProcess,
    SequenceRatioStats,
    StepsDone,
    StreamingDataLoaderConfig,
    VLLMConfig,
    average_rank_metrics,
    batch_lengths,
    bundle_index,
    compute_token_weights,
    grpo_config_from,
    load_policy,
    maker_config_from,
    one_training_step,
    open_instruct_step_metrics,
    polyak_update_ref_policy,
    trainer_config_from,
    training_step_metrics,
)
from detached_rl.compat.open_instruct.namespaces import (
    is_anonymous,
    learner_namespace,
    maker_advice,
    no_batch_advice,
)
from detached_rl.core.sampling import SamplingConfig
from detached_rl.maker.experience_maker import MakerModels
from detached_rl.models import tiny_causal_lm

from .helpers import LowTokenReward, arithmetic_prompts, make_experience, naive_strategy, tiny_policy

NAMESPACE = "detached_rl_tests"
TIMEOUT = 180
SAMPLING = SamplingConfig(max_new_tokens=6)


# ---------------------------------------------------------------------------------------------- without Ray
def rank(tokens: float, **values: float) -> dict[str, float]:
    return {"_token_count": tokens, **values}


def test_token_weighted_metrics_average_by_each_ranks_tokens_and_the_rest_plainly():
    ranks = [rank(10, **{"loss/policy_avg": 1.0, "val/ratio_var": 0.2, "time/other": 2.0}),
             rank(30, **{"loss/policy_avg": 3.0, "val/ratio_var": 0.6, "time/other": 4.0})]
    assert compute_token_weights(ranks) == [0.25, 0.75]
    averaged = average_rank_metrics(ranks)
    assert averaged == pytest.approx({"loss/policy_avg": 2.5, "val/ratio_var": 0.5, "time/other": 3.0})
    assert "_token_count" not in averaged
    # A key one rank lacks (its staleness histogram) is averaged over the ranks that have it.
    ranks[1]["staleness/hist_1"], ranks[0]["loss/kl_avg"] = 8.0, 0.4
    averaged = average_rank_metrics(ranks)
    assert averaged["staleness/hist_1"] == 8.0 and averaged["loss/kl_avg"] == pytest.approx(0.4)
    assert compute_token_weights([rank(0), rank(0)]) == [0.5, 0.5]


def test_driver_metrics_count_tokens_and_compute_mfu_against_the_summed_peaks():
    ranks = [rank(9,
                  **{"loss/policy_avg": 1.0, SEQUENCE_TOKENS: 20.0, PEAK_FLOPS: 1e9, "_num_params": 1000.0}),
             rank(3,
                  **{"loss/policy_avg": 2.0, SEQUENCE_TOKENS: 12.0, PEAK_FLOPS: 3e9, "_num_params": 1000.0})]
    arrays = [{PROMPT_LENGTHS: [3, 4], RESPONSE_LENGTHS: [5, 4]},
              {PROMPT_LENGTHS: [2], RESPONSE_LENGTHS: [1, 2]}]
    metrics, tokens = training_step_metrics(
        ranks, arrays, episode=8, training_step=2, num_total_tokens=100, step_time=4.0,
        total_training_time=50.0,
        training_time=2.0, samples_per_prompt=2, train_dataset_size=4,
        data_thread_metrics={"time/health_check": 0.1})
    assert tokens == 3 + 4 + 5 + 4 + 2 + 1 + 2 == metrics["val/num_step_tokens"]
    assert metrics["learner_tokens_per_second_step"] == pytest.approx(tokens / 4.0)
    assert metrics["learner_tokens_per_second_overall"] == pytest.approx(100 / 50.0)
    assert metrics["learner_mfu"] == pytest.approx(100 * 6 * 1000 * 32 / 2.0 / 4e9)
    assert metrics["loss/policy_avg"] == pytest.approx(0.75 * 1.0 + 0.25 * 2.0)
    assert metrics["epoch"] == 8 / 2 / 4
    assert metrics["time/health_check"] == 0.1 and metrics["time/training"] == 2.0
    assert metrics[PROMPT_LENGTHS] == [3, 4]  # the first rank's arrays, as open-instruct's
    assert not any(key.startswith("_") for key in metrics)


def test_sequence_ratio_variance_is_token_weighted_over_sequences():
    stats = SequenceRatioStats()
    # Sequence 0: one token of ratio 1; sequence 1: three tokens of ratio 2 (one padding position).
    log_probs = torch.tensor([[0.0, 5.0, 5.0, 5.0], [math.log(2.0)] * 3 + [7.0]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    stats.add(log_probs, torch.zeros_like(log_probs), mask)
    mean = (1 * 1.0 + 3 * 2.0) / 4
    assert stats.variance() == pytest.approx((1 * (1.0 - mean) ** 2 + 3 * (2.0 - mean) ** 2) / 4)
    stats.reset()
    assert stats.variance() == 0.0


def test_polyak_update_moves_the_reference_towards_the_policy_by_alpha():
    learner = GRPOLearner(tiny_policy(), naive_strategy(), GRPOConfig(kl_coef=0.1, sampling=SAMPLING))
    with torch.no_grad():
        for param in learner.policy.model.parameters():
            param.add_(torch.randn_like(param))
    before = {name: p.detach().clone() for name, p in learner.reference.model.named_parameters()}
    policy = {name: p.detach().clone() for name, p in learner.policy.model.named_parameters()}
    assert not polyak_update_ref_policy(learner, 0.0)  # open-instruct skips alpha 0
    assert all(torch.equal(p, before[n]) for n, p in learner.reference.model.named_parameters())
    assert polyak_update_ref_policy(learner, 0.25)
    for name, param in learner.reference.model.named_parameters():
        torch.testing.assert_close(param, 0.25 * policy[name] + 0.75 * before[name], msg=name)
    no_reference = GRPOLearner(tiny_policy(), naive_strategy(), GRPOConfig(sampling=SAMPLING))
    assert not polyak_update_ref_policy(no_reference, 0.5)


def grpo_batch(seed: int = 0) -> list:
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for group in range(2):
        for member in range(4):
            length = 2 + member
            batch.append(make_experience(
                prompt=[5, 6, 7][: 2 + group],
                response=torch.randint(3, 60, (length,), generator=generator).tolist(),
                reward=float(member), log_probs=-torch.rand(length, generator=generator) - 0.5,
                group_id=f"g{group}"))
    return batch


def test_the_observed_learner_learns_exactly_like_grpo_and_reports_ratio_variance_and_lengths():
    config = GRPOConfig(sampling=SAMPLING, loss_agg="token-mean", micro_batch_size=3)
    torch.manual_seed(0)
    plain = GRPOLearner(tiny_policy(), naive_strategy(), config)
    torch.manual_seed(0)
    observed = ObservedGRPOLearner(tiny_policy(), naive_strategy(), config)
    expected, got = plain.train_step(grpo_batch(), 0), observed.train_step(grpo_batch(), 0)
    # Equal up to the CPU kernels' run-to-run rounding (two plain learners differ by as much).
    for key in ("loss/policy_avg", "val/ratio", "grad_norm/actor"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5), key
    for (name, a), (_, b) in zip(plain.policy.model.named_parameters(),
                                 observed.policy.model.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert got["val/ratio_var"] > 0 and math.isfinite(got["val/ratio_var"])  # random behaviour log-probs
    assert observed.last_prompt_lengths == [2, 3] and observed.last_response_lengths == [2, 3, 4, 5] * 2
    assert observed.last_sequence_tokens == 4 * 2 + 4 * 3 + 2 * (2 + 3 + 4 + 5)
    assert batch_lengths(grpo_batch()) == ([2, 3], [2, 3, 4, 5] * 2)


def test_open_instruct_names_and_meanings_are_added_to_a_steps_metrics():
    ours = {"lr/actor": 1e-4, "grad_norm/actor": 0.5, "loss/kl_avg": 0.2, "policy/entropy_avg": 3.0,
            "val/ratio": 1.0}
    theirs = open_instruct_step_metrics(ours, beta=0.05, kl_kind="k3")
    assert theirs["lr"] == 1e-4 and theirs["optim/grad_norm"] == 0.5
    assert theirs["objective/kl2_avg"] == 0.2 and theirs["loss/kl_avg"] == pytest.approx(0.05 * 0.2)
    assert theirs["policy/entropy_avg"] == 3.0 and theirs["val/ratio"] == 1.0


def test_open_instruct_settings_translate_and_unsupported_ones_are_refused_by_name():
    args = ExperimentConfig(learning_rate=3e-6, num_training_steps=10, num_mini_batches=2, alpha=0.4,
                            beta=0.02)
    stream = StreamingDataLoaderConfig(num_unique_prompts_rollout=4, num_samples_per_prompt_rollout=4,
                                       response_length=32, temperature=0.7, async_steps=1)
    config = grpo_config_from(args, stream, world_size=2)
    assert (config.kl_coef, config.kl_kind, config.ref_update_alpha,
            config.ref_update_every) == (0.02, "k3", 0.4, 0)
    assert (config.clip_low, config.clip_high, config.loss_agg) == (0.2, 0.272, "token-mean")
    assert config.advantage_estimator == "dr_grpo" and config.mini_batch_size == 4 and config.dynamic_sampling
    assert config.actor_optimizer.total_steps == 20 and config.actor_optimizer.warmup_steps == 2
    assert (config.sampling.max_new_tokens, config.sampling.temperature) == (32, 0.7)
    trainer = trainer_config_from(args, stream, world_size=2)
    assert (trainer.train_batch_size, trainer.max_staleness) == (8, 1)
    maker = maker_config_from(stream, VLLMConfig(vllm_num_engines=2))
    assert (maker.experience_batch_size, maker.group_size, maker.sampling) == (2, 4, config.sampling)
    assert grpo_config_from(ExperimentConfig(load_ref_policy=False, num_training_steps=1), stream,
                            1).kl_coef == 0.0
    refused = {"kl_estimator": ExperimentConfig(kl_estimator=3, num_training_steps=1),
               "loss_fn": ExperimentConfig(loss_fn="cispo", num_training_steps=1),
               "loss_denominator": ExperimentConfig(loss_denominator="1024", num_training_steps=1),
               "num_training_steps": ExperimentConfig()}
    for field, bad in refused.items():
        with pytest.raises(ValueError, match=field):
            grpo_config_from(bad, stream, world_size=1)
    with pytest.raises(ValueError, match="world_size 3"):
        grpo_config_from(args, stream, world_size=3)
    assert [bundle_index(r, [2, 1]) for r in range(3)] == [0, 0, 1]


#: The reference pages' (seeds 000, 002) positional arguments of the learner and of the driver step.
SEED_LEARNER_ARGS = ("world_size", "rank", "local_rank", "master_addr", "master_port", "args",
                     "streaming_config", "vllm_config", "data_prep_actor_name", "tokenizer")
SEED_STEP_ARGS = ("args", "streaming_config", "policy_group", "tokenizer", "data_thread_metrics", "episode",
                  "training_step", "num_total_tokens", "start_time", "train_dataset", "training_start_time",
                  "wandb_url", "chat_template_name", "model_dims", "actor_manager")


def positional(function) -> tuple[str, ...]:
    """The names `function` takes by position (without self)."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return tuple(name for name, parameter in inspect.signature(function).parameters.items()
                 if parameter.kind is kind and name != "self")


def test_the_learner_and_the_driver_step_take_the_seeds_arguments_in_the_seeds_order():
    assert positional(PolicyTrainerProcess.__init__) == SEED_LEARNER_ARGS
    assert positional(one_training_step) == SEED_STEP_ARGS
    args, stream, vllm = ExperimentConfig(num_training_steps=1), StreamingDataLoaderConfig(), VLLMConfig()
    learner = PolicyTrainerProcess(1, 0, 0, None, None, args, stream, vllm,
                                   data_prep_actor_name="data_prep_actor", tokenizer=None)
    assert learner.data_prep_actor_name == "data_prep_actor" and learner.strategy_name == "naive"
    with pytest.raises(TypeError, match="data_prep_actor_name must be a str"):
        PolicyTrainerProcess(1, 0, 0, None, None, args, stream, vllm, object())  # a tokenizer in its place
    with pytest.raises(TypeError, match="policy_group must be a ModelGroup"):
        one_training_step(args, stream, vllm, None)  # the former order, vllm_config third


def test_from_pretrained_returns_the_steps_done_as_an_int_that_carries_the_saved_state():
    done = StepsDone(4, {"training_step": 4, "rank": 0})
    assert isinstance(done, int) and done + 1 == 5 and range(done + 1, 7) == range(5, 7)
    assert done.checkpoint_state == {"training_step": 4, "rank": 0}
    assert done["optimization_steps_done"] == 4 and done["checkpoint_state"] == done.checkpoint_state
    again = pickle.loads(pickle.dumps(done))  # as Ray returns it
    assert again == 4 and again.checkpoint_state == done.checkpoint_state
    assert StepsDone(0) + 1 == 1 and StepsDone(0).checkpoint_state is None


def test_a_learner_is_created_where_it_looks_and_a_maker_elsewhere_is_told_the_exact_change():
    anonymous = str(uuid.uuid4())
    assert is_anonymous(anonymous) and not is_anonymous("detached_rl") and not is_anonymous(str(uuid.uuid1()))
    # Given none, where every actor looks (`resolve_namespace`); given one, in .options or to the constructor.
    assert learner_namespace(None, None, "learner l") == resolve_namespace(None)
    assert learner_namespace("mine", None, "l") == learner_namespace(None, "mine", "l") == "mine"
    with pytest.raises(ValueError, match=r"^learner l: \.options\(namespace='a'\) and namespace='b' differ"):
        learner_namespace("a", "b", "learner l")
    assert maker_advice("engine_0", "learner_0", "detached_rl", [anonymous]) == (
        "maker 'engine_0' is not in Ray namespace 'detached_rl', where learner 'learner_0' sends it weights "
        f"and makers find learners; it is in the anonymous namespace '{anonymous}' of a plain ray.init() "
        "(actors created with .options(name=...) and no namespace land there): create it with "
        ".options(name='engine_0', namespace='detached_rl'), or name the namespace in the driver: "
        "ray.init(namespace='detached_rl')")
    assert "; it is in namespace 'other': create it" in maker_advice("m", "l", "ns", ["other"])
    assert "; no Ray namespace holds an actor of that name: create it" in maker_advice("m", "l", "ns", [])
    assert no_batch_advice("learner_0", "ns", ["maker 'm' is not in Ray namespace 'ns', ..."]) == (
        "Learner 'learner_0' is in Ray namespace 'ns': makers find it there by name (create them with "
        ".options(name=..., namespace='ns')). Refused: maker 'm' is not in Ray namespace 'ns', ....")


def test_a_step_that_gets_no_batch_says_which_namespace_makers_must_push_in():
    args = ExperimentConfig(num_training_steps=1, backend_timeout=0.02)  # minutes: a 1.2 s wait for a batch
    stream = StreamingDataLoaderConfig(num_unique_prompts_rollout=1, num_samples_per_prompt_rollout=2,
                                       response_length=4)
    learner = PolicyTrainerProcess(1, 0, 0, None, None, args, stream, VLLMConfig(), name="learner_0",
                                   namespace="mine")
    learner.put_chunk = lambda chunk: chunk  # its version-0 update stays in this process (no Ray)
    learner.from_pretrained(args, ModelConfig("tiny"))
    expected = (r"are the makers running\?.* Learner 'learner_0' is in Ray namespace 'mine': makers find it "
                r"there by name \(create them with \.options\(name=\.\.\., namespace='mine'\)\)\.$")
    with pytest.raises(TimeoutError, match=expected):
        learner.step()
    assert not ray.is_initialized()


# ---------------------------------------------------------------------------------------------- on Ray
def maker_models(path: str) -> MakerModels:
    """A maker's models: the policy from `path` and the token reward."""
    return MakerModels(actor=load_policy(path, "float32", 0), reward=LowTokenReward())


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("oi") / "base"
    model, tokenizer = tiny_causal_lm("llama", seed=3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def wait_until_stopped(ray, maker) -> None:
    deadline = time.monotonic() + TIMEOUT
    while ray.get(maker.status.remote(),
                  timeout=TIMEOUT)["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.2)


def wait_until_gone(ray, names: list[str]) -> None:
    deadline = time.monotonic() + 30
    for name in names:
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            time.sleep(0.2)


OPEN_INSTRUCT_METRICS = ("loss/policy_avg", "loss/kl_avg", "loss/total_avg", "policy/clipfrac_avg",
                         "policy/entropy_avg", "val/ratio", "val/ratio_var", "objective/kl2_avg", "lr",
                         "optim/grad_norm", "time/training", "time/total", "learner_tokens_per_second_step",
                         "learner_tokens_per_second_overall", "val/num_step_tokens", "val/num_total_tokens",
                         "learner_mfu", "episode", "training_step")


@pytest.mark.ray
def test_open_instruct_driver_loop_steps_saves_and_resumes(ray_cluster, base_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from detached_rl.actors.maker import ExperienceMakerHolder
    from detached_rl.core.prompts import CyclingPrompts

    ray = ray_cluster
    args = ExperimentConfig(learning_rate=1e-3, lr_scheduler_type="constant", beta=0.05, alpha=0.5,
                            ref_policy_update_freq=1, num_training_steps=3, per_device_train_batch_size=4,
                            checkpoint_state_dir=str(tmp_path / "state"), output_dir=str(tmp_path / "out"),
                            save_freq=2, backend_timeout=2, seed=1)
    stream = StreamingDataLoaderConfig(num_unique_prompts_rollout=2, num_samples_per_prompt_rollout=4,
                                       response_length=SAMPLING.max_new_tokens, async_steps=2,
                                       filter_zero_std_samples=False)
    vllm = VLLMConfig(vllm_num_engines=1)
    model_config = ModelConfig(model_name_or_path=base_model)

    def start_learners() -> tuple[ModelGroup, list]:
        group = ModelGroup(None, PolicyTrainerRayProcess, [2], False, args, stream, vllm, "data_prep_actor",
                           None, name="oi_learner", namespace=NAMESPACE)
        return group, [m.from_pretrained.remote(args, model_config, None, "", None) for m in group.models]

    group, loading = start_learners()
    maker = ExperienceMakerHolder.options(name="oi_engine_0", namespace=NAMESPACE).remote(
        "oi_engine_0", group.names, functools.partial(maker_models, base_model),
        CyclingPrompts(arithmetic_prompts()),
        maker_config_from(stream, vllm, experience_batch_size=1), namespace=NAMESPACE)
    logged: list[dict] = []
    try:
        # As the seed's driver: from_pretrained returns the steps done, an int.
        assert [done + 1 for done in ray.get(loading, timeout=TIMEOUT)] == [1, 1]
        ray.get([m.setup_model_update_group.remote([maker]) for m in group.models], timeout=TIMEOUT)
        maker.start.remote()
        training_start, episode, total_tokens = time.perf_counter(), 0, 0
        for training_step in (1, 2):
            start = time.perf_counter()
            episode += stream.num_unique_prompts_rollout * stream.num_samples_per_prompt_rollout
            # The seed's positional order: args, streaming_config, policy_group, tokenizer, ...
            total_tokens += one_training_step(args, stream, group, None, {}, episode, training_step,
                                              total_tokens, start, None, training_start, "", None, None,
                                              log_metrics=logged.append)
            syncs = ray.get([m.broadcast_to_vllm.remote(training_step) for m in group.models],
                            timeout=TIMEOUT)
            assert sum(s["weight_sync/makers_updated"] for s in syncs) == 1  # the maker is one rank's share
        # The seed's save_checkpoint_state(checkpoint_state_dir, training_step).
        ray.get([m.save_checkpoint_state.remote(args.checkpoint_state_dir, 2) for m in group.models],
                timeout=TIMEOUT)
        saved_weights = ray.get(group.models[0].weights_fingerprint.remote(), timeout=TIMEOUT)
        ray.get([m.save_model.remote(args.output_dir) for m in group.models], timeout=TIMEOUT)
        assert ray.get(maker.status.remote(), timeout=TIMEOUT)["policy_version"] == 2

        for metrics in logged:
            missing = [name for name in OPEN_INSTRUCT_METRICS if name not in metrics]
            assert not missing, missing
            assert all(math.isfinite(metrics[name]) for name in OPEN_INSTRUCT_METRICS)
            assert metrics["learner_mfu"] > 0 and metrics["val/num_step_tokens"] > 0
        assert [m["training_step"] for m in logged] == [1, 2]
        assert logged[1]["val/num_total_tokens"] == total_tokens - logged[1]["val/num_step_tokens"]

        # save_model at step 2 (save_freq) and at the end: Hugging Face directories that load and have moved.
        base = AutoModelForCausalLM.from_pretrained(base_model)
        for directory in (f"{args.output_dir}_checkpoints/step_2", args.output_dir):
            saved = AutoModelForCausalLM.from_pretrained(directory)
            AutoTokenizer.from_pretrained(directory)
            assert (tmp_path / directory / CHECKPOINT_COMPLETE_MARKER).exists()
            assert any(not torch.equal(a, b)
                       for a, b in zip(saved.parameters(), base.parameters(), strict=True))

        # A restart: new ranks under the same names resume from the saved state; the maker rejoins them.
        ray.get(maker.stop.remote(), timeout=TIMEOUT)
        wait_until_stopped(ray, maker)
        group.stop()
        wait_until_gone(ray, group.names)
        group, loading = start_learners()
        inits = ray.get(loading, timeout=TIMEOUT)
        assert [done + 1 for done in inits] == [3, 3]
        assert [done.checkpoint_state for done in inits] == [{"training_step": 2, "rank": r}
                                                             for r in range(2)]
        assert ray.get(group.models[0].weights_fingerprint.remote(), timeout=TIMEOUT) == saved_weights
        ray.get([m.setup_model_update_group.remote(["oi_engine_0"]) for m in group.models], timeout=TIMEOUT)
        maker.start.remote()
        one_training_step(args, stream, group, None, {}, episode, 3, total_tokens, time.perf_counter(),
                          None, training_start, "", None, None, vllm_config=vllm, log_metrics=logged.append)
        assert logged[-1]["training_step"] == 3 and "val/ratio_var" in logged[-1]
        assert [s["policy_version"]
                for s in ray.get([m.status.remote() for m in group.models], timeout=TIMEOUT)] \
            == [3, 3]
    finally:
        ray.kill(maker)
        group.stop()


@pytest.mark.ray
def test_learner_requests_the_cluster_can_never_place_are_refused_before_any_rank_starts(ray_cluster):
    from detached_rl.core.resources import UnplaceableError

    args, stream, vllm = ExperimentConfig(num_training_steps=1), StreamingDataLoaderConfig(), VLLMConfig()
    with pytest.raises(UnplaceableError, match=r"^learner gpu_learner_0 asks for 1 GPU; the cluster has 0$"):
        ModelGroup(None, PolicyTrainerRayProcess, [1], False, args, stream, vllm, name="gpu_learner",
                   namespace=NAMESPACE, num_gpus_per_actor=1)
    with pytest.raises(UnplaceableError, match=r"ask for 9 CPU together; the cluster has 8$"):
        ModelGroup(None, PolicyTrainerRayProcess, [3], False, args, stream, vllm, name="wide_learner",
                   namespace=NAMESPACE, num_cpus_per_actor=3)
    with pytest.raises(UnplaceableError, match=r"^learner lone asks for 1 GPU; the cluster has 0$"):
        PolicyTrainerRayProcess.options(name="lone", namespace=NAMESPACE, num_gpus=1).remote(
            1, 0, 0, None, None, args, stream, vllm, None, None)
    group = ray_cluster.util.placement_group([{"CPU": 1, "GPU": 1}])  # pending forever on this cluster
    try:
        with pytest.raises(UnplaceableError,
                           match=r"^placement group bundle 0 asks for 1 GPU; the cluster has 0$"):
            ModelGroup(group, PolicyTrainerRayProcess, [1], False, args, stream, vllm, name="pg_learner",
                       namespace=NAMESPACE)
    finally:
        ray_cluster.util.remove_placement_group(group)
    named = {actor["name"] for actor in ray_cluster.util.list_named_actors(all_namespaces=True)}
    assert not named & {"gpu_learner_0", "wide_learner_0", "lone", "pg_learner_0"}


#: A driver as a user writes it from the seeds, under a plain `ray.init()` (an anonymous namespace). Seed 000:
#: a learner created as its page does, but for the Ray name makers push to (`ray.remote(num_gpus=1)(...)`
#: becomes `.options(num_gpus=..., name=...)`), keyword arguments, `from_pretrained`,
#: `setup_model_update_group`, `step`, `broadcast_to_vllm`; a maker created like the learner, without a
#: namespace, is refused saying what to change, and the change is made as said. Seed 002: a `ModelGroup` and
#: `one_training_step` with positional arguments.
PLAIN_DRIVER = """
import functools, json, re, sys, time
import ray
from detached_rl.actors.maker import ExperienceMakerHolder
from detached_rl.compat.open_instruct import (ExperimentConfig, ModelConfig, ModelGroup,
    PolicyTrainerRayProcess, StreamingDataLoaderConfig, VLLMConfig, maker_config_from, one_training_step)
from detached_rl.core.prompts import CyclingPrompts
from tests.helpers import arithmetic_prompts
from tests.test_compat_open_instruct import maker_models

address, base, root = sys.argv[1:4]
ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": root}})
report = {"driver_namespace": ray.get_runtime_context().namespace}
args = ExperimentConfig(lr_scheduler_type="constant", num_training_steps=1, per_device_train_batch_size=4,
                        backend_timeout=3, seed=1)
stream = StreamingDataLoaderConfig(num_unique_prompts_rollout=1, num_samples_per_prompt_rollout=4,
                                   response_length=6, filter_zero_std_samples=False)
vllm = VLLMConfig()

def engine(name, trainers, **options):
    return ExperienceMakerHolder.options(name=name, **options).remote(
        name, trainers, functools.partial(maker_models, base), CyclingPrompts(arithmetic_prompts()),
        maker_config_from(stream, vllm))

def failure(call):
    try:
        ray.get(call, timeout=180)
    except ray.exceptions.RayTaskError as error:
        return str(error)
    return None

# ---- seed 000
learner = PolicyTrainerRayProcess.options(num_gpus=0, name="learner_0").remote(
    world_size=1, rank=0, local_rank=0, master_addr=None, master_port=None, args=args,
    streaming_config=stream, vllm_config=vllm, data_prep_actor_name="data_prep_actor", tokenizer=None)
steps_done = ray.get(learner.from_pretrained.remote(
    args=args, model_config=ModelConfig(base), beaker_config=None, wandb_url="", tokenizer=None), timeout=180)
misplaced = engine("engine_0", ["learner_0"])  # no namespace, as the learner: the driver's anonymous one
misplaced.start.remote()  # it finds learner_0, which refuses its registration
deadline = time.monotonic() + 180
while (status := ray.get(misplaced.status.remote(), timeout=60))["state"] == "running" \
        and time.monotonic() < deadline:
    time.sleep(0.2)
report["registration_refused"] = status["last_error"]
report["setup_refused"] = failure(learner.setup_model_update_group.remote([misplaced]))
ray.kill(misplaced)
advised = re.search(r"create it with \\.options\\(name='engine_0', namespace='([^']+)'\\)",
                    report["setup_refused"])
vllm_engines = [engine("engine_0", ["learner_0"], namespace=advised.group(1))]  # as the refusal said
try:
    ray.get(learner.setup_model_update_group.remote(vllm_engines), timeout=180)
    vllm_engines[0].start.remote()
    metrics, array_metrics = ray.get(learner.step.remote(), timeout=240)
    updated = ray.get(learner.broadcast_to_vllm.remote(), timeout=180)["weight_sync/makers_updated"]
    # acknowledged once staged; the maker swaps it in between two of its batches
    deadline = time.monotonic() + 120
    while (served := ray.get(vllm_engines[0].status.remote(), timeout=60)["policy_version"]) < 1 \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    report["seed_000"] = {"steps_done": steps_done, "loss": metrics["loss/policy_avg"],
                          "responses": len(array_metrics["batch/response_lengths"]),
                          "updated": updated, "engine_version": served}
finally:
    ray.kill(vllm_engines[0])
    ray.get(learner.shutdown.remote(), timeout=60)
    ray.kill(learner)

# ---- seed 002
group = ModelGroup(None, PolicyTrainerRayProcess, [1], False, args, stream, vllm, "data_prep_actor", None,
                   name="plain_learner")
maker = None
try:
    resume = ray.get(group.models[0].from_pretrained.remote(args, ModelConfig(base), None, "", None),
                     timeout=180) + 1
    maker = engine("plain_engine_0", group.names, namespace=group.namespace)
    ray.get(group.models[0].setup_model_update_group.remote([maker]), timeout=180)
    maker.start.remote()
    now = time.perf_counter()
    tokens = one_training_step(args, stream, group, None, {}, 4, resume, 0, now, None, now, "", None, None,
                               log_metrics=lambda metrics: None)
    report["seed_002"] = {"namespace": group.namespace, "resume": resume, "tokens": tokens}
finally:
    if maker is not None:
        ray.kill(maker)
    group.stop()
print(json.dumps(report))
"""


@pytest.mark.ray
def test_the_seeds_driver_code_under_a_plain_ray_init_trains_and_a_maker_elsewhere_is_told_where(ray_cluster,
                                                                                                 base_model):
    root = str(Path(__file__).resolve().parents[1])
    address = ray_cluster.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": root}
    result = subprocess.run([sys.executable, "-c", PLAIN_DRIVER, address, base_model, root], env=env,
                            cwd=root, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    anonymous = report["driver_namespace"]
    assert is_anonymous(anonymous)
    # The maker landed in the driver's anonymous namespace, the learner in "detached_rl": both refusals say
    # where each is and the exact change.
    for refusal in (report["registration_refused"], report["setup_refused"]):
        assert "maker 'engine_0' is not in Ray namespace 'detached_rl', where learner 'learner_0'" in refusal
        assert f"it is in the anonymous namespace '{anonymous}' of a plain ray.init()" in refusal
        assert "create it with .options(name='engine_0', namespace='detached_rl')" in refusal
    seed_000 = report["seed_000"]
    assert seed_000["steps_done"] == 0 and math.isfinite(seed_000["loss"]) and seed_000["responses"] == 4
    assert seed_000["updated"] == 1 and seed_000["engine_version"] == 1
    seed_002 = report["seed_002"]
    assert (seed_002["namespace"], seed_002["resume"]) == ("detached_rl", 1) and seed_002["tokens"] > 0
