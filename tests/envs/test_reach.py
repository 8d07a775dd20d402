"""Reach the target: ``ReachTargetEnv`` rules (moves, invalid moves, the turn limit), snapshot/restore and
``BranchRollout`` continuations, ``ReachTargetTask``'s test and validation splits (disjoint, deterministic, never
drawn by the training stream), the planners, the preset ``configs/tasks/reach.yaml`` and the shipped warm start
``embedded:reach`` (a converged imitation with greedy test success in [0.20, 0.40])."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
import yaml

from rl_lightning.envs import Environment, ReachTargetEnv, ReachTargetTask, Task
from rl_lightning.envs.reach import MOVES, apply_move, best_move, distances_to, shortest_solution
from tests.conftest import REPO
from tests.helpers.settings import data_kwargs

PRESET = REPO / "configs" / "tasks" / "reach.yaml"


@pytest.fixture(scope="module")
def task() -> ReachTargetTask:
    return ReachTargetTask()


def _env(start: int = 17, target: int = 52, **kwargs) -> ReachTargetEnv:
    env = ReachTargetEnv(start, target, **kwargs)
    env.reset()
    return env


# ---------------------------------------------------------------------------------------------------------- rules
def test_a_hand_played_episode_shows_each_new_value_and_ends_with_reward_1_on_the_target():
    env = ReachTargetEnv(17, 52)
    obs, info = env.reset(seed=3)
    assert obs == "s17 t52:" and info == {"start": 17, "target": 52}
    assert isinstance(env, Environment)
    assert env.step("+5") == ("22:", 0.0, False, False, {})
    assert env.step("*2") == ("44:", 0.0, False, False, {})
    assert env.step(" +5 ") == ("49:", 0.0, False, False, {})  # surrounding whitespace is ignored
    assert env.step("+1")[:4] == ("50:", 0.0, False, False)
    assert env.step("-3")[:4] == ("47:", 0.0, False, False)
    assert env.value == 47 and len(env.moves) == 5


def test_reaching_the_target_ends_the_episode_with_reward_1():
    env = _env(17, 52)
    for move, obs in [("+5", "22:"), ("*2", "44:"), ("+5", "49:"), ("+1", "50:"), ("+1", "51:")]:
        assert env.step(move) == (obs, 0.0, False, False, {})
    assert env.step("+1") == ("", 1.0, True, False, {"reached": True})
    assert env.value == 52 and env.moves == ["+5", "*2", "+5", "+1", "+1", "+1"]
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("+1")


@pytest.mark.parametrize("action", ["+2", "", "x", "+5+5", "*3", "5", "+ 5", "<eos>"])
def test_an_unknown_move_ends_the_episode_with_reward_0(action):
    env = _env(17, 52)
    env.step("+5")
    assert env.step(action) == ("", 0.0, True, False, {"reached": False, "invalid": True})
    assert env.value == 22


@pytest.mark.parametrize(("start", "move"), [(2, "-3"), (60, "*2"), (95, "+5"), (99, "+1")])
def test_a_move_that_leaves_0_to_99_is_invalid(start, move):
    env = _env(start, 50 if start != 50 else 51)
    assert env.step(move) == ("", 0.0, True, False, {"reached": False, "invalid": True})
    assert apply_move(start, move) is None
    assert [apply_move(3, m) for m in MOVES] == [4, 8, 0, 6] and apply_move(49, "*2") == 98


def test_the_turn_limit_ends_the_episode_with_reward_0_and_the_last_turn_still_counts():
    env = _env(0, 50)
    for k in range(1, 10):
        assert env.step("+1") == (f"{k}:", 0.0, False, False, {})
    assert env.step("+1") == ("", 0.0, True, False, {"reached": False})  # the 10th move misses
    env = _env(0, 10, max_moves=3)
    assert env.step("+5")[0] == "5:" and env.step("+1")[0] == "6:"
    assert env.step("+1")[:3] == ("", 0.0, True)
    env = _env(0, 10, max_moves=2)
    env.step("+5")
    assert env.step("+5")[:3] == ("", 1.0, True)  # reached on the last allowed turn


def test_the_env_and_task_check_their_arguments():
    for args in [(5, 5), (-1, 5), (5, 100)]:
        with pytest.raises(ValueError, match="different start and target"):
            ReachTargetEnv(*args)
    with pytest.raises(ValueError, match="max_moves"):
        ReachTargetEnv(1, 2, max_moves=0)
    with pytest.raises(ValueError, match="no training pairs"):
        ReachTargetTask(num_heldout=1000, num_validation=1000)


# ---------------------------------------------------------------------------------------------------------- snapshot
def _play(env: ReachTargetEnv, moves: list[str]) -> list[tuple]:
    return [env.step(m) for m in moves]


def test_a_snapshot_mid_episode_continues_identically_and_restores_into_another_instance():
    env = _env(17, 52)
    _play(env, ["+5", "*2", "+1"])
    state = env.snapshot()
    rest = ["+1", "-3", "+5", "+1", "+1", "+1"]
    first = _play(env, rest)
    env.restore(state)
    assert _play(env, rest) == first
    assert state["moves"] == ["+5", "*2", "+1"] and state["value"] == 45  # later steps do not leak into it
    other = ReachTargetEnv(3, 60)
    other.restore(state)
    assert _play(other, rest) == first
    assert pickle.loads(pickle.dumps(state)) == state == copy.deepcopy(state)
    assert all(isinstance(v, (int, str, bool, list)) for v in state.values())  # plain values: Branch.to_state


# ---------------------------------------------------------------------------------------------------------- splits
def test_the_splits_are_disjoint_deterministic_and_obey_the_pool_rules(task):
    test, val, train = set(task.test), set(task.validation), set(task.train)
    assert len(test) == len(task.test) == 400 and len(val) == len(task.validation) == 200
    assert not test & val and not test & train and not val & train
    assert [p.text for p in task.heldout_prompts()] == [f"s{s} t{t}:" for s, t in task.test]
    assert [p.metadata["start"] for p in task.validation_prompts()] == [s for s, _ in task.validation]
    again = ReachTargetTask()
    assert again.test == task.test and again.validation == task.validation and again.train == task.train
    assert ReachTargetTask(seed=5).test != task.test
    for s, t in task.test + task.validation + task.train:
        assert 30 <= t - s <= 70 and 4 <= distances_to(t)[s] <= 8
    uids = [p.uid for p in task.heldout_prompts() + task.validation_prompts()]
    assert len(set(uids)) == 600  # distinct starting states
    assert len({p.text for p in task.heldout_prompts()}) == 400


def test_the_training_stream_is_a_pure_function_of_seed_and_index_and_never_draws_a_heldout_start(task):
    held = set(task.test) | set(task.validation)
    drawn = [task.train_prompt(i) for i in range(5000)]
    pairs = [(p.metadata["start"], p.metadata["target"]) for p in drawn]
    assert not set(pairs) & held
    assert len(set(pairs)) > 0.9 * len(task.train)  # it covers the training pool
    assert [ReachTargetTask().train_prompt(i) for i in (0, 7, 4999)] == [drawn[0], drawn[7], drawn[4999]]
    assert [ReachTargetTask(seed=9).train_prompt(i).text for i in range(20)] != [p.text for p in drawn[:20]]


def test_the_task_is_a_task_of_ten_turn_episodes(task):
    assert isinstance(task, Task) and task.episode_turns() == 10
    prompt = task.heldout_prompts()[0]
    env = task.make_env(prompt, task.default_reward())
    assert env.reset()[0] == prompt.text and (env.start, env.target, env.max_moves) == (
        prompt.metadata["start"], prompt.metadata["target"], 10)


# ---------------------------------------------------------------------------------------------------------- planners
def test_a_shortest_solution_reaches_every_heldout_target_in_4_to_8_moves(task):
    for s, t in task.test + task.validation:
        moves = shortest_solution(s, t)
        assert 4 <= len(moves) <= 8 and len(moves) == distances_to(t)[s]
        env = _env(s, t)
        *_, last = _play(env, moves)
        assert last[:3] == ("", 1.0, True)
    assert shortest_solution(17, 52) == ["+5", "*2", "+5", "+1", "+1", "+1"] or len(shortest_solution(17, 52)) <= 6
    assert best_move(52, 52) is None and shortest_solution(52, 52) == []


def test_the_teacher_without_doubling_reaches_near_targets_only():
    """The warm start's teacher plans with +1 +5 -3: near targets within 10 moves, far ones never."""
    teacher = ("+1", "+5", "-3")
    near, far = shortest_solution(10, 45, teacher), shortest_solution(10, 75, teacher)
    assert near == ["+5"] * 7 and "*2" not in far and len(far) == 13 > 10
    assert len(shortest_solution(10, 75)) <= 6  # with doubling it is within reach
    env = _env(10, 45)
    assert _play(env, near)[-1][:3] == ("", 1.0, True)


