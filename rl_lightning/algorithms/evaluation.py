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
rank's first held-out batch. Its state -- the step of the last evaluation and every ``(step, val/reward)`` -- is
kept in checkpoints.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
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

    def __init__(self) -> None:
        self.last_step = -1  # the step of the last val/reward logged (-1: none yet)
        self.history: list[tuple[int, float]] = []
        self._reward = MeanMetric()
        self._first: RolloutBatch | None = None  # the running validation's first batch, for the observers

    # ------------------------------------------------------------------ Lightning's validation loop
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._reward = self._reward.to(pl_module.device)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._reward.update(batch.rewards)
        if self._first is None:
            self._first = batch

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        value = self._reward.compute()  # synchronised over ranks
        self._reward.reset()
        batch, self._first = self._first, None
        pl_module.log("val/reward", value, prog_bar=True, logger=False)
        if trainer.sanity_checking:
            return
        self._record(trainer, pl_module, trainer.global_step, float(value), batch)

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
            if not first:
                first.append(batch)

        if isinstance(datamodule, RolloutDataModule):  # the data module's own evaluation, seeing its batches
            total, count = datamodule.evaluate(on_batch=keep_first)
        else:  # another data module: its sums only
            total, count = datamodule.evaluate()
        sums = trainer.strategy.reduce(torch.tensor([total, float(count)], device=pl_module.device), reduce_op="sum")
        if float(sums[1]) == 0:
            return  # no held-out prompts: nothing to report
        value = float(sums[0] / sums[1])
        self._record(trainer, pl_module, step, value, first[0] if first else None)
        rank_zero_info(f"val/reward at step {step} ({when}): {value:.4f} on {int(sums[1])} held-out prompts")

    def _record(self, trainer: Trainer, pl_module: LightningModule, step: int, value: float,
                batch: RolloutBatch | None) -> None:
        if trainer.logger is not None:
            trainer.logger.log_metrics({"val/reward": value}, step=step)
        self.last_step = step
        self.history = [(s, v) for s, v in self.history if s != step] + [(step, value)]
        if batch is not None:
            for observer in (cb for cb in trainer.callbacks if isinstance(cb, HeldoutObserver)):
                observer.on_heldout_evaluated(trainer, pl_module, batch, step, value)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "history": [list(entry) for entry in self.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_step = int(state_dict.get("last_step", self.last_step))
        self.history = [(int(s), float(v)) for s, v in state_dict.get("history", [])]

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Checkpoints written before this callback existed kept the state in the module's entries."""
        if "rl_lightning_val_step" in checkpoint and not any("HeldoutEvaluation" in k
                                                             for k in checkpoint.get("callbacks", {})):
            self.load_state_dict({"last_step": checkpoint["rl_lightning_val_step"],
                                  "history": checkpoint.get("rl_lightning_val_history", [])})
