"""Data production: prompt streams, rollout engines and strategies, and the ``RolloutBatch`` container."""

from rl_lightning.rollout.batch import (
    EndState, EpisodeEnds, PromptBatch, RolloutBatch, SamplerRecord, StepRequest, Turns,
)
from rl_lightning.rollout.branching import Branch, BranchRollout, BranchStore
from rl_lightning.rollout.datamodule import RolloutDataModule
from rl_lightning.rollout.encoding import PromptEncoder
from rl_lightning.rollout.engine import EngineSession, RolloutEngine, SamplingParams, Turn, check_capabilities
from rl_lightning.rollout.engines import HFGenerateEngine, KVCacheEngine, ModuleEngine
from rl_lightning.rollout.episodes import EpisodeGeneration, sample_episodes
from rl_lightning.rollout.filters import GroupFilter, RewardSpread
from rl_lightning.rollout.generation import DecodeOptions, Generation, position_ids_from_mask, sample
from rl_lightning.rollout.inputs import RolloutInputs
from rl_lightning.rollout.prompts import PromptSampler, SequentialSampler, WeightedSampler
from rl_lightning.rollout.settings import AsyncRollout, Evaluation, PromptFormat, Recording, Sampling
from rl_lightning.rollout.shaping import OverlongPenalty, RewardShaper
from rl_lightning.rollout.strategies import GroupRollout, RolloutContext, RolloutStrategy
from rl_lightning.rollout.sync import SamplerSync
from rl_lightning.rollout.vllm_engines import VLLMEngine, VLLMServerEngine

__all__ = [
    "AsyncRollout",
    "Evaluation",
    "PromptFormat",
    "Recording",
    "Sampling",
    "Branch",
    "BranchRollout",
    "BranchStore",
    "DecodeOptions",
    "EndState",
    "EpisodeEnds",
    "EngineSession",
    "EpisodeGeneration",
    "Generation",
    "GroupFilter",
    "GroupRollout",
    "HFGenerateEngine",
    "KVCacheEngine",
    "ModuleEngine",
    "OverlongPenalty",
    "PromptBatch",
    "PromptEncoder",
    "PromptSampler",
    "RewardShaper",
    "RewardSpread",
    "RolloutBatch",
    "RolloutContext",
    "RolloutDataModule",
    "RolloutEngine",
    "RolloutInputs",
    "RolloutStrategy",
    "SamplerRecord",
    "SamplerSync",
    "SamplingParams",
    "SequentialSampler",
    "StepRequest",
    "Turn",
    "Turns",
    "VLLMEngine",
    "VLLMServerEngine",
    "WeightedSampler",
    "check_capabilities",
    "position_ids_from_mask",
    "sample",
    "sample_episodes",
]
