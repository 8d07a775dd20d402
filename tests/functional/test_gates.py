"""FlashREINFORCE's Bernoulli KL and trajectory gate (Hu et al. 2026), and the batch-centred
advantages with a precomputed (global) mean."""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.functional import batch_centered_advantages, bernoulli_kl, trajectory_gate
from tests.tolerances import gamma, log_softmax_tolerance, unit_roundoff

LOG = math.log
U32, U64 = unit_roundoff(torch.float32), unit_roundoff(torch.float64)


def _bkl(p: float, q: float) -> float:
    """FlashREINFORCE's formula in float64 Python arithmetic."""
    return p * LOG(p / q) + (1 - p) * LOG((1 - p) / (1 - q))


def _terms(p: float, q: float) -> float:
    """``|t1| + |t2|``: the magnitude of the two terms of ``_bkl``, which cancel down to d."""
    return abs(p * LOG(p / q)) + abs((1 - p) * LOG((1 - p) / (1 - q)))


# ---------------------------------------------------------------------------------------------------------------
# bernoulli_kl
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "q"), [(0.5, 0.25), (0.2, 0.4), (0.9, 0.6), (0.01, 0.3), (0.999, 0.99)])
def test_hand_values(p, q):
    # e.g. p = 0.5, q = 0.25: 0.5 log 2 + 0.5 log(0.5 / 0.75) = 0.34657 - 0.20273 = 0.14384
    exact = _bkl(p, q)
    d64 = bernoulli_kl(torch.tensor([LOG(p)], dtype=torch.float64), torch.tensor([LOG(q)], dtype=torch.float64))
    assert d64.dtype == torch.float64
    # each of the two terms carries a few roundings (exp, 1 - ·, log, division, product: 8 u) relative to itself,
    # and the terms cancel down to d by at most a factor (|t1| + |t2|) / d: 8 u of the terms, plus the final
    # rounding u of d. In float64 the Python reference rounds as much, and its logs of the rounded ratios p/q,
    # (1-p)/(1-q) (near 1 when p ≈ q) carry u absolute each, weighted by p and 1 - p: u more
    terms = _terms(p, q)
    assert abs(d64.item() - exact) <= 16 * U64 * terms + 2 * U64 + U64 * exact
    d32 = bernoulli_kl(torch.tensor([LOG(p)]), torch.tensor([LOG(q)]))
    assert d32.dtype == torch.float32
    assert abs(d32.item() - exact) <= 8 * U32 * terms + U32 * exact


def test_worked_example_of_the_docstring():
    d = bernoulli_kl(torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25])))
    assert abs(d.item() - _bkl(0.5, 0.25)) <= 8 * U32 * _terms(0.5, 0.25) + U32 * _bkl(0.5, 0.25)  # as above


def test_nonnegative_and_zero_iff_equal():
    gen = torch.Generator().manual_seed(0)
    # log-probs of probabilities inside the clamp range [1e-6, 1 - 1e-6]
    logp = -torch.rand(2000, generator=gen, dtype=torch.float64) * 12
    logq = -torch.rand(2000, generator=gen, dtype=torch.float64) * 12
    d = bernoulli_kl(logp, logq)
    assert (d >= 0).all() and (d > 0).all()  # p != q almost surely, so d > 0 strictly
    assert torch.equal(bernoulli_kl(logp, logp.clone()), torch.zeros_like(logp))
    d32 = bernoulli_kl(logp.float(), logq.float())
    assert d32.dtype == torch.float32 and (d32 >= 0).all()
    assert torch.equal(bernoulli_kl(logp.float(), logp.float()), torch.zeros(2000))
    assert bernoulli_kl(logp.view(40, 50), logq.view(40, 50)).shape == (40, 50)


