"""The ``rl-lightning`` command: ``LightningCLI`` with any ``RLModule`` and any ``RolloutDataModule``.

    rl-lightning fit --config configs/grpo.yaml [--trainer.max_steps 20] [--print_config] [--ckpt_path last]
    rl-lightning replay runs/grpo/version_0/failures/step_000057 [--pdb]

What it adds to a plain ``LightningCLI``:

* **One run, one directory** (see ``rl_lightning.runs``): logs, ``config.yaml``, ``checkpoints/`` and
  ``failures/`` of a run live in its logger directory; ``--ckpt_path last`` / a run directory / a file resumes
  that run into the same directory (TensorBoard events after the checkpoint's step are purged); a checkpoint of
  another method, model or task is refused; a fresh run never writes into a directory that holds one.
* **Nothing lost**: checkpoint writes are atomic, SIGINT/SIGTERM write ``last.ckpt`` of the last completed step
  (``GracefulInterrupt``), a failing step is dumped for ``rl-lightning replay`` (``FailureDump``).
* **One line for every user error**: configuration errors (unknown keys -- all of them, with the closest valid
  name --, wrong types, bad values, bad checkpoints) exit with status 2, runtime failures (a reward function
  that raises, a non-finite loss) with status 1; ``RL_LIGHTNING_TRACEBACK=1`` shows the traceback.
* ``--ckpt_path FILE`` resumes with the configuration given, not the hyperparameters stored in the checkpoint
  (settings that differ are listed in a warning).
* The optimiser is set in one place, ``model.init_args.optimizer`` (the top-level ``--optimizer`` is refused).
* ``trainer.callbacks`` of a stacked config, and ``--trainer.callbacks+=CLASS [--trainer.callbacks.KEY VALUE]``,
  add to the callback list; an entry of a class already there updates that entry (``rl_lightning.cli_parser``),
  so a preset never drops the method config's callbacks and ``--trainer.callbacks+=KLRegularizer
  --trainer.callbacks.beta 0.04`` turns the configs' KL penalty on.

The callbacks every run has are ``trainer_defaults`` (``run_callbacks``), and so is the checkpoint plugin
(``trainer.plugins`` defaults to ``AtomicCheckpointIO``).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

from jsonargparse import Namespace
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

import rl_lightning
from rl_lightning import config_check, runs
from rl_lightning.callbacks import compat
from rl_lightning.algorithms.base import RLModule
from rl_lightning.callbacks.progress import RLProgressBar
from rl_lightning.callbacks.reward_check import ConstantRewardWarning
from rl_lightning.callbacks.safety import (FailureDump, FinalCheckpoint, GracefulInterrupt, RunInterrupted, RunStopped,
                                          checkpoint_dir)
from rl_lightning.cli_parser import ConfigParseError, Parser, class_switches
from rl_lightning.functional.errors import ConfigError
from rl_lightning.export import export_main
from rl_lightning.generate import generate_main
from rl_lightning.replay import replay_main
from rl_lightning.rollout.datamodule import RolloutDataModule

class _RunLineage(Callback):
    """Writes the run identity (``runs.run_identity``) into every checkpoint."""

    def __init__(self, identity: dict[str, Any]) -> None:
        self.identity = identity

    def on_save_checkpoint(self, trainer: Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint[runs.CHECKPOINT_KEY] = {"identity": self.identity}


class _SaveRunConfig(SaveConfigCallback):
    """Saves the resolved configuration as ``<run>/config.yaml`` with the run's version pinned, so that
    ``--config <run>/config.yaml --ckpt_path last`` resumes exactly that run. A resumed run keeps the original
    and writes its own configuration beside it (``config.resume-step<k>.yaml``)."""

    def __init__(self, *args: Any, resume_step: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resume_step = resume_step

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if self.already_saved:
            return
        log_dir = trainer.log_dir
        logger = _logger_config(self.config)
        if log_dir and logger is not None:
            self.config = self.config.clone()
            _logger_config(self.config).init_args.version = os.path.basename(os.path.normpath(log_dir))
        if self.resume_step is not None and log_dir and os.path.isfile(os.path.join(log_dir, self.config_filename)):
            self.config_filename = f"config.resume-step{self.resume_step}.yaml"
        super().setup(trainer, pl_module, stage)


def _logger_config(config: Namespace) -> Namespace | None:
    """The configuration's TensorBoardLogger namespace (``trainer.logger``), when it has exactly one."""
    logger = config.get("trainer", Namespace()).get("logger") if isinstance(config, Namespace) else None
    if isinstance(logger, list) and len(logger) == 1:
        logger = logger[0]
    if isinstance(logger, Namespace) and str(logger.get("class_path", "")).endswith("TensorBoardLogger"):
        return logger
    return None


