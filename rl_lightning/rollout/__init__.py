"""Data production: prompt streams, generation with KV cache, and the ``RolloutBatch`` container."""

from rl_lightning.rollout.batch import PromptBatch, RolloutBatch
from rl_lightning.rollout.datamodule import RolloutDataModule
from rl_lightning.rollout.engines import HFGenerateEngine, KVCacheEngine, RolloutEngine
from rl_lightning.rollout.episodes import EpisodeGeneration, sample_episodes
from rl_lightning.rollout.generation import Generation, position_ids_from_mask, sample
from rl_lightning.rollout.prompts import PromptSampler, SequentialSampler, WeightedSampler
from rl_lightning.rollout.strategies import Branch, BranchRollout, GroupRollout, RolloutStrategy

__all__ = [
    "Branch",
    "BranchRollout",
    "PromptSampler",
    "SequentialSampler",
    "WeightedSampler",
    "EpisodeGeneration",
    "GroupRollout",
    "RolloutStrategy",
    "sample_episodes",
    "Generation",
    "HFGenerateEngine",
    "KVCacheEngine",
    "PromptBatch",
    "RolloutBatch",
    "RolloutDataModule",
    "RolloutEngine",
    "position_ids_from_mask",
    "sample",
]
