"""Ecosystem task suites behind adapters: gem-llm's games and reasoning-gym's datasets, offline.

These tests need the optional packages (``pip install -e '.[dev,gem,reasoning-gym]'`` then
``pip install --no-deps gem-llm==0.1.0``); without them they fail, naming that install line, rather than skip.
"""

from __future__ import annotations

import copy
import importlib
import pickle
import random
import re
import sys

import numpy as np
import pytest
import torch

from rl_lightning.envs import Prompt
from rl_lightning.envs.adapters import GemEnv, GemTask, ReasoningGymReward, ReasoningGymTask, normalize_answer
from rl_lightning.envs.adapters.gem_envs import GEM_INSTALL
from rl_lightning.envs.adapters.reasoning_gym_tasks import REASONING_GYM_INSTALL
from rl_lightning.envs.environment import env_step

GAMES = ["game:GuessTheNumber-v0-easy", "game:Mastermind-v0-easy", "game:TowerofHanoi-v0-easy"]
RG_DATASETS = ["basic_arithmetic", "leg_counting", "chain_sum", "gcd"]


@pytest.fixture(scope="module")
def gem():
    try:
        from rl_lightning.envs.adapters.gem_envs import import_gem
        return import_gem()
    except ImportError as err:
        pytest.fail(f"{err}")


@pytest.fixture(scope="module")
def rg():
    try:
        from rl_lightning.envs.adapters.reasoning_gym_tasks import import_reasoning_gym
        return import_reasoning_gym()
    except ImportError as err:
        pytest.fail(f"{err}")


def rng_states() -> tuple:
    state = np.random.get_state()
    return random.getstate(), (state[0], state[1].tolist(), *state[2:])


# ---------------------------------------------------------------------------------------------- optional imports
def test_the_adapters_import_without_either_library_and_name_the_install_line(monkeypatch):
    import rl_lightning.envs as envs_package

    monkeypatch.setitem(sys.modules, "gem", None)  # None in sys.modules makes `import gem` raise ImportError
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    monkeypatch.setattr(envs_package, "adapters", envs_package.adapters)
    for name in [m for m in sys.modules if m.startswith("rl_lightning.envs.adapters")]:
        monkeypatch.delitem(sys.modules, name)
    adapters = importlib.import_module("rl_lightning.envs.adapters")  # re-executed with both libraries blocked
    with pytest.raises(ImportError, match=re.escape(GEM_INSTALL)) as err:
        adapters.GemEnv("game:GuessTheNumber-v0-easy")
    assert "\n" not in str(err.value) and "gem-llm" in str(err.value)
    with pytest.raises(ImportError, match=re.escape(REASONING_GYM_INSTALL)):
        adapters.ReasoningGymTask("leg_counting")
    assert adapters.ReasoningGymReward()(Prompt("q", "4"), "4") == 1.0  # the reward needs no library


