"""Worked examples for the REINFORCE family's math (PG and REINFORCE + baseline: Williams 1992; RLOO: Ahmadian et
al. 2024, arXiv 2402.14740)."""

from __future__ import annotations

import torch

from rl_lightning.functional import (
    aggregation_weights,
    baseline_advantages,
    ema_update,
    leave_one_out_advantages,
    outcome_token_rewards,
    policy_gradient_loss,
)
from tests.tolerances import log_softmax_tolerance, sum_tolerance


def test_baseline_advantages_worked_example():
    # REINFORCE + baseline: b = 0.6; R = 0.9 -> +0.3 (better than expected); R = 0.2 -> -0.4 (worse)
    adv = baseline_advantages(torch.tensor([0.9, 0.2]), 0.6)
    torch.testing.assert_close(adv, torch.tensor([0.3, -0.4]))


def test_baseline_is_a_constant():
    b = torch.tensor(0.5, requires_grad=True)
    adv = baseline_advantages(torch.tensor([1.0, 0.0]), b)
    assert not adv.requires_grad


def test_ema_update_hand_numbers():
    # 0.9 * 0.5 + 0.1 * 1.0 = 0.55 ; then 0.9 * 0.55 + 0.1 * 0.0 = 0.495
    first = ema_update(torch.tensor(0.5), torch.tensor(1.0), 0.9)
    second = ema_update(first, torch.tensor(0.0), 0.9)
    torch.testing.assert_close(first, torch.tensor(0.55))
    torch.testing.assert_close(second, torch.tensor(0.495))


def test_policy_gradient_loss_is_reward_times_token_sum_averaged_over_responses():
    # two responses: R = [1.0, -0.5]; log-probs [-1, -2] and [-0.5, (pad)]
    lp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    w = aggregation_weights(mask, "seq_mean_token_sum")  # 1/N = 0.5 on every real token
    loss, stats = policy_gradient_loss(lp, torch.tensor([1.0, -0.5]), mask, w)
    # L = 1/2 * [ -1.0 * (-1 - 2) + -(-0.5) * (-0.5) ] = 1/2 * [3 - 0.25] = 1.375
    torch.testing.assert_close(loss, torch.tensor(1.375))
    torch.testing.assert_close(stats.logprob_mean, torch.tensor(-3.5 / 3))


def test_policy_gradient_logit_gradient_is_minus_reward_times_onehot_minus_softmax():
    # For one position with logits z and sampled a, dL/dz = -R (e_a - softmax(z)); it sums to 0.
    z = torch.tensor([0.3, -1.2, 2.0, 0.0], requires_grad=True)
    a, reward = 2, 0.7
    logp = torch.log_softmax(z, -1)[a].reshape(1, 1)
    mask = torch.ones(1, 1)
    loss, _ = policy_gradient_loss(logp, torch.tensor([reward]), mask, aggregation_weights(mask, "token_sum"))
    loss.backward()
    expected = -reward * (torch.nn.functional.one_hot(torch.tensor(a), 4).float() - torch.softmax(z.detach(), -1))
    torch.testing.assert_close(z.grad, expected)
    # Σ_v (e_a - p_v) = 1 - Σ p: the V + 1 terms of size 2R, p within log_softmax_tolerance relative
    assert abs(float(z.grad.sum())) <= reward * (log_softmax_tolerance(z) + sum_tolerance(4 + 1, 2.0))


def test_rloo_advantages_receive_no_gradient():
    rewards = torch.tensor([1.0, 0.8, 0.2, 0.0], requires_grad=True)
    adv = leave_one_out_advantages(rewards, 4)  # differentiable in rewards...
    lp = torch.full((4, 1), -1.0, requires_grad=True)
    mask = torch.ones(4, 1)
    loss, _ = policy_gradient_loss(lp, adv, mask, aggregation_weights(mask, "seq_mean_token_sum"))
    loss.backward()
    assert rewards.grad is None  # ...but the loss treats them as constants (sg[A])
    # d/dlp of -(1/4) Σ A_i lp_i = -A_i / 4 = [-0.1667, -0.1, 0.1, 0.1667]
    torch.testing.assert_close(lp.grad.squeeze(-1), -adv.detach() / 4)


def test_constant_baseline_leaves_the_expected_gradient_unchanged():
    # On an enumerable one-token policy, Σ_a π(a)(R(a) - b) ∇log π(a) is the same for b = 0 and 0.7.
    z = torch.tensor([0.5, -0.3, 0.1])
    rewards = torch.tensor([1.0, 0.2, 0.5])

    def expected_grad(b: float) -> torch.Tensor:
        logits = z.clone().requires_grad_(True)
        logp = torch.log_softmax(logits, -1)
        probs = logp.exp().detach()
        surrogate = (probs * (rewards - b) * logp).sum()  # exact expectation over the 3 actions
        (grad,) = torch.autograd.grad(surrogate, logits)
        return grad

    # float32: Σ_a π(a)(R(a) - b)(e_a - π) over 3 actions, terms of size π |R - b| (1 + π) <= 2 (|R| + b) each,
    # a few roundings each (log-softmax, exp) and 3 + 3 summed, for each b
    magnitude = 2 * float((rewards.abs() + 0.7).sum())
    tol = 2 * (log_softmax_tolerance(z) * magnitude + sum_tolerance(6, magnitude))
    torch.testing.assert_close(expected_grad(0.0), expected_grad(0.7), atol=tol, rtol=0)


def test_outcome_token_rewards_sit_on_the_last_generated_token():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    r = outcome_token_rewards(torch.tensor([1.0, 0.5, 9.0]), mask)
    assert r.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0]]


def test_outcome_gae_is_gae_on_outcome_rewards_then_whitened():
    from rl_lightning.functional import gae, masked_whiten, outcome_gae

    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.4, 9.0]])
    rewards = torch.tensor([1.0, 0.0])
    adv, ret = outcome_gae(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    # γ = λ = 1 and V = 0 after the end: Â_t = R - V_t on every generated token
    torch.testing.assert_close(adv, torch.tensor([[0.9, 0.8, 0.7], [-0.5, -0.4, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    white, ret2 = outcome_gae(rewards, values, mask, gamma=1.0, lam=0.9, whiten=True)
    raw, ret_raw = gae(torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), values, mask, 1.0, 0.9)
    torch.testing.assert_close(white, masked_whiten(raw, mask))
    torch.testing.assert_close(ret2, ret_raw)  # returns are never whitened
