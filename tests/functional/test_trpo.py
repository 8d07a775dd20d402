"""TRPO's pure pieces as worked examples: CG solves SPD systems, the trust-region scale, the full-vocab KL, the
Fisher-vector product of a single categorical, and the importance-weighted surrogate (spec 003, §4 TRPO)."""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.functional.trpo import (
    categorical_kl,
    conjugate_gradient,
    fisher_vector_product,
    importance_surrogate,
    trust_region_scale,
)


# ------------------------------------------------------------------ conjugate_gradient
def test_cg_solves_a_3x3_spd_system_in_3_iterations():
    F = torch.tensor([[4.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 2.0]], dtype=torch.float64)  # SPD
    b = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    x = conjugate_gradient(lambda v: F @ v, b, iters=3)  # n iterations solve an n x n system
    torch.testing.assert_close(x, torch.linalg.solve(F, b), atol=1e-6, rtol=0)


def test_cg_hand_2x2_example():
    # [[4, 1], [1, 3]] x = [1, 2]: det = 11, inverse = [[3, -1], [-1, 4]] / 11 -> x = [1/11, 7/11]
    F = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    x = conjugate_gradient(lambda v: F @ v, torch.tensor([1.0, 2.0], dtype=torch.float64), iters=2)
    torch.testing.assert_close(x, torch.tensor([1 / 11, 7 / 11], dtype=torch.float64), atol=1e-12, rtol=0)


def test_cg_solves_a_random_20x20_spd_system():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(20, 20, generator=gen, dtype=torch.float64)
    F = q @ q.T + 20 * torch.eye(20, dtype=torch.float64)  # SPD, condition number ~ 4
    b = torch.randn(20, generator=gen, dtype=torch.float64)
    x = conjugate_gradient(lambda v: F @ v, b, iters=20)
    torch.testing.assert_close(x, torch.linalg.solve(F, b), atol=1e-6, rtol=0)
    # one iteration is only the steepest-descent point, far from the solution: the test can tell them apart
    one = conjugate_gradient(lambda v: F @ v, b, iters=1)
    assert (one - torch.linalg.solve(F, b)).abs().max() > 1e-3


def test_cg_of_a_zero_right_hand_side_is_zero_and_iters_is_validated():
    F = torch.eye(3, dtype=torch.float64)
    assert torch.equal(conjugate_gradient(lambda v: F @ v, torch.zeros(3, dtype=torch.float64), iters=5),
                       torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="iters"):
        conjugate_gradient(lambda v: F @ v, torch.ones(3), iters=0)


# ------------------------------------------------------------------ trust_region_scale
def test_trust_region_scale_hand_case():
    # x = [1, 0], F = 2 I: xᵀFx = 2 -> β = sqrt(2 * 0.01 / 2) = sqrt(0.01) = 0.1
    x = torch.tensor([1.0, 0.0])
    F = 2 * torch.eye(2)
    beta = trust_region_scale(x, F @ x, delta=0.01)
    torch.testing.assert_close(beta, torch.tensor(0.1))
    # and the scaled step sits on the edge of the quadratic trust region: ½ (βx)ᵀF(βx) = ½ * 0.01 * 2 = δ
    step = beta * x
    torch.testing.assert_close(0.5 * step @ (F @ step), torch.tensor(0.01))


def test_trust_region_scale_guards_non_positive_curvature_and_delta():
    x = torch.tensor([1.0, 0.0])
    assert trust_region_scale(x, torch.zeros(2), delta=0.01) == 0  # xᵀFx = 0: no step
    assert trust_region_scale(x, torch.tensor([-1.0, 0.0]), delta=0.01) == 0  # xᵀFx < 0: no step
    with pytest.raises(ValueError, match="delta"):
        trust_region_scale(x, 2 * x, delta=0.0)


# ------------------------------------------------------------------ categorical_kl
def test_categorical_kl_is_zero_for_identical_distributions():
    logp = torch.log_softmax(torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)), dim=-1)
    assert categorical_kl(logp, logp.clone(), torch.ones(2, 3)).abs() < 1e-7


