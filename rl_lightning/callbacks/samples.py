"""``RolloutSamples``: sample prompt/response texts with their rewards, written to TensorBoard as a table."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from rl_lightning.rollout.batch import RolloutBatch


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "⏎") or "∅"


class RolloutSamples(Callback):
    """Rollouts as markdown tables of prompt, response, reward (the verdict) and truncation, under *Text*.

    * ``samples/train``: ``num_samples`` sampled training rollouts every ``every_n_steps`` training steps
      (step 0 included) and at the last step (``max_steps - 1``), at the step that produced them.
    * ``samples/val``: ``num_samples`` greedy held-out responses at every evaluation -- the one before
      training (step 0), each validation and the one after the last step -- at ``step = trainer.global_step``
      (the updates done before it, the step ``val/reward`` is logged at). The module calls
      ``on_heldout_evaluated`` (the ``HeldoutObserver`` protocol of ``rl_lightning.algorithms``).

    Args:
        every_n_steps: logging interval of the training samples in training steps.
        num_samples: rows shown (the first rows of the batch, i.e. whole groups first).
    """

    def __init__(self, every_n_steps: int = 20, num_samples: int = 8) -> None:
        if every_n_steps < 1 or num_samples < 1:
            raise ValueError("RolloutSamples: every_n_steps and num_samples must be >= 1")
        self.every_n_steps = every_n_steps
        self.num_samples = num_samples

    @staticmethod
    def table(batch: RolloutBatch, num_samples: int) -> str:
        rows = ["| prompt | response | reward | truncated |", "| --- | --- | --- | --- |"]
        for i in range(min(num_samples, batch.num_rows)):
            rows.append(
                f"| {_cell(batch.prompts[i].text)} | {_cell(batch.responses[i])} | "
                f"{float(batch.rewards[i]):.3g} | {bool(batch.truncated[i])} |"
            )
        return "\n".join(rows)

    def _write(self, trainer: Trainer, tag: str, batch: RolloutBatch, step: int) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(tag, self.table(batch, self.num_samples), global_step=step)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step - 1  # the step that produced `batch`
        last = trainer.max_steps is not None and trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
        if isinstance(batch, RolloutBatch) and (step % self.every_n_steps == 0 or last):
            self._write(trainer, "samples/train", batch, step)

    def on_heldout_evaluated(
        self, trainer: Trainer, module: LightningModule, batch: RolloutBatch, step: int, reward: float
    ) -> None:
        self._write(trainer, "samples/val", batch, step)
