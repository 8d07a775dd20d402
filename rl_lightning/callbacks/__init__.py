"""Cross-cutting behaviour that plugs into any method: KL regularisers, critic schedules, sample logging."""

from rl_lightning.callbacks.critic import CriticWarmup, FreezeCriticModules
from rl_lightning.callbacks.kl import KLRegularizer
from rl_lightning.callbacks.samples import RolloutSamples

__all__ = ["CriticWarmup", "FreezeCriticModules", "KLRegularizer", "RolloutSamples"]
