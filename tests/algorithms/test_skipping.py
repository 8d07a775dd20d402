"""Doing less work for the same update (issue 14, items 2 and 3).

* Inert rows (``RLModule.inert_rows``: zero advantage, no contributing loss term) are not forwarded, and the
  gradient is the one of forwarding every row -- also when every row is skipped (a zero gradient, logged,
  no NaN) -- while a contributing ``LossTerm`` (KL with ``beta > 0``), a value loss (PPO) or a class that does
  not declare ``zero_advantage_rows_are_inert`` (CoPE's forecasting term) switch the skipping off.
* Length bucketing (rows ordered by response length into micro-batches, each cut to its longest row) leaves
  the gradient unchanged, for ``[N]`` and ``[N, T]`` (PPO) advantages.

Tolerance: both paths add up the same per-row contributions ``g_r`` to every gradient entry (an inert row's are
exactly 0), in another order and with other matrix-product shapes (fewer rows, fewer columns), so each ``g_r`` is
itself computed through other kernels. ``tolerances.decoder_gradient_tolerance`` bounds that by
``2 (sqrt(2 K) + n) u`` of the terms' magnitude (``u = 2^-24``; ``K`` the decoder's reduction depth at this
context length, ~4600 here; ``n`` = 16 rows x 14 positions summed by a weight gradient), taken as the step's
``max |g|`` (issue 19: relative to the gradient's scale, not to an entry whose terms may cancel): ``3.8e-5`` of
``max |g|``, measured differences up to ``2e-6`` of it. A missing, doubled or mis-weighted row moves the gradient
by about ``max |g| / 16``.

The logged metrics are functions of log-probs that two paths compute within ``δ`` of each other
(``tolerances.decoder_logprob_tolerance``): ``_metric_tolerances`` propagates ``δ`` through each metric's
arithmetic, relative to the magnitude of its terms (the loss ``Σ w ℓ`` relative to ``Σ w |A| ρ``, since
the advantages are zero-mean per group and the terms cancel).
"""

from __future__ import annotations

import dataclasses

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from rl_lightning.algorithms import (
    CoPE, GRPO, PPO, REINFORCE, RLOO, SPO, Advantages, FlashREINFORCE, PolicyGradient, TRPO,
)
from rl_lightning.algorithms.planning import minibatch_rows, trim_padding
from rl_lightning.algorithms.update_plan import UpdatePlan
from rl_lightning.callbacks import KLRegularizer
from rl_lightning.envs.base import Prompt, RewardFunction
from rl_lightning.rollout import RolloutBatch
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.tolerances import (
    decoder_gradient_tolerance, decoder_logprob_tolerance, gamma, unit_roundoff,
)

#: response lengths of the hand batch (4 groups of 4; width 8): very different within every group
LENGTHS = [8, 1, 5, 3, 2, 7, 1, 6, 4, 8, 2, 1, 6, 3, 8, 5]
PROMPTS = [3, 6, 4, 5]  # real prompt tokens of each group (left-padded to 6)
MIXED = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 1.0, 0.25, 0.0, 1.0, 1.0, 1.0, 1.0]  # groups 1, 3 constant
SPREAD = [1.0, 0.0, 0.0, 1.0, 0.75, 0.0, 1.0, 0.5, 0.0, 1.0, 0.25, 0.0, 1.0, 0.0, 0.5, 1.0]  # every group varies


