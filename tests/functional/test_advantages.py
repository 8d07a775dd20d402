"""Worked-example tests for ``rl_lightning.functional.advantages`` (RLOO: Ahmadian et al. 2024, arXiv 2402.14740;
PPO's GAE: Schulman et al. 2015, arXiv 1506.02438; GRPO: Shao et al. 2024, arXiv 2402.03300)."""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.functional import (
    batch_centered_advantages,
    gae,
    group_advantages,
    leave_one_out_advantages,
)
from tests.tolerances import gamma, sum_tolerance

# Tolerances: mean/std/divide of a few rewards is a handful of roundings (``gamma(n)`` relative, ``n`` counted at
# each use); sums that cancel (advantages summing to 0, GAE's telescoping) are bounded relative to the magnitude
# of their terms. The float64 loop references round too, by the same count.

# ---------------------------------------------------------------------------------------------------------------
# GRPO: group_advantages
# ---------------------------------------------------------------------------------------------------------------


def test_group_advantages_worked_example():
    # GRPO's notation (Shao et al. 2024): R = [1, 1, 0, 0]
    #   μ_G = (1 + 1 + 0 + 0) / 4 = 0.5
    #   σ_G = sqrt(1/4 * (0.25 + 0.25 + 0.25 + 0.25)) = sqrt(0.25) = 0.5      (population std)
    #   A   = (R - 0.5) / (0.5 + eps) = [+1, +1, -1, -1]  (up to eps)
    # (a Bessel std would give sqrt(1/3) = 0.577 and A = ±0.866, which must NOT be what we get)
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    adv = group_advantages(rewards, group_size=4)
    # off ±1 by eps / (σ + eps) = 2e-6 (the eps), plus the rounding of mean, std (4 terms each) and the division
    torch.testing.assert_close(adv, torch.tensor([1.0, 1.0, -1.0, -1.0]), atol=1e-6 / 0.5 + gamma(12), rtol=0)
    # exact value with eps: 0.5 / (0.5 + 1e-6)
    expected = 0.5 / (0.5 + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([expected, expected, -expected, -expected]))


def test_group_advantages_multiple_groups():
    # Two groups of G=2, contiguous rows:
    #   group 0: [3, 1]  μ=2, σ=sqrt((1+1)/2)=1 → A = [+1, -1]
    #   group 1: [0, 4]  μ=2, σ=2              → A = [-1, +1]
    # If the groups were mixed (e.g. strided), group 0 would be [3, 0] and the answer would differ.
    rewards = torch.tensor([3.0, 1.0, 0.0, 4.0])
    adv = group_advantages(rewards, group_size=2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]))
    # Three groups of G=3:
    #   [1, 2, 3]: μ=2, σ=sqrt(2/3)=0.8165 → A = [-1.2247, 0, 1.2247]
    #   [5, 5, 8]: μ=6, σ=sqrt((1+1+4)/3)=sqrt(2) → A = [-0.7071, -0.7071, 1.4142]
    #   [0, 0, 0]: no spread → 0
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 8.0, 0.0, 0.0, 0.0])
    adv = group_advantages(rewards, group_size=3, eps=1e-12)
    s = math.sqrt(1.5)
    r2 = math.sqrt(2.0)
    expected = torch.tensor([-s, 0.0, s, -1 / r2, -1 / r2, r2, 0.0, 0.0, 0.0])
    # mean (3 terms), centring, std (3 squares, a division, a sqrt), + eps, the division, float32(expected):
    # 12 roundings
    torch.testing.assert_close(adv, expected, atol=0, rtol=gamma(12))


def test_group_advantages_scale_false():
    # scale=False (Dr. GRPO): A = R - μ_G only.
    #   group [1, 1, 0, 0]: μ=0.5 → [0.5, 0.5, -0.5, -0.5]
    #   group [0.2, 0.4, 0.6, 0.8]: μ=0.5 → [-0.3, -0.1, 0.1, 0.3]
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.2, 0.4, 0.6, 0.8])
    adv = group_advantages(rewards, group_size=4, scale=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, 0.5, -0.5, -0.5, -0.3, -0.1, 0.1, 0.3]))