def test_finite_near_one_and_near_zero():
    near_one = math.log1p(-1e-9)  # p = 1 - 1e-9: log(1 - p) would be -inf without the clamp in float32
    cases = [(near_one, 0.0), (0.0, near_one), (0.0, 0.0), (near_one, LOG(0.5)), (0.0, LOG(0.5)),
             (LOG(0.5), 0.0), (-200.0, 0.0), (0.0, -200.0), (-1e-7, -2e-7), (-1e-30, -1e-3)]
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        logp = torch.tensor([c[0] for c in cases], dtype=dtype)
        logq = torch.tensor([c[1] for c in cases], dtype=dtype)
        d = bernoulli_kl(logp, logq)
        assert torch.isfinite(d).all() and (d >= 0).all(), (dtype, d)
    # both beyond 1 - 1e-6: clamped to the same value, d = 0; q = 1 with p = 1/2 is q = 1 - 1e-6
    d = bernoulli_kl(torch.tensor([near_one, LOG(0.5)], dtype=torch.float64),
                     torch.tensor([0.0, 0.0], dtype=torch.float64))
    assert d[0].item() == 0.0
    # ≈ 6.2, finite. The reference's 1 - q is 1 minus the double nearest 1 - 1e-6, off by up to u = 1.1e-16, i.e.
    # u / 1e-6 relative, which its log passes on times 1 - p = 1/2; plus test_hand_values' bound
    bound = 0.5 * U64 / 1e-6 + 16 * U64 * _terms(0.5, 1 - 1e-6) + 2 * U64 + U64 * d[1].item()
    assert abs(d[1].item() - _bkl(0.5, 1 - 1e-6)) <= bound


def _slack(log_mu: torch.Tensor, log_pi: torch.Tensor, logits_mu: torch.Tensor,
           logits_pi: torch.Tensor) -> torch.Tensor:
    """float64 rounding slack of ``d <= full`` (``[N, V]``): both are functions of the same rounded log-softmax
    values, each within half ``log_softmax_tolerance`` of the exact ones, where ``d <= full`` holds exactly; to
    first order that moves each side by that times the sum of its partial derivatives (autograd; large where a
    probability is near 1, whose complement ``-expm1`` is ill-conditioned). Plus each side's own rounding: the V
    terms of the full KL (size ``μ |log μ - log π|``, summed), d's two terms (8 u each, test_hand_values)."""
    delta = max(log_softmax_tolerance(logits_mu), log_softmax_tolerance(logits_pi)) / 2
    lm, lp = log_mu.clone().requires_grad_(True), log_pi.clone().requires_grad_(True)
    d = bernoulli_kl(lm, lp)
    full = (lm.exp() * (lm - lp)).sum(-1, keepdim=True)
    cond_d = sum(g.abs() for g in torch.autograd.grad(d.sum(), (lm, lp), retain_graph=True))
    cond_full = sum(g.abs() for g in torch.autograd.grad(full.sum(), (lm, lp))).sum(-1, keepdim=True)
    mu, pi = log_mu.exp(), log_pi.exp()
    full_terms = (mu * (log_mu - log_pi).abs()).sum(-1, keepdim=True)
    d_terms = (mu * (log_mu - log_pi)).abs() + ((1 - mu) * ((1 - mu) / (1 - pi)).log()).abs()
    own = gamma(log_mu.shape[-1] + 4, torch.float64) * full_terms + 8 * U64 * d_terms + U64 * full.detach().abs()
    return delta * (cond_d + cond_full) + own


