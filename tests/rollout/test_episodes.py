"""Multi-turn episodes: exact-token trajectories, masks, limits, the KV cache carried over, bad environments."""

from __future__ import annotations

import dataclasses

import copy
import math
import pickle
from typing import Any

import numpy as np
import pytest
import torch

from rl_lightning.algorithms import GRPO
from rl_lightning.envs import EnvError, Environment, Prompt, RewardError, Task
from rl_lightning.functional import gae
from rl_lightning.functional.advantages import outcome_token_rewards
from rl_lightning.rollout import GroupRollout, PromptFormat, RolloutBatch, RolloutDataModule, Sampling
from tests.rollout.rollout_helpers import fake_trainer
from tests.tolerances import decoder_logprob_bound
from tests.helpers.settings import data_kwargs


class CountdownEnv(Environment):
    """Replies ``"n<k>:"`` after each turn; ends after ``turns`` turns with reward = number of turns answered
    ``"a"`` (``pay``: that much every turn); raises on the action ``"!"`` when ``fragile``."""

    def __init__(self, turns: int, fragile: bool = False, pay: Any = None) -> None:
        self.turns, self.fragile, self.pay, self.seen = turns, fragile, pay, []

    def reset(self, seed=None, options=None):  # noqa: ANN001, ANN201
        self.seen = []
        return "go:", {}

    def step(self, action: str):  # noqa: ANN201
        if self.fragile and "!" in action:
            raise KeyError("boom")
        self.seen.append(action)
        done = len(self.seen) >= self.turns
        reward = float(action == "a") if self.pay is None else self.pay
        return ("" if done else f"n{len(self.seen)}:"), reward, done, False, {}


class CountdownTask(Task):
    def __init__(self, turns: int = 3, fragile: bool = False, pay: Any = None) -> None:
        self.turns, self.fragile, self.pay = turns, fragile, pay

    def train_prompt(self, index: int) -> Prompt:
        return Prompt("go:", metadata={"uid": index % 3})

    def heldout_prompts(self) -> list[Prompt]:
        return [Prompt("go:", metadata={"uid": 100 + i}) for i in range(4)]

    def make_env(self, prompt: Prompt, reward_fn: Any) -> CountdownEnv:
        return CountdownEnv(self.turns, self.fragile, self.pay)


@pytest.fixture(scope="module")
def module() -> GRPO:
    torch.manual_seed(0)
    return GRPO(model_name_or_path="embedded:random")


def rollout(module: GRPO, strategy: GroupRollout, task: Task | None = None, step: int = 0,
            **kwargs: Any) -> RolloutBatch:
    dm = RolloutDataModule(**data_kwargs(task=task or CountdownTask(), prompts_per_step=2, group_size=3,
                                         strategy=strategy, sampling=Sampling(max_new_tokens=3), **kwargs))
    dm.trainer = fake_trainer(module)
    dm.cursor = step
    return dm.rollout(dm.prompt_batch(step))


def test_the_trajectory_is_the_sampled_ids_with_the_observation_ids_between_them(module):
    batch = rollout(module, GroupRollout(max_turns=3))
    tok = module.tokenizer
    assert (batch.turns.count == 3).all()
    assert not (batch.loss_mask.bool() & batch.turns.obs_mask.bool()).any()
    for row in range(batch.num_rows):
        ids = batch.response_ids[row]
        turns = batch.turns.index[row]
        for turn in range(3):  # each turn's ids are model ids with that turn index, contiguous
            positions = (turns == turn).nonzero().flatten()
            assert positions.numel() >= 1 and (positions.diff() == 1).all()
            assert batch.loss_mask[row, positions].all()
        obs_ids = ids[batch.turns.obs_mask[row].bool()].tolist()
        assert obs_ids == (tok("n1:", add_special_tokens=False)["input_ids"]
                           + tok("n2:", add_special_tokens=False)["input_ids"])
        # the observation follows its turn immediately, and the turn before it is model ids
        first_obs = int(batch.turns.obs_mask[row].nonzero()[0])
        assert batch.loss_mask[row, first_obs - 1] == 1 and batch.turns.index[row, first_obs - 1] == 0
        assert (batch.attention_mask[row, batch.prompt_length:].bool()
                == (batch.loss_mask[row].bool() | batch.turns.obs_mask[row].bool())).all()
    assert batch.turns.rewards.shape == (6, 3)
    assert torch.equal(batch.rewards, batch.turns.rewards.nansum(dim=1))


