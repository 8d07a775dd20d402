"""Rollout strategies: how a batch of prompts becomes a ``RolloutBatch``. The data module's extension point.

``RolloutDataModule.rollout`` checks the stream, picks the sampler (the policy or its lagged copy) and hands
the prompt batch to its ``strategy``; a new way of making rollouts is a new ``RolloutStrategy`` subclass, set
with ``data.init_args.strategy``, with no change to the data module.

``GroupRollout`` (the default) runs ``group_size`` episodes per training prompt (one per held-out prompt,
greedy), each in the environment the task makes for it (``Task.make_env``; a ``SingleTurnEnv`` for
single-turn tasks). With ``max_turns == 1`` an episode is one generate call of the data module's engine; with
more turns it runs through ``episodes.sample_episodes`` (the KV cache carried over from turn to turn).
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch
from torch import Tensor, nn

from rl_lightning.envs.base import Prompt, RewardError
from rl_lightning.envs.environment import EnvError, Environment, env_step
from rl_lightning.rollout.batch import PromptBatch, RolloutBatch
from rl_lightning.rollout.episodes import left_pad, sample_episodes

if TYPE_CHECKING:
    from rl_lightning.rollout.datamodule import RolloutDataModule


class RolloutStrategy(ABC):
    """Turns a ``PromptBatch`` into a ``RolloutBatch`` with ``model`` (under ``torch.no_grad``, in eval mode)."""

    @abstractmethod
    def rollout(self, dm: RolloutDataModule, batch: PromptBatch, model: nn.Module,
                generator: torch.Generator | None) -> RolloutBatch:
        """``generator`` is the step's seeded generator for training batches, ``None`` for greedy held-out ones."""


class _Episodes:
    """The environments of one batch of episodes and what they returned, turn by turn."""

    def __init__(self, dm: RolloutDataModule, prompts: list[Prompt], seeds: list[int], on_error: str) -> None:
        self.dm, self.prompts, self.on_error = dm, prompts, on_error
        self.envs: list[Environment] = [dm.task.make_env(p, dm.reward_fn) for p in prompts]
        self.first = [str(env.reset(seed=seed)[0]) for env, seed in zip(self.envs, seeds)]
        self.turn_rewards: list[list[float]] = [[] for _ in prompts]
        self.actions: list[list[str]] = [[] for _ in prompts]
        self.observations: list[list[str]] = [[] for _ in prompts]  # the texts appended after each turn
        self.env_truncated = [False] * len(prompts)
        self.errors = 0
        self.pending: list[list[int]] = [[] for _ in prompts]  # ids of an unfinished turn a branch starts inside

    def step(self, row: int, action: str) -> tuple[str, bool]:
        """Step episode ``row``; ``(observation, over)``."""
        self.actions[row].append(action)
        turn = len(self.actions[row]) - 1
        try:
            obs, reward, terminated, truncated, _ = env_step(self.envs[row], action, self.prompts[row], turn)
        except EnvError:
            if self.on_error == "raise":
                raise
            self.errors += 1
            self.turn_rewards[row] = [0.0] * (len(self.turn_rewards[row]) + 1)  # it returns 0, whatever it earned
            return "", True
        self.turn_rewards[row].append(reward)
        self.env_truncated[row] = truncated
        return obs, terminated or truncated

    def returns(self) -> list[float]:
        return [sum(r) if r else float("nan") for r in self.turn_rewards]


