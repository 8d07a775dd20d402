"""FlashREINFORCE (Hu et al. 2026): the loss's gradient is the written-out formula, the gate filters whole
trajectories and keeps them in B, advantages use the mean over every rank, the update and its metrics do not
depend on micro-batching or on the split over ranks, and the method trains from its config's settings."""

from __future__ import annotations

import dataclasses

import math
from types import SimpleNamespace

import pytest
import torch

from rl_lightning.algorithms import Advantages, FlashREINFORCE, PolicyOutput
from rl_lightning.algorithms.metrics import plain
from rl_lightning.rollout import RolloutBatch
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.helpers.ddp_run import GradedMatch
from tests.tolerances import decoder_gradient_tolerance, decoder_logprob_bound, decoder_logprob_tolerance, gamma

#: a coefficient -m w A / (B T) takes at most 6 float32 roundings (2^-24 each) along either path
COEFF_RTOL = 6 * 2.0**-24


def _batch(lengths: list[int], rewards: list[float], width: int = 4, prompt: int = 3, seed: int = 0) -> RolloutBatch:
    """Random token ids, right-padded responses of ``lengths`` tokens; sampler log-probs are filled in later."""
    gen = torch.Generator().manual_seed(seed)
    n = len(lengths)
    loss_mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(3, 99, (n, prompt + width), generator=gen)
    attention = torch.cat([torch.ones(n, prompt, dtype=torch.long), loss_mask], dim=1)
    return RolloutBatch(
        input_ids=ids * attention, attention_mask=attention, prompt_length=prompt, loss_mask=loss_mask,
        sampler_logprobs=torch.zeros(n, width), rewards=torch.tensor(rewards), group_size=1,
        prompt_index=torch.arange(n), truncated=torch.zeros(n, dtype=torch.bool),
    )


def _module(**kwargs) -> FlashREINFORCE:
    torch.manual_seed(0)
    return FlashREINFORCE(model_name_or_path="embedded:random", max_grad_norm=None, **kwargs)


def _lag(module: FlashREINFORCE, batch: RolloutBatch, shifts: list[float]) -> RolloutBatch:
    """Set the sampler's log-probs to the learner's plus a per-row mismatch (as a lagged sampler would give)."""
    with torch.no_grad():
        learner = module.forward_policy(batch).logprobs
    noise = torch.randn(learner.shape, generator=torch.Generator().manual_seed(7))
    sampler = (learner + torch.tensor(shifts)[:, None] * (1.0 + noise)).clamp(max=0.0)
    batch = dataclasses.replace(batch, sampler_logprobs=sampler * batch.loss_mask)
    return batch


