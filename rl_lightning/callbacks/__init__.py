"""Cross-cutting behaviour that plugs into any method: KL regularisers, sample logging (critic callbacks next)."""

from rl_lightning.callbacks.kl import KLRegularizer
from rl_lightning.callbacks.samples import RolloutSamples

__all__ = ["KLRegularizer", "RolloutSamples"]