def test_the_learner_recomputes_the_samplers_logprobs_on_episodes(module):
    batch = rollout(module, GroupRollout(max_turns=3), temperature=0.7)
    with torch.no_grad():
        logprobs, _ = module.token_logprobs(batch)
    mask = batch.loss_mask.bool()
    # the float32 bound of this decoder, far below what a wrong context would give (an observation token missing
    # from the cache, or a position shifted, changes log-probs by O(1e-1))
    bound = decoder_logprob_bound(module.policy, batch.temperature, batch.input_ids.shape[1])
    assert (logprobs - batch.sampler_logprobs)[mask].abs().max() <= bound
    assert (logprobs[~mask] == 0).all()


def test_carrying_the_cache_equals_re_encoding_the_history(module):
    carried = rollout(module, GroupRollout(max_turns=3))
    again = rollout(module, GroupRollout(max_turns=3, carry_cache=False))
    assert torch.equal(carried.input_ids, again.input_ids)
    assert torch.equal(carried.loss_mask, again.loss_mask) and torch.equal(carried.turns.obs_mask, again.turns.obs_mask)
    assert (carried.sampler_logprobs - again.sampler_logprobs).abs().max() < 1e-4


def test_limits_end_runaway_episodes_and_flag_them(module):
    by_turns = rollout(module, GroupRollout(max_turns=2), task=CountdownTask(turns=10))
    assert (by_turns.turns.count == 2).all() and by_turns.truncated.all()
    tokens = rollout(module, GroupRollout(max_turns=10, max_episode_tokens=8), task=CountdownTask(turns=10))
    lengths = (tokens.loss_mask + tokens.turns.obs_mask).sum(dim=1)
    assert (lengths <= 8).all() and tokens.truncated.all()


def test_single_turn_tasks_are_one_step_episodes(module):
    from rl_lightning.envs import ArithmeticTask

    batch = rollout(module, GroupRollout(), task=ArithmeticTask(num_heldout=4))
    assert batch.turns is None  # one generate call, as before
    assert batch.prompt_id.tolist() == [p.uid for p in batch.prompts]


def _row_1_answers_bang_in_its_second_turn(module: GRPO, monkeypatch: pytest.MonkeyPatch) -> None:
    from rl_lightning.rollout import episodes

    real = episodes.sample_episodes

    def forcing(model, prompts, observe, **kwargs):  # noqa: ANN001, ANN202 -- row 1's second turn answers "!"
        def wrapped(rows, actions):  # noqa: ANN001, ANN202
            actions = [a if not (r == 1 and len(seen.get(r, [])) == 1) else module.tokenizer("!")["input_ids"]
                       for r, a in zip(rows, actions)]
            for r in rows:
                seen.setdefault(r, []).append(1)
            return observe(rows, actions)
        seen: dict[int, list[int]] = {}
        return real(model, prompts, wrapped, **kwargs)

    monkeypatch.setattr("rl_lightning.rollout.strategies.sample_episodes", forcing)


def test_an_environment_that_raises_names_episode_turn_and_action(module, monkeypatch):
    _row_1_answers_bang_in_its_second_turn(module, monkeypatch)
    with pytest.raises(EnvError, match=r"CountdownEnv raised KeyError: 'boom' \(episode prompt='go:', turn 1, "
                                       r"action='!'\)"):
        rollout(module, GroupRollout(max_turns=3), task=CountdownTask(fragile=True))
    batch = rollout(module, GroupRollout(max_turns=3, env_errors="fail_episode"), task=CountdownTask(fragile=True))
    assert batch.env_errors == 1
    assert batch.turns.count[1] == 2 and (batch.turns.count[[0, 2, 3, 4, 5]] == 3).all()