def run_callbacks(identity: dict[str, Any], trainer_config: dict[str, Any]) -> list[Callback]:
    """The callbacks every run of the CLI has, after the configured ones (``trainer_defaults["callbacks"]``).

    ``identity`` (``runs.run_identity``) goes into every checkpoint; ``GracefulInterrupt``, ``FailureDump``,
    ``ConstantRewardWarning`` and ``FinalCheckpoint`` join unless ``trainer_config`` (the instantiated ``trainer``
    settings) holds one already; ``RLProgressBar`` unless it disables the bar or sets another one.
    """
    given = trainer_config.get("callbacks") or []
    given = given if isinstance(given, list) else [given]
    callbacks: list[Callback] = [_RunLineage(identity)]
    saving = trainer_config.get("enable_checkpointing") is not False
    callbacks += [cls() for cls in (GracefulInterrupt, FailureDump, FinalCheckpoint, ConstantRewardWarning)
                  if not any(isinstance(cb, cls) for cb in given) and (saving or cls is not FinalCheckpoint)]
    if trainer_config.get("enable_progress_bar") is not False and not any(isinstance(cb, ProgressBar) for cb in given):
        callbacks.append(RLProgressBar())
    return callbacks


class RLCLI(compat.CheckpointPathCLI):
    """LightningCLI in subclass mode for the model (``--model GRPO``) and the data module."""

    _resume: runs.ResumeTarget | None = None
    _started: float = 0.0

    def __init__(self, *args: Any, on_trainer: Callable[[Trainer], None] | None = None, **kwargs: Any) -> None:
        self._on_trainer = on_trainer  # told the trainer once it exists (cli_main finds its FailureDump there)
        try:
            super().__init__(*args, **kwargs)  # parses, instantiates and runs the subcommand
        except BaseException:
            self._remove_empty_run()  # a run that failed in its setup leaves no directory behind
            raise

    # ------------------------------------------------------------------ resume: which run, and is it this one
    def resolve_ckpt_path(self) -> None:
        """Resolve ``--ckpt_path`` to one run's checkpoint, refuse another run's, continue in its directory."""
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        config = self.config[subcommand]
        spec = config.get("ckpt_path")
        logger = _logger_config(config)
        run_root, version = None, None
        if logger is not None:
            run_root = Path(logger.init_args.get("save_dir") or ".") / str(logger.init_args.get("name") or "")
            version = logger.init_args.get("version")
        if not spec or spec in ("best", "hpc", "registry"):
            self._refuse_occupied_run(config, logger)
            return
        path = runs.resolve(str(spec), run_root, version)
        if path is None:
            rank_zero_warn(f"--ckpt_path last: no checkpoint of run {run_root} found; starting a new run")
            config["ckpt_path"] = None
            return
        checkpoint = runs.read_checkpoint(path)
        self._check_identity(path, checkpoint, config, str(spec), run_root)
        self._warn_changed_hyperparameters(path, checkpoint, config)
        run_dir = runs.run_dir_of(path)
        if run_dir is not None and logger is not None:  # continue writing into the checkpoint's run
            if Path(logger.init_args.get("save_dir") or ".").resolve() != run_dir.parent.parent:
                logger.init_args.save_dir = str(run_dir.parent.parent)  # as given otherwise: ModelCheckpoint
            logger.init_args.name = run_dir.parent.name  # keeps its state only when its dirpath reads the same
            logger.init_args.version = run_dir.name
        config["ckpt_path"] = str(path)
        self._resume = runs.ResumeTarget(path, run_dir, checkpoint)

    @staticmethod
    def _refuse_occupied_run(config: Namespace, logger: Namespace | None) -> None:
        if logger is None or logger.init_args.get("version") is None:
            return
        version = logger.init_args.version
        run_dir = (Path(logger.init_args.get("save_dir") or ".") / str(logger.init_args.get("name") or "")
                   / (version if isinstance(version, str) else f"version_{version}"))
        if runs.last_checkpoint_in(run_dir) is not None:
            raise runs.CheckpointError(
                f"{run_dir} already holds a run with checkpoints: resume it with --ckpt_path last, or start a new run "
                f"with --trainer.logger.init_args.version null")

    @staticmethod
    def _check_identity(path: Path, checkpoint: dict[str, Any], config: Namespace, spec: str,
                        run_root: Path | None) -> None:
        """Refuse another run's checkpoint, naming the fields that differ and the command to run instead."""
        given = runs.run_identity(config.as_dict())
        saved = (checkpoint.get(runs.CHECKPOINT_KEY) or {}).get("identity")
        if saved is None:  # a checkpoint written outside the CLI: the method is all it records
            saved_class = (checkpoint.get("hyper_parameters") or {}).get("_class_path")
            saved = {"model.class_path": saved_class} if saved_class else {}
            given = {k: v for k, v in given.items() if k in saved}
        differ = runs.identity_differences(saved, given)
        if not differ:
            return
        own = runs.newest_run_of(run_root, given) if spec == "last" and run_root is not None else None
        found = runs.run_dir_of(path)
        if own is not None:
            remedy = (f"; to resume the newest run of this configuration: --config {own / 'config.yaml'} "
                      "--ckpt_path last")
        elif found is not None:
            remedy = (f"; to resume that run with its own configuration: --config {found / 'config.yaml'} "
                      f"--ckpt_path {spec}" + ("" if spec != "last" else "; or start a new run without --ckpt_path"))
        else:
            remedy = ""
        raise runs.CheckpointError(f"--ckpt_path {path} belongs to another run; it differs in "
                                   + "; ".join(differ) + remedy)

    @staticmethod
    def _warn_changed_hyperparameters(path: Path, checkpoint: dict[str, Any], config: Namespace) -> None:
        saved = dict(checkpoint.get("hyper_parameters", {}))
        for key in ("_instantiator", "_class_path"):
            saved.pop(key, None)
        given = (config.get("model") or Namespace()).get("init_args")
        if given is None:
            return
        differ = [f"model.init_args.{key}: {_plain(saved[key])!r} in the checkpoint, {_plain(given[key])!r} now"
                  for key in saved if key in given and _plain(given[key]) != _plain(saved[key])]
        if differ:
            rank_zero_warn("Resuming from " + str(path) + " with model settings that differ from the "
                           "checkpoint's (the configuration's values are used):\n  " + "\n  ".join(differ))

    # ------------------------------------------------------------------ the trainer and the run's callbacks
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config.get(str(self.subcommand), self.config)
        trainer_config = self.config_init.get(str(self.subcommand), self.config_init).get("trainer", {})
        max_steps = trainer_config.get("max_steps")
        if isinstance(max_steps, int) and max_steps < 0:
            raise ValueError(f"trainer.max_steps={max_steps}: give the number of rollout steps (>= 0); a negative "
                             "value would train until stopped")
        given = trainer_config.get("callbacks")
        if trainer_config.get("enable_checkpointing") is False and isinstance(given, list):
            dropped = [cb for cb in given if isinstance(cb, ModelCheckpoint)]
            for cb in dropped:  # Lightning refuses the pair; the setting says what the user wants
                given.remove(cb)
            if dropped:
                rank_zero_info("rl-lightning: trainer.enable_checkpointing=false: the config's ModelCheckpoint is "
                               "dropped; this run writes no checkpoint (an interrupted run cannot resume)")
        self.trainer_defaults["callbacks"] = run_callbacks(runs.run_identity(config.as_dict()), trainer_config)
        if self.save_config_callback is not None and issubclass(self.save_config_callback, _SaveRunConfig):
            self.save_config_kwargs["resume_step"] = self._resume.step if self._resume is not None else None
        trainer = super().instantiate_trainer(**kwargs)
        if self._on_trainer is not None:
            self._on_trainer(trainer)
        if self._resume is not None and self._resume.run_dir is not None:
            for logger in trainer.loggers:  # the curves continue: later events of the old run are purged
                if isinstance(logger, TensorBoardLogger):
                    compat.set_purge_step(logger, self._resume.step)
        return trainer

    def before_instantiate_classes(self) -> None:
        """Say which settings a class switch carried over from the earlier class (``class_switches``)."""
        subcommand = self.config.get("subcommand")
        config = self.config.get(subcommand) if subcommand else self.config
        if config is None:
            return
        for line in class_switches(getattr(self.parser, "last_args", []), config.as_dict()):
            rank_zero_info(f"rl-lightning: warning: {line}")

    def before_fit(self) -> None:
        self._started = time.perf_counter()
        if self._resume is not None:
            differ = runs.architecture_differences(self._resume.checkpoint["state_dict"], self.model.state_dict())
            if differ:
                raise runs.CheckpointError(f"--ckpt_path {self._resume.path} holds another architecture than "
                                           f"model.init_args.model_name_or_path builds: " + "; ".join(differ))
            verb = f"resuming at step {self._resume.step} from {self._resume.path}"
            self._resume.checkpoint = {"global_step": self._resume.step}  # Lightning loads the file itself
        else:
            verb = "new run"
        log_dir = self.trainer.log_dir
        if log_dir:
            rank_zero_info(f"rl-lightning: run directory {os.path.abspath(log_dir)} ({verb}); checkpoints in "
                           f"{checkpoint_dir(self.trainer).resolve()}")

    def _remove_empty_run(self) -> bool:
        """Remove a new run's directory when the run logged nothing (it failed in setup, or had ``max_steps``
        0): it holds only ``config.yaml``, ``hparams.yaml`` and an empty event file. Returns whether it did."""
        trainer = getattr(self, "trainer", None)
        if (trainer is None or self._resume is not None or not trainer.log_dir or not trainer.is_global_zero
                or trainer.global_step > 0 or getattr(self.model, "val_history", None)):
            return False
        run = Path(trainer.log_dir)
        written = ("config.yaml", "hparams.yaml", "events.out.tfevents.")
        if not run.is_dir() or any(p.is_dir() or not p.name.startswith(written) for p in run.iterdir()):
            return False
        shutil.rmtree(run)
        save_dir = Path(getattr(trainer.logger, "save_dir", None) or run.parent).resolve()
        for parent in run.resolve().parents:  # runs/<name> (and runs), when this run was all they held
            if not (parent == save_dir or save_dir in parent.parents) or any(parent.iterdir()):
                break
            parent.rmdir()
        return True

    def after_fit(self) -> None:
        elapsed = time.perf_counter() - self._started
        history = list(getattr(self.model, "val_history", []) or [])
        parts = []
        if history:
            (s0, v0), (s1, v1) = history[0], history[-1]
            parts.append(f"val/reward {v0:.3f} at step {s0} -> {v1:.3f} at step {s1}")
        start = self._resume.step if self._resume is not None else 0
        resumed = f" (resumed at step {start})" if self._resume is not None else ""
        done = self.trainer.global_step - start
        parts.append(f"{done} step{'' if done == 1 else 's'} in {_duration(elapsed)}{resumed}")
        if self._remove_empty_run():
            parts.append("nothing was trained or logged, so no run directory is kept")
            rank_zero_info("rl-lightning: " + "; ".join(parts))
            return
        if checkpoint_dir(self.trainer).is_dir():
            parts.append(f"checkpoints: {checkpoint_dir(self.trainer).resolve()}")
        if self.trainer.log_dir:
            parts.append(f"logs: {os.path.abspath(self.trainer.log_dir)} (tensorboard --logdir "
                         f"{os.path.dirname(os.path.abspath(self.trainer.log_dir))})")
        rank_zero_info("rl-lightning: " + "; ".join(parts))


    def after_validate(self) -> None:
        """One line: the held-out reward, on what, from which weights, and where the per-item outcomes are."""
        metrics, data = self.trainer.callback_metrics, self.datamodule
        if "val/reward" not in metrics:
            rank_zero_info("rl-lightning: validate evaluated nothing (no held-out prompts, or limit_val_batches 0)")
            return
        config = self.config.get(str(self.subcommand), self.config)
        source = config.get("ckpt_path") or f"the initial weights of {self.model.hparams.get('model_name_or_path')}"
        count = len(data.heldout_prompts()) if hasattr(data, "heldout_prompts") else "the"
        split = data.evaluation.split if hasattr(data, "evaluation") else "test"
        parts = [f"val/reward {float(metrics['val/reward']):.3f} on {count} held-out prompts "
                 f"({split} split, greedy) from {source}"]
        if self.trainer.log_dir:
            items = Path(self.trainer.log_dir) / "eval_items.csv"
            if items.is_file():
                parts.append(f"per-item outcomes: {items.resolve()}")
            parts.append(f"logs: {os.path.abspath(self.trainer.log_dir)}")
        rank_zero_info("rl-lightning: " + "; ".join(parts))


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


