"""Dynamic sampling as a data-module feature (``group_filter``, ``max_rounds``), the stock ``RewardSpread`` filter
and ``RolloutBatch.concat`` (single- and multi-turn fields)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rl_lightning.algorithms import GRPO
from rl_lightning.rollout import Evaluation, GroupRollout, RewardSpread, RolloutBatch, Sampling, Turns
from tests.conftest import RecordRollouts, tiny_datamodule, tiny_trainer
from tests.rollout.test_batch import _batch


def test_reward_spread_keeps_the_groups_whose_rewards_differ():
    batch = _batch(rewards=torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.25]))  # groups of 2: equal, differ, differ
    assert RewardSpread().keep(batch).tolist() == [False, True, True]
    assert RewardSpread(min_spread=0.3).keep(batch).tolist() == [False, True, False]  # spread 0.25 is not > 0.3
    with pytest.raises(ValueError, match="min_spread"):
        RewardSpread(min_spread=-1.0)


def _assert_same(a: RolloutBatch, b: RolloutBatch) -> None:
    for name in ("input_ids", "attention_mask", "loss_mask", "sampler_logprobs", "rewards", "prompt_index",
                 "truncated", "ref_logprobs"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert set(a.turns.tensors()) == set(b.turns.tensors())
    for name, value in a.turns.tensors().items():
        assert torch.equal(value, getattr(b.turns, name)), name
    assert set(a.record.tensors()) == set(b.record.tensors())
    for name, value in a.record.tensors().items():
        assert torch.equal(value, getattr(b.record, name)), name
    assert a.prompts == b.prompts and a.responses == b.responses and a.prompt_length == b.prompt_length


def test_concat_of_a_batch_split_in_two_is_the_batch():
    whole = _batch()
    parts = [whole.select(torch.arange(0, 2)), whole.select(torch.arange(2, 6))]
    _assert_same(RolloutBatch.concat(parts), whole)
    assert RolloutBatch.concat(parts).group_size == whole.group_size


def test_concat_pads_prompts_left_responses_right_and_turn_fields_with_their_fillers():
    a = RolloutBatch(input_ids=torch.tensor([[7, 8, 1, 2]]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                     prompt_length=2, loss_mask=torch.tensor([[1, 1]]), sampler_logprobs=torch.tensor([[-1.0, -2.0]]),
                     rewards=torch.tensor([1.0]), group_size=1, prompt_index=torch.tensor([0]),
                     truncated=torch.tensor([False]),
                     turns=Turns(obs_mask=torch.tensor([[0, 0]]), index=torch.tensor([[0, 1]]),
                                 count=torch.tensor([2]), rewards=torch.tensor([[0.5, 0.5]])),
                     rollout_time=1.0, env_errors=1, extras={"w": torch.tensor([3.0])})
    b = RolloutBatch(input_ids=torch.tensor([[6, 7, 8, 3, 4, 5]]), attention_mask=torch.ones(1, 6, dtype=torch.long),
                     prompt_length=3, loss_mask=torch.tensor([[1, 0, 1]]),
                     sampler_logprobs=torch.tensor([[-3.0, 0.0, -4.0]]), rewards=torch.tensor([0.0]), group_size=1,
                     prompt_index=torch.tensor([1]), truncated=torch.tensor([True]),
                     turns=Turns(obs_mask=torch.tensor([[0, 1, 0]]), index=torch.tensor([[0, -1, 1]]),
                                 count=torch.tensor([3]), rewards=torch.tensor([[0.0, 0.0, 0.0]])),
                     rollout_time=2.0, extras={"w": torch.tensor([4.0])})
    joined = RolloutBatch.concat([a, b], pad_id=9)
    assert joined.prompt_length == 3
    assert joined.input_ids.tolist() == [[9, 7, 8, 1, 2, 0], [6, 7, 8, 3, 4, 5]]
    assert joined.attention_mask.tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert joined.loss_mask.tolist() == [[1, 1, 0], [1, 0, 1]]
    assert joined.sampler_logprobs.tolist() == [[-1.0, -2.0, 0.0], [-3.0, 0.0, -4.0]]
    assert joined.turns.index.tolist() == [[0, 1, -1], [0, -1, 1]]
    assert joined.turns.obs_mask.tolist() == [[0, 0, 0], [0, 1, 0]]
    assert joined.turns.rewards[0, :2].tolist() == [0.5, 0.5] and math.isnan(joined.turns.rewards[0, 2])
    assert joined.turns.count.tolist() == [2, 3] and joined.extras["w"].tolist() == [3.0, 4.0]
    assert joined.rollout_time == 3.0 and joined.env_errors == 1
    with pytest.raises(ValueError, match="turns is recorded in some"):
        RolloutBatch.concat([a, dataclasses.replace(b, turns=None)])
    with pytest.raises(ValueError, match="group_size"):
        RolloutBatch.concat([_batch(), _batch(group_size=3)])


class _Recording(GroupRollout):
    """GroupRollout that notes every rollout's prompt indices and sampled tokens (each round of a step)."""

    def __init__(self) -> None:
        super().__init__()
        self.rounds: list[tuple[list[int], int]] = []

    def rollout(self, ctx, batch):  # noqa: ANN001, ANN201
        out = super().rollout(ctx, batch)
        if batch.split == "train":
            self.rounds.append((list(batch.indices), int(out.loss_mask.sum())))
        return out


