"""CoPE: GRPO plus forecasting of successful action chunks on the shared backbone (docs/algorithms.md, CoPE).

``L = L_GRPO + η · E_x[L_AF,x]``, ``L_AF,x = -Σ_{τ∈S_x} Σ_t log p_θ(a_{t:t+K} | h_t) / max(1, |S_x|)``: for
every action ``t`` of every successful trajectory (reward ``>= success_threshold``), the policy is asked, after
the history ``h_t`` and a forecast instruction, for the next ``K`` recorded actions (fewer at the episode's end),
teacher-forced through ``RLModule.score_sequences`` (a second forward, with gradient). Acting is unchanged: the
instruction is only ever in the forecasting forward. The AF term is not weighted by ratios or advantages.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.base import Metrics, PolicyOutput
from rl_lightning.algorithms.metrics import Summed
from rl_lightning.algorithms.grpo import GRPO
from rl_lightning.functional import forecast_loss, forecast_pairs, forecast_weights
from rl_lightning.rollout.batch import RolloutBatch

#: ``Advantages.rows`` key of the per-row AF weights, fixed once per rollout batch in ``compute_advantages``
WEIGHT_KEY = "forecast_weight"


class CoPE(GRPO):
    """GRPO with an action-forecasting NLL on the successful trajectories of each group.

    Args:
        forecast_coef: η, the weight of ``E_x[L_AF,x]`` (0 gives GRPO, and skips the forecasting forward). The
            default 0.001 was chosen on reach-the-target's validation split; at 0.01 and 0.1 the forecasting
            gradient dominated the update (docs/algorithms.md#cope).
        forecast_horizon: K, actions per forecast chunk.
        success_threshold: a trajectory is successful when its reward is ``>=`` this.
        forecast_instruction: text appended after ``h_t`` (encoded once, no special tokens); the policy's
            tokenizer must encode it without unknown tokens.
        instruction_first: put the instruction before ``h_t`` instead (a leading instruction).
        **kwargs: ``GRPO`` arguments (clipping, model, optimizer, aggregation, ...).
    """

    #: the forecasting term is not zero on a zero-advantage row (a group that all succeeded)
    zero_advantage_rows_are_inert = False

    def __init__(
        self,
        forecast_coef: float = 0.001,
        forecast_horizon: int = 2,
        success_threshold: float = 1.0,
        forecast_instruction: str = "forecast:",
        instruction_first: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_settings(self, [("forecast_coef", forecast_coef, forecast_coef >= 0, "must be >= 0"),
                              ("forecast_horizon", forecast_horizon, forecast_horizon >= 1, "must be >= 1")])
        self.forecast_coef = forecast_coef
        self.forecast_horizon = forecast_horizon
        self.success_threshold = success_threshold
        self.instruction_ids = self._encode_instruction(forecast_instruction)
        self.instruction_first = instruction_first

    def _encode_instruction(self, text: str) -> list[int]:
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        unk = self.tokenizer.unk_token_id
        if not ids or (unk is not None and unk in ids):
            unknown = [ch for ch in dict.fromkeys(text)
                       if unk in self.tokenizer(ch, add_special_tokens=False)["input_ids"]]
            why = f"{''.join(unknown)!r} map to the unknown token" if ids else "it encodes to no tokens"
            raise ValueError(f"CoPE: forecast_instruction {text!r} cannot be encoded by the policy's tokenizer "
                             f"({why}); use text it knows, e.g. 'forecast:'")
        return ids

    @override
    def compute_advantages(self, batch: RolloutBatch) -> Advantages:
        """GRPO's advantages with the rows' AF weights (``forecast_weights``, ``E_x`` over every prompt of every
        rank) in ``Advantages.rows``, so micro-batches, minibatches and devices only slice them."""
        prompts = self.ranks.sum(torch.tensor(float(batch.num_rows // batch.group_size), device=batch.rewards.device))
        weights = forecast_weights(batch.rewards, batch.group_size, self.success_threshold, float(prompts))
        weights = weights * self.ranks.world_size  # cancels DDP's gradient averaging, like loss_weights
        return Advantages(super().compute_advantages(batch), rows={WEIGHT_KEY: weights})

    @override
    def extra_losses(self, batch: RolloutBatch, out: PolicyOutput, adv: Advantages,
                     weights: Tensor) -> list[tuple[Tensor, Metrics]]:
        term = self.forecast_term(batch, adv)
        return [(term, {"train/forecast_loss": Summed(term.detach())})]

    def forecast_term(self, batch: RolloutBatch, adv: Advantages) -> Tensor:
        """``η · Σ_{i in rows} w_i Σ_t -log p(a_{t:t+K} | h_t, instruction)`` of ``batch``'s rows (their share of
        ``η · E_x[L_AF,x]``), scaled by ``num_minibatches`` as the base scales the policy weights."""
        if WEIGHT_KEY not in adv.rows:
            raise RuntimeError(f"CoPE: Advantages.rows[{WEIGHT_KEY!r}] is missing; compute_advantages sets it")
        row_weights = adv.rows[WEIGHT_KEY] * self.num_minibatches
        rows = (row_weights > 0).nonzero().flatten().tolist() if self.forecast_coef > 0 else []
        contexts, targets, owners = [], [], []
        for row in rows:
            turns = None if batch.turns is None else batch.turns.index[row]
            for context, target in forecast_pairs(batch.input_ids[row], batch.attention_mask[row],
                                                  batch.prompt_length, batch.loss_mask[row], turns,
                                                  self.instruction_ids, self.forecast_horizon,
                                                  self.instruction_first):
                contexts.append(context)
                targets.append(target)
                owners.append(row)
        if not contexts:
            return row_weights.new_zeros(())
        self._check_length(max(len(c) + len(t) for c, t in zip(contexts, targets)))
        scored, mask = self.score_sequences(contexts, targets)
        pair_weights = row_weights[torch.tensor(owners, device=row_weights.device)]
        return self.forecast_coef * forecast_loss(scored.logprobs, mask, pair_weights)

    def _check_length(self, longest: int) -> None:
        limit = getattr(self.policy.config, "max_position_embeddings", None)
        if limit is not None and longest > limit:
            raise ValueError(f"CoPE: a forecast sequence (history + instruction + {self.forecast_horizon} actions) "
                             f"has {longest} tokens, more than the policy's {limit} positions; shorten "
                             "forecast_instruction or forecast_horizon, or the episodes")

    @override
    def rollout_metrics(self, batch: RolloutBatch) -> dict[str, Tensor]:
        success = (batch.rewards >= self.success_threshold).float().mean()
        return {**super().rollout_metrics(batch), "train/success_fraction": success}
