"""Tasks yield prompts from a seeded stream; reward functions score a response against a prompt.

A task is addressed by a *stream index*: ``task.train_prompt(i)`` is a pure function of the task's seed and
``i``, so a data module can shard the stream across ranks and resume it from one integer cursor.

``Prompt`` and the reward functions live in ``envs.rewards`` (below the environments); they are importable
from here too.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod

from rl_lightning.envs.environment import Environment, SingleTurnEnv
from rl_lightning.envs.rewards import (
    ExactMatchReward, Prompt, RewardError, RewardFunction, checked_reward, score,
)

__all__ = ["ExactMatchReward", "Prompt", "RewardError", "RewardFunction", "Task", "checked_reward", "score"]


#: a prompt's metadata key of its own chat messages (``[{"role", "content"}]``): with the data module's
#: ``use_chat_template`` they are rendered in place of one user message holding the prompt's text
MESSAGES = "messages"


class Task(ABC):
    """A task: a seeded training stream of prompts, two fixed held-out splits, a default verifier, and the
    environment an episode on a prompt runs in (``make_env``; one answer scored by the verifier unless a task says
    otherwise).

    The two held-out splits are the *test* split (``heldout_prompts``: what studies report) and the *validation*
    split (``validation_prompts``: what settings are tuned on). Neither is ever drawn by ``train_prompt``, and the
    two share no problem (docs/environments.md#splits). The data module evaluates one of them (its
    ``evaluation.split``).
    """

    @abstractmethod
    def train_prompt(self, index: int) -> Prompt:
        """The prompt at position ``index`` of the training stream (deterministic given the task's seed)."""

    @abstractmethod
    def heldout_prompts(self) -> list[Prompt]:
        """The test split: fixed held-out prompts (never drawn by ``train_prompt``), in a fixed order."""

    def validation_prompts(self) -> list[Prompt]:
        """The validation split: fixed prompts, in a fixed order, apart from the training stream and from the test
        split (``heldout_prompts``); settings are chosen on it. A task without one raises ``NotImplementedError``
        (the data module turns that into a one-line configuration error when ``evaluation.split="validation"``)."""
        raise NotImplementedError(f"{type(self).__name__} has no validation split")

    def default_reward(self) -> RewardFunction:
        """The verifier used when the data module is given no ``reward_fn``."""
        return ExactMatchReward()

    def needs_chat_template(self) -> bool:
        """Whether the prompts carry chat messages (``MESSAGES``) that only the chat template renders: the data
        module then refuses ``prompt_format.use_chat_template: false`` in one line. Default: no."""
        return False

    def episode_turns(self) -> int | None:
        """The most model turns an episode of this task takes: 1 with the default ``make_env`` (one answer);
        ``None`` (not said) for a task with its own environment unless it overrides this. A strategy whose
        limits are for training only (``BranchRollout``) plays held-out episodes of up to this many turns."""
        return 1 if type(self).make_env is Task.make_env else None

    def make_env(self, prompt: Prompt, reward_fn: RewardFunction) -> Environment:
        """The environment of one episode on ``prompt`` (a ``rl_lightning.envs.Environment``).

        Default: ``SingleTurnEnv`` (the prompt, one answer scored by ``reward_fn``). Multi-turn tasks return
        their own environment, built from the prompt (its metadata carries what the episode needs, e.g. a seed).
        """
        return SingleTurnEnv(prompt, reward_fn)


class PromptListTask(Task):
    """A task over fixed lists of prompts: ``_train`` is reshuffled every pass with ``seed`` (pass ``e`` in the
    order of ``random.Random(seed * 1_000_003 + e)``), ``_heldout`` is the test split. Subclasses fill both
    (``JsonlTask``, ``DatasetTask``)."""

    def __init__(self, train: list[Prompt], heldout: list[Prompt], seed: int) -> None:
        self._train, self._heldout, self.seed = train, heldout, seed
        self._order: tuple[int, list[int]] = (-1, [])  # the permutation of the last pass asked for

    def _permutation(self, epoch: int) -> list[int]:
        if self._order[0] != epoch:
            order = list(range(len(self._train)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def train_prompt(self, index: int) -> Prompt:
        epoch, offset = divmod(index, len(self._train))
        return self._train[self._permutation(epoch)[offset]]

    def heldout_prompts(self) -> list[Prompt]:
        return list(self._heldout)
