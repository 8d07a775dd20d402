"""Cross-cutting behaviour that plugs into any method: KL regularisers, critic schedules, sample logging,
the progress bar, and run safety (atomic checkpoints, a checkpoint on interrupt, replayable failure dumps)."""

from rl_lightning.callbacks.audit import FullRolloutAudit
from rl_lightning.callbacks.critic import CriticWarmup, FreezeCriticModules
from rl_lightning.callbacks.kl import KLRegularizer
from rl_lightning.callbacks.memory import GradientCheckpointing
from rl_lightning.callbacks.progress import RLProgressBar
from rl_lightning.callbacks.reward_check import ConstantRewardWarning
from rl_lightning.callbacks.safety import (AtomicCheckpointIO, FailureDump, FinalCheckpoint, GracefulInterrupt,
                                          RunInterrupted, StepCheckpoint)
from rl_lightning.callbacks.samples import RolloutSamples

__all__ = [
    "AtomicCheckpointIO", "ConstantRewardWarning", "CriticWarmup", "FailureDump", "FinalCheckpoint", "FullRolloutAudit",
    "GradientCheckpointing", "FreezeCriticModules", "GracefulInterrupt", "KLRegularizer",
    "RLProgressBar", "RolloutSamples", "RunInterrupted", "StepCheckpoint",
]
