"""LVRL (no public paper: docs/algorithms.md, LVRL): the per-token advantages of a hand-built multi-turn
batch with an oracle critic, equal steps for the linear critic, the telescoping sum for the frozen-policy critic on
real guess-the-number episodes, one advantage per action, none on observations, single-turn = GRPO, the fallbacks
and the refusals."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from rl_lightning.algorithms import GRPO, LVRL, Advantages
from rl_lightning.algorithms.hindsight import (
    HindsightCritic, HindsightValues, LinearCritic, PromptedCritic, ValueTokenCritic, parse_values,
)
from rl_lightning.envs import GuessNumberTask
from rl_lightning.functional import group_advantages, turn_mask_from_index
from rl_lightning.rollout import Evaluation, GroupRollout, RolloutBatch, RolloutDataModule, Sampling, Turns
from tests.conftest import tiny_datamodule
from tests.rollout.rollout_helpers import fake_trainer

GUESS = dict(task=GuessNumberTask(), prompts_per_step=4, group_size=4, sampling=Sampling(max_new_tokens=3),
             strategy=GroupRollout(max_turns=5, max_episode_tokens=32), evaluation=Evaluation(batch_size=31), seed=0)


class TableCritic(HindsightCritic):
    """The oracle of the hand-built batch: fixed ``Ṽ_t`` per row (NaN where they must be ignored)."""

    def __init__(self, table: list[list[float]]) -> None:
        self.table = torch.tensor(table)

    def values(self, module, batch, turn_index, turn_mask, value_range) -> HindsightValues:  # noqa: ANN001
        return HindsightValues(self.table.clone(), torch.ones(batch.num_rows, dtype=torch.bool))


def make(hindsight: HindsightCritic | None = None, **kwargs) -> LVRL:
    return LVRL(model_name_or_path="embedded:guess", hindsight=hindsight, **kwargs)


def advantages(module: LVRL, batch: RolloutBatch) -> Advantages:
    adv = module.compute_advantages(batch)
    return dataclasses.replace(adv, advantages=adv.advantages.reshape(batch.num_rows, -1))


@pytest.fixture(scope="module")
def episodes() -> RolloutBatch:
    """16 real episodes (4 secrets x 4) sampled from the guess warm start."""
    torch.manual_seed(0)
    sampler = make(LinearCritic())
    dm = RolloutDataModule(**GUESS)
    dm.trainer = fake_trainer(sampler)
    batch = dm.rollout(dm.prompt_batch(0))
    assert batch.turns.index is not None and (batch.turns.count >= 3).sum() >= 8 and batch.rewards.std() > 0
    return batch


def hand_batch() -> RolloutBatch:
    """4 episodes in 2 groups; ``a`` = an action token, ``o`` = an observation token, ``.`` = padding:

    row 0 (R=1): a a o a o a a    row 1 (R=0): a o o a . . .
    row 2 (R=1): a a . . . . .    row 3 (R=0): a o a a . . .
    """
    nan = float("nan")
    turns = torch.tensor([[0, 0, -1, 1, -1, 2, 2], [0, -1, -1, 1, -1, -1, -1],
                          [0, 0, -1, -1, -1, -1, -1], [0, -1, 1, 1, -1, -1, -1]])
    obs = torch.tensor([[0, 0, 1, 0, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0], [0] * 7, [0, 1, 0, 0, 0, 0, 0]])
    loss = (turns >= 0).long()
    n, t, p = 4, 7, 2
    attention = torch.cat([torch.ones(n, p, dtype=torch.long), loss | obs], dim=1)
    ids = torch.randint(4, 90, (n, p + t), generator=torch.Generator().manual_seed(0)) * attention
    return RolloutBatch(input_ids=ids, attention_mask=attention, prompt_length=p, loss_mask=loss,
                        sampler_logprobs=-torch.rand(n, t) * loss, rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
                        group_size=2, prompt_index=torch.tensor([0, 0, 1, 1]),
                        truncated=torch.zeros(n, dtype=torch.bool),
                        turns=Turns(obs_mask=obs, index=turns, count=torch.tensor([3, 2, 1, 2]),
                                    rewards=torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, nan], [1.0, nan, nan],
                                                          [0.0, 0.0, nan]])))


def test_hand_built_batch_with_an_oracle_critic():
    nan = float("nan")
    oracle = TableCritic([[nan, 0.8, 0.9], [nan, 0.1, nan], [nan, nan, nan], [nan, 1.5, nan]])  # 1.5 -> clamped to 1
    batch = hand_batch()
    adv = advantages(make(oracle), batch)
    # group 0: R̄ = 0.5; row 0 Ṽ = 0.5, 0.8, 0.9, 1 -> Ā = 0.3, 0.1, 0.1; row 1 Ṽ = 0.5, 0.1, 0 -> Ā = -0.4, -0.1;
    # σ_G² = (0.09 + 0.01 + 0.01 + 0.16 + 0.01) / 5 = 0.056.
    # group 1: R̄ = 0.5; row 2 (one action) Ā = 0.5; row 3 Ṽ = 0.5, 1 (clamped), 0 -> Ā = 0.5, -1;
    # σ_G² = mean of (0.5, 0.5, -1)² - 0² = 0.5.
    s0, s1 = 0.056 ** 0.5 + 1e-6, 0.5 ** 0.5 + 1e-6
    a = [[0.3 / s0, 0.1 / s0, 0.1 / s0], [-0.4 / s0, -0.1 / s0, 0], [0.5 / s1, 0, 0], [0.5 / s1, -1 / s1, 0]]
    expected = torch.tensor([[a[b][int(k)] if k >= 0 else 0.0 for k in row] for b, row in enumerate(batch.turns.index)])
    torch.testing.assert_close(adv.advantages, expected)
    assert (adv.advantages[batch.turns.obs_mask.bool()] == 0).all()  # observation tokens get none
    assert (adv.advantages[(batch.loss_mask == 0) & (batch.turns.obs_mask == 0)] == 0).all()  # nor does padding
    metrics = make(oracle).before_update(batch, adv, torch.ones(4, 7))
    torch.testing.assert_close(metrics["train/step_credit_std"][0], torch.tensor((0.056 ** 0.5 + 0.5 ** 0.5) / 2))
    # boundaries: row 0 (t = 1, 2), row 1 (t = 1), row 3 (t = 1); linear Ṽ: row 0 2/3, 5/6; row 1 0.25; row 3 0.25
    departure = (abs(0.8 - 2 / 3) + abs(0.9 - 5 / 6) + abs(0.1 - 0.25) + abs(1.0 - 0.25)) / 4
    torch.testing.assert_close(metrics["train/hindsight_departure"][0], torch.tensor(departure))
    assert metrics["train/hindsight_fallback"][0] == 0


def test_the_raw_credit_sums_to_reward_minus_group_mean_for_the_frozen_policy_critic(episodes):
    module = make(scale_rewards=False)  # the default critic: the frozen warm start reading value tokens
    adv = advantages(module, episodes)
    mean = episodes.rewards.view(-1, 4).mean(dim=1).repeat_interleave(4)
    for row in range(episodes.num_rows):
        turns = episodes.turns.index[row]
        per_action = [adv.advantages[row, turns == t][0] for t in range(int(turns.max()) + 1)]
        torch.testing.assert_close(torch.stack(per_action).sum(), episodes.rewards[row] - mean[row])
    # it is no linear split
    assert module.before_update(episodes, adv, torch.ones(1))["train/hindsight_departure"][0] > 0
    again = advantages(module, episodes)  # frozen and greedy: the same values every time
    assert torch.equal(again.advantages, adv.advantages)


def test_the_frozen_policy_critic_values_lie_in_the_reward_range_and_it_is_not_saved(episodes):
    module = make()
    turns = episodes.turns.index
    reading = module.hindsight.values(module, episodes, turns, turn_mask_from_index(turns), (0.0, 1.0))
    inner = turn_mask_from_index(turns).bool()
    inner[:, 0] = False
    assert reading.read.all() and (reading.values[inner] >= 0).all() and (reading.values[inner] <= 1).all()
    assert len(pickle.dumps(module.hindsight)) < 2_000  # the loaded judge is not pickled into hparams


def test_a_linear_critic_gives_every_action_of_an_episode_the_same_advantage(episodes):
    adv = advantages(make(LinearCritic()), episodes).advantages
    mean = episodes.rewards.view(-1, 4).mean(dim=1).repeat_interleave(4)
    raw = advantages(make(LinearCritic(), scale_rewards=False), episodes).advantages
    for row in range(episodes.num_rows):
        on = episodes.turns.index[row] >= 0
        torch.testing.assert_close(adv[row, on], adv[row, on][0].expand(int(on.sum())))  # equal steps (to rounding)
        torch.testing.assert_close(raw[row, on], ((episodes.rewards[row] - mean[row]) / episodes.turns.count[row])
                                   .expand(int(on.sum())))
        assert (adv[row, ~on] == 0).all()  # observation tokens and padding get none
    metrics = make(LinearCritic()).before_update(episodes, advantages(make(LinearCritic()), episodes), torch.ones(1))
    assert metrics["train/hindsight_departure"][0] == 0 and metrics["train/hindsight_fallback"][0] == 0


def test_all_tokens_of_an_action_share_its_advantage(episodes):
    adv = advantages(make(), episodes).advantages
    for row in range(episodes.num_rows):
        turns = episodes.turns.index[row]
        for t in range(int(turns.max()) + 1):
            assert torch.unique(adv[row, turns == t]).numel() == 1
        assert (adv[row, episodes.turns.obs_mask[row].bool()] == 0).all()


def test_single_turn_responses_are_one_action_and_give_grpo():
    torch.manual_seed(0)
    dm = tiny_datamodule()
    module = LVRL(hindsight=TableCritic([[float("nan")]] * 16))  # the critic's entries are never read
    dm.trainer = fake_trainer(module)
    batch = dm.rollout(dm.prompt_batch(0))
    adv = advantages(module, batch).advantages
    grpo = GRPO().compute_advantages(batch).unsqueeze(1) * batch.loss_mask
    torch.testing.assert_close(adv, grpo)
    torch.testing.assert_close(adv[:, 0], group_advantages(batch.rewards, 4) * batch.loss_mask[:, 0])


def test_a_row_the_judge_cannot_read_falls_back_to_linear_interpolation(episodes):
    long_query = " the value after action {step} of {steps} given outcome {outcome:g}:"  # > 64 positions
    module = make(ValueTokenCritic(query=long_query))
    turns = episodes.turns.index
    steps = turn_mask_from_index(turns)
    reading = module.hindsight.values(module, episodes, turns, steps, (0.0, 1.0))
    linear = LinearCritic().values(module, episodes, turns, steps, (0.0, 1.0)).values
    several = steps.sum(dim=1) >= 2
    assert not reading.read[several].any()
    torch.testing.assert_close(reading.values, linear)
    metrics = module.before_update(episodes, advantages(module, episodes), torch.ones(1))
    assert metrics["train/hindsight_fallback"][0] == 1


def test_the_prompted_critic_parses_its_answer_and_falls_back_without_one(episodes):
    assert parse_values("step 1 helps a bit, then most: 0.4, 0.9", 2) == [0.4, 0.9]
    assert parse_values("0.4 then .5 and -1", 3) == [0.4, 0.5, -1.0]
    assert parse_values("only 0.3", 2) is None
    assert parse_values("anything", 0) == []
    module = make(PromptedCritic(template="{trajectory}|{count}:", max_new_tokens=6))
    turns = episodes.turns.index
    steps = turn_mask_from_index(turns)
    reading = module.hindsight.values(module, episodes, turns, steps, (0.0, 1.0))
    linear = LinearCritic().values(module, episodes, turns, steps, (0.0, 1.0)).values
    for row in range(episodes.num_rows):  # the tiny model answers no numbers: every unread row is interpolated
        if not reading.read[row]:
            torch.testing.assert_close(reading.values[row], linear[row])


def test_refusals(episodes):
    with pytest.raises(ValueError, match="reward_range must be"):
        make(reward_range=(1.0, 0.0))
    with pytest.raises(ValueError, match="not single tokens"):
        make(ValueTokenCritic(value_tokens=("0", "10"))).compute_advantages(episodes)
