"""GSPO and CISPO on hand-computed numbers, each with a negative control that tells it apart from GRPO, and the
functional helpers they use (sequence_log_ratio, clipped_is_weight)."""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.algorithms import CISPO, GRPO, GSPO
from rl_lightning.algorithms.advantages import Advantages
from rl_lightning.algorithms.forward import PolicyOutput
from rl_lightning.functional import clipped_is_weight, sequence_log_ratio
from rl_lightning.rollout import RolloutBatch


def test_sequence_log_ratio_is_the_mean_token_log_ratio_over_the_mask():
    logp = torch.log(torch.tensor([[2.0, 0.5, 7.0], [1.1, 1.2, 1.3], [5.0, 5.0, 5.0]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    got = sequence_log_ratio(logp, torch.zeros(3, 3), mask)
    # row 0: (log 2 + log 0.5) / 2 = 0 (the padded 7 is ignored); row 1: log(1.1 * 1.2 * 1.3) / 3; row 2: empty -> 0
    assert got[0].abs() < 1e-7 and got[2] == 0
    assert got[1] == pytest.approx(math.log(1.1 * 1.2 * 1.3) / 3, abs=1e-6)


def test_clipped_is_weight_on_numbers_and_detached():
    ratio = torch.tensor([0.05, 0.7, 1.0, 3.0, 9.0], requires_grad=True)
    assert clipped_is_weight(ratio, None, 4.0).tolist() == pytest.approx([0.05, 0.7, 1.0, 3.0, 5.0])
    assert clipped_is_weight(ratio, 0.2, 0.28).tolist() == pytest.approx([0.8, 0.8, 1.0, 1.28, 1.28])
    assert not clipped_is_weight(ratio, None, 4.0).requires_grad


def _batch(sampler: list[list[float]], mask: list[list[float]]) -> RolloutBatch:
    n, width = len(sampler), len(sampler[0])
    loss_mask = torch.tensor(mask)
    return RolloutBatch(input_ids=torch.ones(n, 2 + width, dtype=torch.long),
                        attention_mask=torch.ones(n, 2 + width, dtype=torch.long), prompt_length=2,
                        loss_mask=loss_mask.long(), sampler_logprobs=torch.tensor(sampler), rewards=torch.zeros(n),
                        group_size=2, prompt_index=torch.zeros(n, dtype=torch.long),
                        truncated=torch.zeros(n, dtype=torch.bool))


def _objective_and_grad(module, batch, logp, advantages, per_response: bool = False):
    """The objective, and the gradient of its sum over tokens (``per_response``: each row's token mean, the weights
    GSPO's ``seq_mean_token_mean`` gives up to 1/N)."""
    logp = logp.clone().requires_grad_(True)
    out = PolicyOutput(logprobs=logp * batch.loss_mask)
    ratio = torch.exp((out.logprobs - batch.sampler_logprobs) * batch.loss_mask)
    objective, metrics = module.policy_objective(batch, out, ratio, Advantages(advantages))
    weights = batch.loss_mask / batch.loss_mask.sum(dim=1, keepdim=True) if per_response else batch.loss_mask
    (objective * weights).sum().backward()
    return objective.detach(), logp.grad, metrics


def test_gspo_clips_whole_responses_by_their_geometric_mean_ratio_where_grpo_clips_tokens():
    gspo, grpo = (cls(model_name_or_path="embedded:random") for cls in (GSPO, GRPO))
    sampler = [[math.log(0.25), math.log(0.5)], [math.log(0.5), math.log(0.5)]]
    batch = _batch(sampler, [[1.0, 1.0], [1.0, 1.0]])
    # row 0: token ratios 2 and 0.5 -> s = 1 (inside any range); row 1: both 1.0005 -> s = 1.0005 > 1 + 4e-4
    logp = torch.tensor([[math.log(0.5), math.log(0.25)], [math.log(0.5 * 1.0005), math.log(0.5 * 1.0005)]])
    adv = torch.tensor([[1.0], [1.0]])
    objective, grad, _ = _objective_and_grad(gspo, batch, logp, adv, per_response=True)
    # row 0: s A = 1 on both tokens; d/dlogp_t of s A = A s / |y| = 0.5 for each token
    assert objective[0].tolist() == pytest.approx([1.0, 1.0], abs=1e-6)
    assert grad[0].tolist() == pytest.approx([0.5, 0.5], abs=1e-6)
    # row 1: clipped at 1 + 4e-4 with A > 0: the value is the bound and the whole response gets no gradient
    assert objective[1].tolist() == pytest.approx([1.0004, 1.0004], abs=1e-6)
    assert grad[1].tolist() == [0.0, 0.0]
    # negative control: GRPO clips row 0's first token (ratio 2 > 1.2 with A > 0) and keeps row 1's (1.0005 < 1.2)
    _, grpo_grad, _ = _objective_and_grad(grpo, batch, logp, adv)
    assert grpo_grad[0, 0] == 0.0 and grpo_grad[0, 1] == pytest.approx(0.5, abs=1e-6)  # d(rho A)/dlogp = rho = 0.5
    assert grpo_grad[1].tolist() == pytest.approx([1.0005, 1.0005], abs=1e-6)


def test_cispo_keeps_the_gradient_of_tokens_whose_weight_is_clipped():
    cispo, grpo = CISPO(model_name_or_path="embedded:random"), GRPO(model_name_or_path="embedded:random")
    batch = _batch([[math.log(0.1), math.log(0.5)], [math.log(0.5), math.log(0.5)]], [[1.0, 1.0], [1.0, 0.0]])
    # token ratios: row 0 -> 9 (clipped to 5) and 1; row 1 -> 0.1 (no floor) and padding
    logp = torch.tensor([[math.log(0.9), math.log(0.5)], [math.log(0.05), 0.0]])
    adv = torch.tensor([[2.0], [-1.0]])
    objective, grad, metrics = _objective_and_grad(cispo, batch, logp, adv)
    # the objective is sg(r) A log pi; its gradient r A: 5 * 2, 1 * 2 and 0.1 * -1 (the padded token none)
    assert grad.tolist() == [pytest.approx([10.0, 2.0], abs=1e-5), pytest.approx([-0.1, 0.0], abs=1e-6)]
    assert objective[0, 0] == pytest.approx(5.0 * 2.0 * math.log(0.9), abs=1e-5)
    assert float(metrics["train/is_weight_clip_fraction"].value) == pytest.approx(1 / 3)  # 1 of 3 real tokens
    # negative control: GRPO's clip zeroes the gradient of the token whose ratio is 9 (A > 0)
    _, grpo_grad, _ = _objective_and_grad(grpo, batch, logp, adv)
    assert grpo_grad[0, 0] == 0.0 and grpo_grad[0, 1] == pytest.approx(2.0, abs=1e-6)


def test_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="GSPO: loss_aggregation must be seq_mean_token_mean"):
        GSPO(model_name_or_path="embedded:random", loss_aggregation="token_mean")
    with pytest.raises(ValueError, match="CISPO: is_eps_high must be >= 0"):
        CISPO(model_name_or_path="embedded:random", is_eps_high=-1.0)
    assert CISPO(model_name_or_path="embedded:random", is_eps_low=1.0).is_eps_low == 1.0  # a floor at 0: allowed