def _batch(rewards: list[float], lengths: list[int] = LENGTHS, width: int = 8, prompt: int = 6) -> RolloutBatch:
    n, g = len(lengths), 4
    gen = torch.Generator().manual_seed(0)
    loss_mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    real_prompt = torch.tensor([PROMPTS[i // g % len(PROMPTS)] for i in range(n)])
    prompt_mask = (torch.arange(prompt)[None] >= prompt - real_prompt[:, None]).long()
    attention = torch.cat([prompt_mask, loss_mask], dim=1)
    ids = torch.randint(3, 99, (n, prompt + width), generator=gen) * attention
    return RolloutBatch(
        input_ids=ids, attention_mask=attention, prompt_length=prompt, loss_mask=loss_mask,
        sampler_logprobs=torch.zeros(n, width), rewards=torch.tensor(rewards), group_size=g,
        prompt_index=torch.arange(n) // g, truncated=torch.zeros(n, dtype=torch.bool),
        prompt_id=torch.arange(n) // g,
    )


def _off_policy(module, batch: RolloutBatch) -> RolloutBatch:  # noqa: ANN001
    """Sampler log-probs = the learner's plus noise, so ratios differ from 1 (and some tokens clip)."""
    with torch.no_grad():
        learner = module.forward_policy(batch).logprobs
    noise = 0.2 * torch.randn(learner.shape, generator=torch.Generator().manual_seed(7))
    batch = dataclasses.replace(batch, sampler_logprobs=(learner + noise).clamp(max=0.0) * batch.loss_mask)
    return batch


class _Capture:
    """Stands in for Lightning's optimiser wrapper: every ``step`` keeps the accumulated gradient."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params, self.steps, self.optimizer = params, [], self

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self.steps.append([None if p.grad is None else p.grad.clone() for p in self.params])


def _advantages(module, batch: RolloutBatch) -> Advantages:  # noqa: ANN001
    """``compute_advantages`` as ``RLModule.training_step`` takes it: an ``Advantages``, ``[N, 1]`` or ``[N, T]``."""
    adv = module.compute_advantages(batch)
    adv = adv if isinstance(adv, Advantages) else Advantages(adv)
    return replace(adv, advantages=adv.advantages.detach().reshape(batch.num_rows, -1))


def _update(module, batch: RolloutBatch, monkeypatch, terms=()):  # noqa: ANN001, ANN202
    """``RLModule.update`` without a Trainer: ``(gradients of each optimiser step, metrics, backward count)``."""
    capture = _Capture(list(module.parameters()))
    backwards = []
    monkeypatch.setattr(module, "optimizers", lambda: capture)
    monkeypatch.setattr(module, "manual_backward", lambda loss: (backwards.append(1), loss.backward()))
    monkeypatch.setattr(module, "_loss_terms", lambda: list(terms))
    stats = module.update(batch, _advantages(module, batch), module.loss_weights(batch))
    metrics = {k: torch.stack([v.float().reshape(()) for v in vs]).mean().item() for k, vs in stats.items()}
    return capture.steps, metrics, len(backwards)


def _gradient_tolerances(module, batch: RolloutBatch, want: list) -> list[float]:  # noqa: ANN001
    """Per optimiser step: ``decoder_gradient_tolerance`` relative to the step's ``max |g|`` (module docstring)."""
    config, length, terms = module.policy.config, batch.input_ids.shape[1], batch.input_ids.numel()
    scales = [max(float(g.abs().max()) for g in step if g is not None) for step in want]
    assert all(scale > 0 for scale in scales)
    return [float(decoder_gradient_tolerance(config, length, terms, torch.tensor(scale))) for scale in scales]


def _assert_same_gradient(got: list, want: list, module, batch: RolloutBatch) -> None:  # noqa: ANN001
    assert len(got) == len(want)
    for step_got, step_want, atol in zip(got, want, _gradient_tolerances(module, batch, want)):
        assert [g is None for g in step_got] == [g is None for g in step_want]  # the same parameters reached
        for g, w in zip(step_got, step_want):
            if w is not None:
                torch.testing.assert_close(g, w, rtol=0, atol=atol)


def _grad_norm_tolerance(got: list, want: list) -> float:  # noqa: ANN001
    """``train/grad_norm`` (the mean over optimiser steps of ``‖g‖``): ``|‖g‖ - ‖g'‖| <= ‖g - g'‖`` (measured,
    in float64), plus each run's rounding of its norm, a sum of ``N`` squares: ``sqrt(N) u`` of it (probabilistic)."""
    bounds = []
    for step_got, step_want in zip(got, want):
        pairs = [(g.double(), w.double()) for g, w in zip(step_got, step_want) if w is not None]
        diff = math.sqrt(sum(float((g - w).square().sum()) for g, w in pairs))
        norm = math.sqrt(sum(float(w.square().sum()) for _, w in pairs))
        count = sum(w.numel() for _, w in pairs)
        bounds.append(diff + 2 * math.sqrt(count) * unit_roundoff() * norm)
    return sum(bounds) / len(bounds)


def _metric_tolerances(module, batch: RolloutBatch) -> dict[str, tuple[float, float]]:  # noqa: ANN001
    """How far two updates of ``batch`` that differ only in shapes and orders may log different metrics.

    ``δ``: the log-prob rounding bound (``decoder_logprob_tolerance``), so a ratio ``ρ = exp(lp - lp_old)`` moves
    by at most ``ρ (e^δ - 1)``; ``n``: the tokens (and micro-batches) summed, each sum within ``gamma(n)`` of the
    magnitude of its terms in each run (``x 2``).

    * ``train/loss = Σ w ℓ``, ``ℓ = -min(ρA, clip(ρ)A)`` is 1-Lipschitz in ``ρ`` times ``|A|``: within
      ``Σ w |A| ρ · (e^δ - 1 + 2 gamma(n))``, relative to the terms (the advantages cancel per group).
    * ``train/ratio_mean``: ``mean ρ · (e^δ - 1 + 2 gamma(n))``.
    * ``train/entropy``: ``∂H/∂s_v = -p_v (log p_v + H)``, so ``|ΔH| <= 2 H max|Δs| <= H δ``; the log-probs'
      own error ``<= δ`` adds ``Σ_v p_v δ = δ``, the vocabulary sum ``2 gamma(V) H`` (``H``: the largest).
    * ``train/clip_fraction``: a count, exact unless a ratio lies within rounding of ``1 ± ε``; asserted here that
      none does (by twice that margin), it is then ``Σ (c_m / t_m) t_m / t``: ``gamma(n)`` of itself.
    """
    with torch.no_grad():
        out = module.forward_policy(batch, with_entropy=True, with_hidden=True)
    mask = batch.loss_mask.bool()
    delta = decoder_logprob_tolerance(module.policy, out.hidden[mask], batch.temperature, batch.input_ids.shape[1])
    advantages = _advantages(module, batch).advantages
    weights = module.loss_weights(batch)
    ratio = torch.exp(out.logprobs - batch.sampler_logprobs)[mask].double()
    n = int(mask.sum()) + batch.num_rows  # tokens, and at most one partial sum per row (micro-batch)
    drift = math.expm1(delta) + 2 * gamma(n)
    for edge in (1 - module.clip_eps_low, 1 + module.clip_eps_high):
        assert ((ratio - edge).abs() > 2 * ratio * math.expm1(delta)).all(), "a ratio on the clip edge"
    entropy = float(out.entropy[mask].max())  # the largest: the bound then holds for the mean over any rows
    vocab = module.policy.config.vocab_size
    terms = (weights * advantages.abs() * torch.exp(out.logprobs - batch.sampler_logprobs))[mask]
    return {  # (absolute, relative to the value)
        "train/loss": (float(terms.sum()) * drift, 0.0),
        "train/ratio_mean": (float(ratio.mean()) * drift, 0.0),
        "train/entropy": (delta * (1 + entropy) + 2 * (gamma(vocab) + gamma(n)) * entropy, 0.0),
        "train/clip_fraction": (0.0, 2 * gamma(n)),
    }


def _assert_same_metrics(got: dict, want: dict, tolerances: dict) -> None:
    for key, (absolute, relative) in tolerances.items():
        bound = absolute + relative * abs(want[key])
        assert abs(got[key] - want[key]) <= bound, (key, got[key], want[key], bound)


def _grpo(**kwargs) -> GRPO:  # noqa: ANN003
    torch.manual_seed(0)
    return GRPO(model_name_or_path="embedded:arithmetic", max_grad_norm=None, **kwargs)


# ------------------------------------------------------------------------------------------------ inert rows
@pytest.mark.parametrize("settings", [{}, {"micro_batch_size": 3}, {"num_minibatches": 2, "micro_batch_size": 2},
                                      {"num_iterations": 2, "loss_aggregation": "token_mean"}])
def test_skipping_zero_variance_groups_gives_the_same_gradient(monkeypatch, settings):
    module = _grpo(**settings)
    batch = _off_policy(module, _batch(MIXED))
    state = {k: v.clone() for k, v in module.state_dict().items()}
    runs = {}
    for skip in (False, True):
        module.load_state_dict(state)
        module.skip_inert_rows = skip
        runs[skip] = _update(module, batch, monkeypatch)
    (want, full, calls_full), (got, skipped, calls_skipped) = runs[False], runs[True]
    _assert_same_gradient(got, want, module, batch)
    assert full["train/skipped_rows"] == 0.0 and skipped["train/skipped_rows"] == 0.5
    assert module.forwarded_rows.tolist() == [r < 4 or 8 <= r < 12 for r in range(16)]  # groups 1 and 3 skipped
    assert calls_skipped < calls_full or "micro_batch_size" not in settings
    # loss values are every row's (an inert row's is 0); the loss is a sum of terms of both signs, whose per-row
    # log-probs round differently in other micro-batch shapes: bounded relative to Σ w |A| ρ
    _assert_same_metrics(skipped, full, {"train/loss": _metric_tolerances(module, batch)["train/loss"],
                                         "train/grad_norm": (_grad_norm_tolerance(got, want), 0.0)})


@pytest.mark.parametrize("cls", [PolicyGradient, REINFORCE, RLOO, SPO, FlashREINFORCE])
def test_the_reinforce_family_skips_zero_advantage_rows_with_the_same_gradient(monkeypatch, cls):
    torch.manual_seed(0)
    kwargs = {"prioritized": False} if cls is SPO else {"baseline": "none"} if cls is REINFORCE else {}
    if cls is FlashREINFORCE:
        kwargs = {"delta": float("inf")}  # no gate: the keep fraction is 1 either way
    module = cls(model_name_or_path="embedded:arithmetic", max_grad_norm=None, micro_batch_size=5, **kwargs)
    rewards = [1.0, 1.0, 1.0, 1.0] + SPREAD[4:] if cls is RLOO else SPREAD  # RLOO: a constant group
    if cls is SPO:  # SPO: A = 0 where R equals the batch mean of R - v̂ (0.5 here, v̂ = 0.5)
        rewards = [1.0, 0.0] * 4 + [0.5] * 8
    if cls is FlashREINFORCE:
        rewards = [0.5] * 8 + [0.0, 1.0] * 4  # batch mean 0.5
    batch = _off_policy(module, _batch(rewards))
    state = {k: v.clone() for k, v in module.state_dict().items()}

    runs = {}
    for skip in (False, True):
        module.load_state_dict(state)
        if cls is SPO:  # the tracker took the first run's outcomes
            module.tracker.clear(), module.last_response.clear()
        module.skip_inert_rows = skip
        runs[skip] = _update(module, batch, monkeypatch)
    _assert_same_gradient(runs[True][0], runs[False][0], module, batch)
    assert runs[True][1]["train/skipped_rows"] > 0
    if cls is FlashREINFORCE:  # a skipped row counts as kept: Σ of the rows' weights, n = tokens + rows terms
        n = int(batch.loss_mask.sum()) + batch.num_rows
        assert runs[True][1]["train/trajectory_keep_fraction"] == pytest.approx(1.0, rel=gamma(n))


def test_a_contributing_kl_term_switches_skipping_off(monkeypatch):
    module = _grpo(micro_batch_size=4)
    batch = _off_policy(module, _batch(MIXED))
    state = {k: v.clone() for k, v in module.state_dict().items()}
    runs = {}
    for name, skip, terms in (("off", False, [KLRegularizer(beta=0.1, target="sampler")]),
                              ("kl", True, [KLRegularizer(beta=0.1, target="sampler")]),
                              ("no-kl", True, [KLRegularizer(beta=0.0)])):
        module.load_state_dict(state)
        module.skip_inert_rows = skip
        runs[name] = _update(module, batch, monkeypatch, terms)
    assert runs["kl"][1]["train/skipped_rows"] == 0.0  # a constant group still gets the KL's gradient
    for want, got in zip(runs["off"][0][0], runs["kl"][0][0]):
        assert torch.equal(got, want)  # nothing skipped: the very same computation
    assert runs["kl"][1]["train/kl"] > 0
    assert runs["no-kl"][1]["train/skipped_rows"] == 0.5  # beta = 0 promises nothing


def test_a_loss_term_without_contributes_counts_as_contributing(monkeypatch):
    from rl_lightning.algorithms import LossTerm

    class Nothing(LossTerm):
        def loss_term(self, module, batch, logprobs, weights):  # noqa: ANN001, ANN201
            return logprobs.new_zeros(()), {}

    class Idle(Nothing):
        def contributes(self, module) -> bool:  # noqa: ANN001
            return False

    module = _grpo()
    batch = _off_policy(module, _batch(MIXED))
    assert _update(module, batch, monkeypatch, [Nothing()])[1]["train/skipped_rows"] == 0.0
    assert _update(module, batch, monkeypatch, [Idle()])[1]["train/skipped_rows"] == 0.5


@pytest.mark.parametrize("micro_batch_size", [None, 3])
def test_an_all_skipped_batch_gives_a_zero_gradient_and_no_nan(monkeypatch, micro_batch_size):
    module = _grpo(micro_batch_size=micro_batch_size)
    batch = _off_policy(module, _batch([1.0] * 4 + [0.0] * 4 + [0.5] * 4 + [1.0] * 4))
    steps, metrics, backwards = _update(module, batch, monkeypatch)
    assert metrics["train/skipped_rows"] == 1.0
    assert backwards == 1  # one zero-contribution row keeps the backward (a collective under DDP)
    assert int(module.forwarded_rows.sum()) == 1
    (grads,) = steps
    assert all(g is not None and torch.equal(g, torch.zeros_like(g)) for g in grads)  # as without skipping
    assert metrics["train/grad_norm"] == 0.0 and metrics["train/loss"] == 0.0
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


class _Constant(RewardFunction):
    def __call__(self, prompt: Prompt, response: str) -> float:
        return 1.0


def test_an_all_skipped_step_trains_on_and_logs(tmp_path, recorder):
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:arithmetic", micro_batch_size=4,
                  optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0))
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[recorder])
    trainer.fit(module, datamodule=tiny_datamodule(reward_fn=_Constant()))
    assert trainer.global_step == 2
    for metrics in recorder.metrics:
        assert metrics["train/skipped_rows"] == 1.0 and metrics["train/zero_std_fraction"] == 1.0
        assert metrics["train/grad_norm"] == 0.0 and metrics["train/loss"] == 0.0
        assert all(v == v for v in metrics.values())  # no NaN
    after = module.policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # Adam's step of a zero gradient is 0


