"""Guess the number: a multi-turn environment a tiny model can learn (higher/lower feedback, a few guesses).

An episode: the first observation is ``"guess 1-31:"``; each turn the model answers a number (``"16"``); a wrong
guess is answered ``"hi:"`` (the secret is higher) or ``"lo:"`` (lower), an answer that is not a number in range
``"bad:"``; finding the secret ends the episode with reward 1, running out of guesses ends it with reward 0.
Bisection finds any secret of ``1..31`` in 5 guesses.
"""

from __future__ import annotations

import random
from typing import Any

from rl_lightning.envs.base import Prompt, RewardFunction, Task
from rl_lightning.envs.environment import Environment, StepResult


class GuessNumberEnv(Environment):
    """One episode of guess-the-number (see the module docstring).

    Args:
        secret: the number to find.
        low, high: the range announced (inclusive).
        max_guesses: guesses allowed; the episode ends (terminated, reward 0) after the last wrong one.
    """

    def __init__(self, secret: int, low: int = 1, high: int = 31, max_guesses: int = 5) -> None:
        if not low <= secret <= high:
            raise ValueError(f"GuessNumberEnv: secret {secret} outside {low}..{high}")
        self.secret, self.low, self.high, self.max_guesses = secret, low, high, max_guesses
        self.guesses: list[int | None] = []

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.guesses = []
        return f"guess {self.low}-{self.high}:", {"secret": self.secret}

    def step(self, action: str) -> StepResult:
        if self.guesses and (self.guesses[-1] == self.secret or len(self.guesses) >= self.max_guesses):
            raise RuntimeError("GuessNumberEnv: step() after the episode ended (reset() starts a new one)")
        text = action.strip()
        guess = int(text) if text.isdigit() and self.low <= int(text) <= self.high else None
        self.guesses.append(guess)
        if guess == self.secret:
            return "", 1.0, True, False, {"found": True}
        if len(self.guesses) >= self.max_guesses:
            return "", 0.0, True, False, {"found": False}
        feedback = "bad:" if guess is None else "hi:" if self.secret > guess else "lo:"
        return feedback, 0.0, False, False, {}


class GuessNumberTask(Task):
    """Guess-the-number episodes: the training stream draws secrets uniformly; the held-out set is every
    secret of the range once (greedy success over it is ``val/reward``).

    Args:
        low, high: the range (inclusive).
        max_guesses: guesses per episode (run it with ``GroupRollout(max_turns >= max_guesses)``).
        seed: seeds the training stream.
    """

    def __init__(self, low: int = 1, high: int = 31, max_guesses: int = 5, seed: int = 1234) -> None:
        if low < 0 or high <= low:
            raise ValueError(f"GuessNumberTask: need 0 <= low < high, got low={low}, high={high}")
        if max_guesses < 1:
            raise ValueError(f"GuessNumberTask: max_guesses must be >= 1, got {max_guesses}")
        self.low, self.high, self.max_guesses, self.seed = low, high, max_guesses, seed

    def _prompt(self, secret: int) -> Prompt:
        return Prompt(text=f"guess {self.low}-{self.high}:", answer=str(secret),
                      metadata={"secret": secret, "uid": secret})

    def train_prompt(self, index: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + 7919 * index + 1)
        return self._prompt(rng.randint(self.low, self.high))

    def heldout_prompts(self) -> list[Prompt]:
        return [self._prompt(secret) for secret in range(self.low, self.high + 1)]

    def make_env(self, prompt: Prompt, reward_fn: RewardFunction) -> GuessNumberEnv:
        return GuessNumberEnv(int(prompt.metadata["secret"]), self.low, self.high, self.max_guesses)

    def episode_turns(self) -> int:
        return self.max_guesses