def _reference_coefficients(learner: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor,
                            delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``∂L/∂log π`` of ``L = -1/B Σ_i m_i 1/T_i Σ_t w A_i log π`` written out, and the gate ``m``."""
    mask = mask.float()
    p = sampler.exp().clamp(1e-6, 1 - 1e-6)
    q = learner.exp().clamp(1e-6, 1 - 1e-6)
    d = p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))
    lengths = mask.sum(1)
    m = ((d * mask).sum(1) / lengths.clamp(min=1) <= delta) & (lengths > 0)
    advantage = rewards - rewards.mean()
    w = torch.exp((learner - sampler).clamp(-30, 30))
    coeff = -(m.float() * advantage)[:, None] * w * mask / lengths.clamp(min=1)[:, None] / len(rewards)
    return coeff, m.float()


def _shape_tolerances(module: FlashREINFORCE, batch: RolloutBatch, delta: float, scale: float):  # noqa: ANN202
    """Rounding bounds of an update computed in other shapes (micro-batches, ranks): ``(gradient atol, metric
    atols)``. The learner's log-probs of each row then come from other kernels, within ``δ``
    (``decoder_logprob_tolerance``) of each other, and every gradient entry within ``decoder_gradient_tolerance``
    of ``max |g|`` (``scale``), besides the coefficients' own ``10 COEFF_RTOL`` (a 10-token sum that may cancel).
    Each metric moves by ``δ`` times its sensitivity to the log-probs, plus twice ``gamma(n)`` of its terms'
    size (``n`` tokens and rows summed, in each run):

    * loss ``Σ c_t log π_t``: ``δ Σ (|c| + |c log π|)`` (directly, and through ``ρ`` inside ``c``);
    * logprob_mean ``δ``; ratio_mean ``mean ρ (e^δ - 1)``; advantage_mean: no log-prob in it;
    * bernoulli_kl: ``δ mean |∂d/∂ log π|`` (autograd of ``functional.bernoulli_kl``);
    * trajectory_keep_fraction: a count over the rows (no row's mean ``d`` is within rounding of the gate here),
      then ``gamma(n)`` of itself.
    """
    from rl_lightning.functional import bernoulli_kl

    with torch.no_grad():
        out = module.forward_policy(batch, with_hidden=True)
    mask = batch.loss_mask.bool()
    length = batch.input_ids.shape[1]
    lp_tol = decoder_logprob_tolerance(module.policy, out.hidden[mask], batch.temperature, length)
    grad_atol = float(decoder_gradient_tolerance(module.policy.config, length, batch.input_ids.numel(), scale))
    grad_atol += 10 * COEFF_RTOL * scale
    learner, sampler = out.logprobs, batch.sampler_logprobs
    coeff, _ = _reference_coefficients(learner, sampler, batch.loss_mask, batch.rewards, delta)
    n = int(mask.sum()) + batch.num_rows
    ratio = torch.exp((learner - sampler).clamp(-30, 30))[mask]
    leaf = learner.clone().requires_grad_(True)
    (slope,) = torch.autograd.grad(bernoulli_kl(sampler, leaf)[mask].sum(), leaf)
    d = bernoulli_kl(sampler, learner)[mask]
    advantage = (batch.rewards - batch.rewards.mean()).abs()
    size = float((coeff * learner).abs().sum())
    metrics = {
        "train/loss": lp_tol * (float(coeff.abs().sum()) + size) + 2 * gamma(n) * size,
        "train/logprob_mean": lp_tol + 2 * gamma(n) * float(learner[mask].abs().mean()),
        "train/ratio_mean": float(ratio.mean()) * (math.expm1(lp_tol) + 2 * gamma(n)),
        "train/advantage_mean": 2 * gamma(n) * float(advantage.max()),
        "train/bernoulli_kl": lp_tol * float(slope[mask].abs().mean()) + 2 * gamma(n) * float(d.mean()),
        "train/trajectory_keep_fraction": 2 * gamma(n),
    }
    return grad_atol, metrics


# ------------------------------------------------------------------------------------------------ settings


def test_bad_settings_are_refused_naming_the_field():
    for kwargs, field in [({"delta": 0.0}, "delta"), ({"delta": -1e-3}, "delta"), ({"delta": math.nan}, "delta"),
                          ({"num_iterations": 2}, "num_iterations"), ({"num_minibatches": 2}, "num_minibatches"),
                          ({"loss_aggregation": "token_mean"}, "loss_aggregation")]:
        with pytest.raises(ValueError, match=field):
            FlashREINFORCE(model_name_or_path="embedded:random", **kwargs)
    module = FlashREINFORCE(model_name_or_path="embedded:random")
    assert module.delta == 5e-3 and module.loss_aggregation == "seq_mean_token_mean"
    assert FlashREINFORCE(model_name_or_path="embedded:random", delta=math.inf).delta == math.inf  # gate off


# ------------------------------------------------------------------------------------------------ the loss


def test_gradient_with_respect_to_the_logprobs_is_the_written_out_formula():
    """Rows: on-policy (kept), a small and a large mismatch, an empty row; one of them is filtered."""
    module = _module(delta=5e-3)
    batch = _lag(module, _batch([4, 2, 3, 0, 1], [1.0, 0.0, 0.5, 0.25, 1.0]), [0.0, 0.02, 3.0, 0.0, 0.05])
    learner = module.forward_policy(batch).logprobs.detach()
    leaf = learner.clone().requires_grad_(True)
    advantages = Advantages(module.compute_advantages(batch).unsqueeze(-1))
    loss, stats = module.policy_loss(batch, PolicyOutput(leaf), advantages, module.loss_weights(batch))
    (grad,) = torch.autograd.grad(loss, leaf)
    coeff, m = _reference_coefficients(learner, batch.sampler_logprobs, batch.loss_mask, batch.rewards, 5e-3)
    assert m.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]  # the large mismatch and the empty row are filtered
    torch.testing.assert_close(grad, coeff, rtol=COEFF_RTOL, atol=0.0)  # w, m, A are constants: ∂L/∂logπ = c
    # the loss sums terms of both signs: relative to their size, the coefficients' rounding and the sum's
    n = int(batch.loss_mask.sum()) + batch.num_rows
    torch.testing.assert_close(loss, (coeff * learner).sum(), rtol=0,
                               atol=(COEFF_RTOL + 2 * gamma(n)) * float((coeff * learner).abs().sum()))
    assert plain(stats["train/trajectory_keep_fraction"]).item() == pytest.approx(3 / 5, rel=4 * 2.0**-24)  # B = 5


def test_parameter_gradient_is_the_written_out_formula():
    module = _module(delta=1e-3)
    batch = _lag(module, _batch([4, 2, 3, 1], [1.0, 0.0, 0.5, 0.0], seed=1), [0.0, 0.01, 0.5, 0.02])
    params = [p for p in module.policy.parameters() if p.requires_grad]
    out = module.forward_policy(batch)
    advantages = Advantages(module.compute_advantages(batch).unsqueeze(-1))
    loss, _ = module.policy_loss(batch, out, advantages, module.loss_weights(batch))
    grads = torch.autograd.grad(loss, params)
    out = module.forward_policy(batch)
    coeff, m = _reference_coefficients(out.logprobs.detach(), batch.sampler_logprobs, batch.loss_mask,
                                       batch.rewards, 1e-3)
    assert 0 < m.sum() < len(m)
    reference = torch.autograd.grad((coeff * out.logprobs).sum(), params)
    scale = max(float(g.abs().max()) for g in reference)
    assert scale > 0
    # the two losses are J·c for the same Jacobian J and coefficients c equal to COEFF_RTOL; a component is a sum
    # over 10 tokens of both signs, which can cancel the relative precision by about one decimal
    for g, r in zip(grads, reference):
        torch.testing.assert_close(g, r, rtol=10 * COEFF_RTOL, atol=10 * COEFF_RTOL * scale)


def test_an_all_filtered_batch_gives_zero_loss_and_zero_gradient():
    module = _module(delta=1e-3)
    batch = _batch([4, 2, 3], [1.0, 0.0, 0.5])
    with torch.no_grad():  # the sampler gave every token e^-40 of the learner's probability
        batch = dataclasses.replace(batch,
                                    sampler_logprobs=(module.forward_policy(batch).logprobs - 40.0) * batch.loss_mask)
    params = list(module.policy.parameters())
    out = module.forward_policy(batch)
    loss, stats = module.policy_loss(batch, out, Advantages(module.compute_advantages(batch).unsqueeze(-1)),
                                     module.loss_weights(batch))
    assert loss.item() == 0.0 and plain(stats["train/trajectory_keep_fraction"]).item() == 0.0
    assert all(torch.isfinite(plain(v)).all() for v in stats.values())
    # the ratios are e^40, bounded to e^30 (finite in float32), and never reach the gradient
    # every ratio is the float32 e^30 (1 ulp off the exact one), their token mean gamma(n) of it
    n = int(batch.loss_mask.sum()) + batch.num_rows
    assert plain(stats["train/ratio_mean"]).item() == pytest.approx(math.exp(30.0), rel=2 * 2.0**-24 + gamma(n))
    loss.backward()
    assert all(p.grad is None or (torch.isfinite(p.grad).all() and not p.grad.any()) for p in params)


# ------------------------------------------------------------------------------------------------ splits


class _CaptureOptimizer:
    """Stands in for Lightning's optimiser wrapper: ``step`` keeps the accumulated gradient."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params, self.grads, self.optimizer = params, None, self

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self.grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in self.params]


def _update(module: FlashREINFORCE, batch: RolloutBatch,
            monkeypatch) -> tuple[list[torch.Tensor], dict]:  # noqa: ANN001
    """``RLModule.update`` on one rollout batch without a Trainer; returns the stepped gradient and the stats."""
    capture = _CaptureOptimizer(list(module.policy.parameters()))
    monkeypatch.setattr(module, "optimizers", lambda: capture)
    monkeypatch.setattr(module, "manual_backward", lambda loss: loss.backward())
    advantages = Advantages(module.compute_advantages(batch).unsqueeze(-1))
    stats = module.update(batch, advantages, module.loss_weights(batch))
    return capture.grads, {k: torch.stack(v).mean().item() for k, v in stats.items()}


def test_micro_batching_changes_neither_the_gradient_nor_the_metrics(monkeypatch):
    lengths, rewards = [4, 1, 3, 2, 4, 0, 2], [1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.25]
    shifts = [0.0, 3.0, 0.02, 3.0, 0.05, 0.0, 0.0]
    runs = []
    for micro in (None, 1, 3):
        module = _module(delta=5e-3, micro_batch_size=micro)
        runs.append(_update(module, _lag(module, _batch(lengths, rewards), shifts), monkeypatch))
    (grads, stats), others = runs[0], runs[1:]
    assert stats["train/trajectory_keep_fraction"] == pytest.approx(4 / 7, rel=4 * 2.0**-24)
    assert 0 < stats["train/bernoulli_kl"] and stats["train/ratio_mean"] != 1.0
    scale = max(float(g.abs().max()) for g in grads)
    module = _module(delta=5e-3)
    grad_atol, metric_atol = _shape_tolerances(module, _lag(module, _batch(lengths, rewards), shifts), 5e-3, scale)
    for other_grads, other_stats in others:
        for g, o in zip(grads, other_grads):  # micro-batches: other shapes, other sum orders
            torch.testing.assert_close(o, g, rtol=10 * COEFF_RTOL, atol=grad_atol)
        for key, atol in metric_atol.items():
            relative = key == "train/trajectory_keep_fraction"
            assert other_stats[key] == pytest.approx(stats[key], rel=atol if relative else 0,
                                                     abs=0 if relative else atol), key


class _FakeRanks:
    """Two ranks in one process: the first pass records what each rank hands to ``strategy.reduce``; in the
    second every reduce returns the sum over both ranks of that call (an all-reduce), in call order."""

    def __init__(self) -> None:
        self.calls: dict[int, list[torch.Tensor]] = {0: [], 1: []}
        self.summed: list[torch.Tensor] | None = None

    def attach(self, module: FlashREINFORCE, rank: int) -> None:
        queue = iter(self.summed or [])

        def reduce(value: torch.Tensor, reduce_op: str = "mean") -> torch.Tensor:
            assert reduce_op == "sum"
            if self.summed is None:
                self.calls[rank].append(value.detach().clone())
                return value
            return next(queue).clone()

        strategy = SimpleNamespace(reduce=reduce)
        module._trainer = SimpleNamespace(world_size=2, strategy=strategy, global_step=0, callbacks=[])

    def freeze(self) -> None:
        self.summed = [a + b for a, b in zip(self.calls[0], self.calls[1])]


def _rank_step(module: FlashREINFORCE, batch: RolloutBatch) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    advantages = module.compute_advantages(batch)
    weights = module.loss_weights(batch)
    loss, stats = module.policy_loss(batch, module.forward_policy(batch), Advantages(advantages.unsqueeze(-1)), weights)
    grads = torch.autograd.grad(loss, list(module.policy.parameters()), allow_unused=True)
    return advantages, [torch.zeros(()) if g is None else g for g in grads], stats


def test_two_ranks_see_the_global_mean_and_together_give_the_one_process_gradient():
    lengths, rewards, shifts = [4, 2, 3, 3, 4, 2], [1.0, 1.0, 0.5, 0.0, 0.0, 0.0], [0.0, 0.02, 3.0, 3.0, 3.0, 0.03]
    module = _module(delta=5e-3)
    whole = _lag(module, _batch(lengths, rewards), shifts)
    rank_batches = [whole.select(torch.arange(0, 3)), whole.select(torch.arange(3, 6))]
    adv_whole, grads_whole, stats_whole = _rank_step(module, whole)
    ranks = _FakeRanks()
    for rank, batch in enumerate(rank_batches):  # pass 1: record each rank's local totals
        ranks.attach(module, rank)
        module.compute_advantages(batch), module.loss_weights(batch)
    ranks.freeze()
    results = []
    for rank, batch in enumerate(rank_batches):
        ranks.attach(module, rank)
        results.append(_rank_step(module, batch))
    module._trainer = None
    # A = R - 5/12 on both ranks, not R - their own means (5/6 and 0)
    adv = torch.cat([r[0] for r in results])
    torch.testing.assert_close(adv, torch.tensor(rewards) - 2.5 / 6, rtol=0, atol=2.0**-23)
    torch.testing.assert_close(adv, adv_whole, rtol=0, atol=2.0**-23)
    # DDP averages the ranks' gradients; the weights carry the global B, times the world size
    scale = max(float(g.abs().max()) for g in grads_whole)
    assert scale > 0
    grad_atol, _ = _shape_tolerances(module, whole, 5e-3, scale)  # 3-row forwards against a 6-row one
    for name_index, g in enumerate(grads_whole):
        averaged = (results[0][1][name_index] + results[1][1][name_index]) / 2
        torch.testing.assert_close(averaged, g, rtol=10 * COEFF_RTOL, atol=grad_atol)
    # each rank's keep fraction is its own rows' fraction; their mean (the logged value) is the whole batch's
    fractions = [float(plain(r[2]["train/trajectory_keep_fraction"])) for r in results]
    with torch.no_grad():
        _, m = _reference_coefficients(module.forward_policy(whole).logprobs, whole.sampler_logprobs,
                                       whole.loss_mask, whole.rewards, 5e-3)
    assert m.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]  # rank 0 keeps 2 of its 3 rows, rank 1 keeps 1
    assert fractions == pytest.approx([2 / 3, 1 / 3], rel=4 * 2.0**-24)
    assert plain(stats_whole["train/trajectory_keep_fraction"]).item() == pytest.approx(3 / 6, rel=4 * 2.0**-24)


