"""BPCO's bounded value, length-adaptive λ and divergence clipping bounds, EasyPPO's variance weights and SAO's
band mask (BPCO: VAPO, arXiv 2504.05118, and DPPO, arXiv 2602.04879; EasyPPO: arXiv 2609.36802; SAO: Hou et al.
2026, arXiv 2607.07508; docs/algorithms.md).

Tolerances are in units of the unit roundoff of the dtype (2^-24 for float32, 2^-53 for float64), with the count
of roundings each formula takes stated where it is used.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.functional.critics import (
    band_mask_weights,
    bounded_value,
    divergence_clip_bounds,
    length_adaptive_lambda,
    variance_weights,
)

U32, U64 = 2.0**-24, 2.0**-53
UNIT = {torch.float32: U32, torch.float64: U64}


# ---------------------------------------------------------------------------------------------------------------
# length_adaptive_lambda
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("alpha", "lengths"), [
    (0.05, [20, 21, 40, 100, 1000, 4096]),
    (0.5, [2, 3, 7, 10, 512]),
    (1.5, [1, 2, 5, 33, 8192]),   # SAO's actor λ; 1/α = 2/3 < 1, so every L >= 1 qualifies
    (2.0, [1, 2, 9, 100]),
])
def test_effective_horizon_is_alpha_times_length(alpha, lengths, dtype):
    # Σ_t λ^t = 1/(1 - λ) = α L for L >= 1/α. Rounding: α L and the reciprocal take up to 3 relative roundings,
    # 1 - u one absolute rounding of at most u/2 (λ < 1), which 1/(1 - λ) magnifies by α L: relative error
    # <= (3 + α L/2) u; the bound below is (4 + α L) u.
    lam = length_adaptive_lambda(torch.tensor(lengths, dtype=dtype), alpha)
    assert lam.dtype == dtype and lam.shape == (len(lengths),)
    u = UNIT[dtype]
    for length, value in zip(lengths, lam.tolist()):
        horizon = alpha * length
        assert 1.0 / (1.0 - value) == pytest.approx(horizon, rel=(4 + horizon) * u, abs=0)


def test_hand_values_of_the_docstring():
    lam = length_adaptive_lambda(torch.tensor([0, 1, 2, 4, 10]), alpha=0.5)
    assert lam.dtype == torch.float32  # integer lengths compute in float32
    # 1 - 1/(0.5 L): L=0 -> 0 (guarded), -1 -> 0, 0, 0.5, 0.8
    assert lam.tolist()[:4] == [0.0, 0.0, 0.0, 0.5]
    assert lam[4].item() == pytest.approx(0.8, rel=4 * U32)


@pytest.mark.parametrize("alpha", [0.05, 0.5, 1.5])
def test_clamped_to_zero_below_one_over_alpha_and_at_zero_length(alpha):
    short = [L for L in range(0, 40) if L < 1 / alpha]
    lam = length_adaptive_lambda(torch.tensor(short), alpha)
    assert torch.equal(lam, torch.zeros(len(short)))  # the unclamped 1 - 1/(αL) is < 0 (or -inf at L = 0) there


def test_in_unit_interval_and_finite():
    lengths = torch.arange(0, 20000)
    for alpha in (1e-3, 0.05, 0.5, 1.5, 100.0):
        lam = length_adaptive_lambda(lengths, alpha)
        assert torch.isfinite(lam).all() and (lam >= 0).all() and (lam <= 1).all()
        assert (lam[1:] >= lam[:-1]).all()  # non-decreasing in L: longer responses decay slower


# ---------------------------------------------------------------------------------------------------------------
# divergence_clip_bounds
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("eps", [0.1, 0.02, 0.3])
def test_ratio_at_the_bounds_moves_the_probability_by_eps(eps, dtype):
    probs = [0.99, 0.9, 0.5, 0.2, 0.05, 0.01]
    logp = torch.tensor([math.log(p) for p in probs], dtype=dtype)
    low, high = divergence_clip_bounds(logp, eps)
    assert low.shape == high.shape == logp.shape and low.dtype == high.dtype == dtype
    # p is the probability the (rounded) log-prob stands for; π = ρ p. ε/p = ε exp(-log p) carries about 3
    # relative roundings (exp, product, exp of the reference), 1 ± ε/p one absolute rounding of u (1 + ε/p), so
    # |π - p| is ε within ε·3u + p(1 + ε/p)u = (p + 4ε)u; the bound below is 4(p + ε)u.
    u = UNIT[dtype]
    for lp, lo, hi in zip(logp.tolist(), low.tolist(), high.tolist()):
        p = math.exp(lp)
        for rho in (lo, hi):
            assert abs(rho * p - p) == pytest.approx(eps, abs=4 * (p + eps) * u, rel=0)
        assert hi * p - p > 0 > lo * p - p


def test_bounds_of_the_docstring_and_inactive_lower_bound():
    low, high = divergence_clip_bounds(torch.log(torch.tensor([0.5, 0.05])), eps=0.1)
    assert low.tolist() == pytest.approx([0.8, -1.0], rel=8 * U32)
    assert high.tolist() == pytest.approx([1.2, 3.0], rel=8 * U32)
    assert low[1] < 0  # p < ε: the lower bound 1 - ε/p is negative, so inactive


def test_inside_iff_the_absolute_probability_change_is_at_most_eps():
    gen = torch.Generator().manual_seed(0)
    eps = 0.1
    p = torch.rand(64, 1, generator=gen, dtype=torch.float64) * 0.98 + 0.01
    rho = torch.rand(64, 200, generator=gen, dtype=torch.float64) * 4.0
    low, high = divergence_clip_bounds(p.log().expand(-1, 200), eps)
    inside = (rho >= low) & (rho <= high)
    change = (rho * p - p).abs()
    # leave out draws within rounding of the boundary: change = |ρp - p| takes 2 roundings of size ρp + p, the
    # bounds 1 ± ε/p (p = exp(log p)) 3 of size 1 + ε/p, which comparing ρ to them multiplies by p
    clear = (change - eps).abs() > 8 * U64 * (rho * p + p + eps)
    assert clear.float().mean() > 0.99
    assert torch.equal(inside[clear], (change <= eps)[clear])
    assert inside.any() and (~inside).any()
    assert (change[inside & clear] < eps).all() and (change[~inside & clear] > eps).all()


def test_bounds_carry_no_gradient():
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    low, high = divergence_clip_bounds(logp, 0.1)
    assert not low.requires_grad and not high.requires_grad


# ---------------------------------------------------------------------------------------------------------------
# variance_weights
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_easyppo_reference_case(dtype):
    # EasyPPO's own test: Var_pop([0, 1]) = 0.25 -> 1/0.25 = 4; Var_pop([0.5, 0.5]) = 0 -> floored at 0.01 -> 100;
    # mean over the rows (4 + 4 + 100 + 100)/4 = 52. Rounding: 0.01 in the dtype (1/2 u), the power (~2 u), the
    # mean and the division (1 u): the bound is 8 u relative.
    w = variance_weights(torch.tensor([0.0, 1.0, 0.5, 0.5], dtype=dtype), group_size=2, w_min=0.01, beta=1.0)
    assert w.dtype == dtype and w.shape == (4,)
    expected = [4 / 52, 4 / 52, 100 / 52, 100 / 52]
    assert w.tolist() == pytest.approx(expected, rel=8 * UNIT[dtype], abs=0)
    assert w[0] == w[1] and w[2] == w[3]  # every row carries its prompt's weight


def test_floor_is_on_var_to_the_beta_at_reference_beta():
    # The reference's form 1 / max(Var^β, w_min), β = 0.5, w_min = 0.25 (its shipped setting; docs/algorithms.md).
    # Groups of 4:
    #   [0, 1, 0, 1]      Var = 0.25  σ = 0.5     -> 1/0.5 = 2
    #   [1, 1, 1, 1]      Var = 0     σ = 0       -> floored at 0.25 -> 4 (the largest weight)
    #   [0, 0, 0, 1]      Var = 3/16  σ = 0.4330  -> 2.3094
    #   [0.4, 0.6, ...]   Var = 0.01  σ = 0.1     -> floored at 0.25 -> 4 (a floor on Var itself, the other
    #                                                 reading, would give max(0.01, 0.25)^-0.5 = 2)
    rewards = torch.tensor([0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 0.4, 0.6, 0.4, 0.6], dtype=torch.float64)
    w = variance_weights(rewards, group_size=4, w_min=0.25, beta=0.5)
    raw = [2.0, 4.0, (3 / 16) ** -0.5, 4.0]
    mean = sum(raw) / 4
    expected = [r / mean for r in raw for _ in range(4)]
    # a handful of correctly rounded operations per weight (var, pow, max, reciprocal, mean, division): 16 u
    assert w.tolist() == pytest.approx(expected, rel=16 * U64, abs=0)
    # the reference's shipped setting equals a variance floor of w_min^(1/β) = 0.0625 in the other form
    var = rewards.view(4, 4).var(dim=1, unbiased=False)
    other = var.clamp_min(0.25 ** 2).pow(-0.5)
    assert w.tolist() == pytest.approx((other / other.mean()).repeat_interleave(4).tolist(), rel=16 * U64, abs=0)


def test_equal_variance_gives_ones_and_the_weighted_value_loss_is_plain_mse():
    # every prompt's variance is exactly 0.25 (the rewards are exact binary fractions)
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.5, 1.5, 2.0, 3.0])
    w = variance_weights(rewards, group_size=2, w_min=0.25, beta=0.5)
    assert torch.equal(w, torch.ones(8))
    gen = torch.Generator().manual_seed(1)
    values = torch.rand(8, 5, generator=gen).requires_grad_()
    mask = (torch.rand(8, 5, generator=gen) < 0.7).float()
    mask[:, 0] = 1.0
    squared = (values - rewards[:, None]) ** 2

    def token_mean(x):
        return (x * mask).sum() / mask.sum()

    weighted, plain = token_mean(w[:, None] * squared), token_mean(squared)
    assert torch.equal(weighted, plain)
    (grad_weighted,) = torch.autograd.grad(weighted, values, retain_graph=True)
    (grad_plain,) = torch.autograd.grad(plain, values)
    assert torch.equal(grad_weighted, grad_plain)


def test_mean_is_one_and_noisier_prompts_weigh_less():
    gen = torch.Generator().manual_seed(2)
    rewards = (torch.rand(32, generator=gen) < 0.5).float()  # binary rewards, G = 4: Var in {0, 3/16, 1/4}
    for dtype, u in ((torch.float32, U32), (torch.float64, U64)):
        w = variance_weights(rewards.to(dtype), group_size=4, w_min=0.25, beta=0.5)
        # summing 32 terms: at most 32 roundings of u relative to the (positive) sum, plus the division
        assert abs(w.mean().item() - 1.0) <= 33 * u
        assert (w > 0).all()
        sd = rewards.view(8, 4).var(dim=1, unbiased=False).to(dtype).sqrt().repeat_interleave(4)
        for i in range(32):
            for j in range(32):
                if max(sd[i], 0.25) > max(sd[j], 0.25):
                    assert w[i] < w[j]


def test_beta_zero_and_group_size_one_give_ones():
    gen = torch.Generator().manual_seed(3)
    rewards = torch.rand(12, generator=gen)
    assert torch.equal(variance_weights(rewards, group_size=4, w_min=0.25, beta=0.0), torch.ones(12))
    # one response per prompt: every variance is 0 (Var^β floored to w_min), so every weight is the same
    assert torch.equal(variance_weights(rewards, group_size=1, w_min=0.25), torch.ones(12))


def test_weights_are_constants():
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0], requires_grad=True)
    w = variance_weights(rewards, group_size=2, w_min=0.01)
    assert not w.requires_grad and torch.isfinite(w).all()


# ---------------------------------------------------------------------------------------------------------------
# band_mask_weights
# ---------------------------------------------------------------------------------------------------------------

EPS_LOW, EPS_HIGH = 0.3, 5.0  # SAO's math band (0.7, 6.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inside_the_band_the_weight_is_the_ratio_and_keeps_its_gradient(dtype):
    ratio = torch.tensor([1.3, 0.71, 5.9, 1.0, 0.75], dtype=dtype, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5, 3.0], dtype=dtype)
    w = band_mask_weights(ratio, EPS_LOW, EPS_HIGH)
    assert w.dtype == dtype and torch.equal(w, ratio.detach())
    (w * adv).sum().backward()
    assert torch.equal(ratio.grad, adv)

    # through the log-probs the ratio is built from: ∂(ρ A)/∂log π = ρ A
    logq = torch.log(torch.tensor([0.2, 0.5, 0.1, 0.9, 0.4], dtype=dtype))
    logp = (logq + torch.tensor([1.3, 0.71, 5.9, 1.0, 0.75], dtype=dtype).log()).requires_grad_()
    rho = torch.exp(logp - logq)
    (band_mask_weights(rho, EPS_LOW, EPS_HIGH) * adv).sum().backward()
    assert torch.equal(logp.grad, adv * rho.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_bounds_are_strict_and_give_exactly_zero_gradient(dtype, sign):
    low = torch.tensor(1 - EPS_LOW, dtype=dtype)
    high = torch.tensor(1 + EPS_HIGH, dtype=dtype)
    assert high.item() == 6.0
    on = torch.stack([low, high]).requires_grad_()
    w = band_mask_weights(on, EPS_LOW, EPS_HIGH)
    assert torch.equal(w, torch.zeros(2, dtype=dtype))
    (w * sign).sum().backward()
    assert torch.equal(on.grad, torch.zeros(2, dtype=dtype))
    # one representable step inside each bound is kept, one step outside is not
    one = torch.tensor(1.0, dtype=dtype)
    inner = torch.stack([torch.nextafter(low, one), torch.nextafter(high, one)])
    outer = torch.stack([torch.nextafter(low, -one), torch.nextafter(high, 2 * high)])
    assert torch.equal(band_mask_weights(inner, EPS_LOW, EPS_HIGH), inner)
    assert torch.equal(band_mask_weights(outer, EPS_LOW, EPS_HIGH), torch.zeros(2, dtype=dtype))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_outside_the_band_zero_gradient_for_either_sign_of_the_advantage(sign):
    outside = [0.5, 0.1, 1e-6, 7.0, 100.0]
    adv = sign * torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0])
    ratio = torch.tensor(outside, requires_grad=True)
    w = band_mask_weights(ratio, EPS_LOW, EPS_HIGH)
    assert torch.equal(w, torch.zeros(5))
    (w * adv).sum().backward()
    assert torch.equal(ratio.grad, torch.zeros(5))

    logq = torch.full((5,), math.log(0.1))
    logp = (logq + torch.tensor(outside).log()).requires_grad_()
    loss = -(band_mask_weights(torch.exp(logp - logq), EPS_LOW, EPS_HIGH) * adv).sum()
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(5))


def test_mixed_batch_and_non_finite_ratio_outside():
    ratio = torch.tensor([[0.69, 0.8, 5.9, 6.1], [float("inf"), 1.0, 0.0, 3.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 2.0, -1.0, 1.0], [1.0, -1.0, 1.0, 1.0]])
    w = band_mask_weights(ratio, EPS_LOW, EPS_HIGH)
    keep = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0]])
    assert w.shape == (2, 4) and torch.isfinite(w).all()
    assert torch.equal(w, torch.where(keep.bool(), ratio.detach(), 0.0))
    (w * adv).sum().backward()
    assert torch.equal(ratio.grad, adv * keep)


# ---------------------------------------------------------------------------------------------------------------
# bounded_value
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("r_min", "r_max"), [(0.0, 1.0), (-1.0, 2.0), (0.1, 0.7), (-0.3, 0.1), (-5.0, -3.0)])
def test_bounded_value_stays_in_range_with_finite_gradient(r_min, r_max, dtype):
    h = torch.tensor([-1e4, -100.0, -20.0, -1.0, 0.0, 1.0, 20.0, 100.0, 1e4], dtype=dtype, requires_grad=True)
    v = bounded_value(h, r_min, r_max)
    assert v.dtype == dtype and v.shape == h.shape and torch.isfinite(v).all()
    lo, hi = torch.tensor(r_min, dtype=dtype), torch.tensor(r_max, dtype=dtype)
    assert (v >= lo).all() and (v <= hi).all()
    assert v[0] == lo and v[-1] == hi  # saturated
    # mid-point: r_min + (r_max - r_min)/2, 2 roundings
    assert v[4].item() == pytest.approx((r_min + r_max) / 2, abs=2 * UNIT[dtype] * max(abs(r_min), abs(r_max)))
    v.sum().backward()
    assert torch.isfinite(h.grad).all() and (h.grad >= 0).all()
    assert h.grad[0] == 0 and h.grad[-1] == 0
    # sigmoid'(0) = 1/4
    assert h.grad[4].item() == pytest.approx((r_max - r_min) / 4, rel=2 * UNIT[dtype])


# ---------------------------------------------------------------------------------------------------------------
# input validation
# ---------------------------------------------------------------------------------------------------------------

R4 = torch.tensor([0.0, 1.0, 0.5, 0.5])
LOGP = torch.log(torch.tensor([0.5, 0.25]))
RATIO = torch.tensor([1.0, 2.0])


@pytest.mark.parametrize(("fn", "args"), [
    (length_adaptive_lambda, (torch.tensor([1, 2]), 0.0)),
    (length_adaptive_lambda, (torch.tensor([1, 2]), -0.5)),
    (length_adaptive_lambda, (torch.tensor([1, 2]), float("nan"))),
    (length_adaptive_lambda, (torch.tensor([[1, 2]]), 0.5)),
    (divergence_clip_bounds, (LOGP, 0.0)),
    (divergence_clip_bounds, (LOGP, -0.1)),
    (divergence_clip_bounds, (torch.tensor([0, 1]), 0.1)),
    (variance_weights, (R4, 3, 0.01)),
    (variance_weights, (R4, 0, 0.01)),
    (variance_weights, (R4, 2, 0.0)),
    (variance_weights, (R4, 2, 0.01, -0.5)),
    (variance_weights, (R4.view(2, 2), 2, 0.01)),
    (band_mask_weights, (RATIO, -0.1, 5.0)),
    (band_mask_weights, (RATIO, 1.1, 5.0)),
    (band_mask_weights, (RATIO, 0.3, -1.0)),
    (band_mask_weights, (torch.tensor([1, 2]), 0.3, 5.0)),
    (bounded_value, (RATIO, 1.0, 1.0)),
    (bounded_value, (RATIO, 1.0, 0.0)),
    (bounded_value, (RATIO, 0.0, float("inf"))),
    (bounded_value, (torch.tensor([1, 2]), 0.0, 1.0)),
])
def test_invalid_inputs_raise_naming_the_function(fn, args):
    with pytest.raises(ValueError, match=fn.__name__):
        fn(*args)


def test_valid_edge_parameters_are_accepted():
    assert torch.equal(band_mask_weights(torch.tensor([1e-6, 1.0]), 1.0, 0.0), torch.tensor([1e-6, 0.0]))
    assert torch.equal(band_mask_weights(torch.tensor([1.0, 0.5]), 0.0, 1.0), torch.zeros(2))
