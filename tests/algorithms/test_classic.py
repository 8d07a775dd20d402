"""PolicyGradient, REINFORCE, RLOO and PPO on CPU: they train, refuse bad settings, and keep state on resume."""

from __future__ import annotations

import pytest
import torch

from rl_lightning.algorithms import PPO, REINFORCE, RLOO, PolicyGradient
from rl_lightning.rollout import RolloutBatch
from tests.conftest import RecordRollouts, tiny_datamodule, tiny_trainer
from tests.tolerances import decoder_logprob_bound


def _adamw(lr: float):
    return lambda params: torch.optim.AdamW(params, lr=lr)


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("cls", [PolicyGradient, REINFORCE, RLOO])
def test_reinforce_family_trains(cls, tmp_path, recorder):
    module = cls(model_name_or_path="embedded:arithmetic", optimizer=_adamw(1e-3))
    before = _snapshot(module.policy)
    tiny_trainer(tmp_path, max_steps=2, callbacks=[recorder]).fit(module, datamodule=tiny_datamodule())
    after = _snapshot(module.policy)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    bound = decoder_logprob_bound(module.policy, 1.0, module.policy.config.max_position_embeddings)
    assert recorder.metrics[0]["train/sampler_logp_diff"] <= bound  # on-policy: float32 rounding
    assert module.loss_aggregation == "seq_mean_token_sum"  # REINFORCE's token sum, averaged over responses


def _batch(rewards: list[float], group_size: int) -> RolloutBatch:
    n = len(rewards)
    return RolloutBatch(
        input_ids=torch.zeros(n, 3, dtype=torch.long), attention_mask=torch.ones(n, 3, dtype=torch.long),
        prompt_length=1, loss_mask=torch.ones(n, 2, dtype=torch.long), sampler_logprobs=torch.zeros(n, 2),
        rewards=torch.tensor(rewards), group_size=group_size, prompt_index=torch.arange(n),
        truncated=torch.zeros(n, dtype=torch.bool),
    )


def test_pg_advantage_is_the_reward():
    module = PolicyGradient(model_name_or_path="embedded:random")
    assert module.compute_advantages(_batch([1.0, 0.0, 0.5], 1)).tolist() == [1.0, 0.0, 0.5]


def test_rloo_advantages_are_leave_one_out():
    module = RLOO(model_name_or_path="embedded:random")
    adv = module.compute_advantages(_batch([1.0, 0.8, 0.2, 0.0], 4))
    torch.testing.assert_close(adv, torch.tensor([2 / 3, 0.4, -0.4, -2 / 3]))


def test_reinforce_baselines():
    batch = _batch([1.0, 0.0, 0.0, 0.0], 1)  # mean 0.25
    mean = REINFORCE(model_name_or_path="embedded:random", baseline="batch_mean")
    torch.testing.assert_close(mean.compute_advantages(batch), torch.tensor([0.75, -0.25, -0.25, -0.25]))
    none = REINFORCE(model_name_or_path="embedded:random", baseline="none")
    assert none.compute_advantages(batch).tolist() == [1.0, 0.0, 0.0, 0.0]
    ema = REINFORCE(model_name_or_path="embedded:random", baseline="ema", ema_decay=0.5)
    # first batch: no history -> b = its own mean 0.25; then ema = 0.5*0.25 + 0.5*0.25 = 0.25
    torch.testing.assert_close(ema.compute_advantages(batch), torch.tensor([0.75, -0.25, -0.25, -0.25]))
    # second batch (mean 1.0) is scored against the history b = 0.25, then ema = 0.5*0.25 + 0.5*1.0 = 0.625
    torch.testing.assert_close(ema.compute_advantages(_batch([1.0, 1.0, 1.0, 1.0], 1)), torch.full((4,), 0.75))
    torch.testing.assert_close(ema.reward_ema, torch.tensor(0.625))


def test_reinforce_is_the_policy_gradient_with_an_ema_baseline():
    assert issubclass(REINFORCE, PolicyGradient)
    assert REINFORCE(model_name_or_path="embedded:random").baseline == "ema"
    assert PolicyGradient(model_name_or_path="embedded:random").baseline == "none"
    pg = PolicyGradient(model_name_or_path="embedded:random", baseline="ema", ema_decay=0.5)
    reinforce = REINFORCE(model_name_or_path="embedded:random", ema_decay=0.5)
    for rewards in ([1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]):
        assert torch.equal(pg.compute_advantages(_batch(rewards, 1)), reinforce.compute_advantages(_batch(rewards, 1)))
    assert torch.equal(pg.reward_ema, reinforce.reward_ema)