def test_ppo_trpo_and_cope_never_skip(monkeypatch):
    batch = _batch([1.0] * 16)
    torch.manual_seed(0)
    ppo = PPO(model_name_or_path="embedded:arithmetic", micro_batch_size=4)
    _, metrics, backwards = _update(ppo, batch, monkeypatch)
    zero = Advantages(torch.zeros(16, 1))
    assert ppo.inert_rows(batch, zero) is None  # a value loss: every row has a gradient
    assert metrics["train/skipped_rows"] == 0.0 and backwards == 4
    assert TRPO(model_name_or_path="embedded:random").inert_rows(batch, zero) is None
    # CoPE is a GRPO that declares False: its forecasting term (extra_losses) is not zero on successful rows
    assert GRPO.zero_advantage_rows_are_inert and not CoPE.zero_advantage_rows_are_inert
    assert CoPE(model_name_or_path="embedded:arithmetic").inert_rows(batch, zero) is None


def test_inert_rows_follow_the_class_declaration():
    class NewTerm(GRPO):  # a term that is not zero on a zero-advantage row: the class declares False
        zero_advantage_rows_are_inert = False

        def extra_losses(self, batch, out, adv, weights):  # noqa: ANN001, ANN201
            return [(-(out.logprobs * batch.loss_mask).sum(), {})]

    class Redeclared(NewTerm):
        zero_advantage_rows_are_inert = True

    class NewBaseline(GRPO):  # advantages only: the loss is GRPO's, and so is its declaration
        def compute_advantages(self, batch):  # noqa: ANN001, ANN201
            return super().compute_advantages(batch)

    batch = _batch(MIXED)
    adv = Advantages(GRPO(model_name_or_path="embedded:random").compute_advantages(batch).unsqueeze(-1))
    assert NewTerm(model_name_or_path="embedded:random").inert_rows(batch, adv) is None
    expect = [r in range(4, 8) or r in range(12, 16) for r in range(16)]
    assert Redeclared(model_name_or_path="embedded:random").inert_rows(batch, adv).tolist() == expect
    assert NewBaseline(model_name_or_path="embedded:random").inert_rows(batch, adv).tolist() == expect
    entropy = GRPO(model_name_or_path="embedded:random")
    entropy.needs_entropy = True  # e.g. an entropy bonus: a zero-advantage row still has a gradient
    assert entropy.inert_rows(batch, adv) is None
    # per-token advantages: inert when zero on every generated token; padding does not count
    per_token = adv.advantages.expand(16, 8) * batch.loss_mask
    per_token[0, 7] = 0.0  # row 0 (length 8) stays live through its other tokens
    per_token[1, 0], per_token[1, 5] = 0.0, 3.0  # row 1 (length 1): zero on its token, not on padding
    expect[1] = True
    assert GRPO(model_name_or_path="embedded:random").inert_rows(batch, Advantages(per_token)).tolist() == expect


