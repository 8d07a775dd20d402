"""``FullRolloutAudit``: complete a fraction of the problems a critic valued and compare its predictions with the
actual outcomes (AC2's full-rollout audits; docs/algorithms.md, AC2).

Any method that implements the ``rl_lightning.algorithms.readiness.AuditedCritic`` protocol can use it (AC2 does):
after the step's update it takes the method's ``audit_candidates()`` (a problem key, the ``Branch`` to complete,
the predicted value), completes ``ceil(fraction · count)`` of them drawn by the step's seed with one seeded, eval-mode
rollout each (``RolloutDataModule.rollout_branches``), hands ``|V̂ - R|`` to ``record_audits`` (the method's
readiness check) and adds ``train/audit_error`` (the mean error; 0 when nothing was audited) and
``train/audit_count`` to the step's metrics (``RLModule.add_step_metrics``: averaged over ranks, shown in the
progress bar, counted in ``perf/step_time``). The completions use the weights after the update; the predictions
were made before it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import Callback

from rl_lightning.algorithms.readiness import AuditedCritic


class FullRolloutAudit(Callback):
    """Audit a critic with full rollouts (see the module docstring).

    Args:
        fraction: share of the step's candidates completed (default 10%).
        seed: seeds which candidates are drawn and the completions' sampling (with the step).
    """

    def __init__(self, fraction: float = 0.1, seed: int = 0) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"FullRolloutAudit: fraction must be in (0, 1], got {fraction}")
        self.fraction, self.seed = fraction, seed

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not isinstance(pl_module, AuditedCritic):
            raise TypeError(f"FullRolloutAudit: {type(pl_module).__name__} does not implement audit_candidates and "
                            "record_audits (rl_lightning.algorithms.readiness.AuditedCritic)")
        items = pl_module.audit_candidates()
        step = trainer.global_step
        errors: list[float] = []
        if items:
            count = math.ceil(self.fraction * len(items))
            order = torch.randperm(len(items), generator=torch.Generator().manual_seed(self.seed * 1_000_003 + step))
            picked = [items[i] for i in order[:count].tolist()]
            out = trainer.datamodule.rollout_branches([it.branch for it in picked], n=1,
                                                      seed=(self.seed * 1_000_033 + step) % 2**31)
            errors = [abs(it.value - float(r)) for it, r in zip(picked, out.rewards.tolist())]
            pl_module.record_audits([it.key for it in picked], errors)
        pl_module.add_step_metrics({"train/audit_error": torch.tensor(sum(errors) / max(len(errors), 1)),
                                    "train/audit_count": torch.tensor(float(len(errors)))})
