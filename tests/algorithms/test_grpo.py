"""GRPO end to end on CPU: it trains, refuses bad settings, and never writes NaN into the weights."""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.algorithms import GRPO, NonFiniteLossError
from rl_lightning.callbacks import KLRegularizer
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.helpers.ddp_run import GradedMatch
from tests.tolerances import decoder_gradient_tolerance, decoder_logprob_bound, unit_roundoff


def _params(module: GRPO) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


def test_two_steps_change_the_weights_and_log_the_fixed_metrics(tmp_path, recorder):
    module = GRPO(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    before = _params(module)
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[recorder])
    trainer.fit(module, datamodule=tiny_datamodule())
    assert trainer.global_step == 2
    after = _params(module)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    names = set(recorder.metrics[-1])
    for name in ("train/reward", "train/reward_std", "train/zero_std_fraction", "train/response_length",
                 "train/truncation_rate", "train/entropy", "train/clip_fraction", "train/clip_fraction_low",
                 "train/clip_fraction_high", "train/sampler_logp_diff", "train/grad_norm", "train/approx_kl",
                 "train/policy_loss", "train/loss", "perf/step_time", "perf/rollout_time", "perf/tokens_per_sec"):
        assert name in names, name
    # GRPO's one loss term is the policy loss (no KL callback here): the same summed value
    assert all(m["train/policy_loss"] == m["train/loss"] for m in recorder.metrics)
    # On-policy, before the first update, the learner reproduces the sampler's log-probs (float32 rounding)
    assert recorder.metrics[0]["train/sampler_logp_diff"] <= decoder_logprob_bound(
        module.policy, 1.0, module.policy.config.max_position_embeddings)
    assert len(recorder.rewards[0]) == 16  # 4 prompts x G=4


def test_group_size_one_is_refused_before_training(tmp_path):
    module = GRPO(model_name_or_path="embedded:random")
    trainer = tiny_trainer(tmp_path, max_steps=1)
    with pytest.raises(ValueError, match="group_size >= 2"):
        trainer.fit(module, datamodule=tiny_datamodule(group_size=1))


class _NaNGRPO(GRPO):
    def policy_loss(self, batch, out, adv, weights):  # noqa: ANN001
        loss, stats = super().policy_loss(batch, out, adv, weights)
        if self.global_step == 1:
            loss = loss * float("nan")
        return loss, stats


def test_nan_loss_stops_with_the_step_and_leaves_weights_finite(tmp_path):
    module = _NaNGRPO(model_name_or_path="embedded:random")
    trainer = tiny_trainer(tmp_path, max_steps=3)
    with pytest.raises(NonFiniteLossError, match="at step 1"):
        trainer.fit(module, datamodule=tiny_datamodule())
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())


def _one_step_weights(tmp_path, **module_kwargs) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
                  max_grad_norm=None, **module_kwargs)
    # a dense reward: groups do not tie, so the update is not zero (with exact-match rewards this rollout is all 0)
    tiny_trainer(tmp_path, max_steps=1).fit(module, datamodule=tiny_datamodule(temperature=1.5,
                                                                                reward_fn=GradedMatch()))
    return _params(module)


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean"])
def test_micro_batching_does_not_change_the_update(tmp_path, aggregation):
    full = _one_step_weights(tmp_path, loss_aggregation=aggregation)
    split = _one_step_weights(tmp_path, loss_aggregation=aggregation, micro_batch_size=3)  # 16 rows -> 3+3+3+3+3+1
    # SGD(lr = 1): the weights moved by the gradient, whose two computations (other micro-batch shapes) differ by
    # decoder_gradient_tolerance of max|g| (16 rows of at most the 64 positions); plus the step's own rounding
    torch.manual_seed(0)
    start = _params(GRPO(model_name_or_path="embedded:arithmetic"))
    config = GRPO(model_name_or_path="embedded:arithmetic").policy.config
    scale = max(float((full[k] - start[k]).abs().max()) for k in full)
    assert scale > 0
    atol = float(decoder_gradient_tolerance(config, config.max_position_embeddings,
                                            16 * config.max_position_embeddings, scale))
    for k in full:
        torch.testing.assert_close(split[k], full[k], atol=atol, rtol=2 * unit_roundoff())


