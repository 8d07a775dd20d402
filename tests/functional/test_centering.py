"""Score centering, its Monte-Carlo form and truncated importance sampling (Score Centering: Marek & Ryabinin 2026,
arXiv 2609.20807; the Monte-Carlo form: Tinker's StableReinforce loss; docs/algorithms.md), checked on logit
gradients computed by autograd through the real losses."""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.functional import (
    mc_centered_loss,
    sampling_log_softmax,
    sampling_logprobs,
    sampling_logprobs_at,
    score_centered_loss,
    score_centering_coefficients,
    tail_ratio,
    truncated_importance_weights,
)

from tests.tolerances import (
    assert_small_relative, gamma, log_softmax_tolerance, softmax_gradient_tolerance, sum_tolerance, unit_roundoff,
)


def _tol(vocab: int, advantage: float, expectations: int = 1) -> float:
    """float64 rounding of the centred loss's logit gradient at one position, or of ``expectations`` nested sums
    of it over the vocabulary (``_expected_update``): the log-softmax backward and the centring add up ``2 V + 6``
    vectors of total size ``<= 6 |A|`` (``|e_a - p| + Σ_h |r_h| |e_h - p|``, ``Σ |r| <= Σ q + Σ p = 2``), each
    expectation ``V`` more terms; twice that for a comparison of two such computations."""
    return 2 * sum_tolerance(2 * vocab + 6 + expectations * vocab, 6 * abs(advantage), torch.float64)


def _one_position(p_logits: torch.Tensor, q: torch.Tensor, token: int, head: list[int], advantage: float,
                  cap: float | None = None) -> torch.Tensor:
    """The logit gradient at one position of the top-k centred loss (head ``head``, sampled ``token``)."""
    z = p_logits.clone().double().requires_grad_(True)
    logp = torch.log_softmax(z, -1)
    ids = torch.tensor(head)
    loss, _ = score_centered_loss(
        logp[token].view(1, 1), logp[ids].view(1, 1, -1), q[token].log().view(1, 1).double(),
        q[ids].log().view(1, 1, -1).double(), torch.tensor([[advantage]], dtype=torch.float64),
        torch.ones(1, 1), torch.ones(1, 1, dtype=torch.float64), cap)
    (grad,) = torch.autograd.grad(loss, z)
    return grad


def _random_pair(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(vocab, generator=gen, dtype=torch.float64) * 1.5
    q = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 1.5, -1)
    return z, q


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_vocabulary_centring_gives_minus_a_times_e_a_minus_q_whatever_p(seed):
    vocab = 7
    z, q = _random_pair(vocab, seed)
    advantage = 0.7
    for token in range(vocab):
        grad = _one_position(z, q, token, list(range(vocab)), advantage)
        expected = -advantage * (torch.nn.functional.one_hot(torch.tensor(token), vocab).double() - q)
        # float64 throughout; ρ = eps/eps = 1 on a full head, so r = q - p exactly up to rounding
        assert torch.allclose(grad, expected, rtol=0, atol=_tol(vocab, advantage)), (token, grad, expected)
    # p enters nowhere: another learner gives the same gradient
    other = _one_position(z * -2.0 + 1.0, q, 3, list(range(vocab)), advantage)
    assert torch.allclose(other, _one_position(z, q, 3, list(range(vocab)), advantage), rtol=0,
                          atol=_tol(vocab, advantage))


def test_uncentred_gradient_depends_on_p_where_the_centred_one_does_not():
    z, q = _random_pair(5, 3)
    grad = _one_position(z, q, 2, list(range(5)), 1.0)
    p = torch.softmax(z, -1)
    uncentred = -(torch.nn.functional.one_hot(torch.tensor(2), 5).double() - p)
    assert not torch.allclose(grad, uncentred, rtol=0, atol=_tol(5, 1.0))  # differ by more than rounding


