"""Rewards by import path: specs, the helper process, weighted totals, refusing bad rewards (no Ray)."""

import sys
import textwrap

import pytest

from detached_rl.config.loading import load_config
from detached_rl.config.schema import ConfigError
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig, MakerModels
from detached_rl.maker.refusals import refused_rows
from detached_rl.models import SamplingConfig
from detached_rl.rewards.reward_process import RewardProcess
from detached_rl.rewards.specs import RewardSpec, RewardSpecError, resolve, reward_specs, shipped_path
from detached_rl.rewards.task_reward import TaskReward
from detached_rl.trainer.core import TrainerCore

from .helpers import naive_strategy, tiny_actor_critic

USER_REWARDS = textwrap.dedent('''
    import math, os, time

    def score(prompts, completions, answer, **metadata):
        """1 when the completion contains the answer; 'bonus' metadata added."""
        return [float(str(a) in c) + b for c, a, b in zip(completions, answer, metadata["bonus"])]

    def length(prompts, completions, **metadata):
        return [{"reward": len(c) / 100, "chars": float(len(c))} for c in completions]

    def raises(prompts, completions, **metadata):
        raise RuntimeError("the grader is broken")

    def nan_for_second(prompts, completions, **metadata):
        return [math.nan if i == 1 else 0.5 for i in range(len(completions))]

    def inf_for_first(prompts, completions, **metadata):
        return [math.inf] + [0.0] * (len(completions) - 1)

    def one_short(prompts, completions, **metadata):
        return [0.0] * (len(completions) - 1)

    def sleeps(prompts, completions, **metadata):
        time.sleep(60)
        return [0.0] * len(completions)

    def text(prompts, completions, **metadata):
        return ["high"] * len(completions)

    def exits(prompts, completions, **metadata):
        os._exit(3)

    def a_float(prompts, completions, **metadata):
        return 1.0

    def by_group(prompts, completions, **metadata):
        return [math.nan if i == 2 else 0.0 for i in range(len(completions))]

    not_callable = 3
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """`user_rewards.py` in a directory of its own, on this process's path (not installed anywhere)."""
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("user_rewards", None)


@pytest.fixture
def process(user_module):
    helper = RewardProcess()
    yield helper
    helper.close()


def grade(process, *fns, timeout_s=10.0, completions=("7", "it is 7", "8"), **metadata):
    specs = [RewardSpec(fn) if isinstance(fn, str) else RewardSpec(*fn) for fn in fns]
    reward = TaskReward(specs, tokenizer=None, timeout_s=timeout_s, process=process)
    rows = [{"answer": 7, "bonus": 0.0, **metadata} for _ in completions]
    return reward.grade(["q"] * len(completions), list(completions), rows)


def test_specs_are_checked_by_field_and_a_config_names_the_key():
    assert reward_specs("answer_line", ())[0].target == "detached_rl.rewards.builtin:answer_line"
    assert RewardSpec("detached_rl:format", 0.2).target == "detached_rl.rewards.builtin:format"
    assert RewardSpec("pkg.mod:Grader.score").label == "score"
    with pytest.raises(RewardSpecError, match="task.reward and task.rewards are both set"):
        reward_specs("answer_line", (RewardSpec("m:f"),))
    with pytest.raises(RewardSpecError, match=r"task.rewards: label\(s\) \['f'\] used twice"):
        reward_specs(None, (RewardSpec("a:f"), RewardSpec("b:f")))
    with pytest.raises(ConfigError, match=r"task.rewards\[1\].weight: expected a finite number"):
        load_config(None, ["task.rewards=[{fn: m:f}, {fn: m:g, weight: .nan}]"])
    with pytest.raises(ConfigError, match="task.reward: 'my_rewards.score' is neither 'module:function'"):
        load_config(None, ["task.reward=my_rewards.score"])
    with pytest.raises(ConfigError, match="task.dataset needs its reward named"):
        load_config(None, ["task.dataset=data.jsonl", "task.reward=null"])


def test_resolve_names_what_it_cannot_import(user_module):
    assert resolve(RewardSpec("user_rewards:score"))([], [], answer=[], bonus=[]) == []
    with pytest.raises(RewardSpecError, match="task.reward: cannot import module 'no_such_rewards'"):
        resolve(RewardSpec("no_such_rewards:score"))
    with pytest.raises(RewardSpecError, match="module 'user_rewards' has no 'missing'"):
        resolve(RewardSpec("user_rewards:missing"))
    with pytest.raises(RewardSpecError, match="is a int, not a function"):
        resolve(RewardSpec("user_rewards:not_callable"))
    assert shipped_path(RewardSpec("user_rewards:score")) == user_module / "user_rewards.py"
    assert shipped_path(RewardSpec("detached_rl:format")) is None


def test_a_reward_named_by_file_is_loaded_from_it_graded_and_shipped(tmp_path, monkeypatch):
    """`task.reward=path/to/file.py:fn` (verl's convention): the path made absolute (the actors run
    elsewhere), loaded from the file without its directory on any path, graded in the helper process, shipped
    as that file; where the path does not exist (a far host), the shipped copy is imported by its name."""
    rewards = tmp_path / "lib" / "file_rewards.py"
    rewards.parent.mkdir()
    rewards.write_text(USER_REWARDS)
    monkeypatch.chdir(tmp_path)
    spec = RewardSpec("lib/file_rewards.py:score")
    assert spec.fn == f"{rewards}:score" and spec.label == "score" and not spec.builtin
    assert "file_rewards" not in sys.modules or sys.modules.pop("file_rewards")
    try:
        assert resolve(spec)(["q"], ["it is 7"], answer=[7], bonus=[0.5]) == [1.5]
        assert shipped_path(spec) == rewards
        with pytest.raises(RewardSpecError, match="has no 'missing'"):
            resolve(RewardSpec(f"{rewards}:missing"))
        helper = RewardProcess(python_path=[p for p in sys.path if p != str(tmp_path / "lib")])
        try:
            rows = TaskReward([spec], tokenizer=None, process=helper).grade(["q"] * 2, ["7", "8"],
                                                                            [{"answer": 7, "bonus": 0.0}] * 2)
        finally:
            helper.close()
        assert [row["reward:score"] for row in rows] == [1.0, 0.0]
        # A far host: no such path there; the job's runtime_env put the shipped file on its path.
        far = RewardSpec("/nowhere/file_rewards.py:score")
        assert shipped_path(far) is None
        sys.modules.pop("file_rewards")
        monkeypatch.syspath_prepend(str(rewards.parent))
        assert resolve(far)(["q"], ["7"], answer=[7], bonus=[0.0]) == [1.0]
    finally:
        sys.modules.pop("file_rewards", None)
    with pytest.raises(RewardSpecError, match="cannot import module '/nowhere/other.py'"):
        resolve(RewardSpec("/nowhere/other.py:score"))


def test_weighted_rewards_total_label_and_report_their_parts(process):
    rows = grade(process, "user_rewards:score", ("user_rewards:length", 0.5, "len"),
                 ("detached_rl:format", 0.2))
    assert [row["reward:score"] for row in rows] == [1.0, 1.0, 0.0]
    assert [row["chars"] for row in rows] == [1.0, 7.0, 1.0]
    for row, text in zip(rows, ("7", "it is 7", "8"), strict=True):
        assert row["reward"] == pytest.approx(row["reward:score"] + 0.5 * len(text) / 100
                                              + 0.2 * row["reward:format"])
    # No reward reports "correct": the first one's full marks are the held-out accuracy.
    assert [row["correct"] for row in rows] == [1.0, 1.0, 0.0]
    builtin = grade(process, "answer_line", completions=("1 + 6 = 7\nAnswer: 7",))
    assert builtin[0]["correct"] == 1.0 and builtin[0]["reward"] == pytest.approx(1.2)


@pytest.mark.parametrize(("fn", "refused"), [
    ("user_rewards:raises", ["raised"] * 3),
    ("user_rewards:nan_for_second", [None, "non_finite", None]),
    ("user_rewards:inf_for_first", ["non_finite", None, None]),
    ("user_rewards:one_short", ["wrong_count"] * 3),
    ("user_rewards:a_float", ["wrong_count"] * 3),
    ("user_rewards:text", ["not_a_number"] * 3),
    ("user_rewards:exits", ["raised"] * 3),
])
def test_a_bad_reward_refuses_what_it_cannot_grade_by_reason_and_the_next_call_works(process, fn, refused):
    rows = grade(process, "user_rewards:score", fn)
    assert [row.get("refused") for row in rows] == refused
    assert all("refused_detail" in row and fn.split(":")[1] in row["refused_detail"]
               for row in rows if "refused" in row)
    assert [row["reward"] for row in grade(process, "user_rewards:score")] == [1.0, 1.0, 0.0]


def test_a_reward_past_its_timeout_is_killed_and_the_process_comes_back(process):
    rows = grade(process, "user_rewards:sleeps", timeout_s=0.5)
    assert {row["refused"] for row in rows} == {"timeout"}
    assert "task.reward_timeout_s=0.5" in rows[0]["refused_detail"]
    assert process.restarts == 1
    assert [row["reward"] for row in grade(process, "user_rewards:score")] == [1.0, 1.0, 0.0]


def test_a_refused_sample_takes_its_group_out_counted_under_its_reason():
    components = [{}, {}, {"refused": "non_finite", "refused_detail": "x"}, {}, {}, {}]
    rows, counts, detail = refused_rows(components, group_size=3)
    assert rows == {0, 1, 2} and dict(counts) == {"non_finite": 3} and detail == "x"
    assert refused_rows(components, group_size=1)[:2] == ({2}, {"non_finite": 1})


def test_a_maker_whose_reward_refuses_a_group_pushes_the_rest_counts_it_and_trains(process):
    """Groups of 4, two a batch: the reward gives NaN to the third completion of each call, so the first
    group of every batch is left out (counted as non_finite), the second is pushed, and a trainer trains on
    what was pushed."""
    from detached_rl.algorithms.ppo import PPOConfig, PPOLearner
    from detached_rl.trainer.config import TrainerConfig

    from .helpers import ObjectStore, arithmetic_prompts

    sampling = SamplingConfig(max_new_tokens=4)
    actor, maker_critic = tiny_actor_critic(seed=7)
    reward = TaskReward([RewardSpec("user_rewards:by_group")], actor.tokenizer, process=process)
    maker = ExperienceMaker("maker_0", MakerModels(actor=actor, critic=maker_critic, reward=reward),
                            CyclingPrompts(arithmetic_prompts()),
                            MakerConfig(experience_batch_size=2, group_size=4, sampling=sampling),
                            strategy=naive_strategy())
    policy, critic = tiny_actor_critic(seed=0)
    learner = PPOLearner(policy, critic, naive_strategy(), PPOConfig(sampling=sampling))
    trainer = TrainerCore("trainer_0", learner, TrainerConfig(train_batch_size=8))
    store = ObjectStore()
    trainer.weights.snapshot(store.put)
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    pushed = [maker.make_experience() for _ in range(2)]
    assert [len(batch) for batch in pushed] == [4, 4]
    assert all(e.info["reward:by_group"] == 0.0 and "refused" not in e.info
               for batch in pushed for e in batch)
    status = maker.status()
    assert status["reward_refused"] == {"non_finite": 8} and status["samples_made"] == 8
    assert "by_group" in status["last_reward_refusal"]
    for batch in pushed:
        assert trainer.push_experience(batch).accepted == 4
    assert trainer.train_step()["samples"] == 8