def test_the_switches_are_validated():
    with pytest.raises(ValueError, match="skip_inert_rows must be true or false"):
        GRPO(model_name_or_path="embedded:random", skip_inert_rows="yes")
    with pytest.raises(ValueError, match="length_bucketing must be true or false"):
        GRPO(model_name_or_path="embedded:random", length_bucketing=1)


# ------------------------------------------------------------------------------------------------ padding
@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean"])
def test_length_bucketing_gives_the_same_gradient(monkeypatch, aggregation):
    module = _grpo(loss_aggregation=aggregation)
    batch = _off_policy(module, _batch(SPREAD))
    state = {k: v.clone() for k, v in module.state_dict().items()}
    runs = []
    for micro, bucketing in ((None, False), (None, True), (1, True), (2, True), (2, False), (5, True)):
        module.load_state_dict(state)
        module.micro_batch_size, module.length_bucketing = micro, bucketing
        runs.append(_update(module, batch, monkeypatch))
    want = runs[0][0]
    for got, *_ in runs[1:]:
        _assert_same_gradient(got, want, module, batch)
    assert all(run[1]["train/skipped_rows"] == 0.0 for run in runs)
    # the loss cancels (advantages are zero-mean per group): bounded relative to Σ w |A| ρ, not to itself
    metric_tolerances = _metric_tolerances(module, batch)
    for run in runs[1:]:
        _assert_same_metrics(run[1], runs[0][1], {k: metric_tolerances[k] for k in (
            "train/loss", "train/clip_fraction", "train/ratio_mean", "train/entropy")})


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_length_bucketing_slices_per_token_advantages_ppo(monkeypatch, critic):
    torch.manual_seed(0)
    module = PPO(model_name_or_path="embedded:arithmetic", critic=critic, max_grad_norm=None)
    batch = _off_policy(module, _batch(SPREAD))
    state = {k: v.clone() for k, v in module.state_dict().items()}
    runs = []
    for micro, bucketing in ((None, False), (3, True), (1, True)):
        module.load_state_dict(state)
        module.micro_batch_size, module.length_bucketing = micro, bucketing
        runs.append(_update(module, batch, monkeypatch))
    for got, *_ in runs[1:]:
        _assert_same_gradient(got, runs[0][0], module, batch)