def _expected_update(z: torch.Tensor, q: torch.Tensor, advantages: torch.Tensor, head: list[int] | None,
                     cap: float | None = None) -> torch.Tensor:
    """``E_{a~q}[∂ℓ/∂z]`` exactly: the sum over the vocabulary of q_a times the loss's gradient at token a;
    ``head=None``: the uncentred REINFORCE loss ``-A log p_a``."""
    total = torch.zeros_like(z)
    for token in range(z.numel()):
        if head is None:
            zz = z.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(-advantages[token] * torch.log_softmax(zz, -1)[token], zz)
        else:
            g = _one_position(z, q, token, head, float(advantages[token]), cap)
        total += q[token] * g
    return total


def test_on_policy_the_correction_changes_nothing_in_expectation():
    z, _ = _random_pair(6, 4)
    p = torch.softmax(z, -1)
    advantages = torch.tensor([1.0, -0.5, 0.3, 2.0, -1.0, 0.1], dtype=torch.float64)
    for head in ([0, 1, 2], list(range(6))):
        centred = _expected_update(z, p, advantages, head)
        plain = _expected_update(z, p, advantages, None)
        assert torch.allclose(centred, plain, rtol=0, atol=_tol(6, float(advantages.abs().max()), 1))


def test_a_constant_added_to_every_advantage_moves_the_uncentred_update_off_policy_not_the_centred_one():
    z, q = _random_pair(6, 5)
    advantages = torch.tensor([1.0, -0.5, 0.3, 2.0, -1.0, 0.1], dtype=torch.float64)
    shift = 3.0
    plain = _expected_update(z, q, advantages + shift, None) - _expected_update(z, q, advantages, None)
    p = torch.softmax(z, -1)
    # a difference of two expected updates of advantages up to max|A| + c: twice the rounding of one
    tol = 2 * _tol(6, float(advantages.abs().max()) + shift, 1)
    assert torch.allclose(plain, -shift * (q - p), rtol=0, atol=tol)  # the loss gradient: -c E_q[ψ] = -c (q - p)
    assert plain.abs().max() > 0.05  # the drift is real: E_q[ψ] = q - p is not 0 off-policy
    full = list(range(6))
    centred = _expected_update(z, q, advantages + shift, full) - _expected_update(z, q, advantages, full)
    assert centred.abs().max() <= tol
    for cap in (1.5, 1e9):  # the importance-weighted centring removes it too (weights <= cap: x cap)
        weighted = (_expected_update(z, q, advantages + shift, full, cap)
                    - _expected_update(z, q, advantages, full, cap))
        assert weighted.abs().max() <= tol * min(cap, 1 / float(q.min()))


def test_hand_computed_top1_example_of_the_notes():
    """p = (0.6, 0.4), q = (0.5, 0.5), head {0}: ρ = 0.5/0.4 = 1.25, r_0 = 0.5 - 1.25·0.6 = -0.25; the tail
    guess q̂_1 = ρ p_1 = 0.5 is exact here, so the centred expectation is 0 while the uncentred mean score is
    q - p = (-0.1, 0.1)."""
    p = torch.tensor([0.6, 0.4], dtype=torch.float64)
    q = torch.tensor([0.5, 0.5], dtype=torch.float64)
    rho = tail_ratio(p[:1].log(), q[:1].log())
    assert rho.item() == pytest.approx(1.25, rel=gamma(8, torch.float64))  # logs, exps, 1 - ·, a division
    r = score_centering_coefficients(p[:1].log(), q[:1].log())
    assert r.item() == pytest.approx(-0.25, rel=gamma(12, torch.float64))
    z = p.log()
    ones = torch.ones(2, dtype=torch.float64)
    plain = _expected_update(z, q, ones, None)  # = -(q - p) for A = 1
    assert torch.allclose(plain, torch.tensor([0.1, -0.1], dtype=torch.float64), rtol=0, atol=_tol(2, 1.0, 1))
    centred = _expected_update(z, q, ones, [0])
    assert centred.abs().max() <= _tol(2, 1.0, 1) * 1.25  # ρ = 1.25 scales the centring


