"""FlashREINFORCE's Bernoulli KL and trajectory gate (spec 000, FlashREINFORCE), and the batch-centred
advantages with a precomputed (global) mean."""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.functional import batch_centered_advantages, bernoulli_kl, trajectory_gate

LOG = math.log


def _bkl(p: float, q: float) -> float:
    """The spec's formula in float64 Python arithmetic."""
    return p * LOG(p / q) + (1 - p) * LOG((1 - p) / (1 - q))


# ---------------------------------------------------------------------------------------------------------------
# bernoulli_kl
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "q"), [(0.5, 0.25), (0.2, 0.4), (0.9, 0.6), (0.01, 0.3), (0.999, 0.99)])
def test_hand_values(p, q):
    # e.g. p = 0.5, q = 0.25: 0.5 log 2 + 0.5 log(0.5 / 0.75) = 0.34657 - 0.20273 = 0.14384
    exact = _bkl(p, q)
    d64 = bernoulli_kl(torch.tensor([LOG(p)], dtype=torch.float64), torch.tensor([LOG(q)], dtype=torch.float64))
    assert d64.dtype == torch.float64
    assert d64.item() == pytest.approx(exact, rel=1e-12)
    # float32: each of the two terms carries a few roundings of 2^-24 (6e-8) relative to itself, and the terms
    # cancel down to d by at most a factor (|t1| + |t2|) / d, so the bound below is 8 ulps of the terms
    d32 = bernoulli_kl(torch.tensor([LOG(p)]), torch.tensor([LOG(q)]))
    terms = abs(p * LOG(p / q)) + abs((1 - p) * LOG((1 - p) / (1 - q)))
    assert d32.dtype == torch.float32
    assert abs(d32.item() - exact) <= 8 * 2.0**-24 * terms + 2.0**-24 * exact


def test_spec_example_of_the_docstring():
    d = bernoulli_kl(torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25])))
    assert d.item() == pytest.approx(0.5 * LOG(2) + 0.5 * LOG(2 / 3), rel=1e-6)


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
    assert d[1].item() == pytest.approx(_bkl(0.5, 1 - 1e-6), rel=1e-9)  # ≈ 6.56, finite


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
        assert (d <= full * (1 + 1e-12) + 1e-15).all(), vocab
        if vocab == 2:  # {k, not k} is the whole distribution: equality
            torch.testing.assert_close(d, full.expand_as(d), rtol=1e-10, atol=1e-15)
        else:
            assert (d < full).float().mean() > 0.99  # a strict bound almost everywhere
        sampled = torch.multinomial(log_mu.exp(), 1, generator=gen)  # tokens drawn from μ, as in a rollout
        assert (d.gather(1, sampled) <= full * (1 + 1e-12) + 1e-15).all()


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