def _plan(module, batch: RolloutBatch) -> list[tuple[int, int, torch.Tensor, list[torch.Tensor]]]:  # noqa: ANN001
    """``(iteration, minibatch index, rows, micro-batches)`` of each optimiser step of ``module``'s plan for
    ``batch`` (advantages 1 everywhere: no row is inert)."""
    plan = UpdatePlan.build(module, batch, Advantages(torch.ones(batch.num_rows, 1)),
                            torch.ones(batch.loss_mask.shape), [])
    return [(step.iteration, step.index, step.rows, step.micros) for step in plan]


def test_micro_batches_hold_rows_of_similar_length_deterministically():
    module = _grpo(micro_batch_size=4, num_minibatches=2)
    batch = _batch(SPREAD)
    plans = [_plan(module, batch), _plan(module, batch)]
    assert [[m.tolist() for m in micros] for *_, micros in plans[0]] == \
           [[m.tolist() for m in micros] for *_, micros in plans[1]]
    minibatches = minibatch_rows(16, 2, module.seed, 0, 0, torch.device("cpu"))
    for (iteration, index, rows, micros), want in zip(plans[0], minibatches):
        assert (iteration, rows.tolist()) == (0, want.tolist())  # the minibatch's rows, micro-batches of them
        assert sorted(r for m in micros for r in m.tolist()) == sorted(want.tolist())
        lengths = [LENGTHS[r] for m in micros for r in m.tolist()]
        assert lengths == sorted(lengths, reverse=True)  # longest first within each minibatch
    rows = sorted(r for *_, micros in plans[0] for m in micros for r in m.tolist())
    assert rows == list(range(16))  # every row once per pass
    module.length_bucketing = False
    assert [m.tolist() for m in _plan(module, batch)[0][3]] == [m.tolist() for m in minibatches[0].split(4)]


