"""Per-token log-probabilities and entropy from logits, under the sampler's exact distribution.

The sampler draws from ``softmax(truncate_top_p(logits / temperature))``; the learner must score tokens under
the same distribution, so both call ``sampling_logprobs`` (design contract: on-policy, recomputed log-probs
equal the recorded ones). ``sampling_logprobs`` works on ``chunk_size`` positions at a time and never saves a
``[B, T, V]`` (log-)softmax for backward, so its peak is the logits, their gradient and ``[chunk_size, V]``
temporaries (``experiments/bench_logprob_memory.py`` measures it against the naive ``log_softmax().gather()``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

DEFAULT_CHUNK_POSITIONS = 256
"""Default ``chunk_size`` of ``sampling_logprobs``, in positions. Peak memory is about the logits plus their
gradient plus two or three ``[chunk_size, V]`` float32 temporaries: at V = 49,152 each is 48 MiB (vs 192 MiB at
1024, which measured 0.75 of a ``[B, T, V]`` float32 copy more than 256 at B = 4, T = 512), while 256 × V elements
per kernel keep the per-chunk overhead negligible, on GPU too."""


def top_p_mask(scaled_logits: Tensor, top_p: float) -> Tensor:
    """Boolean mask of the nucleus: the smallest set of highest-probability tokens whose mass reaches ``top_p``.

    The most likely token is always kept. Matches the usual top-p warper (keep a token while the mass of the
    tokens strictly more likely than it is below ``top_p``).
    """
    if top_p >= 1.0:
        return torch.ones_like(scaled_logits, dtype=torch.bool)
    # stable: ties break the same way in the sampler, in the learner and in a backward recomputation
    sorted_logits, order = torch.sort(scaled_logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sampling_logits(logits: Tensor, temperature: float = 1.0, top_p: float = 1.0,
                    keep: Tensor | None = None) -> Tensor:
    """Temperature-scaled, top-p-truncated float32 logits (``-inf`` outside the nucleus): the sampling
    distribution is ``softmax`` of these.

    Args:
        logits: ``[..., V]`` raw logits.
        temperature: > 0.
        top_p: nucleus mass in ``(0, 1]``.
        keep: optional ``[...]`` token ids that stay in the support even if truncation would drop them (the
            learner passes the sampled tokens so an off-policy ratio is never ``exp(-inf)``).
    """
    scaled = logits.float() / temperature
    if top_p < 1.0:
        support = top_p_mask(scaled, top_p)
        if keep is not None:
            support = support.scatter(-1, keep.unsqueeze(-1), True)
        scaled = scaled.masked_fill(~support, float("-inf"))
    return scaled


def sampling_log_softmax(logits: Tensor, temperature: float = 1.0, top_p: float = 1.0,
                         keep: Tensor | None = None) -> Tensor:
    """Log-probabilities of the sampling distribution: ``log_softmax(sampling_logits(...))``."""
    return torch.log_softmax(sampling_logits(logits, temperature, top_p, keep), dim=-1)


def position_chunks(batch: int, width: int, chunk_size: int) -> Iterator[tuple]:
    """Index tuples into ``[B, T, ...]`` covering every position once, at most ``chunk_size`` positions each.

    Chunks are whole rows (``logits[r0:r1]``) when ``chunk_size >= T``, else slices of one row
    (``logits[b, t0:t1]``): both are views, so no ``[B*T, V]`` flattened copy of (possibly non-contiguous) logits
    is ever made.
    """
    if batch == 0 or width == 0:
        return
    if chunk_size >= width:
        rows = chunk_size // width
        for r in range(0, batch, rows):
            yield (slice(r, r + rows),)
    else:
        for b in range(batch):
            for t in range(0, width, chunk_size):
                yield (b, slice(t, t + chunk_size))


def _chunk_values(logits: Tensor, ids: Tensor, temperature: float, top_p: float,
                  with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """``(logprobs [..., J], entropy or None)`` of one chunk at ``ids`` ``[..., J]`` (column 0: the sampled token,
    kept in the top-p support), without autograd (in place on the chunk's temporaries).

    ``log_softmax`` of the chunk is the sampler's own kernel (``generation`` scores its draws with
    ``log_softmax(sampling_logits(...))``), so on-policy the recomputed log-probs match the recorded ones as
    closely as the logits do; it is a ``[chunk, V]`` temporary, never a ``[B, T, V]`` one.
    """
    logp = torch.log_softmax(sampling_logits(logits, temperature, top_p, ids[..., 0]), dim=-1)  # -inf off support
    lp = logp.gather(-1, ids)
    ent = None
    if with_entropy:
        p = logp.exp()
        ent = p.mul_(logp.masked_fill_(torch.isneginf(logp), 0.0)).sum(-1).neg_()  # 0·(-inf) → 0, not NaN
    return lp, ent


def chunk_values_autograd(logits: Tensor, ids: Tensor, temperature: float, top_p: float,
                           with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """``(logprobs [..., J], entropy or None)`` of one chunk with out-of-place, differentiable ops (double
    backward)."""
    logp = torch.log_softmax(sampling_logits(logits, temperature, top_p, ids[..., 0]), dim=-1)
    lp = logp.gather(-1, ids)
    if not with_entropy:
        return lp, None
    return lp, -(logp.exp() * logp.masked_fill(torch.isneginf(logp), 0.0)).sum(-1)


class _SamplingLogprobs(torch.autograd.Function):
    """Chunked log-probs at ``ids`` ``[B, T, J]`` (and entropy) whose backward recomputes each chunk's softmax.

    Autograd keeps only the logits (the input, alive anyway), the ids and the ``[B, T]`` entropy: no
    ``[B, T, V]`` (log-)softmax is saved. The backward allocates the one ``[B, T, V]`` logits gradient (or, with
    ``overwrite``, writes it over the saved logits, each chunk after its softmax is recomputed) and fills it chunk
    by chunk with the closed form (``s`` = scaled logits, ``ℓ = log_softmax(s)``, ``p = exp ℓ``, ``H``
    the entropy, ``g_j``/``h`` the incoming gradients of the log-prob at ``ids[..., j]``/of the entropy)::

        ∂L/∂s_v = Σ_j g_j · (1[v = ids_j] - p_v) - h · p_v (ℓ_v + H),    ∂s/∂logits = 1/τ on the support, 0 off

    An id outside the top-p support (possible for ``j >= 1``; column 0 is kept in it) has log-prob ``-inf`` and
    passes no gradient. Under ``create_graph=True`` it recomputes each chunk with differentiable ops instead, so
    double backward (e.g. Fisher-vector products) still works.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor, temperature: float, top_p: float, chunk_size: int,
                with_entropy: bool, overwrite: bool):  # noqa: ANN205
        lp, ent = _chunked_values(logits, ids, temperature, top_p, chunk_size, with_entropy)
        ctx.set_materialize_grads(False)
        ctx.settings = (temperature, top_p, chunk_size, with_entropy)
        ctx.overwrite = overwrite
        ctx.save_for_backward(logits, ids, ent)
        return (lp, ent) if with_entropy else lp

    @staticmethod
    def backward(ctx, grad_lp: Tensor | None, grad_ent: Tensor | None = None):  # noqa: ANN205
        logits, ids, ent = ctx.saved_tensors
        temperature, top_p, chunk_size, with_entropy = ctx.settings
        none = (None,) * 6
        if grad_lp is None and grad_ent is None:
            return (None, *none)
        batch, width = ids.shape[:2]
        if torch.is_grad_enabled():  # create_graph=True: differentiable recomputation, chunk by chunk
            grad = torch.zeros_like(logits)
            for idx in position_chunks(batch, width, chunk_size):
                chunk = logits[idx]
                lp, e = chunk_values_autograd(chunk, ids[idx], temperature, top_p, with_entropy)
                outs, grads = [], []
                if grad_lp is not None:
                    outs.append(lp), grads.append(grad_lp[idx])
                if grad_ent is not None:
                    outs.append(e), grads.append(grad_ent[idx])
                grad[idx] = torch.autograd.grad(outs, chunk, grads, create_graph=True)[0]
            return (grad, *none)
        grad = logits if ctx.overwrite else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for idx in position_chunks(batch, width, chunk_size):
            chunk_ids = ids[idx]
            logp = torch.log_softmax(sampling_logits(logits[idx], temperature, top_p, chunk_ids[..., 0]), dim=-1)
            g_ids = None
            if grad_lp is not None:
                g_ids = grad_lp[idx]
                if top_p < 1.0 and chunk_ids.shape[-1] > 1:  # an id off the support: log-prob -inf, no gradient
                    g_ids = g_ids.masked_fill(torch.isneginf(logp.gather(-1, chunk_ids)), 0.0)
            p = logp.exp()
            if grad_ent is not None:  # -p (Σ g + h (ℓ + H)), with ℓ + H := 0 off the support (p = 0 there)
                inner = logp.add_(ent[idx].unsqueeze(-1))
                inner = inner.masked_fill_(torch.isneginf(inner), 0.0).mul_(grad_ent[idx].unsqueeze(-1))
                if g_ids is not None:
                    inner.add_(g_ids.sum(-1, keepdim=True))
                g = inner.mul_(p).neg_()
            else:
                g = p.mul_(g_ids.sum(-1, keepdim=True)).neg_()
            del logp, p
            if g_ids is not None:
                g.scatter_add_(-1, chunk_ids, g_ids)
            if temperature != 1.0:
                g.div_(temperature)
            grad[idx] = g
            del g
        return (grad, *none)


