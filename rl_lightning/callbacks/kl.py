"""``KLRegularizer``: adds ``β · KL`` to every policy loss, toward a frozen reference model or the sampler."""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn

from rl_lightning.algorithms.base import RLModule
from rl_lightning.algorithms.metrics import Metrics, Summed, TokenMean
from rl_lightning.algorithms.protocols import LossTerm
from rl_lightning.functional import KLKind, aggregate, kl_estimate
from rl_lightning.rollout.batch import RolloutBatch


class KLRegularizer(LossTerm):
    """A KL penalty for any method, a ``LossTerm`` callback (``RLModule`` adds its term to every policy loss).

    The term is ``β · Σ_{i,t} w_{i,t} k_{i,t}`` with the method's own aggregation weights ``w`` and a per-token
    estimator ``k`` (k1/k2/k3 of ``functional.kl_estimate``) evaluated at the generated tokens, in the
    direction each target calls for:

    * ``reference``: ``KL(π_θ || π_ref)`` estimated at tokens from ``π_old ≈ π_θ``,
      ``k = kl_estimate(logπ_θ, logπ_ref)`` (GRPO's KL-in-the-loss, Shao et al. 2024, arXiv 2402.03300, eq. 3;
      k3 by default);
    * ``sampler``: ``KL(q || π_θ)`` at tokens drawn from the sampler ``q``, ``k = kl_estimate(log q, logπ_θ)``;
      with k1 that is ``log q - logπ_θ``, Tinker's regulariser of its ``stable_reinforce`` loss
      (docs/algorithms.md, StableReinforce), which pulls the learner toward the sampler. Its expected gradient is
      ``∇ KL(q || π_θ)`` for k1 and k3.

    Args:
        beta: coefficient β; with ``0`` nothing is computed and no reference model is created.
        estimator: ``k3`` (GRPO's default), ``k2`` or ``k1``.
        target: ``reference`` = a frozen copy of the initial policy (reloaded from ``model_name_or_path``,
            so it is the same after a resume); ``sampler`` = the sampler's recorded log-probs (no extra model).

    Logs ``train/kl`` (the token-mean estimate) and ``train/kl_loss`` (the term added).
    """

    def __init__(self, beta: float = 0.0, estimator: KLKind = "k3",
                 target: Literal["reference", "sampler"] = "reference") -> None:
        if beta < 0:
            raise ValueError(f"KLRegularizer: beta must be >= 0, got {beta}")
        self.beta = beta
        self.estimator = estimator
        self.target = target
        self.reference: nn.Module | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(target=self.target, estimator=self.estimator)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not isinstance(pl_module, RLModule):
            raise TypeError(f"KLRegularizer needs an RLModule, got {type(pl_module).__name__}")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.beta > 0 and self.target == "reference" and self.reference is None:
            self.reference = pl_module.load_frozen_copy()  # type: ignore[operator]

    def prepare(self, module: RLModule, batch: RolloutBatch) -> RolloutBatch:
        """``LossTerm.prepare``: the batch with the reference model's log-probs (``ref_logprobs``), once per
        rollout batch, shared by all iterations and minibatches."""
        if self.reference is None:
            return batch
        with torch.no_grad():
            return replace(batch, ref_logprobs=module.token_logprobs(batch, model=self.reference)[0])

    def contributes(self, module: RLModule) -> bool:
        """``LossTerm.contributes``: with ``beta = 0`` the term is exactly zero, so it never keeps a row
        that the method finds inert from being skipped."""
        return self.beta != 0

    def loss_term(
        self, module: RLModule, batch: RolloutBatch, logprobs: Tensor, weights: Tensor
    ) -> tuple[Tensor, Metrics]:
        if self.beta == 0:
            return logprobs.new_zeros(()), {}
        other = batch.sampler_logprobs if self.target == "sampler" else batch.ref_logprobs
        if other is None:
            raise RuntimeError("KLRegularizer: reference log-probs missing from the batch")
        if self.target == "sampler":  # KL(q || p_θ) at tokens drawn from q: k1 = log q - log p_θ (Tinker)
            kl = kl_estimate(other.detach(), logprobs, self.estimator)
        else:  # KL(p_θ || π_ref) at tokens drawn from π_old ≈ p_θ (GRPO)
            kl = kl_estimate(logprobs, other.detach(), self.estimator)
        kl = kl * batch.loss_mask  # [n, T]
        term = self.beta * aggregate(kl, weights)
        with torch.no_grad():
            mean_kl = kl.sum() / batch.loss_mask.sum().clamp(min=1)
        return term, {"train/kl": TokenMean(mean_kl), "train/kl_loss": Summed(term.detach())}
