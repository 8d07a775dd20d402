"""Step metrics from callbacks (issue 22, item 5): ``add_step_metrics`` from any hook of the step, reduced over
ranks (``Ranks.mean``), logged at the step's index and shown in the progress bar; ``perf/step_time`` is the step's
wall clock, callbacks' work included."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger

from rl_lightning.algorithms import GRPO
from rl_lightning.algorithms.distributed import Ranks
from rl_lightning.callbacks import RLProgressBar
from tests.conftest import tiny_datamodule, tiny_trainer


class Points(Logger):
    """Every scalar logged, by name and step."""

    def __init__(self) -> None:
        super().__init__()
        self.points: dict[str, dict[int, float]] = {}

    @property
    def name(self) -> str:
        return "points"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            self.points.setdefault(key, {})[step] = float(value)


class SlowAudit(Callback):
    """Sleeps ``seconds`` at the start and at the end of every training step; reports ``train/audit_error``
    (the step index + 0.5) from the end and ``train/audit_start`` from the start."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        time.sleep(self.seconds)
        pl_module.add_step_metrics({"train/audit_start": 1.0})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        time.sleep(self.seconds)
        pl_module.add_step_metrics({"train/audit_error": trainer.global_step - 1 + 0.5})


class ShiftedRanks(Ranks):
    """One process whose ``mean`` adds 100: shows which values went through the ranks' reduction."""

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        return value + 100.0


class Shifted(GRPO):
    @property
    def ranks(self) -> Ranks:
        return ShiftedRanks(self._trainer)


def test_callback_work_counts_in_step_time_and_callback_metrics_are_logged_per_step(tmp_path):
    points = Points()
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[SlowAudit(0.2), RLProgressBar()], logger=points,
                           enable_progress_bar=True)
    trainer.fit(GRPO(model_name_or_path="embedded:random"), datamodule=tiny_datamodule())
    p = points.points
    for step in (0, 1):
        parts = sum(p[f"perf/{k}_time"][step] for k in ("rollout", "reward", "update"))
        # the two sleeps are disjoint from the rollout and the update, all inside the step's wall clock
        assert p["perf/step_time"][step] >= parts + 0.4
        assert p["perf/tokens_per_sec"][step] == pytest.approx(
            p["train/response_length"][step] * 16 / p["perf/step_time"][step], rel=1e-5)
        assert p["train/audit_error"][step] == step + 0.5 and p["train/audit_start"][step] == 1.0
    assert trainer.progress_bar_metrics["train/audit_error"] == pytest.approx(1.5)


def test_step_time_without_slow_callbacks_is_the_rollout_and_the_update(tmp_path):
    points = Points()
    tiny_trainer(tmp_path, max_steps=2, logger=points).fit(GRPO(model_name_or_path="embedded:random"),
                                                           datamodule=tiny_datamodule())
    p = points.points
    for step in (0, 1):
        parts = sum(p[f"perf/{k}_time"][step] for k in ("rollout", "reward", "update"))
        assert parts <= p["perf/step_time"][step] < parts + 0.2  # no sleeping callback: no 0.2 s more


def test_callback_metrics_are_reduced_over_ranks(tmp_path):
    points = Points()
    tiny_trainer(tmp_path, max_steps=1, callbacks=[SlowAudit(0.0)], logger=points).fit(
        Shifted(model_name_or_path="embedded:random"), datamodule=tiny_datamodule())
    assert points.points["train/audit_error"][0] == 100.5  # through Ranks.mean, like every step metric


class OneOffRollouts(Callback):
    """Makes 3 one-off continuations of 2 of the step's prompts after the update (as an audit does) and keeps the
    tokens sampled by the step's training rollout and by the one-off rollout."""

    def __init__(self) -> None:
        self.counts: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        from rl_lightning.rollout.branching import Branch

        extra = trainer.datamodule.rollout_branches([Branch(p) for p in batch.prompts[:2]], n=3)
        assert extra.num_rows == 6
        self.counts.append((int(batch.loss_mask.sum()), int(extra.loss_mask.sum())))


def test_sampled_tokens_count_the_training_rollout_and_one_off_rollouts_but_not_evaluation(tmp_path):
    points, one_off = Points(), OneOffRollouts()
    trainer = tiny_trainer(tmp_path, max_steps=3, callbacks=[one_off], logger=points, limit_val_batches=None,
                           val_check_interval=1, check_val_every_n_epoch=None)  # an evaluation after every step
    trainer.fit(GRPO(model_name_or_path="embedded:random"), datamodule=tiny_datamodule())
    sampled = points.points["perf/sampled_tokens"]
    assert sorted(sampled) == [0, 1, 2] and sorted(points.points["val/reward"]) == [0, 1, 2, 3]
    for step, (train, extra) in enumerate(one_off.counts):
        assert train > 0 and extra > 0
        assert sampled[step] == train + extra  # the held-out rollouts between the steps add nothing


def test_sampled_tokens_of_a_plain_step_are_its_response_tokens(tmp_path):
    points = Points()
    tiny_trainer(tmp_path, max_steps=2, logger=points).fit(GRPO(model_name_or_path="embedded:random"),
                                                           datamodule=tiny_datamodule())
    p = points.points
    for step in (0, 1):  # 16 rows of the tiny data module, the mean response length each
        assert p["perf/sampled_tokens"][step] == pytest.approx(p["train/response_length"][step] * 16, rel=1e-6)


def test_no_mixin_of_rlmodule_overrides_a_lightning_hook_and_steplog_closes_the_step():
    """The step's clock and closing log live in one named callback (StepLog), not in a mixin's Lightning hook: no
    class RLModule mixes in besides LightningModule defines a name of LightningModule's, and StepLog is the last
    callback a method brings, so the Trainer's callbacks run before it."""
    from lightning.pytorch import LightningModule

    from rl_lightning.algorithms import RLModule
    from rl_lightning.algorithms.step_log import StepLog

    lightning_names = {name for klass in LightningModule.__mro__ for name in vars(klass)}
    mixins = [k for k in RLModule.__mro__[1:] if k not in LightningModule.__mro__]
    assert mixins  # LearnerForward, StepLogging
    for mixin in mixins:
        overridden = sorted(set(vars(mixin)) & lightning_names - {"__init__", "__doc__", "__module__", "__dict__",
                                                                  "__weakref__", "__annotations__", "__qualname__"})
        assert overridden == [], (mixin.__name__, overridden)
    assert isinstance(GRPO(model_name_or_path="embedded:random").configure_callbacks()[-1], StepLog)


def test_training_step_returns_the_totals_steplog_logs_from(tmp_path):
    from rl_lightning.algorithms.step_log import STEP_TOTALS, StepTotals

    seen: list[Any] = []

    class Outputs(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            seen.append(outputs[STEP_TOTALS])

    tiny_trainer(tmp_path, max_steps=2, callbacks=[Outputs()]).fit(GRPO(model_name_or_path="embedded:random"),
                                                                    datamodule=tiny_datamodule())
    assert [type(t) for t in seen] == [StepTotals, StepTotals]
    assert [t.step for t in seen] == [0, 1]
    assert all(t.rows == seen[0].rows > 0 and t.tokens > 0 for t in seen)
