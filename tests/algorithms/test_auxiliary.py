"""``auxiliary.auxiliary_plan``: which auxiliary rows each optimiser step forwards, with equal backward counts on
every rank (a rank with fewer micro-batches repeats one of its rows with weight 0)."""

from __future__ import annotations

import pytest
import torch

from rl_lightning.algorithms import AuxiliaryRows
from rl_lightning.algorithms.auxiliary import auxiliary_plan
from rl_lightning.algorithms.forward import sequences_batch


def _rows(n: int) -> AuxiliaryRows:
    batch = sequences_batch([[1, 2]] * n, [[3]] * n, None, 0, 1.0, torch.device("cpu"))
    return AuxiliaryRows(batch, batch.loss_mask.float() / n, lambda rows, out, w: (w.sum(), {}))


def test_auxiliary_rows_follow_the_minibatches_and_micro_batches():
    item = _rows(5)
    plan = auxiliary_plan([item], [0, 1, 0, 1], num_minibatches=2, micro_batch_size=2, reduce_max=None)
    rows = [[m[1].tolist() for m in step] for step in plan]
    assert rows == [[[0, 1], [2]], [[3, 4]], [[0, 1], [2]], [[3, 4]]]  # one pass: every row once, by parts
    assert all(scale == 2.0 for step in plan for *_, scale in step)  # x num_minibatches, as the rollout's weights
    assert auxiliary_plan(None, [0, 1], 2, None, None) == [[], []]


def test_a_rank_with_fewer_auxiliary_micro_batches_pads_with_zero_weight_repeats():
    item = _rows(1)
    plan = auxiliary_plan([item], [0], num_minibatches=1, micro_batch_size=1,
                          reduce_max=lambda counts: counts + 2)  # another rank has 3 micro-batches
    ((first, rows0, s0), *fill) = plan[0]
    assert s0 == 1.0 and len(fill) == 2 and all(scale == 0.0 and rows.tolist() == [0] for _, rows, scale in fill)
    with pytest.raises(ValueError, match="every rank must give at least one row"):
        auxiliary_plan([], [0], 1, None, reduce_max=lambda counts: counts + 1)
    with pytest.raises(ValueError, match="weights have shape"):
        AuxiliaryRows(item.batch, torch.ones(3, 3), item.loss)


def test_auxiliary_extra_ids_reach_the_forward_sliced_with_the_rows():
    from types import SimpleNamespace

    item = _rows(3)
    ids = torch.arange(3).view(3, 1, 1).expand(3, 1, 2).clone()  # row r asks for ids (r, r)
    seen = []
    module = SimpleNamespace(
        forward_policy=lambda rows, model=None, extra_ids=None: seen.append(extra_ids) or SimpleNamespace(),
        global_step=0, manual_backward=lambda loss: None)
    from rl_lightning.algorithms.auxiliary import run_auxiliary
    from rl_lightning.algorithms.metrics import UpdateMetrics
    with_ids = AuxiliaryRows(item.batch, item.weights, item.loss, extra_ids=ids)
    run_auxiliary(module, [(with_ids, torch.tensor([2, 0]), 1.0)], UpdateMetrics(), 0, 0)
    assert seen[0].tolist() == [[[2, 2]], [[0, 0]]]
    with pytest.raises(ValueError, match="extra_ids have shape"):
        AuxiliaryRows(item.batch, item.weights, item.loss, extra_ids=torch.zeros(3, 2, 1, dtype=torch.long))