class _Tokens(RecordRollouts):
    """``RecordRollouts`` whose metrics of step k are read when step k + 1 starts (or training ends): the module
    logs ``perf/*`` and the dynamic-sampling metrics after every callback's ``on_train_batch_end``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.rewards.append(batch.rewards.detach().cpu().clone())
        self.prompt_index.append(batch.prompt_index.detach().cpu().clone())
        self.rows.append(batch.num_rows)

    def _read(self, trainer) -> None:  # noqa: ANN001
        if len(self.metrics) < len(self.rows):
            self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self._read(trainer)

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self._read(trainer)


def _data(strategy=None, **overrides):  # noqa: ANN001, ANN003, ANN202
    return tiny_datamodule(group_filter=RewardSpread(), max_rounds=3, strategy=strategy or _Recording(),
                           temperature=1.5, **overrides)


def test_a_step_keeps_groups_with_spread_draws_the_next_prompts_and_counts_every_token(tmp_path):
    """Exact-match rewards on 2-digit sums: many groups are all wrong. Each step rolls out up to 3 draws of the
    prompt stream (SequentialSampler: draw d is prompts 4d .. 4d + 3); it keeps 4 groups, those with a spread
    first; ``perf/sampled_tokens`` is every round's tokens; the next step starts at the next draw."""
    strategy, record = _Recording(), _Tokens()
    data = _data(strategy)
    module = GRPO(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    tiny_trainer(tmp_path, max_steps=3, callbacks=[record]).fit(module, datamodule=data)
    draws = [indices for indices, _ in strategy.rounds]
    assert draws == [list(range(4 * d, 4 * d + 4)) for d in range(len(draws))]  # consecutive, never repeated
    assert data.extra_draws == len(draws) - 3 > 0  # some step drew more than once
    start = 0
    for step, metrics in enumerate(record.metrics):
        rounds = int(metrics["train/sampling_rounds"])
        assert 1 <= rounds <= 3 and record.rows[step] == 16
        assert metrics["perf/sampled_tokens"] == sum(n for _, n in strategy.rounds[start:start + rounds])
        rewards = record.rewards[step].reshape(4, 4)
        spread = (rewards.max(dim=1).values > rewards.min(dim=1).values).tolist()
        assert spread == sorted(spread, reverse=True)  # accepted groups first
        if rounds < 3:
            assert all(spread)  # stopped early: enough accepted groups
        assert sum(spread) / 4 == pytest.approx(1 - metrics["train/zero_std_fraction"])
        assert 0 <= metrics["train/kept_group_fraction"] <= 1
        kept_prompts = set(record.prompt_index[step].tolist())
        assert kept_prompts <= {i for d in draws[start:start + rounds] for i in d}
        start += rounds
    assert start == len(draws)


def test_without_a_filter_nothing_changes_and_max_rounds_is_validated(tmp_path):
    plain = tiny_datamodule()
    assert plain.group_filter is None and plain.take_rollout_metrics() == {}
    with pytest.raises(ValueError, match="max_rounds"):
        tiny_datamodule(max_rounds=0)
    with pytest.raises(ValueError, match="async_rollout.queue"):
        tiny_datamodule(group_filter=RewardSpread(), queue=1)


def test_resume_mid_stream_is_bit_identical(tmp_path):
    def module():  # noqa: ANN202
        torch.manual_seed(0)
        return GRPO(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))

    straight, straight_data = module(), _data()
    tiny_trainer(tmp_path / "a", max_steps=4).fit(straight, datamodule=straight_data)
    first = module()
    trainer = tiny_trainer(tmp_path / "b", max_steps=2)
    trainer.fit(first, datamodule=_data())
    ckpt = tmp_path / "b" / "step2.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed, resumed_data = module(), _data()
    tiny_trainer(tmp_path / "c", max_steps=4).fit(resumed, datamodule=resumed_data, ckpt_path=str(ckpt))
    assert resumed_data.extra_draws == straight_data.extra_draws > 0
    for a, b in zip(straight.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b)


