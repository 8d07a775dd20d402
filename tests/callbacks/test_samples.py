"""RolloutSamples writes held-out greedy samples with their verdicts at every evaluation (step 0 included) and
training samples at the run's last step, to TensorBoard's Text tab."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from rl_lightning.algorithms import GRPO, HeldoutObserver
from rl_lightning.callbacks import RolloutSamples
from tests.conftest import tiny_datamodule, tiny_trainer


def _tables(acc: EventAccumulator, tag: str) -> dict[int, list[list[str]]]:
    """step -> the rows of the markdown table logged under ``tag`` (header and rule dropped)."""
    tables = {}
    for event in acc.Tensors(f"{tag}/text_summary"):
        text = tensor_util.make_ndarray(event.tensor_proto).item().decode()
        lines = text.splitlines()
        assert lines[0] == "| prompt | response | reward | truncated |", lines[0]
        tables[event.step] = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]
    return tables


def test_heldout_samples_at_every_evaluation_and_train_samples_at_the_last_step(tmp_path: Path):
    samples = RolloutSamples(every_n_steps=3, num_samples=16)
    assert isinstance(samples, HeldoutObserver)
    logger = TensorBoardLogger(str(tmp_path), name="run")
    trainer = tiny_trainer(tmp_path, max_steps=5, callbacks=[samples], logger=logger, limit_val_batches=None,
                           val_check_interval=2, check_val_every_n_epoch=None)
    module = GRPO(model_name_or_path="embedded:arithmetic")
    trainer.fit(module, datamodule=tiny_datamodule())
    logger.experiment.flush()

    acc = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    assert "samples/val/text_summary" in acc.Tags()["tensors"]
    val = _tables(acc, "samples/val")
    # the evaluation before training (step 0, outside Lightning's loop), each validation and the one after the
    # last step (5, off the interval), at the steps of val/reward
    assert sorted(val) == [0, 2, 4, 5]
    assert sorted(val) == [e.step for e in acc.Scalars("val/reward")]
    val_reward = {e.step: e.value for e in acc.Scalars("val/reward")}
    # the module's HeldoutEvaluation callback keeps the same evaluations (val_history reads it)
    assert [s for s, _ in module.val_history] == sorted(val)
    assert all(v == pytest.approx(val_reward[s]) for s, v in module.val_history)
    for step, rows in val.items():
        assert len(rows) == 16  # the 16 held-out prompts: one greedy response each, in one validation batch
        rewards = [row[2] for row in rows]
        assert set(rewards) <= {"0", "1"}, rewards  # the verdicts of the exact-match reward
        assert all(row[0].endswith("=") for row in rows)  # arithmetic prompts "a+b="
        # the table holds the whole held-out set here, so its verdicts average to the val/reward of its step
        assert sum(map(float, rewards)) / 16 == val_reward[step]
    # training samples every 3 steps (0, 3) and at the last one (4 = max_steps - 1)
    train = _tables(acc, "samples/train")
    assert sorted(train) == [0, 3, 4]
    assert all(len(rows) == 16 for rows in train.values())  # 4 prompts x 4 responses
