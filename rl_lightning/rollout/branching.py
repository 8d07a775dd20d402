"""``BranchRollout``: continue episodes from saved points (a prompt, a prefix of response ids, an environment
state), ``n`` times each -- TEMPO's macro-steps from saved environment states, AC2's continuations of response
prefixes. A ``RolloutStrategy`` like ``GroupRollout``, whose episode loop it shares.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from rl_lightning.envs.base import Prompt, Task
from rl_lightning.rollout.batch import PromptBatch, RolloutBatch
from rl_lightning.rollout.engine import SESSIONS
from rl_lightning.rollout.episodes import left_pad
from rl_lightning.rollout.strategies import GroupRollout, RolloutContext, _Episodes


@dataclass
class Branch:
    """A point to continue from: a prompt, the response ids after its first observation, the environment's
    state there, and the ids of the turn it is in the middle of (part of that turn's action).

    ``turns`` are the texts ``(action, observation)`` of the turns the prefix completed; with a chat template
    (``use_chat_template``) the continuation's observations are rendered after that whole conversation, so a
    branched trajectory is the template's rendering of it, as an unbranched episode is. Without a template they
    are only history (the environment's state is ``env_state``).
    """

    prompt: Prompt
    prefix_ids: list[int] = field(default_factory=list)
    env_state: Any = None  # ``Environment.snapshot()`` at the end of the prefix; None: the state after reset
    pending_ids: list[int] = field(default_factory=list)  # the unfinished turn's ids (a suffix of prefix_ids)
    turns: list[tuple[str, str]] = field(default_factory=list)  # (action, observation) texts of the prefix
    prompt_index: int = -1  # the prompt's stream index (its rows' ``RolloutBatch.prompt_index``); -1: none


class BranchRollout(GroupRollout):
    """Continue ``n`` times from each of the branches a method sets.

    Each branch gives ``n`` contiguous rows (``group_size = n``): the prompt part of a row is the branch's
    first observation followed by its prefix ids (context, no loss); the response is the continuation, for up
    to ``max_turns`` more turns in the environment restored to ``env_state``. The first action the
    environment sees is the branch's ``pending_ids`` followed by what was sampled; a row's ``prompt_index`` is
    its branch's. Held-out batches are plain greedy episodes, whatever the branches' limits: a
    ``GroupRollout`` of up to ``Task.episode_turns()`` turns (the branches' ``max_turns`` for a task that does not
    say) of the data module's ``max_new_tokens`` each, with the default episode budget.

    The branches of a step are read when its rollout starts: ``set_branches(list)`` for the next step, or
    ``branches_from(fn)`` with ``fn(step) -> list[Branch]`` called at every step.
    """

    def __init__(self, n: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if n < 1:
            raise ValueError(f"BranchRollout: n must be >= 1, got {n}")
        self.n = n
        self._next: list[Branch] | None = None
        self._fn: Callable[[int], list[Branch]] | None = None

    def needs(self) -> dict[str, str]:
        return {SESSIONS: "BranchRollout"}

    def set_branches(self, branches: list[Branch]) -> None:
        """Branch from ``branches`` at the next training step."""
        self._next = list(branches)

    def branches_from(self, fn: Callable[[int], list[Branch]] | None) -> None:
        """Ask ``fn(step)`` for the branches of every training step (``None``: stop asking)."""
        self._fn = fn

    def heldout(self, task: Task) -> GroupRollout:
        """The strategy of held-out episodes: plain ones, limited by the task, not by the branches' limits."""
        return GroupRollout(max_turns=task.episode_turns() or self.max_turns, stop_strings=self.stop_strings,
                            env_errors=self.env_errors, carry_cache=self.carry_cache)

    def rollout(self, ctx: RolloutContext, batch: PromptBatch) -> RolloutBatch:
        if batch.split != "train":
            return self.heldout(ctx.task).rollout(ctx, batch)
        branches = self._next if self._next is not None else self._fn(batch.step) if self._fn else None
        self._next = None
        if not branches:
            raise ValueError(f"BranchRollout: no branches for step {batch.step} (set_branches or branches_from)")
        tok = ctx.tokenizer
        rows_of = [b for b in branches for _ in range(self.n)]
        prompts = [b.prompt for b in rows_of]
        seeds = [(ctx.seed * 1_000_003 + batch.step) * 97 + k for k in range(len(prompts))]
        t0 = time.perf_counter()
        episodes = _Episodes(ctx, prompts, seeds, self.env_errors)
        for row, branch in enumerate(rows_of):
            if branch.env_state is not None:
                episodes.envs[row].restore(branch.env_state)
            episodes.pending[row] = list(branch.pending_ids)
            episodes.actions[row] = [action for action, _ in branch.turns]
            episodes.observations[row] = [observation for _, observation in branch.turns]
        contexts = [first + list(b.prefix_ids) for first, b in zip(ctx.encoder.first(episodes.first), rows_of)]
        prompt_ids, prompt_mask = left_pad(contexts, tok.pad_token_id, ctx.device)
        gen = self._episodes(ctx, contexts, episodes, self.turn_params(ctx))
        responses = [tok.decode(ids, skip_special_tokens=False) for ids in self._response_lists(gen)]
        make = self._maker(ctx, prompt_ids, prompt_mask, gen, self.n, [b.prompt_index for b in rows_of], prompts,
                           responses, time.perf_counter() - t0, self._episode_fields(gen))
        out = make(episodes.returns(), 0.0, episodes)
        return replace(out, truncated=gen.truncated | torch.tensor(episodes.env_truncated, device=gen.truncated.device))
