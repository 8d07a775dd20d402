"""REINFORCE plus a KL to the sampler on its recorded top-k head: ``RLModule.extra_logprob_ids`` at work."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms import REINFORCE, PolicyOutput
from rl_lightning.functional import aggregate
from rl_lightning.rollout import RolloutBatch


class HeadKL(REINFORCE):
    """REINFORCE + ``coef · Σ_{a∈H} q_a (log q_a - log p_a)`` per token, ``H`` the sampler's top-k ids."""

    summed_metrics = REINFORCE.summed_metrics | {"train/head_kl_loss"}  # a share of the step's loss

    def __init__(self, head_kl_coef: float = 0.1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.head_kl_coef = head_kl_coef

    @override
    def check_datamodule(self, datamodule: Any) -> None:
        self.require_data_setting(datamodule, "record_topk", "the sampler's top-k head")

    @override
    def extra_logprob_ids(self, batch: RolloutBatch) -> Tensor | None:
        return batch.topk_ids  # -> out.extra_logprobs [n, T, k], from the same forward, with gradient

    @override
    def policy_loss(self, batch: RolloutBatch, out: PolicyOutput, advantages: Tensor,
                    weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        loss, stats = super().policy_loss(batch, out, advantages, weights)
        q_log = batch.topk_logprobs
        kl = (q_log.exp() * (q_log - out.extra_logprobs)).sum(-1) * batch.loss_mask
        term = self.head_kl_coef * aggregate(kl, weights)
        return loss + term, {**stats, "train/head_kl_loss": term.detach()}
