"""BPCO and EasyPPO (docs/algorithms.md, BPCO; EasyPPO, arXiv 2609.36802): their advantages,
critic targets, clip interval, truncation filter and critic weights, on hand batches through the modules."""

from __future__ import annotations

import dataclasses

import math
from dataclasses import replace

import torch

from rl_lightning.algorithms import BPCO, PPO, Advantages, EasyPPO, PolicyOutput
from rl_lightning.algorithms.critic import GAE_LAMBDA, VALUE_WEIGHTS
from rl_lightning.functional import variance_weights
from rl_lightning.rollout import RolloutBatch


def _batch(lengths: list[int], rewards: list[float], group_size: int = 2, width: int = 4,
           truncated: list[bool] | None = None) -> RolloutBatch:
    n, prompt = len(lengths), 3
    gen = torch.Generator().manual_seed(0)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(3, 99, (n, prompt + width), generator=gen)
    attention = torch.cat([torch.ones(n, prompt, dtype=torch.long), mask], dim=1)
    return RolloutBatch(
        input_ids=ids * attention, attention_mask=attention, prompt_length=prompt, loss_mask=mask,
        sampler_logprobs=torch.full((n, width), math.log(0.5)) * mask, rewards=torch.tensor(rewards),
        group_size=group_size, prompt_index=torch.arange(n) // group_size,
        truncated=torch.tensor(truncated if truncated is not None else [False] * n),
    )


def test_bpco_advantages_use_each_responses_own_lambda_and_the_critic_targets_the_final_reward():
    torch.manual_seed(0)
    module = BPCO(model_name_or_path="embedded:random", alpha=0.5)
    batch = _batch([4, 2, 3, 1], [1.0, 0.0, 1.0, 0.0])
    adv = module.compute_advantages(batch)
    advantages = adv.advantages
    # the bounded head starts at the middle of [0, 1]: V = 0.5 on every generated token, so every TD error is 0
    # but the last one, R - 0.5, and A_t = λ(L)^(L-1-t) (R - 0.5) with λ(L) = max(1 - 1/(0.5 L), 0)
    for row, (length, reward) in enumerate([(4, 1.0), (2, 0.0), (3, 1.0), (1, 0.0)]):
        lam = max(1 - 1 / (0.5 * length), 0.0)
        want = torch.tensor([lam ** (length - 1 - t) * (reward - 0.5) for t in range(length)])
        torch.testing.assert_close(advantages[row, :length], want, rtol=4 * 2**-24, atol=2**-24)
        assert (advantages[row, length:] == 0).all()
        # λ_V = 1, γ = 1: the critic's target is the observed final reward at every token, exactly
        assert (adv.returns[row, :length] == reward).all()
        torch.testing.assert_close(adv.rows[GAE_LAMBDA][row], torch.tensor(lam))  # the λ the advantages used
    assert torch.equal(adv.values[batch.loss_mask.bool()], torch.full((10,), 0.5))  # raw, unwhitened


def _objective_grad(module, p: float, pi: float, advantage: float) -> tuple[float, float]:
    """``(objective, d objective / d log π)`` at one token with rollout probability ``p`` and learner ``π``."""
    batch = _batch([1], [0.0], group_size=1, width=1)
    batch = dataclasses.replace(batch, sampler_logprobs=torch.tensor([[math.log(p)]]))
    logprobs = torch.tensor([[math.log(pi)]], requires_grad=True)
    ratio = torch.exp((logprobs - batch.sampler_logprobs) * batch.loss_mask)  # as RLModule.policy_loss makes it
    objective, _ = module.policy_objective(batch, PolicyOutput(logprobs), ratio,
                                           Advantages(torch.tensor([[advantage]])))
    (grad,) = torch.autograd.grad(objective.sum(), logprobs)
    return float(objective), float(grad)


def _rel(p: float, pi: float) -> float:
    """float32: the inputs log p, log π (u |log| each), ρ = exp of their difference (1 ulp), times A; a clip bound
    1 ± ε/p (p = exp(log p)) as many: relative ``u (|log p| + |log π| + 4)``."""
    return 2.0**-24 * (abs(math.log(p)) + abs(math.log(pi)) + 4)


