"""``rl-lightning replay <run>/failures/step_<k>``: re-run a failed step exactly, without regenerating it.

``FailureDump`` wrote the step's rollout batch, the RNG state at the start of its update and the full training
state at the start of the step (``state.ckpt``). Replay builds the run from its ``config.yaml`` (no logger, no
checkpoints, nothing written), loads ``state.ckpt``, hands the data module the saved batch instead of a fresh
rollout, restores the RNG state and runs that one training step. A reward function that raised is replayed by
scoring the saved responses again. The failure's full traceback is printed (``--pdb``: a post-mortem debugger
at the failing frame); the exit status is 1 when the failure reproduces, 0 when the step runs cleanly.

The run is built by the function the caller passes (the CLI passes its ``build_cli``), so that this module does
not import the CLI that dispatches to it.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import CheckpointIO

from rl_lightning.runs import run_settings
from rl_lightning.callbacks.safety import FailureDump, GracefulInterrupt, set_rng_state
from rl_lightning.envs.base import score


class _RestoreRng(Callback):
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        set_rng_state(self.state)


def _dump_file(failure_dir: Path) -> Path:
    for name in ("batch.pt", "batch.rank0.pt"):
        if (failure_dir / name).is_file():
            return failure_dir / name
    raise FileNotFoundError(f"{failure_dir}: no batch.pt (not a failure directory written by FailureDump)")


def replay(failure_dir: str | Path, build_cli: Callable[..., Any]) -> dict[str, float]:
    """Re-run the failed step saved in ``failure_dir``; raises what the step raises, else returns its metrics.

    ``build_cli(settings, run=False, save_config=False)`` builds the run from its configuration
    (``rl_lightning.cli.build_cli``).
    """
    failure_dir = Path(failure_dir)
    dump = torch.load(_dump_file(failure_dir), map_location="cpu", weights_only=False)
    run_dir = failure_dir.resolve().parent.parent
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(f"{failure_dir}: the run's configuration {config} is missing")
    step, batch = int(dump["step"]), dump["batch"]
    settings = run_settings(config, logger=False, enable_progress_bar=False, limit_val_batches=0,
                            enable_model_summary=False, max_steps=step + 1)
    cli = build_cli(settings, run=False, save_config=False)
    if dump["where"] in ("rollout", "evaluation"):  # the reward function raised: score the saved responses again
        reward_fn = cli.datamodule.reward_fn
        for prompt, response in zip(batch.prompts, batch.responses):
            score(reward_fn, prompt, response)
        return {}
    state = failure_dir / "state.ckpt"
    if not state.is_file():
        note = ""
        info = failure_dir / "info.json"
        if info.is_file():
            import json

            note = json.loads(info.read_text()).get("note") or ""
        raise FileNotFoundError(f"{failure_dir}: no state.ckpt, so the step cannot be replayed exactly ({note})")
    trainer = cli.trainer
    skip = (ModelCheckpoint, FailureDump, GracefulInterrupt)
    trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, skip)]
    trainer.callbacks.append(_RestoreRng(dump["rng"]))
    trainer.strategy.checkpoint_io = _OwnCallbacksOnly(trainer.strategy.checkpoint_io,
                                                       {cb.state_key for cb in trainer.callbacks})
    cli.datamodule.inject(batch)
    trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=str(state))
    return {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}


class _OwnCallbacksOnly(CheckpointIO):
    """Reads checkpoints through ``inner`` without the states of callbacks the replaying trainer does not have.

    The replay leaves out the run's checkpoint, interrupt and failure-dump callbacks on purpose; Lightning would
    otherwise ask for them back ("callbacks used to create the checkpoint need to be provided"). Writes go to
    ``inner`` unchanged.
    """

    def __init__(self, inner: CheckpointIO, keep: set[str]) -> None:
        self.inner, self.keep = inner, keep

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict:
        checkpoint = self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if "callbacks" in checkpoint:
            checkpoint["callbacks"] = {k: v for k, v in checkpoint["callbacks"].items() if k in self.keep}
        return checkpoint

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def replay_main(argv: list[str], build_cli: Callable[..., Any]) -> int:
    """The ``rl-lightning replay`` subcommand (``build_cli`` as for ``replay``)."""
    parser = argparse.ArgumentParser(prog="rl-lightning replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("failure_dir", help="a <run>/failures/step_<k> directory written by FailureDump")
    parser.add_argument("--pdb", action="store_true", help="open a post-mortem debugger where the step fails")
    args = parser.parse_args(argv)
    try:
        metrics = replay(args.failure_dir, build_cli)
    except (FileNotFoundError, OSError) as err:
        print(f"rl-lightning replay: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 -- the replayed failure: shown in full, that is the point
        traceback.print_exc()
        print(f"rl-lightning replay: the failure reproduces: {type(err).__name__}: {err}", file=sys.stderr)
        if args.pdb:
            import pdb

            pdb.post_mortem(err.__traceback__)
        return 1
    shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()) if k.startswith("train/"))
    print(f"rl-lightning replay: the step ran without error{': ' + shown if shown else ''}")
    return 0
