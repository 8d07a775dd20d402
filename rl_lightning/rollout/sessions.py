"""``ModuleSession``: multi-turn sessions of the in-process engines, on a Hugging Face model's KV cache.

A turn feeds one sampled token per running row; when the turn ends, each continuing episode's last sampled id
and its observation ids go into the cache in one forward (``append``), so the history is never re-encoded. With
``carry_cache=False`` the whole history is run through the model again at the start of every turn instead (a
reference; the draws are the same).

Draws are made for every row of the cache at every decode step (rows whose turn has ended get a dummy
distribution), so the random stream does not depend on which rows are still running.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from rl_lightning.rollout.engine import EngineSession, SamplingParams, StopCheck, Turn, seeded
from rl_lightning.rollout.generation import (
    cache_argument, draw, position_ids_from_mask, returned_cache, sampler_extras,
)


def left_pad(rows: Sequence[Sequence[int]], pad: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """``(ids, mask)`` ``[n, max len]`` of token-id rows, left-padded with ``pad`` (mask 1 on real ids)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode (no dropout) for the block, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


class _Decoder:
    """The model with a growing KV cache over ``B`` rows (rows may be dropped; ``rows`` maps them back)."""

    def __init__(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> None:
        self.model = model
        self.cache_kw = cache_argument(model)
        self.mask = attention_mask.long()
        out = model(input_ids=input_ids, attention_mask=self.mask, position_ids=position_ids_from_mask(self.mask),
                    use_cache=True, logits_to_keep=1)
        self.cache, self.logits = returned_cache(out), out.logits[:, -1]
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
        self.cache = returned_cache(out)
        count = real.long().sum(dim=1)
        last = (count - 1).clamp(min=0)
        fresh = out.logits[torch.arange(tokens.shape[0], device=tokens.device), last]
        self.logits = torch.where((count > 0).unsqueeze(-1), fresh, self.logits)
        self.next_pos = self.next_pos + count.unsqueeze(-1)

    def keep(self, keep: Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.mask, self.logits, self.next_pos, self.rows = (
            self.mask[keep], self.logits[keep], self.next_pos[keep], self.rows[keep])


class ModuleSession(EngineSession):
    """A session on ``model`` (see the module docstring); its draws use the generator seeded by
    ``params.seed`` (the auxiliary draws ``params.aux_seed``), one stream over the whole session."""

    def __init__(self, model: nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 carry_cache: bool = True) -> None:
        self.model, self.params, self.carry_cache = model, params, carry_cache
        self.device = next(model.parameters()).device
        self.generator = seeded(params.seed, self.device)
        self.aux_generator = seeded(params.aux_seed, self.device)
        self.history = [list(p) for p in prompts]  # everything fed so far (for carry_cache=False)
        self.last: dict[int, list[int]] = {}  # per row: the last id of its turn, fed with its observation
        self.reencode = False
        with torch.no_grad(), evaluating(model):
            self.decoder = _Decoder(model, *left_pad(self.history, params.pad_token_id, self.device))

    @torch.no_grad()
    def turn(self, rows: list[int], budgets: list[int], stop: StopCheck | None = None) -> Turn:
        p = self.params
        with evaluating(self.model):
            if self.reencode:  # the reference: the whole history through the model again
                self.decoder = _Decoder(self.model, *left_pad([self.history[r] for r in rows], p.pad_token_id,
                                                               self.device))
                self.decoder.rows = torch.tensor(rows, device=self.device)
            return self._turn(rows, budgets, stop)

    def _turn(self, rows: list[int], budgets: list[int], stop: StopCheck | None) -> Turn:
        p, decoder = self.params, self.decoder
        slot = {int(r): i for i, r in enumerate(decoder.rows.tolist())}  # episode -> row of the decoder batch
        active = torch.zeros(decoder.rows.numel(), dtype=torch.bool, device=self.device)
        active[[slot[r] for r in rows]] = True
        budget = dict(zip(rows, budgets))
        sampled: dict[int, list[int]] = {r: [] for r in rows}
        logps: dict[int, list[float]] = {r: [] for r in rows}
        extras: dict[int, list] = {r: [] for r in rows}
        ended: set[int] = set()  # rows whose turn ended at EOS or a stop check (not cut by a budget)
        want_extras = bool(p.topk or p.aux_draws)
        for _ in range(max(budgets)):
            token, logp, logp_all = draw(decoder.logits, p.temperature, p.top_p, p.greedy, self.generator)
            token = torch.where(active, token, torch.full_like(token, p.pad_token_id))
            extra = sampler_extras(logp_all, p.topk, p.aux_draws, self.aux_generator) if want_extras else None
            for i in active.nonzero().flatten().tolist():
                r = int(decoder.rows[i])
                tok = int(token[i])
                sampled[r].append(tok)
                logps[r].append(float(logp[i]))
                if extra is not None:
                    extras[r].append(tuple(None if x is None else x[i] for x in extra))
                done = tok == p.eos_token_id or (stop is not None and stop(r, sampled[r]))
                if done:
                    ended.add(r)
                if done or len(sampled[r]) >= budget[r]:
                    active[i] = False
            if not bool(active.any()):
                break
            decoder.feed(token.unsqueeze(-1), active.long().unsqueeze(-1))
        # a turn's last id is not fed while decoding (its row is no longer active); it goes in with the observation
        for r in rows:
            self.history[r] += sampled[r]
            self.last[r] = sampled[r][-1:]
        return Turn([sampled[r] for r in rows], [logps[r] for r in rows],
                    ["stop" if r in ended else "length" for r in rows],
                    [extras[r] for r in rows] if want_extras else None)

    @torch.no_grad()
    def append(self, rows: list[int], ids: list[list[int]]) -> None:
        for r, obs in zip(rows, ids):
            self.history[r] += list(obs)
        if not self.carry_cache:
            self.reencode = True
            return
        decoder = self.decoder
        slot = {int(r): i for i, r in enumerate(decoder.rows.tolist())}
        keep = torch.tensor(sorted(slot[r] for r in rows), device=self.device)
        if keep.numel() < decoder.rows.numel():
            decoder.keep(keep)
            slot = {int(r): i for i, r in enumerate(decoder.rows.tolist())}
        chunks: list[list[int]] = [[] for _ in range(decoder.rows.numel())]
        for r, obs in zip(rows, ids):
            chunks[slot[r]] = self.last[r] + list(obs)  # the turn's final id, then the observation
        width = max(len(c) for c in chunks)
        tokens = torch.full((len(chunks), width), self.params.pad_token_id, dtype=torch.long, device=self.device)
        real = torch.zeros((len(chunks), width), dtype=torch.long, device=self.device)
        for i, c in enumerate(chunks):
            tokens[i, :len(c)] = torch.tensor(c, dtype=torch.long, device=self.device)
            real[i, :len(c)] = 1
        with evaluating(self.model):
            decoder.feed(tokens, real)


#: ``complete(histories, budgets, seeds)`` -> per row: (sampled ids, their log-probs, finish reason, extras or None)
Complete = Callable[[list[list[int]], list[int], list[int | None]],
                    list[tuple[list[int], list[float], str, list | None]]]


class ResubmitSession(EngineSession):
    """A session for an engine that samples whole requests (vLLM, a server): every turn re-submits each running
    row's full history (prompt, turns, observations: exactly the ids of the conversation, never re-tokenised), and
    the engine's prefix cache makes the shared history cheap.

    ``complete`` samples one turn per history with its budget and seed; a turn's seed derives from
    ``params.seed``, the row and the turn, so a session is reproducible. A ``stop`` check is applied to the turn's
    ids afterwards: the turn is cut after the first id at which it says stop (the ids before it are the ones an
    engine checking per id would have drawn; only the draws after it are wasted).
    """

    def __init__(self, complete: Complete, prompts: Sequence[Sequence[int]], params: SamplingParams) -> None:
        self.complete, self.params = complete, params
        self.history = [list(p) for p in prompts]
        self.turns = [0] * len(self.history)

    def _seed(self, row: int) -> int | None:
        if self.params.seed is None:
            return None
        return ((self.params.seed * 1_000_003 + row) * 1_009 + self.turns[row]) % (2**63 - 1)

    def turn(self, rows: list[int], budgets: list[int], stop: StopCheck | None = None) -> Turn:
        results = self.complete([self.history[r] for r in rows], list(budgets), [self._seed(r) for r in rows])
        ids, logps, reasons, extras = [], [], [], []
        for r, (row_ids, row_logps, reason, row_extras) in zip(rows, results):
            if stop is not None:
                cut = next((k for k in range(1, len(row_ids) + 1) if stop(r, row_ids[:k])), None)
                if cut is not None:
                    row_ids, row_logps, reason = row_ids[:cut], row_logps[:cut], "stop"
                    row_extras = None if row_extras is None else row_extras[:cut]
            self.history[r] += row_ids
            self.turns[r] += 1
            ids.append(row_ids)
            logps.append(row_logps)
            reasons.append(reason)
            extras.append(row_extras)
        return Turn(ids, logps, reasons, extras if self.params.topk else None)

    def append(self, rows: list[int], ids: list[list[int]]) -> None:
        for r, obs in zip(rows, ids):
            self.history[r] += list(obs)
