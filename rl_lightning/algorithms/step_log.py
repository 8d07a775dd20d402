"""The step's closing log: ``perf/*`` and the metrics callbacks add, once every callback has done its work.

``RLModule.training_step`` returns the step's totals (``StepTotals``, under ``STEP_TOTALS``); Lightning hands that
return value to every callback's ``on_train_batch_end``, and ``StepLog``, which every ``RLModule`` brings
(``configure_callbacks``), logs from it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

from rl_lightning.algorithms.metrics import learning_rates, log_step
from rl_lightning.rollout.datamodule import RolloutDataModule

#: the key of ``StepTotals`` in what ``training_step`` returns
STEP_TOTALS = "step_totals"


@dataclass(frozen=True)
class StepTotals:
    """What a training step hands to its closing log.

    Attributes:
        step: the step's index (the updates done before its rollout).
        rows: the rollout's rows (the log's batch size).
        tokens: the tokens the rollout generated.
        started: ``time.perf_counter()`` at the step's start as the step itself measured it (its end less its
            rollout, reward and update seconds): the clock's start when the data module noted none.
    """

    step: int
    rows: int
    tokens: float
    started: float


class StepLog(Callback):
    """Logs ``perf/step_time``, ``perf/tokens_per_sec``, ``perf/sampled_tokens``, the data module's rollout
    metrics (dynamic sampling, reward shaping) and the metrics callbacks added in the step (``add``, through
    ``RLModule.add_step_metrics``), at the step's index, averaged over ranks.

    ``perf/step_time`` runs from the start of the step's rollout (``RolloutDataModule.step_started``) to this
    callback's ``on_train_batch_end``. Every ``RLModule`` adds it last of its ``configure_callbacks``, so Lightning
    runs it after the Trainer's callbacks: the work they do in the step (audits, extra rollouts) counts; the
    checkpoint callbacks, which Lightning always runs last, do not. A method that adds callbacks of its own puts
    them before it (``[*extra, *super().configure_callbacks()]``) so that their metrics reach the same step.
    """

    def __init__(self) -> None:
        self._extra: dict[str, Tensor] = {}

    @staticmethod
    def of(trainer: Trainer | None) -> StepLog | None:
        """The run's ``StepLog`` (``None`` outside a Trainer)."""
        found = [cb for cb in trainer.callbacks if isinstance(cb, StepLog)] if trainer is not None else []
        return found[0] if found else None

    def add(self, metrics: dict[str, Any]) -> None:
        """Metrics of the running step, logged at its end (the same names on every rank: the mean is collective)."""
        self._extra.update({k: torch.as_tensor(v, dtype=torch.float32).detach().reshape(())
                            for k, v in metrics.items()})

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        extra, self._extra = self._extra, {}
        totals = outputs.get(STEP_TOTALS) if isinstance(outputs, Mapping) else None
        if not isinstance(totals, StepTotals):
            return
        data = trainer.datamodule if isinstance(trainer.datamodule, RolloutDataModule) else None
        started = data.step_started if data is not None and data.step_started is not None else totals.started
        seconds = time.perf_counter() - started
        perf = {"perf/step_time": torch.tensor(seconds), "perf/tokens_per_sec": torch.tensor(totals.tokens / seconds)}
        if data is not None:  # every token sampled in the step, one-off rollouts of callbacks included
            perf["perf/sampled_tokens"] = torch.tensor(float(data.take_sampled_tokens()))
            perf.update(data.take_rollout_metrics())  # the same names on every rank: the data module's settings
        log_step(pl_module, {**perf, **dict(sorted(extra.items()))}, totals.step, totals.rows, bar=tuple(extra))


class StepLogging:
    """The step's log as ``RLModule`` methods: the learning rates each update was taken with, the step's metrics,
    and the metrics callbacks add (``add_step_metrics``), which ``StepLog`` logs at the step's end."""

    def add_step_metrics(self, metrics: dict[str, Any]) -> None:
        """Add metrics of the running training step from outside the update -- a callback's (an audit's error),
        from any hook of the step (``on_train_batch_start``, a loss term, ``on_train_batch_end``). They are logged
        at the step's index after every callback's ``on_train_batch_end`` (``StepLog``), averaged over ranks (every
        rank must add the same names in a step: the reduction is a collective), and shown in the progress bar.
        Document their names in docs/metrics.md. Outside a Trainer they are dropped."""
        log = StepLog.of(self._trainer)
        if log is not None:
            log.add(metrics)

    def learning_rates(self) -> dict[str, Tensor]:
        """``metrics.learning_rates`` of the run's optimisers (``train/lr``, ``train/lr_<group>``)."""
        return learning_rates(self.trainer.optimizers) if self._trainer is not None else {}

    def log_training_metrics(self, metrics: dict[str, Tensor], step: int, batch_size: int,
                             tokens: Tensor) -> StepTotals:
        """``metrics.log_step``: the step's metrics, averaged over ranks, at ``step``; the totals ``StepLog``
        logs ``perf/step_time`` from at the step's end (``tokens``: generated)."""
        log_step(self, metrics, step, batch_size)
        spent = sum(float(metrics.get(f"perf/{k}_time", 0.0)) for k in ("rollout", "reward", "update"))
        return StepTotals(step, batch_size, float(tokens), time.perf_counter() - spent)  # start if not clocked