def test_optional_imports_keep_their_side_effects_to_themselves(tmp_path, monkeypatch):
    import logging

    from rl_lightning.envs.adapters._isolation import import_optional

    # what `import gem` (logging.basicConfig(level=INFO)) and `import reasoning_gym` (draws from `random`) do
    (tmp_path / "noisy_suite.py").write_text(
        "import logging, random\nimport numpy as np\nlogging.basicConfig(level=logging.INFO)\n"
        "random.random()\nnp.random.seed(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    root = logging.getLogger()
    handlers, level, before = list(root.handlers), root.level, rng_states()
    try:
        assert import_optional("noisy_suite", "this test", "nothing").__name__ == "noisy_suite"
        assert (root.handlers, root.level, rng_states()) == (handlers, level, before)
    finally:
        sys.modules.pop("noisy_suite", None)
    with pytest.raises(ImportError, match=r"^this test needs the optional package 'no_such_suite' \(No module .*\); "
                                          r"install it with: pip install x$"):
        import_optional("no_such_suite", "this test", "pip install x")


# ---------------------------------------------------------------------------------------------- GemEnv
@pytest.mark.parametrize("env_id", GAMES)
def test_gem_env_follows_the_environment_api(gem, env_id):
    env = GemEnv(env_id, seed=3)
    observation, info = env.reset(seed=0)
    assert isinstance(observation, str) and observation.startswith("You are playing") and isinstance(info, dict)
    result = env.step("\\boxed{1}")
    observation, reward, terminated, truncated, info = result
    types = (type(observation), type(reward), type(terminated), type(truncated), type(info))
    assert types == (str, float, bool, bool, dict)
    fresh = GemEnv(env_id, seed=3)
    fresh.reset()
    assert env_step(fresh, "\\boxed{1}", Prompt("p"), 0) == result  # what the rollout loop calls; deterministic
    env.reset()
    observation, reward, terminated, truncated, _ = env.step("no box here")  # gem's format error ends the episode
    assert (reward, terminated) == (-0.1, True)
    with pytest.raises(RuntimeError, match="step after the episode ended"):
        env.step("\\boxed{1}")
    assert env.reset()[0].startswith("You are playing")  # a new episode after reset


def test_hanoi_observations_carry_the_board_and_a_solution_wins(gem):
    env = GemEnv("game:TowerofHanoi-v0-easy", seed=1)
    observation, _ = env.reset()
    assert "A: [3, 2, 1]\nB: []\nC: []" in observation  # gem keeps the board in info["suffix"]
    moves = ["A C", "A B", "C B", "A C", "B A", "B C", "A C"]
    for k, move in enumerate(moves):
        observation, reward, terminated, truncated, _ = env.step(f"\\boxed{{{move}}}")
        if k < len(moves) - 1:
            assert (reward, terminated, truncated) == (0.0, False, False)
            assert "Enter your move." in observation
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert "Enter your move." not in observation  # no prompt for a next turn on the last observation


def bisect(env: GemEnv, low: int, high: int) -> list[tuple]:
    """Play GuessTheNumber by bisection on ``low..high``; the list of step results."""
    results = []
    while True:
        guess = (low + high) // 2
        result = env.step(f"I guess \\boxed{{{guess}}}")
        results.append(result)
        if result[2] or result[3]:
            return results
        if f"higher than {guess}" in result[0]:
            low = guess + 1
        else:
            assert f"lower than {guess}" in result[0]
            high = guess - 1


def test_bisection_wins_guess_the_number_and_running_out_is_terminated_and_truncated(gem):
    for seed in range(20):
        env = GemEnv("game:GuessTheNumber-v0-easy", seed=seed)  # 1..10 in 4 turns
        env.reset()
        results = bisect(env, 1, 10)
        assert results[-1][1:4] == (1.0, True, False) and len(results) <= 4
        assert all(r[1:4] == (0.0, False, False) for r in results[:-1])
    env = GemEnv("game:GuessTheNumber-v0-easy", seed=0)
    env.reset()
    secret = env.env.game_number
    wrong = [g for g in range(1, 11) if g != secret][:4]
    results = [env.step(f"\\boxed{{{g}}}") for g in wrong]
    assert results[-1][2:4] == (True, True)  # gem's turn limit: both flags, a partial (distance) reward
    assert results[-1][1] == pytest.approx(1 - abs(wrong[-1] - secret) / 9)


def test_gem_calls_leave_the_global_rngs_unchanged_and_episodes_depend_only_on_the_seed(gem):
    raw = gem.make("game:Mastermind-v0-easy")
    random.seed(11)
    np.random.seed(11)
    before = rng_states()
    raw.reset(seed=5)
    assert rng_states() != before  # what the wrapper isolates: gem reseeds the global generators

    def play(global_seed: int) -> list:
        random.seed(global_seed)
        np.random.seed(global_seed)
        before = rng_states()
        env = GemEnv("game:Mastermind-v0-easy", seed=5)
        out = [env.reset(seed=123)]
        out += [env.step(f"\\boxed{{{a} {b}}}") for a, b in [(1, 2), (3, 4), (5, 6)]]
        env.reset()
        out.append(env.step("\\boxed{2 1}"))
        assert rng_states() == before  # construction, reset and step: the caller's streams are untouched
        return out

    assert play(0) == play(999)  # the episode is the same whatever the caller's global state


def test_reset_uses_the_games_seed_else_the_given_one(gem):
    fixed = GemEnv("game:Mastermind-v0-easy", seed=5)
    fixed.reset(seed=1)
    code = fixed.env.game_code
    fixed.reset(seed=2)
    assert fixed.env.game_code == code  # a game seed overrides reset's seed (a group plays one game)
    free = GemEnv("game:Mastermind-v0-easy")
    codes = set()
    for seed in range(10):
        free.reset(seed=seed)
        codes.add(tuple(free.env.game_code))
    assert len(codes) > 1
    free.reset(seed=5)
    assert free.env.game_code == code
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        free.reset(seed=-1)
    with pytest.raises(ValueError, match="no gem environment 'game:Nope'.*game:GuessTheNumber-v0-easy"):
        GemEnv("game:Nope")


@pytest.mark.parametrize("env_id", GAMES)
def test_snapshots_branch_a_gem_episode(gem, env_id):
    actions = {"game:GuessTheNumber-v0-easy": ["\\boxed{5}", "\\boxed{2}", "\\boxed{8}"],
               "game:Mastermind-v0-easy": ["\\boxed{1 2}", "\\boxed{3 4}", "\\boxed{5 6}"],
               "game:TowerofHanoi-v0-easy": ["\\boxed{A C}", "\\boxed{A B}", "\\boxed{C B}"]}[env_id]
    env = GemEnv(env_id, seed=7)
    env.reset()
    env.step(actions[0])
    state = env.snapshot()
    first = [env.step(a) for a in actions[1:]]
    env.restore(state)
    assert [env.step(a) for a in actions[1:]] == first
    env.restore(pickle.loads(pickle.dumps(copy.deepcopy(state))))  # snapshots deep-copy and pickle
    assert [env.step(a) for a in actions[1:]] == first


# ---------------------------------------------------------------------------------------------- GemTask
def test_gem_task_streams_are_deterministic_and_disjoint_from_the_heldout_seeds(gem):
    task = GemTask("game:GuessTheNumber-v0-hard", num_heldout=32, seed=3)
    heldout = task.heldout_prompts()
    assert [p.metadata["seed"] for p in heldout] == task.heldout_seeds and len(set(task.heldout_seeds)) == 32
    train = [task.train_seed(i) for i in range(3000)]
    assert not set(train) & set(task.heldout_seeds)
    assert len(set(train)) > 2990  # seeds from [0, 2**31): repeats are rare
    again = GemTask("game:GuessTheNumber-v0-hard", num_heldout=32, seed=3)
    assert [again.train_prompt(i) for i in range(5)] == [task.train_prompt(i) for i in range(5)]
    assert again.heldout_prompts() == heldout
    other = GemTask("game:GuessTheNumber-v0-hard", num_heldout=32, seed=4)
    assert other.heldout_seeds != task.heldout_seeds and other.train_seed(0) != task.train_seed(0)
    prompt = task.train_prompt(7)
    env = task.make_env(prompt, task.default_reward())
    assert env.reset(seed=123)[0] == prompt.text and prompt.answer is None and prompt.uid == prompt.metadata["seed"]


# ---------------------------------------------------------------------------------------------- reasoning-gym
@pytest.mark.parametrize("dataset", RG_DATASETS)
def test_reasoning_gym_task_is_deterministic_and_its_heldout_set_is_never_trained_on(rg, dataset):
    before = rng_states()
    task = ReasoningGymTask(dataset, num_heldout=50, seed=5)
    heldout = task.heldout_prompts()
    assert len(heldout) == 50 and len({p.text for p in heldout}) == 50
    train = [task.train_prompt(i) for i in range(300)]
    assert not {p.text for p in train} & {p.text for p in heldout}
    assert all(isinstance(p.answer, str) and p.answer for p in train)
    again = ReasoningGymTask(dataset, num_heldout=50, seed=5)
    assert again.heldout_prompts() == heldout and [again.train_prompt(i) for i in range(20)] == train[:20]
    other = ReasoningGymTask(dataset, num_heldout=50, seed=6)
    assert [p.text for p in other.heldout_prompts()] != [p.text for p in heldout]
    assert rng_states() == before
    # the gold answer is reasoning-gym's own, and it scores 1 with the task's default verifier
    entry = task._data[train[0].metadata["index"]]
    assert entry["question"] == train[0].text and entry["answer"] == train[0].answer
    assert task.default_reward()(train[0], train[0].answer) == 1.0


def test_reasoning_gym_task_options(rg):
    task = ReasoningGymTask("basic_arithmetic", config={"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                        "max_digits": 1}, num_heldout=10, seed=0,
                            instruction="Answer in <answer></answer> tags.")
    prompt = task.train_prompt(0)
    assert prompt.text.endswith("\nAnswer in <answer></answer> tags.")
    assert prompt.metadata["question"] + "\nAnswer in <answer></answer> tags." == prompt.text
    with pytest.raises(ValueError, match="may not set 'seed'"):
        ReasoningGymTask("basic_arithmetic", config={"seed": 1})
    with pytest.raises(ValueError, match="no reasoning-gym dataset 'nope'"):
        ReasoningGymTask("nope")
    with pytest.raises(ValueError, match="distinct questions"):  # 1-digit a+b: fewer problems than asked
        ReasoningGymTask("chain_sum", config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                         num_heldout=500)


def test_the_gold_string_among_junk_earns_reasoning_gyms_credit_but_not_ours(rg):
    reward = ReasoningGymReward()
    for dataset in ("leg_counting", "basic_arithmetic", "chain_sum"):
        task = ReasoningGymTask(dataset, num_heldout=5, seed=0)
        prompt = task.train_prompt(0)
        entry = task._data[prompt.metadata["index"]]
        gold = entry["answer"]
        hack = f"maybe 1 or 7 or {gold} or 12 or 100 or 3"  # a list of guesses that contains the gold string
        assert task._data.score_answer(hack, entry) > 0  # reasoning-gym: partial credit len(gold) / len(hack)
        assert reward(prompt, hack) == 0.0
        assert reward(prompt, f"<answer>{hack}</answer>") == 0.0
        assert task._data.score_answer(gold, entry) == 1.0 and reward(prompt, gold) == 1.0


def test_reward_extracts_the_last_answer_block_else_the_last_line():
    prompt = Prompt("How many legs?", "292")
    reward = ReasoningGymReward()
    assert reward(prompt, "<answer>292</answer>") == 1.0
    assert reward(prompt, "Thinking: 4*73 = 292.\n\n<answer> 292 </answer>\n") == 1.0
    assert reward(prompt, "<answer>292</answer> wait <answer>291</answer>") == 0.0  # the last block counts
    assert reward(prompt, "<answer>it is 292</answer>") == 0.0
    assert reward(prompt, "4 * 73\n292\n\n") == 1.0  # no block: the last non-empty line
    assert reward(prompt, "292\nthat is my answer") == 0.0
    assert reward(prompt, "<answer>292") == 0.0  # an unclosed tag is no block; the last line is "<answer>292"
    assert reward(prompt, "") == 0.0 and reward(prompt, "   \n ") == 0.0
    assert ReasoningGymReward(fallback="none")(prompt, "292") == 0.0
    assert ReasoningGymReward(tag=None)(prompt, "<answer>1</answer>\n292") == 1.0
    words = Prompt("Sort", "apple, Banana")
    assert reward(words, "<answer>apple,  \n Banana</answer>") == 1.0  # whitespace runs collapse to one space
    assert reward(words, "<answer>apple,Banana</answer>") == 0.0  # ... but are not removed
    assert reward(words, "<answer>apple, banana</answer>") == 0.0
    assert ReasoningGymReward(ignore_case=True)(words, "<answer>APPLE, banana</answer>") == 1.0
    assert normalize_answer("\uff11\uff12 ") == "12"  # NFKC: full-width digits
    with pytest.raises(ValueError, match="needs a reference answer"):
        reward(Prompt("q"), "1")


# ---------------------------------------------------------------------------------------------- rollouts
@pytest.fixture(scope="module")
def module():
    from rl_lightning.algorithms import GRPO

    torch.manual_seed(0)
    return GRPO(model_name_or_path="embedded:random")


def data_module(module, task, strategy, **kwargs):
    from rl_lightning.rollout import Evaluation, RolloutDataModule, Sampling
    from tests.helpers.settings import data_kwargs
    from tests.rollout.rollout_helpers import fake_trainer

    dm = RolloutDataModule(**data_kwargs(task=task, prompts_per_step=2, group_size=2, strategy=strategy,
                                         sampling=Sampling(max_new_tokens=6), evaluation=Evaluation(batch_size=4),
                                         **kwargs))
    dm.trainer = fake_trainer(module)
    return dm


class RecordingGemTask(GemTask):
    """A GemTask that keeps the environments it makes, to compare the batch with what they returned."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.envs: list[GemEnv] = []

    def make_env(self, prompt, reward_fn):  # noqa: ANN001, ANN201
        env = super().make_env(prompt, reward_fn)
        real_step = env.step

        def step(action):  # noqa: ANN001, ANN202
            result = real_step(action)
            env.recorded.append((action, result))
            return result

        env.recorded = []
        env.step = step
        self.envs.append(env)
        return env


def test_a_gem_game_runs_end_to_end_through_the_rollout_data_module(gem, module):
    from rl_lightning.rollout import GroupRollout

    task = RecordingGemTask("game:GuessTheNumber-v0-easy", num_heldout=4, seed=0)
    dm = data_module(module, task, GroupRollout(max_turns=4))
    batch = dm.rollout(dm.prompt_batch(0))
    assert batch.num_rows == 4 and len(task.envs) == 4
    for row, env in enumerate(task.envs):
        assert env.recorded, "every episode took at least one turn"
        returns = sum(result[1] for _, result in env.recorded)
        assert float(batch.rewards[row]) == pytest.approx(returns)
        assert int(batch.turns.count[row]) == len(env.recorded)
        last = env.recorded[-1][1]
        assert last[2] or last[3] or len(env.recorded) == 4  # the game ended it, or the rollout's turn limit
    # a group plays one game (the prompt's seed), whatever reset seed the rollout gives each episode
    assert task.envs[0].env.game_number == task.envs[1].env.game_number
    assert task.envs[2].env.game_number == task.envs[3].env.game_number
    val = dm.rollout(dm.val_prompt_batches()[0])  # greedy, held-out
    assert val.num_rows == 4 and torch.isfinite(val.rewards).all()


@torch.no_grad()
def script(module, action: str) -> None:
    """Rewire the tiny Llama so that it writes ``action`` + EOS after any context ending in "." or <unk>.

    Attention and MLP outputs are zeroed, so the last hidden state is the (one-hot) embedding of the last token;
    the LM head maps each character of ``action`` to the next one (the last to EOS) with a margin of ~110 nats,
    so sampling at temperature 1 writes the same text as greedy decoding.
    """
    tok, model = module.tokenizer, module.policy
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    vocab = model.model.embed_tokens.weight.shape[0]
    model.model.embed_tokens.weight.zero_()
    model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
    model.model.norm.weight.fill_(1.0)
    model.lm_head.weight.zero_()
    ids = tok(action, add_special_tokens=False)["input_ids"]
    assert len(set(ids)) == len(ids)  # one successor per character
    starts = [tok.convert_tokens_to_ids("."), tok.unk_token_id]
    for prev, nxt in [*((s, ids[0]) for s in starts), *zip(ids, ids[1:]), (ids[-1], tok.eos_token_id)]:
        model.lm_head.weight[nxt, prev] = 10.0


def test_a_multi_turn_gem_game_runs_end_to_end_with_gems_feedback_between_the_turns(gem):
    from rl_lightning.algorithms import GRPO
    from rl_lightning.rollout import GroupRollout

    torch.manual_seed(0)
    scripted = GRPO(model_name_or_path="embedded:random")
    script(scripted, "\\boxed{5}")  # always guesses 5: "higher"/"lower", then "already guessed" until turn 4
    task = RecordingGemTask("game:GuessTheNumber-v0-easy", num_heldout=4, seed=0)
    dm = data_module(scripted, task, GroupRollout(max_turns=6, max_turn_tokens=12, max_episode_tokens=600))
    batch = dm.rollout(dm.prompt_batch(0))
    tok = scripted.tokenizer
    for row, env in enumerate(task.envs):
        secret = env.env.game_number
        assert [action for action, _ in env.recorded] == ["\\boxed{5}"] * len(env.recorded)
        if secret == 5:
            assert int(batch.turns.count[row]) == 1 and float(batch.rewards[row]) == 1.0
            continue
        # gem's turn limit (4) ends the episode, before the rollout's (6): terminated and truncated, with
        # GuessTheNumber's distance reward on the last turn and 0 on the others
        assert int(batch.turns.count[row]) == 4 and env.recorded[-1][1][2:4] == (True, True)
        assert float(batch.rewards[row]) == pytest.approx(1 - abs(5 - secret) / 9)
        assert batch.turns.rewards[row].tolist()[:3] == [0.0, 0.0, 0.0]
        assert bool(batch.truncated[row])
        observed = tok.decode(batch.response_ids[row][batch.turns.obs_mask[row].bool()].tolist())
        hint = "higher" if secret > 5 else "lower"
        assert observed.startswith(f"At turn 1, you guessed 5, and the target number is {hint} than 5.")
        assert "At turn 3, you guessed 5, which has been already guessed before." in observed
    assert any(env.env.game_number != 5 for env in task.envs)


def test_a_reasoning_gym_task_runs_through_the_rollout_data_module(rg, module):
    from rl_lightning.rollout import GroupRollout

    task = ReasoningGymTask("chain_sum", config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                            num_heldout=4, seed=0)
    dm = data_module(module, task, GroupRollout())
    batch = dm.rollout(dm.prompt_batch(0))
    assert batch.num_rows == 4 and set(batch.rewards.tolist()) <= {0.0, 1.0}
    reward = ReasoningGymReward()
    assert batch.rewards.tolist() == [reward(p, r) for p, r in zip(batch.prompts, batch.responses)]
