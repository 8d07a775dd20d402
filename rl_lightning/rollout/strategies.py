"""Rollout strategies: how a batch of prompts becomes a ``RolloutBatch``. The data module's extension point.

``RolloutDataModule.rollout`` checks the stream, readies the engine (the sampler sync) and hands the prompt
batch to its ``strategy`` with a ``RolloutContext``: the encoder, the engine, the task, the reward function, the
batch's sampling settings and the seed -- never the data module. A new way of making rollouts is a new
``RolloutStrategy`` subclass, set with ``data.init_args.strategy``, with no change to the data module.

``GroupRollout`` (the default) runs ``group_size`` episodes per training prompt (one per held-out prompt,
greedy), each in the environment the task makes for it (``Task.make_env``; a ``SingleTurnEnv`` for
single-turn tasks). With ``max_turns == 1`` an episode is one ``generate`` call of the engine (``n = group_size``
samples of each prompt); with more turns it runs through ``episodes.sample_episodes`` in an engine session.
``BranchRollout`` (``rollout.branching``) continues from saved mid-episode states.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal

import torch
from torch import Tensor

from rl_lightning.envs.base import MESSAGES, Prompt, RewardError, RewardFunction, Task
from rl_lightning.envs.environment import REWARD_PARTS, EnvError, Environment, env_step
from rl_lightning.rollout.batch import EndState, EpisodeEnds, PromptBatch, RolloutBatch, Turns
from rl_lightning.rollout.encoding import PromptEncoder
from rl_lightning.rollout.engine import SESSIONS, RolloutEngine, SamplingParams
from rl_lightning.rollout.episodes import EpisodeGeneration, left_pad, sample_episodes
from rl_lightning.rollout.generation import Generation


@dataclass(frozen=True)
class RolloutContext:
    """What a strategy makes a rollout with: the data module builds one per batch.

    Attributes:
        encoder: the ids of first observations and of observations after a turn (its ``tokenizer`` decodes).
        engine: the rollout engine, with the weights this batch samples with.
        task, reward_fn: the environments' source and their verifier.
        params: this batch's sampling settings (``max_tokens`` per turn; greedy and unseeded for held-out ones).
        group_size: samples per training prompt (``G``).
        seed: the data module's seed (environment seeds derive from it).
        device: where the ``RolloutBatch`` goes (the learner's device).
        rank, world_size: this process's data-parallel rank and the number of ranks (a strategy that draws
            anything per rank reads them here, never from the sampling seed).
        keep_failed: where a strategy hands the rollout a reward function raised in (its responses, with the
            rewards scored so far) before the error goes on: the data module keeps it (``failed_rollout``) for
            ``FailureDump`` to save and ``rl-lightning replay`` to score again.
    """

    encoder: PromptEncoder
    engine: RolloutEngine
    task: Task
    reward_fn: RewardFunction
    params: SamplingParams
    group_size: int
    seed: int
    device: torch.device
    rank: int = 0
    world_size: int = 1
    keep_failed: Callable[[RolloutBatch], None] | None = None

    @property
    def tokenizer(self) -> Any:
        return self.encoder.tokenizer


class RolloutStrategy(ABC):
    """Turns a ``PromptBatch`` into a ``RolloutBatch`` through ``ctx.engine``."""

    @abstractmethod
    def rollout(self, ctx: RolloutContext, batch: PromptBatch) -> RolloutBatch:
        """Training batches sample with ``ctx.params`` (seeded by their step); held-out ones greedily."""

    def needs(self) -> dict[str, str]:
        """The engine capabilities this strategy needs, each with the setting that asks for it."""
        return {}

    @property
    def group_size(self) -> int | None:
        """Rows per group when the strategy decides it (``BranchRollout.n``); ``None``: the data module's."""
        return None


