"""One LightningModule per method; ``RLModule`` is the shared base."""

from rl_lightning.algorithms.base import LossTerm, NonFiniteLossError, RLModule
from rl_lightning.algorithms.grpo import GRPO

__all__ = ["GRPO", "LossTerm", "NonFiniteLossError", "RLModule"]