def test_trim_padding_cuts_unused_columns_and_keeps_the_log_probs():
    module = _grpo()
    batch = _batch(SPREAD)
    rows = torch.tensor([1, 10, 11])  # responses of 1, 2 and 1 tokens, prompts of 3, 4 and 4 tokens (of 6, 8)
    part = batch.select(rows)
    cut = trim_padding(part)
    assert cut.prompt_length == 4 and cut.loss_mask.shape == (3, 2) and cut.input_ids.shape == (3, 6)
    assert torch.equal(cut.response_ids, part.response_ids[:, :2])
    assert torch.equal(cut.input_ids[:, :4], part.input_ids[:, 2:6])
    with torch.no_grad():
        full, short = module.forward_policy(part).logprobs, module.forward_policy(cut).logprobs
    torch.testing.assert_close(short, full[:, :2], rtol=0, atol=1e-5)
    assert torch.equal(full[:, 2:], torch.zeros_like(full[:, 2:]))
    # a per-row tensor that may be per-token blocks the cut; per-row scalars follow it
    part.extras["per_token"] = torch.zeros(3, 8)
    assert trim_padding(part) is part
    part.extras.pop("per_token")
    part.extras["per_row"] = torch.ones(3)
    assert trim_padding(part).extras["per_row"].shape == (3,)
    assert trim_padding(cut) is cut  # nothing left to cut


def test_the_kl_term_declares_whether_it_contributes():
    assert KLRegularizer(beta=0.0).contributes(SimpleNamespace()) is False
    assert KLRegularizer(beta=0.05).contributes(SimpleNamespace()) is True