@pytest.mark.parametrize(
    "rewards",
    [[0.5] * 4, [0.0] * 4, [1.0] * 4, [0.0] * 8, [1.0] * 3, [0.25] * 6],
    ids=["half", "zeros", "ones", "zeros8", "ones3", "quarter6"],
)
def test_group_advantages_zero_variance_is_exactly_zero(rewards):
    # σ_G = 0: GRPO's formula is 0/0; we require A = 0 exactly and no NaN.
    r = torch.tensor(rewards)
    adv = group_advantages(r, group_size=len(rewards))
    assert not torch.isnan(adv).any()
    assert torch.equal(adv, torch.zeros_like(r))


@pytest.mark.parametrize(
    "value,group_size",
    [(0.1, 8), (0.9, 3), (0.3, 7), (0.7, 16)],
)
def test_group_advantages_zero_variance_non_dyadic_reward_is_exactly_zero(value, group_size):
    # BUG REPORT TEST (fails against the current implementation, do not skip):
    # A constant group such as [0.9, 0.9, 0.9] has σ_G = 0 exactly, so the docstring/DESIGN promise A = 0 exactly.
    # In float32 the group mean of 0.9 ×3 is not bit-equal to 0.9, so R - μ ≈ 6e-8, σ is ~0, and
    # (R - μ)/(σ + 1e-6) ≈ 0.056 for every row (≈ 5.6 with eps=1e-8): a spurious, same-sign advantage on a
    # group that carries no signal.
    r = torch.full((group_size,), value)
    adv = group_advantages(r, group_size=group_size)
    assert torch.equal(adv, torch.zeros_like(r)), (
        f"constant group {value}×{group_size} must give A == 0 exactly, got {adv.tolist()}"
    )


def test_group_advantages_no_success_group_and_mixed():
    # Group 0 has no success (all 0) → all 0; group 1 has one success out of 4:
    #   [1, 0, 0, 0]: μ = 0.25, σ = sqrt((0.5625 + 3*0.0625)/4) = sqrt(0.1875) = 0.4330
    #   A = [0.75/0.4330, -0.25/0.4330 ×3] = [1.7321, -0.5774 ×3]
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    adv = group_advantages(rewards, group_size=4)
    assert torch.equal(adv[:4], torch.zeros(4))
    torch.testing.assert_close(adv[4:], torch.tensor([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3),
                                                      -1 / math.sqrt(3)]),
                               atol=0, rtol=1e-6 / math.sqrt(0.1875) + gamma(13))  # eps / σ, and rounding
    # advantages sum to 0 per group: 4 terms, each one division off the exact (R - μ = 0.75, -0.25 are exact)
    magnitude = float(adv.view(2, 4).abs().sum(1).max())
    torch.testing.assert_close(adv.view(2, 4).sum(1), torch.zeros(2), atol=sum_tolerance(4 + 1, magnitude), rtol=0)


@pytest.mark.parametrize("group_size", [0, 3, 5, -1])
def test_group_advantages_bad_group_size_raises(group_size):
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(8), group_size=group_size)


def test_group_advantages_rejects_2d():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 4), group_size=4)


