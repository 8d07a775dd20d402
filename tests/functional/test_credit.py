"""LVRL's anchored credit (no public paper: docs/algorithms.md, LVRL) on numbers: hand cases, the
telescoping sum for any critic output, equal steps for a linear critic, the group-wide step std, the broadcast to
each action's tokens, and the edge rows (no action, one action, zero-variance groups)."""

from __future__ import annotations

import pytest
import torch

from rl_lightning.functional import (
    anchored_credit, group_advantages, group_step_normalized, group_step_std, interpolated_values,
    turn_mask_from_index, turn_token_advantages,
)

NAN = float("nan")


def mask(*lengths: int, width: int) -> torch.Tensor:
    return (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long()


def loop_credit(values: list[list[float]], rewards: list[float], group_size: int,
                lengths: list[int]) -> list[list[float]]:
    """LVRL's recursion by a plain loop: Ṽ_0 = R̄_G, Ṽ_T = R, Ā_t = Ṽ_{t+1} - Ṽ_t."""
    out = []
    for b, (row, reward, length) in enumerate(zip(values, rewards, lengths)):
        group = rewards[b // group_size * group_size:(b // group_size + 1) * group_size]
        anchored = [sum(group) / group_size] + row[1:length] + [reward]
        steps = [anchored[t + 1] - anchored[t] for t in range(length)] if length else []
        out.append(steps + [0.0] * (len(row) - len(steps)))
    return out


def test_hand_computed_credit():
    # group 0: R = [1, 0] -> R̄ = 0.5. Row 0, T = 3: Ṽ = 0.5, 0.8, 0.9, 1 -> Ā = 0.3, 0.1, 0.1.
    # Row 1, T = 2: Ṽ = 0.5, 0.1, 0 -> Ā = -0.4, -0.1.
    # group 1: R = [1, 1] -> R̄ = 1. Row 2, T = 2, a critic that dips: Ṽ = 1, 0.4, 1 -> Ā = -0.6, +0.6 (sum 0).
    # Row 3, T = 1: Ā_0 = R - R̄ = 0, the critic's entry ignored.
    values = torch.tensor([[9.0, 0.8, 0.9], [9.0, 0.1, 9.0], [9.0, 0.4, 9.0], [9.0, 9.0, 9.0]])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    credit = anchored_credit(values, rewards, 2, mask(3, 2, 2, 1, width=3))
    expected = torch.tensor([[0.3, 0.1, 0.1], [-0.4, -0.1, 0.0], [-0.6, 0.6, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(credit, expected)


def test_ignored_entries_may_hold_anything():
    values = torch.tensor([[NAN, 0.25, NAN], [NAN, NAN, NAN]])  # entry 0 and entries from T_b on are ignored
    credit = anchored_credit(values, torch.tensor([1.0, 0.0]), 2, mask(2, 1, width=3))
    torch.testing.assert_close(credit, torch.tensor([[-0.25, 0.75, 0.0], [-0.5, 0.0, 0.0]]))
    assert torch.isfinite(credit).all()


@pytest.mark.parametrize("seed", range(5))
def test_credit_sums_to_reward_minus_group_mean_for_any_critic_output(seed):
    gen = torch.Generator().manual_seed(seed)
    n, g, k = 12, 4, 6
    values = torch.randn(n, k, generator=gen, dtype=torch.float64) * 10  # any output, far outside [0, 1]
    rewards = torch.rand(n, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, k + 1, (n,), generator=gen)
    credit = anchored_credit(values, rewards, g, mask(*lengths.tolist(), width=k))
    mean = rewards.view(-1, g).mean(dim=1).repeat_interleave(g)
    torch.testing.assert_close(credit.sum(dim=1), rewards - mean, rtol=0, atol=1e-12)
    reference = loop_credit(values.tolist(), rewards.tolist(), g, lengths.tolist())
    torch.testing.assert_close(credit, torch.tensor(reference, dtype=torch.float64), rtol=0, atol=1e-12)


def test_a_linear_interpolation_critic_gives_equal_steps():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.25])  # G = 3: R̄ = 1/3, 7/12
    lengths = [4, 2, 5, 3, 1, 5]
    steps = mask(*lengths, width=5)
    credit = anchored_credit(interpolated_values(rewards, 3, steps), rewards, 3, steps)
    mean = rewards.view(-1, 3).mean(dim=1).repeat_interleave(3)
    for b, length in enumerate(lengths):
        equal = (rewards[b] - mean[b]) / length  # (R - R̄_G) / T on each of the T actions
        torch.testing.assert_close(credit[b, :length], equal.repeat(length))
        assert (credit[b, length:] == 0).all()
    torch.testing.assert_close(interpolated_values(rewards[:3], 3, steps[:3])[0],  # Ṽ_t = R̄ + (R - R̄) t/T
                               torch.tensor([1 / 3, 1 / 3 + 1 / 6, 2 / 3, 1 / 3 + 1 / 2, 0.0]))


def test_single_turn_rows_get_reward_minus_group_mean_and_normalise_to_grpo():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.2, 0.7])
    steps = torch.ones(8, 1, dtype=torch.long)  # one action per row: no critic value is read
    credit = anchored_credit(torch.full((8, 1), NAN), rewards, 4, steps)
    mean = rewards.view(-1, 4).mean(dim=1).repeat_interleave(4)
    torch.testing.assert_close(credit[:, 0], rewards - mean)
    torch.testing.assert_close(group_step_normalized(credit, 4, steps)[:, 0], group_advantages(rewards, 4))


def test_a_row_with_no_action_gets_nothing_and_still_counts_in_the_group_mean():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])  # R̄ = 0.25 over all four rows
    steps = mask(2, 1, 0, 1, width=2)
    credit = anchored_credit(torch.tensor([[0.0, 0.5], [0.0, 0.0], [7.0, 7.0], [0.0, 0.0]]), rewards, 4, steps)
    torch.testing.assert_close(credit, torch.tensor([[0.25, 0.5], [-0.25, 0.0], [0.0, 0.0], [-0.25, 0.0]]))
    normalised = group_step_normalized(credit, 4, steps)
    assert (normalised[2] == 0).all()
    torch.testing.assert_close(turn_token_advantages(normalised, torch.full((4, 3), -1)), torch.zeros(4, 3))


