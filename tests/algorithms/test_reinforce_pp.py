"""REINFORCE++ and REINFORCE++-baseline (Hu 2025, arXiv 2501.03262) on hand-computed numbers: the KL in the reward,
the global token normalisation, the group-mean baseline, with negative controls that tell it apart from GRPO."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rl_lightning.algorithms import GRPO, ReinforcePP
from rl_lightning.functional import kl_penalized_returns, masked_whiten, token_moments
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.tolerances import decoder_logprob_bound


def test_kl_penalized_returns_sum_the_kl_to_the_end():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, -0.5, 9.0]])
    ref = torch.tensor([[-1.5, -2.0, -1.0], [-1.0, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    got = kl_penalized_returns(torch.tensor([1.0, 0.0]), old, ref, mask, 0.1)
    # row 0: KL = [0.5, 1.0, 0] -> to-go [1.5, 1.0, 0]; row 1: KL = [0.5, 0, (padding: ignored)] -> [0.5, 0, 0]
    torch.testing.assert_close(got, torch.tensor([[0.85, 0.9, 1.0], [-0.05, 0.0, 0.0]]))
    torch.testing.assert_close(kl_penalized_returns(torch.tensor([1.0, 0.0]), old, ref, mask, 0.0),
                               torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))  # beta 0: R on every token


def test_token_normalisation_is_over_every_token_with_the_population_variance():
    adv = torch.tensor([[1.0, 3.0], [2.0, 9.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    scale = 1 / math.sqrt(2 / 3)  # tokens 1, 3, 2: mean 2, population variance 2/3; the padded 9 is ignored
    torch.testing.assert_close(masked_whiten(adv, mask), torch.tensor([[-scale, scale], [0.0, 0.0]]))
    # the moments of two halves summed (two ranks) give the one-process result
    halves = token_moments(adv[:1], mask[:1]) + token_moments(adv[1:], mask[1:])
    torch.testing.assert_close(masked_whiten(adv[1:], mask[1:], moments=halves), torch.tensor([[0.0, 0.0]]))
    torch.testing.assert_close(masked_whiten(adv[:1], mask[:1], moments=halves), torch.tensor([[-scale, scale]]))
    assert masked_whiten(torch.ones(2, 2), mask).abs().sum() == 0  # no spread: 0, not NaN
    assert masked_whiten(adv, torch.zeros(2, 2)).abs().sum() == 0  # no token: 0


def _batch(rewards: list[float], group_size: int) -> SimpleNamespace:
    n = len(rewards)
    return SimpleNamespace(rewards=torch.tensor(rewards), group_size=group_size, loss_mask=torch.ones(n, 1),
                           sampler_logprobs=torch.full((n, 1), -1.0))


def test_the_baseline_variant_normalises_over_the_batch_where_grpo_normalises_each_group():
    """Groups [1, 0, 0, 0] and [1, 1, 1, 0], one token each. REINFORCE++-baseline: R - mean = [.75, -.25 x 3,
    .25 x 3, -.75], then over all 8 tokens (mean 0, population std sqrt(0.1875)). Negative control: GRPO scales each
    group by its own std, so its two correct-and-lonely rows get +-sqrt(3), where REINFORCE++-baseline's get
    +-0.75 / sqrt(0.1875) = +-sqrt(3) too, but its majority rows get +-0.25 / sqrt(0.1875), not GRPO's 1/sqrt(3)."""
    batch = _batch([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], 4)
    module = ReinforcePP(model_name_or_path="embedded:random", kl_coef=0.0, baseline="group_mean")
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75])
    want = (centred / math.sqrt(0.1875)).unsqueeze(-1)
    torch.testing.assert_close(module.compute_advantages(batch), want)
    grpo = GRPO(model_name_or_path="embedded:random").compute_advantages(batch)
    assert grpo[1].item() == pytest.approx(-1 / math.sqrt(3), rel=1e-5)
    assert module.compute_advantages(batch)[1].item() == pytest.approx(-0.25 / math.sqrt(0.1875), rel=1e-5)
    # without the baseline: the raw rewards normalised over the batch (mean 0.5, std 0.5): +-1
    plain = ReinforcePP(model_name_or_path="embedded:random", kl_coef=0.0)
    torch.testing.assert_close(plain.compute_advantages(batch), (2 * batch.rewards - 1).unsqueeze(-1))


def test_settings_are_validated_and_the_baseline_needs_groups(tmp_path):
    for bad in ({"kl_coef": -1.0}, {"baseline": "ema"}, {"norm_eps": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ReinforcePP(model_name_or_path="embedded:random", **bad)
    module = ReinforcePP(model_name_or_path="embedded:arithmetic", baseline="group_mean")
    with pytest.raises(ValueError, match="group_size"):
        tiny_trainer(tmp_path, max_steps=1).fit(module, datamodule=tiny_datamodule(group_size=1))


def test_training_puts_the_kl_to_the_starting_policy_in_the_reward(tmp_path, recorder):
    """Step 1 samples from the starting policy (KL 0 up to float32 rounding: the reference is its copy); after an
    update the sampler has moved, so the KL in the reward is no longer 0, and the frozen reference is not a
    checkpointed submodule."""
    module = ReinforcePP(model_name_or_path="embedded:arithmetic", kl_coef=0.1,
                         optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    tiny_trainer(tmp_path, max_steps=3, callbacks=[recorder]).fit(module, datamodule=tiny_datamodule(group_size=1))
    kls = [m["train/reward_kl"] for m in recorder.metrics]
    bound = float(decoder_logprob_bound(module.policy, 1.0, module.policy.config.max_position_embeddings))
    assert abs(kls[0]) <= bound and any(abs(k) > 10 * bound for k in kls[1:]), (kls, bound)
    assert not any(k.startswith("_reference") for k in module.state_dict())
