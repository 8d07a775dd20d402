"""``LossTerm``: the callback base class that adds a term to every policy loss (``KLRegularizer``)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback
from torch import Tensor

from rl_lightning.algorithms.metrics import Metrics
from rl_lightning.rollout.batch import RolloutBatch


class LossTerm(Callback):
    """A callback that adds a term to every policy loss (e.g. ``KLRegularizer``): every ``LossTerm`` among the
    Trainer's callbacks takes part in every update.

    ``loss_term`` (to implement) is called once per micro-batch with the learner's ``logprobs`` ``[n, T]``
    (carrying the gradient) and the aggregation ``weights`` ``[n, T]`` of those rows; it returns the term to *add*
    to the loss and its metrics (``metrics.TokenMean``/``Summed`` values, or plain tensors averaged over
    micro-batches). ``prepare`` and ``contributes`` have defaults; override them where the term needs to.
    """

    def prepare(self, module: Any, batch: RolloutBatch) -> RolloutBatch:
        """Once per rollout batch, before the advantages: the batch the step uses (a new one through
        ``dataclasses.replace``, e.g. with ``ref_logprobs``). Default: ``batch`` as it is."""
        return batch

    def contributes(self, module: Any) -> bool:
        """``False`` promises the term is exactly zero with zero gradient this update (``beta = 0``), so rows the
        method finds inert may still be skipped. The answer must be the same on every rank. Default: ``True``."""
        return True

    def loss_term(self, module: Any, batch: RolloutBatch, logprobs: Tensor,
                  weights: Tensor) -> tuple[Tensor, Metrics]:
        """The term to add to the micro-batch's loss, and its metrics."""
        raise NotImplementedError(f"{type(self).__name__} is a LossTerm without a loss_term method")
