"""``LossTerm``: what a callback implements to add a term to every policy loss (``KLRegularizer``)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from rl_lightning.algorithms.metrics import Metrics
from rl_lightning.rollout.batch import RolloutBatch


@runtime_checkable
class LossTerm(Protocol):
    """What a callback implements to add a term to every policy loss (e.g. ``KLRegularizer``).

    ``loss_term`` is called once per micro-batch with the learner's ``logprobs`` ``[n, T]`` (carrying the
    gradient) and the aggregation ``weights`` ``[n, T]`` of those rows; it returns the term to *add* to the loss
    and its metrics (``metrics.TokenMean``/``Summed`` values, or plain tensors averaged over micro-batches).
    Optional: ``prepare(module, batch) -> RolloutBatch``, once per rollout batch before the advantages (a new
    batch through ``dataclasses.replace``, e.g. with ``ref_logprobs``); ``contributes(module) -> bool``: ``False``
    promises the term is exactly zero with zero gradient this update (``beta = 0``), so inert rows may still be
    skipped -- a term without it switches skipping off. The answers must be the same on every rank.
    """

    def loss_term(self, module: Any, batch: RolloutBatch, logprobs: Tensor,
                  weights: Tensor) -> tuple[Tensor, Metrics]: ...