def test_group_advantages_matches_loop_reference():
    gen = torch.Generator().manual_seed(0)
    G, B = 5, 7
    rewards = torch.rand(B * G, generator=gen, dtype=torch.float64)
    eps = 1e-6
    expected = []
    for g in range(B):
        grp = rewards[g * G:(g + 1) * G].tolist()
        mu = sum(grp) / G
        sigma = math.sqrt(sum((r - mu) ** 2 for r in grp) / G)
        expected += [(r - mu) / (sigma + eps) for r in grp]
    adv = group_advantages(rewards, G, eps=eps)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))
    adv_ns = group_advantages(rewards, G, scale=False)
    expected_ns = [r - sum(rewards[(i // G) * G:(i // G + 1) * G].tolist()) / G for i, r in enumerate(rewards.tolist())]
    torch.testing.assert_close(adv_ns, torch.tensor(expected_ns, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------------
# RLOO: leave_one_out_advantages
# ---------------------------------------------------------------------------------------------------------------


def test_leave_one_out_worked_example():
    # RLOO (Ahmadian et al. 2024): R = [1.0, 0.8, 0.2, 0.0], G = 4
    #   b_1 = (0.8 + 0.2 + 0.0)/3 = 0.333  → A_1 = 1.0 - 0.333 = 0.667
    #   b_2 = (1.0 + 0.2 + 0.0)/3 = 0.4    → A_2 = 0.8 - 0.4   = 0.4
    #   b_3 = (1.0 + 0.8 + 0.0)/3 = 0.6    → A_3 = 0.2 - 0.6   = -0.4
    #   b_4 = (1.0 + 0.8 + 0.2)/3 = 0.667  → A_4 = 0.0 - 0.667 = -0.667
    rewards = torch.tensor([1.0, 0.8, 0.2, 0.0])
    adv = leave_one_out_advantages(rewards, 4)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, 0.4, -0.4, -2 / 3]))
    # the baselines themselves: b_i = R_i - A_i
    torch.testing.assert_close(rewards - adv, torch.tensor([1 / 3, 0.4, 0.6, 2 / 3]))


def test_leave_one_out_sums_to_zero_and_closed_form():
    gen = torch.Generator().manual_seed(1)
    for G in (2, 3, 4, 8):
        rewards = torch.randn(5 * G, generator=gen, dtype=torch.float64)
        adv = leave_one_out_advantages(rewards, G)
        grouped = rewards.view(-1, G)
        # each A_i = R_i - (Σ R - R_i) / (G - 1): G + 3 roundings of terms of size Σ|R|, then G of them summed
        magnitude = float(grouped.abs().sum(1).max()) * 2
        torch.testing.assert_close(adv.view(-1, G).sum(1), torch.zeros(5, dtype=torch.float64), rtol=0,
                                   atol=sum_tolerance(2 * G + 3, magnitude, torch.float64))
        closed = (G / (G - 1)) * (grouped - grouped.mean(1, keepdim=True))  # A_i = G/(G-1) (R_i - R̄)
        torch.testing.assert_close(adv, closed.reshape(-1))


def test_leave_one_out_g1_raises():
    with pytest.raises(ValueError):
        leave_one_out_advantages(torch.tensor([1.0, 0.0]), 1)
    with pytest.raises(ValueError):
        leave_one_out_advantages(torch.zeros(6), 4)  # 4 does not divide 6


def test_leave_one_out_matches_loop_reference():
    gen = torch.Generator().manual_seed(2)
    G = 4
    rewards = torch.rand(6 * G, generator=gen, dtype=torch.float64)
    r = rewards.tolist()
    expected = []
    for i in range(len(r)):
        g0 = (i // G) * G
        others = [r[j] for j in range(g0, g0 + G) if j != i]
        expected.append(r[i] - sum(others) / (G - 1))
    torch.testing.assert_close(leave_one_out_advantages(rewards, G), torch.tensor(expected, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------------
# FlashREINFORCE: batch_centered_advantages
# ---------------------------------------------------------------------------------------------------------------


def test_batch_centered_hand_example():
    # R = [1, 0, 0.5, 0.5]: mean = 2/4 = 0.5 → A = [0.5, -0.5, 0, 0]
    adv = batch_centered_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]))
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    # R = [3, 1, 2]: mean 2 → [1, -1, 0]
    torch.testing.assert_close(batch_centered_advantages(torch.tensor([3.0, 1.0, 2.0])), torch.tensor([1.0, -1.0, 0.0]))


def test_batch_centered_single_element_is_zero():
    adv = batch_centered_advantages(torch.tensor([0.7]))
    assert torch.equal(adv, torch.zeros(1))


def test_batch_centered_rejects_2d():
    with pytest.raises(ValueError):
        batch_centered_advantages(torch.zeros(2, 2))


# ---------------------------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------------------------


def _ref_gae_row(rewards: list[float], values: list[float], mask: list[int], gamma: float, lam: float):
    """Independent plain-python skip-observation GAE for one row: walk the masked indices backwards."""
    idx = [t for t, m in enumerate(mask) if m]
    adv = [0.0] * len(rewards)
    ret = [0.0] * len(rewards)
    next_v, next_a = 0.0, 0.0
    for t in reversed(idx):
        delta = rewards[t] + gamma * next_v - values[t]
        a = delta + gamma * lam * next_a
        adv[t], ret[t] = a, a + values[t]
        next_v, next_a = values[t], a
    return adv, ret


def _ref_gae(rewards, values, mask, gamma, lams):
    advs, rets = [], []
    for i in range(rewards.shape[0]):
        a, r = _ref_gae_row(rewards[i].tolist(), values[i].tolist(), mask[i].tolist(), gamma, lams[i])
        advs.append(a)
        rets.append(r)
    return torch.tensor(advs, dtype=torch.float64), torch.tensor(rets, dtype=torch.float64)


def test_gae_lambda_gamma_one_terminal_reward():
    # γ = λ = 1 and one terminal reward R on the last generated token:
    #   Â_t = Σ_{k≥t} δ_k = R - V_t (telescoping, V after the end = 0), so Â_t + V_t = R at every masked token.
    R = 0.75
    values = torch.tensor([[0.1, 0.4, -0.3, 0.9, 5.0, 5.0], [0.2, 0.3, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.float64)
    rewards = torch.zeros_like(values)
    rewards[0, 3] = R
    rewards[1, 1] = R
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close((adv + values)[mask.bool()], torch.full((6,), R, dtype=torch.float64))
    torch.testing.assert_close(ret[mask.bool()], torch.full((6,), R, dtype=torch.float64))
    # e.g. row 0, t=0: Â = 0.75 - 0.1 = 0.65
    assert adv[0, 0].item() == pytest.approx(0.65)


def test_gae_lambda_zero_is_td_error():
    # λ = 0: Â_t = δ_t = r_t + γ V_{t+1} - V_t  (V after the last masked token = 0)
    gamma = 0.9
    rewards = torch.tensor([[0.0, 0.5, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.2, 0.4, 0.8]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    adv, _ = gae(rewards, values, mask, gamma=gamma, lam=0.0)
    # δ_0 = 0   + 0.9*0.4 - 0.2 = 0.16
    # δ_1 = 0.5 + 0.9*0.8 - 0.4 = 0.82
    # δ_2 = 1.0 + 0.9*0   - 0.8 = 0.2
    torch.testing.assert_close(adv, torch.tensor([[0.16, 0.82, 0.2]], dtype=torch.float64))


def test_gae_hand_three_tokens():
    # γ = 0.9, λ = 0.8 (γλ = 0.72); rewards [0, 0, 1]; values [0.5, 0.6, 0.7]; a 4th padded position with junk.
    #   t=2: δ_2 = 1 + 0.9*0   - 0.7 = 0.3     Â_2 = 0.3
    #   t=1: δ_1 = 0 + 0.9*0.7 - 0.6 = 0.03    Â_1 = 0.03 + 0.72*0.3   = 0.246
    #   t=0: δ_0 = 0 + 0.9*0.6 - 0.5 = 0.04    Â_0 = 0.04 + 0.72*0.246 = 0.21712
    #   returns = Â + V = [0.71712, 0.846, 1.0]; padding → 0
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0, 0.0]], dtype=torch.float64))


def test_gae_matches_loop_reference_right_padded():
    gen = torch.Generator().manual_seed(3)
    B, T = 6, 9
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64)
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    lengths = [9, 1, 4, 7, 2, 5]
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths], dtype=torch.float64)
    for discount, lam in [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0), (0.5, 0.0)]:
        adv, ret = gae(rewards, values, mask, gamma=discount, lam=lam)
        ref_adv, ref_ret = _ref_gae(rewards, values, mask, discount, [lam] * B)
        torch.testing.assert_close(adv, ref_adv)
        torch.testing.assert_close(ret, ref_ret)


