"""REINFORCE plus a KL to the sampler on its recorded top-k head: ``RLModule.extra_logprob_ids`` and
``RLModule.extra_losses`` at work."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms import REINFORCE, Advantages, PolicyOutput, Summed
from rl_lightning.functional import aggregate
from rl_lightning.rollout import RolloutBatch


class HeadKL(REINFORCE):
    """REINFORCE + ``coef · Σ_{a∈H} q_a (log q_a - log p_a)`` per token, ``H`` the sampler's top-k ids."""

    #: the KL term reaches every row, zero advantage or not: no row is inert
    zero_advantage_rows_are_inert = False

    def __init__(self, head_kl_coef: float = 0.1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.head_kl_coef = head_kl_coef

    @override
    def check_datamodule(self, datamodule: Any) -> None:
        self.require_data_setting(datamodule, "record.topk", "the sampler's top-k head")

    @override
    def extra_logprob_ids(self, batch: RolloutBatch) -> Tensor | None:
        return batch.record.topk_ids  # -> out.extra_logprobs [n, T, k], from the same forward, with gradient

    @override
    def extra_losses(self, batch: RolloutBatch, out: PolicyOutput, adv: Advantages,
                     weights: Tensor) -> list[tuple[Tensor, dict]]:
        q_log = batch.record.topk_logprobs
        kl = (q_log.exp() * (q_log - out.extra_logprobs)).sum(-1) * batch.loss_mask
        term = self.head_kl_coef * aggregate(kl, weights)
        return [(term, {"train/head_kl_loss": Summed(term.detach())})]  # Summed: a share of the step's loss
