"""Prompt samplers: which stream indices of the task a training step draws. The data module's extension point.

The data module asks its ``prompt_sampler`` for the step's *global* list of ``prompts_per_step`` indices when
the step's rollout starts -- not when the data loader prefetches the batch -- so weights a method updates in
step ``k`` decide the prompts of step ``k + 1``. Every rank computes the same global list from ``(seed,
step)`` and takes its contiguous slice, so the ranks agree without communicating, and a resumed run draws the
same prompts without any saved sampler state (the weights are the method's state, checkpointed by it).

* ``SequentialSampler`` (the default): step ``k`` takes indices ``k·P .. k·P + P - 1`` of the task's seeded
  stream (every index once, in order).
* ``WeightedSampler``: draws from a fixed pool of stream indices ``0 .. pool_size - 1`` with probabilities
  proportional to weights that a method provides (``weights_from``), e.g. SPO's prioritised sampling.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

import torch

from rl_lightning.envs.base import Prompt, Task

#: ``weights(prompts) -> [len(prompts)]`` non-negative weights (a tensor or a sequence of floats)
WeightFn = Callable[[Sequence[Prompt]], "torch.Tensor | Sequence[float]"]


class PromptSampler(ABC):
    """Chooses the task stream indices of a training step."""

    @abstractmethod
    def indices(self, task: Task, step: int, count: int, seed: int) -> list[int]:
        """The ``count`` global stream indices of training step ``step`` (the same on every rank)."""


class SequentialSampler(PromptSampler):
    """Step ``k`` takes stream indices ``k·count .. k·count + count - 1``."""

    def indices(self, task: Task, step: int, count: int, seed: int) -> list[int]:
        return list(range(step * count, (step + 1) * count))


class WeightedSampler(PromptSampler):
    """Draw ``count`` prompts of a pool of ``pool_size`` stream indices with probability ∝ weight.

    Args:
        pool_size: the pool is stream indices ``0 .. pool_size - 1`` (a dataset of that many prompts).
        replacement: draw with replacement (without: ``count`` distinct prompts per step).
        temperature: weights are raised to ``1 / temperature`` before normalising (1: as given).

    A method sets the weights with ``weights_from(fn)``: ``fn(prompts)`` is called at every draw with the
    pool's prompts (``Prompt.uid`` identifies them) and returns one weight per prompt. Until then the draw is
    uniform.
    """

    def __init__(self, pool_size: int, replacement: bool = False, temperature: float = 1.0) -> None:
        if pool_size < 1:
            raise ValueError(f"WeightedSampler: pool_size must be >= 1, got {pool_size}")
        if temperature <= 0:
            raise ValueError(f"WeightedSampler: temperature must be > 0, got {temperature}")
        self.pool_size, self.replacement, self.temperature = pool_size, replacement, temperature
        self.weight_fn: WeightFn | None = None
        self._pool: list[Prompt] | None = None

    def weights_from(self, fn: WeightFn | None) -> None:
        """Use ``fn`` for the weights from the next draw on (``None``: uniform again)."""
        self.weight_fn = fn

    def pool(self, task: Task) -> list[Prompt]:
        if self._pool is None:
            self._pool = [task.train_prompt(i) for i in range(self.pool_size)]
        return self._pool

    def indices(self, task: Task, step: int, count: int, seed: int) -> list[int]:
        if not self.replacement and count > self.pool_size:
            raise ValueError(f"WeightedSampler: {count} prompts per step without replacement from a pool of "
                             f"{self.pool_size}")
        pool = self.pool(task)
        if self.weight_fn is None:
            weights = torch.ones(len(pool), dtype=torch.float64)
        else:
            weights = torch.as_tensor(self.weight_fn(pool), dtype=torch.float64).flatten().cpu()
        if weights.shape != (len(pool),) or not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
            raise ValueError(f"WeightedSampler: the weights must be {len(pool)} finite values >= 0, got shape "
                             f"{tuple(weights.shape)} (min {float(weights.min()) if weights.numel() else 'n/a'})")
        if float(weights.sum()) == 0:
            raise ValueError("WeightedSampler: all weights are 0")
        probs = weights ** (1.0 / self.temperature)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + 17) * 1_000_033 + step)
        return torch.multinomial(probs / probs.sum(), count, replacement=self.replacement, generator=gen).tolist()