def test_kl_reference_is_only_created_when_beta_is_positive(tmp_path, recorder):
    off = KLRegularizer(beta=0.0)
    tiny_trainer(tmp_path, max_steps=1, callbacks=[off]).fit(GRPO(model_name_or_path="embedded:random"),
                                                             datamodule=tiny_datamodule())
    assert off.reference is None

    on = KLRegularizer(beta=0.1, estimator="k3")
    module = GRPO(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    tiny_trainer(tmp_path, max_steps=3, callbacks=[on, recorder]).fit(module, datamodule=tiny_datamodule())
    assert on.reference is not None
    assert all(not p.requires_grad for p in on.reference.parameters())
    kls = [m["train/kl"] for m in recorder.metrics]
    # the policy equals its reference before the first update: their float32 log-probs are within δ, and k3 of a
    # log-ratio x with |x| <= δ is at most e^δ - 1 - δ
    delta = decoder_logprob_bound(module.policy, 1.0, module.policy.config.max_position_embeddings)
    assert abs(kls[0]) <= math.expm1(delta) - delta
    assert kls[-1] > math.expm1(delta) - delta  # and drifts from it after updates at a large learning rate


def test_lagged_sampler_makes_the_mismatch_real(tmp_path, recorder):
    module = GRPO(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    tiny_trainer(tmp_path, max_steps=3, callbacks=[recorder]).fit(
        module, datamodule=tiny_datamodule(sync_interval=2)
    )
    diffs = [m["train/sampler_logp_diff"] for m in recorder.metrics]
    delta = decoder_logprob_bound(module.policy, 1.0, module.policy.config.max_position_embeddings)  # float32 rounding
    assert diffs[0] <= delta  # step 0: the copy was just taken
    assert diffs[1] > delta  # step 1: the copy is one update behind the learner
    assert diffs[2] <= delta  # step 2: refreshed


def test_clip_bounds_are_validated():
    with pytest.raises(ValueError, match="clip_eps_low"):
        GRPO(model_name_or_path="embedded:random", clip_eps_low=1.5)


def test_sub_batching_is_validated(tmp_path):
    module = GRPO(model_name_or_path="embedded:random", num_minibatches=3)
    with pytest.raises(ValueError, match="num_minibatches=3"):
        tiny_trainer(tmp_path, max_steps=1).fit(module, datamodule=tiny_datamodule())



def test_several_iterations_and_minibatches_count_one_step_per_rollout(tmp_path, recorder):
    module = GRPO(model_name_or_path="embedded:arithmetic", num_iterations=2, num_minibatches=2,
                  optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    before = _params(module)
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[recorder])
    trainer.fit(module, datamodule=tiny_datamodule())
    assert trainer.global_step == 2  # 2 rollouts x (2 iterations x 2 minibatches) optimiser steps
    assert len(recorder.metrics) == 2
    assert any(not torch.equal(before[k], v) for k, v in _params(module).items())
    # Later minibatches are scored after earlier updates: the policy moved away from π_old within a step.
    assert recorder.metrics[0]["train/approx_kl"] > 0
    # measured before the first update only: on-policy, float32 rounding
    bound = decoder_logprob_bound(module.policy, 1.0, module.policy.config.max_position_embeddings)
    assert recorder.metrics[0]["train/sampler_logp_diff"] <= bound


def test_dr_grpo_config_is_grpo_without_the_std_and_length_normalisers(tmp_path):
    """configs/dr_grpo.yaml (Liu et al. 2025, arXiv 2503.20783): A = R - mean over the group (no std division) and
    every token weighs 1/(N L) with L = loss_norm_length = data.sampling.max_new_tokens. Negative control: the
    shipped GRPO divides by the std (advantages +-1 on this group) and weighs a 1-token response's token 1/N."""
    from pathlib import Path
    from types import SimpleNamespace

    from rl_lightning.cli import build_cli

    repo = Path(__file__).resolve().parents[2]
    cli = build_cli(["--config", str(repo / "configs" / "dr_grpo.yaml"), f"--trainer.default_root_dir={tmp_path}"],
                    run=False)
    module, data = cli.model, cli.datamodule
    assert type(module) is GRPO and module.loss_norm_length == data.sampling.max_new_tokens == 6
    rewards = SimpleNamespace(rewards=torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4)
    torch.testing.assert_close(module.compute_advantages(rewards), torch.tensor([0.75, -0.25, -0.25, -0.25]))
    grpo = GRPO(model_name_or_path="embedded:arithmetic")
    assert grpo.compute_advantages(rewards)[0].item() == pytest.approx(math.sqrt(3), rel=1e-5)  # 0.75 / sqrt(0.1875)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    batch = SimpleNamespace(loss_mask=mask, num_rows=2)
    torch.testing.assert_close(module.loss_weights(batch), mask / 12)  # 1 / (N L) = 1 / (2 * 6)
    assert grpo.loss_weights(batch)[1, 0].item() == pytest.approx(0.5)  # seq_mean_token_mean: 1 / (N T_1)
    with pytest.raises(ValueError, match="loss_norm_length"):
        GRPO(model_name_or_path="embedded:arithmetic", loss_aggregation="seq_mean_token_sum_norm")


def test_dapo_config_is_grpo_with_clip_higher_token_mean_dynamic_sampling_and_the_overlong_penalty(tmp_path):
    """configs/dapo.yaml (Yu et al. 2025, arXiv 2503.14476): GRPO's class with its four pieces set, each checked."""
    from pathlib import Path

    from rl_lightning.cli import build_cli
    from rl_lightning.rollout import OverlongPenalty, RewardSpread

    repo = Path(__file__).resolve().parents[2]
    cli = build_cli(["--config", str(repo / "configs" / "dapo.yaml"), f"--trainer.default_root_dir={tmp_path}"],
                    run=False)
    module, data = cli.model, cli.datamodule
    assert type(module) is GRPO and (module.clip_eps_low, module.clip_eps_high) == (0.2, 0.28)
    assert module.loss_aggregation == "token_mean" and module.scale_rewards
    assert isinstance(data.group_filter, RewardSpread) and data.max_rounds == 3
    (shaper,) = data.reward_shapers
    assert isinstance(shaper, OverlongPenalty) and (shaper.cache_tokens, shaper.max_tokens) == (2, 6)