def test_tail_ratio_is_clamped_when_the_head_covers_everything():
    logp = torch.log_softmax(torch.randn(4), -1)
    rho = tail_ratio(logp, logp)  # 1 - Σ = 0 (or a rounding residue) on both sides
    assert torch.isfinite(rho) and 0 < rho.item() < 1e6


def test_mc_estimator_logit_gradient_is_sparse_and_averages_to_the_exact_centred_one():
    vocab, k = 9, 8
    z, q = _random_pair(vocab, 6)
    token, advantage = 4, -1.3
    gen = torch.Generator().manual_seed(0)

    def grad_for(draws: torch.Tensor) -> torch.Tensor:
        zz = z.clone().requires_grad_(True)
        logp = torch.log_softmax(zz, -1)
        loss, _ = mc_centered_loss(logp[token].view(1, 1), logp[draws].view(1, 1, -1),
                                   torch.tensor([[advantage]], dtype=torch.float64), torch.ones(1, 1),
                                   torch.ones(1, 1, dtype=torch.float64))
        return torch.autograd.grad(loss, zz)[0]

    draws = torch.multinomial(q, k, replacement=True, generator=gen)
    g = grad_for(draws)
    e = torch.nn.functional.one_hot(torch.tensor(token), vocab).double()
    expected = -advantage * (e - torch.nn.functional.one_hot(draws, vocab).double().mean(0))
    # Rounding (float64): the log-softmax backward is g_v = d_v - p_v Σ_j d_j, with d = -A at a plus A/k at each
    # draw (the index backward adds up to k of them per id). Σ_j d_j = 0 exactly only in exact arithmetic: it is a
    # sum of the k + 1 terms of magnitude Σ|d| = 2|A|, added once per id and once over the vocabulary, then times
    # p_v <= 1: every entry is within gamma(k + vocab + 1) · 2|A| of -A (e_a - mean e_u), and off {a} ∪ {u_k}
    # (d_v = 0 there) of 0, not exactly 0 (AVX-512 kernels leave 1e-17 there).
    tol = gamma(k + vocab + 1, torch.float64) * 2 * abs(advantage)
    assert ((g - expected).abs() <= tol).all(), (g - expected).abs().max()
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[draws] = False
    outside[token] = False
    assert outside.any()
    assert_small_relative(g[outside], 2 * abs(advantage), k + vocab + 1, torch.float64, "off {a} ∪ {u_k}")
    # every draw = a: d = -A + k · A/k = 0 up to the same rounding, so no gradient at all
    assert_small_relative(grad_for(torch.full((k,), token)), 2 * abs(advantage), k + vocab + 1, torch.float64)
    # the mean over many draws approaches -A (e_a - q); the MC error of a mean of n one-hot draws is about
    # |A| sqrt(q(1-q)/n) per coordinate: 6 of those is a bound that a wrong estimator (e.g. centring by p) misses;
    # plus the rounding of each gradient (tol) and of the sum of the n gradients, each of magnitude <= 2|A|
    n = 4000
    many = torch.multinomial(q, n * k, replacement=True, generator=gen).view(n, k)
    mean = sum(grad_for(row) for row in many) / n
    exact = -advantage * (e - q)
    rounding = tol + gamma(n + 1, torch.float64) * 2 * abs(advantage)
    bound = 6 * abs(advantage) * torch.sqrt(q * (1 - q) / (n * k)) + rounding
    assert ((mean - exact).abs() <= bound).all(), (mean - exact, bound)
    p = torch.softmax(z, -1)
    assert ((-advantage * (e - p) - exact).abs() > bound).any()  # the bound can tell p-centring from q-centring