def test_gae_skip_observation_equals_compressed_row():
    # Row with holes (observation tokens at 2, 3 and 6) and right padding at 8, 9:
    #   mask = [1, 1, 0, 0, 1, 1, 0, 1, 0, 0]; model tokens at 0, 1, 4, 5, 7.
    # Skip-observation GAE must equal plain GAE on the row with the unmasked positions removed.
    gen = torch.Generator().manual_seed(4)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 0, 0]], dtype=torch.float64)
    rewards = torch.randn(1, 10, generator=gen, dtype=torch.float64)
    values = torch.randn(1, 10, generator=gen, dtype=torch.float64)
    keep = mask[0].bool()
    gamma, lam = 0.95, 0.9
    adv, ret = gae(rewards, values, mask, gamma, lam)
    c_adv, c_ret = gae(rewards[:, keep], values[:, keep], torch.ones(1, int(keep.sum()), dtype=torch.float64),
                       gamma, lam)
    torch.testing.assert_close(adv[:, keep], c_adv)
    torch.testing.assert_close(ret[:, keep], c_ret)
    assert torch.equal(adv[:, ~keep], torch.zeros(1, 5, dtype=torch.float64))
    # the independent reference agrees too
    ref_adv, _ = _ref_gae(rewards, values, mask, gamma, [lam])
    torch.testing.assert_close(adv, ref_adv)
    # values / rewards at unmasked positions do not change anything
    rewards2, values2 = rewards.clone(), values.clone()
    rewards2[:, ~keep] = 100.0
    values2[:, ~keep] = -50.0
    adv2, ret2 = gae(rewards2, values2, mask, gamma, lam)
    torch.testing.assert_close(adv2, adv)
    torch.testing.assert_close(ret2, ret)


