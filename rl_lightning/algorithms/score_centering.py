"""Score Centering (Marek & Ryabinin 2026, "Score Centering Stabilizes Off-policy Reinforcement Learning", arXiv
2609.20807; reference implementation ``vllm-project/vime``; docs/algorithms.md, Score Centering): REINFORCE whose
score is centred by the sampler's expected score, so that the update off-policy keeps only ``Cov_q(A, ψ)`` (no
drift term).

Per generated token, with ``H`` the sampler's recorded top-k ids (``data.record.topk``), ``q`` the sampler's and
``p`` the learner's full-vocabulary probabilities, ``ρ = (1 - Σ_H q) / (1 - Σ_H p)`` (both clamped at 1e-6)::

    ℓ_t = -sg(A) [ sg(w_a) log p_a - Σ_{v∈H} sg(q_v w_v - ρ_w p_v) log p_v ]

``w ≡ 1`` and ``ρ_w = ρ`` by default; with ``importance_cap = C`` the importance-weighted variant
``w = min(p/q, C)``, ``ρ_w = ρ min(1/ρ, C)`` centres ``w ψ`` instead (``functional.score_centered_loss``).
The learner's log-probs at the head ids come from the same forward as the sampled tokens'
(``RLModule.extra_logprob_ids``). Advantages, baseline and aggregation are REINFORCE's.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.base import Metrics, PolicyOutput
from rl_lightning.algorithms.metrics import TokenMean
from rl_lightning.algorithms.pg import Baseline, PolicyGradient, score_metrics
from rl_lightning.functional import head_mass, masked_mean, score_centered_loss, tail_ratio
from rl_lightning.functional.centering import TAIL_EPS
from rl_lightning.rollout.batch import RolloutBatch


class ScoreCentering(PolicyGradient):
    """REINFORCE with top-k score centering (needs ``data.record.topk >= 1``; ``min(8, V)`` on a tiny vocabulary).

    The reference implementations use it with a REINFORCE loss only (not combinable with PPO-style clipping), so
    it is a ``PolicyGradient`` with REINFORCE's default EMA baseline: ``baseline``, ``ema_decay`` and
    ``loss_aggregation`` mean what they mean there. Logged besides REINFORCE's metrics: ``train/head_mass`` (token
    mean of ``Σ_H q``, how much of the sampler the head covers) and ``train/tail_ratio`` (token mean of ``ρ``; 1
    on-policy).

    Args:
        importance_cap: ``None``: ``w ≡ 1`` (the plain correction); ``C > 0``: the importance-weighted variant with
            ``w = min(p/q, C)`` (truncated importance sampling, centred).
        tail_eps: the clamp of ``1 - Σ_H q`` and ``1 - Σ_H p`` in the tail ratio.
        **kwargs: ``PolicyGradient`` arguments (``tis_cap`` is refused: use ``importance_cap``, which centres the
            weighted score).
    """


    def __init__(self, importance_cap: float | None = None, tail_eps: float = TAIL_EPS, baseline: Baseline = "ema",
                 **kwargs: Any) -> None:
        super().__init__(baseline=baseline, **kwargs)
        check_settings(self, [
            ("importance_cap", importance_cap, importance_cap is None or importance_cap > 0, "must be > 0 or null"),
            ("tail_eps", tail_eps, tail_eps > 0, "must be > 0"),
            ("tis_cap", self.tis_cap, self.tis_cap is None, "must be null (it would weight the score without centring "
             "the weights; use importance_cap, the importance-weighted centring)")])
        self.importance_cap = importance_cap
        self.tail_eps = tail_eps

    @override
    def check_datamodule(self, datamodule: Any) -> None:
        self.require_data_setting(datamodule, "record.topk", "the sampler's top-k ids and log-probs")

    @override
    def extra_logprob_ids(self, batch: RolloutBatch) -> Tensor | None:
        return batch.record.topk_ids

    @override
    def policy_loss(self, batch: RolloutBatch, out: PolicyOutput, adv: Advantages,
                    weights: Tensor) -> tuple[Tensor, Metrics]:
        advantages = adv.advantages
        if batch.record.topk_logprobs is None or out.extra_logprobs is None:
            raise RuntimeError("ScoreCentering: the batch has no recorded top-k (data.init_args.record.topk)")
        loss, stats = score_centered_loss(
            out.logprobs, out.extra_logprobs, batch.sampler_logprobs, batch.record.topk_logprobs, advantages,
            batch.loss_mask, weights, self.importance_cap, self.tail_eps,
        )
        rho = tail_ratio(out.extra_logprobs, batch.record.topk_logprobs, self.tail_eps)
        head = head_mass(batch.record.topk_logprobs, batch.loss_mask)
        return loss, {
            **score_metrics(stats), "train/head_mass": TokenMean(head),
            "train/tail_ratio": TokenMean(masked_mean(rho, batch.loss_mask)),
        }
