"""The pieces the update is built from, on hand tensors: ``Advantages`` (sliced by rows, cut by columns), the
metric kinds (``TokenMean``, ``Summed``, plain) and how ``UpdateMetrics`` combines them, ``Ranks`` in one process,
and ``planning.micro_batch`` / ``zero_advantage_rows``."""

from __future__ import annotations

import pytest
import torch

from rl_lightning.algorithms import Advantages, Summed, TokenMean
from rl_lightning.algorithms.distributed import Ranks
from rl_lightning.algorithms.metrics import UpdateMetrics, plain
from rl_lightning.algorithms.planning import micro_batch, zero_advantage_rows
from tests.algorithms.test_skipping import SPREAD, _batch


def test_advantages_select_rows_and_cut_per_token_fields_only():
    per_token = torch.arange(12.0).view(3, 4)
    adv = Advantages(per_token, values=per_token + 100, returns=per_token + 200, rows={"w": torch.tensor([1., 2, 3])})
    picked = adv.select(torch.tensor([2, 0]))
    assert picked.num_rows == 2
    assert torch.equal(picked.advantages, per_token[[2, 0]]) and torch.equal(picked.values, per_token[[2, 0]] + 100)
    assert torch.equal(picked.returns, per_token[[2, 0]] + 200) and picked.rows["w"].tolist() == [3.0, 1.0]
    cut = adv.cut(2)
    assert cut.advantages.shape == cut.values.shape == cut.returns.shape == (3, 2)
    assert torch.equal(cut.rows["w"], adv.rows["w"])  # per-row fields are not cut
    one = Advantages(torch.ones(3, 1))
    assert one.cut(2).advantages.shape == (3, 1) and one.select(torch.tensor([1])).values is None  # broadcast
    with pytest.raises(ValueError, match="rows"):
        Advantages(torch.ones(3, 1), rows={"w": torch.ones(2)})


def test_update_metrics_combine_each_kind_as_it_states():
    metrics = UpdateMetrics()
    # one optimiser step of two micro-batches of 1 and 3 tokens, then a second step of one micro-batch of 2 tokens
    for tokens, value, share in ((1.0, 1.0, 0.25), (3.0, 3.0, 0.75)):
        metrics.add_loss(torch.tensor(share), {"t": TokenMean(torch.tensor(value)), "s": Summed(torch.tensor(share)),
                                               "p": torch.tensor(value)}, torch.tensor(tokens))
    metrics.end_optimizer_step()
    metrics.add_loss(torch.tensor(2.0), {"t": TokenMean(torch.tensor(0.0)), "s": Summed(torch.tensor(2.0)),
                                         "p": torch.tensor(0.0)}, torch.tensor(2.0))
    metrics.end_optimizer_step()
    stats = metrics.finish()
    # the mean over every token, (1 x 1 + 3 x 3 + 0 x 2) / 6, in float32 (exact sums, one rounded division)
    assert [float(v) for v in stats["t"]] == [float(torch.tensor(10.0) / 6)]
    assert [float(v) for v in stats["s"]] == [1.0, 2.0]  # one entry per optimiser step: its micro-batches' sum
    assert [float(v) for v in stats["train/loss"]] == [1.0, 2.0]
    assert [float(v) for v in stats["p"]] == [1.0, 3.0, 0.0]  # one entry per micro-batch
    assert [float(plain(v)) for v in (TokenMean(torch.tensor(1.5)), Summed(torch.tensor(2.5)), torch.tensor(3.5))] \
        == [1.5, 2.5, 3.5]
    # under data parallelism the token sums are reduced once, then divided: rank 1 doubling them changes nothing
    twice = UpdateMetrics()
    twice.add_loss(torch.tensor(0.0), {"t": TokenMean(torch.tensor(2.0))}, torch.tensor(4.0))
    assert float(twice.finish(lambda sums: sums * 2)["t"][0]) == 2.0


def test_ranks_in_one_process_are_the_identity():
    ranks = Ranks(None)
    value = torch.tensor([1.0, -2.0])
    assert ranks.world_size == 1
    assert ranks.sum(value) is value and ranks.mean(value) is value and ranks.max(value) is value
    assert ranks.gather_objects({"a": 1}) == [{"a": 1}]


def test_micro_batch_slices_rows_and_cuts_the_padding_with_its_advantages():
    batch = _batch(SPREAD)  # width 8; rows 1, 10, 11 have 1, 2 and 1 generated tokens
    rows = torch.tensor([1, 10, 11])
    per_token = torch.arange(16 * 8, dtype=torch.float32).view(16, 8)
    adv = Advantages(per_token, values=-per_token, returns=per_token, rows={"w": torch.arange(16.0)})
    weights = torch.rand(16, 8, generator=torch.Generator().manual_seed(0))
    mb, mb_adv, mb_w = micro_batch(batch, rows, adv, weights, trim=True)
    assert mb.loss_mask.shape == mb_adv.advantages.shape == mb_adv.values.shape == mb_w.shape == (3, 2)
    assert torch.equal(mb_adv.advantages, per_token[rows, :2]) and torch.equal(mb_w, weights[rows, :2])
    assert mb_adv.rows["w"].tolist() == [1.0, 10.0, 11.0]
    whole, whole_adv, whole_w = micro_batch(batch, rows, adv, weights, trim=False)
    assert whole.loss_mask.shape == whole_adv.advantages.shape == whole_w.shape == (3, 8)


def test_zero_advantage_rows_count_only_generated_tokens():
    batch = _batch(SPREAD)
    per_row = torch.zeros(16, 1)
    per_row[3] = 1.0
    assert zero_advantage_rows(batch, per_row).tolist() == [r != 3 for r in range(16)]
    per_token = batch.loss_mask.float().clone()
    per_token[1] = 0.0
    per_token[1, 5] = 7.0  # row 1 has one generated token: a value on its padding does not count
    assert zero_advantage_rows(batch, per_token).tolist() == [r == 1 for r in range(16)]
