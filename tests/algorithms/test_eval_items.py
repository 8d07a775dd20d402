"""Per-item outcomes of the held-out evaluation (``HeldoutEvaluation.items``, ``eval_items.csv``) and the
validation split (``RolloutDataModule(evaluation=Evaluation(split=...))``)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from rl_lightning.algorithms import GRPO
from rl_lightning.algorithms.evaluation import HeldoutEvaluation
from rl_lightning.envs import ArithmeticTask, GuessNumberTask
from tests.conftest import tiny_datamodule, tiny_trainer


def _module() -> GRPO:
    return GRPO(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))


def _items(path: Path) -> dict[int, list[tuple[str, int, float]]]:
    rows: dict[int, list[tuple[str, int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.setdefault(int(row["step"]), []).append((row["split"], int(row["item"]), float(row["reward"])))
    return rows


def _fit(tmp_path: Path, steps: int, **data) -> tuple[GRPO, object, Path]:
    module, dm = _module(), tiny_datamodule(**data)
    logger = CSVLogger(str(tmp_path), name="run", version=0)
    trainer = tiny_trainer(tmp_path, max_steps=steps, logger=logger, limit_val_batches=1.0, val_check_interval=1,
                           check_val_every_n_epoch=None)
    trainer.fit(module, datamodule=dm)
    return module, dm, Path(logger.log_dir) / HeldoutEvaluation.ITEMS_FILE


def test_every_evaluation_logs_each_items_reward_in_heldout_order(tmp_path):
    module, dm, path = _fit(tmp_path, steps=2)
    rows = _items(path)
    history = dict(module.val_history)
    assert sorted(rows) == sorted(history) == [0, 1, 2]
    for step, items in rows.items():
        assert [i for _, i, _ in items] == list(range(16))  # every held-out item once, in order
        assert {s for s, _, _ in items} == {"test"}
        assert all(r in (0.0, 1.0) for _, _, r in items)  # exact match
        # 16 rewards of 0 or 1: both means are k/16, exact in float32 and float64
        assert sum(r for _, _, r in items) / 16 == history[step]
    # the item order is the data module's held-out order: a fresh greedy evaluation of the trained policy
    # reproduces the last evaluation item by item
    got: dict[int, float] = {}
    dm.evaluate(on_batch=lambda b: got.update(zip(b.prompt_index.tolist(), b.rewards.tolist())))
    assert [got[i] for i in range(16)] == [r for _, _, r in rows[2]]


def test_validation_split_is_evaluated_when_asked(tmp_path):
    task = ArithmeticTask(num_heldout=16, num_validation=12)
    module, dm, path = _fit(tmp_path, steps=1, task=task, split="validation")
    rows = _items(path)
    assert sorted(rows) == [0, 1]
    for step, items in rows.items():
        assert len(items) == 12 and {s for s, _, _ in items} == {"validation"}
        assert sum(r for _, _, r in items) / 12 == pytest.approx(dict(module.val_history)[step], abs=1e-7)
    assert [p.text for p in dm.heldout_prompts()] == [p.text for p in task.validation_prompts()]


def test_a_task_without_a_validation_split_is_refused_in_one_line():
    dm = tiny_datamodule(task=GuessNumberTask(), split="validation")
    with pytest.raises(ValueError, match=r"^data.init_args.evaluation.split='validation': GuessNumberTask has no "
                                         r"validation split") as err:
        dm.heldout_prompts()
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="evaluation.split"):
        tiny_datamodule(split="train")


def test_items_survive_a_checkpoint_and_the_file_holds_only_the_resumed_runs_evaluations(tmp_path):
    class Stub:  # what _write_items reads of a trainer
        is_global_zero = True
        logger = type("L", (), {"log_dir": str(tmp_path)})()
        datamodule = tiny_datamodule()

    callback = HeldoutEvaluation()
    callback.items = {0: [1.0, 0.0], 5: [1.0, 1.0], 10: [0.0, 0.5]}
    callback.history = [(0, 0.5), (5, 1.0), (10, 0.25)]
    callback.last_step = 10
    callback._write_items(Stub())
    assert sorted(_items(tmp_path / "eval_items.csv")) == [0, 5, 10]
    state = callback.state_dict()
    state["items"].pop(10)  # a checkpoint written at step 5
    resumed = HeldoutEvaluation()
    resumed.load_state_dict(state)
    assert resumed.items == {0: [1.0, 0.0], 5: [1.0, 1.0]}
    resumed._write_items(Stub())  # what on_train_start does after loading the checkpoint
    rows = _items(tmp_path / "eval_items.csv")
    assert sorted(rows) == [0, 5] and rows[5] == [("test", 0, 1.0), ("test", 1, 1.0)]
