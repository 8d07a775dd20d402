"""``BranchRollout``: continue episodes from saved points (a prompt, a prefix of response ids, an environment
state), ``n`` times each -- TEMPO's macro-steps from saved environment states, AC2's continuations of response
prefixes. A ``RolloutStrategy`` like ``GroupRollout``, whose episode loop it shares.

* ``Branch`` -- one point to continue from, with its own horizon (``max_turns``) and token budget
  (``max_tokens``); ``Branch.from_rollout(batch, row)`` is the end state of any cut row of a batch the built-in
  strategies made (``RolloutBatch.ends``), so a continuation never replays the episode;
* ``BranchRollout`` -- the training strategy that continues each branch of a step ``n`` times; ``continue_from``
  is the same rollout for any branches (``RolloutDataModule.rollout_branches``: one-off completions and audits);
* ``BranchStore`` -- saved branches kept across steps (a replay store), checkpointed as plain values.
"""

from __future__ import annotations

import inspect
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

    ``max_turns`` (the horizon: model turns of the continuation) and ``max_tokens`` (its budget of sampled +
    observation tokens) override the strategy's ``max_turns`` / ``max_episode_tokens`` for this branch's rows. A
    continuation never makes a turn longer than the strategy's tokens per turn: the ``pending_ids`` count
    against its first turn. A turn cut by the token budget before it ends is not sent to the environment: the row
    ends cut, with that turn in its end state's ``pending_ids`` (AC2's chunks).
    """

    prompt: Prompt
    prefix_ids: list[int] = field(default_factory=list)
    env_state: Any = None  # ``Environment.snapshot()`` at the end of the prefix; None: the state after reset
    pending_ids: list[int] = field(default_factory=list)  # the unfinished turn's ids (a suffix of prefix_ids)
    turns: list[tuple[str, str]] = field(default_factory=list)  # (action, observation) texts of the prefix
    prompt_index: int = -1  # the prompt's stream index (its rows' ``RolloutBatch.prompt_index``); -1: none
    max_turns: int | None = None  # the continuation's horizon (None: the strategy's max_turns)
    max_tokens: int | None = None  # the continuation's token budget (None: the strategy's max_episode_tokens)

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"Branch: {name} must be >= 1 or None, got {value}")

    @classmethod
    def from_rollout(cls, batch: RolloutBatch, row: int, max_turns: int | None = None,
                     max_tokens: int | None = None) -> Branch:
        """The end of ``batch``'s row ``row`` (cut by a limit, not terminated), as a branch to continue: its
        environment state, everything after its first observation (the final observation a limit kept out of the
        trajectory included) and any unfinished turn, with no replay."""
        if batch.ends is None:
            raise ValueError("Branch.from_rollout: the batch has no ends (made by a strategy that does not record "
                             "them)")
        end = batch.ends.states[row]
        if end is None:
            raise ValueError(f"Branch.from_rollout: row {row} terminated (its environment ended it); a terminal "
                             "state has nothing to continue")
        if end.snapshot_error is not None:
            raise ValueError(f"Branch.from_rollout: row {row}'s environment could not be snapshotted "
                             f"({end.snapshot_error}); override Environment.snapshot/restore to continue it")
        return cls(batch.prompts[row], list(end.prefix_ids), end.env_state, list(end.pending_ids), list(end.turns),
                   int(batch.prompt_index[row]), max_turns, max_tokens)

    def to_state(self) -> dict[str, Any]:
        """Plain values only, for checkpoints that load with ``weights_only=True`` (``env_state`` and the prompt's
        metadata must be plain values themselves: dicts, lists, numbers, strings, tensors)."""
        return {"prompt": self.prompt.to_state(), "prefix_ids": list(self.prefix_ids), "env_state": self.env_state,
                "pending_ids": list(self.pending_ids), "turns": [list(t) for t in self.turns],
                "prompt_index": self.prompt_index, "max_turns": self.max_turns, "max_tokens": self.max_tokens}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Branch:
        """The branch ``to_state`` returned."""
        return cls(**{**state, "prompt": Prompt.from_state(state["prompt"]),
                      "turns": [tuple(t) for t in state["turns"]]})


class BranchStore:
    """Saved branches a method keeps across steps (a replay store: TEMPO's states, AC2's prefixes), oldest
    first, at most ``capacity`` (``None``: unbounded). ``state_dict`` is plain values, so it survives a checkpoint
    loaded with ``weights_only=True``; save it from the method's ``on_save_checkpoint``."""

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"BranchStore: capacity must be >= 1 or None, got {capacity}")
        self.capacity = capacity
        self.items: list[Branch] = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, branches: list[Branch]) -> None:
        """Keep ``branches``; beyond ``capacity`` the oldest go."""
        self.items.extend(branches)
        if self.capacity is not None and len(self.items) > self.capacity:
            del self.items[: len(self.items) - self.capacity]

    def sample(self, k: int, generator: torch.Generator) -> list[Branch]:
        """``k`` branches drawn without replacement (all of them if fewer), by ``generator``."""
        order = torch.randperm(len(self.items), generator=generator)[:k].tolist()
        return [self.items[i] for i in order]

    def state_dict(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "items": [b.to_state() for b in self.items]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.capacity = state["capacity"]
        self.items = [Branch.from_state(b) for b in state["items"]]


#: ``RolloutBatch.extras`` key of a branched batch: ``[N]`` the prefix ids each row continued from (0: the prompt's
#: start; more: a saved state or prefix)
BRANCH_PREFIX_TOKENS = "branch_prefix_tokens"

#: what ``branches_from`` calls at every training step: ``fn(step, prompts)`` with the step's ``PromptBatch``
BranchFn = Callable[[int, PromptBatch], list[Branch]]


class BranchRollout(GroupRollout):
    """Continue ``n`` times from each of the branches a method sets.

    Each branch gives ``n`` contiguous rows (``group_size = n``; the data module refuses a ``group_size`` that
    differs): the prompt part of a row is the branch's first observation followed by its prefix ids (context, no
    loss); the response is the continuation, for up to ``max_turns`` more turns (the branch's own ``max_turns``
    if it has one) in the environment restored to ``env_state``. The first action the environment sees is the
    branch's ``pending_ids`` followed by what was sampled; a row's ``prompt_index`` is its branch's. Held-out
    batches are plain greedy episodes, whatever the branches' limits: a ``GroupRollout`` of up to
    ``Task.episode_turns()`` turns (the branches' ``max_turns`` for a task that does not say) of the data module's
    ``max_new_tokens`` each, with the default episode budget. ``rewards`` are the continuation's (the segment's,
    not the episode's), ``ends`` says where each row stopped, and
    ``extras[BRANCH_PREFIX_TOKENS]`` how many prefix ids each row continued from (0: from the prompt's start).

    The branches of a step are read when its rollout starts: ``set_branches(list)`` for the next step, or
    ``branches_from(fn)`` with ``fn(step, prompts) -> list[Branch]`` called at every step, ``prompts`` being the
    ``PromptBatch`` the data module drew for it (its ``indices`` and ``prompts``).
    """

    def __init__(self, n: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if n < 1:
            raise ValueError(f"BranchRollout: n must be >= 1, got {n}")
        self.n = n
        self._next: list[Branch] | None = None
        self._fn: BranchFn | None = None

    @property
    def group_size(self) -> int:
        """The strategy's rows per branch: the data module's ``group_size`` must equal it."""
        return self.n

    def needs(self) -> dict[str, str]:
        return {SESSIONS: "BranchRollout"}

    def set_branches(self, branches: list[Branch]) -> None:
        """Branch from ``branches`` at the next training step."""
        self._next = list(branches)

    def branches_from(self, fn: BranchFn | None) -> None:
        """Ask ``fn(step, prompts)`` for the branches of every training step (``None``: stop asking)."""
        if fn is not None and len(inspect.signature(fn).parameters) != 2:
            raise TypeError("BranchRollout.branches_from: fn must take (step, prompts), the step and its PromptBatch")
        self._fn = fn

    def heldout(self, task: Task) -> GroupRollout:
        """The strategy of held-out episodes: plain ones, limited by the task, not by the branches' limits."""
        return GroupRollout(max_turns=task.episode_turns() or self.max_turns, stop_strings=self.stop_strings,
                            env_errors=self.env_errors, carry_cache=self.carry_cache)

    def rollout(self, ctx: RolloutContext, batch: PromptBatch) -> RolloutBatch:
        if batch.split != "train":
            return self.heldout(ctx.task).rollout(ctx, batch)
        branches = self._next if self._next is not None else self._fn(batch.step, batch) if self._fn else None
        self._next = None
        if not branches:
            raise ValueError(f"BranchRollout: no branches for step {batch.step} (set_branches or branches_from)")
        return self.continue_from(ctx, branches, batch.step)

    def continue_from(self, ctx: RolloutContext, branches: list[Branch], step: int) -> RolloutBatch:
        """``n`` continuations of each of ``branches`` with ``ctx``'s engine and sampling settings (environment
        seeds from ``(ctx.seed, step)``); a ``RolloutBatch`` of ``len(branches) * n`` rows."""
        tok = ctx.tokenizer
        params = self.turn_params(ctx)
        rows_of = [b for b in branches for _ in range(self.n)]
        for b in branches:
            if len(b.pending_ids) >= params.max_tokens:
                raise ValueError(f"BranchRollout: a branch's pending_ids hold {len(b.pending_ids)} ids, which leaves "
                                 f"no room in a turn of {params.max_tokens} tokens (max_turn_tokens / max_new_tokens)")
        prompts = [b.prompt for b in rows_of]
        seeds = [(ctx.seed * 1_000_003 + step) * 97 + k for k in range(len(prompts))]
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
        budget = self.episode_budget(params)
        gen = self._episodes(ctx, contexts, episodes, params, turns=[b.max_turns or self.max_turns for b in rows_of],
                             budget=[b.max_tokens or budget for b in rows_of],
                             turn_used=[len(b.pending_ids) for b in rows_of], hold_at_budget=True)
        lists = self._response_lists(gen)
        responses = [tok.decode(ids, skip_special_tokens=False) for ids in lists]
        make = self._maker(ctx, prompt_ids, prompt_mask, gen, self.n, [b.prompt_index for b in rows_of], prompts,
                           responses, time.perf_counter() - t0, multi_turn=True)
        out = make(episodes.returns(unscored=0.0), 0.0, episodes)  # a held chunk has earned nothing yet
        truncated = gen.truncated | torch.tensor(episodes.env_truncated, device=gen.truncated.device)
        pending = [episodes.pending[r] + held if held else [] for r, held in enumerate(gen.pending)]  # whole turn
        prefixes = [b.prefix_ids for b in rows_of]
        extras = {**out.extras, BRANCH_PREFIX_TOKENS: torch.tensor([len(p) for p in prefixes], device=ctx.device)}
        return replace(out, truncated=truncated, extras=extras,
                       **episodes.end_fields(prefixes, lists, gen.final_obs, pending, ctx.device))
