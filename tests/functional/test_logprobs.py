"""Worked-example tests for ``rl_lightning.functional.logprobs`` and ``masked`` reductions."""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.functional import (
    masked_mean,
    masked_sum,
    masked_whiten,
    sampling_log_softmax,
    sampling_logprobs,
    top_p_mask,
)
from tests.tolerances import entropy_tolerance, log_softmax_tolerance, sum_tolerance

HAND_P = torch.tensor([0.5, 0.3, 0.15, 0.05])


def _rand_logits(seed=0, B=5, T=4, V=11):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen) * 2
    tokens = torch.randint(0, V, (B, T), generator=gen)
    return logits, tokens


# ---------------------------------------------------------------------------------------------------------------
# sampling_logprobs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_sampling_logprobs_matches_log_softmax(temperature):
    logits, tokens = _rand_logits()
    lp, ent = sampling_logprobs(logits, tokens, temperature=temperature)
    expected = torch.log_softmax(logits / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, expected, rtol=0, atol=log_softmax_tolerance(logits, temperature))
    assert ent is None
    assert lp.shape == tokens.shape


def test_temperature_actually_matters():
    logits, tokens = _rand_logits()
    a, _ = sampling_logprobs(logits, tokens, temperature=1.0)
    b, _ = sampling_logprobs(logits, tokens, temperature=0.5)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_chunk_size_does_not_change_results(top_p):
    logits, tokens = _rand_logits(seed=1, B=7)
    a, ea = sampling_logprobs(logits, tokens, temperature=0.8, top_p=top_p, chunk_size=1, with_entropy=True)
    b, eb = sampling_logprobs(logits, tokens, temperature=0.8, top_p=top_p, chunk_size=16, with_entropy=True)
    c, ec = sampling_logprobs(logits, tokens, temperature=0.8, top_p=top_p, chunk_size=3, with_entropy=True)
    lp_tol, ent_tol = log_softmax_tolerance(logits, 0.8), entropy_tolerance(logits, 0.8, float(ea.max()))
    torch.testing.assert_close(a, b, rtol=0, atol=lp_tol)
    torch.testing.assert_close(a, c, rtol=0, atol=lp_tol)
    torch.testing.assert_close(ea, eb, rtol=0, atol=ent_tol)
    torch.testing.assert_close(ea, ec, rtol=0, atol=ent_tol)


def test_sampling_logprobs_carry_gradient():
    logits, tokens = _rand_logits(seed=2)
    logits.requires_grad_(True)
    lp, _ = sampling_logprobs(logits, tokens, chunk_size=2)
    lp.sum().backward()
    # ∂ log softmax(z)_a / ∂z = e_a - softmax(z): components sum to 0 per position, up to p's relative error
    # (within log_softmax_tolerance, Σ p = 1) and the sum of the V + 1 terms, of magnitude 2
    torch.testing.assert_close(logits.grad.sum(-1), torch.zeros(tokens.shape), rtol=0,
                               atol=log_softmax_tolerance(logits) + sum_tolerance(logits.shape[-1] + 1, 2.0))


def test_entropy_hand_example():
    # logits [0, ln 2] → p = [1/3, 2/3]
    # H = -(1/3 ln 1/3 + 2/3 ln 2/3) = ln 3 - (2/3) ln 2 = 1.09861 - 0.46210 = 0.63651
    logits = torch.tensor([[[0.0, math.log(2.0)]]])
    _, ent = sampling_logprobs(logits, torch.tensor([[0]]), with_entropy=True)
    expected = math.log(3) - 2 / 3 * math.log(2)
    assert ent.item() == pytest.approx(expected, abs=entropy_tolerance(logits, 1.0, expected))


def test_entropy_random_matches_formula():
    logits, tokens = _rand_logits(seed=3)
    _, ent = sampling_logprobs(logits, tokens, temperature=1.3, with_entropy=True)
    logp = torch.log_softmax(logits / 1.3, -1)
    torch.testing.assert_close(ent, -(logp.exp() * logp).sum(-1), rtol=0,
                               atol=entropy_tolerance(logits, 1.3, float(ent.max())))
    assert (ent >= 0).all()
    assert not ent.requires_grad


# ---------------------------------------------------------------------------------------------------------------
# top-p
# ---------------------------------------------------------------------------------------------------------------


def test_top_p_mask_hand_distribution():
    # p = [0.5, 0.3, 0.15, 0.05]; mass strictly before each token: [0, 0.5, 0.8, 0.95]
    #   top_p = 0.8  : keep while mass_before < 0.8 → tokens 0, 1           (0.5 + 0.3 = 0.8 reaches top_p)
    #   top_p = 0.81 : → tokens 0, 1, 2
    #   top_p = 0.5  : → token 0 only
    #   top_p = 1e-6 : the top token is always kept
    logits = HAND_P.log()
    assert top_p_mask(logits, 0.8).tolist() == [True, True, False, False]
    assert top_p_mask(logits, 0.81).tolist() == [True, True, True, False]
    assert top_p_mask(logits, 0.5).tolist() == [True, False, False, False]
    assert top_p_mask(logits, 1e-6).tolist() == [True, False, False, False]
    assert top_p_mask(logits, 1.0).all()


def test_top_p_mask_unsorted_and_batched():
    # The same distribution permuted, in a batch: the mask follows the tokens, not their positions.
    perm = torch.tensor([2, 0, 3, 1])  # p = [0.15, 0.5, 0.05, 0.3]
    logits = torch.stack([HAND_P.log(), HAND_P[perm].log()])
    mask = top_p_mask(logits, 0.8)
    assert mask.tolist() == [[True, True, False, False], [False, True, False, True]]