def test_a_failed_episode_returns_zero_whatever_its_earlier_turns_earned(module, monkeypatch):
    """``env_errors="fail_episode"``: the episode whose environment raised at turn 1 returns 0 (its turn 0 paid
    1.0), its turn rewards are 0, and the failure is counted in ``train/env_errors``."""
    _row_1_answers_bang_in_its_second_turn(module, monkeypatch)
    batch = rollout(module, GroupRollout(max_turns=3, env_errors="fail_episode"),
                    task=CountdownTask(fragile=True, pay=1.0))
    assert batch.rewards.tolist() == [3.0, 0.0, 3.0, 3.0, 3.0, 3.0]
    assert batch.turns.rewards[1, :2].tolist() == [0.0, 0.0] and batch.turns.rewards[1, 2].isnan()
    assert batch.turns.count.tolist() == [3, 2, 3, 3, 3, 3]
    assert float(module.rollout_metrics(batch)["train/env_errors"]) == 1.0


def test_a_failed_branch_episode_returns_zero_too(module, monkeypatch):
    """A ``BranchRollout`` row that fails in its second continuation turn: return 0 and two turn rewards of 0,
    the continuation's turns (not counting the prefix's)."""
    from rl_lightning.rollout import Branch, BranchRollout

    _row_1_answers_bang_in_its_second_turn(module, monkeypatch)
    env = CountdownEnv(3, fragile=True, pay=1.0)
    env.reset()
    env.step("x")
    strategy = BranchRollout(n=3, max_turns=2, env_errors="fail_episode")
    dm = RolloutDataModule(task=CountdownTask(fragile=True, pay=1.0), prompts_per_step=1, group_size=3,
                           strategy=strategy, sampling=Sampling(max_new_tokens=3))
    dm.trainer = fake_trainer(module)
    strategy.set_branches([Branch(Prompt("go:"), [], env.snapshot(), turns=[("x", "n1:")])])
    batch = dm.rollout(dm.prompt_batch(0))
    assert batch.env_errors == 1 and batch.rewards.tolist() == [2.0, 0.0, 2.0]
    assert batch.turns.rewards.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]


class _EndingEnv(Environment):
    """One answer to an arithmetic prompt, then ``ending``: ``"terminated"``, ``"truncated"`` (the environment's
    own limit ends the episode) or ``"goes_on"`` (another turn, after the observation ``"more:"``)."""

    def __init__(self, prompt: Prompt, ending: str) -> None:
        self.prompt, self.ending = prompt, ending

    def reset(self, seed=None, options=None):  # noqa: ANN001, ANN201
        return self.prompt.text, {}

    def step(self, action: str):  # noqa: ANN201
        if self.ending == "goes_on":
            return "more:", 0.0, False, False, {}
        return "", 0.0, self.ending == "terminated", self.ending == "truncated", {}


@pytest.mark.parametrize("max_turns", [1, 2])
def test_the_single_turn_and_the_episode_path_mark_truncation_alike(max_turns):
    """``max_turns=1`` (one generate call) and ``max_turns=2`` (``sample_episodes``) both flag an episode the
    environment truncated, and one that the turn limit cuts while the environment would go on."""
    from rl_lightning.envs import ArithmeticTask

    class EndingTask(ArithmeticTask):
        def __init__(self, ending: str) -> None:
            super().__init__(num_heldout=4)
            self.ending = ending

        def make_env(self, prompt: Prompt, reward_fn: Any) -> _EndingEnv:
            return _EndingEnv(prompt, self.ending)

    module = GRPO(model_name_or_path="embedded:arithmetic")  # answers <= 3 digits, then EOS, within 4 tokens

    def truncated(ending: str) -> list[bool]:
        dm = RolloutDataModule(task=EndingTask(ending), prompts_per_step=4, group_size=2,
                               strategy=GroupRollout(max_turns=max_turns), sampling=Sampling(max_new_tokens=4))
        dm.trainer = fake_trainer(module)
        return dm.rollout(dm.prompt_batch(0)).truncated.tolist()

    assert truncated("terminated") == [False] * 8  # every answer ended at EOS: nothing else cuts them
    assert truncated("truncated") == [True] * 8
    assert truncated("goes_on") == [True] * 8