def test_categorical_kl_two_token_hand_case_and_mask():
    # p_old = [0.5, 0.5], p_new = [0.25, 0.75]:
    # KL = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln 2 + 0.5 ln(2/3) = 0.5 (0.693147 - 0.405465) = 0.143841
    expected = 0.5 * math.log(2.0) + 0.5 * math.log(2.0 / 3.0)
    old = torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.5, 0.5]]]).log()  # [1, 3, 2]
    new = torch.tensor([[[0.25, 0.75], [0.1, 0.9], [0.5, 0.5]]]).log()
    mask = torch.tensor([[1.0, 0.0, 1.0]])  # position 1 (a very different pair) does not count
    # token mean over the 2 masked positions: (0.143841 + 0) / 2
    torch.testing.assert_close(categorical_kl(old, new, mask), torch.tensor(expected / 2))
    torch.testing.assert_close(categorical_kl(old[:, :1], new[:, :1], mask[:, :1]), torch.tensor(expected))


def test_categorical_kl_outside_the_old_support_counts_zero():
    # p_old = [1, 0] (token 1 cut by top-p, log-prob -inf), p_new = [0.5, 0.5]: KL = 1 * ln(1 / 0.5) = ln 2
    old = torch.tensor([[[0.0, float("-inf")]]])
    new = torch.tensor([[[0.5, 0.5]]]).log()
    torch.testing.assert_close(categorical_kl(old, new, torch.ones(1, 1)), torch.tensor(math.log(2.0)))


# ------------------------------------------------------------------ fisher_vector_product
def test_fisher_vector_product_of_one_categorical_is_diag_p_minus_ppT():
    # logits θ = log p with p = [0.5, 0.25, 0.25]: the Hessian of KL(p ‖ softmax(θ)) is F = diag(p) - p pᵀ.
    # F e_0 = [0.5 - 0.5*0.5, -0.25*0.5, -0.25*0.5] = [0.25, -0.125, -0.125]; damping 0.1 adds [0.1, 0, 0].
    p = torch.tensor([0.5, 0.25, 0.25])
    theta = p.log().clone().requires_grad_(True)
    new = torch.log_softmax(theta, -1).view(1, 1, 3)
    kl = categorical_kl(new.detach(), new, torch.ones(1, 1))
    fvp = fisher_vector_product(kl, [theta], damping=0.1)
    torch.testing.assert_close(fvp(torch.tensor([1.0, 0.0, 0.0])), torch.tensor([0.35, -0.125, -0.125]))
    # reusable (the graph is kept) and exact on every vector: F v = (diag(p) - p pᵀ) v + 0.1 v
    v = torch.tensor([0.3, -1.0, 2.0])
    torch.testing.assert_close(fvp(v), (torch.diag(p) - torch.outer(p, p)) @ v + 0.1 * v)
    # float64 vectors come back float64 (CG runs in float64)
    assert fvp(v.double()).dtype == torch.float64


def test_cg_on_fisher_products_recovers_the_natural_gradient():
    # F = diag(p) - p pᵀ + 0.1 I with p = [0.5, 0.25, 0.25]; 3 CG iterations solve the 3 x 3 system
    p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    theta = p.log().clone().requires_grad_(True)
    new = torch.log_softmax(theta, -1).view(1, 1, 3)
    fvp = fisher_vector_product(categorical_kl(new.detach(), new, torch.ones(1, 1)), [theta], damping=0.1)
    g = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    dense = torch.diag(p) - torch.outer(p, p) + 0.1 * torch.eye(3, dtype=torch.float64)
    torch.testing.assert_close(conjugate_gradient(fvp, g, iters=3), torch.linalg.solve(dense, g), atol=1e-6, rtol=0)


# ------------------------------------------------------------------ importance_surrogate
def test_importance_surrogate_hand_case_and_its_gradient_is_the_policy_gradient():
    # ρ = [0.5/0.25, 0.2/0.2] = [2, 1], A = 1, w = 0.5 each: S = 0.5*2*1 + 0.5*1*1 = 1.5
    lp = torch.log(torch.tensor([[0.5, 0.2]]))
    old = torch.log(torch.tensor([[0.25, 0.2]]))
    s = importance_surrogate(lp, old, torch.tensor([1.0]), torch.ones(1, 2), torch.full((1, 2), 0.5))
    torch.testing.assert_close(s, torch.tensor(1.5))
    # at ρ = 1, dS/dlogπ_t = w_t A_t: [0.5*2, 0.5*(-1)] for A = [2, -1] per token; padding (mask 0) gets 0
    lp = old.clone().requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0]])
    importance_surrogate(lp, old, torch.tensor([[2.0, -1.0]]), mask, 0.5 * mask).backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[1.0, -0.5]]))
