"""Multi-turn episodes, batched: each turn generates for the episodes still running, the environment answers,
and its observation tokens are appended to the session (never a re-tokenisation of decoded text).

The turns run in a session of the rollout engine (``RolloutEngine.open_session``): ``turn`` samples for the
running episodes, ``append`` continues them with their observation ids (the in-process engines' sessions,
``rollout.sessions``, append them to the KV cache, so the history is never re-encoded).

The trajectory of an episode is exactly the ids that were fed to the model: the prompt's ids, then for each
turn the sampled ids (EOS included) followed by the observation's ids (encoded once, as the environment's next
message). ``EpisodeGeneration`` lays them out as one response per row: ``loss_mask`` 1 on sampled ids,
``obs_mask`` 1 on observation ids, ``turn_index`` the turn of every sampled id (-1 elsewhere).

An episode ends when the environment says so (terminated / truncated), after ``max_turns`` turns, or when its
response would exceed ``max_episode_tokens`` (both limits mark it ``truncated``; either may be given per row). A
turn ends at EOS, at a stop string (``stop``: a callable on the turn's ids so far), or after ``params.max_tokens``
(an unfinished turn still goes to the environment, which decides what it means; ``turn_used`` counts ids a row's
first turn already holds against that limit). With ``hold_at_budget``, a turn that ``max_episode_tokens`` cuts
before its own end is *not* sent to the environment: the episode ends cut with that turn's ids
``EpisodeGeneration.pending`` (a continuation can finish the turn). The observation that a limit keeps out of the
trajectory (an episode cut by ``max_turns`` or the token budget after its environment answered) is kept in
``EpisodeGeneration.final_obs``, so a cut episode can be continued from its end without replaying it.

On request (``topk``, ``aux_draws``) every sampled position also records the sampling distribution's top-k ids
with their full-vocabulary log-probs and independent auxiliary draws (``generation.sampler_extras``), laid out
like the sampled ids (0 on observation and padding positions).

``carry_cache=False`` asks the session to re-run the whole history through the model at every turn instead of
appending to the cache (a reference, and the baseline of ``experiments/bench_episodes.py``); the draws are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from rl_lightning.rollout.engine import RolloutEngine, SamplingParams, StopCheck, TokenExtras
from rl_lightning.rollout.engines import KVCacheEngine
from rl_lightning.rollout.sessions import left_pad

__all__ = ["EpisodeGeneration", "Observe", "left_pad", "sample_episodes"]

#: ``observe(rows, actions)`` -> for each row, the observation ids to append, or ``None`` if its episode ended
Observe = Callable[[list[int], list[list[int]]], list[list[int] | None]]


@dataclass
class EpisodeGeneration:
    """The response side of a batch of episodes, ``[N, T]`` (right-padded), plus per-episode counts."""

    response_ids: Tensor
    logprobs: Tensor  # sampler log-prob of each sampled id (0 elsewhere)
    mask: Tensor  # loss mask: 1 on sampled ids
    obs_mask: Tensor  # 1 on observation ids
    turn_index: Tensor  # turn of each sampled id, -1 elsewhere
    truncated: Tensor  # [N] bool: the episode hit a limit (turns, tokens, or the last turn had no EOS)
    num_turns: Tensor  # [N] long
    segments: list[list[tuple[str, list[int]]]] = field(default_factory=list)  # per row: ("model"/"obs", ids)
    final_obs: list[list[int]] = field(default_factory=list)  # per row: observation ids a limit left out ([]: none)
    pending: list[list[int]] = field(default_factory=list)  # per row: a held unfinished turn's ids ([]: none)
    topk_ids: Tensor | None = None  # [N, T, k] on request, at sampled positions (0 elsewhere)
    topk_logprobs: Tensor | None = None  # [N, T, k]
    aux_ids: Tensor | None = None  # [N, T, K]


def sample_episodes(
    engine: RolloutEngine | nn.Module, prompt_ids: list[list[int]], observe: Observe, *, params: SamplingParams,
    max_turns: int | list[int], max_episode_tokens: int | list[int], stop: StopCheck | None = None,
    carry_cache: bool = True, device: torch.device | str | None = None, turn_used: list[int] | None = None,
    hold_at_budget: bool = False,
) -> EpisodeGeneration:
    """Run ``len(prompt_ids)`` episodes turn by turn in a session of ``engine`` (see the module docstring).

    ``params`` are the session's sampling settings (``max_tokens``: per turn). ``observe(rows, actions)`` is
    called once per turn with the episodes whose turn just ended and the ids they sampled in it; it returns the
    observation ids for each (appended before their next turn) or ``None`` when the episode is over. The result is
    laid out on ``device`` (default: the engine's). A bare model for ``engine`` runs on ``KVCacheEngine``.
    ``max_turns`` and ``max_episode_tokens`` are one limit for every row or a list with one per row; ``turn_used``
    (per row, default 0) and ``hold_at_budget`` are described in the module docstring.
    """
    if isinstance(engine, nn.Module):
        engine = KVCacheEngine().bound(engine)
    device = engine.device if device is None else device
    session = engine.open_session(prompt_ids, params, carry_cache=carry_cache)
    n = len(prompt_ids)
    turn_limit = max_turns if isinstance(max_turns, list) else [max_turns] * n
    token_limit = max_episode_tokens if isinstance(max_episode_tokens, list) else [max_episode_tokens] * n
    used = list(turn_used) if turn_used is not None else [0] * n  # ids already in each row's current turn
    segments: list[list[tuple[str, list[int]]]] = [[] for _ in range(n)]
    turn_logps: list[list[float]] = [[] for _ in range(n)]  # per row: log-probs of its sampled ids, in order
    turn_extras: list[list[TokenExtras]] = [[] for _ in range(n)]  # per sampled id, on request
    final_obs: list[list[int]] = [[] for _ in range(n)]
    pending: list[list[int]] = [[] for _ in range(n)]
    length = [0] * n  # response tokens so far (sampled + observed)
    running = list(range(n))
    truncated = [False] * n
    turns = [0] * n
    for _ in range(max(turn_limit, default=0)):
        if not running:
            break
        own = [params.max_tokens - used[r] for r in running]  # the turn's own limit
        budgets = [min(o, token_limit[r] - length[r]) for o, r in zip(own, running)]
        turn = session.turn(running, budgets, stop)
        held = set()
        for i, r in enumerate(running):
            segments[r].append(("model", turn.ids[i]))
            turn_logps[r] += turn.logprobs[i]
            turn_extras[r] += turn.extras[i] if turn.extras is not None else []
            length[r] += len(turn.ids[i])
            turns[r] += 1
            used[r] = 0
            if hold_at_budget and budgets[i] < own[i] and turn.finish_reasons[i] != "stop":
                held.add(r)  # the episode's budget cut the turn: not the environment's to see
                pending[r], truncated[r] = list(turn.ids[i]), True
        observed = [(i, r) for i, r in enumerate(running) if r not in held]
        observations = observe([r for _, r in observed], [turn.ids[i] for i, _ in observed]) if observed else []
        still, appended = [], []
        for (i, r), obs in zip(observed, observations):
            if obs is None:  # the environment ended it; cut if its last turn was (no EOS within the budget)
                truncated[r] = turn.finish_reasons[i] != "stop"
                continue
            if turns[r] >= turn_limit[r] or length[r] + len(obs) >= token_limit[r]:
                truncated[r] = True  # a limit ends the episode before its next turn
                final_obs[r] = list(obs)  # kept: the episode can be continued from here
                continue
            segments[r].append(("obs", list(obs)))
            length[r] += len(obs)
            still.append(r)
            appended.append(list(obs))
        if still:
            session.append(still, appended)
        running = still
    gen = _assemble(segments, turn_logps, truncated, turns, params.pad_token_id, device)
    gen.final_obs, gen.pending = final_obs, pending
    if params.topk or params.aux_draws:
        gen.topk_ids, gen.topk_logprobs, gen.aux_ids = _assemble_extras(turn_extras, gen.mask)
    return gen


def _assemble(segments: list[list[tuple[str, list[int]]]], logps: list[list[float]], truncated: list[bool],
              turns: list[int], pad: int, device: torch.device) -> EpisodeGeneration:
    n = len(segments)
    width = max(1, max(sum(len(ids) for _, ids in row) for row in segments))
    response = torch.full((n, width), pad, dtype=torch.long)
    logprobs = torch.zeros((n, width))
    loss_mask = torch.zeros((n, width), dtype=torch.long)
    obs_mask = torch.zeros((n, width), dtype=torch.long)
    turn_index = torch.full((n, width), -1, dtype=torch.long)
    for i, row in enumerate(segments):
        pos, k, turn = 0, 0, 0
        for kind, ids in row:
            span = slice(pos, pos + len(ids))
            response[i, span] = torch.tensor(ids, dtype=torch.long)
            if kind == "model":
                loss_mask[i, span] = 1
                turn_index[i, span] = turn
                logprobs[i, span] = torch.tensor(logps[i][k:k + len(ids)])
                k += len(ids)
                turn += 1
            else:
                obs_mask[i, span] = 1
            pos += len(ids)
    return EpisodeGeneration(
        response_ids=response.to(device), logprobs=logprobs.to(device), mask=loss_mask.to(device),
        obs_mask=obs_mask.to(device), turn_index=turn_index.to(device),
        truncated=torch.tensor(truncated, device=device), num_turns=torch.tensor(turns, device=device),
        segments=segments,
    )


def _assemble_extras(extras: list[list[tuple[Tensor | None, ...]]], mask: Tensor) -> list[Tensor | None]:
    """Lay the per-sampled-id extras (top-k ids, their log-probs, aux draws) out as ``[N, T, k]`` tensors at the
    sampled positions of ``mask`` (the i-th sampled id of a row is its i-th masked position), 0 elsewhere."""
    out: list[Tensor | None] = []
    columns = next((row[0] for row in extras if row), None)
    for c in range(3):
        if columns is None or columns[c] is None:
            out.append(None)
            continue
        like = columns[c]
        full = torch.zeros((*mask.shape, like.shape[-1]), dtype=like.dtype, device=mask.device)
        for i, row in enumerate(extras):
            if row:
                full[i, mask[i].bool()] = torch.stack([entry[c] for entry in row]).to(mask.device)
        out.append(full)
    return out
