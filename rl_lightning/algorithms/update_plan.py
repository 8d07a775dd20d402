"""``UpdatePlan``: the planner ``RLModule.update`` iterates. Built once per update from the module's settings and
the pure functions of ``planning.py``, it yields each ``OptimizerStep``, which yields its typed ``MicroBatch``es
(``for step in plan: for mb in step``); the speed features (inert-row skipping, length bucketing, prompt-shared
micro-batches, equal backward counts over ranks) live behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor

from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.auxiliary import AuxiliaryMicro, auxiliary_plan
from rl_lightning.algorithms.planning import (
    PlannedStep, micro_batch, plan_update, prompt_blocks, skipped_rows, unforwarded,
)
from rl_lightning.rollout.batch import RolloutBatch


@dataclass(frozen=True)
class MicroBatch:
    """One forward and backward of an update: ``rows`` of the rollout batch as a sub-batch (cut to the columns they
    use with length bucketing), with their advantages and aggregation weights."""

    rows: Tensor
    batch: RolloutBatch
    adv: Advantages
    weights: Tensor


@dataclass(frozen=True)
class OptimizerStep:
    """One optimiser step of an update: pass ``iteration``, minibatch ``index``; iterating it yields its
    ``MicroBatch``es, made one at a time. ``rows``: the minibatch's rows; ``micros``: the rows of each micro-batch;
    ``idle``: ``[N]`` bool, the minibatch's rows it does not forward (skipped as inert); ``auxiliary``: the
    auxiliary micro-batches it also forwards (``auxiliary.py``)."""

    iteration: int
    index: int
    first: bool
    last: bool
    rows: Tensor
    micros: list[Tensor]
    idle: Tensor
    auxiliary: list[AuxiliaryMicro]
    plan: UpdatePlan

    def __iter__(self) -> Iterator[MicroBatch]:
        for rows in self.micros:
            yield MicroBatch(rows, *micro_batch(self.plan.batch, rows, self.plan.adv, self.plan.weights,
                                                self.plan.bucketing))


class UpdatePlan:
    """The optimiser steps of one update, with the speed features behind it: inert rows left out
    (``skipped_rows``), micro-batches bucketed by length or by shared prompt (``micro_batches``), every rank
    running the same number of backward passes (``plan_update``), auxiliary rows split over the steps
    (``auxiliary_plan``). Built by ``UpdatePlan.build`` from the module's settings; ``for step in plan``.

    Attributes:
        batch, adv, weights: the rollout batch, its advantages and its aggregation weights (already scaled by
            ``num_minibatches``), sliced per micro-batch.
        skipped: ``[N]`` bool, the rows left out as inert (``None``: skipping does not apply).
        forwarded: ``[N]`` bool, the rows some micro-batch forwards.
        steps: every ``OptimizerStep``, in order.
        auxiliary_metrics: the metrics the auxiliary rows were made with (``AuxiliaryRows.metrics``).
    """

    def __init__(self, batch: RolloutBatch, adv: Advantages, weights: Tensor, skipped: Tensor | None,
                 planned: list[PlannedStep], auxiliary: list[list[AuxiliaryMicro]], bucketing: bool,
                 auxiliary_metrics: dict[str, list[Tensor]] | None = None) -> None:
        self.batch, self.adv, self.weights, self.skipped, self.bucketing = batch, adv, weights, skipped, bucketing
        self.auxiliary_metrics = auxiliary_metrics or {}
        self.forwarded = torch.zeros(batch.num_rows, dtype=torch.bool, device=batch.loss_mask.device)
        self.steps = []
        for k, ((iteration, index, rows, micros), aux) in enumerate(zip(planned, auxiliary)):
            for micro in micros:
                self.forwarded[micro] = True
            self.steps.append(OptimizerStep(iteration, index, k == 0, k == len(planned) - 1, rows, micros,
                                            unforwarded(rows, micros, batch.num_rows), aux, self))

    @classmethod
    def build(cls, module: Any, batch: RolloutBatch, adv: Advantages, weights: Tensor,
              terms: list[Any]) -> UpdatePlan:
        """The plan of ``module``'s settings (``num_iterations``, ``num_minibatches``, ``micro_batch_size``,
        ``skip_inert_rows``, ``length_bucketing``, ``share_prompt_forward``, ``seed``) for this rollout batch; its
        ``auxiliary_rows`` hook is called here, once."""
        skipped = skipped_rows(module, batch, adv, terms) if module.skip_inert_rows else None
        share = module.length_bucketing and module.micro_batch_size and module.share_prompt_forward
        planned = plan_update(batch, skipped, module.num_iterations, module.num_minibatches, module.micro_batch_size,
                              module.length_bucketing, prompt_blocks(batch, module.policy) if share else None,
                              module.seed, module.global_step, module.ranks.max, module.share_prompt_min_tokens,
                              module.device)
        items = module.auxiliary_rows(batch, adv)
        auxiliary = auxiliary_plan(items, [step[1] for step in planned], module.num_minibatches,
                                   module.micro_batch_size, module.ranks.max)
        metrics = {name: values for item in items or [] for name, values in item.metrics.items()}
        return cls(batch, adv, weights, skipped, planned, auxiliary, module.length_bucketing, metrics)

    def __iter__(self) -> Iterator[OptimizerStep]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def skipped_fraction(self) -> Tensor:
        """``train/skipped_rows``: the fraction of rows left out as inert (0 when skipping does not apply)."""
        if self.skipped is None:
            return self.forwarded.new_zeros((), dtype=torch.float)
        return self.skipped.float().mean()
