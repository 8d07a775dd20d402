"""Worked-example tests for ``rl_lightning.functional.kl`` (Schulman's k1/k2/k3 estimators)."""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.functional import kl_estimate
from tests.tolerances import sum_tolerance


def test_hand_numbers():
    # logp = 0, logp_other = -1 → log_r = logp_other - logp = -1
    #   k1 = -log_r             = 1
    #   k2 = log_r² / 2         = 0.5
    #   k3 = e^{log_r} - 1 - log_r = e^{-1} - 1 + 1 = 0.36788
    logp, other = torch.tensor([0.0]), torch.tensor([-1.0])
    assert kl_estimate(logp, other, "k1").item() == pytest.approx(1.0)
    assert kl_estimate(logp, other, "k2").item() == pytest.approx(0.5)
    # float32: the exp (1 ulp), - 1, - log_r: 4 roundings of terms up to 1
    assert kl_estimate(logp, other, "k3").item() == pytest.approx(math.exp(-1), abs=sum_tolerance(4, 1.0))
    assert kl_estimate(logp, other).item() == kl_estimate(logp, other, "k3").item()  # default is k3
    # log_r = +2 (other more likely): k1 = -2, k2 = 2, k3 = e² - 3 = 4.38906
    logp, other = torch.tensor([-3.0]), torch.tensor([-1.0])
    assert kl_estimate(logp, other, "k1").item() == pytest.approx(-2.0)
    assert kl_estimate(logp, other, "k2").item() == pytest.approx(2.0)
    assert kl_estimate(logp, other, "k3").item() == pytest.approx(math.exp(2) - 3, abs=sum_tolerance(4, math.exp(2)))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_zero_when_equal(kind):
    logp = torch.randn(4, 7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kl_estimate(logp, logp.clone(), kind), torch.zeros(4, 7))


def test_k2_k3_nonnegative_random():
    gen = torch.Generator().manual_seed(1)
    logp = torch.randn(1000, generator=gen) * 3
    other = torch.randn(1000, generator=gen) * 3
    assert (kl_estimate(logp, other, "k2") >= 0).all()
    assert (kl_estimate(logp, other, "k3") >= 0).all()
    # k1 on the same inputs does go negative (it is unbiased but not pointwise positive)
    assert (kl_estimate(logp, other, "k1") < 0).any()


def test_k1_k3_unbiased_by_enumeration():
    # p, q two categoricals over 5 tokens. Tokens a ~ p; the estimators take logp = log p(a), other = log q(a).
    # Exact expectation by enumeration: E_p[k(a)] = Σ_a p(a) k(a).
    #   k1: Σ p (log p - log q) = KL(p||q)
    #   k3: Σ p (q/p - 1 - log(q/p)) = Σ q - Σ p + KL = KL(p||q)
    #   k2: ½ Σ p (log q/p)² -- biased, not equal in general
    p = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.1], dtype=torch.float64)
    kl = (p * (p.log() - q.log())).sum()
    # float64 rounding of both sides: per token a few roundings (logs, exp, -1, -log r, x p) of terms of size
    # p (r + 1 + |log r|), r = q/p or p/q, then 5 of them summed (and the same for the reference KL)
    log_r = (q.log() - p.log()).abs()
    tol = 2 * sum_tolerance(5 + 8, float((p * (log_r.exp() + 1 + log_r) + q * (1 / log_r.exp() + 1 + log_r)).sum()),
                            torch.float64)
    for kind in ("k1", "k3"):
        expectation = (p * kl_estimate(p.log(), q.log(), kind)).sum()
        torch.testing.assert_close(expectation, kl, atol=tol, rtol=0)
    e_k2 = (p * kl_estimate(p.log(), q.log(), "k2")).sum()
    assert abs(e_k2 - kl).item() > tol  # biased: off by more than rounding
    # and KL(q||p) (swapped roles) is a different number, so direction matters
    kl_rev = (q * (q.log() - p.log())).sum()
    assert abs(kl_rev - kl).item() > tol
    torch.testing.assert_close((q * kl_estimate(q.log(), p.log(), "k3")).sum(), kl_rev, atol=tol, rtol=0)


def test_unknown_kind_raises():
    with pytest.raises(ValueError):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")  # type: ignore[arg-type]