def test_overlong_penalty_on_hand_values():
    from rl_lightning.functional import overlong_penalty

    got = overlong_penalty(torch.tensor([0, 12, 13, 15, 16, 20]), max_tokens=16, cache_tokens=4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]  # free up to 12, then -1/4 per token, -1 from 16
    assert overlong_penalty(torch.tensor([3, 4]), max_tokens=4, cache_tokens=4).tolist() == [-0.75, -1.0]
    with pytest.raises(ValueError, match="cache_tokens"):
        overlong_penalty(torch.tensor([1]), max_tokens=4, cache_tokens=5)


class _Zero:
    """Every response is wrong: no group has a spread in the task's reward."""

    def __call__(self, prompt, response):  # noqa: ANN001, ANN204
        return 0.0


def test_shaping_adds_to_training_rewards_after_the_filter_chose_on_the_task_reward(tmp_path):
    """Task reward 0 everywhere and L_cache = L_max = 4: every response's shaped reward is -|y| / 4, so groups
    would have a spread after shaping; the filter must still see none (it reads the task reward), and the
    batch's rewards are exactly the penalty. Held-out evaluation is not shaped (0, not negative)."""
    from rl_lightning.rollout import OverlongPenalty

    record = _Tokens()
    data = tiny_datamodule(group_filter=RewardSpread(), max_rounds=2, reward_fn=_Zero(), temperature=1.5,
                           reward_shapers=[OverlongPenalty(cache_tokens=4)])
    module = GRPO(model_name_or_path="embedded:arithmetic")
    tiny_trainer(tmp_path, max_steps=1, callbacks=[record]).fit(module, datamodule=data)
    metrics = record.metrics[0]
    assert metrics["train/kept_group_fraction"] == 0.0 and metrics["train/sampling_rounds"] == 2.0
    assert metrics["train/task_reward"] == 0.0 and metrics["train/overlong_penalty"] < 0
    assert metrics["train/reward"] == pytest.approx(metrics["train/overlong_penalty"])
    total, count = data.evaluate()
    assert total == 0.0 and count == 16
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny_datamodule(reward_shapers=[OverlongPenalty(cache_tokens=5)])  # the budget is 4


def test_multi_turn_episodes_are_filled_and_joined_with_their_turn_fields(tmp_path):
    """Guess-the-number, up to 5 turns: rounds of episodes of different lengths are joined by RolloutBatch.concat
    (turns, end states); the step trains on 4 x 4 rows whose fields agree,
    and ``perf/sampled_tokens`` counts every round's model tokens."""
    from rl_lightning.envs import GuessNumberTask
    from rl_lightning.rollout import RolloutDataModule

    class Rounds(GroupRollout):
        def __init__(self) -> None:
            super().__init__(max_turns=5, max_episode_tokens=32)
            self.tokens: list[int] = []

        def rollout(self, ctx, batch):  # noqa: ANN001, ANN201
            out = super().rollout(ctx, batch)
            if batch.split == "train":
                self.tokens.append(int(out.loss_mask.sum()))
            return out

    seen: list[RolloutBatch] = []

    class Keep(_Tokens):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            seen.append(batch)

    strategy, record = Rounds(), Keep()
    data = RolloutDataModule(task=GuessNumberTask(), prompts_per_step=4, group_size=4, strategy=strategy,
                             group_filter=RewardSpread(), max_rounds=3, seed=0,
                             sampling=Sampling(max_new_tokens=3, temperature=1.5),
                             evaluation=Evaluation(batch_size=8))
    module = GRPO(model_name_or_path="embedded:guess")
    tiny_trainer(tmp_path, max_steps=2, callbacks=[record]).fit(module, datamodule=data)
    assert len(strategy.tokens) > 2  # some step drew more than one round
    start = 0
    for step, batch in enumerate(seen):
        rounds = int(record.metrics[step]["train/sampling_rounds"])
        assert batch.num_rows == 16 and batch.turns is not None
        assert record.metrics[step]["perf/sampled_tokens"] == sum(strategy.tokens[start:start + rounds])
        start += rounds
        for row in range(batch.num_rows):  # each row's turn fields still describe its own tokens
            generated = batch.turns.index[row][batch.loss_mask[row].bool()]
            assert int(generated.max()) + 1 == int(batch.turns.count[row])
            assert bool((batch.turns.index[row][~batch.loss_mask[row].bool()] == -1).all())
        assert torch.allclose(torch.nan_to_num(batch.turns.rewards).sum(dim=1), batch.rewards)
