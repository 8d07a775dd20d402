"""The ``rl-lightning`` command: ``LightningCLI`` with any ``RLModule`` and any ``RolloutDataModule``.

    rl-lightning fit --config configs/grpo.yaml [--trainer.max_steps 20] [--print_config]

Two things differ from a plain ``LightningCLI``:

* A configuration error found by the library's own checks (a bad value, a missing model directory, a
  malformed prompt file, a data setting the method cannot use) ends the command with one line naming the
  config section and the problem, exit status 2, instead of the chained tracebacks ``jsonargparse`` and
  Lightning wrap it in. ``RL_LIGHTNING_TRACEBACK=1`` shows the full traceback.
* ``--ckpt_path FILE`` resumes with the configuration given, not with the hyperparameters stored in the
  checkpoint (Lightning's default silently replaces the ``model`` section with them, so command-line
  overrides of ``model.init_args.*`` had no effect). Settings that differ from the checkpoint's are listed
  in a warning; a checkpoint of another method is refused.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

import rl_lightning

from rl_lightning.algorithms.base import RLModule
from rl_lightning.rollout.datamodule import RolloutDataModule


# RLModule checkpoints after the step on purpose (the state after k updates, with the stream at k).
warnings.filterwarnings("ignore", message=".*ModelCheckpoint with manual optimization.*")


class RLCLI(LightningCLI):
    """LightningCLI in subclass mode for the model (``--model GRPO``) and the data module."""

    def _parse_ckpt_path(self) -> None:
        """Keep the configuration's model settings on resume; warn about those that differ from the checkpoint's."""
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        ckpt_path = self.config[subcommand].get("ckpt_path")
        model = self.config[subcommand].get("model")
        if not ckpt_path or not Path(ckpt_path).is_file() or model is None:
            return  # "last" / "best" are resolved by Lightning later, from the same configuration
        saved = dict(torch.load(ckpt_path, weights_only=True, map_location="cpu").get("hyper_parameters", {}))
        saved.pop("_instantiator", None)
        saved_class, given_class = saved.pop("_class_path", None), model.get("class_path")
        if saved_class and given_class and saved_class != given_class:
            raise ValueError(f"--ckpt_path {ckpt_path} was written by {saved_class}, but the configuration's model is "
                             f"{given_class}: resume with the method (model.class_path) that wrote it")
        given = model.get("init_args")
        differ = [f"model.init_args.{key}: {_plain(saved[key])!r} in the checkpoint, {_plain(given[key])!r} now"
                  for key in saved if given is not None and key in given and _plain(given[key]) != _plain(saved[key])]
        if differ:
            rank_zero_warn("Resuming from " + str(ckpt_path) + " with model settings that differ from the "
                           "checkpoint's (the configuration's values are used):\n  " + "\n  ".join(differ))

    def after_fit(self) -> None:
        logger = self.trainer.logger
        log_dir = getattr(logger, "log_dir", None)
        if log_dir:
            rank_zero_info(f"TensorBoard logs: {os.path.abspath(log_dir)}")
            rank_zero_info(f"  view them with: tensorboard --logdir {os.path.dirname(os.path.abspath(log_dir))}")


def build_cli(args: list[str] | None = None, run: bool = True) -> RLCLI:
    """Parse ``args`` (``None`` reads ``sys.argv``) and, with ``run=True``, run the subcommand."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    return RLCLI(
        RLModule,
        RolloutDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def _plain(value: Any) -> Any:
    """Comparable form of a config value (tuples and lists alike)."""
    return list(value) if isinstance(value, tuple) else value


_PACKAGE_DIR = Path(rl_lightning.__file__).resolve().parent


def configuration_error(exc: BaseException) -> BaseException | None:
    """The library's own configuration error at the root of ``exc``'s cause chain, or ``None``.

    That is a ``ValueError`` / ``TypeError`` / ``FileNotFoundError`` / ``NotADirectoryError`` raised by code in
    this package (its argument checks); errors raised elsewhere, and any other type, are not.
    """
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    if not isinstance(root, (ValueError, TypeError, FileNotFoundError, NotADirectoryError)):
        return None
    frame = root.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    if frame is None or not Path(frame.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE_DIR):
        return None
    return root


def _section(exc: BaseException) -> str:
    """``"model (rl_lightning.algorithms.GRPO)"``-like context from jsonargparse's wrapper message, if any."""
    text = str(exc)
    section = "model" if "RLModule" in text else "data" if "RolloutDataModule" in text else ""
    match = re.search(r"Given value: Namespace\(class_path='([^']+)'", text)
    if section and match:
        section += f" ({match.group(1)})"
    return section


def cli_main() -> None:
    """Entry point of the ``rl-lightning`` console script."""
    try:
        build_cli()
    except Exception as exc:  # noqa: BLE001 -- re-raised unless it is a configuration error of ours
        root = configuration_error(exc)
        if root is None or os.environ.get("RL_LIGHTNING_TRACEBACK"):
            raise
        section = _section(exc)
        where = f" in {section}" if section else ""
        print(f"rl-lightning: error{where}: {root}\n(RL_LIGHTNING_TRACEBACK=1 shows the full traceback)",
              file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    cli_main()