class _RewardEnv(CountdownEnv):
    """A ``CountdownEnv`` whose turn 1 pays ``value``."""

    def __init__(self, value: Any) -> None:
        super().__init__(turns=3)
        self.value = value

    def step(self, action: str):  # noqa: ANN201
        observation, reward, terminated, truncated, info = super().step(action)
        return observation, self.value if len(self.seen) == 2 else reward, terminated, truncated, info


class _RewardTask(CountdownTask):
    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value

    def make_env(self, prompt: Prompt, reward_fn: Any) -> _RewardEnv:
        return _RewardEnv(self.value)


@pytest.mark.parametrize("value, shown", [
    (None, "NoneType None, not a real number"), ("1", "str '1', not a real number"), (math.nan, "nan"),
    (math.inf, "inf"), (-math.inf, "-inf"), ([1.0], r"list \[1.0\], not a real number"),
    (torch.tensor([1.0, 2.0]), r"Tensor tensor\(\[1., 2.\]\), not a real number"),
    (1 + 0j, r"complex \(1\+0j\), not a real number"),
])
@pytest.mark.parametrize("env_errors", ["raise", "fail_episode"])
def test_an_environment_turn_reward_that_is_not_a_finite_real_number_is_refused(module, value, shown, env_errors):
    """As a reward function's output: a ``RewardError`` naming the environment, episode, turn and action, with
    ``fail_episode`` too (a wrong reward is a bug in the environment, not an episode that failed)."""
    with pytest.raises(RewardError, match=rf"environment _RewardEnv.step returned {shown} for the turn reward "
                                          r"\(episode prompt='go:', turn 1, action=.+\)$"):
        rollout(module, GroupRollout(max_turns=3, env_errors=env_errors), task=_RewardTask(value))


@pytest.mark.parametrize("value", [True, np.float32(0.5), torch.tensor(0.5), 2])
def test_an_environment_turn_reward_may_be_any_real_number(module, value):
    """The numbers a reward function may return (``bool`` included, as ``numbers.Real``) are taken as floats."""
    batch = rollout(module, GroupRollout(max_turns=3), task=_RewardTask(value))
    assert batch.turns.rewards[:, 1].tolist() == [float(value)] * 6


def test_per_row_extras_survive_select_and_the_batch_changes_only_through_replace(module):
    batch = rollout(module, GroupRollout(max_turns=3))
    batch.extras["score"] = torch.arange(6.0)
    part = batch.select(torch.tensor([4, 1]))
    assert part.extras["score"].tolist() == [4.0, 1.0]
    assert part.turns.index.shape[0] == 2 and part.turns.count.shape == (2,) and part.prompt_id.shape == (2,)
    with pytest.raises(dataclasses.FrozenInstanceError):  # an unknown attribute would be lost by select()/to()
        batch.my_tensor = torch.zeros(6)
    with pytest.raises(dataclasses.FrozenInstanceError):  # a field too: a new batch is dataclasses.replace(...)
        batch.rewards = torch.zeros(6)
    assert torch.equal(dataclasses.replace(batch, rewards=torch.zeros(6)).rewards, torch.zeros(6))


