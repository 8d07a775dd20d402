"""Run safety: atomic checkpoint writes, a checkpoint on SIGINT/SIGTERM, and a replayable dump of a failed step.

* ``AtomicCheckpointIO`` writes a checkpoint to a temporary file in the same directory and renames it over the
  target, so a write killed half-way never leaves a truncated ``last.ckpt`` (the previous one stays).
* ``GracefulInterrupt``: the first SIGINT (Ctrl-C) or SIGTERM (cluster preemption) lets the current step
  finish, writes ``last.ckpt`` of that completed step and stops the run (``RunInterrupted``); a second
  signal stops at once (``RunStopped``).
* ``FailureDump``: when a training step raises (a non-finite loss or gradient, a reward function that raises,
  ...), the step's rollout batch, its RNG state and the state at the start of the step are written to
  ``<run>/failures/step_<k>/``; ``rl-lightning replay <that directory>`` re-runs exactly that update.
* ``FinalCheckpoint``: a run that ends between two ``every_n_train_steps`` saves gets the ``last.ckpt`` of its
  final step (Lightning keeps the earlier one).

The CLI adds all four to every run (``trainer.plugins`` defaults to ``AtomicCheckpointIO``; the callbacks join
unless the configuration already holds an instance); in Python, pass them to the ``Trainer`` yourself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from rl_lightning.algorithms.evaluation import HeldoutEvaluation
from rl_lightning.callbacks import compat
from rl_lightning.rollout.batch import RolloutBatch
from rl_lightning.rollout.datamodule import RolloutDataModule

FAILURE_DIRNAME = "failures"


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose writes are atomic: temporary file beside the target, flush to disk, ``os.replace``.

    Lightning's own write is atomic only in part, so this one stays. lightning 2.6.6 ``TorchCheckpointIO
    .save_checkpoint`` (fabric/plugins/io/torch_io.py:58) calls ``_atomic_save`` (fabric/utilities/cloud_io.py:85),
    which serialises the checkpoint into a ``BytesIO`` and writes ``getvalue()`` inside an fsspec transaction. For
    a local path, fsspec (2026.9.0, implementations/local.py ``LocalFileOpener``) writes it to ``tempfile.mkstemp()``
    -- a file in the system temp directory, not beside the checkpoint -- and commits with ``shutil.move``. That is
    a rename only when ``$TMPDIR`` is on the checkpoint's file system; otherwise (a tmpfs ``/tmp``, checkpoints on
    another disk or a network file system, as on most clusters) ``shutil.move`` copies into ``last.ckpt`` in
    place, and a kill during that copy leaves it truncated (``tests/test_run_safety.py`` shows both). It also
    does not ``fsync`` and holds the checkpoint twice in memory (the buffer and its copy). This one writes the
    temporary file in the target's directory, so the rename is always on one file system.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint takes no storage_options")
        target = Path(path)
        if "://" in str(path):  # remote file systems: Lightning's own (non-atomic) write
            return super().save_checkpoint(checkpoint, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        umask = os.umask(0)
        os.umask(umask)
        try:
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 -> the permissions a plain open() would give
            with os.fdopen(fd, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def checkpoint_dir(trainer: Trainer) -> Path:
    """Where the run's checkpoints go: the ``ModelCheckpoint``'s directory, else ``<log_dir>/checkpoints``."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        return Path(callback.dirpath)
    return Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"