class GroupRollout(RolloutStrategy):
    """``group_size`` episodes per prompt (see the module docstring).

    Args:
        max_turns: model turns per episode (1: single-turn tasks).
        max_turn_tokens: sampled tokens per turn (``None``: the data module's ``max_new_tokens``).
        max_episode_tokens: sampled + observation tokens per episode (``None``: ``max_turns x max_turn_tokens``
            plus room for observations of as many tokens again).
        stop_strings: a turn also ends when its decoded text ends with one of these.
        env_errors: ``"raise"`` stops on an environment that raises (naming episode, turn and action);
            ``"fail_episode"`` ends that episode with reward 0 and counts it in ``train/env_errors``.
        carry_cache: append observations to the KV cache (``False``: re-run the history each turn, a reference).
    """

    def __init__(self, max_turns: int = 1, max_turn_tokens: int | None = None, max_episode_tokens: int | None = None,
                 stop_strings: list[str] | None = None, env_errors: Literal["raise", "fail_episode"] = "raise",
                 carry_cache: bool = True) -> None:
        if max_turns < 1:
            raise ValueError(f"GroupRollout: max_turns must be >= 1, got {max_turns}")
        if max_turn_tokens is not None and max_turn_tokens < 1:
            raise ValueError(f"GroupRollout: max_turn_tokens must be >= 1 or null, got {max_turn_tokens}")
        if max_episode_tokens is not None and max_episode_tokens < 1:
            raise ValueError(f"GroupRollout: max_episode_tokens must be >= 1 or null, got {max_episode_tokens}")
        if env_errors not in ("raise", "fail_episode"):
            raise ValueError(f"GroupRollout: env_errors must be 'raise' or 'fail_episode', got {env_errors!r}")
        self.max_turns, self.max_turn_tokens, self.max_episode_tokens = max_turns, max_turn_tokens, max_episode_tokens
        self.stop_strings = list(stop_strings or [])
        self.env_errors = env_errors
        self.carry_cache = carry_cache

    def rollout(self, dm: RolloutDataModule, batch: PromptBatch, model: nn.Module,
                generator: torch.Generator | None) -> RolloutBatch:
        train = batch.split == "train"
        group = dm.group_size if train else 1
        prompts = [p for p in batch.prompts for _ in range(group)]
        indices = [i for i in batch.indices for _ in range(group)]
        seeds = [(dm.seed * 1_000_003 + i) * 97 + k % group for k, i in enumerate(indices)]
        device = next(model.parameters()).device
        tok = dm.tokenizer
        t0 = time.perf_counter()
        episodes = _Episodes(dm, prompts, seeds, self.env_errors)
        prompt_ids, prompt_mask = dm.encode_first(prompts, episodes.first, device)
        turn_tokens = self.max_turn_tokens or dm.max_new_tokens
        common = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, temperature=dm.temperature,
                      top_p=dm.top_p, greedy=not train, generator=generator)
        extras = dm.sampler_extras(generator, batch.step)
        if self.max_turns == 1:
            gen = dm.engine.generate(model, prompt_ids, prompt_mask, turn_tokens, **common, **extras)
            t1 = time.perf_counter()
            lengths = gen.mask.sum(dim=1).tolist()
            responses = tok.batch_decode([row[:n] for row, n in zip(gen.response_ids.tolist(), lengths)],
                                         skip_special_tokens=True)
            fields: dict[str, Any] = {name: getattr(gen, name) for name in ("topk_ids", "topk_logprobs", "aux_ids")
                                      if getattr(gen, name, None) is not None}
            make = self._maker(dm, prompt_ids, prompt_mask, gen, group, indices, prompts, responses, t1 - t0, fields)
            over = []
            try:
                for row, response in enumerate(responses):
                    over.append(episodes.step(row, response)[1])
            except RewardError as err:  # keep the responses so the failure can be replayed (FailureDump)
                if train:
                    err.rollout_batch = make(episodes.returns(), time.perf_counter() - t1)  # type: ignore[attr-defined]
                raise
            batch_out = make(episodes.returns(), time.perf_counter() - t1, episodes)
            # as in sample_episodes: the environment truncated it, or the turn limit ends an episode that goes on
            cut = [truncated or not done for truncated, done in zip(episodes.env_truncated, over)]
            batch_out.truncated = gen.truncated | torch.tensor(cut, device=gen.truncated.device)
            return batch_out
        gen = self._episodes(dm, model, prompt_ids, prompt_mask, episodes, turn_tokens, {**common, **extras})
        t1 = time.perf_counter()
        responses = [tok.decode(ids, skip_special_tokens=False) for ids in self._response_lists(gen)]
        make = self._maker(dm, prompt_ids, prompt_mask, gen, group, indices, prompts, responses, t1 - t0,
                           self._episode_fields(gen))
        batch_out = make(episodes.returns(), 0.0, episodes)
        batch_out.truncated = gen.truncated | torch.tensor(episodes.env_truncated, device=gen.truncated.device)
        return batch_out

    def _episodes(self, dm: RolloutDataModule, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                  episodes: _Episodes, turn_tokens: int, common: dict[str, Any]):  # noqa: ANN202
        tok = dm.tokenizer
        firsts = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        budget = self.max_episode_tokens or 2 * self.max_turns * turn_tokens

        def observe(rows: list[int], actions: list[list[int]]) -> list[list[int] | None]:
            out: list[list[int] | None] = []
            for row, ids in zip(rows, actions):
                text = tok.decode(episodes.pending[row] + list(ids), skip_special_tokens=True)
                episodes.pending[row] = []
                obs, over = episodes.step(row, text)
                closed = bool(ids) and ids[-1] == tok.eos_token_id
                out.append(None if over else dm.encode_observation(episodes, row, obs, closed))
            return out

        stop = self._stop_check(tok) if self.stop_strings else None
        return sample_episodes(model, firsts, observe, max_turns=self.max_turns, max_turn_tokens=turn_tokens,
                               max_episode_tokens=budget, stop=stop, carry_cache=self.carry_cache, **common)

    def _stop_check(self, tok: Any) -> Callable[[int, list[int]], bool]:
        def stop(row: int, ids: list[int]) -> bool:
            text = tok.decode(ids, skip_special_tokens=True)
            return any(text.endswith(s) for s in self.stop_strings)
        return stop

    @staticmethod
    def _episode_fields(gen: Any) -> dict[str, Any]:
        """The ``RolloutBatch`` fields of an ``EpisodeGeneration`` beyond those of a single-turn generation."""
        fields = {"obs_mask": gen.obs_mask, "turn_index": gen.turn_index, "num_turns": gen.num_turns}
        fields.update({name: getattr(gen, name) for name in ("topk_ids", "topk_logprobs", "aux_ids")
                       if getattr(gen, name) is not None})
        return fields

    @staticmethod
    def _response_lists(gen: Any) -> list[list[int]]:
        real = (gen.mask | gen.obs_mask).bool()
        return [row[m].tolist() for row, m in zip(gen.response_ids.cpu(), real.cpu())]

    @staticmethod
    def _maker(dm: RolloutDataModule, prompt_ids: Tensor, prompt_mask: Tensor, gen: Any, group: int,
               indices: list[int], prompts: list[Prompt], responses: list[str], rollout_time: float,
               fields: dict[str, Any]) -> Callable[..., RolloutBatch]:
        device = prompt_ids.device

        def make(returns: list[float], reward_time: float, episodes: _Episodes | None = None) -> RolloutBatch:
            extra = dict(fields)
            if episodes is not None and "num_turns" in fields:
                width = max(1, max(len(r) for r in episodes.turn_rewards))
                extra["turn_rewards"] = torch.tensor(
                    [r + [math.nan] * (width - len(r)) for r in episodes.turn_rewards], device=device)
            return RolloutBatch.from_generation(
                prompt_ids, prompt_mask, gen, rewards=torch.tensor(returns, dtype=torch.float32, device=device),
                group_size=group, prompt_index=torch.tensor(indices, dtype=torch.long, device=device),
                prompt_id=torch.tensor([p.uid for p in prompts], dtype=torch.long, device=device),
                temperature=dm.temperature, top_p=dm.top_p, prompts=prompts, responses=responses,
                rollout_time=rollout_time, reward_time=reward_time,
                env_errors=episodes.errors if episodes is not None else 0, **extra)
        return make


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
    """Continue ``n`` times from each of the branches a method sets (TEMPO's macro-steps from saved environment
    states, AC2's continuations of response prefixes).

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

    def set_branches(self, branches: list[Branch]) -> None:
        """Branch from ``branches`` at the next training step."""
        self._next = list(branches)

    def branches_from(self, fn: Callable[[int], list[Branch]] | None) -> None:
        """Ask ``fn(step)`` for the branches of every training step (``None``: stop asking)."""
        self._fn = fn

    def heldout(self, dm: RolloutDataModule) -> GroupRollout:
        """The strategy of held-out episodes: plain ones, limited by the task, not by the branches' limits."""
        return GroupRollout(max_turns=dm.task.episode_turns() or self.max_turns, stop_strings=self.stop_strings,
                            env_errors=self.env_errors, carry_cache=self.carry_cache)

    def rollout(self, dm: RolloutDataModule, batch: PromptBatch, model: nn.Module,
                generator: torch.Generator | None) -> RolloutBatch:
        if batch.split != "train":
            return self.heldout(dm).rollout(dm, batch, model, generator)
        branches = self._next if self._next is not None else self._fn(batch.step) if self._fn else None
        self._next = None
        if not branches:
            raise ValueError(f"BranchRollout: no branches for step {batch.step} (set_branches or branches_from)")
        tok = dm.tokenizer
        device = next(model.parameters()).device
        prompts = [b.prompt for b in branches for _ in range(self.n)]
        seeds = [(dm.seed * 1_000_003 + batch.step) * 97 + k for k in range(len(prompts))]
        t0 = time.perf_counter()
        episodes = _Episodes(dm, prompts, seeds, self.env_errors)
        for row, branch in enumerate(b for b in branches for _ in range(self.n)):
            if branch.env_state is not None:
                episodes.envs[row].restore(branch.env_state)
            episodes.pending[row] = list(branch.pending_ids)
            episodes.actions[row] = [action for action, _ in branch.turns]
            episodes.observations[row] = [observation for _, observation in branch.turns]
        first_ids, first_mask = dm.encode_first(prompts, episodes.first, torch.device("cpu"))
        contexts = [row[m.bool()].tolist() + list(b.prefix_ids) for row, m, b in
                    zip(first_ids, first_mask, (b for b in branches for _ in range(self.n)))]
        prompt_ids, prompt_mask = left_pad(contexts, tok.pad_token_id, device)
        turn_tokens = self.max_turn_tokens or dm.max_new_tokens
        common = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, temperature=dm.temperature,
                      top_p=dm.top_p, greedy=False, generator=generator, **dm.sampler_extras(generator, batch.step))
        gen = self._episodes(dm, model, prompt_ids, prompt_mask, episodes, turn_tokens, common)
        responses = [tok.decode(ids, skip_special_tokens=False) for ids in self._response_lists(gen)]
        indices = [b.prompt_index for b in branches for _ in range(self.n)]
        make = self._maker(dm, prompt_ids, prompt_mask, gen, self.n, indices, prompts, responses,
                           time.perf_counter() - t0, self._episode_fields(gen))
        out = make(episodes.returns(), 0.0, episodes)
        out.truncated = gen.truncated | torch.tensor(episodes.env_truncated, device=gen.truncated.device)
        return out
