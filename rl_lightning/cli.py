"""The ``rl-lightning`` command: ``LightningCLI`` with any ``RLModule`` and any ``RolloutDataModule``.

    rl-lightning fit --config configs/grpo.yaml [--trainer.max_steps 20] [--print_config]
"""

from __future__ import annotations

import os
import warnings

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from rl_lightning.algorithms.base import RLModule
from rl_lightning.rollout.datamodule import RolloutDataModule


# RLModule checkpoints after the step on purpose (the state after k updates, with the stream at k).
warnings.filterwarnings("ignore", message=".*ModelCheckpoint with manual optimization.*")


class RLCLI(LightningCLI):
    """LightningCLI in subclass mode for the model (``--model GRPO``) and the data module."""

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


def cli_main() -> None:
    """Entry point of the ``rl-lightning`` console script."""
    build_cli()


if __name__ == "__main__":
    cli_main()