def test_truncated_importance_weights():
    logp = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.2)]])
    logq = torch.tensor([[math.log(0.25), math.log(0.9), math.log(0.4)]])
    w = truncated_importance_weights(logp.requires_grad_(True), logq, cap=1.5)
    assert not w.requires_grad
    # float32 logs of the decimals (u |log| each), their difference, the exp (1 ulp): relative to w
    rel = unit_roundoff() * (float((logp.abs() + logq.abs()).max()) + 4)
    assert torch.allclose(w, torch.tensor([[1.5, 1.0, 0.5]]), rtol=rel, atol=0)
    with pytest.raises(ValueError, match="truncated_importance_weights"):
        truncated_importance_weights(logp, logq, cap=0.0)


def test_padding_positions_and_a_zero_advantage_row_add_nothing():
    logits = torch.randn(2, 3, 6, requires_grad=True)
    tokens = torch.randint(0, 6, (2, 3))
    head = torch.topk(torch.randn(2, 3, 6), 2, -1).indices
    logp, head_lp, _ = sampling_logprobs_at(logits, tokens, head)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    q_head = torch.zeros(2, 3, 2)  # padding-like garbage on purpose: q = 1 at both head ids
    adv = torch.tensor([[0.0], [1.0]])
    loss, _ = score_centered_loss(logp * mask, head_lp, logp.detach(), q_head, adv, mask, mask / 5)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(grad).all()
    assert (grad[0] == 0).all() and (grad[1, :, :].abs().sum() > 0)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampling_logprobs_at_matches_the_naive_gather_values_and_gradients(temperature, top_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 11, (3, 5))
    extra = torch.randint(0, 11, (3, 5, 4))
    lp, extra_lp, ent = sampling_logprobs_at(logits, tokens, extra, temperature, top_p, chunk_size=4,
                                             with_entropy=True)
    full = sampling_log_softmax(logits, temperature, top_p, keep=tokens)
    ref_lp = full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ref_extra = full.gather(-1, extra)
    assert torch.equal(torch.isneginf(extra_lp), torch.isneginf(ref_extra))
    if top_p < 1:
        assert torch.isneginf(extra_lp).any()  # some extra ids fall outside the nucleus: -inf, no gradient
    finite = torch.isfinite(ref_extra)
    # the sampling functions score in float32 (the reference in float64): float32 log-softmax rounding; against
    # sampling_logprobs (other chunks, so other vectorised/scalar splits of the exp) the same bound
    lp_tol = log_softmax_tolerance(logits, temperature, torch.float32)
    assert torch.allclose(lp, ref_lp.float(), rtol=0, atol=lp_tol)
    assert torch.allclose(extra_lp[finite], ref_extra[finite].float(), rtol=0, atol=lp_tol)
    assert torch.allclose(lp, sampling_logprobs(logits, tokens, temperature, top_p)[0], rtol=0, atol=lp_tol)
    gl, ge, gh = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5)
    (ours,) = torch.autograd.grad((lp * gl).sum() + (torch.where(finite, extra_lp, 0) * ge).sum()
                                  + (ent * gh).sum(), logits)
    p = full.exp()
    ref_ent = -(p * full.masked_fill(torch.isneginf(full), 0)).sum(-1)
    (ref,) = torch.autograd.grad((ref_lp * gl).sum() + (torch.where(finite, ref_extra, 0) * ge).sum()
                                 + (ref_ent * gh).sum(), logits)
    # the custom backward works in float32 on float64 logits' softmax: float32 rounding of the logit gradient of
    # Σ g ℓ_a + Σ_j g_j ℓ_j + Σ h H, the J = 4 extra ids counting as 4 more upstream terms
    upstream = float(gl.abs().max()) + 4 * float(ge.abs().max()) + float(gh.abs().max())
    tol = softmax_gradient_tolerance(logits, temperature, float(ref_ent.max()), upstream, torch.float32)
    assert torch.allclose(ours, ref, rtol=0, atol=tol), (ours - ref).abs().max()