def _chunked_values(logits: Tensor, ids: Tensor, temperature: float, top_p: float, chunk_size: int,
                    with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """``_chunk_values`` over all positions, written into ``[B, T, J]`` / ``[B, T]`` outputs (no autograd)."""
    batch, width, count = ids.shape
    lp = torch.empty(batch, width, count, dtype=torch.float32, device=logits.device)
    ent = torch.empty(batch, width, dtype=torch.float32, device=logits.device) if with_entropy else None
    with torch.no_grad():
        for idx in position_chunks(batch, width, chunk_size):
            lp[idx], e = _chunk_values(logits[idx], ids[idx], temperature, top_p, with_entropy)
            if with_entropy:
                ent[idx] = e
    return lp, ent


def _logprobs_at(logits: Tensor, ids: Tensor, temperature: float, top_p: float, chunk_size: int,
                 with_entropy: bool, overwrite: bool = False) -> tuple[Tensor, Tensor | None]:
    if torch.is_grad_enabled() and logits.requires_grad:
        out = _SamplingLogprobs.apply(logits, ids, temperature, top_p, chunk_size, with_entropy, overwrite)
        return out if with_entropy else (out, None)
    return _chunked_values(logits, ids, temperature, top_p, chunk_size, with_entropy)


def sampling_logprobs(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_POSITIONS,
    with_entropy: bool = False,
    overwrite_logits: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of ``tokens`` (and optionally the entropy) under the sampling distribution, chunked over positions.

    Per position, with ``s = sampling_logits(logits, temperature, top_p, keep=tokens)`` and ``ℓ = log_softmax(s)``
    (the sampler's computation)::

        logprob = ℓ[token]          entropy = -Σ_v exp(ℓ_v) ℓ_v   (0 · log 0 = 0 off the top-p support)

    No ``[B, T, V]`` (log-)softmax is materialised: ``chunk_size`` positions are processed at a time, and when
    ``logits`` requires grad a custom autograd function saves only ``logits`` and ``[B, T]`` statistics and
    recomputes each chunk's softmax in backward. Peak extra memory is about one ``[B, T, V]`` gradient (in
    ``logits``' dtype, during backward; none with ``overwrite_logits``) plus a few ``[chunk_size, V]`` float32
    temporaries. Values and gradients equal ``log_softmax(s).gather(...)`` (and its entropy); double backward is
    supported.
    ``sampling_logprobs_at`` also returns the log-probs at other ids from the same pass.

    Args:
        logits: ``[B, T, V]`` logits predicting each token of ``tokens`` (any float dtype, may be a view).
        tokens: ``[B, T]`` token ids; they stay in the support under top-p (``keep``).
        temperature, top_p: the sampler's settings.
        chunk_size: positions (of the ``B*T``) per chunk, not rows; chunks are ``chunk_size // T`` whole rows when
            ``chunk_size >= T``, else pieces of one row. Small values are correct but slower (one Python-level
            chunk each).
        with_entropy: also return the per-token entropy ``-Σ_v p_v log p_v`` (it carries the gradient).
        overwrite_logits: the backward writes the logits' gradient over ``logits`` itself instead of into a new
            ``[B, T, V]`` buffer: one ``[B, T, V]`` less at the backward's peak, the same gradient bits. Only for
            logits nothing reads after the backward (``forward.policy_forward``'s, made and dropped inside it): a
            second backward through them (``retain_graph=True``) fails loudly in autograd's in-place check.

    Returns:
        ``(logprobs [B, T], entropy [B, T] or None)``, float32.
    """
    _check_shapes("sampling_logprobs", logits, tokens, chunk_size)
    lp, ent = _logprobs_at(logits, tokens.unsqueeze(-1), temperature, top_p, chunk_size, with_entropy,
                           overwrite_logits)
    return lp.squeeze(-1), ent


def sampling_logprobs_at(
    logits: Tensor,
    tokens: Tensor,
    extra_ids: Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_POSITIONS,
    with_entropy: bool = False,
    overwrite_logits: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``sampling_logprobs`` plus the log-probs at ``extra_ids`` ``[B, T, J]`` (e.g. the sampler's top-k ids or
    auxiliary draws of Score Centering and StableReinforce), from the same chunked pass and backward.

    Every log-prob is under the sampling distribution whose support keeps the sampled token (as
    ``sampling_logprobs``); an extra id outside the top-p support gets ``-inf`` and no gradient (callers that
    multiply by it mask those first). No ``[B, T, V]`` copy beyond the one logits gradient of the backward (none
    with ``overwrite_logits``, as in ``sampling_logprobs``).

    Returns:
        ``(logprobs [B, T], extra_logprobs [B, T, J], entropy [B, T] or None)``, float32.
    """
    _check_shapes("sampling_logprobs_at", logits, tokens, chunk_size)
    if extra_ids.dim() != 3 or extra_ids.shape[:2] != tokens.shape:
        raise ValueError(f"sampling_logprobs_at: extra_ids [B, T, J] expected for tokens {tuple(tokens.shape)}, got "
                         f"{tuple(extra_ids.shape)}")
    ids = torch.cat([tokens.unsqueeze(-1), extra_ids.to(tokens.dtype)], dim=-1)
    lp, ent = _logprobs_at(logits, ids, temperature, top_p, chunk_size, with_entropy, overwrite_logits)
    return lp[..., 0], lp[..., 1:], ent


def _check_shapes(name: str, logits: Tensor, tokens: Tensor, chunk_size: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"{name}: chunk_size must be >= 1, got {chunk_size}")
    if logits.shape[:-1] != tokens.shape or logits.dim() != 3:
        raise ValueError(f"{name}: logits [B, T, V] and tokens [B, T] expected, got "
                         f"{tuple(logits.shape)} and {tuple(tokens.shape)}")