def test_normalised_by_the_group_wide_step_std():
    # group 0 steps: 0.3, 0.1, 0.1 | -0.4, -0.1 -> mean 0, σ² = (0.09 + 0.01 + 0.01 + 0.16 + 0.01) / 5 = 0.056.
    # group 1: every step equal (all 0): exactly 0, not 0 / eps.
    credit = torch.tensor([[0.3, 0.1, 0.1], [-0.4, -0.1, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    steps = mask(3, 2, 2, 1, width=3)
    out = group_step_normalized(credit, 2, steps, eps=0.0)
    sigma = 0.056 ** 0.5
    torch.testing.assert_close(out[:2], credit[:2] / sigma)
    torch.testing.assert_close(group_step_std(credit, 2, steps), torch.tensor([sigma, sigma, 0.0, 0.0]))
    assert (out[2:] == 0).all()
    # σ is over the steps only (not the padded entries) and the credit is divided, not re-centred
    shifted = torch.tensor([[1.0, 1.0, 0.0], [-2.0, 0.0, 0.0]])  # steps 1, 1, -2: σ = sqrt(2)
    torch.testing.assert_close(group_step_normalized(shifted, 2, mask(2, 1, width=3), eps=0.0),
                               shifted / 2 ** 0.5)


def test_zero_variance_groups_get_exactly_zero():
    rewards = torch.tensor([0.9, 0.9, 0.9, 0.0, 0.0, 0.0])  # 0.9 x 3 has a float mean != 0.9
    steps = mask(3, 2, 1, 2, 2, 2, width=3)
    credit = anchored_credit(interpolated_values(rewards, 3, steps), rewards, 3, steps)
    out = group_step_normalized(credit, 3, steps)
    assert (out == 0).all()
    # a critic that moves credit inside a no-spread group still gives a learning signal, sum 0 per row
    values = torch.tensor([[0, 1.0, 0.2], [0, 0.0, 0], [0, 0, 0], [0, 0.5, 0], [0, 0.5, 0], [0, 0.5, 0]])
    credit = anchored_credit(values, torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), 3, steps)
    out = group_step_normalized(credit, 3, steps)
    assert (out[0] != 0).any() and (out[3:, :2] != 0).all()
    torch.testing.assert_close(credit.sum(dim=1), torch.zeros(6))


def test_turn_mask_from_index():
    turns = torch.tensor([[0, 0, -1, 1, 1, -1, 2], [0, -1, -1, -1, -1, -1, -1], [-1] * 7])
    assert torch.equal(turn_mask_from_index(turns), torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]]))
    assert turn_mask_from_index(torch.full((2, 3), -1)).shape == (2, 1)


def test_every_token_of_an_action_shares_its_advantage_and_observations_get_none():
    step_adv = torch.tensor([[0.5, -1.0, 2.0], [3.0, 0.0, 0.0]])
    turns = torch.tensor([[0, 0, -1, -1, 1, -1, 2, 2, 2], [0, 0, 0, -1, -1, -1, -1, -1, -1]])
    out = turn_token_advantages(step_adv, turns)
    expected = torch.tensor([[0.5, 0.5, 0, 0, -1.0, 0, 2.0, 2.0, 2.0], [3.0, 3.0, 3.0, 0, 0, 0, 0, 0, 0]])
    assert torch.equal(out, expected)
    assert torch.equal(turn_token_advantages(step_adv, torch.full((2, 4), -1)), torch.zeros(2, 4))


def test_refusals():
    with pytest.raises(ValueError, match="left-aligned"):
        anchored_credit(torch.zeros(2, 3), torch.zeros(2), 2, torch.tensor([[1, 0, 1], [1, 1, 0]]))
    with pytest.raises(ValueError, match="group_size=3"):
        anchored_credit(torch.zeros(4, 2), torch.zeros(4), 3, torch.ones(4, 2))
    with pytest.raises(ValueError, match="same shape"):
        anchored_credit(torch.zeros(2, 3), torch.zeros(2), 2, torch.ones(2, 2))
    with pytest.raises(ValueError, match="reaches action 2"):
        turn_token_advantages(torch.zeros(1, 2), torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="same shape"):
        group_step_normalized(torch.zeros(2, 3), 2, torch.ones(2, 2))
