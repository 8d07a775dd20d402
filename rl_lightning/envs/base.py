"""Tasks yield prompts from a seeded stream; reward functions score a response against a prompt.

A task is addressed by a *stream index*: ``task.train_prompt(i)`` is a pure function of the task's seed and
``i``, so a data module can shard the stream across ranks and resume it from one integer cursor.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task: the text the model sees, the reference answer, and free-form metadata."""

    text: str
    answer: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


class RewardFunction(ABC):
    """Scores one response. Subclass it and plug it in with ``class_path`` (``data.init_args.reward_fn``)."""

    @abstractmethod
    def __call__(self, prompt: Prompt, response: str) -> float:
        """Return the scalar reward of ``response`` (the decoded generated text, without EOS) to ``prompt``."""


class ExactMatchReward(RewardFunction):
    """1.0 when the response equals the reference answer, else 0.0.

    Args:
        strip: compare after stripping surrounding whitespace on both sides.
    """

    def __init__(self, strip: bool = True) -> None:
        self.strip = strip

    def __call__(self, prompt: Prompt, response: str) -> float:
        if prompt.answer is None:
            raise ValueError(f"ExactMatchReward needs a reference answer; prompt {prompt.text!r} has none")
        got, want = (response.strip(), prompt.answer.strip()) if self.strip else (response, prompt.answer)
        return 1.0 if got == want else 0.0


class RewardError(RuntimeError):
    """A reward function raised: the message names the prompt and the response that broke it."""


def score(reward_fn: RewardFunction, prompt: Prompt, response: str) -> float:
    """Call ``reward_fn`` and turn any exception or non-finite value into a ``RewardError`` naming the inputs."""
    try:
        value = float(reward_fn(prompt, response))
    except Exception as err:  # noqa: BLE001 - re-raised with context, never swallowed
        raise RewardError(
            f"reward function {type(reward_fn).__name__} raised {type(err).__name__}: {err} "
            f"(prompt={prompt.text!r}, response={response!r})"
        ) from err
    if not math.isfinite(value):
        raise RewardError(
            f"reward function {type(reward_fn).__name__} returned {value} "
            f"(prompt={prompt.text!r}, response={response!r})"
        )
    return value


class Task(ABC):
    """A single-turn task: a seeded training stream, a fixed held-out set, and a default verifier."""

    @abstractmethod
    def train_prompt(self, index: int) -> Prompt:
        """The prompt at position ``index`` of the training stream (deterministic given the task's seed)."""

    @abstractmethod
    def heldout_prompts(self) -> list[Prompt]:
        """The fixed held-out prompts (never drawn by ``train_prompt``), in a fixed order."""

    def default_reward(self) -> RewardFunction:
        """The verifier used when the data module is given no ``reward_fn``."""
        return ExactMatchReward()
