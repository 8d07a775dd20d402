"""RLProgressBar: the training bar counts steps up to max_steps and shows reward and val/reward, no v_num."""

from __future__ import annotations

from typing import Any

import pytest
from lightning.pytorch import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from rl_lightning.algorithms import GRPO, HeldoutObserver
from rl_lightning.callbacks import RLProgressBar
from tests.conftest import tiny_datamodule, tiny_trainer


class WatchBar(Callback):
    """Snapshots of the progress bar after each training step and during each validation."""

    def __init__(self) -> None:
        self.train: list[dict[str, Any]] = []
        self.val_desc: list[str] = []
        self.heldout: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        bar = trainer.progress_bar_callback
        tqdm = bar.train_progress_bar
        self.train.append({"step": trainer.global_step, "desc": tqdm.desc, "n": tqdm.n, "total": tqdm.total,
                           "postfix": tqdm.postfix, "metrics": dict(bar.get_metrics(trainer, pl_module))})

    def on_validation_batch_end(  # noqa: ANN001
            self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.val_desc.append(trainer.progress_bar_callback.val_progress_bar.desc)

    def on_heldout_evaluated(self, trainer, module, batch, step, reward) -> None:  # noqa: ANN001
        self.heldout.append((step, reward))


def test_the_bar_counts_steps_to_max_steps_and_shows_the_rewards(tmp_path):
    watch = WatchBar()
    assert isinstance(watch, HeldoutObserver) and isinstance(RLProgressBar(), HeldoutObserver)
    trainer = tiny_trainer(
        tmp_path, max_steps=4, callbacks=[RLProgressBar(), watch], enable_progress_bar=True,
        limit_val_batches=None, val_check_interval=2, check_val_every_n_epoch=None,
        logger=TensorBoardLogger(str(tmp_path)),  # a logger: Lightning's bar would show its v_num
    )
    trainer.fit(GRPO(model_name_or_path="embedded:arithmetic"), datamodule=tiny_datamodule())

    assert [s["step"] for s in watch.train] == [1, 2, 3, 4]
    for snap in watch.train:
        assert snap["desc"] == "step"  # the bar reads "step k/4", not "Epoch 0"
        assert snap["total"] == 4  # max_steps, the run's budget
        assert snap["n"] == snap["step"]  # trainer.global_step
        assert "v_num" not in snap["metrics"] and "v_num" not in snap["postfix"]
        assert list(snap["metrics"])[:2] == ["reward", "val/reward"]
        assert "reward=" in snap["postfix"] and "val/reward=" in snap["postfix"]
    assert watch.train[-1]["metrics"]["reward"] == pytest.approx(float(trainer.callback_metrics["train/reward"]))
    # val/reward is there from the first step on: the step-0 evaluation's, then each validation's
    assert [step for step, _ in watch.heldout] == [0, 2, 4]
    assert watch.train[0]["metrics"]["val/reward"] == watch.heldout[0][1]
    assert abs(watch.train[2]["metrics"]["val/reward"] - watch.heldout[1][1]) < 1e-6
    assert set(watch.val_desc) == {"validating"}
