"""Per-token log-probabilities and entropy from logits, under the sampler's exact distribution.

The sampler draws from ``softmax(truncate_top_p(logits / temperature))``; the learner must score tokens under
the same distribution, so both call ``sampling_logprobs`` (design contract: on-policy, recomputed log-probs
equal the recorded ones). Work is chunked over rows so at most ``chunk_size`` rows of ``[T, V]`` float32
temporaries are alive at once.
"""

from __future__ import annotations

import torch
from torch import Tensor


def top_p_mask(scaled_logits: Tensor, top_p: float) -> Tensor:
    """Boolean mask of the nucleus: the smallest set of highest-probability tokens whose mass reaches ``top_p``.

    The most likely token is always kept. Matches the usual top-p warper (keep a token while the mass of the
    tokens strictly more likely than it is below ``top_p``).
    """
    if top_p >= 1.0:
        return torch.ones_like(scaled_logits, dtype=torch.bool)
    sorted_logits, order = torch.sort(scaled_logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sampling_log_softmax(logits: Tensor, temperature: float = 1.0, top_p: float = 1.0,
                         keep: Tensor | None = None) -> Tensor:
    """Log-probabilities of the sampling distribution: ``log_softmax`` of temperature-scaled, top-p-truncated logits.

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
    return torch.log_softmax(scaled, dim=-1)


def sampling_logprobs(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    chunk_size: int = 16,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of ``tokens`` (and optionally the entropy) under the sampling distribution, chunked over rows.

    Args:
        logits: ``[B, T, V]`` logits predicting each token of ``tokens``.
        tokens: ``[B, T]`` token ids.
        temperature, top_p: the sampler's settings.
        chunk_size: rows per chunk.
        with_entropy: also return the per-token entropy ``-Σ_v p_v log p_v`` (it carries the gradient).

    Returns:
        ``(logprobs [B, T], entropy [B, T] or None)``.
    """
    out, ent = [], []
    for start in range(0, logits.shape[0], chunk_size):
        chunk = logits[start:start + chunk_size]
        tok = tokens[start:start + chunk_size]
        logp_all = sampling_log_softmax(chunk, temperature, top_p, keep=tok)  # [b, T, V]
        out.append(logp_all.gather(-1, tok.unsqueeze(-1)).squeeze(-1))
        if with_entropy:  # differentiable (entropy bonuses); callers detach it for metrics
            p = logp_all.exp()
            ent.append(-(p * logp_all.masked_fill(p == 0, 0.0)).sum(-1))
        del logp_all
    return torch.cat(out), (torch.cat(ent) if with_entropy else None)
