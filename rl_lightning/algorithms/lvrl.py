"""LVRL: a frozen hindsight critic splits each episode's outcome over its actions (no paper or reference code
found: docs/algorithms.md, LVRL).

A frozen critic (``hindsight.HindsightCritic``) reads the completed episode and gives ``Ṽ_t`` at the boundaries
between its ``T`` actions; anchored at ``Ṽ_0 = R̄_G`` (the group's mean reward) and ``Ṽ_T = R``:

    Ā_t = Ṽ_{t+1} - Ṽ_t,    Σ_t Ā_t = R - R̄_G,    A_t = Ā_t / (σ_G + eps)

with ``σ_G`` the population std of every step ``Ā_t`` of the group (``functional.anchored_credit``,
``group_step_normalized``). Every token of action ``t`` gets ``A_t``; observation tokens get none
(``functional.turn_token_advantages`` over ``RolloutBatch.turns.index``). The loss is GRPO's clipped surrogate on
these per-token advantages. A single-turn response is one action, and LVRL is then exactly GRPO. Not validated
at scale.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.grpo import GRPO
from rl_lightning.algorithms.hindsight import HindsightCritic, ValueTokenCritic
from rl_lightning.functional import (
    anchored_credit, group_step_normalized, group_step_std, interpolated_values, turn_mask_from_index,
    turn_token_advantages,
)
from rl_lightning.rollout.batch import RolloutBatch

#: ``Advantages.rows`` keys of the per-row quantities ``before_update`` turns into the step's credit metrics
FALLBACK, DEPARTURE, BOUNDARIES, STEP_STD = "hindsight_fallback", "hindsight_departure", "boundaries", "step_std"


class LVRL(GRPO):
    """GRPO on per-action advantages from a frozen hindsight critic, anchored to the outcome (needs
    ``data.group_size >= 2``).

    Args:
        hindsight: the frozen critic (``class_path``: ``rl_lightning.algorithms.hindsight.ValueTokenCritic``,
            ``LinearCritic`` or ``PromptedCritic``); ``None``: ``ValueTokenCritic()``, the frozen starting policy
            reading a grid of value tokens.
        reward_range: ``[R_min, R_max]``: the critic's values are clamped to it (this package's choice) and
            its value grid spans it.
        scale_rewards: divide the credit by the group-wide step std ``σ_G`` (LVRL's); ``False`` keeps ``Ā_t``.
        std_eps: added to ``σ_G``; a group whose steps are all equal (all 0) gets 0.
        **kwargs: ``GRPO`` arguments (clipping, model, optimizer, aggregation, ...).
    """

    #: GRPO's ``-Σ w · min(ρA, clip(ρ)A)`` on per-token advantages: a row whose every token has ``A = 0`` adds
    #: exactly 0 with zero gradient (``RLModule.inert_rows``)
    zero_advantage_rows_are_inert = True

    def __init__(self, hindsight: HindsightCritic | None = None, reward_range: tuple[float, float] = (0.0, 1.0),
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_settings(self, [("reward_range", reward_range, len(reward_range) == 2
                               and reward_range[0] < reward_range[1], "must be [R_min, R_max] with R_min < R_max")])
        self.hindsight = ValueTokenCritic() if hindsight is None else hindsight
        self.reward_range = (float(reward_range[0]), float(reward_range[1]))

    def action_index(self, batch: RolloutBatch) -> Tensor:
        """``[N, T]`` the action of every generated token (-1 elsewhere): the batch's ``turns.index``; a single-turn
        response is action 0."""
        if batch.turns is not None:
            return batch.turns.index
        return torch.where(batch.loss_mask.bool(), 0, -1)

    @override
    def compute_advantages(self, batch: RolloutBatch) -> Advantages:
        """``[N, T]`` per-token advantages ``A_{turn(j)}`` (see the module docstring), with per-row credit metrics
        in ``Advantages.rows``."""
        turns = self.action_index(batch)
        steps = turn_mask_from_index(turns)  # [N, K]: the rows' T_b actions
        reading = self.hindsight.values(self, batch, turns, steps, self.reward_range)
        values = reading.values.float().clamp(*self.reward_range)
        rewards, group = batch.rewards.float(), batch.group_size
        credit = anchored_credit(values, rewards, group, steps)  # Ā_t, Σ_t Ā_t = R - R̄_G
        scaled = group_step_normalized(credit, group, steps, self.std_eps) if self.scale_rewards else credit
        rows = self._credit_rows(values, rewards, group, steps, credit, reading.read)
        return Advantages(turn_token_advantages(scaled, turns), rows=rows)

    @staticmethod
    def _credit_rows(values: Tensor, rewards: Tensor, group_size: int, steps: Tensor, credit: Tensor,
                     read: Tensor) -> dict[str, Tensor]:
        """Per row: whether it fell back, its boundaries ``T_b - 1``, the summed ``|Ṽ_t - Ṽ_t^lin|`` over them, and
        ``σ_G`` of its group (before normalising)."""
        count = steps.sum(dim=1)
        t = torch.arange(steps.shape[1], device=steps.device)
        inner = (t > 0) & (t < count.unsqueeze(1))  # the boundaries the critic valued
        linear = interpolated_values(rewards, group_size, steps)
        return {FALLBACK: ((~read) & (count >= 2)).float(), BOUNDARIES: inner.sum(dim=1).float(),
                DEPARTURE: torch.where(inner, (values - linear).abs(), torch.zeros_like(linear)).sum(dim=1),
                STEP_STD: group_step_std(credit, group_size, steps)}

    @override
    def before_update(self, batch: RolloutBatch, adv: Advantages, weights: Tensor) -> dict[str, list[Tensor]]:
        """The credit metrics of the whole rollout batch (``train/hindsight_fallback``, ``train/hindsight_departure``,
        ``train/step_credit_std``)."""
        rows, judged = adv.rows, adv.rows[BOUNDARIES] > 0
        judged_rows = judged.float().sum().clamp(min=1)
        return {**super().before_update(batch, adv, weights),
                "train/hindsight_fallback": [rows[FALLBACK].sum() / judged_rows],
                "train/hindsight_departure": [rows[DEPARTURE].sum() / rows[BOUNDARIES].sum().clamp(min=1)],
                "train/step_credit_std": [rows[STEP_STD].mean()]}
