"""``RLProgressBar``: one bar over the run's training steps, with the latest reward and held-out reward.

A run is one endless "epoch" over the prompt stream and ``trainer.max_steps`` is its budget, so Lightning's
bar (``Epoch 0``, a total of ``inf``, ``v_num``) says nothing useful. This one reads

    step 120/200 |██████    | [01:40<01:07, 1.19it/s, reward=0.562, val/reward=0.410]

``reward`` is the step's mean training reward, ``val/reward`` the last held-out evaluation's (from the one
before training on); validation shows a short transient ``validating`` bar.
"""

from __future__ import annotations

import sys
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, convert_inf
from typing_extensions import override

from rl_lightning.rollout.batch import RolloutBatch


class RLProgressBar(TQDMProgressBar):
    """The training bar counts ``trainer.global_step`` up to ``trainer.max_steps`` and shows ``reward`` and
    ``val/reward`` (and any other metric logged with ``prog_bar=True``), never ``v_num``.

    Args:
        refresh_rate: update the bar every this many steps (as in ``TQDMProgressBar``).
        process_position: bar position, for several processes writing bars (as in ``TQDMProgressBar``).
    """

    BAR_FORMAT = "{desc} {n_fmt}/{total_fmt} |{bar}| [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"
    #: shown before the step counter
    train_label = "step"
    #: the description of the (transient) validation bar
    validation_label = "validating"
    #: metrics shown first, in this order, once they exist
    leading_metrics = ("reward", "val/reward")

    def __init__(self, refresh_rate: int = 1, process_position: int = 0) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position)
        self._heldout_reward: float | None = None

    # ------------------------------------------------------------------ what the bar shows
    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        metrics = dict(trainer.progress_bar_metrics)  # no get_standard_metrics: no v_num
        if self._heldout_reward is not None:  # the step-0 evaluation runs outside Lightning's logging
            metrics["val/reward"] = self._heldout_reward
        leading = {k: metrics.pop(k) for k in self.leading_metrics if k in metrics}
        return {**leading, **metrics}

    def on_heldout_evaluated(
        self, trainer: Trainer, module: LightningModule, batch: RolloutBatch, step: int, reward: float
    ) -> None:
        """``HeldoutObserver``: keep the latest held-out reward (the step-0 one is not in Lightning's metrics)."""
        self._heldout_reward = reward
        try:
            bar = self.train_progress_bar
        except TypeError:  # the step-0 evaluation runs before training opens the bar
            return
        if not bar.disable:
            bar.set_postfix(self.get_metrics(trainer, module))

    # ------------------------------------------------------------------ the training bar: steps, not epochs
    @override
    def init_train_tqdm(self) -> Tqdm:
        return Tqdm(desc=self.train_label, total=self._total_steps(self.trainer), initial=self.trainer.global_step,
                    position=2 * self.process_position, disable=self.is_disabled, leave=True, dynamic_ncols=True,
                    file=sys.stdout, smoothing=0, bar_format=self.BAR_FORMAT)

    def _total_steps(self, trainer: Trainer) -> int | None:
        return trainer.max_steps if trainer.max_steps is not None and trainer.max_steps > 0 else None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # a resumed run starts at its step (``initial`` keeps the rate and the time left right)
        self.train_progress_bar = self.init_train_tqdm()

    @override
    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        pass  # one bar for the whole run, opened in on_train_start: epochs do not reset the step count

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = trainer.global_step
        bar = self.train_progress_bar
        if bar.disable:
            return
        if n % self.refresh_rate == 0 or n == bar.total:
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.refresh()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.train_progress_bar.disable:  # closed by on_train_end, not here
            self.train_progress_bar.n = trainer.global_step
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    # ------------------------------------------------------------------ validation: one short transient bar
    @override
    def init_validation_tqdm(self) -> Tqdm:
        has_main_bar = self.trainer.state.fn != "validate"
        return Tqdm(desc=self.validation_label, position=2 * self.process_position + has_main_bar,
                    disable=self.is_disabled, leave=not has_main_bar, dynamic_ncols=True, file=sys.stdout,
                    bar_format=self.BAR_FORMAT)

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not self.has_dataloader_changed(dataloader_idx):
            return
        bar = self.val_progress_bar
        bar.reset(total=convert_inf(self.total_val_batches_current_dataloader))
        bar.set_description_str(self.sanity_check_description if trainer.sanity_checking else self.validation_label,
                                refresh=False)
