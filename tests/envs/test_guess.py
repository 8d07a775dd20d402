"""Guess the number: ``GuessNumberEnv`` rules, snapshot/restore branching, ``GuessNumberTask`` streams and held-out
set, the task preset ``configs/tasks/guess.yaml`` stacked on each method, and the shipped warm start
``embedded:guess`` (greedy held-out success in [0.20, 0.50] through ``Trainer.validate``)."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import yaml

from rl_lightning.envs import Environment, GuessNumberEnv, GuessNumberTask, Prompt, Task
from tests.conftest import REPO
from tests.helpers.settings import data_kwargs

PRESET = REPO / "configs" / "tasks" / "guess.yaml"
#: each method's own settings for the task (run_methods.sh stacks configs/tasks/guess_<method>.yaml after the preset)
METHOD_PRESETS = {m: REPO / "configs" / "tasks" / f"guess_{m}.yaml" for m in ("grpo", "reinforce", "ppo")}


def _env(secret: int = 20, **kwargs) -> GuessNumberEnv:
    env = GuessNumberEnv(secret, **kwargs)
    env.reset()
    return env


# ---------------------------------------------------------------------------------------------------------- rules
def test_reset_announces_the_range_and_starts_empty():
    env = GuessNumberEnv(7, low=1, high=31)
    env.step("3")
    obs, info = env.reset(seed=123)
    assert obs == "guess 1-31:" and info == {"secret": 7}
    assert env.guesses == []
    assert isinstance(env, Environment)
    assert GuessNumberEnv(5, low=2, high=9).reset()[0] == "guess 2-9:"


def test_a_low_guess_is_answered_hi_and_a_high_one_lo():
    env = _env(20)
    assert env.step("16") == ("hi:", 0.0, False, False, {})  # the secret is higher
    assert env.step("24") == ("lo:", 0.0, False, False, {})  # the secret is lower
    assert env.step("1") == ("hi:", 0.0, False, False, {})
    assert env.step("31") == ("lo:", 0.0, False, False, {})
    assert env.guesses == [16, 24, 1, 31]


def test_the_right_guess_ends_the_episode_with_reward_1():
    env = _env(20)
    env.step("16")
    obs, reward, terminated, truncated, info = env.step("20")
    assert (obs, reward, terminated, truncated) == ("", 1.0, True, False)
    assert info == {"found": True}


def test_surrounding_whitespace_is_ignored():
    env = _env(9)
    assert env.step(" 9\n")[1:3] == (1.0, True)


def test_the_right_guess_on_the_last_turn_still_counts():
    env = _env(3, max_guesses=2)
    env.step("10")
    assert env.step("3")[:4] == ("", 1.0, True, False)


def test_the_episode_ends_after_max_guesses_with_reward_0():
    env = _env(20, max_guesses=5)
    for guess in ["1", "2", "3", "4"]:
        obs, reward, terminated, truncated, _ = env.step(guess)
        assert (obs, reward, terminated, truncated) == ("hi:", 0.0, False, False)
    obs, reward, terminated, truncated, info = env.step("5")
    assert (obs, reward, terminated, truncated) == ("", 0.0, True, False)
    assert info == {"found": False}


@pytest.mark.parametrize("action", ["", "abc", "1 6", "16a", "-3", "0", "32", "99", "+5", "1.5", "<eos>"])
def test_an_unparseable_or_out_of_range_action_is_answered_bad_and_costs_a_guess(action):
    env = _env(5, max_guesses=3)
    assert env.step(action) == ("bad:", 0.0, False, False, {})
    assert env.guesses == [None]
    env.step(action)
    obs, reward, terminated, _, _ = env.step(action)  # the third bad guess ends the episode
    assert (obs, reward, terminated) == ("", 0.0, True)


def test_the_range_ends_are_valid_guesses():
    assert _env(1).step("1")[1] == 1.0
    assert _env(31).step("31")[1] == 1.0


def test_a_secret_outside_the_range_is_refused():
    with pytest.raises(ValueError, match="outside 1..31"):
        GuessNumberEnv(32)
    with pytest.raises(ValueError, match="outside 1..31"):
        GuessNumberEnv(0)


def test_bisection_finds_every_secret_in_five_guesses():
    for secret in range(1, 32):
        env, low, high = _env(secret), 1, 31
        for _ in range(5):
            guess = (low + high) // 2
            obs, reward, terminated, _, _ = env.step(str(guess))
            if terminated:
                break
            low, high = (guess + 1, high) if obs == "hi:" else (low, guess - 1)
        assert reward == 1.0, secret


# ---------------------------------------------------------------------------------------------------------- snapshot
def _play(env: GuessNumberEnv, actions: list[str]) -> list[tuple]:
    return [env.step(a) for a in actions]


def test_snapshot_mid_episode_branches_identically():
    env = _env(13)
    _play(env, ["16", "8"])
    state = env.snapshot()
    continuation = ["12", "abc", "14"]  # guesses 3..5: the episode ends, out of guesses, at "14"
    first = _play(env, continuation)
    assert env.guesses == [16, 8, 12, None, 14]
    env.restore(state)
    assert env.guesses == [16, 8]
    second = _play(env, continuation)
    assert first == second
    assert first[-1] == ("", 0.0, True, False, {"found": False})

    env.restore(state)  # the state is not consumed: restoring twice gives the same branch again
    assert _play(env, ["12", "13"]) == [("hi:", 0.0, False, False, {}), ("", 1.0, True, False, {"found": True})]
    env.restore(state)
    assert _play(env, ["12", "13"]) == [("hi:", 0.0, False, False, {}), ("", 1.0, True, False, {"found": True})]


def test_the_snapshot_is_independent_of_the_env_and_restores_into_another_instance():
    env = _env(13)
    env.step("16")
    state = env.snapshot()
    env.step("8")
    assert state["guesses"] == [16]  # later steps do not leak into the snapshot
    other = GuessNumberEnv(30)
    other.restore(state)
    assert other.secret == 13 and other.guesses == [16]
    assert other.step("13")[1] == 1.0


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))],
                         ids=["deepcopy", "pickle"])
def test_the_snapshot_is_deep_copyable_and_picklable(copier):
    env = _env(13)
    _play(env, ["16", "x"])
    state = env.snapshot()
    expected = _play(env, ["12", "14", "13"])
    copied = copier(state)
    assert copied == state
    fresh = GuessNumberEnv(1)
    fresh.restore(copied)
    assert _play(fresh, ["12", "14", "13"]) == expected
    assert pickle.loads(pickle.dumps(env)).guesses == env.guesses  # the env itself pickles too


# ---------------------------------------------------------------------------------------------------------- task
def test_the_task_is_a_task_whose_prompts_are_the_first_observation():
    task = GuessNumberTask()
    assert isinstance(task, Task)
    prompt = task.train_prompt(0)
    assert isinstance(prompt, Prompt) and prompt.text == "guess 1-31:"
    env = task.make_env(prompt, task.default_reward())
    assert isinstance(env, GuessNumberEnv) and (env.low, env.high, env.max_guesses) == (1, 31, 5)
    assert env.secret == prompt.metadata["secret"] == int(prompt.answer)
    assert env.reset()[0] == prompt.text


def test_the_heldout_set_is_every_secret_once_in_order():
    held = GuessNumberTask().heldout_prompts()
    assert [p.metadata["secret"] for p in held] == list(range(1, 32))
    assert [p.answer for p in held] == [str(s) for s in range(1, 32)]
    assert {p.text for p in held} == {"guess 1-31:"}
    assert [p.uid for p in held] == list(range(1, 32))
    assert [p.metadata["secret"] for p in GuessNumberTask(low=3, high=7).heldout_prompts()] == [3, 4, 5, 6, 7]
    assert GuessNumberTask(seed=99).heldout_prompts() == held  # the training seed does not move the held-out set


def test_the_training_stream_is_a_pure_function_of_seed_and_index():
    a, b = GuessNumberTask(seed=1234), GuessNumberTask(seed=1234)
    stream = [a.train_prompt(i).metadata["secret"] for i in range(500)]
    assert stream == [b.train_prompt(i).metadata["secret"] for i in range(500)]
    assert [a.train_prompt(i).metadata["secret"] for i in (499, 7, 0)] == [stream[499], stream[7], stream[0]]
    other = [GuessNumberTask(seed=1235).train_prompt(i).metadata["secret"] for i in range(500)]
    assert other != stream
    assert set(stream) == set(range(1, 32))  # every secret is drawn, none outside the range
    counts = [stream.count(s) for s in range(1, 32)]
    assert min(counts) >= 4 and max(counts) <= 35  # roughly uniform (500 / 31 = 16 expected)
    # the first secrets of the default stream, pinned: a change of the stream changes every recorded run
    assert stream[:8] == [18, 25, 30, 16, 29, 15, 14, 2]


def test_the_task_checks_its_arguments():
    with pytest.raises(ValueError, match="low < high"):
        GuessNumberTask(low=5, high=5)
    with pytest.raises(ValueError, match="max_guesses"):
        GuessNumberTask(max_guesses=0)


# ---------------------------------------------------------------------------------------------------------- preset
def _preset_datamodule(**overrides):
    """The data module the preset configures (task, strategy, sampling, evaluation), built from the
    YAML itself so the test follows it."""
    from rl_lightning.rollout import Evaluation, GroupRollout, RolloutDataModule, Sampling

    data = yaml.safe_load(PRESET.read_text())["data"]["init_args"]
    assert data["task"]["class_path"] == "rl_lightning.envs.GuessNumberTask"
    assert data["strategy"]["class_path"] == "rl_lightning.rollout.GroupRollout"
    kwargs = dict(task=GuessNumberTask(**data["task"]["init_args"]),
                  strategy=GroupRollout(**data["strategy"]["init_args"]),
                  sampling=Sampling(**data["sampling"]), evaluation=Evaluation(**data["evaluation"]))
    kwargs.update(overrides)
    return RolloutDataModule(**data_kwargs(**kwargs))


@pytest.mark.parametrize("method", ["grpo", "reinforce", "ppo"])
def test_the_preset_stacks_on_each_method(method):
    from unittest import mock

    from rl_lightning.cli import RLCLI, build_cli

    files = [REPO / "configs" / f"{method}.yaml", PRESET]
    args = [a for f in files for a in ("--config", str(f))]
    with mock.patch.object(RLCLI, "instantiate_classes", lambda self: None):
        config = build_cli(args, run=False).config
    classes = {"grpo": "GRPO", "reinforce": "REINFORCE", "ppo": "PPO"}
    assert config.model.class_path == f"rl_lightning.algorithms.{classes[method]}"
    assert config.model.init_args.model_name_or_path == "embedded:guess"
    data = config.data.init_args
    assert data.task.class_path == "rl_lightning.envs.GuessNumberTask"
    assert "num_heldout" not in data.task.init_args  # the arithmetic task's setting does not carry over
    assert data.strategy.class_path == "rl_lightning.rollout.GroupRollout"
    assert data.strategy.init_args.max_turns == 5
    assert data.sampling.max_new_tokens == 3 and data.evaluation.batch_size >= 31
    assert config.trainer.logger.init_args.name == "guess"  # the preset's own runs
    assert (config.trainer.max_steps, config.trainer.val_check_interval) == (100, 10)
    assert config.model.init_args.optimizer.init_args.lr == (5e-5 if method == "ppo" else 1e-4)  # the method's own
    assert data.sampling.temperature == 1.0


@pytest.mark.parametrize("method", ["grpo", "reinforce", "ppo"])
def test_each_method_preset_stacks_after_the_task_preset(method):
    """``configs/tasks/guess_<method>.yaml``: the method's settings for the task, its runs under their own name, the
    task's budget (100 steps of the method config's 16 prompts x 8 episodes) unchanged."""
    from unittest import mock

    from rl_lightning.cli import RLCLI, build_cli

    files = [REPO / "configs" / f"{method}.yaml", PRESET, METHOD_PRESETS[method]]
    args = [a for f in files for a in ("--config", str(f))]
    with mock.patch.object(RLCLI, "instantiate_classes", lambda self: None):
        config = build_cli(args, run=False).config
    model, data = config.model.init_args, config.data.init_args
    assert model.model_name_or_path == "embedded:guess" and data.task.class_path == "rl_lightning.envs.GuessNumberTask"
    assert config.trainer.logger.init_args.name == f"guess_{method}"
    assert (config.trainer.max_steps, data.prompts_per_step, data.group_size) == (100, 16, 8)
    assert model.optimizer.init_args.lr == 1e-4
    if method == "ppo":
        assert model.lam == 1.0 and data.sampling.temperature == 1.0
    elif method == "grpo":  # the study's fix: temperature 0.7 and PPO's 2 passes x 2 minibatches
        assert data.sampling.temperature == 0.7 and (model.num_iterations, model.num_minibatches) == (2, 2)
    else:  # REINFORCE: temperature 0.7, one optimiser step per batch
        assert data.sampling.temperature == 0.7 and (model.num_iterations, model.num_minibatches) == (1, 1)


def test_the_longest_episode_fits_the_tiny_llama():
    """5 turns cut at max_new_tokens without EOS, each answered "bad:", stay within the episode budget and the
    model's 64 positions."""
    from rl_lightning.models.policy import load_policy

    dm = _preset_datamodule()
    model, tok = load_policy("embedded:guess")
    first = 1 + len(tok("guess 1-31:", add_special_tokens=False)["input_ids"])
    worst = 5 * dm.sampling.max_new_tokens + 4 * len(tok("bad:", add_special_tokens=False)["input_ids"])
    assert worst <= dm.strategy.max_episode_tokens
    assert first + dm.strategy.max_episode_tokens <= model.config.max_position_embeddings == 64


