"""TRPO end to end on CPU: the accepted step stays inside the KL trust region, a rejected step changes nothing
(bit for bit) while still counting as the rollout's global step, the Fisher is symmetric positive, the
Gauss-Newton products (the default) take the double-backward products' step, and the GAE critic variant
trains."""

from __future__ import annotations

import pytest
import torch

from rl_lightning.algorithms import Advantages
from rl_lightning.algorithms.trpo import TRPO
from rl_lightning.functional.trpo import categorical_kl
from rl_lightning.rollout.generation import position_ids_from_mask
from tests.conftest import RecordRollouts, tiny_datamodule, tiny_trainer
from tests.tolerances import (
    decoder_gradient_tolerance, decoder_logit_tolerance, decoder_logprob_bound, gamma_probabilistic, unit_roundoff,
)


def _product_rounding(module: TRPO, batch) -> float:  # noqa: ANN001
    """Relative float32 rounding of one Fisher-vector product (``decoder_gradient_tolerance`` with 4 passes: a
    forward, a backward and their derivatives), relative to the magnitude of its terms."""
    return float(decoder_gradient_tolerance(module.policy.config, batch.input_ids.shape[1], batch.input_ids.numel(),
                                            1.0, passes=4))


def _params(module: TRPO) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


class KeepBatches(RecordRollouts):
    """Also keeps each rollout batch and the policy weights before its update."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list = []
        self.before: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.batches.append(batch)
        self.before.append(_params(pl_module))


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    """One TRPO step (δ = 0.01) on 4 prompts x 4 responses of the warm-started arithmetic policy."""
    torch.manual_seed(0)
    module = TRPO(model_name_or_path="embedded:arithmetic", delta=0.01)
    keep = KeepBatches()
    trainer = tiny_trainer(tmp_path_factory.mktemp("trpo"), max_steps=1, callbacks=[keep])
    trainer.fit(module, datamodule=tiny_datamodule())
    return module, trainer, keep


def test_accepted_step_stays_inside_the_trust_region_and_moves_the_weights(one_step):
    module, trainer, keep = one_step
    metrics = keep.metrics[0]
    assert trainer.global_step == 1
    assert metrics["train/step_accepted"] == 1.0
    assert metrics["train/surrogate_improvement"] > 0
    assert metrics["train/grad_norm"] > 0
    # on-policy: the learner reproduces the sampler, to float32 rounding of the two forwards
    context = module.policy.config.max_position_embeddings
    assert metrics["train/sampler_logp_diff"] <= decoder_logprob_bound(module.policy, 1.0, context)
    assert metrics["train/loss"] == -metrics["train/surrogate"]  # the fixed name every method logs
    after = _params(module)
    assert any(not torch.equal(keep.before[0][k], after[k]) for k in after)
    # Measure KL(π_old ‖ π_new) independently: full-vocab log-probs on the same batch at the new and old weights.
    batch = keep.batches[0]
    with torch.no_grad():
        new = module.vocab_logprobs(batch)
        module.policy.load_state_dict(keep.before[0])
        old = module.vocab_logprobs(batch)
        module.policy.load_state_dict(after)
    kl = categorical_kl(old, new, batch.loss_mask)
    # these log-probs and the module's are float32 forwards of the same weights, within δ of each other (each
    # side); KL_t = Σ_v p_v (lo_v - ln_v) moves by Σ_v p_v (|lo_v - ln_v| + 1) δ + Σ_v p_v δ per token
    delta = decoder_logprob_bound(module.policy, 1.0, batch.input_ids.shape[1])
    mask = batch.loss_mask.bool()
    spread = float((old.exp() * (old - new).abs()).sum(-1)[mask].max())
    tol = (spread + 2) * delta
    assert 0 < kl <= module.delta + tol
    assert abs(float(kl) - metrics["train/kl_after_step"]) <= tol  # the logged KL is the applied step's


@pytest.mark.parametrize("method", ["gauss_newton", "double_backward"])
def test_fisher_vector_product_is_symmetric_positive(one_step, method):
    module, _, keep = one_step
    fvp = module.fisher_vector_product(keep.batches[0], damping=0.0, method=method)  # the bare Fisher: no damping
    dim = sum(p.numel() for p in module.trainable_parameters())
    gen = torch.Generator().manual_seed(0)
    u, v = torch.randn(dim, generator=gen), torch.randn(dim, generator=gen)
    fu, fv = fvp(u), fvp(v)
    assert float(v @ fv) > 0 and float(u @ fu) > 0  # vᵀFv > 0
    # symmetric: uᵀFv = vᵀFu up to float32 rounding of the two double-backward passes. Not derived: an a-priori
    # bound (_product_rounding of the products' terms, through the D = 1.1M-term dot products) exceeds uᵀFv
    # itself here, and the products stay partly float32 (the log-softmax) in a float64 module; measured 1.4e-5
    # relative (gauss_newton) and 1.8e-5 (double_backward), 1e-3 allows 50x
    assert abs(float(u @ fv) - float(v @ fu)) <= 1e-3 * (abs(float(u @ fv)) + 1e-8)
    # damping adds exactly damping * v: the same product again (within its rounding, relative to its largest
    # entry) plus 0.5 v (one rounding)
    eps = _product_rounding(module, keep.batches[0])
    atol = eps * float(fv.abs().max()) + 2 * unit_roundoff() * 0.5 * float(v.abs().max())
    torch.testing.assert_close(module.fisher_vector_product(keep.batches[0], damping=0.5, method=method)(v),
                               fv + 0.5 * v, atol=atol, rtol=2 * unit_roundoff())


def test_fisher_logits_are_the_full_forwards_with_each_prompt_through_the_network_once(one_step):
    module, _, keep = one_step
    batch = keep.batches[0]  # 4 prompts x 4 responses
    seen: list[tuple[int, int]] = []
    hook = module.policy.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        shared = module.fisher_logits(batch)
    finally:
        hook.remove()
    prompt, width = batch.prompt_length, batch.input_ids.shape[1] - batch.prompt_length
    # the 4 distinct prompts but their last token, then each row's last prompt token and response but its last
    assert seen == [(4, prompt - 1), (16, width)]
    with torch.no_grad():
        full = module.policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             position_ids=position_ids_from_mask(batch.attention_mask), logits_to_keep=width + 1,
                             use_cache=False).logits[:, :-1]
    assert shared.shape == full.shape and shared.requires_grad
    # the same function of the weights: equal to float32 rounding of the logits (other shapes, same arithmetic)
    torch.testing.assert_close(shared.detach(), full, rtol=0,
                               atol=decoder_logit_tolerance(module.policy, batch.input_ids.shape[1]))


def test_gauss_newton_and_double_backward_products_agree(one_step):
    # Two float32 evaluations of one matrix-vector product (tests/functional: equal to rounding in float64); each
    # within _product_rounding (decoder_gradient_tolerance, 4 passes: 3.7e-5 here) of the terms' size, taken in
    # norm (measured 3e-7..2e-6 relative on this batch); vᵀFv by Cauchy-Schwarz, plus its D-term dot products.
    module, _, keep = one_step
    eps = _product_rounding(module, keep.batches[0])
    gauss = module.fisher_vector_product(keep.batches[0], damping=0.0, method="gauss_newton")
    double = module.fisher_vector_product(keep.batches[0], damping=0.0, method="double_backward")
    dim = sum(p.numel() for p in module.trainable_parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        v = torch.randn(dim, generator=gen, dtype=torch.float64)
        fg, fd = gauss(v), double(v)
        assert float((fg - fd).norm() / fd.norm()) <= eps
        # and the quadratic forms as far apart as the products allow (Cauchy-Schwarz), plus their dots' rounding
        dots = gamma_probabilistic(dim) * float(v.abs() @ (fg.abs() + fd.abs()))
        assert abs(float(v @ fg) - float(v @ fd)) <= float(v.norm() * (fg - fd).norm()) + dots


class _Plain:
    """What ``update`` needs of Lightning's optimiser wrapper, around a plain SGD(lr=1)."""

    def __init__(self, params) -> None:  # noqa: ANN001
        self.optimizer = torch.optim.SGD(params, lr=1.0)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        self.optimizer.step()