# ---------------------------------------------------------------------------------------------------------- branching
@pytest.fixture(scope="module")
def warm():
    from rl_lightning.algorithms import GRPO

    return GRPO(model_name_or_path="embedded:reach")


def _preset_datamodule(module, **overrides):
    from rl_lightning.rollout import Evaluation, GroupRollout, RolloutDataModule, Sampling
    from tests.rollout.rollout_helpers import fake_trainer

    data = yaml.safe_load(PRESET.read_text())["data"]["init_args"]
    assert data["task"]["class_path"] == "rl_lightning.envs.ReachTargetTask"
    kwargs = dict(task=ReachTargetTask(**data["task"]["init_args"]),
                  strategy=GroupRollout(**data["strategy"]["init_args"]),
                  sampling=Sampling(**data["sampling"]), evaluation=Evaluation(**data["evaluation"]),
                  prompts_per_step=2, group_size=4)
    kwargs.update(overrides)
    dm = RolloutDataModule(**data_kwargs(**kwargs))
    dm.trainer = fake_trainer(module)
    return dm


def _real(batch, row: int) -> list[int]:
    keep = (batch.loss_mask[row] | batch.turns.obs_mask[row]).bool()
    return batch.response_ids[row][keep].tolist()


def test_branching_saved_mid_episode_states_continues_the_episode(warm):
    """3 greedy turns, then up to 7 more from each cut row's end state = 10 greedy turns straight; BranchRollout
    continues saved states n times in the restored environment."""
    from rl_lightning.rollout import Branch, BranchRollout, GroupRollout

    dm = _preset_datamodule(warm, num_prompts=40, batch_size=40)
    (prompts,) = dm.val_prompt_batches()
    with torch.no_grad():
        straight = dm.rollout(prompts)
        dm.strategy = GroupRollout(max_turns=3, max_episode_tokens=60)
        first = dm.rollout(prompts)
        rows = [r for r in range(first.num_rows) if first.ends.states[r] is not None]
        assert len(rows) >= 30
        branches = [Branch.from_rollout(first, r, max_turns=7, max_tokens=60 - len(first.ends.states[r].prefix_ids))
                    for r in rows]
        rest = dm.rollout_branches(branches, n=1, greedy=True)
        for k, r in enumerate(rows):
            assert first.ends.states[r].prefix_ids + _real(rest, k) == _real(straight, r)
            assert float(first.rewards[r] + rest.rewards[k]) == float(straight.rewards[r])
            assert int(first.turns.count[r] + rest.turns.count[k]) == int(straight.turns.count[r])
        # a training step of BranchRollout from saved states: 4 sampled continuations each, from the saved value
        strategy = BranchRollout(n=4, max_turns=10, max_episode_tokens=60)
        dm = _preset_datamodule(warm, strategy=strategy, group_size=4)
        strategy.set_branches(branches[:3])
        batch = dm.rollout(dm.prompt_batch(0))
    assert batch.num_rows == 12 and int(batch.turns.count.max()) <= 7
    tok = warm.tokenizer
    for k, b in enumerate(branches[:3]):
        value = b.env_state["value"]
        for row in range(4 * k, 4 * k + 4):
            text = tok.decode(_real(batch, row))
            move = text.split("<eos>")[0] if "<eos>" in text else text
            after = apply_move(value, move.strip())
            if after is not None and after != b.env_state["target"] and int(batch.turns.count[row]) > 1:
                assert f"{after}:" in text  # the environment continued from the restored value


