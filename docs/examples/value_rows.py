"""GRPO plus a value-token critic trained on auxiliary rows: ``RLModule.auxiliary_rows`` at work."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms import GRPO, Advantages, AuxiliaryRows, PolicyOutput, Summed
from rl_lightning.algorithms.forward import sequences_batch
from rl_lightning.algorithms.planning import rollout_weights
from rl_lightning.functional import aggregate
from rl_lightning.rollout import RolloutBatch


class ValueRowsGRPO(GRPO):
    """GRPO + ``value_coef · mean_G(-log π(v_G | prompt + query))``: one extra row per group, the prompt and
    ``query`` followed by ``v_G``, the digit of the group's mean reward on the grid ``"0".."9"`` over [0, 1]."""

    def __init__(self, value_coef: float = 0.1, query: str = " V:", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.value_coef, self.query = value_coef, query

    @override
    def auxiliary_rows(self, batch: RolloutBatch, adv: Advantages) -> list[AuxiliaryRows]:
        tok, g, p = self.tokenizer, batch.group_size, batch.prompt_length
        query = tok(self.query, add_special_tokens=False)["input_ids"]
        contexts, targets = [], []
        for k, mean in enumerate(batch.rewards.view(-1, g).mean(dim=1).clamp(0, 1).tolist()):
            prompt = batch.input_ids[k * g, :p][batch.attention_mask[k * g, :p].bool()].tolist()
            contexts.append(prompt + query)
            targets.append(tok(str(round(mean * 9)), add_special_tokens=False)["input_ids"])
        rows = sequences_batch(contexts, targets, None, tok.pad_token_id, 1.0, batch.input_ids.device)
        weights = rollout_weights(rows, "token_mean", self.ranks) * self.value_coef  # over every rank's rows
        return [AuxiliaryRows(rows, weights, self.value_loss)]

    def value_loss(self, rows: RolloutBatch, out: PolicyOutput, weights: Tensor) -> tuple[Tensor, dict]:
        term = aggregate(-out.logprobs, weights)  # the value token's cross-entropy
        return term, {"train/value_token_loss": Summed(term.detach())}
