"""``sampling_logprobs`` (chunked over positions, softmax recomputed in backward) against the naive reference.

The reference is the plain autograd computation ``log_softmax(sampling_logits(...)).gather(...)`` and
``-Σ p log p`` on the whole ``[B, T, V]`` tensor; values, first and second derivatives must agree, to the rounding
bounds of ``tests/tolerances.py`` (``log_softmax_tolerance``, ``entropy_tolerance``,
``softmax_gradient_tolerance``: the ``V``-term sums, the exponentials and ``u`` times the logits' scale).
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.functional import sampling_logits, sampling_logprobs
from rl_lightning.functional.logprobs import position_chunks
from tests.tolerances import (
    entropy_tolerance, gamma, log_softmax_tolerance, softmax_gradient_tolerance, unit_roundoff,
)


def _naive(logits, tokens, temperature, top_p, with_entropy):
    scaled = sampling_logits(logits, temperature, top_p, keep=tokens)
    logp = torch.log_softmax(scaled, dim=-1)
    lp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return lp, None
    p = logp.exp()
    return lp, -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)


def _inputs(seed, B, T, V, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen) * scale
    tokens = torch.randint(0, V, (B, T), generator=gen)
    # random upstream gradients, so every position's two output gradients are exercised
    g_lp = torch.randn(B, T, generator=gen)
    g_ent = torch.randn(B, T, generator=gen)
    return logits, tokens, g_lp, g_ent


def _tolerances(logits, temperature, entropy, *upstream, dtype=None):  # noqa: ANN001, ANN002, ANN202
    """``(log-prob, entropy, logit gradient)`` rounding bounds; ``entropy``: the largest one compared."""
    lp = log_softmax_tolerance(logits, temperature, dtype)
    ent = entropy_tolerance(logits, temperature, entropy, dtype)
    scale = max(float(g.abs().max()) for g in upstream) if upstream else 1.0
    return lp, ent, softmax_gradient_tolerance(logits, temperature, entropy, scale, dtype)


def _value_and_grad(fn, logits, tokens, g_lp, g_ent, temperature, top_p, with_entropy):
    x = logits.clone().requires_grad_(True)
    lp, ent = fn(x, tokens, temperature, top_p, with_entropy)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
    (grad,) = torch.autograd.grad(loss, x)
    return lp.detach(), None if ent is None else ent.detach(), grad


B, T, V = 3, 5, 13  # 15 positions: chunk sizes 1, 4 (< T), 7 (> T, not a multiple), 15, 100 (> B*T)
CHUNKS = [1, 4, 7, 15, 100]


@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.6, 1.0), (1.0, 0.6), (0.8, 0.9)])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_values_and_gradients_match_naive(chunk_size, temperature, top_p, with_entropy):
    logits, tokens, g_lp, g_ent = _inputs(0, B, T, V)
    if top_p < 1.0:  # some sampled tokens fall outside the nucleus: `keep` must put them back
        outside = ~torch.gather(sampling_logits(logits, temperature, top_p).isfinite(), -1, tokens.unsqueeze(-1))
        assert outside.any()

    def chunked(x, tok, tau, p, ent):
        return sampling_logprobs(x, tok, tau, p, chunk_size=chunk_size, with_entropy=ent)

    lp, ent, grad = _value_and_grad(chunked, logits, tokens, g_lp, g_ent, temperature, top_p, with_entropy)
    lp_ref, ent_ref, grad_ref = _value_and_grad(_naive, logits, tokens, g_lp, g_ent, temperature, top_p,
                                                with_entropy)
    entropy = float(ent_ref.max()) if with_entropy else 0.0
    lp_tol, ent_tol, grad_tol = _tolerances(logits, temperature, entropy, g_lp, g_ent)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=lp_tol)
    assert torch.isfinite(lp).all()
    if with_entropy:
        torch.testing.assert_close(ent, ent_ref, rtol=0, atol=ent_tol)
        assert torch.isfinite(ent).all()
    else:
        assert ent is None
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=grad_tol)
    assert torch.isfinite(grad).all()
    if top_p < 1.0:  # tokens outside the (kept) support get exactly no gradient
        support = sampling_logits(logits, temperature, top_p, keep=tokens).isfinite()
        assert (~support).any()
        assert (grad[~support] == 0).all()


@pytest.mark.parametrize("chunk_size", [1, 7, 100])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_without_grad_matches_naive_and_carries_no_graph(chunk_size, with_entropy):
    logits, tokens, _, _ = _inputs(1, B, T, V)
    lp_ref, ent_ref = _naive(logits, tokens, 0.9, 0.8, with_entropy)
    lp, ent = sampling_logprobs(logits, tokens, 0.9, 0.8, chunk_size=chunk_size, with_entropy=with_entropy)
    lp_tol, ent_tol, _ = _tolerances(logits, 0.9, float(ent_ref.max()) if with_entropy else 0.0)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=lp_tol)
    assert not lp.requires_grad
    if with_entropy:
        torch.testing.assert_close(ent, ent_ref, rtol=0, atol=ent_tol)
        assert not ent.requires_grad
    # under no_grad, logits that require grad give values without a graph too
    with torch.no_grad():
        lp2, _ = sampling_logprobs(logits.clone().requires_grad_(True), tokens, 0.9, 0.8, chunk_size=chunk_size)
    torch.testing.assert_close(lp2, lp_ref, rtol=0, atol=lp_tol)
    assert not lp2.requires_grad


def test_larger_case_matches_naive():
    # B*T = 128 positions, V = 4096; chunks of 48 positions (< T, so row slices) and of 100 (whole rows)
    logits, tokens, g_lp, g_ent = _inputs(2, 2, 64, 4096, scale=4.0)
    ref = _value_and_grad(_naive, logits, tokens, g_lp, g_ent, 0.7, 0.95, True)
    for chunk_size in (48, 100):
        def chunked(x, tok, tau, p, ent):
            return sampling_logprobs(x, tok, tau, p, chunk_size=chunk_size, with_entropy=ent)

        got = _value_and_grad(chunked, logits, tokens, g_lp, g_ent, 0.7, 0.95, True)
        # the chunk's log_softmax is the naive (and the sampler's) kernel, and the closed-form gradient rounds
        # otherwise than autograd's: both within float32 rounding of 4096-term sums at logits up to ~25
        lp_tol, ent_tol, grad_tol = _tolerances(logits, 0.7, float(ref[1].max()), g_lp, g_ent)
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=lp_tol)
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=ent_tol)
        torch.testing.assert_close(got[2], ref[2], rtol=0, atol=grad_tol)


def test_only_entropy_or_only_logprobs_receive_gradient():
    # One output unused: the other's gradient alone must come back (the unused one's is None inside backward).
    logits, tokens, g_lp, g_ent = _inputs(3, B, T, V)
    for use_lp, use_ent in ((True, False), (False, True)):
        grads = []
        for fn in (lambda x: sampling_logprobs(x, tokens, 1.3, 0.7, chunk_size=4, with_entropy=True),
                   lambda x: _naive(x, tokens, 1.3, 0.7, True)):
            x = logits.clone().requires_grad_(True)
            lp, ent = fn(x)
            loss = (lp * g_lp).sum() if use_lp else (ent * g_ent).sum()
            grads.append(torch.autograd.grad(loss, x)[0])
            entropy = float(ent.detach().max())
        grad_tol = _tolerances(logits, 1.3, entropy, g_lp if use_lp else g_ent)[2]
        torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=grad_tol)
        assert grads[0].abs().sum() > 0


def test_bfloat16_noncontiguous_logits_like_the_model_output():
    # forward_policy passes `out.logits[:, :-1]`: a non-contiguous view, in the model's dtype.
    full, _, g_lp, g_ent = _inputs(4, B, T + 1, V)
    tokens = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(5))
    g_lp, g_ent = g_lp[:, :T], g_ent[:, :T]
    base = full.to(torch.bfloat16).requires_grad_(True)
    lp, ent = sampling_logprobs(base[:, :-1], tokens, 0.8, 0.9, chunk_size=7, with_entropy=True)
    (grad,) = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), base)
    base_ref = full.to(torch.bfloat16).requires_grad_(True)
    lp_ref, ent_ref = _naive(base_ref[:, :-1], tokens, 0.8, 0.9, True)
    (grad_ref,) = torch.autograd.grad((lp_ref * g_lp).sum() + (ent_ref * g_ent).sum(), base_ref)
    assert lp.dtype == torch.float32 and grad.dtype == torch.bfloat16
    # the same bf16 logits, scored in float32; each float32 gradient is then rounded to bf16 (u = 2^-8 relative)
    lp_tol, ent_tol, grad_tol = _tolerances(base.detach(), 0.8, float(ent_ref.max()), g_lp, g_ent,
                                            dtype=torch.float32)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=lp_tol)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=ent_tol)
    torch.testing.assert_close(grad, grad_ref, rtol=2 * unit_roundoff(torch.bfloat16), atol=grad_tol)
    assert (grad[:, -1] == 0).all()  # the dropped last position gets no gradient


@pytest.mark.parametrize("with_entropy", [False, True])
def test_double_backward_matches_naive(with_entropy):
    # Hessian-vector product of a scalar of the outputs (what a Fisher-vector product needs).
    logits, tokens, g_lp, g_ent = _inputs(6, B, T, V)
    v = torch.randn(B, T, V, generator=torch.Generator().manual_seed(7))
    hvps = []
    for fn in (lambda x: sampling_logprobs(x, tokens, 0.9, 0.8, chunk_size=4, with_entropy=with_entropy),
               lambda x: _naive(x, tokens, 0.9, 0.8, with_entropy)):
        x = logits.clone().requires_grad_(True)
        lp, ent = fn(x)
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
        (grad,) = torch.autograd.grad(loss, x, create_graph=True)
        hvps.append(torch.autograd.grad((grad * v).sum(), x)[0])
        entropy = float(ent.detach().max()) if with_entropy else 0.0
    # the Hessian-vector product Σ_w H_uw v_w: H's entries are products of two gradient-like factors, each of
    # size <= (3 + 1/e + H) / T and carrying the same relative error as the first derivative; the V-term sum over w
    # adds gamma(V): within upstream (3 + 1/e + H)^2 (δ + δ_H + gamma(V) + 6u) · 2 max|v| / T^2 (V = 13 here)
    lp_tol, ent_tol, _ = _tolerances(logits, 0.9, entropy)
    size = (3 + 1 / math.e + entropy) / 0.9
    upstream = max(float(g_lp.abs().max()), float(g_ent.abs().max()))
    atol = upstream * size**2 * (lp_tol + ent_tol + gamma(V) + 6 * unit_roundoff()) * 2 * float(v.abs().max())
    torch.testing.assert_close(hvps[0], hvps[1], rtol=0, atol=atol)
    assert hvps[0].abs().sum() > 0


def test_backward_saves_no_vocab_sized_float_tensor():
    # Autograd must hold the logits (the input) and [B, T] statistics only: no [B, T, V] (log-)softmax.
    logits, tokens, _, _ = _inputs(8, B, T, V)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = logits.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sampling_logprobs(x, tokens, 0.7, 0.9, chunk_size=4, with_entropy=True)
    big = [t for t in saved if t.numel() >= B * T * V]
    assert len(big) == 1 and big[0] is x  # the logits themselves, nothing else vocabulary-sized
    # the naive reference does save [B, T, V] tensors besides the logits (this test can fail)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _naive(x, tokens, 0.7, 0.9, True)
    assert sum(t.numel() >= B * T * V and t is not x for t in saved) >= 2


@pytest.mark.parametrize("batch, width, chunk_size", [(3, 5, 1), (3, 5, 4), (3, 5, 5), (3, 5, 7), (3, 5, 11),
                                                     (3, 5, 100), (1, 1, 1)])
def test_position_chunks_cover_every_position_once_within_the_bound(batch, width, chunk_size):
    count = torch.zeros(batch, width, dtype=torch.long)
    for idx in position_chunks(batch, width, chunk_size):
        assert count[idx].numel() <= chunk_size
        count[idx] += 1
    assert (count == 1).all()


def test_rejects_bad_arguments():
    logits, tokens, _, _ = _inputs(9, B, T, V)
    with pytest.raises(ValueError, match="chunk_size"):
        sampling_logprobs(logits, tokens, chunk_size=0)
    with pytest.raises(ValueError, match="expected"):
        sampling_logprobs(logits, tokens[:, :-1])


def test_empty_batch():
    lp, ent = sampling_logprobs(torch.zeros(0, 4, 7), torch.zeros(0, 4, dtype=torch.long), with_entropy=True)
    assert lp.shape == (0, 4) and ent.shape == (0, 4)
    lp, _ = sampling_logprobs(torch.zeros(2, 0, 7), torch.zeros(2, 0, dtype=torch.long))
    assert lp.shape == (2, 0)


def _overwrite_inputs(overwrite, base, tokens, **kwargs):
    """``(grad of base, what base's storage holds after the backward)``: the logits are the view ``base[:, :-1]`` of a
    non-leaf, as the model's output in ``policy_forward``."""
    leaf = base.clone().requires_grad_(True)
    logits = leaf * 1.0  # a non-leaf whose storage only this function reads after the forward
    lp, ent = sampling_logprobs(logits[:, :-1], tokens, overwrite_logits=overwrite, **kwargs)
    loss = lp.sum() + (ent.sum() if ent is not None else 0.0)
    (grad,) = torch.autograd.grad(loss, leaf)
    return grad, logits.detach().clone()


@pytest.mark.parametrize("with_entropy, top_p", [(False, 1.0), (True, 0.8)])
def test_overwriting_the_logits_gives_the_same_gradient_bits_and_holds_it_in_their_storage(with_entropy, top_p):
    full, _, _, _ = _inputs(9, B, T + 1, V)
    tokens = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(10))
    settings = {"temperature": 0.7, "top_p": top_p, "chunk_size": 4, "with_entropy": with_entropy}
    grad, kept = _overwrite_inputs(False, full, tokens, **settings)
    grad_over, overwritten = _overwrite_inputs(True, full, tokens, **settings)
    assert torch.equal(grad, grad_over)
    assert torch.equal(kept, full)  # by default the logits are left as they were
    assert torch.equal(overwritten[:, :-1], grad[:, :-1]) and torch.equal(overwritten[:, -1], full[:, -1])


def test_overwritten_logits_refuse_a_second_backward_loudly():
    logits, tokens, _, _ = _inputs(11, B, T, V)
    x = logits.clone().requires_grad_(True)
    y = x * 2.0
    lp, _ = sampling_logprobs(y, tokens, overwrite_logits=True)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        lp.sum().backward()


def test_overwriting_keeps_the_double_backward():
    logits, tokens, g_lp, _ = _inputs(12, B, T, V)
    v = torch.randn(B, T, V, generator=torch.Generator().manual_seed(13))
    hvps = []
    for overwrite in (False, True):
        x = logits.clone().requires_grad_(True)
        lp, _ = sampling_logprobs(x * 1.0, tokens, 0.9, 0.8, chunk_size=4, overwrite_logits=overwrite)
        (grad,) = torch.autograd.grad((lp * g_lp).sum(), x, create_graph=True)
        hvps.append(torch.autograd.grad((grad * v).sum(), x)[0])
    assert torch.equal(hvps[0], hvps[1]) and hvps[0].abs().sum() > 0