class GracefulInterrupt(Callback):
    """On SIGINT or SIGTERM, finish the current step, write ``last.ckpt`` of it, and stop the run.

    The signal is only noted by the handler; the decision is taken at the end of a training step or a
    validation (and agreed on by all ranks, so every rank stops after the same step). A second signal
    stops at once (``RunStopped``); the last checkpoint written stays intact.

    Once the checkpoint is written, ``Trainer.fit`` raises ``RunInterrupted`` (the CLI exits with status
    128 + the signal number, as a shell reports a process ended by that signal, and so it does after a second
    signal). Steps are named by their index, as in the logs (step ``k`` is the ``k+1``-th).

    Attributes:
        received: the signal number received, or ``None``.
        saved_path: the checkpoint written on interrupt, or ``None``.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.saved_path: Path | None = None
        self._previous: dict[int, Any] = {}
        self._trainer: Trainer | None = None
        self._step = 0  # the step the next check follows: the one running (or, between steps, the next one)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.received, self.saved_path, self._trainer = None, None, trainer
        self._step = trainer.global_step
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        trainer = self._trainer
        if self.received is not None:  # the second signal: stop now
            self._restore()
            last = checkpoint_dir(trainer) / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"
            raise RunStopped(signum, self._step, last if last.is_file() else None)
        self.received = signum
        print(f"\nrl-lightning: received {signal.Signals(signum).name}: finishing step {self._step}, then writing "
              "a checkpoint (send it again to stop at once)", flush=True)
        launcher = getattr(trainer.strategy, "launcher", None) if trainer is not None else None
        if launcher is not None and trainer.is_global_zero and hasattr(launcher, "kill"):
            launcher.kill(signum)  # processes this one started (Lightning's ddp launcher) stop too

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _check(self, trainer: Trainer) -> None:
        flag = torch.tensor(0.0 if self.received is None else 1.0, device=trainer.strategy.root_device)
        if trainer.world_size > 1:
            flag = trainer.strategy.reduce(flag, reduce_op="sum")
        if float(flag) == 0:
            return
        self._restore()
        path = checkpoint_dir(trainer) / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint):  # so that it overwrites this file after a resume (no last-v1)
            callback.last_model_path = str(path)
        trainer.save_checkpoint(path)
        self.saved_path = path
        signum = self.received if self.received is not None else signal.SIGTERM  # another rank's signal
        raise RunInterrupted(int(signum), trainer.global_step - 1, path)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._check(trainer)
        self._step = trainer.global_step

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self._step = trainer.global_step - 1  # its check follows the step it validates

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self._check(trainer)
            self._step = trainer.global_step

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore()


class StepCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` for modules that optimise by hand and checkpoint after the step's update.

    Every method here sets ``automatic_optimization = False``; the checkpoint of step k holds the weights after k
    updates with the prompt stream at k, which is what a resume needs. ``ModelCheckpoint`` writes exactly these files
    at these steps too, but warns at its first save that they hold the post-update state (a notice meant for modules
    that wanted the pre-update one). This subclass saves the same files at the same steps without that notice
    (``compat.save_every_n_train_steps``); every setting and everything else is Lightning's. The shipped configs use
    it; a plain ``ModelCheckpoint`` works the same and prints the notice once.
    """

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if pl_module.automatic_optimization:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        else:
            compat.save_every_n_train_steps(self, trainer)


class FinalCheckpoint(Callback):
    """At the end of a run, write ``last.ckpt`` of its final step when the ``ModelCheckpoint`` (``save_last``)
    last wrote it at an earlier step: with ``every_n_train_steps: 50`` and ``max_steps: 120`` Lightning keeps
    the ``last.ckpt`` of step 100 (``compat.stale_last_checkpoint``), and ``--ckpt_path last`` would train
    steps 100-119 again. Runs before the ``ModelCheckpoint``'s own ``on_train_end`` (Lightning calls checkpoint
    callbacks last), every rank (the save is collective)."""

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint) and compat.stale_last_checkpoint(callback, trainer):
            path = checkpoint_dir(trainer) / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"
            trainer.save_checkpoint(path, weights_only=callback.save_weights_only)  # as the callback writes it
            callback.last_model_path = str(path)


class RunInterrupted(Exception):
    """Raised by ``GracefulInterrupt`` out of ``Trainer.fit`` once the interrupted run's checkpoint is written.

    Stopping by an exception (not ``trainer.should_stop``) keeps Lightning from running a last validation that
    an uninterrupted run would not have run, so a resumed run logs exactly what a straight run logs.
    """

    def __init__(self, signum: int, step: int, path: Path) -> None:
        self.signum, self.step, self.path = signum, step, path
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint: {path}")


class RunStopped(BaseException):
    """Raised by ``GracefulInterrupt``'s handler on a second signal: the run stops at once, in step ``step``.

    A ``BaseException`` like ``KeyboardInterrupt`` (no ``except Exception`` on the way swallows it), but not one:
    Lightning turns a ``KeyboardInterrupt`` into exit status 1, and the CLI exits with 128 + the signal number.
    ``path`` is the last checkpoint written (``None`` if none was).
    """

    def __init__(self, signum: int, step: int, path: Path | None) -> None:
        self.signum, self.step, self.path = signum, step, path
        saved = f"the last checkpoint is {path}" if path is not None else "no checkpoint was written yet"
        super().__init__(f"stopped at once by a second {signal.Signals(signum).name} in step {step}; {saved}")


# ---------------------------------------------------------------------------------------------------- failures
def rng_state() -> dict[str, Any]:
    """The global random states a step may draw from (torch CPU and CUDA, Python's ``random``, NumPy's)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch's dependencies here
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def failed_rollout(trainer: Trainer) -> RolloutBatch | None:
    """The rollout a reward function raised in, kept by the run's ``RolloutDataModule`` (``failed_rollout``)."""
    datamodule = trainer.datamodule
    return datamodule.failed_rollout if isinstance(datamodule, RolloutDataModule) else None


