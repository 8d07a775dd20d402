"""``CriticLearner``, the critic every critic method holds (``module.critic_learner``): its own update schedule (K
passes x minibatches, each minibatch's gradient clipped), the joint default left as it was, and the bounded value
head."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from rl_lightning.algorithms import PPO, TRPO, CriticLearner
from rl_lightning.algorithms.metrics import plain
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.rollout.rollout_helpers import fake_trainer


def _rollout(module):
    dm = tiny_datamodule()
    dm.trainer = fake_trainer(module)
    batch = dm.rollout(dm.prompt_batch(0))
    batch = replace(batch, rewards=torch.rand(batch.num_rows,
                                              generator=torch.Generator().manual_seed(0)))  # graded returns
    return batch


def _optimizer(module):
    optimizer = torch.optim.SGD([p for g in module.parameter_groups() for p in g["params"]], lr=0.1)
    return SimpleNamespace(zero_grad=optimizer.zero_grad, step=optimizer.step, optimizer=optimizer)


def test_critic_updates_take_k_passes_of_minibatches_each_clipped_on_its_own(monkeypatch):
    torch.manual_seed(0)
    module = PPO(model_name_or_path="embedded:random", critic="separate", critic_updates=2, critic_minibatches=4,
                 critic_max_grad_norm=1e-3)
    batch = _rollout(module)
    adv = module.compute_advantages(batch)
    optimizer = _optimizer(module)
    norms_at_step: list[float] = []
    inner = optimizer.optimizer.step

    def step():
        grads = [p.grad for p in module.critic.parameters() if p.grad is not None]
        norms_at_step.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        assert all(p.grad is None for p in module.policy.parameters())  # the critic's update alone
        return inner()

    monkeypatch.setattr(optimizer.optimizer, "step", step)
    monkeypatch.setattr(module, "manual_backward", lambda loss: loss.backward())
    policy_before = [p.detach().clone() for p in module.policy.parameters()]
    stats = module.critic_learner.fit(batch, adv, module.loss_weights(batch), optimizer)
    assert len(norms_at_step) == 8 and len(stats["train/critic_grad_norm"]) == 8  # 2 passes x 4 minibatches
    assert min(float(n) for n in stats["train/critic_grad_norm"]) > 1e-3  # the clip had something to do
    # clip_grad_norm_ scales by c / (norm + 1e-6): the clipped norm is c (1 - 1e-6 / norm) <= c, up to the
    # scaling's rounding (u) and the two norms' (each a sum of N squares: sqrt(N) u of it, probabilistic)
    from tests.tolerances import gamma_probabilistic, unit_roundoff

    count = sum(p.numel() for p in module.critic.parameters())
    assert max(norms_at_step) <= 1e-3 * (1 + 2 * gamma_probabilistic(count) + 2 * unit_roundoff())
    assert all(torch.equal(a, b) for a, b in zip(policy_before, module.policy.parameters()))


def test_a_shared_critic_trained_on_its_own_moves_only_its_head(monkeypatch):
    torch.manual_seed(0)
    module = PPO(model_name_or_path="embedded:random", critic="shared", critic_updates=1)
    assert not module.needs_hidden  # the actor's forward need not produce hidden states for the critic
    batch = _rollout(module)
    adv = module.compute_advantages(batch)
    monkeypatch.setattr(module, "manual_backward", lambda loss: loss.backward())
    before = [p.detach().clone() for p in module.policy.parameters()]
    head = module.critic.head.proj.weight.detach().clone()
    module.critic_learner.fit(batch, adv, module.loss_weights(batch), _optimizer(module))
    assert all(torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))
    assert not torch.equal(head, module.critic.head.proj.weight)


def test_with_separate_critic_updates_the_actor_loss_has_no_value_term():
    torch.manual_seed(0)
    module = PPO(model_name_or_path="embedded:random", critic_updates=1)
    joint = PPO(model_name_or_path="embedded:random")
    batch = _rollout(module)
    adv = module.compute_advantages(batch)
    adv = replace(adv, advantages=adv.advantages.detach())
    joint_adv = replace(joint.compute_advantages(batch), advantages=adv.advantages)  # joint's V_old and returns
    weights = module.loss_weights(batch)
    out = module.forward_policy(batch)
    loss, metrics = module.policy_loss(batch, out, adv, weights)
    assert module.extra_losses(batch, out, adv, weights) == []  # no value term (and no entropy bonus)
    joint_out = joint.forward_policy(batch, with_hidden=True)
    joint_loss, joint_metrics = joint.policy_loss(batch, joint_out, joint_adv, weights)
    for term, term_metrics in joint.extra_losses(batch, joint_out, joint_adv, weights):
        joint_loss, joint_metrics = joint_loss + term, {**joint_metrics, **term_metrics}
    assert "train/value_loss" not in metrics and "train/value_loss" in joint_metrics
    torch.testing.assert_close(loss, plain(metrics["train/policy_loss"]))
    torch.testing.assert_close(joint_loss, plain(joint_metrics["train/policy_loss"])
                               + 0.5 * plain(joint_metrics["train/value_loss"]))


def test_a_bounded_value_head_starts_mid_range_and_never_leaves_it(tmp_path):
    torch.manual_seed(0)
    module = PPO(model_name_or_path="embedded:random", value_bounds=(0.0, 1.0), critic_lr=1.0, vf_coef=100.0)
    batch = _rollout(module)
    values = module.critic_learner.rollout_values(batch)[batch.loss_mask.bool()]
    assert torch.allclose(values, torch.full_like(values, 0.5))
    tiny_trainer(tmp_path, max_steps=3).fit(module, datamodule=tiny_datamodule())
    values = module.critic_learner.rollout_values(batch)[batch.loss_mask.bool()]
    assert not torch.allclose(values, torch.full_like(values, 0.5))  # it moved (lr 1, a large value loss)
    assert float(values.min()) >= 0.0 and float(values.max()) <= 1.0


def test_a_ppo_fit_with_its_own_critic_schedule_runs_and_logs_the_critic(tmp_path):
    torch.manual_seed(0)
    module = PPO(model_name_or_path="embedded:arithmetic", critic_updates=2, critic_minibatches=2,
                 critic_max_grad_norm=1.0)  # the warm start earns rewards: the critic has returns to fit
    critic_before = module.critic.head.proj.weight.detach().clone()
    trainer = tiny_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=tiny_datamodule())
    assert trainer.global_step == 2  # the critic's inner steps are not counted
    assert not torch.equal(critic_before, module.critic.head.proj.weight)
    assert {"train/critic_grad_norm", "train/value_loss", "train/explained_variance"} <= set(trainer.callback_metrics)


def test_every_critic_method_holds_a_critic_learner():
    ppo = PPO(model_name_or_path="embedded:random")
    assert isinstance(ppo.critic_learner, CriticLearner) and ppo.critic_learner.model is ppo.critic
    group = TRPO(model_name_or_path="embedded:random")
    assert group.critic_learner is None and getattr(group, "critic", None) is None  # group advantages: no critic
    gae = TRPO(model_name_or_path="embedded:random", advantage_estimator="gae", critic_steps=3)
    assert isinstance(gae.critic_learner, CriticLearner) and gae.critic is gae.critic_learner.model
    assert gae.critic_learner.updates == 3 and gae.critic_learner.value_clip is None


def test_a_reference_answer_reaches_the_critic_only():
    import pytest

    with pytest.raises(ValueError, match="critic_reference needs critic: separate or adapter"):
        PPO(model_name_or_path="embedded:random", critic_reference="answer: {answer}\n")
    torch.manual_seed(0)
    module = PPO(model_name_or_path="embedded:random", critic="separate", critic_reference="answer: {answer}\n")
    with torch.no_grad():
        module.critic.head.proj.weight.normal_()  # a head that reads its hidden states (it starts at 0)
    batch = _rollout(module)
    ids, mask, prompt_length = module.critic_learner.inputs(batch)
    width = batch.input_ids.shape[1] - batch.prompt_length
    assert torch.equal(ids[:, prompt_length:], batch.input_ids[:, batch.prompt_length:])  # the same responses
    text = module.tokenizer.decode(ids[0, :prompt_length][mask[0, :prompt_length].bool()])
    assert f"answer: {batch.prompts[0].answer}" in text and ids.shape[1] == prompt_length + width
    values = module.critic_learner.rollout_values(batch)
    other = replace(batch, prompts=[replace(p, answer="999") for p in batch.prompts])
    assert not torch.allclose(module.critic_learner.rollout_values(other), values)  # the critic reads the reference ...
    with torch.no_grad():  # ... the policy does not
        assert torch.equal(module.forward_policy(other).logprobs, module.forward_policy(batch).logprobs)
