"""Deterministic failures for the run-safety tests (named by class_path in their configs)."""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback

from rl_lightning.algorithms import LossTerm
from rl_lightning.envs import ExactMatchReward, Prompt


class PoisonedReward(ExactMatchReward):
    """Exact match, but raises on the prompts listed in ``poison`` (so the failing step is known in advance)."""

    def __init__(self, poison: list[str]) -> None:
        super().__init__()
        self.poison = set(poison)

    def __call__(self, prompt: Prompt, response: str) -> float:
        if prompt.text in self.poison:
            raise ValueError(f"cannot score {prompt.text!r}")
        return super().__call__(prompt, response)


class NonFiniteAtStep(LossTerm):
    """A ``LossTerm`` that is 0, except NaN on the ``call``-th micro-batch (0-based) of step ``step``."""

    def __init__(self, step: int, call: int = 0) -> None:
        self.step, self.call = step, call
        self._seen: tuple[int, int] = (-1, 0)

    def loss_term(self, module: Any, batch: Any, logprobs: torch.Tensor, weights: torch.Tensor):
        step, count = self._seen
        count = count + 1 if step == module.global_step else 1
        self._seen = (module.global_step, count)
        scale = float("nan") if module.global_step == self.step and count - 1 == self.call else 0.0
        return (logprobs * weights).sum() * scale, {}


class SlowSteps(Callback):
    """Sleeps ``seconds`` at the start of every step from ``step`` on (a step long enough to be interrupted in)."""

    def __init__(self, step: int, seconds: float) -> None:
        self.step, self.seconds = step, seconds

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            time.sleep(self.seconds)


class RaiseAtStep(Callback):
    """Raises ``RuntimeError`` at the start of step ``step`` (a crash in the middle of a run)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            raise RuntimeError(f"RaiseAtStep: a crash at step {trainer.global_step}")