class _Episodes:
    """The environments of one batch of episodes and what they returned, turn by turn."""

    def __init__(self, ctx: RolloutContext, prompts: list[Prompt], seeds: list[int], on_error: str) -> None:
        self.prompts, self.on_error = prompts, on_error
        self.envs: list[Environment] = [ctx.task.make_env(p, ctx.reward_fn) for p in prompts]
        self.first = [str(env.reset(seed=seed)[0]) for env, seed in zip(self.envs, seeds)]
        self.turn_rewards: list[list[float]] = [[] for _ in prompts]
        self.actions: list[list[str]] = [[] for _ in prompts]
        self.observations: list[list[str]] = [[] for _ in prompts]  # the texts appended after each turn
        self.env_truncated = [False] * len(prompts)
        self.env_terminated = [False] * len(prompts)  # the environment ended it (or failed it)
        self.final_ids: list[list[int]] = [[] for _ in prompts]  # the observation after an environment's truncation
        self.errors = 0
        self.reward_parts: list[dict[str, float]] = [{} for _ in prompts]  # a reward's named parts, summed over turns
        self.pending: list[list[int]] = [[] for _ in prompts]  # ids of an unfinished turn a branch starts inside

    def step(self, row: int, action: str) -> tuple[str, bool]:
        """Step episode ``row``; ``(observation, over)``."""
        self.actions[row].append(action)
        turn = len(self.actions[row]) - 1
        try:
            obs, reward, terminated, truncated, info = env_step(self.envs[row], action, self.prompts[row], turn)
        except EnvError:
            if self.on_error == "raise":
                raise
            self.errors += 1
            self.turn_rewards[row] = [0.0] * (len(self.turn_rewards[row]) + 1)  # it returns 0, whatever it earned
            self.env_terminated[row] = True
            return "", True
        self.turn_rewards[row].append(reward)
        for name, value in info.get(REWARD_PARTS, {}).items():
            self.reward_parts[row][name] = self.reward_parts[row].get(name, 0.0) + float(value)
        self.env_truncated[row], self.env_terminated[row] = truncated, terminated
        return obs, terminated or truncated

    def part_extras(self, device: torch.device) -> dict[str, Tensor]:
        """``reward/<name>`` ``[N]`` per named reward part any episode returned (NaN where one did not: a failed
        episode), for ``RolloutBatch.extras``; empty when the reward has no parts."""
        names = sorted({name for parts in self.reward_parts for name in parts})
        return {f"reward/{name}": torch.tensor([parts.get(name, math.nan) for parts in self.reward_parts],
                                               dtype=torch.float32, device=device) for name in names}

    def turns(self, gen: EpisodeGeneration, device: torch.device) -> Turns:
        """``RolloutBatch.turns`` of these episodes: ``gen``'s layout of their turns, with the reward each turn
        returned (NaN after an episode's last)."""
        width = max(1, max(len(r) for r in self.turn_rewards))
        rewards = torch.tensor([r + [math.nan] * (width - len(r)) for r in self.turn_rewards], device=device)
        return Turns(obs_mask=gen.obs_mask, index=gen.turn_index, count=gen.num_turns, rewards=rewards)

    def observation_ids(self, encoder: PromptEncoder, row: int, observation: str, closed: bool) -> list[int]:
        """The ids of episode ``row``'s next observation (after its last turn), remembered for the next."""
        ids = encoder.observation(self.first[row], self.actions[row], self.observations[row], observation, closed)
        self.observations[row].append(observation)
        return ids

    def returns(self, unscored: float = float("nan")) -> list[float]:
        """Each episode's return; ``unscored`` for one the environment never scored (NaN: a reward failure's dump
        marks the rows not scored yet; a continuation whose only turn was held earned 0)."""
        return [sum(r) if r else unscored for r in self.turn_rewards]

    def end_fields(self, prefixes: list[list[int]], responses: list[list[int]], final_obs: list[list[int]],
                   pending: list[list[int]], device: torch.device) -> dict[str, Any]:
        """The batch's ``ends``: whether each episode terminated, and an ``EndState`` for every cut one
        (``prefixes``: what preceded each row's response after its first observation; ``responses``: its real
        response ids)."""
        states: list[EndState | None] = []
        for row, env in enumerate(self.envs):
            if self.env_terminated[row]:
                states.append(None)
                continue
            final = list(final_obs[row] or self.final_ids[row])
            try:
                state, error = env.snapshot(), None
            except Exception as err:  # noqa: BLE001 -- an environment that cannot be copied can still be trained on
                state, error = None, f"{type(err).__name__}: {err}"
            states.append(EndState(state, list(prefixes[row]) + list(responses[row]) + final, list(pending[row]),
                                   list(zip(self.actions[row], self.observations[row])), final, error))
        return {"ends": EpisodeEnds(torch.tensor(self.env_terminated, dtype=torch.bool, device=device), states)}


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

    def needs(self) -> dict[str, str]:
        return {SESSIONS: f"{type(self).__name__}(max_turns={self.max_turns})"} if self.max_turns > 1 else {}

    def turn_params(self, ctx: RolloutContext) -> SamplingParams:
        """``ctx.params`` with this strategy's tokens per turn."""
        return replace(ctx.params, max_tokens=self.max_turn_tokens or ctx.params.max_tokens)

    def rollout(self, ctx: RolloutContext, batch: PromptBatch) -> RolloutBatch:
        train = batch.split == "train"
        group = ctx.group_size if train else 1
        prompts = [p for p in batch.prompts for _ in range(group)]
        indices = [i for i in batch.indices for _ in range(group)]
        seeds = [(ctx.seed * 1_000_003 + i) * 97 + k % group for k, i in enumerate(indices)]
        tok = ctx.tokenizer
        t0 = time.perf_counter()
        episodes = _Episodes(ctx, prompts, seeds, self.env_errors)
        rows = ctx.encoder.first(episodes.first, [p.metadata.get(MESSAGES) for p in prompts])
        prompt_ids, prompt_mask = left_pad(rows, tok.pad_token_id, ctx.device)
        params = self.turn_params(ctx)
        if self.max_turns > 1:
            gen = self._episodes(ctx, rows, episodes, params)
            t1 = time.perf_counter()
            lists = self._response_lists(gen)
            responses = [tok.decode(ids, skip_special_tokens=False) for ids in lists]
            make = self._maker(ctx, prompt_ids, prompt_mask, gen, group, indices, prompts, responses, t1 - t0,
                               multi_turn=True)
            batch_out = make(episodes.returns(), 0.0, episodes)
            return replace(batch_out, truncated=gen.truncated | torch.tensor(episodes.env_truncated,
                                                                             device=gen.truncated.device),
                           **episodes.end_fields([[]] * len(rows), lists, gen.final_obs, gen.pending, ctx.device))
        gen = _on(self._generate(ctx.engine, rows, group, params), ctx.device)
        t1 = time.perf_counter()
        lengths = gen.mask.sum(dim=1).tolist()
        responses = tok.batch_decode([row[:n] for row, n in zip(gen.response_ids.tolist(), lengths)],
                                     skip_special_tokens=True)
        make = self._maker(ctx, prompt_ids, prompt_mask, gen, group, indices, prompts, responses, t1 - t0,
                           multi_turn=False)
        over, final = [], [[] for _ in responses]
        try:
            for row, response in enumerate(responses):
                observation, done = episodes.step(row, response)
                over.append(done)
                if not done:  # a multi-turn environment cut after one turn: keep its next observation
                    final[row] = episodes.observation_ids(ctx.encoder, row, observation, not bool(gen.truncated[row]))
        except RewardError:  # keep the responses so the failure can be replayed (FailureDump)
            if ctx.keep_failed is not None:
                ctx.keep_failed(make(episodes.returns(), time.perf_counter() - t1))
            raise
        batch_out = make(episodes.returns(), time.perf_counter() - t1, episodes)
        # as in sample_episodes: the environment truncated it, or the turn limit ends an episode that goes on
        cut = [truncated or not done for truncated, done in zip(episodes.env_truncated, over)]
        ids = [row[:n] for row, n in zip(gen.response_ids.tolist(), lengths)]
        return replace(batch_out, truncated=gen.truncated | torch.tensor(cut, device=gen.truncated.device),
                       **episodes.end_fields([[]] * len(rows), ids, final, [[] for _ in rows], ctx.device))

    @staticmethod
    def _generate(engine: RolloutEngine, rows: list[list[int]], group: int, params: SamplingParams) -> Generation:
        """One generate call: ``n = group`` samples of each prompt when a group's rows are one prompt."""
        if group > 1 and all(rows[k] == rows[k - k % group] for k in range(len(rows))):
            return engine.generate(rows[::group], params, n=group)
        return engine.generate(rows, params)

    def episode_budget(self, params: SamplingParams) -> int:
        """Sampled + observation tokens per episode (``max_episode_tokens``, or its default)."""
        return self.max_episode_tokens or 2 * self.max_turns * params.max_tokens

    def _episodes(self, ctx: RolloutContext, rows: list[list[int]], episodes: _Episodes, params: SamplingParams,
                  turns: int | list[int] | None = None, budget: int | list[int] | None = None,
                  turn_used: list[int] | None = None, hold_at_budget: bool = False) -> Any:
        tok = ctx.tokenizer
        budget = self.episode_budget(params) if budget is None else budget

        def observe(rows: list[int], actions: list[list[int]]) -> list[list[int] | None]:
            out: list[list[int] | None] = []
            for row, ids in zip(rows, actions):
                text = tok.decode(episodes.pending[row] + list(ids), skip_special_tokens=True)
                episodes.pending[row] = []
                obs, over = episodes.step(row, text)
                closed = bool(ids) and ids[-1] == tok.eos_token_id
                if over and episodes.env_truncated[row] and not episodes.env_terminated[row]:
                    episodes.final_ids[row] = episodes.observation_ids(ctx.encoder, row, obs, closed)  # continuable
                out.append(None if over else episodes.observation_ids(ctx.encoder, row, obs, closed))
            return out

        stop = self._stop_check(tok) if self.stop_strings else None
        return sample_episodes(ctx.engine, rows, observe, params=params,
                               max_turns=self.max_turns if turns is None else turns, max_episode_tokens=budget,
                               stop=stop, carry_cache=self.carry_cache, device=ctx.device, turn_used=turn_used,
                               hold_at_budget=hold_at_budget)

    def _stop_check(self, tok: Any) -> Callable[[int, list[int]], bool]:
        def stop(row: int, ids: list[int]) -> bool:
            text = tok.decode(ids, skip_special_tokens=True)
            return any(text.endswith(s) for s in self.stop_strings)
        return stop

    @staticmethod
    def _response_lists(gen: Any) -> list[list[int]]:
        real = (gen.mask | gen.obs_mask).bool()
        return [row[m].tolist() for row, m in zip(gen.response_ids.cpu(), real.cpu())]

    @staticmethod
    def _maker(ctx: RolloutContext, prompt_ids: Tensor, prompt_mask: Tensor, gen: Any, group: int,
               indices: list[int], prompts: list[Prompt], responses: list[str], rollout_time: float,
               multi_turn: bool) -> Callable[..., RolloutBatch]:
        """``make(returns, reward_time, episodes)``: the batch of ``gen``; with ``multi_turn`` (``gen`` is an
        ``EpisodeGeneration``) and ``episodes``, its ``turns``."""
        device = prompt_ids.device

        def make(returns: list[float], reward_time: float, episodes: _Episodes | None = None) -> RolloutBatch:
            turns = episodes.turns(gen, device) if multi_turn and episodes is not None else None
            return RolloutBatch.from_generation(
                prompt_ids, prompt_mask, gen, rewards=torch.tensor(returns, dtype=torch.float32, device=device),
                group_size=group, prompt_index=torch.tensor(indices, dtype=torch.long, device=device),
                prompt_id=torch.tensor([p.uid for p in prompts], dtype=torch.long, device=device),
                temperature=ctx.params.temperature, top_p=ctx.params.top_p, prompts=prompts, responses=responses,
                rollout_time=rollout_time, reward_time=reward_time,
                env_errors=episodes.errors if episodes is not None else 0,
                extras=episodes.part_extras(device) if episodes is not None else {}, turns=turns)
        return make


def _on(gen: Generation, device: torch.device) -> Generation:
    """``gen`` with its tensors on ``device`` (an external engine's output, on its own device)."""
    return replace(gen, **{name: value.to(device) for name, value in vars(gen).items()
                           if isinstance(value, Tensor)})
