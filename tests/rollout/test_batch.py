"""``RolloutBatch``: shape validation naming the field, ``select`` and group structure, ``to()``; its ``Turns``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import Tensor

from rl_lightning.envs import Prompt
from rl_lightning.rollout import PromptBatch, RolloutBatch, SamplerRecord, Turns

N, P, T, G = 6, 3, 4, 2


def _fields(**overrides):
    g = torch.Generator().manual_seed(0)
    fields = dict(
        input_ids=torch.arange(N * (P + T)).reshape(N, P + T),
        attention_mask=torch.ones(N, P + T, dtype=torch.long),
        prompt_length=P,
        loss_mask=torch.ones(N, T, dtype=torch.long),
        sampler_logprobs=-torch.rand(N, T, generator=g),
        rewards=torch.arange(N, dtype=torch.float32),
        group_size=G,
        prompt_index=torch.arange(N) // G + 100,
        truncated=torch.tensor([True, False] * (N // 2)),
        temperature=0.7,
        top_p=0.9,
        prompts=[Prompt(f"p{i // G}", str(i // G)) for i in range(N)],
        responses=[f"r{i}" for i in range(N)],
        ref_logprobs=-torch.rand(N, T, generator=g),
        topk_ids=torch.randint(0, 9, (N, T, 3), generator=g),
        topk_logprobs=-torch.rand(N, T, 3, generator=g),
        aux_ids=torch.randint(0, 9, (N, T, 2), generator=g),
        turns=Turns(obs_mask=torch.randint(0, 2, (N, T), generator=g), index=torch.randint(-1, 2, (N, T), generator=g),
                    count=torch.arange(N) % 3 + 1, rewards=torch.rand(N, 3, generator=g)),
    )
    fields.update(overrides)
    return fields


RECORD = ("topk_ids", "topk_logprobs", "aux_ids")


def _batch(**overrides) -> RolloutBatch:
    """The batch of ``_fields``; ``topk_ids``, ``topk_logprobs`` and ``aux_ids`` go into its ``record``."""
    fields = _fields(**overrides)
    record = SamplerRecord(**{name: fields.pop(name) for name in RECORD})
    return RolloutBatch(**fields, record=record)


def test_valid_batch_and_properties():
    b = _batch(loss_mask=torch.tensor([[1, 1, 0, 0]] * N))
    assert b.num_rows == N
    assert torch.equal(b.response_ids, b.input_ids[:, P:])
    assert b.response_lengths.tolist() == [2] * N
    minimal = _batch(turns=None, ref_logprobs=None, topk_ids=None, topk_logprobs=None, aux_ids=None)
    assert minimal.turns is None


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("attention_mask", torch.ones(N, P + T + 1)),
        ("attention_mask", torch.ones(N - 1, P + T)),
        ("loss_mask", torch.ones(N, T - 1)),
        ("loss_mask", torch.ones(N, P + T)),
        ("sampler_logprobs", torch.zeros(N, T + 1)),
        ("rewards", torch.zeros(N + 1)),
        ("rewards", torch.zeros(N, 1)),
        ("prompt_index", torch.zeros(N - 2, dtype=torch.long)),
        ("truncated", torch.zeros(1, dtype=torch.bool)),
        ("ref_logprobs", torch.zeros(N, 1)),
    ],
)
def test_shape_validation_names_the_field(name, bad):
    with pytest.raises(ValueError, match=f"RolloutBatch.{name} has shape"):
        _batch(**{name: bad})


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("topk_ids", torch.zeros(N - 1, T, 3, dtype=torch.long)),
        ("topk_logprobs", torch.zeros(N, T + 1, 3)),
        ("aux_ids", torch.zeros(N, T - 1, 2, dtype=torch.long)),
    ],
)
def test_shape_validation_of_per_token_extras(name, bad):
    """The documented ``[N, T, k]`` / ``[N, T, K]`` fields are row tensors too (sliced by ``select``)."""
    with pytest.raises(ValueError, match=name):
        _batch(**{name: bad})


def test_prompt_length_beyond_width_is_rejected():
    with pytest.raises(ValueError):
        _batch(prompt_length=P + T + 1)


@pytest.mark.parametrize("group_size", [4, 5, 0])
def test_group_size_must_divide_rows(group_size):
    with pytest.raises(ValueError, match="group_size"):
        _batch(group_size=group_size)


def _assert_rows(sub: RolloutBatch, full: RolloutBatch, rows: list[int]) -> None:
    idx = torch.tensor(rows)
    for f in ("input_ids", "attention_mask", "loss_mask", "sampler_logprobs", "rewards", "prompt_index",
              "truncated", "ref_logprobs"):
        assert torch.equal(getattr(sub, f), getattr(full, f)[idx]), f
    for f, value in full.turns.tensors().items():
        assert torch.equal(getattr(sub.turns, f), value[idx]), f
    assert set(sub.record.tensors()) == set(RECORD)
    for f in RECORD:
        assert torch.equal(getattr(sub.record, f), getattr(full.record, f)[idx]), f
    assert sub.prompts == [full.prompts[i] for i in rows]
    assert sub.responses == [full.responses[i] for i in rows]
    assert (sub.prompt_length, sub.temperature, sub.top_p) == (full.prompt_length, full.temperature, full.top_p)


@pytest.mark.parametrize(
    ("rows", "group_size"),
    [
        ([2, 3], G),            # one whole group
        ([4, 5, 0, 1], G),      # whole groups, reordered
        ([0, 1, 2, 3, 4, 5], G),
        ([0, 2], 1),            # one row from each of two groups
        ([1, 2], 1),            # contiguous but straddling a group boundary
        ([3, 2], 1),            # a whole group, rows swapped: not contiguous in order
        ([0, 1, 2], 1),         # a group and a half
        ([5], 1),
    ],
)
def test_select_keeps_rows_and_group_size_only_for_whole_groups(rows, group_size):
    full = _batch()
    sub = full.select(torch.tensor(rows))
    assert sub.num_rows == len(rows)
    assert sub.group_size == group_size
    _assert_rows(sub, full, rows)


def test_select_without_optional_fields_and_texts():
    full = _batch(turns=None, topk_ids=None, topk_logprobs=None, aux_ids=None, ref_logprobs=None,
                  prompts=[], responses=[])
    sub = full.select(torch.tensor([1, 4]))
    assert sub.turns is None and sub.record.tensors() == {} and sub.prompts == [] and sub.responses == []
    assert sub.rewards.tolist() == [1.0, 4.0]


def test_to_moves_every_tensor():
    full = _batch()
    moved = full.to("meta")
    tensor_fields = [f.name for f in dataclasses.fields(RolloutBatch) if isinstance(getattr(full, f.name), Tensor)]
    assert len(tensor_fields) >= 8
    pairs = [(name, getattr(moved, name), getattr(full, name)) for name in tensor_fields]
    pairs += [(f"record.{name}", getattr(moved.record, name), value) for name, value in full.record.tensors().items()]
    pairs += [(f"turns.{name}", getattr(moved.turns, name), value) for name, value in full.turns.tensors().items()]
    assert len(pairs) >= 15
    for name, value, original in pairs:
        assert value.device.type == "meta", name
        assert value.dtype == original.dtype and value.shape == original.shape, name
        assert original.device.type == "cpu", name  # the original is untouched
    assert moved.prompts == full.prompts and moved.responses == full.responses
    assert (moved.group_size, moved.prompt_length, moved.temperature) == (G, P, 0.7)
    partial = _batch(turns=None, aux_ids=None).to("meta")
    assert partial.turns is None and partial.record.aux_ids is None and partial.input_ids.device.type == "meta"


def test_prompt_batch_to_is_identity():
    pb = PromptBatch("train", 3, [6, 7], [Prompt("a", "1"), Prompt("b", "2")])
    assert pb.to("meta") is pb


def test_from_generation_puts_prompt_and_response_side_by_side():
    from rl_lightning.rollout.generation import Generation

    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    gen = Generation(response_ids=torch.tensor([[3, 2], [4, 4]]), logprobs=torch.tensor([[-0.5, -0.1], [-1.0, -2.0]]),
                     mask=torch.tensor([[1, 1], [1, 1]]), truncated=torch.tensor([False, True]))
    batch = RolloutBatch.from_generation(prompt_ids, prompt_mask, gen, rewards=torch.tensor([1.0, 0.0]),
                                         group_size=2, prompt_index=torch.tensor([4, 4]), temperature=0.7, top_p=0.9,
                                         responses=["a", "b"])
    assert batch.input_ids.tolist() == [[0, 5, 6, 3, 2], [7, 8, 9, 4, 4]]
    assert batch.attention_mask.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch.prompt_length == 3 and torch.equal(batch.response_ids, gen.response_ids)
    assert torch.equal(batch.sampler_logprobs, gen.logprobs) and torch.equal(batch.loss_mask, gen.mask)
    assert batch.truncated.tolist() == [False, True] and batch.responses == ["a", "b"]
    assert (batch.temperature, batch.top_p, batch.group_size) == (0.7, 0.9, 2)


def _turn_batch(turns: Turns, width: int) -> RolloutBatch:
    n = turns.count.shape[0]
    return RolloutBatch(input_ids=torch.ones(n, 1 + width, dtype=torch.long),
                        attention_mask=torch.ones(n, 1 + width, dtype=torch.long), prompt_length=1,
                        loss_mask=(turns.index >= 0).long(), sampler_logprobs=torch.zeros(n, width),
                        rewards=torch.zeros(n), group_size=1, prompt_index=torch.zeros(n, dtype=torch.long),
                        truncated=torch.zeros(n, dtype=torch.bool), turns=turns)


def test_turns_select_keeps_the_rows_and_concat_pads_index_obs_mask_and_rewards():
    nan = math.nan
    two = Turns(obs_mask=torch.tensor([[0, 1, 0], [0, 0, 0]]), index=torch.tensor([[0, -1, 1], [0, 0, -1]]),
                count=torch.tensor([2, 1]), rewards=torch.tensor([[0.5, 0.25], [1.0, nan]]))
    one = Turns(obs_mask=torch.tensor([[0, 1, 0, 1, 0]]), index=torch.tensor([[0, -1, 1, -1, 2]]),
                count=torch.tensor([3]), rewards=torch.tensor([[0.0, 0.0, 1.0]]))
    picked = two.select(torch.tensor([1]))
    assert picked.obs_mask.tolist() == [[0, 0, 0]] and picked.index.tolist() == [[0, 0, -1]]
    assert picked.count.tolist() == [1] and picked.rewards[0, 0] == 1.0 and picked.rewards[0, 1].isnan()
    swapped = two.select(torch.tensor([1, 0]))
    assert swapped.index.tolist() == [[0, 0, -1], [0, -1, 1]] and swapped.count.tolist() == [1, 2]
    want_index = [[0, -1, 1, -1, -1], [0, 0, -1, -1, -1], [0, -1, 1, -1, 2]]
    want_obs = [[0, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 1, 0, 1, 0]]
    want_rewards = torch.tensor([[0.5, 0.25, nan], [1.0, nan, nan], [0.0, 0.0, 1.0]])
    joined = Turns.concat([two, one], width=5)
    # and the same through the batch, which pads to its widest response (5) and the most turns (3)
    through = RolloutBatch.concat([_turn_batch(two, 3), _turn_batch(one, 5)]).turns
    for got in (joined, through):
        assert got.index.tolist() == want_index and got.obs_mask.tolist() == want_obs
        assert got.count.tolist() == [2, 1, 3]
        torch.testing.assert_close(got.rewards, want_rewards, equal_nan=True, rtol=0, atol=0)
    moved = two.map(lambda value: value.to("meta"))
    assert all(value.device.type == "meta" for value in moved.tensors().values())
    assert set(two.tensors()) == {"obs_mask", "index", "count", "rewards"}


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("obs_mask", torch.zeros(N, T + 2, dtype=torch.long)),
        ("index", torch.zeros(N - 1, T, dtype=torch.long)),
        ("count", torch.zeros(N, 1, dtype=torch.long)),
        ("rewards", torch.zeros(N)),
        ("rewards", torch.zeros(N + 1, 2)),
    ],
)
def test_turns_shape_validation_names_the_field(name, bad):
    turns = dataclasses.replace(_fields()["turns"], **{name: bad})
    with pytest.raises(ValueError, match=f"RolloutBatch.turns.{name} has shape"):
        _batch(turns=turns)