def test_the_outcome_reward_sits_on_the_last_model_token_and_observations_get_nothing(module):
    batch = rollout(module, GroupRollout(max_turns=3))
    rewards = torch.arange(1.0, 7.0)
    token_rewards = outcome_token_rewards(rewards, batch.loss_mask)
    for row in range(batch.num_rows):
        last_model = int(batch.loss_mask[row].nonzero()[-1])
        assert token_rewards[row, last_model] == rewards[row]
        assert token_rewards[row][batch.turns.obs_mask[row].bool()].abs().sum() == 0
    values = torch.randn(batch.loss_mask.shape) * batch.loss_mask
    adv, _ = gae(token_rewards, values, batch.loss_mask, gamma=1.0, lam=0.95)
    assert (adv[batch.turns.obs_mask.bool()] == 0).all()
    # removing the observation columns (same values at the model tokens) leaves the model tokens' advantages
    for row in range(batch.num_rows):
        keep = batch.loss_mask[row].bool()
        compact_mask = torch.ones(1, int(keep.sum()))
        compact, _ = gae(token_rewards[row, keep][None], values[row, keep][None], compact_mask, 1.0, 0.95)
        assert torch.allclose(compact[0], adv[row, keep], atol=1e-6)


def test_snapshots_branch_an_episode():
    from rl_lightning.envs import GuessNumberEnv

    env = GuessNumberEnv(secret=20)
    env.reset()
    env.step("16")
    state = env.snapshot()
    first = [env.step(a) for a in ("24", "20")]
    env.restore(state)
    again = [env.step(a) for a in ("24", "20")]
    assert first == again and first[-1][1] == 1.0
    clone = pickle.loads(pickle.dumps(copy.deepcopy(state)))
    env.restore(clone)
    assert env.guesses == [16]


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{% if m['role'] == 'assistant' %}"
                 "{{ eos_token }}{% endif %}|{% endfor %}{% if add_generation_prompt %}a:{% endif %}")