# ------------------------------------------------------------------------------------------------ training


def test_trains_with_a_lagged_sampler_and_the_gate_bites(tmp_path, recorder):
    """Step 0 is on-policy (everything kept); step 1 samples with the policy of before step 0's update, and
    δ = 1e-3 filters some of those trajectories (about half, with this seed)."""
    module = FlashREINFORCE(model_name_or_path="embedded:arithmetic", delta=1e-3,
                            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    dm = tiny_datamodule(prompts_per_step=16, group_size=1, sync_interval=2, temperature=1.5,
                         reward_fn=GradedMatch())
    tiny_trainer(tmp_path, max_steps=3, callbacks=[recorder]).fit(module, datamodule=dm)
    assert any(not torch.equal(before[k], v) for k, v in module.policy.state_dict().items())
    first, second = recorder.metrics[0], recorder.metrics[1]
    # on-policy at step 0: the learner's log-probs within δ of the sampler's (decoder_logprob_bound at T = 1.5), so
    # ρ within e^δ - 1 of 1; the kept fraction sums the rows' weights, n = 16 rows x (4 tokens + 1) terms. (The
    # Bernoulli KL of two log-probs δ apart is second order in δ but unbounded near p = 1: 1e-6 is a threshold.)
    delta = decoder_logprob_bound(module.policy, 1.5, module.policy.config.max_position_embeddings)
    assert first["train/trajectory_keep_fraction"] == pytest.approx(1.0, rel=gamma(16 * 5))
    assert first["train/bernoulli_kl"] < 1e-6
    assert first["train/ratio_mean"] == pytest.approx(1.0, abs=math.expm1(delta) + gamma(16 * 5))
    assert 0.0 < second["train/trajectory_keep_fraction"] < 1.0
    assert second["train/bernoulli_kl"] > first["train/bernoulli_kl"]
    for metrics in recorder.metrics:
        assert abs(metrics["train/advantage_mean"]) < 1.0  # batch-centred (token-weighted, so not exactly 0)