def build_cli(args: list[str] | dict[str, Any] | None = None, run: bool = True, save_config: bool = True,
              on_trainer: Callable[[Trainer], None] | None = None) -> RLCLI:
    """Parse ``args`` (``None`` reads ``sys.argv``; a dict is a whole configuration) and, with ``run=True``, run
    the subcommand. ``save_config=False`` writes no ``config.yaml``; ``on_trainer`` is called with the trainer once
    it is made."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    return RLCLI(
        RLModule,
        RolloutDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=_SaveRunConfig if save_config else None,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"plugins": [{"class_path": "rl_lightning.callbacks.AtomicCheckpointIO"}]},
        parser_class=Parser,
        auto_configure_optimizers=False,
        args=args,
        run=run,
        on_trainer=on_trainer,
    )


def _plain(value: Any) -> Any:
    """Comparable form of a config value (tuples and lists alike)."""
    return list(value) if isinstance(value, tuple) else value


# ---------------------------------------------------------------------------------------------------- errors
_PACKAGE_DIR = Path(rl_lightning.__file__).resolve().parent
_NEGATIVE = re.compile(r"^-(\d|\.\d|inf\b|nan\b)", re.IGNORECASE)


def configuration_error(exc: BaseException) -> BaseException | None:
    """The library's own configuration error at the root of ``exc``'s cause chain, or ``None``.

    That is a ``ConfigError`` raised anywhere (user code included: ``check_settings``, or raised directly), or a
    ``ValueError`` / ``TypeError`` / ``FileNotFoundError`` / ``NotADirectoryError`` raised by code in this package
    (its argument checks); other errors raised elsewhere, and any other type, are not.
    """
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    config_error = next((link for link in _chain(exc) if isinstance(link, ConfigError)), None)
    if config_error is not None:
        return config_error
    if not isinstance(root, (ValueError, TypeError, FileNotFoundError, NotADirectoryError)):
        return None
    frame = root.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    if frame is None or not Path(frame.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE_DIR):
        return None
    return root


def runtime_failure(exc: BaseException) -> BaseException | None:
    """A failure of the run itself that the user must act on (a reward function that raised, a non-finite loss
    or rollout), as opposed to a bug: the exception of that kind along ``exc``'s chain, or ``None``."""
    from rl_lightning.algorithms.checks import NonFiniteLossError
    from rl_lightning.envs.base import RewardError

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (RewardError, NonFiniteLossError, FloatingPointError)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