def conversation_ids(tokenizer, batch: RolloutBatch, row: int, observations: list[str]) -> tuple[list[int], list[int]]:
    """(the trajectory's ids, the template's rendering of the whole conversation, tokenised)."""
    prompt = batch.input_ids[row, : batch.prompt_length][batch.attention_mask[row, : batch.prompt_length].bool()]
    response = batch.response_ids[row][(batch.loss_mask[row] | batch.turns.obs_mask[row]).bool()]
    messages = [{"role": "user", "content": "go:"}]
    for turn in range(int(batch.turns.count[row])):
        ids = batch.response_ids[row][batch.turns.index[row] == turn].tolist()
        messages.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
        if turn < int(batch.turns.count[row]) - 1:
            messages.append({"role": "user", "content": observations[turn]})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    return prompt.tolist() + response.tolist(), tokenizer(rendered, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("turn_tokens", [None, 1], ids=["turns-end-at-eos", "turns-cut-before-eos"])
def test_with_a_chat_template_the_trajectory_is_the_templates_rendering_of_the_conversation(turn_tokens):
    module = GRPO(model_name_or_path="embedded:arithmetic")  # answers digits then EOS: no special ids mid-turn
    module.tokenizer.chat_template = CHAT_TEMPLATE
    dm = RolloutDataModule(task=CountdownTask(), prompts_per_step=2, group_size=4,
                           strategy=GroupRollout(max_turns=3, max_turn_tokens=turn_tokens, max_episode_tokens=60),
                           sampling=Sampling(max_new_tokens=4), prompt_format=PromptFormat(use_chat_template=True))
    dm.trainer = fake_trainer(module)
    batch = dm.rollout(dm.prompt_batch(0))  # sampled (seeded): some turns are cut before EOS at 1 token
    assert (batch.turns.count == 3).all()
    cuts = 0
    for row in range(batch.num_rows):
        trajectory, rendered = conversation_ids(module.tokenizer, batch, row, ["n1:", "n2:"])
        # the same ids up to the end of the last turn; the template then closes the last message
        assert rendered[: len(trajectory)] == trajectory
        closed = trajectory[-1] == module.tokenizer.eos_token_id
        assert module.tokenizer.decode(rendered[len(trajectory):]) == ("|" if closed else "<eos>|")
        # a turn cut before EOS gets it from the template's next message (an observation id, not a model id)
        ids, obs = batch.response_ids[row], batch.turns.obs_mask[row].bool()
        starts = [t for t in range(1, ids.numel()) if obs[t] and not obs[t - 1]]
        assert len(starts) == 2
        for start in starts:
            cut = ids[start - 1] != module.tokenizer.eos_token_id
            assert (ids[start] == module.tokenizer.eos_token_id) == bool(cut)
            cuts += int(cut)
        segments = module.tokenizer.decode(ids[obs]).replace("<eos>", "")
        assert segments == "|u:n1:|a:|u:n2:|a:"  # the template's next user message and generation prompt
    if turn_tokens == 1:
        assert cuts > 0  # one token per turn: digits are cut before their EOS


def test_observation_tokens_get_zero_loss_and_zero_kl(module):
    from rl_lightning.algorithms import Advantages, PolicyOutput
    from rl_lightning.callbacks import KLRegularizer

    batch = rollout(module, GroupRollout(max_turns=3))
    batch = dataclasses.replace(batch, rewards=torch.arange(6.0))
    weights = module.loss_weights(batch)
    assert (weights[batch.turns.obs_mask.bool()] == 0).all() and (weights[batch.loss_mask.bool()] > 0).all()
    advantages = Advantages(module.compute_advantages(batch).unsqueeze(-1))
    logprobs = torch.randn(batch.loss_mask.shape) * batch.loss_mask
    noise = torch.randn(batch.loss_mask.shape) * batch.turns.obs_mask  # anything at the observation positions
    loss, _ = module.policy_loss(batch, PolicyOutput(logprobs), advantages, weights)
    noisy, _ = module.policy_loss(batch, PolicyOutput(logprobs + noise), advantages, weights)
    assert torch.equal(loss, noisy)
    kl = KLRegularizer(beta=0.1, estimator="k3", target="sampler")
    term, _ = kl.loss_term(module, batch, logprobs, weights)
    noisy_term, _ = kl.loss_term(module, batch, logprobs + noise, weights)
    assert torch.equal(term, noisy_term) and term != 0


def test_ppo_advantages_skip_observation_tokens(module):
    from rl_lightning.algorithms import PPO

    torch.manual_seed(0)
    ppo = PPO(model_name_or_path="embedded:random")
    batch = rollout(module, GroupRollout(max_turns=3))
    batch = dataclasses.replace(batch, rewards=torch.arange(6.0))
    with torch.no_grad():
        adv = ppo.compute_advantages(batch)
    advantages = adv.advantages
    assert advantages.shape == batch.loss_mask.shape
    assert (advantages[batch.turns.obs_mask.bool()] == 0).all()
    assert (advantages[batch.loss_mask.bool()] != 0).any()
    assert (adv.values[batch.turns.obs_mask.bool()] == 0).all()  # the critic's values are masked there too


def test_extra_sampler_outputs_on_episodes_sit_at_the_sampled_positions(module):
    """record.topk / record.aux_draws on multi-turn episodes: the sampled ids do not change, the top-k log-probs
    are the learner's full-vocabulary log-probs at every sampled position (whatever turn), 0 on observations."""
    strategy = GroupRollout(max_turns=3, max_episode_tokens=30)
    plain = rollout(module, strategy)
    rich = rollout(module, strategy, topk=4, aux_draws=3)
    assert torch.equal(plain.input_ids, rich.input_ids) and torch.equal(plain.sampler_logprobs, rich.sampler_logprobs)
    n, t = rich.loss_mask.shape
    assert rich.record.topk_ids.shape == (n, t, 4) and rich.record.aux_ids.shape == (n, t, 3)
    assert (rich.turns.count > 1).any() and rich.turns.obs_mask.any()
    with torch.no_grad():
        logits = module.policy(input_ids=rich.input_ids, attention_mask=rich.attention_mask,
                               position_ids=(rich.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits
    full = torch.log_softmax(logits[:, rich.prompt_length - 1:-1], dim=-1)  # position P-1+t predicts token t
    m = rich.loss_mask.bool()
    r = rich.record
    torch.testing.assert_close(full.gather(-1, r.topk_ids)[m], r.topk_logprobs[m], atol=1e-4, rtol=1e-4)
    top1 = full.max(dim=-1).values[m]
    torch.testing.assert_close(rich.record.topk_logprobs[m][:, 0], top1, atol=1e-4, rtol=1e-4)
    assert (r.topk_ids[~m] == 0).all() and (r.topk_logprobs[~m] == 0).all() and (r.aux_ids[~m] == 0).all()
    picked = rich.select(torch.tensor([1, 4]))  # the extras follow the rows into minibatches
    assert torch.equal(picked.record.topk_ids, r.topk_ids[[1, 4]])
    assert torch.equal(picked.record.aux_ids, r.aux_ids[[1, 4]])


# numbers every message, so an observation's rendering depends on the whole conversation before it
NUMBERED_TEMPLATE = ("{% for m in messages %}{{ loop.index }}{{ m['role'][0] }}:{{ m['content'] }}"
                     "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}|{% endfor %}"
                     "{% if add_generation_prompt %}{{ messages | length + 1 }}a:{% endif %}")


def test_a_branch_with_a_chat_template_continues_the_templates_rendering_of_the_conversation():
    from rl_lightning.rollout import Branch, BranchRollout

    module = GRPO(model_name_or_path="embedded:arithmetic")
    tok = module.tokenizer
    tok.chat_template = NUMBERED_TEMPLATE
    common = dict(task=CountdownTask(), prompts_per_step=1, group_size=2, sampling=Sampling(max_new_tokens=4),
                  prompt_format=PromptFormat(use_chat_template=True))
    dm = RolloutDataModule(**common, strategy=GroupRollout(max_turns=3, max_episode_tokens=80))
    dm.trainer = fake_trainer(module)
    recorded = dm.rollout(dm.prompt_batch(0))
    ids = recorded.response_ids[0]
    first_turn = ids[recorded.turns.index[0] == 0].tolist()
    obs = recorded.turns.obs_mask[0].bool()
    start = len(first_turn)
    end = start + int(obs[start:].int().argmin())  # the first observation's span
    prefix = first_turn + ids[start:end].tolist()
    action = tok.decode(first_turn, skip_special_tokens=True)
    env = CountdownEnv(3)
    env.reset()
    env.step(action)

    def branched(turns: list[tuple[str, str]]) -> RolloutBatch:
        strategy = BranchRollout(n=2, max_turns=2, max_episode_tokens=80)
        bdm = RolloutDataModule(**common, strategy=strategy)
        bdm.trainer = fake_trainer(module)
        strategy.set_branches([Branch(Prompt("go:", metadata={"uid": 0}), prefix, env.snapshot(), turns=turns)])
        return bdm.rollout(bdm.prompt_batch(0))

    batch = branched([(action, "n1:")])
    assert (batch.turns.count == 2).all()
    for row in range(batch.num_rows):
        context = batch.input_ids[row, : batch.prompt_length][batch.attention_mask[row, : batch.prompt_length].bool()]
        response = batch.response_ids[row][(batch.loss_mask[row] | batch.turns.obs_mask[row]).bool()]
        trajectory = context.tolist() + response.tolist()
        messages = [{"role": "user", "content": "go:"}, {"role": "assistant", "content": action},
                    {"role": "user", "content": "n1:"}]
        for turn in range(2):
            turn_ids = batch.response_ids[row][batch.turns.index[row] == turn].tolist()
            messages.append({"role": "assistant", "content": tok.decode(turn_ids, skip_special_tokens=True)})
            if turn == 0:
                messages.append({"role": "user", "content": "n2:"})
        rendered = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
        assert rendered[: len(trajectory)] == trajectory
        assert "5u:n2:|6a:" in tok.decode(batch.response_ids[row][batch.turns.obs_mask[row].bool()])
    # without the prefix's turns the template numbers the next observation as if the conversation began there
    forgetful = branched([])
    assert "3u:n2:|4a:" in tok.decode(forgetful.response_ids[0][forgetful.turns.obs_mask[0].bool()])