def _step_of(module: TRPO, batch, method: str, cg_iters: int, monkeypatch) -> tuple[torch.Tensor, dict]:  # noqa: ANN001
    """The parameter change of one ``update`` from the current weights (restored afterwards) and its metrics."""
    state = _params(module)
    before = torch.nn.utils.parameters_to_vector(module.trainable_parameters()).detach().clone()
    optimizer = _Plain(module.policy.parameters())
    monkeypatch.setattr(module, "optimizers", lambda: optimizer)
    monkeypatch.setattr(module, "fisher_product", method)
    monkeypatch.setattr(module, "cg_iters", cg_iters)
    advantages = Advantages(module.compute_advantages(batch).detach().unsqueeze(-1))
    stats = module.update(batch, advantages, module.loss_weights(batch))
    step = torch.nn.utils.parameters_to_vector(module.trainable_parameters()).detach() - before
    module.policy.load_state_dict(state)
    return step, {k: float(v[0]) for k, v in stats.items()}


@pytest.mark.parametrize("cg_iters", [1, 5])
def test_both_fisher_products_take_the_same_step(one_step, monkeypatch, cg_iters):
    # Same g (the same code), products equal to ~1e-6 relative (above), float64 CG: the direction, its scale (from
    # CG's residual here, from an 11th product there) and the accepted step agree to that rounding times CG's
    # amplification, measured <= 5e-6 up to 7 iterations on this batch: 1e-4 allows 20x. (Past ~7 iterations CG in
    # float32 products amplifies rounding ~10x per iteration, for either path on its own too: see
    # test_at_ten_cg_iterations_both_paths_differ_only_as_much_as_rounding_moves_either.)
    module, _, keep = one_step
    batch = keep.batches[0]
    old, old_stats = _step_of(module, batch, "double_backward", cg_iters, monkeypatch)
    new, new_stats = _step_of(module, batch, "gauss_newton", cg_iters, monkeypatch)
    assert old_stats["train/step_accepted"] == new_stats["train/step_accepted"] == 1.0
    assert old_stats["train/line_search_steps"] == new_stats["train/line_search_steps"]
    assert float((new - old).norm() / old.norm()) < 1e-4
    for key in ("train/kl_after_step", "train/expected_improvement", "train/surrogate_improvement"):
        assert new_stats[key] == pytest.approx(old_stats[key], rel=1e-4)
    assert new_stats["train/grad_norm"] == old_stats["train/grad_norm"]  # g is computed the same way, bit for bit


