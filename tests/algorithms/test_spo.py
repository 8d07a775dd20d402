"""SPO: advantages against the tracker before the step, the tracker after each step, prioritised draws, resume."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback

from rl_lightning.algorithms import SPO
from rl_lightning.envs import ArithmeticTask
from rl_lightning.functional import beta_tracker_update, tracker_value
from rl_lightning.rollout import WeightedSampler
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.tolerances import gamma


def _module(lr: float = 1e-3, **kwargs) -> SPO:  # noqa: ANN003
    return SPO(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.AdamW(p, lr=lr), **kwargs)


def _data(**overrides):  # noqa: ANN003, ANN202
    kwargs = dict(prompts_per_step=4, group_size=1, prompt_sampler=WeightedSampler(pool_size=6))
    kwargs.update(overrides)
    return tiny_datamodule(**kwargs)


class _Outcomes(Callback):
    """Each step's (prompt ids, rewards) and the tracker as the step started."""

    def __init__(self) -> None:
        self.steps: list[tuple[list[int], list[float]]] = []
        self.before: list[dict[int, tuple[float, float]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.before.append(dict(pl_module.tracker))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.steps.append((batch.prompt_id.tolist(), batch.rewards.tolist()))


def test_advantages_compare_with_the_tracker_before_this_steps_outcomes():
    module = _module()
    module.tracker = {7: (3.0, 1.0), 8: (1.0, 3.0)}  # v = 0.75, 0.25; uid 9 unseen: the prior's 0.5
    batch = SimpleNamespace(prompt_id=torch.tensor([7, 8, 9]), rewards=torch.tensor([1.0, 1.0, 0.0]))
    raw = torch.tensor([0.25, 0.75, -0.5])
    want = (raw - raw.mean()) / (raw.std() + 1e-8)
    torch.testing.assert_close(module.compute_advantages(batch), want)
    assert module.tracker == {7: (3.0, 1.0), 8: (1.0, 3.0)}  # computing advantages changes nothing
    one = SimpleNamespace(prompt_id=torch.tensor([7]), rewards=torch.tensor([1.0]))
    assert module.compute_advantages(one).tolist() == [0.0]  # B = 1: no NaN
    bad = SimpleNamespace(prompt_id=torch.tensor([7]), rewards=torch.tensor([2.0]))
    with pytest.raises(ValueError, match=r"rewards in \[0, 1\]"):
        module.compute_advantages(bad)


def test_the_batch_mean_ablation_ignores_the_tracker_in_the_advantages():
    """baseline=batch_mean: A = (R - mean R) / (std R + eps), whatever the tracker holds (it still updates)."""
    module = _module(baseline="batch_mean")
    module.tracker = {7: (3.0, 1.0), 8: (1.0, 3.0)}
    batch = SimpleNamespace(prompt_id=torch.tensor([7, 8, 9, 9]), rewards=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    std = torch.tensor([1.0, 1.0, 0.0, 0.0]).std()  # Bessel: sqrt(4 * 0.25 / 3)
    want = torch.tensor([0.5, 0.5, -0.5, -0.5]) / (std + 1e-8)
    torch.testing.assert_close(module.compute_advantages(batch), want)
    with_tracker = _module()
    with_tracker.tracker = dict(module.tracker)  # the tracker's baseline gives other advantages on this batch
    assert not torch.allclose(with_tracker.compute_advantages(batch), want)
    with pytest.raises(ValueError, match="baseline"):
        _module(baseline="ema")


def test_with_rho_one_the_tracker_counts_each_prompts_outcomes(tmp_path):
    """discount=constant, rho_max=1: every prompt's tracker is the prior plus its successes and failures, keyed by
    the stable prompt id across steps (the pool of 6 prompts is revisited)."""
    record = _Outcomes()
    module = _module(discount="constant", rho_max=1.0)
    tiny_trainer(tmp_path, max_steps=4, callbacks=[record]).fit(module, datamodule=_data())
    counts: dict[int, list[float]] = {}
    for uids, rewards in record.steps:
        for uid, reward in zip(uids, rewards):
            counts.setdefault(uid, [0.5, 0.5])
            counts[uid][0] += reward
            counts[uid][1] += 1 - reward
    assert sum(len(u) for u, _ in record.steps) > len(counts)  # prompts came back
    assert module.tracker.keys() == counts.keys()
    for uid, (a, b) in counts.items():
        assert module.tracker[uid] == pytest.approx((a, b), rel=0, abs=0)  # halves and integers: exact


def test_without_a_policy_change_the_discount_is_rho_max_and_the_stored_logprobs_are_the_policys(tmp_path):
    record = _Outcomes()
    module = _module(lr=0.0)  # the policy never changes: D = 0 on every revisit
    tiny_trainer(tmp_path, max_steps=3, callbacks=[record]).fit(module, datamodule=_data())
    want: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for uids, rewards in record.steps:
        for uid, reward in zip(uids, rewards):
            a, b = want.get(uid, (torch.tensor(0.5, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)))
            want[uid] = beta_tracker_update(a, b, torch.tensor(reward, dtype=torch.float64), 0.96)
    for uid, (a, b) in want.items():
        # the same float64 updates in the same order: 2 roundings per update, on both sides
        rel = 2 * gamma(2 * len(record.steps), torch.float64)
        assert module.tracker[uid] == pytest.approx((float(a), float(b)), rel=rel)
    context, target, mask, logprobs = module.last_response[record.steps[-1][0][0]]
    out, _ = module.score_sequences([context], [target], [mask])
    torch.testing.assert_close(torch.tensor(logprobs), out.logprobs[0, :len(target)].detach())
    assert sum(mask) > 0 and all(lp <= 0 for lp in logprobs)


def test_a_changing_policy_discounts_revisited_prompts(tmp_path):
    metrics: list[dict[str, float]] = []

    class _Metrics(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    module = _module(lr=1e-2)
    tiny_trainer(tmp_path, max_steps=4, callbacks=[_Metrics()]).fit(module, datamodule=_data())
    assert metrics[0]["train/spo_revisit_fraction"] == 0.0 and metrics[0]["train/spo_rho"] == pytest.approx(0.96)
    later = metrics[1:]
    assert any(m["train/spo_revisit_fraction"] > 0 for m in later)
    assert any(m["train/spo_divergence"] > 0 and m["train/spo_rho"] < 0.96 for m in later)
    assert all(0.875 - 1e-9 <= m["train/spo_rho"] <= 0.96 + 1e-9 for m in metrics)


def test_prompts_near_zero_or_one_are_drawn_less_often_than_uncertain_ones():
    task = ArithmeticTask(num_heldout=4)
    sampler = WeightedSampler(pool_size=40, replacement=True)
    module = _module()
    pool = sampler.pool(task)
    uncertain = {p.uid for p in pool[:20]}
    for i, prompt in enumerate(pool):  # the first half near 0.5, the second half solved or hopeless
        module.tracker[prompt.uid] = (10.0, 10.0) if i < 20 else ((200.0, 0.5) if i % 2 else (0.5, 200.0))
    sampler.weights_from(module.prompt_weights)
    drawn = Counter(pool[i].uid for step in range(200) for i in sampler.indices(task, step, 10, seed=0))
    near_half = sum(n for uid, n in drawn.items() if uid in uncertain)
    assert near_half > 0.8 * sum(drawn.values())  # weights 0.55 vs ~0.10: expected share 0.85
    values = tracker_value(torch.tensor([10.0, 200.0]), torch.tensor([10.0, 0.5]))
    assert values.tolist() == pytest.approx([0.5, 200 / 200.5])


def test_prioritized_spo_needs_a_weighted_sampler(tmp_path):
    with pytest.raises(ValueError, match="prompt_sampler"):
        tiny_trainer(tmp_path, max_steps=1).fit(_module(), datamodule=tiny_datamodule(group_size=1))
    module = _module(prioritized=False)  # the stock stream: runs, prompts rarely repeat
    tiny_trainer(tmp_path, max_steps=1).fit(module, datamodule=tiny_datamodule(group_size=1))
    assert len(module.tracker) == 4


def test_resume_restores_the_tracker_exactly(tmp_path):
    straight = _module()
    tiny_trainer(tmp_path / "a", max_steps=4).fit(straight, datamodule=_data())
    first = _module()
    trainer = tiny_trainer(tmp_path / "b", max_steps=2)
    trainer.fit(first, datamodule=_data())
    ckpt = tmp_path / "b" / "step2.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = _module()
    tiny_trainer(tmp_path / "c", max_steps=4).fit(resumed, datamodule=_data(), ckpt_path=str(ckpt))
    assert resumed.tracker == straight.tracker and len(straight.tracker) > 0
    assert resumed.last_response == straight.last_response
    for a, b in zip(straight.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b)
