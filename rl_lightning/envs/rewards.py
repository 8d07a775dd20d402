"""Prompts and the reward functions that score a response to one.

The bottom of ``rl_lightning.envs``: tasks (``envs.base``) and environments (``envs.environment``) build on it.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task: the text the model sees, the reference answer, and free-form metadata."""

    text: str
    answer: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def uid(self) -> int:
        """A stable id of this prompt (the same whenever and wherever it is drawn): ``metadata["uid"]`` if set,
        else a 63-bit hash of its text and answer (for per-prompt state such as SPO's tracker)."""
        if "uid" in self.metadata:
            return int(self.metadata["uid"])
        digest = hashlib.blake2b(f"{self.text}\x00{self.answer}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    def to_state(self) -> dict[str, Any]:
        """The prompt as plain values (a checkpoint loads with ``weights_only=True`` when ``metadata`` is plain)."""
        return {"text": self.text, "answer": self.answer, "metadata": dict(self.metadata)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Prompt:
        """The prompt ``to_state`` returned."""
        return cls(**state)


class RewardFunction(ABC):
    """Scores one response. Subclass it and plug it in with ``class_path`` (``data.init_args.reward_fn``)."""

    @abstractmethod
    def __call__(self, prompt: Prompt, response: str) -> float:
        """Return the scalar reward of ``response`` (the decoded generated text, without EOS) to ``prompt``.

        Any real number will do: a Python ``int``/``float``/``bool``, a NumPy scalar, or a 0-dim tensor/array.
        """


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
    """A reward function raised or returned no finite real number: the message names the prompt and response."""


def _reward_name(reward_fn: RewardFunction) -> str:
    """A plain function's own name, else the reward object's class name."""
    return getattr(reward_fn, "__qualname__", None) or type(reward_fn).__name__


def _real_number(value: object) -> float | None:
    """``value`` as a float if it is one real number, else ``None``.

    Real numbers are ``numbers.Real`` (``int``, ``float``, ``bool``, NumPy's numeric scalars) and anything
    0-dimensional whose ``item()`` is one (a 0-dim tensor or array). Strings (``"1"``), ``None``, sequences,
    multi-element tensors and complex numbers are not: ``float()`` would accept some of them silently.
    """
    if not isinstance(value, numbers.Real) and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    return float(value) if isinstance(value, numbers.Real) else None


def _short_repr(value: object, limit: int = 200) -> str:
    text = " ".join(repr(value).split())  # one line, even for a tensor's repr
    return text if len(text) <= limit else text[:limit] + "..."


def score(reward_fn: RewardFunction, prompt: Prompt, response: str) -> float:
    """Call ``reward_fn`` and turn any exception, non-number or non-finite value into a ``RewardError`` naming
    the reward function and the inputs."""
    inputs = f"(prompt={prompt.text!r}, response={response!r})"
    try:
        returned = reward_fn(prompt, response)
    except Exception as err:  # noqa: BLE001 - re-raised with context, never swallowed
        raise RewardError(
            f"reward function {_reward_name(reward_fn)} raised {type(err).__name__}: {err} {inputs}"
        ) from err
    return checked_reward(returned, f"reward function {_reward_name(reward_fn)}", inputs)


def checked_reward(value: object, source: str, context: str) -> float:
    """``value`` as a float if it is one finite real number (``_real_number``), else a ``RewardError`` naming
    ``source`` (what returned it) and ``context`` (what it was given)."""
    number = _real_number(value)
    if number is None:
        raise RewardError(
            f"{source} returned {type(value).__name__} {_short_repr(value)}, not a real number {context}")
    if not math.isfinite(number):
        raise RewardError(f"{source} returned {number} {context}")
    return number
