"""rl_lightning: reinforcement-learning post-training of language models, one small LightningModule per method.

Importing the package registers the algorithms and the data module, so configs and the command line may
name them by their short class names (``--model GRPO``).
"""

from rl_lightning.algorithms import GRPO, PPO, REINFORCE, RLOO, TRPO, PolicyGradient, RLModule, check_settings
from rl_lightning.callbacks import KLRegularizer, RolloutSamples
from rl_lightning.envs import ArithmeticTask, ExactMatchReward, JsonlTask
from rl_lightning.functional.errors import ConfigError
from rl_lightning.rollout import RolloutBatch, RolloutDataModule

__version__ = "0.1.0"

__all__ = [
    "ArithmeticTask",
    "ConfigError",
    "ExactMatchReward",
    "GRPO",
    "JsonlTask",
    "PPO",
    "PolicyGradient",
    "REINFORCE",
    "RLOO",
    "TRPO",
    "KLRegularizer",
    "RLModule",
    "RolloutBatch",
    "RolloutDataModule",
    "RolloutSamples",
    "__version__",
    "check_settings",
]
