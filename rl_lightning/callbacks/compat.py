"""Every private name of Lightning and jsonargparse that rl_lightning uses, and nothing else.

Checked against lightning 2.6.6 and jsonargparse 4.53.0 (the versions in the project's environment). Each entry
names the source it relies on; after an upgrade, read those lines again. ``tests/test_cli.py`` checks that every
name used here still exists, so a rename fails there first, by name, and not somewhere in a run.

The rest of the package uses only public API; where it needs one of these, it calls the function here.
"""

from __future__ import annotations

import time
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger


def dump_checkpoint(trainer: Trainer) -> dict[str, Any]:
    """The full checkpoint ``trainer.save_checkpoint`` would write, as a dict in memory (no file).

    lightning 2.6.6: ``Trainer._checkpoint_connector`` (trainer/trainer.py:431) and
    ``_CheckpointConnector.dump_checkpoint(weights_only)`` (trainer/connectors/checkpoint_connector.py:415);
    ``weights_only=False`` is passed so that it does not log "`weights_only` was not set" on every call.
    """
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def stale_last_checkpoint(callback: Any, trainer: Trainer) -> bool:
    """Whether ``callback`` (a ``ModelCheckpoint`` with ``save_last``) wrote a ``last`` checkpoint during the run
    but not at its final step -- which its own ``on_train_end`` then leaves as it is.

    lightning 2.6.6: ``ModelCheckpoint.on_train_end`` (callbacks/model_checkpoint.py:535) saves ``last`` only when
    ``_last_checkpoint_saved`` is empty, i.e. when nothing was saved before, so a run of 120 steps with
    ``every_n_train_steps: 50`` ends with the ``last.ckpt`` of step 100; ``_last_global_step_saved``
    (model_checkpoint.py:601) is the step of its latest save.
    """
    return bool(callback.save_last) and bool(callback._last_checkpoint_saved) and (
        callback._last_global_step_saved != trainer.global_step)


def save_every_n_train_steps(callback: Any, trainer: Trainer) -> None:
    """What ``ModelCheckpoint.on_train_batch_end`` does for a manual-optimisation module, without its notice.

    lightning 2.6.6 (callbacks/model_checkpoint.py:349-422): at a step that is a multiple of
    ``_every_n_train_steps``, unless ``_should_skip_saving_checkpoint``, it saves ``_save_topk_checkpoint`` and
    ``_save_last_checkpoint`` with ``_monitor_candidates`` (deferring to validation when the monitored metric is not
    logged yet), and warns once that the files hold the state after the optimiser step.
    """
    if callback._every_n_train_steps < 1 or trainer.global_step % callback._every_n_train_steps:
        return
    if callback._should_skip_saving_checkpoint(trainer):
        return
    candidates = callback._monitor_candidates(trainer)
    if callback.monitor is not None and callback.monitor not in candidates:
        callback._defer_save_until_validation = True
        return
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)
    callback._last_time_checked = time.monotonic()


def set_purge_step(logger: TensorBoardLogger, step: int) -> None:
    """Make the logger's event writer drop the events at and after ``step`` (a resumed run's curves continue).

    Must run before the logger's first use. lightning 2.6.6: ``TensorBoardLogger._kwargs`` holds the keyword
    arguments its ``SummaryWriter`` is built with, lazily (fabric/loggers/tensorboard.py:109 and 195).
    """
    logger._kwargs["purge_step"] = step


def signature_parameters(cls: type) -> dict[str, Any]:
    """The ``__init__`` parameters jsonargparse accepts for ``cls``, with their annotations: along ``**kwargs`` up
    the class hierarchy, less those a subclass passes itself (``super().__init__(scale_rewards=False, **kwargs)``).

    jsonargparse 4.53.0: ``_parameter_resolvers.get_signature_parameters(cls, "__init__")`` (its resolver for
    ``add_class_arguments``; the public API has no read-only form of it). A class it cannot read gives ``{}``.
    """
    from jsonargparse._parameter_resolvers import get_signature_parameters

    try:
        return {p.name: p.annotation for p in get_signature_parameters(cls, "__init__", logger=False)}
    except Exception:  # noqa: BLE001 -- an unreadable signature is not judged
        return {}


class StackingParser(LightningArgumentParser):
    """A parser whose subclass may rewrite each loaded config before it is applied over the one before it.

    jsonargparse 4.53.0 has no public hook for that: ``ArgumentParser._apply_actions(cfg, parent_key, prev_cfg,
    skip_fn)`` (_core.py:1357) is where a ``--config`` file's values meet the values so far (``prev_cfg``;
    called from _core.py:548 and 760).
    """

    def stack_config(self, cfg: dict[str, Any], before: Namespace) -> dict[str, Any]:
        """The top-level config ``cfg`` to apply over ``before`` (by default ``cfg`` unchanged)."""
        return cfg

    def _apply_actions(self, cfg: Any, parent_key: str = "", prev_cfg: Namespace | None = None,
                       **kwargs: Any) -> Namespace:
        if isinstance(cfg, dict) and not parent_key and isinstance(prev_cfg, Namespace):
            cfg = self.stack_config(cfg, prev_cfg)
        return super()._apply_actions(cfg, parent_key, prev_cfg, **kwargs)


class CheckpointPathCLI(LightningCLI):
    """A ``LightningCLI`` whose ``--ckpt_path`` is resolved by ``resolve_ckpt_path`` instead of Lightning's own step.

    lightning 2.6.6: ``LightningCLI.__init__`` calls ``self._parse_ckpt_path()`` right after parsing (cli.py:408);
    Lightning's version (cli.py:563) loads the checkpoint's hyperparameters over the configuration's. This class
    replaces it, and no other private method of ``LightningCLI`` is overridden in this package.
    """

    def resolve_ckpt_path(self) -> None:
        """Called once the arguments are parsed, before anything is instantiated."""

    def _parse_ckpt_path(self) -> None:
        self.resolve_ckpt_path()