#: Lightning's own refusals that have an rl_lightning answer: a fragment of its message -> what to do instead
LIGHTNING_HINTS = {
    "gradient accumulation is not supported for manual optimization":
        "trainer.accumulate_grad_batches: rl_lightning's methods take their optimiser steps themselves; to fit a "
        "rollout batch in memory, set model.init_args.micro_batch_size (rows per forward/backward, gradients "
        "accumulated over the batch) and leave accumulate_grad_batches at 1",
}


def lightning_refusal(exc: BaseException) -> str | None:
    """One line for a Lightning ``MisconfigurationException`` along ``exc``'s chain (with the rl_lightning answer
    where ``LIGHTNING_HINTS`` has one), or ``None``."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    for link in _chain(exc):
        if isinstance(link, MisconfigurationException):
            text = " ".join(str(link).split())
            hint = next((h for key, h in LIGHTNING_HINTS.items() if key in text.lower()), None)
            return hint or f"Lightning refused the trainer settings: {text}"
    return None


def missing_package(exc: BaseException) -> str | None:
    """One line for a package a configured class needs and this environment lacks (a logger's ``wandb``, the vLLM
    engines' ``vllm``), found along ``exc``'s chain, or ``None``."""
    for link in _chain(exc):
        if isinstance(link, ImportError):
            name = getattr(link, "name", None) or ""
            text = " ".join(str(link).split())
            if name.split(".")[0] == "vllm" or "vllm" in text:
                return (f"{text}: the vLLM engines run in their own environment: ./install_vllm.sh, then "
                        ".venv-vllm/bin/rl-lightning (docs/scaling.md#vllm)")
            return f"{text} (a configured class needs it: install it into this environment, or configure another)"
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and all(exc is not s for s in seen):
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _section(exc: BaseException) -> str:
    """``"model (rl_lightning.algorithms.GRPO)"``-like context from jsonargparse's wrapper message, if any."""
    text = str(exc)
    section = "model" if "RLModule" in text else "data" if "RolloutDataModule" in text else ""
    match = re.search(r"Given value: Namespace\(class_path='([^']+)'", text)
    if section and match:
        section += f" ({match.group(1)})"
    return section


def join_negative_values(args: list[str]) -> list[str]:
    """``--key -1e-4`` -> ``--key=-1e-4`` (argparse would take the negative number for an option)."""
    out: list[str] = []
    for arg in args:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE.match(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _fail(message: str, status: int, where: str = "") -> None:
    where = f" in {where}" if where else ""
    print(f"rl-lightning: error{where}: {message}\n(RL_LIGHTNING_TRACEBACK=1 shows the full traceback)",
          file=sys.stderr)
    raise SystemExit(status)


def cli_main(argv: list[str] | None = None) -> None:
    """Entry point of the ``rl-lightning`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "replay":
        raise SystemExit(replay_main(args[1:], build_cli))
    if args and args[0] == "export":
        raise SystemExit(export_main(args[1:], build_cli))
    if args and args[0] == "generate":
        raise SystemExit(generate_main(args[1:], build_cli))
    args = join_negative_values(args)
    traceback_wanted = bool(os.environ.get("RL_LIGHTNING_TRACEBACK"))
    if argv is None:  # LightningCLI reads sys.argv itself (and warns when given both)
        sys.argv[1:] = args
    trainers: list[Trainer] = []  # the run's trainer: its FailureDump says where a failed step was saved
    try:
        build_cli(None if argv is None else args, on_trainer=trainers.append)
    except (RunInterrupted, RunStopped) as stop:
        resume = "; resume with --ckpt_path last" if stop.path is not None else ""
        print(f"rl-lightning: {stop}{resume}", file=sys.stderr)
        raise SystemExit(128 + stop.signum) from None
    except ConfigParseError as exc:
        if traceback_wanted:
            raise
        _fail(config_check.error_line(str(exc), args), 2)
    except Exception as exc:  # noqa: BLE001 -- re-raised unless it is a user error
        if traceback_wanted:
            raise
        root = configuration_error(exc)
        if isinstance(root, ConfigError):  # raised anywhere, a reward function's call included
            _fail(str(root), 2, _section(exc))
        failure = runtime_failure(exc)
        if failure is not None:
            dump = next((cb for trainer in trainers for cb in trainer.callbacks
                         if isinstance(cb, FailureDump) and cb.dumped is not None), None)
            where, step = (dump.dumped, dump.dumped_step) if dump is not None else (None, None)
            at = f" at step {step}" if step is not None and f"step {step}" not in str(failure) else ""
            saved = (f" -- the failed step is saved in {where}; re-run it with: rl-lightning replay {where}"
                     if where else "")
            _fail(f"{type(failure).__name__}{at}: {failure}{saved}", 1)
        if root is not None:
            _fail(str(root), 2, _section(exc))
        line = lightning_refusal(exc) or missing_package(exc)
        if line is None:
            raise
        _fail(line, 2, _section(exc))


if __name__ == "__main__":
    cli_main()
