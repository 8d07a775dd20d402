"""GRPO on continuations from saved states: ``BranchRollout``, ``Branch.from_rollout`` and ``BranchStore`` at work."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from rl_lightning.algorithms import GRPO
from rl_lightning.rollout import Branch, BranchStore, PromptBatch, RolloutBatch, RolloutInputs


class ReplayGRPO(GRPO):
    """Each step continues ``n`` times (``BranchRollout``) from the step's prompts and from ``replay`` end states
    of earlier steps' cut episodes, ``horizon`` turns each, within ``episode_tokens`` per whole episode. One process
    (each rank would keep its own store)."""

    def __init__(self, replay: int = 2, horizon: int = 2, episode_tokens: int = 32, capacity: int = 64,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.replay, self.horizon, self.episode_tokens = replay, horizon, episode_tokens
        self.store = BranchStore(capacity)  # checkpointed below as plain values (weights_only loads it)

    @override
    def rollout_inputs(self) -> RolloutInputs:
        """Declared once: the data module's ``BranchRollout`` calls ``branches`` at every step (another strategy is
        refused, naming ``data.init_args.strategy``)."""
        return RolloutInputs(branches=self.branches)

    def branches(self, step: int, prompts: PromptBatch) -> list[Branch]:
        """The step's prompts from their start, then replayed end states (seeded by the step)."""
        fresh = [Branch(p, prompt_index=i, max_turns=self.horizon) for i, p in zip(prompts.indices, prompts.prompts)]
        return fresh + self.store.sample(self.replay, torch.Generator().manual_seed(step))

    @override
    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        for row, end in enumerate(batch.ends.states):  # keep the cut rows' end states that leave room to go on
            if end is not None and len(end.prefix_ids) < self.episode_tokens:
                room = self.episode_tokens - len(end.prefix_ids)  # the whole episode stays within the budget
                self.store.add([Branch.from_rollout(batch, row, max_turns=self.horizon, max_tokens=room)])
        return super().compute_advantages(batch)  # GRPO on each branch's n continuations (segment rewards)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["replay_store"] = self.store.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.store.load_state_dict(checkpoint["replay_store"])