def test_top_p_log_probs_are_renormalised_over_kept_tokens():
    # top_p = 0.8 keeps {0, 1} (mass 0.8): log p'(a) = log(p(a) / 0.8)
    logits = HAND_P.log().view(1, 1, 4).expand(1, 2, 4)
    tokens = torch.tensor([[0, 1]])
    lp, _ = sampling_logprobs(logits, tokens, top_p=0.8)
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.5 / 0.8), math.log(0.3 / 0.8)]]))
    # full distribution without `keep`: truncated tokens get -inf
    full = sampling_log_softmax(HAND_P.log(), top_p=0.8)
    assert torch.isinf(full[2:]).all() and (full[2:] < 0).all()
    torch.testing.assert_close(full[:2].exp().sum(), torch.tensor(1.0))


def test_keep_makes_truncated_sampled_token_finite():
    # Token 3 (p=0.05) lies outside the 0.8 nucleus. If it was sampled (e.g. off-policy), `keep` puts it back
    # in the support: support {0, 1, 3}, mass 0.85 → log p'(3) = log(0.05 / 0.85)
    logits = HAND_P.log().view(1, 1, 4)
    lp, ent = sampling_logprobs(logits, torch.tensor([[3]]), top_p=0.8, with_entropy=True)
    assert torch.isfinite(lp).all()
    assert lp.item() == pytest.approx(math.log(0.05 / 0.85), abs=log_softmax_tolerance(logits))
    assert torch.isfinite(ent).all()
    # kept tokens of the nucleus are renormalised over the same enlarged support
    lp_all = sampling_log_softmax(HAND_P.log(), top_p=0.8, keep=torch.tensor(3))
    torch.testing.assert_close(lp_all[[0, 1, 3]].exp(), torch.tensor([0.5, 0.3, 0.05]) / 0.85)
    assert torch.isinf(lp_all[2])
    # entropy on the truncated support: -Σ p' log p' over {0, 1, 3}, no NaN from the -inf entry
    p = torch.tensor([0.5, 0.3, 0.05]) / 0.85
    expected = -(p * p.log()).sum().item()
    assert ent.item() == pytest.approx(expected, abs=entropy_tolerance(logits, 1.0, expected))


# ---------------------------------------------------------------------------------------------------------------
# masked reductions
# ---------------------------------------------------------------------------------------------------------------


def test_masked_mean_and_sum_basics():
    x = torch.tensor([[1.0, 2.0, 9.0], [4.0, 100.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # all: (1 + 2 + 4) / 3 = 7/3
    assert masked_mean(x, m).item() == pytest.approx(7 / 3)
    assert masked_sum(x, m).item() == pytest.approx(7.0)
    # per row: [1.5, 4]
    torch.testing.assert_close(masked_mean(x, m, dim=1), torch.tensor([1.5, 4.0]))
    torch.testing.assert_close(masked_sum(x, m, dim=1), torch.tensor([3.0, 4.0]))
    # bool masks work too
    assert masked_mean(x, m.bool()).item() == pytest.approx(7 / 3)


def test_masked_mean_empty_mask_is_zero():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    m = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    assert masked_mean(x, torch.zeros(2, 2)).item() == 0.0
    torch.testing.assert_close(masked_mean(x, m, dim=1), torch.tensor([0.0, 3.0]))


def test_masked_whiten():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 6, generator=gen, dtype=torch.float64) * 3 + 5
    m = (torch.rand(4, 6, generator=gen) < 0.6).to(torch.float64)
    m[0, 0] = 1.0
    m[1, 1] = 0.0
    x[1, 1] = 1e6  # an unmasked outlier must not affect the statistics
    w = masked_whiten(x, m)
    n = m.sum()
    mean = (w * m).sum() / n
    var = ((w - mean) ** 2 * m).sum() / n  # population variance
    # float64: the mean μ of the n masked x is within gamma(n) of mean|x|, which shifts every w by that over σ; the
    # mean of the n w adds gamma(n + 4) of max|w|. The variance is v / (v + eps) = 1 - eps / v, plus twice the w's
    # relative error (the squares) and a mean of n squares (magnitude 1).
    k, masked = int(n), x[m.bool()]
    sigma, spread = float(masked.std(unbiased=False)), float(masked.abs().mean() / masked.std(unbiased=False))
    assert abs(mean.item()) <= sum_tolerance(k + 4, spread + float(w.abs().max()), torch.float64)
    assert var.item() == pytest.approx(1.0, abs=1e-8 / sigma**2 + sum_tolerance(2 * k + 8, 2 * (1 + spread),
                                                                                  torch.float64))
    assert torch.equal(w[m == 0], torch.zeros(int((m == 0).sum()), dtype=torch.float64))
    # hand example: masked values [1, 3] → mean 2, var 1 → [-1, 1]; the 50 is outside the mask → 0
    w = masked_whiten(torch.tensor([[1.0, 3.0, 50.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(w, torch.tensor([[-1.0, 1.0, 0.0]]))
    # shift_mean=False keeps the mean: [-1, 1] + 2 = [1, 3]
    w = masked_whiten(torch.tensor([[1.0, 3.0, 50.0]]), torch.tensor([[1.0, 1.0, 0.0]]), shift_mean=False)
    torch.testing.assert_close(w, torch.tensor([[1.0, 3.0, 0.0]]))
