"""EasyPPO (arXiv 2609.36802; reference code ``EasyPPO/EasyPPO``; docs/algorithms.md, EasyPPO): PPO with three
changes to how the critic and the actor see the batch.

* **Actor-only truncation filter**: ``C_i = 1`` when response ``i`` finished within the length limit; the actor's
  advantages are multiplied by ``C_i`` (a truncated response has exactly zero actor gradient), while every rollout
  still trains the critic, which so learns ``E[R | s]`` rather than ``E[R | s, C = 1]``.
* **Noise-weighted critic loss**: each row's value loss is weighted by its prompt's
  ``w_x = 1 / max(Var_pop(R_x)^β, w_min)``, normalised to mean 1 over the batch (``functional.variance_weights``,
  the reference's parametrisation; β = 0.5, ``w_min = 0.25``): high-variance prompts count less, their targets
  unchanged.
* **Smaller critic minibatches**: the critic is trained in its own passes of ``critic_minibatches`` minibatches
  (the reference: 4 per rollout batch), each gradient clipped to ``critic_max_grad_norm`` (``CriticLearner``'s
  schedule), so an outlier suppresses only its own minibatch through the shared rescaling.

The actor keeps PPO's clipped objective. A critic-only warm-up (the reference: 30 steps) is the ``CriticWarmup``
callback; ``configs/easyppo.yaml`` uses it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.checks import check_settings
from rl_lightning.algorithms.critic import VALUE_WEIGHTS
from rl_lightning.algorithms.ppo import PPO
from rl_lightning.functional import variance_weights
from rl_lightning.rollout.batch import RolloutBatch


class EasyPPO(PPO):
    """PPO with the actor-only truncation filter, noise-weighted critic loss and small clipped critic minibatches.

    Args:
        w_min: the floor on ``Var^β`` (the reference's; at β = 0.5 a floor on the standard deviation: its shipped
            0.25 is a variance floor of 0.0625, so for 0/1 rewards, ``σ ≤ 0.5``, the weights span at most 2x).
        variance_beta: β of ``w = 1 / max(Var^β, w_min)``.
        filter_truncated: apply ``C_i`` to the actor (``False``: every response trains the actor, as PPO).
        critic_updates, critic_minibatches, critic_max_grad_norm: the CriticLearner's schedule; the defaults are the
            reference's (one critic pass of 4 minibatches per rollout batch, each clipped to norm 1).
        **kwargs: ``PPO`` arguments. Needs ``data.group_size >= 2`` (a prompt's reward variance).

    Logs ``train/kept_for_actor`` (the fraction of rows with ``C_i = 1``) and ``train/value_weight_max``.
    """

    min_group_size = 2

    def __init__(self, w_min: float = 0.25, variance_beta: float = 0.5, filter_truncated: bool = True,
                 critic_updates: int = 1, critic_minibatches: int = 4, critic_max_grad_norm: float | None = 1.0,
                 **kwargs: Any) -> None:
        super().__init__(critic_updates=critic_updates, critic_minibatches=critic_minibatches,
                         critic_max_grad_norm=critic_max_grad_norm, **kwargs)
        check_settings(self, [("w_min", w_min, w_min > 0, "must be > 0"),
                              ("variance_beta", variance_beta, variance_beta >= 0, "must be >= 0")])
        self.w_min, self.variance_beta = float(w_min), float(variance_beta)
        self.filter_truncated = filter_truncated

    @override
    def compute_advantages(self, batch: RolloutBatch) -> Advantages:
        """PPO's GAE over every row (the critic's returns keep them all), ``C_i`` on the actor's advantages only, and
        each row's ``w_x`` (``functional.variance_weights``) as the value loss's row weights."""
        adv = super().compute_advantages(batch)
        advantages = adv.advantages
        if self.filter_truncated:
            advantages = advantages * (~batch.truncated).to(advantages.dtype).unsqueeze(-1)  # C_i on the actor only
        weights = variance_weights(batch.rewards.float(), batch.group_size, self.w_min, self.variance_beta)
        return replace(adv, advantages=advantages, rows={**adv.rows, VALUE_WEIGHTS: weights})

    @override
    def after_update(self, batch: RolloutBatch, adv: Advantages) -> dict[str, list[Tensor]]:
        return {"train/kept_for_actor": [(~batch.truncated).float().mean()],
                "train/value_weight_max": [adv.rows[VALUE_WEIGHTS].float().max()]}
