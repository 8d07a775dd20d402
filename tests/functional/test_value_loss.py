"""Worked examples for PPO's value loss and explained variance (Schulman et al. 2017, arXiv 1707.06347)."""

from __future__ import annotations

import torch

from rl_lightning.functional import aggregation_weights, clipped_value_loss, explained_variance


def test_clipped_value_loss_takes_the_larger_branch():
    mask = torch.ones(1, 3)
    w = aggregation_weights(mask, "token_mean")  # 1/3 each
    values = torch.tensor([[1.0, 0.1, 0.5]])
    old = torch.tensor([[0.0, 0.0, 0.5]])
    returns = torch.tensor([[1.0, 0.0, 0.0]])
    loss, stats = clipped_value_loss(values, old, returns, mask, w, clip_range=0.2)
    # t0: unclipped (1-1)^2 = 0; clipped V = 0 + 0.2 -> (0.2-1)^2 = 0.64 -> max 0.64
    # t1: unclipped (0.1-0)^2 = 0.01; clipped V = 0.1 (inside) -> 0.01
    # t2: unclipped (0.5-0)^2 = 0.25; clipped V = 0.5 -> 0.25
    # loss = 1/3 * 1/2 * (0.64 + 0.01 + 0.25) = 0.15
    torch.testing.assert_close(loss, torch.tensor(0.15))
    torch.testing.assert_close(stats.value_clip_fraction, torch.tensor(1 / 3))


def test_unclipped_value_loss_is_half_mse_and_its_gradient():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = aggregation_weights(mask, "token_mean")  # 1/2 on the two real tokens
    values = torch.tensor([[0.5, -1.0, 7.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = clipped_value_loss(values, values.detach(), returns, mask, w, clip_range=None)
    # 1/2 * 1/2 * (0.25 + 4) = 1.0625 ; padding (7.0) ignored
    torch.testing.assert_close(loss, torch.tensor(1.0625))
    loss.backward()
    # dL/dV = w (V - R) = [0.5*(-0.5), 0.5*(-2), 0]
    torch.testing.assert_close(values.grad, torch.tensor([[-0.25, -1.0, 0.0]]))


def test_explained_variance():
    mask = torch.ones(1, 4)
    returns = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    assert float(explained_variance(returns.clone(), returns, mask)) == 1.0  # perfect critic
    mean_only = torch.full_like(returns, 1.5)
    torch.testing.assert_close(explained_variance(mean_only, returns, mask), torch.tensor(0.0))
    assert float(explained_variance(torch.zeros(1, 4), torch.ones(1, 4), mask)) == 0.0  # no variance -> 0
