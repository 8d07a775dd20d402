"""Auxiliary rows: rows a method adds to an update besides the rollout's, each set with its own loss -- a
generative critic's value-token rows (TEMPO's critic prompts, AC2's value loss), an auxiliary likelihood on
demonstrations. ``RLModule.auxiliary_rows(batch, adv)`` returns them once per rollout batch; ``update`` forwards
them in the same optimiser steps as the rollout's rows and adds their terms to the same loss and metrics
(``train/loss`` includes them; their own metrics are logged by name), never riding on the rollout's rows.

Splitting follows the rollout's rows: with ``num_minibatches = M`` the auxiliary rows are cut into ``M``
contiguous parts, part ``j`` forwarded in minibatch ``j`` of every pass with its weights times ``M`` (as the
rollout's weights are), in micro-batches of ``micro_batch_size`` rows. So a pass over the rollout batch also
passes once over the auxiliary rows, and the summed gradient does not depend on ``micro_batch_size``. Under data
parallelism every rank runs the same number of backward passes per optimiser step: a rank with fewer auxiliary
micro-batches repeats a row of its own with weight 0 (an exact zero), so every rank that any rank gives rows to
must give at least one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from rl_lightning.algorithms.checks import check_finite
from rl_lightning.algorithms.metrics import Metrics, UpdateMetrics
from rl_lightning.rollout.batch import RolloutBatch

#: ``loss(rows, out, weights) -> (term, metrics)``: the term a micro-batch of auxiliary rows adds to the loss
AuxiliaryLoss = Callable[[RolloutBatch, Any, Tensor], tuple[Tensor, Metrics]]


@dataclass(frozen=True)
class AuxiliaryRows:
    """A set of rows with their own loss, merged into the update (see the module docstring).

    Attributes:
        batch: the rows, as a ``RolloutBatch`` the learner forward scores (``forward.sequences_batch`` builds one
            from ``(context, target)`` ids: ``loss_mask`` 1 on the targets).
        weights: ``[n, T]`` their aggregation weights, fixed once per rollout batch (e.g.
            ``planning.rollout_weights(rows, "token_mean", module.ranks)`` times a coefficient).
        loss: ``loss(rows, out, weights) -> (term, metrics)`` for a micro-batch of them; ``out`` is their
            ``forward_policy`` (``PolicyOutput``: log-probs of the target tokens, with gradient); report metrics
            under names of their own (``metrics.Summed`` for a share of the loss).
        extra_ids: ``[n, T, J]`` ids at which the forward also scores each position (``out.extra_logprobs``, from
            the same forward: a value-token grid, ``generative_critic.GenerativeCritic``); ``None``: none.
        model: the model that scores the rows (``None``: the policy), e.g. a generative critic's weights of its own
            (``GenerativeCritic(weights="own")``): its parameters must be in the module's optimiser and
            ``trainable_parameters``.
        metrics: the step's metrics measured when the rows were made (``{name: [values]}``, e.g. TEMPO's critic
            value and error), logged with the update's (``update``'s return value).
    """

    batch: RolloutBatch
    weights: Tensor
    loss: AuxiliaryLoss
    extra_ids: Tensor | None = None
    model: Any = None
    metrics: dict[str, list[Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if tuple(self.weights.shape) != tuple(self.batch.loss_mask.shape):
            raise ValueError(f"AuxiliaryRows: weights have shape {tuple(self.weights.shape)}, the rows' loss_mask "
                             f"{tuple(self.batch.loss_mask.shape)}")
        if self.extra_ids is not None and (self.extra_ids.dim() != 3 or self.extra_ids.shape[:2] != self.weights.shape):
            raise ValueError(f"AuxiliaryRows: extra_ids have shape {tuple(self.extra_ids.shape)}, expected "
                             f"{tuple(self.weights.shape)} + (J,)")


#: one auxiliary micro-batch of an optimiser step: ``(rows set, row indices, weight scale)``
AuxiliaryMicro = tuple[AuxiliaryRows, Tensor, float]


def auxiliary_plan(items: list[AuxiliaryRows] | None, minibatch_indices: list[int], num_minibatches: int,
                   micro_batch_size: int | None,
                   reduce_max: Callable[[Tensor], Tensor] | None) -> list[list[AuxiliaryMicro]]:
    """Per optimiser step of the update (``minibatch_indices``: each step's minibatch index), the auxiliary
    micro-batches it forwards (see the module docstring). ``items`` ``None``: the method has none (no collective);
    ``reduce_max``: the maximum over ranks (``None`` in one process)."""
    steps: list[list[AuxiliaryMicro]] = [[] for _ in minibatch_indices]
    if items is None:
        return steps
    for k, index in enumerate(minibatch_indices):
        for item in items:
            part = torch.arange(item.batch.num_rows, device=item.weights.device).tensor_split(num_minibatches)[index]
            steps[k] += [(item, micro, float(num_minibatches)) for micro in part.split(micro_batch_size or
                                                                                   max(part.numel(), 1))
                         if micro.numel()]
    if reduce_max is None:
        return steps
    device = items[0].weights.device if items else torch.device("cpu")
    need = reduce_max(torch.tensor([len(s) for s in steps], device=device)).tolist()
    for step, count in zip(steps, need):
        if len(step) < count:
            if not items:
                raise ValueError("auxiliary_rows: another rank has auxiliary rows and this one none; every rank "
                                 "must give at least one row when any does")
            filler = next(item for item in items if item.batch.num_rows)
            step += [(filler, torch.zeros(1, dtype=torch.long, device=device), 0.0)] * (count - len(step))
    return steps


def run_auxiliary(module: Any, micros: list[AuxiliaryMicro], metrics: UpdateMetrics, iteration: int,
                  index: int) -> None:
    """Forward, score and back-propagate one optimiser step's auxiliary micro-batches, their losses and metrics
    added to the step's (``metrics.add_loss``)."""
    for item, rows, scale in micros:
        rows_batch, weights = item.batch.select(rows), item.weights[rows] * scale
        out = module.forward_policy(rows_batch, model=item.model,
                                    extra_ids=None if item.extra_ids is None else item.extra_ids[rows])
        loss, stats = item.loss(rows_batch, out, weights)
        check_finite(loss.detach(), "auxiliary loss", module.global_step, iteration, index)
        if loss.requires_grad:
            module.manual_backward(loss)
        metrics.add_loss(loss, stats if scale else {}, rows_batch.loss_mask.sum().float())  # a filler: no metrics
