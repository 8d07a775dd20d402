"""Environments: episodes of text turns, in the gymnasium convention the agent suites use.

    observation, info = env.reset(seed=..., options=...)
    observation, reward, terminated, truncated, info = env.step(action_text)
    state = env.snapshot(); ...; env.restore(state)        # branch a saved mid-episode state

An episode starts with the first observation (the prompt the model answers); each ``step`` takes the model's
turn as text (decoded from the sampled tokens, without EOS) and returns the next observation (the text the
model sees before its next turn, e.g. "higher"), the reward of that turn, and whether the episode ended
(``terminated``: by the environment's rules; ``truncated``: by a limit). A single-turn task is an environment
with one step (``SingleTurnEnv``): the data module runs every task through the same episode loop.

Environments are created per episode by their task (``Task.make_env``) from the prompt, so an episode is
reproducible from the prompt's stream index. ``snapshot()`` returns a deep copy of the environment's state
(deep-copyable and picklable when its attributes are); ``restore`` puts it back.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any

from rl_lightning.envs.rewards import Prompt, RewardError, RewardFunction, checked_reward, score_parts

StepResult = tuple[str, float, bool, bool, dict[str, Any]]


class Environment(ABC):
    """A text environment. Subclasses implement ``reset`` and ``step``; ``snapshot``/``restore`` copy the
    instance's attributes (override them when the state lives elsewhere)."""

    @abstractmethod
    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode; return the first observation (the prompt text) and an info dict."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the model's turn ``action``; return ``(observation, reward, terminated, truncated, info)``.

        ``reward`` is one finite real number, as a reward function's (``int``/``float``/``bool``, a NumPy scalar,
        a 0-dim tensor); anything else is refused with a ``RewardError`` naming the episode, turn and action.

        An action the environment cannot parse gets the environment's defined outcome (an observation saying
        so, a reward), never an exception.
        """

    def snapshot(self) -> Any:
        """A deep copy of the environment's state, for ``restore`` (e.g. to branch an episode n times)."""
        return copy.deepcopy(vars(self))

    def restore(self, state: Any) -> None:
        """Put back a state that ``snapshot`` returned (the state itself is not consumed)."""
        vars(self).clear()
        vars(self).update(copy.deepcopy(state))


#: the step info's key of a reward's named parts (``{name: value}``, summed over an episode's turns)
REWARD_PARTS = "reward_parts"


class SingleTurnEnv(Environment):
    """One prompt, one answer: the first observation is the prompt's text, the only step scores the answer.

    Args:
        prompt: the prompt (its ``answer`` is the reward function's reference).
        reward_fn: scores the response; its failures raise ``RewardError`` naming prompt and response.
    """

    def __init__(self, prompt: Prompt, reward_fn: RewardFunction) -> None:
        self.prompt = prompt
        self.reward_fn = reward_fn

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        return self.prompt.text, {}

    def step(self, action: str) -> StepResult:
        """Score ``action``; a reward function with named parts (``WeightedRewards``) also returns them in the
        info (``reward_parts``), which the rollout logs as ``train/reward/<name>``."""
        reward, parts = score_parts(self.reward_fn, self.prompt, action)
        return "", reward, True, False, {REWARD_PARTS: parts} if parts else {}

    def snapshot(self) -> Any:
        return {}  # stateless: the prompt and the reward function never change

    def restore(self, state: Any) -> None:
        return None


class EnvError(RuntimeError):
    """An environment raised: names the episode (prompt), the turn and the action."""


def env_step(env: Environment, action: str, prompt: Prompt, turn: int) -> StepResult:
    """``env.step(action)`` with a failure turned into ``EnvError`` naming prompt, turn and action.

    A ``RewardError`` (a reward function that raised inside a single-turn step) passes unchanged; a turn reward
    that is not one finite real number (``None``, a string, NaN, a sequence) is refused with a ``RewardError``
    naming the environment, prompt, turn and action, as a reward function's is.
    """
    where = f"(episode prompt={prompt.text!r}, turn {turn}, action={action!r})"
    try:
        observation, reward, terminated, truncated, info = env.step(action)
    except RewardError:
        raise
    except Exception as err:  # noqa: BLE001 -- re-raised with the episode's context
        raise EnvError(f"environment {type(env).__name__} raised {type(err).__name__}: {err} {where}") from err
    reward = checked_reward(reward, f"environment {type(env).__name__}.step", f"for the turn reward {where}")
    return str(observation), reward, bool(terminated), bool(truncated), dict(info or {})
