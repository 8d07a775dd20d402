"""TRPO end to end on CPU: the accepted step stays inside the KL trust region, a rejected step changes nothing
(bit for bit) while still counting as the rollout's global step, the Fisher is symmetric positive, and the GAE
critic variant trains."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from rl_lightning.algorithms.trpo import TRPO
from rl_lightning.functional.trpo import categorical_kl
from tests.conftest import RecordRollouts, tiny_datamodule, tiny_trainer


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
    assert metrics["train/sampler_logp_diff"] < 1e-5  # on-policy: the learner reproduces the sampler
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
    assert 0 < kl <= module.delta + 1e-6
    assert abs(float(kl) - metrics["train/kl_after_step"]) < 1e-6  # the logged KL is the applied step's


def test_fisher_vector_product_is_symmetric_positive(one_step):
    module, _, keep = one_step
    fvp = module.fisher_vector_product(keep.batches[0], damping=0.0)  # the bare Fisher: no damping
    dim = sum(p.numel() for p in module.trainable_parameters())
    gen = torch.Generator().manual_seed(0)
    u, v = torch.randn(dim, generator=gen), torch.randn(dim, generator=gen)
    fu, fv = fvp(u), fvp(v)
    assert float(v @ fv) > 0 and float(u @ fu) > 0  # vᵀFv > 0
    # symmetric: uᵀFv = vᵀFu (up to float32 rounding of the two double-backward passes)
    assert abs(float(u @ fv) - float(v @ fu)) <= 1e-3 * (abs(float(u @ fv)) + 1e-8)
    # damping adds exactly damping * v
    torch.testing.assert_close(module.fisher_vector_product(keep.batches[0], damping=0.5)(v), fv + 0.5 * v,
                               atol=1e-5, rtol=1e-4)


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
        assert 0 < metrics["train/kl_after_step"] <= module.delta + 1e-6
    assert not torch.equal(head_before, module.critic.head.proj.weight)  # the critic learned
    assert any(not torch.equal(before[k], v) for k, v in _params(module).items())  # and the policy moved


def test_top_p_below_one_warns_that_the_trust_region_is_on_truncated_distributions(tmp_path):
    with pytest.warns(UserWarning, match="top_p=0.9.*KL infinite"):
        tiny_trainer(tmp_path, max_steps=1).fit(TRPO(model_name_or_path="embedded:arithmetic"),
                                                datamodule=tiny_datamodule(top_p=0.9))
