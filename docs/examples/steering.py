"""Examples of the rollout extension points (docs/extending_advanced.md; tests/test_extending.py runs them).

* ``CountdownTask``: a multi-turn environment -- the model answers each observation ``"k:"`` with ``k - 1``;
  three turns, one point per right answer.
* ``PrioritizedGRPO``: GRPO drawing the prompts it fails most often more often (a ``WeightedSampler`` whose
  weights the method sets in every step, from a per-prompt success average keyed by ``Prompt.uid``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from typing_extensions import override

from rl_lightning.algorithms import GRPO
from rl_lightning.envs import Environment, Prompt, Task
from rl_lightning.rollout import RolloutBatch, RolloutInputs


class CountdownEnv(Environment):
    """Observation ``"k:"``; the right answer is ``k - 1``; three turns, one point per right answer."""

    def __init__(self, start: int) -> None:
        self.start, self.current = start, start

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.current = self.start
        return f"{self.current}:", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        reward = float(action.strip() == str(self.current - 1))
        self.current -= 1
        done = self.current <= self.start - 3
        return ("" if done else f"{self.current}:"), reward, done, False, {}


class CountdownTask(Task):
    """Episodes starting at 10..99; the held-out set is every fifth start."""

    def train_prompt(self, index: int) -> Prompt:
        start = 10 + (index * 7919) % 90
        if start % 5 == 0:
            start += 1  # never a held-out start
        return Prompt(f"{start}:", metadata={"start": start})

    def heldout_prompts(self) -> list[Prompt]:
        return [Prompt(f"{s}:", metadata={"start": s}) for s in range(10, 100, 5)]

    @override
    def make_env(self, prompt: Prompt, reward_fn: Any) -> CountdownEnv:
        return CountdownEnv(int(prompt.metadata["start"]))


class PrioritizedGRPO(GRPO):
    """GRPO that samples prompts by ``1 - success + floor``, with ``success`` each prompt's running average.

    Needs ``data.init_args.prompt_sampler: {class_path: rl_lightning.rollout.WeightedSampler, ...}``.

    Args:
        decay: weight of the past in the per-prompt success average.
        floor: the smallest weight (solved prompts are still drawn sometimes).
        **kwargs: ``GRPO`` arguments.
    """

    def __init__(self, decay: float = 0.8, floor: float = 0.1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.decay, self.floor = decay, floor
        self.success: dict[int, float] = {}  # Prompt.uid -> running success (saved in checkpoints below)

    @override
    def rollout_inputs(self) -> RolloutInputs:
        """Declared once: the data module hands ``prompt_weights`` to its ``WeightedSampler`` (and refuses another
        sampler, naming ``data.init_args.prompt_sampler``)."""
        return RolloutInputs(prompt_weights=self.prompt_weights)

    def prompt_weights(self, prompts: Sequence[Prompt]) -> torch.Tensor:
        """Read by the sampler when a step's prompts are drawn (after the previous update)."""
        return torch.tensor([1.0 - self.success.get(p.uid, 0.0) + self.floor for p in prompts])

    @override
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        for uid, reward in zip(batch.prompt_id.tolist(), batch.rewards.tolist()):
            self.success[uid] = self.decay * self.success.get(uid, 0.0) + (1 - self.decay) * reward
        return super().compute_advantages(batch)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["prioritized_success"] = dict(self.success)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.success = {int(k): float(v) for k, v in checkpoint.get("prioritized_success", {}).items()}