class FailureDump(Callback):
    """When a training step fails, write what replaying it needs to ``<run>/failures/step_<k>/``.

    * ``batch.pt``: the step's ``RolloutBatch`` (for a reward function that raised: the generated responses, with
      the rewards scored so far), the global RNG state at the start of the update, and what failed;
    * ``state.ckpt``: a full checkpoint of the state at the start of the failing step -- the live state when no
      optimiser step of that rollout had run yet, else the snapshot taken after the previous step;
    * ``info.json``: step, error, and the replay command (``rl-lightning replay <dir>``).

    A reward function that raises in a held-out evaluation (the step-0 one included) is dumped too, to
    ``failures/eval_step_<k>/``: the evaluation's responses, which replay scores again (no state is needed).

    ``state.ckpt`` is also a valid ``--ckpt_path``: resuming from it redraws the failing step.

    Args:
        snapshot: keep an in-memory CPU copy of the state after every step, so the start of a step can be
            written even after some of its optimiser steps ran (several iterations/minibatches, a critic step).
            ``"auto"`` keeps it only for methods that took more than one optimiser step per rollout (costs one
            copy of weights and optimiser state per step); ``"never"`` / ``"always"``.
    """

    def __init__(self, snapshot: Literal["auto", "always", "never"] = "auto") -> None:
        if snapshot not in ("auto", "always", "never"):
            raise ValueError(f"FailureDump: snapshot must be 'auto', 'always' or 'never', got {snapshot!r}")
        self.snapshot = snapshot
        self.dumped: Path | None = None  # where the last failed step was saved (read by the CLI's error line)
        self.dumped_step: int | None = None
        self._batch: RolloutBatch | None = None
        self._rng: dict[str, Any] | None = None
        self._steps_in_batch = 0
        self._many_steps = snapshot == "always"
        self._snapshot: dict[str, Any] | None = None
        self._hooks: list[Any] = []

    def _count_step(self, *args: Any, **kwargs: Any) -> None:  # noqa: ARG002
        self._steps_in_batch += 1

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.dumped, self.dumped_step = None, None
        for optimizer in trainer.optimizers:
            self._hooks.append(optimizer.register_step_post_hook(self._count_step))
        self._rng = rng_state()
        if self.snapshot != "never" and trainer.world_size == 1:
            self._snapshot = _to_cpu(compat.dump_checkpoint(trainer))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # a shallow copy: fields a LossTerm adds to the batch during the step (ref_logprobs, proximal_logprobs) are
        # not kept
        self._batch = dataclasses.replace(batch) if isinstance(batch, RolloutBatch) else None
        self._rng = rng_state()
        self._steps_in_batch = 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._batch = None
        self._many_steps = self.snapshot == "always" or (self.snapshot == "auto" and self._steps_in_batch > 1)
        self._snapshot = None
        if self._many_steps and trainer.world_size == 1:
            self._snapshot = _to_cpu(compat.dump_checkpoint(trainer))
        self._rng = rng_state()
        self._steps_in_batch = 0

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._remove_hooks()
        stopped = (KeyboardInterrupt, SystemExit, RunInterrupted, RunStopped)
        if isinstance(exception, stopped) or trainer.state.fn != "fit":
            return
        evaluating = trainer.validating or any(isinstance(cb, HeldoutEvaluation) and cb.failed_step is not None
                                               for cb in trainer.callbacks)
        batch = None if evaluating else self._batch
        where = "evaluation" if evaluating else "update"
        if batch is None:
            batch, where = failed_rollout(trainer), ("evaluation" if evaluating else "rollout")
        if batch is None:
            return  # not a step's rollout, update or evaluation (setup): nothing to replay
        step = trainer.global_step
        rank = trainer.global_rank
        name = f"{'eval_' if evaluating else ''}step_{step:06d}"
        out = (Path(trainer.log_dir or trainer.default_root_dir) / FAILURE_DIRNAME / name).resolve()
        out.mkdir(parents=True, exist_ok=True)
        suffix = "" if trainer.world_size == 1 else f".rank{rank}"
        state_note = None
        if evaluating:  # a held-out rollout: replaying it is scoring its responses again, no state needed
            state_note = "a held-out evaluation's rollout: replay scores its responses again"
        elif trainer.world_size == 1:
            if self._steps_in_batch == 0:
                state = compat.dump_checkpoint(trainer)
            else:
                state = self._snapshot
            if state is not None:
                AtomicCheckpointIO().save_checkpoint(state, out / "state.ckpt")
            else:
                state_note = (f"{self._steps_in_batch} optimiser step(s) of this rollout had run and no snapshot was "
                              "kept (FailureDump(snapshot='always') keeps one)")
        else:
            state_note = "multi-process run: no state written (replay runs one process; use the last checkpoint)"
        torch.save({"batch": batch.to("cpu"), "rng": self._rng, "step": step, "where": where,
                    "optimizer_steps_before_failure": self._steps_in_batch}, out / f"batch{suffix}.pt")
        error = "".join(traceback.format_exception_only(type(exception), exception)).strip()
        info = {
            "step": step, "where": where, "rank": rank, "error": error,
            "state": "state.ckpt" if (out / "state.ckpt").is_file() else None, "note": state_note,
            "replay": f"rl-lightning replay {out}",
        }
        if rank == 0 or trainer.world_size > 1:
            (out / f"info{suffix}.json").write_text(json.dumps(info, indent=2) + "\n")
        self.dumped, self.dumped_step = out, step
