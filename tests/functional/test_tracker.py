"""SPO's tracker math (Xu & Ding 2025, arXiv 2509.13232; the reference code's choices: docs/algorithms.md, SPO)."""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.functional import (
    beta_tracker_update, normalized_advantages, spo_discount, tracker_sampling_weights, tracker_value,
)
from tests.tolerances import gamma


def test_the_update_is_the_moving_average_with_eta_one_over_rho_n_plus_one():
    gen = torch.Generator().manual_seed(0)
    alpha = torch.rand(1000, generator=gen, dtype=torch.float64) * 20 + 0.1
    beta = torch.rand(1000, generator=gen, dtype=torch.float64) * 20 + 0.1
    reward = (torch.rand(1000, generator=gen, dtype=torch.float64) > 0.5).double()
    rho = torch.rand(1000, generator=gen, dtype=torch.float64) * 0.2 + 0.8
    new_alpha, new_beta = beta_tracker_update(alpha, beta, reward, rho)
    v_old = tracker_value(alpha, beta)
    eta = 1.0 / (rho * (alpha + beta) + 1.0)
    # float64: each side is a handful of roundings (products, sums, one division: <= 8) of values in [0, 1]
    # (the value) or of the same sum (α + β), on both sides
    torch.testing.assert_close(tracker_value(new_alpha, new_beta), v_old + eta * (reward - v_old),
                               rtol=0, atol=2 * gamma(8, torch.float64))
    torch.testing.assert_close(new_alpha + new_beta, rho * (alpha + beta) + 1.0, rtol=2 * gamma(4, torch.float64),
                               atol=0)


def test_hand_update():
    alpha, beta = beta_tracker_update(torch.tensor([2.0, 1.0]), torch.tensor([1.0, 3.0]), torch.tensor([1.0, 0.0]), 0.5)
    assert alpha.tolist() == [2.0, 0.5] and beta.tolist() == [0.5, 2.5]  # (0.5*2 + 1, 0.5*1 + 0), (0.5, 1.5 + 1)


@pytest.mark.parametrize("outcomes", [[1, 0, 1, 1, 0, 0, 0, 1, 1], [0] * 7, [1] * 5, [1]])
def test_with_rho_one_from_half_half_the_value_is_the_laplace_like_mean(outcomes):
    alpha, beta = torch.tensor(0.5, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)
    for r in outcomes:
        alpha, beta = beta_tracker_update(alpha, beta, torch.tensor(float(r), dtype=torch.float64), 1.0)
    n, s = len(outcomes), sum(outcomes)
    # α, β: sums of halves and integers, exact; the value α / (α + β): 2 roundings
    assert float(tracker_value(alpha, beta)) == pytest.approx((s + 0.5) / (n + 1), rel=gamma(2, torch.float64))


def test_the_discount_halves_per_half_life_and_is_clamped():
    d = torch.tensor([0.0, 0.06, 0.12, 10.0], dtype=torch.float64)
    torch.testing.assert_close(spo_discount(d, 0.06, 0.1, 1.0),
                               torch.tensor([1.0, 0.5, 0.25, 0.1], dtype=torch.float64))
    rho = spo_discount(d)  # the reference's constants: [0.875, 0.96]
    assert rho[0] == 0.96 and rho[-1] == 0.875  # a first visit (D = 0) gives rho_max
    with pytest.raises(ValueError):
        spo_discount(d, half_life=0.0)
    with pytest.raises(ValueError):
        spo_discount(d, rho_min=0.99, rho_max=0.9)


def test_sampling_weights_favour_uncertain_prompts():
    v = torch.tensor([0.0, 0.02, 0.5, 0.98, 1.0], dtype=torch.float64)
    w = tracker_sampling_weights(v, 0.05)
    torch.testing.assert_close(w, torch.sqrt(v * (1 - v)) + 0.05)
    assert w[2] == pytest.approx(0.55) and w[0] == w[4] == pytest.approx(0.05)
    assert bool((w[2] > w[[0, 1, 3, 4]]).all())


def test_normalized_advantages_use_bessel_std_and_guard_degenerate_batches():
    a = torch.tensor([1.0, 0.0, 0.5, 0.5])
    mean, std = 0.5, math.sqrt(0.5 / 3)  # sum of squares 0.5, n - 1 = 3
    torch.testing.assert_close(normalized_advantages(a), (a - mean) / (std + 1e-8))
    assert normalized_advantages(torch.tensor([0.7])).tolist() == [0.0]  # B = 1: no std, no NaN
    assert normalized_advantages(torch.full((5,), 0.3)).tolist() == [0.0] * 5  # no spread
    # a global mean/std (data parallelism) is used as given
    torch.testing.assert_close(normalized_advantages(a, torch.tensor(0.0), torch.tensor(2.0), eps=0.0), a / 2)
