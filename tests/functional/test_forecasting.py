"""CoPE's forecasting pieces (no public paper: docs/algorithms.md, CoPE): success weights, (history, action chunk)
pairs, the weighted NLL."""

from __future__ import annotations

import pytest
import torch

from rl_lightning.functional import forecast_loss, forecast_pairs, forecast_weights

PAD, BOS, EOS = 0, 1, 2
I1, I2 = 90, 91  # the forecast instruction's ids


def test_weights_are_success_over_max_1_successes_over_prompts():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0])  # G = 3: |S| = 2, 0, 1 (0.5 < 1)
    w = forecast_weights(rewards, 3, threshold=1.0)
    expected = torch.tensor([1 / 2, 1 / 2, 0, 0, 0, 0, 1, 0, 0]) / 3  # / max(1, |S_x|), then / X = 3 prompts
    assert torch.equal(w, expected)
    assert (w[3:6] == 0).all()  # the zero-success group: exactly 0
    assert torch.equal(forecast_weights(rewards, 3, threshold=0.5)[6:], torch.tensor([1 / 2, 1 / 2, 0]) / 3)  # >=
    assert torch.equal(forecast_weights(rewards, 3, threshold=1.0, num_prompts=6), expected / 2)  # a global X


def test_weights_refuse_bad_shapes():
    with pytest.raises(ValueError, match="group_size=4"):
        forecast_weights(torch.zeros(6), 4, threshold=1.0)
    with pytest.raises(ValueError, match="shape"):
        forecast_weights(torch.zeros(2, 3), 3, threshold=1.0)


def _row():
    """A left-padded prompt ``<bos> 10 11`` and the episode ``a0 o1 a1 o2 a2`` (then right padding)."""
    prompt = [PAD, PAD, BOS, 10, 11]
    a0, o1, a1, o2, a2 = [20, 21, EOS], [30, 31], [22, EOS], [32], [23, 24, EOS]
    response = a0 + o1 + a1 + o2 + a2 + [PAD, PAD]
    ids = torch.tensor(prompt + response)
    attention = torch.tensor([0, 0, 1, 1, 1] + [1] * 11 + [0, 0])
    loss_mask = torch.tensor([1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 0])
    turn_index = torch.tensor([0, 0, 0, -1, -1, 1, 1, -1, 2, 2, 2, -1, -1])
    return ids, attention, len(prompt), loss_mask, turn_index, (a0, o1, a1, o2, a2)


def test_pairs_are_the_history_then_the_instruction_and_the_next_k_recorded_actions():
    ids, attention, p, loss_mask, turns, (a0, o1, a1, o2, a2) = _row()
    pairs = forecast_pairs(ids, attention, p, loss_mask, turns, [I1, I2], horizon=2)
    h0 = [BOS, 10, 11]
    assert pairs == [
        (h0 + [I1, I2], a0 + a1),
        (h0 + a0 + o1 + [I1, I2], a1 + a2),
        (h0 + a0 + o1 + a1 + o2 + [I1, I2], a2),  # truncated at the episode's end: a 1-action chunk
    ]
    single = forecast_pairs(ids, attention, p, loss_mask, turns, [I1], horizon=1)
    assert [target for _, target in single] == [a0, a1, a2]
    long = forecast_pairs(ids, attention, p, loss_mask, turns, [I1], horizon=5)
    assert [target for _, target in long] == [a0 + a1 + a2, a1 + a2, a2]
    first = forecast_pairs(ids, attention, p, loss_mask, turns, [I1, I2], horizon=2, instruction_first=True)
    assert first == [([I1, I2] + context[:-2], target) for context, target in pairs]  # the instruction leads


def test_a_single_turn_response_is_one_action():
    ids = torch.tensor([PAD, BOS, 10, 40, 41, EOS, PAD])
    attention = torch.tensor([0, 1, 1, 1, 1, 1, 0])
    loss_mask = torch.tensor([1, 1, 1, 0])
    assert forecast_pairs(ids, attention, 3, loss_mask, None, [I1], horizon=2) == [([BOS, 10, I1], [40, 41, EOS])]
    empty = forecast_pairs(ids, attention, 3, torch.zeros(4, dtype=torch.long), None, [I1], horizon=2)
    assert empty == []  # no action, no forecast
    with pytest.raises(ValueError, match="horizon"):
        forecast_pairs(ids, attention, 3, loss_mask, None, [I1], horizon=0)


def test_loss_is_the_weighted_nll_and_zero_weights_give_zero_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -7.0], [-0.5, -9.0, -9.0], [-3.0, -4.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 0]])
    weights = torch.tensor([0.5, 2.0, 0.0])
    loss = forecast_loss(logprobs, mask, weights)
    assert loss.item() == 0.5 * 3.0 + 2.0 * 0.5  # masked entries and the weight-0 pair add nothing
    loss.backward()
    assert torch.equal(logprobs.grad, -weights[:, None] * mask)
    assert (logprobs.grad[2] == 0).all()


def test_two_successes_give_the_mean_of_their_nll_sums_over_the_prompts():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0])  # prompt 0: |S| = 2 (rows 0, 2); prompt 1: none
    w = forecast_weights(rewards, 3, threshold=1.0)
    # rows 0 and 2 have 2 and 1 actions; per pair the NLL is the sum of its target's -log p
    logprobs = torch.tensor([[-1.0, -1.0], [-2.0, 0.0], [-0.25, -0.5]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    owners = torch.tensor([0, 0, 2])
    nll_0, nll_2 = 2.0 + 2.0, 0.75
    assert forecast_loss(logprobs, mask, w[owners]).item() == (nll_0 + nll_2) / 2 / 2  # mean over S, then E_x