def test_reinforce_ema_baseline_is_checkpointed(tmp_path):
    module = REINFORCE(model_name_or_path="embedded:arithmetic", baseline="ema", optimizer=_adamw(1e-3))
    trainer = tiny_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=tiny_datamodule())
    assert bool(module.reward_ema_initialised)
    ckpt = tmp_path / "r.ckpt"
    trainer.save_checkpoint(ckpt)
    fresh = REINFORCE(model_name_or_path="embedded:arithmetic", baseline="ema")
    fresh.load_state_dict(torch.load(ckpt, weights_only=False)["state_dict"])
    assert torch.equal(fresh.reward_ema, module.reward_ema) and bool(fresh.reward_ema_initialised)


def test_on_policy_estimators_refuse_several_iterations():
    with pytest.raises(ValueError, match="num_iterations must be 1"):
        PolicyGradient(model_name_or_path="embedded:random", num_iterations=2)


def test_rloo_refuses_groups_of_one(tmp_path):
    with pytest.raises(ValueError, match="group_size >= 2"):
        tiny_trainer(tmp_path, max_steps=1).fit(RLOO(model_name_or_path="embedded:random"),
                                               datamodule=tiny_datamodule(group_size=1))


def test_minibatch_count_is_checked_before_training(tmp_path):
    module = PPO(model_name_or_path="embedded:random", num_minibatches=3)
    recorder = RecordRollouts()
    with pytest.raises(ValueError, match=r"num_minibatches=3 does not divide the 16 rows"):
        tiny_trainer(tmp_path, max_steps=1, callbacks=[recorder]).fit(module, datamodule=tiny_datamodule())
    assert recorder.rewards == []  # refused before the first rollout


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_ppo_trains_policy_and_critic(critic, tmp_path, recorder):
    module = PPO(model_name_or_path="embedded:arithmetic", critic=critic, num_iterations=2, num_minibatches=2,
                 critic_lr=1e-2, entropy_coef=0.01, optimizer=_adamw(1e-3))
    policy_before, critic_before = _snapshot(module.policy), _snapshot(module.critic)
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[recorder])
    trainer.fit(module, datamodule=tiny_datamodule())
    assert trainer.global_step == 2
    assert any(not torch.equal(policy_before[k], v) for k, v in _snapshot(module.policy).items())
    assert any(not torch.equal(critic_before[k], v) for k, v in _snapshot(module.critic).items())
    metrics = recorder.metrics[-1]
    for name in ("train/value_loss", "train/explained_variance", "train/clip_fraction", "train/approx_kl",
                 "train/policy_loss", "train/entropy_bonus"):
        assert name in metrics, name
    bound = decoder_logprob_bound(module.policy, 1.0, module.policy.config.max_position_embeddings)
    assert recorder.metrics[0]["train/sampler_logp_diff"] <= bound  # on-policy: float32 rounding
    lrs = [group["lr"] for group in trainer.optimizers[0].param_groups]
    assert lrs == [1e-3, 1e-2]  # separate actor and critic learning rates


def test_ppo_value_head_starts_at_zero_so_first_advantages_are_whitened_returns():
    module = PPO(model_name_or_path="embedded:random", whiten_advantages=False, lam=1.0)
    batch = _batch([1.0, 0.0], 1)
    adv = module.compute_advantages(batch)
    # V ≡ 0 at init, γ = λ = 1: every generated token's advantage is the response's return R
    torch.testing.assert_close(adv.advantages, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(adv.returns, adv.advantages)
    torch.testing.assert_close(adv.values, torch.zeros(2, 2))


def test_ppo_rejects_bad_settings():
    with pytest.raises(ValueError, match="lam"):
        PPO(model_name_or_path="embedded:random", lam=1.5)
    with pytest.raises(ValueError, match="critic_lr"):
        PPO(model_name_or_path="embedded:random", critic_lr=0.0)