def test_at_ten_cg_iterations_both_paths_differ_only_as_much_as_rounding_moves_either(one_step, monkeypatch):
    # With cg_iters 10 the last CG iterations amplify float32 rounding of the products (~10x per iteration): the
    # double-backward path against itself, its products perturbed by 1e-6 relative (the size of the two paths'
    # product difference), moves about as far as the Gauss-Newton path is from it (measured 6.4e-3 and 9.6e-3;
    # 1e-7, float32's epsilon, already moves it 1.7e-3). The yardstick is measured here, not assumed.
    module, _, keep = one_step
    batch = keep.batches[0]
    old, old_stats = _step_of(module, batch, "double_backward", 10, monkeypatch)
    new, new_stats = _step_of(module, batch, "gauss_newton", 10, monkeypatch)
    import rl_lightning.algorithms.trpo as trpo

    gen = torch.Generator().manual_seed(0)
    exact = trpo.fisher_vector_product

    def perturbed(kl, params, damping):  # noqa: ANN001
        product = exact(kl, params, damping)

        def noisy(v):  # noqa: ANN001
            out = product(v)
            return out * (1 + 1e-6 * torch.randn(out.shape, generator=gen, dtype=out.dtype))
        return noisy

    monkeypatch.setattr(trpo, "fisher_vector_product", perturbed)
    jittered, _ = _step_of(module, batch, "double_backward", 10, monkeypatch)
    rounding = float((jittered - old).norm() / old.norm())
    difference = float((new - old).norm() / old.norm())
    assert 0 < rounding < 0.05 and difference < 0.05
    assert difference < 5 * rounding
    assert old_stats["train/line_search_steps"] == new_stats["train/line_search_steps"]
    assert new_stats["train/kl_after_step"] == pytest.approx(old_stats["train/kl_after_step"], rel=0.05)


class _RecordTrials(TRPO):
    """Records ``(surrogate improvement, measured KL)`` of every line-search trial."""

    def accept_step(self, improvement, kl):  # noqa: ANN001
        self.trials.append((float(improvement), float(kl)))
        return super().accept_step(improvement, kl)


def test_line_search_backtracks_when_the_quadratic_step_overshoots_the_trust_region(tmp_path, recorder):
    # With δ = 1 nat the quadratic model under-estimates the KL: the full step measures KL ≈ 1.12 > δ on this
    # batch, so it must be refused and the half step (KL ≈ 0.16) taken.
    module = _RecordTrials(model_name_or_path="embedded:arithmetic", delta=1.0)
    module.trials = []
    tiny_trainer(tmp_path, max_steps=1, callbacks=[recorder]).fit(module, datamodule=tiny_datamodule())
    first_improvement, first_kl = module.trials[0]
    assert first_kl > module.delta  # the precondition of this test: the full step leaves the trust region
    metrics = recorder.metrics[0]
    assert metrics["train/step_accepted"] == 1.0
    assert metrics["train/line_search_steps"] == len(module.trials) - 1 >= 1
    assert metrics["train/kl_after_step"] <= module.delta
    assert metrics["train/kl_after_step"] == pytest.approx(module.trials[-1][1])


class _NeverAccept(TRPO):
    """Rejects every trial step of the line search, after recording the KL each trial really had."""

    def accept_step(self, improvement, kl):  # noqa: ANN001
        self.trial_kls.append(float(kl))
        return False


