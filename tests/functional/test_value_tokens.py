"""``functional.value_tokens``: the generative critic's value grid and TEMPO's macro-step targets, on numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.functional import (
    accuracy_advantages, branch_mean_targets, macro_step_returns, nearest_bin, value_from_grid, value_levels,
    value_token_ce,
)

GRID = value_levels(0.0, 1.0, 11)


def test_value_levels_are_the_eleven_tenths():
    assert torch.allclose(GRID, torch.tensor([k / 10 for k in range(11)]))
    with pytest.raises(ValueError, match="bins >= 2"):
        value_levels(1.0, 0.0)


def test_value_from_grid_is_the_expectation_over_the_grid_ids_only():
    grid = torch.tensor([0.0, 0.5, 1.0])
    # probabilities 0.1, 0.1, 0.3 over the grid (0.5 elsewhere in the vocabulary): renormalised 0.2, 0.2, 0.6
    logp = torch.log(torch.tensor([[0.1, 0.1, 0.3], [0.5, 0.0 + 1e-30, 0.0 + 1e-30]]))
    values = value_from_grid(logp, grid)
    assert values[0].item() == pytest.approx(0.2 * 0.0 + 0.2 * 0.5 + 0.6 * 1.0)  # 0.7
    assert values[1].item() == pytest.approx(0.0, abs=1e-12)  # all mass on the lowest bin
    # a constant per context cancels: logits or log-probs give the same value
    assert torch.allclose(value_from_grid(logp[:1] + 7.0, grid), values[:1])
    with pytest.raises(ValueError, match=r"must be \[C, 3\]"):
        value_from_grid(logp[:, :2], grid)


def test_nearest_bin_rounds_half_up_at_bin_edges_and_clips_outside_the_range():
    targets = torch.tensor([0.0, 0.049, 0.05, 0.051, 0.15, 0.25, 0.349, 0.95, 1.0])
    assert nearest_bin(targets, GRID).tolist() == [0, 0, 1, 1, 2, 3, 3, 10, 10]
    assert nearest_bin(torch.tensor([-0.7, 1.3, 40.0]), GRID).tolist() == [0, 10, 10]  # clipped to [R_min, R_max]
    # another range: [-1, 1] in 5 bins (-1, -0.5, 0, 0.5, 1)
    assert nearest_bin(torch.tensor([-0.75, -0.2, 0.25, 0.74]), value_levels(-1.0, 1.0, 5)).tolist() == [1, 2, 3, 3]
    with pytest.raises(ValueError, match="increasing"):
        nearest_bin(torch.tensor([0.1]), torch.tensor([1.0, 0.0]))


def test_value_token_ce_is_minus_log_of_the_renormalised_target_probability():
    logp = torch.log(torch.tensor([[0.1, 0.1, 0.3], [0.2, 0.2, 0.1]]))
    ce = value_token_ce(logp, torch.tensor([2, 0]))
    assert ce.tolist() == pytest.approx([-math.log(0.6), -math.log(0.4)])
    # its gradient w.r.t. the grid logits is softmax - onehot
    logits = torch.zeros(1, 3, requires_grad=True)
    value_token_ce(logits, torch.tensor([1])).sum().backward()
    assert logits.grad[0].tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3])


def test_accuracy_advantages_are_centred_within_each_states_group():
    values = torch.tensor([0.0, 0.5, 1.0, 0.2, 0.2, 0.2])
    targets = torch.tensor([0.5, 0.5, 0.5, 0.2, 0.2, 0.2])
    rewards, adv = accuracy_advantages(values, targets, 3, 0.0, 1.0)
    assert rewards.tolist() == pytest.approx([-0.5, 0.0, -0.5, 0.0, 0.0, 0.0])
    assert adv.tolist() == pytest.approx([-1 / 6, 1 / 3, -1 / 6, 0.0, 0.0, 0.0])  # mean -1/3 removed per group
    assert adv.view(2, 3).sum(dim=1).tolist() == pytest.approx([0.0, 0.0], abs=1e-7)
    _, scaled = accuracy_advantages(values, targets, 3, 0.0, 1.0, scale=True)
    std = torch.tensor([-0.5, 0.0, -0.5]).std(unbiased=False).item()
    assert scaled[:3].tolist() == pytest.approx([(-1 / 6) / (std + 1e-6), (1 / 3) / (std + 1e-6),
                                                 (-1 / 6) / (std + 1e-6)])
    assert scaled[3:].tolist() == [0.0, 0.0, 0.0]  # no spread: 0
    # normalised by the range: R in [0, 4] halves... quarters the error
    assert (accuracy_advantages(torch.tensor([0.0, 2.0]), torch.tensor([2.0, 2.0]), 2, 0.0, 4.0)[0].tolist()
            == [-0.5, 0.0])


def test_macro_step_returns_bootstrap_only_cut_branches():
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.0])
    terminated = torch.tensor([False, True, True, False])
    ends = torch.tensor([0.3, float("nan"), float("nan"), 0.9], requires_grad=True)
    g = macro_step_returns(rewards, terminated, ends)
    assert g.tolist() == pytest.approx([0.3, 1.0, 0.0, 0.9])  # a terminal end is worth 0, NaN ignored
    assert not g.requires_grad  # V̂ detached in the actor's target
    # every branch terminal: G is the Monte-Carlo return whatever the critic would say
    assert (macro_step_returns(rewards, torch.ones(4, dtype=torch.bool), torch.full((4,), 5.0)).tolist()
            == rewards.tolist())


def test_branch_mean_targets_are_the_mean_over_each_states_branches():
    g = torch.tensor([0.0, 1.0, 0.5, 0.5, 1.0, 1.0, 1.0, 0.0])
    assert branch_mean_targets(g, 4).tolist() == pytest.approx([0.5, 0.75])
    assert branch_mean_targets(g, 2).tolist() == pytest.approx([0.5, 0.5, 1.0, 0.5])
    with pytest.raises(ValueError, match="not divisible"):
        branch_mean_targets(g, 3)