def test_lower_bound_of_the_full_vocabulary_kl_on_random_categoricals():
    """Data processing: the Bernoulli KL of {token k, not k} is <= KL(μ || π) for every token k."""
    gen = torch.Generator().manual_seed(1)
    for vocab in (2, 3, 8, 50):
        logits_mu = torch.randn(500, vocab, generator=gen, dtype=torch.float64)
        logits_pi = logits_mu + torch.randn(500, vocab, generator=gen, dtype=torch.float64) * 0.7
        log_mu, log_pi = logits_mu.log_softmax(-1), logits_pi.log_softmax(-1)
        assert log_mu.exp().min() > 1e-6 and log_pi.exp().min() > 1e-6  # inside the clamp: the exact formula
        full = (log_mu.exp() * (log_mu - log_pi)).sum(-1, keepdim=True)  # [500, 1]
        d = bernoulli_kl(log_mu, log_pi)  # [500, V]: every token as the sampled one
        slack = _slack(log_mu, log_pi, logits_mu, logits_pi)
        assert (d <= full + slack).all(), vocab
        if vocab == 2:  # {k, not k} is the whole distribution: equality
            assert ((d - full).abs() <= slack).all()
        else:
            assert (d < full).float().mean() > 0.99  # a strict bound almost everywhere
        sampled = torch.multinomial(log_mu.exp(), 1, generator=gen)  # tokens drawn from μ, as in a rollout
        assert (d.gather(1, sampled) <= full + slack.gather(1, sampled)).all()


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="shape"):
        bernoulli_kl(torch.zeros(2, 3), torch.zeros(3, 2))


# ---------------------------------------------------------------------------------------------------------------
# trajectory_gate
# ---------------------------------------------------------------------------------------------------------------


def test_gate_on_hand_rows():
    nan = float("nan")
    d = torch.tensor([
        [0.25, 0.75, 0.0],   # mean 0.5 = δ exactly: kept
        [0.25, 0.75, 9.0],   # mean over all 3 = 10/3 > δ: filtered
        [0.25, 1.0, nan],    # mean over the masked 2 = 0.625 > δ (the NaN is outside the mask): filtered
        [1.0, 0.0, 0.0],     # mean over the masked 1 ... = 1.0 > δ: filtered
        [0.1, 0.2, nan],     # mean 0.15: kept
        [0.0, 0.0, 0.0],     # no generated token: 0
    ])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0], [0, 0, 0]])
    gate = trajectory_gate(d, mask, delta=0.5)
    assert gate.dtype == torch.float32 and gate.shape == (6,)
    assert gate.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert torch.equal(trajectory_gate(d, mask.bool(), delta=0.5), gate)  # bool masks too
    assert trajectory_gate(d, mask, delta=math.inf).tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]  # empty stays 0
    # just above δ: 0.5 + 2^-23 is the next float32 after 0.5 (a mean of [0.25, 0.75 + 2^-22])
    above = torch.tensor([[0.25, 0.75 + 2.0**-22]])
    assert trajectory_gate(above, torch.ones(1, 2), delta=0.5).tolist() == [0.0]


def test_gate_of_the_docstring_and_of_bernoulli_kl():
    gate = trajectory_gate(torch.tensor([[0.0, 0.2], [0.1, 9.0], [0.0, 0.0]]), torch.tensor([[1, 1], [1, 0], [0, 0]]),
                           delta=0.1)
    assert gate.tolist() == [1.0, 1.0, 0.0]
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    logq = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.25]]))  # row 1: d = [0, 0.1438], mean 0.0719
    d = bernoulli_kl(logp, logq)
    assert trajectory_gate(d, torch.ones(2, 2), delta=0.07).tolist() == [1.0, 0.0]
    assert trajectory_gate(d, torch.ones(2, 2), delta=0.072).tolist() == [1.0, 1.0]


def test_gate_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="shape"):
        trajectory_gate(torch.zeros(2, 3), torch.ones(2, 2), 0.1)


# ---------------------------------------------------------------------------------------------------------------
# batch_centered_advantages with a given mean (the global mean under data parallelism)
# ---------------------------------------------------------------------------------------------------------------


def test_batch_centered_with_a_given_mean():
    rewards = torch.tensor([1.0, 0.0])
    # this rank saw [1, 0], the other one [0, 0]: the global mean is 0.25
    assert batch_centered_advantages(rewards, mean=0.25).tolist() == [0.75, -0.25]
    assert batch_centered_advantages(rewards, mean=torch.tensor(0.25)).tolist() == [0.75, -0.25]
    assert torch.equal(batch_centered_advantages(rewards), batch_centered_advantages(rewards, mean=None))
    assert batch_centered_advantages(rewards).tolist() == [0.5, -0.5]  # the local mean when omitted
