"""SAO (Hou et al. 2026, arXiv 2607.07508): the band mask's gradient, skip-observation GAE with the
actor's length-adaptive λ and the critic's λ = 1, and a fit of its config on the multi-turn task with the
asynchronous producer."""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.algorithms import SAO, Advantages, PolicyOutput
from rl_lightning.algorithms.critic import GAE_LAMBDA
from rl_lightning.algorithms.metrics import plain
from rl_lightning.functional import gae
from rl_lightning.rollout import RolloutBatch, Turns
from tests.tolerances import sum_tolerance


def _batch(mask_rows: list[list[int]], obs_rows: list[list[int]] | None = None, rewards=None) -> RolloutBatch:
    """Episodes whose turns are the runs of ``mask_rows``' ones (each turn's reward 0 but the last's: the row's)."""
    mask = torch.tensor(mask_rows)
    n, width = mask.shape
    obs = torch.tensor(obs_rows) if obs_rows is not None else torch.zeros_like(mask)
    prompt = 3
    ids = torch.randint(3, 99, (n, prompt + width), generator=torch.Generator().manual_seed(0))
    attention = torch.cat([torch.ones(n, prompt, dtype=torch.long), (mask.bool() | obs.bool()).long()], dim=1)
    rewards = torch.tensor(rewards if rewards is not None else [1.0] * n)
    starts = mask.bool() & ~torch.cat([torch.zeros(n, 1, dtype=torch.bool), mask.bool()[:, :-1]], dim=1)
    count = starts.sum(dim=1)
    turn_rewards = torch.where(torch.arange(int(count.max())) < count.unsqueeze(1), 0.0, math.nan)
    turn_rewards[torch.arange(n), count - 1] = rewards
    turns = Turns(obs_mask=obs, index=torch.where(mask.bool(), starts.long().cumsum(dim=1) - 1, -1), count=count,
                  rewards=turn_rewards)
    return RolloutBatch(
        input_ids=ids * attention, attention_mask=attention, prompt_length=prompt, loss_mask=mask,
        sampler_logprobs=torch.full((n, width), math.log(0.5)) * mask, rewards=rewards, group_size=1,
        prompt_index=torch.arange(n), truncated=torch.zeros(n, dtype=torch.bool), turns=turns,
    )


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_a_token_outside_the_band_has_exactly_zero_gradient_for_either_sign(advantage):
    module = SAO(model_name_or_path="embedded:random", band_low=0.3, band_high=5.0)
    batch = _batch([[1, 1, 1, 1]])
    # ρ = π / 0.5: 0.3 (outside, below 0.7), 1.2 (inside), 6.4 (outside, above 6.0), 0.68 (just below 0.7)
    pi = torch.tensor([[0.15, 0.6, 3.2, 0.34]])
    logprobs = pi.log().requires_grad_(True)
    ratio = torch.exp((logprobs - batch.sampler_logprobs) * batch.loss_mask)  # as RLModule.policy_loss makes it
    objective, metrics = module.policy_objective(batch, PolicyOutput(logprobs), ratio,
                                                 Advantages(torch.full((1, 4), advantage)))
    (grad,) = torch.autograd.grad(objective.sum(), logprobs)
    assert grad[0, 0] == 0 and grad[0, 2] == 0 and grad[0, 3] == 0
    assert math.isclose(float(grad[0, 1]), advantage * 1.2, rel_tol=1e-6)  # w A with w = ρ: d/dlogπ = ρ A
    assert math.isclose(float(plain(metrics["train/band_fraction"])), 0.25)


def test_skip_observation_gae_ignores_observation_tokens_and_uses_the_length_adaptive_lambda():
    torch.manual_seed(0)
    module = SAO(model_name_or_path="embedded:random", critic="separate", alpha=1.5)
    # one episode of 4 model tokens with observations between its turns, the same 4 tokens without them
    with_obs = _batch([[1, 1, 0, 0, 1, 1]], [[0, 0, 1, 1, 0, 0]], rewards=[1.0])
    with torch.no_grad():  # a critic whose values differ per token, so the recursion matters
        module.critic.head.proj.weight.normal_()
    adv = module.compute_advantages(with_obs)
    advantages, values = adv.advantages, adv.values
    lam = 1 - 1 / (1.5 * 4)
    torch.testing.assert_close(adv.rows[GAE_LAMBDA], torch.tensor([lam]))  # 4 model tokens, not 6 columns
    model = with_obs.loss_mask.bool()
    v = values[model]  # the model tokens' values, in order
    # by hand over the model tokens only: δ_k = r_k + V_{k+1} - V_k with V after the last = 0 and r = R at the last
    r = torch.tensor([0.0, 0.0, 0.0, 1.0])
    nxt = torch.cat([v[1:], torch.zeros(1)])
    delta = r + nxt - v
    want = torch.zeros(4)
    run = torch.zeros(())
    for k in reversed(range(4)):
        run = delta[k] + lam * run
        want[k] = run
    # float32: a 4-step recursion, each step 3 roundings of terms up to |r| + |V_{k+1}| + |V_k| + λ|run|
    magnitude = float(r.abs().sum() + 2 * v.abs().sum() + want.abs().sum())
    torch.testing.assert_close(advantages[model], want, rtol=0, atol=2 * sum_tolerance(3 * 4, magnitude))
    assert (advantages[~model] == 0).all()
    assert (adv.returns[model] == 1.0).all()  # critic λ = 1, γ = 1: the outcome at every model token
    # the same recursion as gae() over the mask on values we give it
    again, _ = gae(torch.tensor([[0.0, 0, 0, 0, 0, 1]]), values, with_obs.loss_mask, 1.0, torch.tensor([lam]))
    torch.testing.assert_close(advantages, again)


def test_the_sao_config_trains_asynchronously_on_the_multi_turn_task(tmp_path):
    from rl_lightning.cli import build_cli

    cli = build_cli(["--config", "configs/sao.yaml", "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
                     "--data.init_args.prompts_per_step", "8", "--trainer.logger", "false",
                     "--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(tmp_path),
                     "--trainer.callbacks", '[{"class_path": "rl_lightning.callbacks.CriticWarmup", '
                     '"init_args": {"steps": 1}}]'], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 3
    assert cli.datamodule.async_rollout.queue == 2 and cli.datamodule._producer is not None
    assert cli.model.critic_learner.updates == 2 and cli.datamodule.group_size == 1