def test_rejected_step_leaves_every_weight_bit_identical_and_still_counts_one_step(tmp_path, recorder):
    module = _NeverAccept(model_name_or_path="embedded:arithmetic", delta=0.01, backtrack_iters=2)
    module.trial_kls = []
    before = _params(module)
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[recorder])
    trainer.fit(module, datamodule=tiny_datamodule())
    assert trainer.global_step == 1  # one global step per rollout batch, even when nothing changed
    assert len(module.trial_kls) == 3  # full step, 1/2, 1/4: backtrack_iters + 1 trials
    assert all(kl > 0 for kl in module.trial_kls)  # the trials really moved the weights...
    after = _params(module)
    assert all(torch.equal(before[k], after[k]) for k in before)  # ...and they were restored bit for bit
    metrics = recorder.metrics[0]
    assert metrics["train/step_accepted"] == 0.0
    assert metrics["train/line_search_steps"] == 3.0  # backtrack_iters + 1
    assert metrics["train/kl_after_step"] == 0.0
    assert metrics["train/surrogate_improvement"] == 0.0


class _NoSignal(TRPO):
    """All-zero advantages: g = 0, so no step can improve the surrogate."""

    def compute_advantages(self, batch):  # noqa: ANN001
        return torch.zeros_like(batch.rewards)


def test_zero_advantages_are_rejected_by_the_line_search(tmp_path, recorder):
    module = _NoSignal(model_name_or_path="embedded:arithmetic", backtrack_iters=1)
    before = _params(module)
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[recorder])
    trainer.fit(module, datamodule=tiny_datamodule())
    assert trainer.global_step == 1
    assert all(torch.equal(before[k], v) for k, v in _params(module).items())
    assert recorder.metrics[0]["train/step_accepted"] == 0.0
    assert recorder.metrics[0]["train/grad_norm"] == 0.0
    assert recorder.metrics[0]["train/line_search_steps"] == 2.0


@pytest.mark.parametrize("delta", [0.0, -0.01])
def test_non_positive_delta_is_refused(delta):
    with pytest.raises(ValueError, match="delta"):
        TRPO(model_name_or_path="embedded:random", delta=delta)


def test_other_settings_are_validated():
    with pytest.raises(ValueError, match="backtrack_coeff"):
        TRPO(model_name_or_path="embedded:random", backtrack_coeff=1.0)
    with pytest.raises(ValueError, match="num_minibatches"):
        TRPO(model_name_or_path="embedded:random", num_minibatches=2)
    with pytest.raises(ValueError, match="fisher_product"):
        TRPO(model_name_or_path="embedded:random", fisher_product="exact")


def test_gae_estimator_fits_the_critic_and_counts_one_step_per_rollout(tmp_path, recorder):
    # (with the Fisher estimated on every 2nd row; the line search still measures the KL on the whole batch)
    module = TRPO(model_name_or_path="embedded:arithmetic", advantage_estimator="gae", critic_steps=2,
                  fisher_subsample=2)
    head_before = module.critic.head.proj.weight.detach().clone()
    before = _params(module)
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[recorder])
    trainer.fit(module, datamodule=tiny_datamodule())
    assert trainer.global_step == 2  # the critic's Adam steps are inner steps, not global ones
    for metrics in recorder.metrics:
        assert metrics["train/value_loss"] > 0
        assert "train/explained_variance" in metrics
        assert metrics["train/step_accepted"] == 1.0
        assert 0 < metrics["train/kl_after_step"] <= module.delta  # accept_step: kl <= δ, the same float
    assert not torch.equal(head_before, module.critic.head.proj.weight)  # the critic learned
    assert any(not torch.equal(before[k], v) for k, v in _params(module).items())  # and the policy moved


def test_top_p_below_one_warns_that_the_trust_region_is_on_truncated_distributions(tmp_path):
    with pytest.warns(UserWarning, match="top_p=0.9.*KL infinite"):
        tiny_trainer(tmp_path, max_steps=1).fit(TRPO(model_name_or_path="embedded:arithmetic"),
                                                datamodule=tiny_datamodule(top_p=0.9))


def test_fisher_logits_of_a_model_with_dropout_in_training_take_the_full_forward(one_step, monkeypatch):
    # a shared prompt would draw one dropout mask for the whole group: with dropout active every row is forwarded
    module, _, keep = one_step
    batch = keep.batches[0]
    monkeypatch.setattr(module.policy.config, "attention_dropout", 0.1)
    seen: list[tuple[int, int]] = []
    hook = module.policy.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    training = module.policy.training
    try:
        module.policy.eval()
        module.fisher_logits(batch)  # eval mode: dropout off, the prompts are shared
        module.policy.train()
        with torch.no_grad():
            module.fisher_logits(batch)
    finally:
        hook.remove()
        module.policy.train(training)
    assert seen == [(4, batch.prompt_length - 1), (16, batch.input_ids.shape[1] - batch.prompt_length),
                    tuple(batch.input_ids.shape)]
