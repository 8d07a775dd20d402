"""``KLRegularizer``'s term has the direction and sign each target calls for, on hand-computed numbers."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rl_lightning.algorithms import GRPO
from rl_lightning.algorithms.metrics import plain
from rl_lightning.callbacks import KLRegularizer
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.tolerances import log_softmax_tolerance, sum_tolerance


def _term(target: str, estimator: str, logp: torch.Tensor, other: torch.Tensor, beta: float = 1.0):
    """The callback's term and logged KL for one row of tokens (token-mean weights)."""
    mask = torch.ones_like(logp)
    batch = SimpleNamespace(sampler_logprobs=other, ref_logprobs=other, loss_mask=mask)
    weights = mask / mask.sum()
    cb = KLRegularizer(beta=beta, estimator=estimator, target=target)
    return cb.loss_term(None, batch, logp, weights)


def test_kl_to_the_sampler_is_log_q_minus_log_p_and_pulls_toward_the_sampler():
    # Tinker's KL to the sampler (StableReinforce; docs/algorithms.md): L_KL = beta * sum_t [log q - log p_theta]
    logp = torch.tensor([[-1.2]], requires_grad=True)
    logq = torch.tensor([[-0.5]])
    term, stats = _term("sampler", "k1", logp, logq, beta=2.0)
    assert float(term) == pytest.approx(2.0 * 0.7)
    assert float(plain(stats["train/kl"])) == pytest.approx(0.7)
    term.backward()
    assert float(logp.grad) == pytest.approx(-2.0)  # minimising raises log p of the sampler's token


def test_k3_to_the_sampler_is_the_k3_of_kl_q_p():
    logp, logq = torch.tensor([[-1.2]]), torch.tensor([[-0.5]])
    term, _ = _term("sampler", "k3", logp, logq)
    r = math.exp(-1.2 + 0.5)  # p / q at a token drawn from q
    assert float(term) == pytest.approx(r - 1 - math.log(r))


def test_kl_to_the_reference_keeps_grpos_direction():
    # GRPO's KL (Shao et al. 2024, eq. 4): k3 of KL(pi_theta || pi_ref) with r = pi_ref / pi_theta at tokens from
    # pi_old ~ pi_theta
    logp, logref = torch.tensor([[-1.2]]), torch.tensor([[-0.5]])
    term, _ = _term("reference", "k3", logp, logref)
    r = math.exp(-0.5 + 1.2)
    assert float(term) == pytest.approx(r - 1 - math.log(r))


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_to_the_sampler_has_the_gradient_of_kl_q_p_in_expectation(estimator):
    # Exact expectation over tokens a ~ q of a 3-token vocabulary: E_q[term] and E_q[d term / d logits].
    q = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(torch.tensor([0.2, 0.3, 0.5])).requires_grad_(True)
    logp_all = torch.log_softmax(logits, -1)
    expected_term, expected_grad = torch.zeros(()), torch.zeros(3)
    for a in range(3):
        term, _ = _term("sampler", estimator, logp_all[a].reshape(1, 1), q[a].log().reshape(1, 1))
        (grad,) = torch.autograd.grad(term, logits, retain_graph=True)
        expected_term = expected_term + q[a] * term.detach()
        expected_grad = expected_grad + q[a] * grad
    p = logp_all.exp().detach()
    kl_qp = float((q * (q.log() - p.log())).sum())
    # float32: the log-probs within log_softmax_tolerance, each term a few roundings (log r, exp, x q: <= 8) of
    # size q (r + 1 + |log r|), r = p/q or q/p, and 3 of them summed; the gradient's terms q (1 + r) (e_a - p)
    log_r = (q.log() - p.log()).abs()
    size = float((q * (log_r.exp() + 1 + log_r)).sum())
    tol = log_softmax_tolerance(logits.detach()) * size + sum_tolerance(8 + 3, size)
    if estimator == "k1":
        assert abs(float(expected_term) - kl_qp) <= tol  # unbiased for KL(q || p)
    assert kl_qp > 0.4
    torch.testing.assert_close(expected_grad, p - q, rtol=0, atol=2 * tol)  # grad of KL(q || p) wrt logits


def test_prepare_fills_the_reference_logprobs_once_per_rollout_batch(tmp_path):
    """``prepare`` (a ``LossTerm`` hook) runs once per rollout batch, before the advantages, whatever the number of
    optimiser steps, and returns a new batch with the frozen reference's log-probs; the rollout is not written to."""
    calls = []

    class Recording(KLRegularizer):
        def prepare(self, module, batch):  # noqa: ANN001, ANN201
            prepared = super().prepare(module, batch)
            calls.append((batch, prepared))
            return prepared

    kl = Recording(beta=0.1)
    module = GRPO(model_name_or_path="embedded:arithmetic", num_iterations=2, num_minibatches=2,
                  optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    tiny_trainer(tmp_path, max_steps=2, callbacks=[kl]).fit(module, datamodule=tiny_datamodule())
    assert len(calls) == 2  # two rollout batches, of 4 optimiser steps each
    for given, prepared in calls:
        assert given.ref_logprobs is None and prepared is not given
        with torch.no_grad():
            want = module.token_logprobs(given, model=kl.reference)[0]
        assert torch.equal(prepared.ref_logprobs, want)  # the frozen reference's: the same forward, bit for bit
    off = KLRegularizer(beta=0.0)
    batch = calls[0][0]
    assert off.reference is None and off.prepare(module, batch) is batch  # beta = 0: no reference, nothing to add