def test_a_policy_that_never_ends_a_turn_still_plays_all_five_turns():
    """The random tiny Llama fills (almost) every turn with 3 non-digit tokens: each is answered "bad:" and the episode
    runs its 5 turns within the preset's token budget (5 x 3 sampled + 4 x 4 observed = 31 tokens)."""
    from types import SimpleNamespace

    from rl_lightning.models.policy import load_policy

    model, tok = load_policy("embedded:random")
    dm = _preset_datamodule(prompts_per_step=2, group_size=2)
    dm.trainer = SimpleNamespace(lightning_module=SimpleNamespace(policy=model, tokenizer=tok), global_rank=0,
                                 world_size=1)
    batch = dm.rollout(dm.prompt_batch(0))
    assert batch.turns.count.tolist() == [5, 5, 5, 5]
    assert batch.rewards.tolist() == [0.0] * 4
    assert all(r.count("bad:") == 4 for r in batch.responses)
    full = [i for i in range(4) if int(batch.loss_mask[i].sum()) == 15]  # no turn of the row ended at EOS
    assert full and all(int(batch.turns.obs_mask[i].sum()) == 16 for i in full)
    assert batch.input_ids.shape[1] <= model.config.max_position_embeddings


# ---------------------------------------------------------------------------------------------------------- warm start
def test_the_warm_start_asset_is_the_tiny_llama_with_the_char_tokenizer():
    from transformers import LlamaForCausalLM

    from rl_lightning.models.policy import ASSETS, load_policy

    model, tok = load_policy("embedded:guess")
    assert isinstance(model, LlamaForCausalLM) and model.config.max_position_embeddings == 64
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 1_200_000
    assert tok("guess 1-31:16", add_special_tokens=False)["input_ids"] == [
        tok.convert_tokens_to_ids(c) for c in "guess 1-31:16"]
    assert (ASSETS / "guess" / "model.safetensors").stat().st_size < 5 * 1024 * 1024
    record = json.loads((ASSETS / "guess" / "warm_start.json").read_text())
    assert record["task"] == {"class": "GuessNumberTask", "low": 1, "high": 31, "max_guesses": 5, "seed": 1234}


def test_the_warm_start_succeeds_20_to_50_percent_of_the_time_greedy_on_the_heldout_set(tmp_path):
    """``val/reward`` of ``Trainer.validate(GRPO(embedded:guess))`` with the preset's data module: the greedy
    held-out success the runs log at step 0. Deterministic: 11 of 31 secrets (``warm_start.json``)."""
    import lightning.pytorch as pl

    from rl_lightning.algorithms import GRPO
    from rl_lightning.models.policy import ASSETS

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.validate(GRPO(model_name_or_path="embedded:guess"), datamodule=_preset_datamodule(), verbose=False)
    success = float(trainer.callback_metrics["val/reward"])
    assert 0.20 <= success <= 0.50, success
    record = json.loads((ASSETS / "guess" / "warm_start.json").read_text())
    assert success == pytest.approx(record["heldout_greedy_success"], abs=1e-6)
    assert record["sampled_success"]["success"] > 0.1  # RL needs successes within its groups


def test_no_guess_is_taken_after_the_episode_ended():
    env = GuessNumberEnv(13)
    env.reset()
    for guess in "12345":
        env.step(guess)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("13")
    env.reset()
    assert env.step("13")[1:3] == (1.0, True)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("13")
