"""Multi-turn episodes, batched: each turn generates for the episodes still running, the environment answers,
and its observation tokens are appended to the KV cache (the history is never re-encoded, nor re-tokenised).

The trajectory of an episode is exactly the ids that were fed to the model: the prompt's ids, then for each
turn the sampled ids (EOS included) followed by the observation's ids (encoded once, as the environment's next
message). ``EpisodeGeneration`` lays them out as one response per row: ``loss_mask`` 1 on sampled ids,
``obs_mask`` 1 on observation ids, ``turn_index`` the turn of every sampled id (-1 elsewhere).

An episode ends when the environment says so (terminated / truncated), after ``max_turns`` turns, or when its
response would exceed ``max_episode_tokens`` (both limits mark it ``truncated``). A turn ends at EOS, at a stop
string (``stop``: a callable on the turn's ids so far), or after ``max_turn_tokens`` (an unfinished turn still
goes to the environment, which decides what it means).

On request (``topk``, ``aux_draws``) every sampled position also records the sampling distribution's top-k ids
with their full-vocabulary log-probs and independent auxiliary draws (``generation.sampler_extras``), laid out
like the sampled ids (0 on observation and padding positions).

``carry_cache=False`` re-runs the whole history through the model at every turn instead of appending to the
cache (a reference, and the baseline of ``experiments/bench_episodes.py``); the draws are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from rl_lightning.functional.logprobs import sampling_logits
from rl_lightning.rollout.generation import _cache_argument, _returned_cache, position_ids_from_mask, sampler_extras

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
    topk_ids: Tensor | None = None  # [N, T, k] on request, at sampled positions (0 elsewhere)
    topk_logprobs: Tensor | None = None  # [N, T, k]
    aux_ids: Tensor | None = None  # [N, T, K]


class _Decoder:
    """The model with a growing KV cache over ``B`` rows (rows may be dropped; ``rows`` maps them back)."""

    def __init__(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> None:
        self.model = model
        self.cache_kw = _cache_argument(model)
        self.mask = attention_mask.long()
        out = model(input_ids=input_ids, attention_mask=self.mask, position_ids=position_ids_from_mask(self.mask),
                    use_cache=True, logits_to_keep=1)
        self.cache, self.logits = _returned_cache(out), out.logits[:, -1]
        self.next_pos = self.mask.sum(dim=1, keepdim=True)  # [B, 1] position of the next real token
        self.rows = torch.arange(input_ids.shape[0], device=input_ids.device)

    def feed(self, tokens: Tensor, real: Tensor) -> None:
        """Append ``tokens`` ``[B, L]`` (``real`` 1 where a token is real, 0 on padding); the next logits of each
        row are taken at its last real token of the chunk (rows with none keep theirs)."""
        positions = self.next_pos + real.long().cumsum(dim=1) - 1
        positions = torch.maximum(positions, self.next_pos - 1).clamp(min=0)
        self.mask = torch.cat([self.mask, real.long()], dim=1)
        out = self.model(input_ids=tokens, attention_mask=self.mask, position_ids=positions, use_cache=True,
                         **{self.cache_kw: self.cache})
        self.cache = _returned_cache(out)
        count = real.long().sum(dim=1)
        last = (count - 1).clamp(min=0)
        fresh = out.logits[torch.arange(tokens.shape[0], device=tokens.device), last]
        self.logits = torch.where((count > 0).unsqueeze(-1), fresh, self.logits)
        self.next_pos = self.next_pos + count.unsqueeze(-1)

    def keep(self, keep: Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.mask, self.logits, self.next_pos, self.rows = (
            self.mask[keep], self.logits[keep], self.next_pos[keep], self.rows[keep])


def left_pad(rows: list[list[int]], pad: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """``(ids, mask)`` ``[n, max len]`` of token-id rows, left-padded with ``pad`` (mask 1 on real ids)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def sample_episodes(
    model: nn.Module, prompt_ids: list[list[int]], observe: Observe, *, eos_token_id: int, pad_token_id: int,
    max_turns: int, max_turn_tokens: int, max_episode_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
    greedy: bool = False, generator: torch.Generator | None = None,
    stop: Callable[[int, list[int]], bool] | None = None, carry_cache: bool = True, topk: int = 0,
    aux_draws: int = 0, aux_generator: torch.Generator | None = None,
) -> EpisodeGeneration:
    """Run ``len(prompt_ids)`` episodes turn by turn (see the module docstring).

    ``observe(rows, actions)`` is called once per turn with the episodes whose turn just ended and the ids they
    sampled in it; it returns the observation ids for each (appended before their next turn) or ``None`` when
    the episode is over. Draws are made for every row of the batch at every decode step (finished rows get a
    dummy distribution), so the random stream does not depend on which rows are still running.
    """
    device = next(model.parameters()).device
    n = len(prompt_ids)
    segments: list[list[tuple[str, list[int]]]] = [[] for _ in range(n)]
    turn_logps: list[list[float]] = [[] for _ in range(n)]  # per row: log-probs of its sampled ids, in order
    turn_extras: list[list[tuple[Tensor | None, ...]]] = [[] for _ in range(n)]  # per sampled id, on request
    history = [list(p) for p in prompt_ids]  # everything fed so far (for carry_cache=False)
    length = [0] * n  # response tokens so far (sampled + observed)
    running = list(range(n))
    truncated = [False] * n
    turns = [0] * n
    ids, mask = left_pad(prompt_ids, pad_token_id, device)
    decoder = _Decoder(model, ids, mask)
    for turn in range(max_turns):
        if not running:
            break
        if not carry_cache and turn > 0:  # the reference: the whole history through the model again
            ids, mask = left_pad([history[r] for r in running], pad_token_id, device)
            decoder = _Decoder(model, ids, mask)
            decoder.rows = torch.tensor(running, device=device)
        slot = {int(r): i for i, r in enumerate(decoder.rows.tolist())}  # episode -> row of the decoder batch
        active = torch.zeros(decoder.rows.numel(), dtype=torch.bool, device=device)
        active[[slot[r] for r in running]] = True
        budget = {r: min(max_turn_tokens, max_episode_tokens - length[r]) for r in running}
        sampled: dict[int, list[int]] = {r: [] for r in running}
        ended: set[int] = set()  # episodes whose turn ended at EOS or a stop string (not cut by a budget)
        for step in range(max(budget.values())):
            scaled = sampling_logits(decoder.logits, temperature, top_p)
            logp_all = torch.log_softmax(scaled, dim=-1)
            if greedy:
                token = decoder.logits.argmax(dim=-1)
            else:
                token = torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator).squeeze(-1)
            logp = logp_all.gather(-1, token.unsqueeze(-1)).squeeze(-1)
            token = torch.where(active, token, torch.full_like(token, pad_token_id))
            extra = sampler_extras(logp_all, topk, aux_draws, aux_generator) if topk or aux_draws else None
            for i in active.nonzero().flatten().tolist():
                r = int(decoder.rows[i])
                tok = int(token[i])
                sampled[r].append(tok)
                turn_logps[r].append(float(logp[i]))
                if extra is not None:
                    turn_extras[r].append(tuple(None if x is None else x[i] for x in extra))
                done = tok == eos_token_id or (stop is not None and stop(r, sampled[r]))
                if done:
                    ended.add(r)
                if done or len(sampled[r]) >= budget[r]:
                    active[i] = False
            if not bool(active.any()):
                break
            decoder.feed(token.unsqueeze(-1), active.long().unsqueeze(-1))
        # a turn's last id is not fed while decoding (its row is no longer active); it goes in with the observation
        for r in running:
            segments[r].append(("model", sampled[r]))
            history[r] += sampled[r]
            length[r] += len(sampled[r])
            turns[r] += 1
        observations = observe(running, [sampled[r] for r in running])
        still = []
        for r, obs in zip(running, observations):
            if obs is None:  # the environment ended it; cut if its last turn was (no EOS within the budget)
                truncated[r] = r not in ended
                continue
            if turns[r] >= max_turns or length[r] + len(obs) >= max_episode_tokens:
                truncated[r] = True  # a limit ends the episode before its next turn
                continue
            segments[r].append(("obs", list(obs)))
            history[r] += list(obs)
            length[r] += len(obs)
            still.append(r)
        if still and carry_cache:
            _append_turn_ends(decoder, still, sampled, segments, pad_token_id, device)
        running = still
    gen = _assemble(segments, turn_logps, truncated, turns, pad_token_id, device)
    if topk or aux_draws:
        gen.topk_ids, gen.topk_logprobs, gen.aux_ids = _assemble_extras(turn_extras, gen.mask)
    return gen


def _append_turn_ends(decoder: _Decoder, rows: list[int], sampled: dict[int, list[int]],
                      segments: list[list[tuple[str, list[int]]]], pad: int, device: torch.device) -> None:
    """Feed, for each continuing episode, its turn's last sampled id and its observation ids (one forward)."""
    slot = {int(r): i for i, r in enumerate(decoder.rows.tolist())}
    keep = torch.tensor(sorted(slot[r] for r in rows), device=device)
    if keep.numel() < decoder.rows.numel():
        decoder.keep(keep)
        slot = {int(r): i for i, r in enumerate(decoder.rows.tolist())}
    chunks = [[] for _ in range(decoder.rows.numel())]
    for r in rows:
        last = sampled[r][-1:]  # the turn's final id (the others were fed while decoding)
        chunks[slot[r]] = last + segments[r][-1][1]
    width = max(len(c) for c in chunks)
    tokens = torch.full((len(chunks), width), pad, dtype=torch.long, device=device)
    real = torch.zeros((len(chunks), width), dtype=torch.long, device=device)
    for i, c in enumerate(chunks):
        tokens[i, :len(c)] = torch.tensor(c, dtype=torch.long, device=device)
        real[i, :len(c)] = 1
    decoder.feed(tokens, real)


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
