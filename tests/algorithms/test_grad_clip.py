"""The gradient clip's scope (``checks.clip_gradients``, ``RLModule(grad_clip=...)``), on hand-computed numbers.

Two groups with gradients ``(3, 0)`` and ``(0, 4)`` (norms 3 and 4, together 5) and ``max_norm = 1``:

* ``joint``: one scale ``1/5`` for both: ``(0.6, 0)`` and ``(0, 0.8)``; the returned norm is 5.
* ``per_group``: each its own scale, ``1/3`` and ``1/4``: ``(1, 0)`` and ``(0, 1)``; norms ``{policy: 3, critic: 4}``
  and the same total 5.

Every value here is exact in fp32 except the scales ``1/3``, ``1/5`` (one rounding each, then one product):
``rel=1e-6`` is a few ulps (2^-23 ≈ 1.2e-7).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rl_lightning import ConfigError
from rl_lightning.algorithms import GRPO, PPO
from rl_lightning.algorithms.checks import clip_gradients
from tests.conftest import RecordRollouts, tiny_datamodule, tiny_trainer


def two_groups() -> tuple[nn.Parameter, nn.Parameter, list[dict]]:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])
    return a, b, [{"params": [a]}, {"params": [b], "name": "critic"}]


def test_joint_scales_every_gradient_by_the_one_norm():
    a, b, groups = two_groups()
    total, norms = clip_gradients([a, b], groups, 1.0, "joint")
    assert total.item() == 5.0 and norms == {}
    assert a.grad.tolist() == pytest.approx([0.6, 0.0], rel=1e-6)
    assert b.grad.tolist() == pytest.approx([0.0, 0.8], rel=1e-6)


def test_per_group_scales_each_group_by_its_own_norm():
    a, b, groups = two_groups()
    total, norms = clip_gradients([a, b], groups, 1.0, "per_group")
    assert {k: v.item() for k, v in norms.items()} == {"policy": 3.0, "critic": 4.0}
    assert total.item() == 5.0  # the joint norm before clipping, as joint mode reports it
    assert a.grad.tolist() == pytest.approx([1.0, 0.0], rel=1e-6)
    assert b.grad.tolist() == pytest.approx([0.0, 1.0], rel=1e-6)


def test_per_group_leaves_a_group_under_the_limit_alone_and_skips_one_without_gradients():
    a, b, groups = two_groups()
    c = nn.Parameter(torch.zeros(1))  # no gradient: not in the norms
    total, norms = clip_gradients([a, b, c], [*groups, {"params": [c], "name": "idle"}], 3.5, "per_group")
    assert a.grad.tolist() == [3.0, 0.0]  # 3 <= 3.5: unchanged, bit for bit
    assert b.grad.tolist() == pytest.approx([0.0, 3.5], rel=1e-6)
    assert set(norms) == {"policy", "critic"} and total.item() == 5.0


def test_no_limit_reports_the_norms_and_changes_nothing():
    a, b, groups = two_groups()
    total, norms = clip_gradients([a, b], groups, None, "per_group")
    assert (a.grad.tolist(), b.grad.tolist()) == ([3.0, 0.0], [0.0, 4.0])
    assert total.item() == 5.0 and norms["critic"].item() == 4.0


def test_nothing_with_a_gradient_gives_norm_zero():
    p = nn.Parameter(torch.zeros(2))
    assert clip_gradients([p], [{"params": [p]}], 1.0, "per_group")[0].item() == 0.0
    assert clip_gradients([p], [{"params": [p]}], 1.0, "joint")[0].item() == 0.0


def test_an_unknown_scope_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"GRPO: grad_clip must be joint or per_group, got 'groups'"):
        GRPO(model_name_or_path="embedded:random", grad_clip="groups")


def test_ppo_per_group_logs_each_group_and_their_joint_norm(tmp_path):
    """PPO's policy and value-head groups: ``train/grad_norm`` is ``sqrt(policy² + critic²)`` of the logged parts."""
    module = PPO(grad_clip="per_group", num_iterations=1, num_minibatches=1)
    record = RecordRollouts()
    tiny_trainer(tmp_path, max_steps=1, callbacks=[record]).fit(module, datamodule=tiny_datamodule())
    m = record.metrics[0]
    assert m["train/grad_norm_policy"] > 0 and m["train/grad_norm_critic"] > 0
    assert m["train/grad_norm"] == pytest.approx(math.hypot(m["train/grad_norm_policy"], m["train/grad_norm_critic"]),
                                                 rel=1e-6)
