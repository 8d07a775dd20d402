"""Prompts and the reward functions that score a response to one.

The bottom of ``rl_lightning.envs``: tasks (``envs.base``) and environments (``envs.environment``) build on it.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from rl_lightning.functional.errors import ConfigError


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


class WeightedRewards(RewardFunction):
    """Several reward functions in one: the reward is ``Σ_k w_k r_k``; each ``r_k`` is also logged on its own as
    ``train/reward/<name>`` (its mean over the step's responses, before weighting).

    Args:
        rewards: the reward functions by name, e.g. ``{correct: NumericAnswerReward, format: BoxedFormatReward}``
            (names become metric names: letters, digits, ``_`` and ``-``).
        weights: ``w_k`` by name; a name left out weighs 1.
    """

    def __init__(self, rewards: dict[str, RewardFunction], weights: dict[str, float] | None = None) -> None:
        weights = dict(weights or {})
        if not rewards:
            raise ConfigError("WeightedRewards: rewards must name at least one reward function")
        bad = [n for n in rewards if not re.fullmatch(r"[A-Za-z0-9_-]+", n)]
        if bad:
            raise ConfigError(f"WeightedRewards: reward names {bad} must be letters, digits, _ or - (metric names)")
        unknown = sorted(set(weights) - set(rewards))
        if unknown:
            raise ConfigError(f"WeightedRewards: weights {unknown} name no reward (rewards: {sorted(rewards)})")
        self.rewards, self.weights = dict(rewards), {n: float(weights.get(n, 1.0)) for n in rewards}

    def parts(self, prompt: Prompt, response: str) -> dict[str, float]:
        """Each reward function's value for ``response`` (checked like any reward), by name."""
        return {name: score(fn, prompt, response) for name, fn in self.rewards.items()}

    def combine(self, parts: dict[str, float]) -> float:
        """The weighted sum of ``parts``."""
        return sum(self.weights[name] * value for name, value in parts.items())

    def __call__(self, prompt: Prompt, response: str) -> float:
        return self.combine(self.parts(prompt, response))


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


def score_parts(reward_fn: RewardFunction, prompt: Prompt, response: str) -> tuple[float, dict[str, float]]:
    """``(reward, parts)``: for a reward function with named parts (``parts`` and ``combine``, as
    ``WeightedRewards``) its parts and their combination, scored once; for any other, ``score`` and no parts."""
    if not (hasattr(reward_fn, "parts") and hasattr(reward_fn, "combine")):
        return score(reward_fn, prompt, response), {}
    parts = reward_fn.parts(prompt, response)
    inputs = f"(prompt={prompt.text!r}, response={response!r})"
    return checked_reward(reward_fn.combine(parts), f"reward function {_reward_name(reward_fn)}", inputs), parts


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
