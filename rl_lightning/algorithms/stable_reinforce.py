"""StableReinforce (Tinker's ``stable_reinforce`` loss, formula unpublished; this is Martin Marek's
reverse-engineered form, docs/algorithms.md, StableReinforce): REINFORCE with Monte-Carlo score centring.

At every generated position the sampler also drew ``K`` auxiliary tokens ``u_k ~ q(·|s)``, independent of the
sampled ``a`` (``data.record.aux_draws``, K = 8). The loss per token is::

    ℓ_t = -sg(A) [ log p(a_t|s_t) - 1/K Σ_k log p(u_k|s_t) ]

whose logit gradient ``-A (e_a - 1/K Σ_k e_{u_k})`` is sparse (only the drawn tokens) and, averaged over the
draws, the exact score-centred ``-A (e_a - q)`` (``functional.mc_centered_loss``). Tinker's optional KL to the
sampler, ``β Σ_t (log q - log p)`` (k1; k3 available), is the ``KLRegularizer(target="sampler")`` callback.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.base import Metrics, PolicyOutput
from rl_lightning.algorithms.pg import Baseline, PolicyGradient, score_metrics
from rl_lightning.functional import mc_centered_loss
from rl_lightning.rollout.batch import RolloutBatch


class StableReinforce(PolicyGradient):
    """REINFORCE centred by the learner's mean score at ``K`` auxiliary sampler draws (needs
    ``data.record.aux_draws >= 1``).

    ``baseline`` (REINFORCE's EMA by default), ``ema_decay`` and ``loss_aggregation`` are ``PolicyGradient``'s. The
    learner's log-probs at the draws come from the same forward as the sampled tokens'
    (``RLModule.extra_logprob_ids``).

    Args:
        **kwargs: ``PolicyGradient`` arguments (``tis_cap`` is refused: the centring would not see the weights).
    """


    def __init__(self, baseline: Baseline = "ema", **kwargs: Any) -> None:
        super().__init__(baseline=baseline, **kwargs)
        check_settings(self, [("tis_cap", self.tis_cap, self.tis_cap is None,
                               "must be null (the Monte-Carlo centring is unweighted)")])

    @override
    def check_datamodule(self, datamodule: Any) -> None:
        self.require_data_setting(datamodule, "record.aux_draws", "K auxiliary draws per position")

    @override
    def extra_logprob_ids(self, batch: RolloutBatch) -> Tensor | None:
        return batch.record.aux_ids

    @override
    def policy_loss(self, batch: RolloutBatch, out: PolicyOutput, adv: Advantages,
                    weights: Tensor) -> tuple[Tensor, Metrics]:
        advantages = adv.advantages
        if batch.record.aux_ids is None or out.extra_logprobs is None:
            raise RuntimeError("StableReinforce: the batch has no auxiliary draws (data.init_args.record.aux_draws)")
        loss, stats = mc_centered_loss(out.logprobs, out.extra_logprobs, advantages, batch.loss_mask, weights)
        return loss, score_metrics(stats)