def test_bpco_clip_interval_is_an_absolute_probability_change_of_eps():
    module = BPCO(model_name_or_path="embedded:random", divergence_eps=0.1)
    # p = 0.5: ρ ∈ [0.8, 1.2] ⇔ |π - p| <= 0.1
    value, grad = _objective_grad(module, 0.5, 0.55, 1.0)  # inside: ρ A, gradient ρ A
    assert math.isclose(value, 1.1, rel_tol=_rel(0.5, 0.55)) and math.isclose(grad, 1.1, rel_tol=_rel(0.5, 0.55))
    value, grad = _objective_grad(module, 0.5, 0.65, 1.0)  # |Δp| = 0.15 > ε in A's direction: clipped, no gradient
    assert math.isclose(value, 1.2, rel_tol=_rel(0.5, 0.65)) and grad == 0.0
    value, grad = _objective_grad(module, 0.5, 0.35, -1.0)  # below, with A < 0: clipped at 1 - ε/p = 0.8
    assert math.isclose(value, -0.8, rel_tol=_rel(0.5, 0.35)) and grad == 0.0
    _, grad = _objective_grad(module, 0.5, 0.35, 1.0)  # below with A > 0: moving back is never clipped
    assert math.isclose(grad, 0.7, rel_tol=_rel(0.5, 0.35))
    # a rare token: p = 0.05, ρ = 2.5 is a change of only 0.075 < ε: unclipped, where PPO's [0.8, 1.2] clips it
    _, grad = _objective_grad(module, 0.05, 0.125, 1.0)
    assert math.isclose(grad, 2.5, rel_tol=_rel(0.05, 0.125))
    ppo = PPO(model_name_or_path="embedded:random")
    assert _objective_grad(ppo, 0.05, 0.125, 1.0)[1] == 0.0


def test_easyppo_a_truncated_response_trains_the_critic_and_not_the_actor():
    torch.manual_seed(0)
    module = EasyPPO(model_name_or_path="embedded:random", critic="separate", whiten_advantages=False)
    batch = _batch([4, 4, 3, 2], [1.0, 0.0, 1.0, 0.0], truncated=[True, False, False, False])
    adv = module.compute_advantages(batch)
    advantages = adv.advantages
    assert (advantages[0] == 0).all() and (advantages[1:] != 0).any()
    weights = module.loss_weights(batch)
    loss, _ = module.policy_loss(batch, module.forward_policy(batch), adv, weights)
    row0 = batch.select(torch.tensor([0]))
    row0_adv = adv.select(torch.tensor([0]))
    actor_loss, _ = module.policy_loss(row0, module.forward_policy(row0), row0_adv, weights[:1])
    assert module.extra_losses(row0, module.forward_policy(row0), row0_adv, weights[:1]) == []  # critic_updates: 1
    grads = torch.autograd.grad(actor_loss, list(module.policy.parameters()), allow_unused=True)
    assert all(g is None or (g == 0).all() for g in grads)  # the truncated row moves the actor not at all
    value_loss, _ = module.critic_learner.loss(row0, module.critic_learner.values(row0), row0_adv, weights[:1])
    head = torch.autograd.grad(value_loss, module.critic.head.proj.bias)[0]
    assert head.abs().item() > 0  # ... and still trains the critic toward its (truncation) reward
    extra = module.after_update(batch, adv)  # EasyPPO's own metrics, after the update
    assert extra["train/kept_for_actor"] == [torch.tensor(0.75)]
    assert extra["train/value_weight_max"] == [adv.rows[VALUE_WEIGHTS].max()]


def test_easyppo_value_loss_with_equal_variances_is_the_plain_value_loss_and_otherwise_the_weighted_one():
    torch.manual_seed(0)
    module = EasyPPO(model_name_or_path="embedded:random", critic="separate", w_min=0.01, value_clip=None)
    plain = PPO(model_name_or_path="embedded:random", critic="separate", value_clip=None)
    for rewards, equal in (([0.0, 1.0, 1.0, 0.0], True), ([0.0, 1.0, 0.5, 0.5], False)):
        batch = _batch([4, 4, 3, 2], rewards)
        adv = module.compute_advantages(batch)
        weights = module.loss_weights(batch)
        values = torch.rand(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1)) * batch.loss_mask
        ours, _ = module.critic_learner.loss(batch, values, adv, weights)
        base, _ = plain.critic_learner.loss(batch, values, replace(adv, rows={}), weights)  # the same targets
        row = variance_weights(batch.rewards, 2, 0.01, 0.5).unsqueeze(-1)
        assert torch.equal(adv.rows[VALUE_WEIGHTS], row.squeeze(-1))
        if equal:
            torch.testing.assert_close(ours, base)
        else:
            # Var^0.5 = 0.5 and 0 (floored at w_min = 0.01): w ∝ 2 and 100, normalised to mean 1
            # -> [2, 2, 100, 100] / 51
            torch.testing.assert_close(row.squeeze(-1), torch.tensor([2 / 51, 2 / 51, 100 / 51, 100 / 51]))
            weighted = (0.5 * (values - adv.returns) ** 2 * batch.loss_mask * weights * row).sum()
            torch.testing.assert_close(ours, weighted)
            assert not torch.allclose(ours, base)