# ---------------------------------------------------------------------------------------------------------- the preset
def _record() -> dict:
    from rl_lightning.models.policy import ASSETS

    return json.loads((ASSETS / "reach" / "warm_start.json").read_text())


def test_the_preset_fits_the_episode_in_the_models_positions():
    cfg = yaml.safe_load(PRESET.read_text())
    data = cfg["data"]["init_args"]
    assert cfg["model"]["init_args"]["model_name_or_path"] == "embedded:reach"
    assert data["strategy"]["init_args"]["max_turns"] == 10 and data["sampling"]["max_new_tokens"] == 3
    longest = 1 + len("s99 t99:") + data["strategy"]["init_args"]["max_episode_tokens"]
    config = json.loads((REPO / "rl_lightning" / "models" / "assets" / "reach" / "config.json").read_text())
    assert 10 * 3 + 9 * len("99:") <= data["strategy"]["init_args"]["max_episode_tokens"]
    assert longest + len(" R=1 t=10/10 V:") <= config["max_position_embeddings"]  # LVRL's query fits too


def test_the_warm_start_is_converged_in_the_window_and_scores_its_record(warm):
    record = _record()
    assert 0.20 <= record["test_greedy_success"] <= 0.40
    assert record["plateau"]["range"] <= record["plateau"]["tolerance"]
    assert record["sampled_success"]["mean_turns"] >= 8
    assert 0.20 <= record["validation_greedy_success"] <= 0.45
    dm = _preset_datamodule(warm, split="validation")  # the smaller split: the test's is checked by the build
    with torch.no_grad():
        total, count = dm.evaluate()
    assert count == 200 and total / count == pytest.approx(record["validation_greedy_success"], abs=1e-6)
