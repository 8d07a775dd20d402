"""``HeldoutEvaluation``: the greedy held-out reward, ``val/reward``, of every run, and its bookkeeping.

Every ``RLModule`` brings it (``RLModule.configure_callbacks``), so a run always has it, however the Trainer was
built. It logs ``val/reward`` at ``step = trainer.global_step`` (the updates done before the evaluation):

* at every validation of Lightning's loop (the data module's held-out prompts, one greedy response each; not the
  sanity check);
* before training, outside the loop: at step 0 in a fresh run (the warm-start level), and on resume at the
  checkpoint's step when that step is a validation step whose validation had not run (step checkpoints are written
  at the end of the training step, before its validation, which a resumed run would otherwise skip);
* after the last step when it had no validation (``max_steps`` not a multiple of ``val_check_interval``, or a run
  stopped early), so that ``val/reward`` always ends at the last step.

Each evaluation is shown to the ``HeldoutObserver`` callbacks (``RolloutSamples``, the progress bar) with this
rank's first held-out batch.

Per-item outcomes: every evaluation also keeps each held-out item's reward (gathered from every rank, in the order
of the data module's ``heldout_prompts``), so that two runs can be compared item by item (a paired test). They are
written, on rank 0, to ``eval_items.csv`` in the logger's ``log_dir`` (columns ``step,split,item,reward``;
``split`` is the data module's ``evaluation.split``), rewritten whole after each evaluation from the callback's
state, so a resumed run's file holds exactly the evaluations of the run it continues. Its state -- the step of the
last evaluation, every ``(step, val/reward)`` and every evaluation's per-item rewards -- is kept in checkpoints.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics import MeanMetric

from rl_lightning.rollout.batch import RolloutBatch
from rl_lightning.rollout.datamodule import RolloutDataModule


@runtime_checkable
class HeldoutObserver(Protocol):
    """What a callback implements to see each held-out (greedy) evaluation (e.g. ``RolloutSamples``).

    ``on_heldout_evaluated`` is called on every rank once per evaluation (see ``HeldoutEvaluation``) with this
    rank's first held-out ``RolloutBatch`` (one greedy response per prompt, rewards filled in), ``step``
    (``trainer.global_step``, the updates done before the evaluation) and ``reward``, the mean held-out reward over
    all ranks (the ``val/reward`` logged at ``step``).
    """

    def on_heldout_evaluated(
        self, trainer: Any, module: Any, batch: RolloutBatch, step: int, reward: float
    ) -> None: ...


class HeldoutEvaluation(Callback):
    """Logs ``val/reward`` (see the module docstring). ``history``: ``(step, val/reward)`` of every evaluation."""

    ITEMS_FILE = "eval_items.csv"

    def __init__(self) -> None:
        self.last_step = -1  # the step of the last val/reward logged (-1: none yet)
        #: the step of a held-out evaluation outside Lightning's loop that raised (``None``: none did); the failure
        #: callbacks read it to dump that evaluation's rollout, not the training step's
        self.failed_step: int | None = None
        self.history: list[tuple[int, float]] = []
        self.items: dict[int, list[float]] = {}  # step -> each held-out item's reward (NaN: not evaluated)
        self._reward = MeanMetric()
        self._first: RolloutBatch | None = None  # the running validation's first batch, for the observers
        self._outcomes: list[tuple[Tensor, Tensor]] = []  # this rank's (item index, reward) of the running evaluation

    # ------------------------------------------------------------------ Lightning's validation loop
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._reward = self._reward.to(pl_module.device)
        self.failed_step = None

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._reward.update(batch.rewards)
        self._outcomes.append((batch.prompt_index, batch.rewards))
        if self._first is None:
            self._first = batch

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        value = self._reward.compute()  # synchronised over ranks
        self._reward.reset()
        batch, self._first = self._first, None
        pl_module.log("val/reward", value, prog_bar=True, logger=False)
        items = self._gather_items(trainer, pl_module)
        if trainer.sanity_checking:
            return
        self._record(trainer, pl_module, trainer.global_step, float(value), batch, items)

    # ------------------------------------------------------------------ outside the loop
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "evaluate") or trainer.limit_val_batches == 0:
            return
        step, interval = trainer.global_step, trainer.val_check_interval
        if step == 0:
            self._evaluate(trainer, pl_module, datamodule, "before any update")
        elif self.last_step != step and isinstance(interval, int) and interval > 0 and step % interval == 0:
            self._evaluate(trainer, pl_module, datamodule, "resumed from a checkpoint written before this step's "
                                                           "validation")
        else:
            # resumed after this step's validation (an interrupt checkpoint): a resumed TensorBoard run has purged
            # the events from this step on, so write its value again (no new evaluation)
            done = dict(self.history)
            if self.last_step == step and step in done and trainer.logger is not None:
                trainer.logger.log_metrics({"val/reward": done[step]}, step=step)
        self._write_items(trainer)  # a resumed run: the file holds the evaluations of the checkpoint's run only

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        if (datamodule is None or not hasattr(datamodule, "evaluate") or trainer.limit_val_batches == 0
                or self.last_step == trainer.global_step):
            return
        self._evaluate(trainer, pl_module, datamodule, "after the last step")

    @torch.no_grad()
    def _evaluate(self, trainer: Trainer, pl_module: LightningModule, datamodule: Any, when: str) -> None:
        """Greedy held-out evaluation outside Lightning's loop; logs ``val/reward`` at ``global_step``."""
        step, first = trainer.global_step, []

        def keep_first(batch: RolloutBatch) -> None:  # only the first is shown to the observers
            self._outcomes.append((batch.prompt_index, batch.rewards))
            if not first:
                first.append(batch)

        try:
            if isinstance(datamodule, RolloutDataModule):  # the data module's own evaluation, seeing its batches
                total, count = datamodule.evaluate(on_batch=keep_first)
            else:  # another data module: its sums only
                total, count = datamodule.evaluate()
        except BaseException:
            self.failed_step = step
            raise
        sums = trainer.strategy.reduce(torch.tensor([total, float(count)], device=pl_module.device), reduce_op="sum")
        items = self._gather_items(trainer, pl_module)
        if float(sums[1]) == 0:
            return  # no held-out prompts: nothing to report
        value = float(sums[0] / sums[1])
        self._record(trainer, pl_module, step, value, first[0] if first else None, items)
        rank_zero_info(f"val/reward at step {step} ({when}): {value:.4f} on {int(sums[1])} held-out prompts")

    def _gather_items(self, trainer: Trainer, pl_module: LightningModule) -> list[float] | None:
        """Each held-out item's reward in this evaluation, from every rank (called on every rank, like the
        reduction of ``val/reward``): the mean of its rows, NaN for an item no rank evaluated. ``None`` without a
        data module that lists its held-out prompts."""
        outcomes, self._outcomes = self._outcomes, []
        datamodule = getattr(trainer, "datamodule", None)
        if not isinstance(datamodule, RolloutDataModule):
            return None
        n = len(datamodule.heldout_prompts())
        sums = torch.zeros(2, n, dtype=torch.float64)
        for index, rewards in outcomes:
            index, rewards = index.detach().cpu().long(), rewards.detach().cpu().double()
            keep = (index >= 0) & (index < n)
            sums[0].index_add_(0, index[keep], rewards[keep])
            sums[1].index_add_(0, index[keep], torch.ones_like(rewards[keep]))
        sums = trainer.strategy.reduce(sums.to(pl_module.device), reduce_op="sum").cpu()
        return [float(total / count) if count > 0 else math.nan for total, count in zip(sums[0], sums[1])]

    def _write_items(self, trainer: Trainer) -> None:
        """Rewrite ``eval_items.csv`` in the logger's ``log_dir`` from ``items`` (rank 0; nothing without a
        logger)."""
        log_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
        if not trainer.is_global_zero or log_dir is None or not self.items:
            return
        datamodule = getattr(trainer, "datamodule", None)
        split = getattr(getattr(datamodule, "evaluation", None), "split", "test")  # another data module class: test
        lines = ["step,split,item,reward"] + [f"{step},{split},{i},{r!r}" for step in sorted(self.items)
                                               for i, r in enumerate(self.items[step])]
        path = Path(log_dir) / self.ITEMS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".csv.tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(path)

    def _record(self, trainer: Trainer, pl_module: LightningModule, step: int, value: float,
                batch: RolloutBatch | None, items: list[float] | None = None) -> None:
        if trainer.logger is not None:
            trainer.logger.log_metrics({"val/reward": value}, step=step)
        self.last_step = step
        self.history = [(s, v) for s, v in self.history if s != step] + [(step, value)]
        if items is not None:
            self.items[step] = items
            self._write_items(trainer)
        if batch is not None:
            for observer in (cb for cb in trainer.callbacks if isinstance(cb, HeldoutObserver)):
                observer.on_heldout_evaluated(trainer, pl_module, batch, step, value)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "history": [list(entry) for entry in self.history],
                "items": {int(step): list(values) for step, values in self.items.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_step = int(state_dict.get("last_step", self.last_step))
        self.history = [(int(s), float(v)) for s, v in state_dict.get("history", [])]
        self.items = {int(step): [float(r) for r in values] for step, values in state_dict.get("items", {}).items()}

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Checkpoints written before this callback existed kept the state in the module's entries."""
        if "rl_lightning_val_step" in checkpoint and not any("HeldoutEvaluation" in k
                                                             for k in checkpoint.get("callbacks", {})):
            self.load_state_dict({"last_step": checkpoint["rl_lightning_val_step"],
                                  "history": checkpoint.get("rl_lightning_val_history", [])})
