"""``RolloutSamples``: sample prompt/response texts with their rewards, written to TensorBoard as a table."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from rl_lightning.rollout.batch import RolloutBatch


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "⏎") or "∅"


class RolloutSamples(Callback):
    """Every ``every_n_steps`` training steps, log ``num_samples`` rollouts as a markdown table (``samples/train``).

    Args:
        every_n_steps: logging interval in training steps (step 0 included).
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

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step - 1  # the step that produced `batch`
        if not isinstance(batch, RolloutBatch) or step % self.every_n_steps or not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("samples/train", self.table(batch, self.num_samples), global_step=step)