def test_gae_skip_observation_hand_example():
    # mask [1, 0, 1]: the observation token in the middle is skipped, so t+ of position 0 is position 2.
    # γ = 0.5, λ = 1, r = [0, 9(ignored), 1], V = [0.2, 9(ignored), 0.4]
    #   t=2: δ = 1 + 0.5*0 - 0.4 = 0.6               Â_2 = 0.6
    #   t=0: δ = 0 + 0.5*0.4 - 0.2 = 0.0             Â_0 = 0 + 0.5*1*0.6 = 0.3
    adv, ret = gae(torch.tensor([[0.0, 9.0, 1.0]]), torch.tensor([[0.2, 9.0, 0.4]]),
                   torch.tensor([[1.0, 0.0, 1.0]]), gamma=0.5, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.3, 0.0, 0.6]]))
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.0, 1.0]]))


def test_gae_random_holes_match_reference():
    gen = torch.Generator().manual_seed(5)
    B, T = 5, 12
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64)
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=gen) < 0.6).to(torch.float64)
    mask[0] = 0.0  # an entirely empty row → all zeros
    adv, ret = gae(rewards, values, mask, gamma=0.97, lam=0.9)
    ref_adv, ref_ret = _ref_gae(rewards, values, mask, 0.97, [0.9] * B)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    assert torch.equal(adv[0], torch.zeros(T, dtype=torch.float64))


def test_gae_per_row_lambda_tensor():
    gen = torch.Generator().manual_seed(6)
    B, T = 4, 7
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64)
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in (7, 3, 5, 1)], dtype=torch.float64)
    lams = [0.0, 0.5, 0.95, 1.0]
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=torch.tensor(lams, dtype=torch.float64))
    for i, lam in enumerate(lams):
        a_i, r_i = gae(rewards[i:i + 1], values[i:i + 1], mask[i:i + 1], gamma=0.9, lam=lam)
        torch.testing.assert_close(adv[i:i + 1], a_i)
        torch.testing.assert_close(ret[i:i + 1], r_i)
    # and the rows really differ from running everything at one λ
    adv_one, _ = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert not torch.allclose(adv_one[2], adv[2])


def test_gae_zero_outside_mask_and_returns_identity():
    gen = torch.Generator().manual_seed(7)
    B, T = 3, 6
    rewards = torch.randn(B, T, generator=gen)
    values = torch.randn(B, T, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.float32)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    off = ~mask.bool()
    assert torch.equal(adv[off], torch.zeros(int(off.sum())))
    assert torch.equal(ret[off], torch.zeros(int(off.sum())))
    on = mask.bool()
    torch.testing.assert_close(ret[on], (adv + values)[on])
    # values carry no gradient into the advantages
    v = values.clone().requires_grad_(True)
    a, r = gae(rewards, v, mask, gamma=1.0, lam=0.95)
    assert not a.requires_grad and not r.requires_grad


def test_gae_shape_mismatch_raises():
    r = torch.zeros(2, 3)
    with pytest.raises(ValueError):
        gae(r, torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)
    with pytest.raises(ValueError):
        gae(r, torch.zeros(2, 3), torch.ones(3, 3), 1.0, 1.0)
    with pytest.raises(ValueError):
        gae(torch.zeros(3), torch.zeros(3), torch.ones(3), 1.0, 1.0)
