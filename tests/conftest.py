"""Shared fixtures: a tiny data module and a quiet CPU trainer for short fits."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*is deprecated.*")
# Tiny models gain nothing from threads, and parallel jobs would oversubscribe the cores: 1 by default.
# RL_LIGHTNING_TEST_THREADS=N runs the suite with N threads (.ci/run's sweep), since reductions split over threads
# round differently: every tolerance must hold for any thread count.
torch.set_num_threads(int(os.environ.get("RL_LIGHTNING_TEST_THREADS", "1")))

REPO = Path(__file__).resolve().parents[1]


def tiny_datamodule(**overrides: Any):
    """4 prompts x 4 responses, at most 4 new tokens, 16 held-out prompts. ``overrides`` are the data module's
    arguments, or fields of one of its settings groups (``temperature=1.5``, ``split="validation"``), which replace
    that field of the tiny defaults."""
    from rl_lightning.envs import ArithmeticTask
    from rl_lightning.rollout import Evaluation, RolloutDataModule, Sampling
    from tests.helpers.settings import data_kwargs

    kwargs: dict[str, Any] = dict(task=ArithmeticTask(num_heldout=16), prompts_per_step=4, group_size=4, seed=0,
                                  sampling=Sampling(max_new_tokens=4), evaluation=Evaluation(batch_size=16))
    kwargs.update(overrides)
    return RolloutDataModule(**data_kwargs(**kwargs))


def tiny_trainer(tmp_path: Path, max_steps: int, callbacks: list[Callback] | None = None, **overrides: Any) -> Trainer:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, default_root_dir=str(tmp_path), callbacks=callbacks or [],
    )
    kwargs.update(overrides)
    return Trainer(**kwargs)


class RecordRollouts(Callback):
    """Keeps each training step's rewards, prompt indices and logged metrics."""

    def __init__(self) -> None:
        self.rewards: list[torch.Tensor] = []
        self.prompt_index: list[torch.Tensor] = []
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.rewards.append(batch.rewards.detach().cpu().clone())
        self.prompt_index.append(batch.prompt_index.detach().cpu().clone())
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


class RecordBatches(RecordRollouts):
    """``RecordRollouts`` that also keeps each step's whole ``RolloutBatch`` (``batches``)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[Any] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.batches.append(batch)


@pytest.fixture
def recorder() -> RecordRollouts:
    return RecordRollouts()
