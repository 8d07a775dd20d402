"""Worked-example tests for ``rl_lightning.functional.losses`` (PPO: Schulman et al. 2017, arXiv 1707.06347, eq. 7;
GRPO: Shao et al. 2024, arXiv 2402.03300, eq. 3; loss aggregation)."""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.functional import (
    aggregate,
    aggregation_weights,
    clipped_policy_loss,
    clipped_surrogate,
    kl_estimate,
)
from tests.tolerances import gamma, sum_tolerance

MODES = ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum", "token_sum"]

# ---------------------------------------------------------------------------------------------------------------
# clipped_surrogate
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rho,adv,expected",
    [
        # clip(1.5, 0.8, 1.2) = 1.2
        (1.5, +1.0, 1.2),   # min(1.5*1, 1.2*1) = 1.2      (clipped: no incentive to push ρ further up)
        (1.5, -1.0, -1.5),  # min(-1.5, -1.2) = -1.5       (unclipped: the pessimistic branch)
        # clip(0.6, 0.8, 1.2) = 0.8
        (0.6, -1.0, -0.8),  # min(-0.6, -0.8) = -0.8       (clipped)
        (0.6, +1.0, 0.6),   # min(0.6, 0.8) = 0.6          (unclipped)
        # clip(1.0, 0.8, 1.2) = 1.0
        (1.0, +1.0, 1.0),
        (1.0, -1.0, -1.0),
        (1.0, 2.5, 2.5),
        (1.5, 2.0, 2.4),    # min(3.0, 2.4)
    ],
)
def test_clipped_surrogate_worked_examples(rho, adv, expected):
    out = clipped_surrogate(torch.tensor([rho]), torch.tensor([adv]), 0.2, 0.2)
    # float32 inputs (1 rounding each), 1 ± 0.2 and one product: gamma(4) of the value
    assert out.item() == pytest.approx(expected, rel=gamma(4))


def test_clipped_surrogate_vectorised_docstring_example():
    out = clipped_surrogate(torch.tensor([1.5, 0.6, 1.0]), torch.tensor([1.0, -1.0, 2.0]), 0.2, 0.2)
    torch.testing.assert_close(out, torch.tensor([1.2, -0.8, 2.0]))


def test_clipped_surrogate_asymmetric():
    # eps_low = 0.2, eps_high = 0.28 → range [0.8, 1.28] (DAPO clip-higher)
    rho = torch.tensor([1.25, 1.30, 0.75, 0.85, 0.75, 1.30])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0])
    # 1.25*1 = 1.25 (inside, would be clipped at 1.2 under symmetric 0.2)
    # 1.30*1 vs 1.28*1 → 1.28
    # 0.75*-1 = -0.75 vs 0.8*-1 = -0.8 → -0.8
    # 0.85*-1 = -0.85 (inside)
    # 0.75*+1 = 0.75 vs 0.8 → 0.75 (unclipped)
    # 1.30*-1 = -1.30 vs -1.28 → -1.30 (unclipped)
    out = clipped_surrogate(rho, adv, eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(out, torch.tensor([1.25, 1.28, -0.8, -0.85, 0.75, -1.30]))
    sym = clipped_surrogate(rho, adv, 0.2, 0.2)
    assert sym[0].item() == pytest.approx(1.2)


def test_clipped_surrogate_gradient_zero_exactly_where_clipped():
    # d/dρ min(ρA, clip(ρ)A):
    #   A>0, ρ>1+eps_high → clipped branch active → 0
    #   A<0, ρ<1-eps_low  → clipped branch active → 0
    #   otherwise → A (the unclipped branch, or both equal inside the range)
    rho = torch.tensor([1.5, 1.1, 0.5, 0.5, 0.9, 1.5, 1.0], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 2.0], requires_grad=True)
    out = clipped_surrogate(rho, adv, 0.2, 0.2)
    out.sum().backward()
    expected = torch.tensor([0.0, 1.0, 1.0, 0.0, -1.0, -1.0, 2.0])
    assert torch.equal(rho.grad[[0, 3]], torch.zeros(2))
    assert (rho.grad[[1, 2, 4, 5, 6]] != 0).all()
    torch.testing.assert_close(rho.grad, expected)
    # advantages are constants: no gradient flows into them
    assert adv.grad is None


# ---------------------------------------------------------------------------------------------------------------
# aggregation_weights / aggregate
# ---------------------------------------------------------------------------------------------------------------

# Ragged hand example: N = 4 rows, T = 4
#   row 0: mask [1,1,1,0]  T_0 = 3, ℓ = 1, 2, 3     (Σ = 6)
#   row 1: mask [1,0,0,0]  T_1 = 1, ℓ = 4           (Σ = 4)
#   row 2: mask [0,0,0,0]  T_2 = 0 (empty)          (Σ = 0)
#   row 3: mask [1,1,0,0]  T_3 = 2, ℓ = 5, 6        (Σ = 11)
#   Σ_i T_i = 6, Σ ℓ = 21. Unmasked positions hold 100 (must never count).
HAND_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.float32)
HAND_LOSS = torch.tensor(
    [[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [100.0, 100.0, 100.0, 100.0], [5.0, 6.0, 100.0, 100.0]]
)


@pytest.mark.parametrize(
    "mode,expected",
    [
        # (1/4) [ 6/3 + 4/1 + 0 + 11/2 ] = (1/4)(2 + 4 + 0 + 5.5) = 11.5/4
        ("seq_mean_token_mean", 2.875),
        # 21 / 6
        ("token_mean", 3.5),
        # (1/4)(6 + 4 + 0 + 11) = 21/4
        ("seq_mean_token_sum", 5.25),
        # 21
        ("token_sum", 21.0),
    ],
)
def test_aggregation_hand_example(mode, expected):
    w = aggregation_weights(HAND_MASK, mode)
    assert aggregate(HAND_LOSS, w).item() == pytest.approx(expected)
    assert torch.equal(w[HAND_MASK == 0], torch.zeros(int((HAND_MASK == 0).sum())))
    assert not torch.isnan(w).any()


def test_aggregation_weights_hand_values():
    w = aggregation_weights(HAND_MASK, "seq_mean_token_mean")
    # w = 1/(N T_i): row 0 → 1/12, row 1 → 1/4, row 2 → 0 (empty row, no NaN), row 3 → 1/8
    expected = torch.tensor([[1 / 12] * 3 + [0.0], [0.25, 0, 0, 0], [0.0] * 4, [0.125, 0.125, 0, 0]])
    torch.testing.assert_close(w, expected)
    torch.testing.assert_close(aggregation_weights(HAND_MASK, "token_mean"), HAND_MASK / 6)
    torch.testing.assert_close(aggregation_weights(HAND_MASK, "seq_mean_token_sum"), HAND_MASK / 4)
    torch.testing.assert_close(aggregation_weights(HAND_MASK, "token_sum"), HAND_MASK)


def test_constant_length_normaliser_dr_grpo():
    """seq_mean_token_sum_norm (Dr. GRPO, arXiv 2503.20783): w = 1/(N L) for every token, whatever its row's
    length; with L = 5 the hand example is (1/4)(6 + 4 + 0 + 11)/5 = 21/20. Negative control: the per-row length
    normaliser of GRPO (seq_mean_token_mean) gives a short row's tokens more weight (row 1: 1/4 vs 1/20)."""
    w = aggregation_weights(HAND_MASK, "seq_mean_token_sum_norm", norm_length=5)
    torch.testing.assert_close(w, HAND_MASK / 20)
    assert aggregate(HAND_LOSS, w).item() == pytest.approx(21 / 20)
    assert aggregation_weights(HAND_MASK, "seq_mean_token_mean")[1, 0].item() == pytest.approx(0.25)
    global_w = aggregation_weights(HAND_MASK, "seq_mean_token_sum_norm", num_sequences=8, norm_length=5)
    torch.testing.assert_close(global_w, HAND_MASK / 40)  # N is the global row count under data parallelism
    with pytest.raises(ValueError, match="norm_length"):
        aggregation_weights(HAND_MASK, "seq_mean_token_sum_norm")


def test_aggregation_all_empty_mask_no_nan():
    mask = torch.zeros(3, 5)
    for mode in MODES:
        w = aggregation_weights(mask, mode)
        assert torch.equal(w, torch.zeros(3, 5)), mode


def test_aggregation_overrides():
    # num_sequences=8 (global N under data parallelism), num_tokens=12 (global Σ T_i)
    #   seq_mean_token_mean: 11.5 / 8 = 1.4375
    #   token_mean:          21 / 12  = 1.75
    #   seq_mean_token_sum:  21 / 8   = 2.625
    #   token_sum:           21 (no normaliser, overrides ignored)
    got = {m: aggregate(HAND_LOSS, aggregation_weights(HAND_MASK, m, num_sequences=8, num_tokens=12)).item()
           for m in MODES}
    assert got["seq_mean_token_mean"] == pytest.approx(1.4375)
    assert got["token_mean"] == pytest.approx(1.75)
    assert got["seq_mean_token_sum"] == pytest.approx(2.625)
    assert got["token_sum"] == pytest.approx(21.0)


def test_aggregation_unknown_mode_raises():
    with pytest.raises(ValueError):
        aggregation_weights(HAND_MASK, "mean")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------
# Split invariance: the key property
# ---------------------------------------------------------------------------------------------------------------


def _toy_batch(seed: int = 0):
    """A small linear 'policy' over a vocab of 7 producing per-token log-probs with a real parameter gradient."""
    gen = torch.Generator().manual_seed(seed)
    N, T, D, V = 6, 5, 4, 7
    feats = torch.randn(N, T, D, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, V, (N, T), generator=gen)
    lengths = [5, 1, 3, 4, 2, 5]
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths], dtype=torch.float64)
    advantages = torch.randn(N, 1, generator=gen, dtype=torch.float64)
    weight0 = torch.randn(D, V, generator=gen, dtype=torch.float64) * 0.5
    with torch.no_grad():
        lp0 = torch.log_softmax(feats @ weight0, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        # π_old differs from π_θ by up to ±0.5 in log space so that many tokens hit the clip range
        old = lp0 + (torch.rand(N, T, generator=gen, dtype=torch.float64) - 0.5)
    return feats, tokens, mask, advantages, weight0, old


def _logprobs(weight, feats, tokens):
    return torch.log_softmax(feats @ weight, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _grad_full(mode, batch):
    feats, tokens, mask, adv, weight0, old = batch
    w_param = weight0.clone().requires_grad_(True)
    weights = aggregation_weights(mask, mode)
    loss, _ = clipped_policy_loss(_logprobs(w_param, feats, tokens), old, adv, mask, weights, 0.2, 0.2)
    loss.backward()
    return loss.detach(), w_param.grad.clone()


def _split_tolerances(mode, batch) -> tuple[float, float]:  # noqa: ANN001
    """Rounding bounds (float64) of the loss and of the weight gradient when the batch is split into chunks.

    Per token the loss term ``w ρ A`` (ρ through a D-term product, a V-term log-softmax and an exp) and its logit
    gradient ``-w ρ A (e_a - p)`` (``Σ_v |·| <= 2 |w ρ A|``) carry ``gamma(D + V + 8)``; the loss adds the ``N T``
    tokens' terms and the weight gradient ``Σ_t feats_t ⊗ dlogits_t`` the same tokens, in any split order. Relative
    to the terms: ``Σ |w ρ A|`` (times ``2 max|feats|`` for the gradient), not to their cancelling sums."""
    feats, tokens, mask, adv, weight0, old = batch
    ratio = torch.exp(_logprobs(weight0, feats, tokens) - old)
    terms = float((aggregation_weights(mask, mode) * ratio * adv).abs().sum())
    n = mask.numel() + feats.shape[-1] + weight0.shape[-1] + 8
    return 2 * sum_tolerance(n, terms, torch.float64), 2 * sum_tolerance(n, 2 * terms * float(feats.abs().max()),
                                                                         torch.float64)


SPLITS = {
    "2_even": [[0, 1, 2], [3, 4, 5]],
    "2_uneven": [[0], [1, 2, 3, 4, 5]],
    "3_uneven": [[0, 1], [2], [3, 4, 5]],
}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("mode", MODES)
def test_gradient_is_split_invariant(mode, split):
    batch = _toy_batch()
    feats, tokens, mask, adv, weight0, old = batch
    full_loss, full_grad = _grad_full(mode, batch)
    assert full_grad.abs().sum() > 0  # a real gradient
    # Weights computed ONCE on the whole batch, then sliced per chunk (micro-batches / devices).
    weights = aggregation_weights(mask, mode)
    w_param = weight0.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for rows in SPLITS[split]:
        idx = torch.tensor(rows)
        lp = _logprobs(w_param, feats[idx], tokens[idx])
        loss, _ = clipped_policy_loss(lp, old[idx], adv[idx], mask[idx], weights[idx], 0.2, 0.2)
        loss.backward()  # gradient accumulation
        total = total + loss.detach()
    loss_tol, grad_tol = _split_tolerances(mode, batch)
    assert torch.allclose(total, full_loss, atol=loss_tol, rtol=0)
    assert torch.allclose(w_param.grad, full_grad, atol=grad_tol, rtol=0)


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "token_mean"])
def test_naive_per_chunk_normalisation_differs(mode):
    # The naive alternative: each chunk normalises by its own statistics (weights / .mean() per chunk) and the
    # accumulated gradients are averaged over the chunks. With ragged masks and uneven chunks this is NOT the
    # full-batch gradient, which shows the split-invariance test above can fail.
    batch = _toy_batch()
    feats, tokens, mask, adv, weight0, old = batch
    _, full_grad = _grad_full(mode, batch)
    chunks = SPLITS["3_uneven"]
    w_param = weight0.clone().requires_grad_(True)
    for rows in chunks:
        idx = torch.tensor(rows)
        lp = _logprobs(w_param, feats[idx], tokens[idx])
        local_w = aggregation_weights(mask[idx], mode)  # chunk-local normaliser
        loss, _ = clipped_policy_loss(lp, old[idx], adv[idx], mask[idx], local_w, 0.2, 0.2)
        (loss / len(chunks)).backward()
    _, grad_tol = _split_tolerances(mode, batch)
    assert not torch.allclose(w_param.grad, full_grad, atol=grad_tol, rtol=0)

    # and the very naive `.mean()` over the padded [B, T] per chunk differs as well
    w_param = weight0.clone().requires_grad_(True)
    for rows in chunks:
        idx = torch.tensor(rows)
        lp = _logprobs(w_param, feats[idx], tokens[idx])
        ratio = torch.exp((lp - old[idx]) * mask[idx])
        obj = clipped_surrogate(ratio, adv[idx], 0.2, 0.2) * mask[idx]
        (-obj.mean() / len(chunks)).backward()
    assert not torch.allclose(w_param.grad, full_grad, atol=grad_tol, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# clipped_policy_loss
# ---------------------------------------------------------------------------------------------------------------


def test_clipped_policy_loss_on_policy():
    # logprobs == old → ρ = 1 everywhere → objective = A per token → loss = -Σ w A
    # token_sum, mask [[1,1,0],[1,0,0]], A = [[2],[-1]]:  loss = -(2 + 2 - 1) = -3
    # seq_mean_token_mean: w = [[1/4,1/4,0],[1/2,0,0]] → loss = -(0.5 + 0.5 - 0.5) = -0.5
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([[2.0], [-1.0]])
    loss, stats = clipped_policy_loss(lp, lp.detach(), adv, mask, aggregation_weights(mask, "token_sum"), 0.2, 0.2)
    assert loss.item() == pytest.approx(-3.0)
    loss2, _ = clipped_policy_loss(lp, lp.detach(), adv, mask, aggregation_weights(mask, "seq_mean_token_mean"),
                                   0.2, 0.2)
    assert loss2.item() == pytest.approx(-0.5)
    assert stats.clip_fraction.item() == 0.0
    assert stats.clip_fraction_low.item() == 0.0
    assert stats.clip_fraction_high.item() == 0.0
    assert stats.ratio_mean.item() == pytest.approx(1.0)
    assert stats.approx_kl.item() == 0.0  # exact: log ρ = lp - lp = 0, k3 = exp(0) - 1 - 0
    # gradient = -w A ∂logp (REINFORCE at ρ=1): token_sum → -A on masked tokens, 0 elsewhere
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2.0, -2.0, 0.0], [1.0, 0.0, 0.0]]))


def test_clipped_policy_loss_known_clip_fractions():
    # 4 masked tokens + 1 padded token, eps = 0.2:
    #   ρ = [1.5, 0.5, 1.0, 1.1 | pad 3.0],   A = [+1, -1, +1, -1 | +1]
    #   token 0: A>0, ρ>1.2 → high clip,  objective 1.2
    #   token 1: A<0, ρ<0.8 → low clip,   objective min(-0.5, -0.8) = -0.8
    #   token 2: inside,                   objective 1.0
    #   token 3: inside,                   objective -1.1
    #   padding: ignored (it would be a high clip if counted)
    #   clip_fraction_high = 1/4, clip_fraction_low = 1/4, clip_fraction = 2/4
    #   ratio_mean = (1.5 + 0.5 + 1.0 + 1.1)/4 = 1.025
    #   token_sum loss = -(1.2 - 0.8 + 1.0 - 1.1) = -0.3
    #   approx_kl = mean_t k3 = mean(ρ - 1 - log ρ) over the 4 masked tokens
    rho = torch.tensor([[1.5, 0.5, 1.0, 1.1, 3.0]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5, -0.2]], dtype=torch.float64)
    logprobs = (old + rho.log()).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, stats = clipped_policy_loss(logprobs, old, adv, mask, aggregation_weights(mask, "token_sum"), 0.2, 0.2)
    assert loss.item() == pytest.approx(-0.3)
    assert stats.clip_fraction_high.item() == pytest.approx(0.25)
    assert stats.clip_fraction_low.item() == pytest.approx(0.25)
    assert stats.clip_fraction.item() == pytest.approx(0.5)
    assert stats.ratio_mean.item() == pytest.approx(1.025)
    expected_kl = sum(r - 1 - math.log(r) for r in [1.5, 0.5, 1.0, 1.1]) / 4
    assert stats.approx_kl.item() == pytest.approx(expected_kl)
    assert stats.approx_kl.item() >= 0
    # gradients: clipped tokens (0, 1) and padding get 0; tokens 2, 3 get -A ρ (d/dlogp of -ρA)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -1.0, 1.1, 0.0]], dtype=torch.float64))
    # stats are detached
    assert not stats.approx_kl.requires_grad and not stats.clip_fraction.requires_grad


def test_clipped_policy_loss_approx_kl_nonnegative_random():
    gen = torch.Generator().manual_seed(11)
    lp = torch.randn(8, 6, generator=gen)
    old = lp + torch.randn(8, 6, generator=gen)
    mask = (torch.rand(8, 6, generator=gen) < 0.7).float()
    adv = torch.randn(8, 1, generator=gen)
    _, stats = clipped_policy_loss(lp, old, adv, mask, aggregation_weights(mask, "token_mean"), 0.2, 0.28)
    assert stats.approx_kl.item() > 0
    expected = (kl_estimate(old, lp, "k3") * mask).sum() / mask.sum()
    # a mean of 48 non-negative terms, each a few roundings (exp, -1, -log r): gamma(48 + 4) of it
    torch.testing.assert_close(stats.approx_kl, expected, rtol=gamma(48 + 4), atol=0)
    assert 0.0 <= stats.clip_fraction.item() <= 1.0
    torch.testing.assert_close(stats.clip_fraction, stats.clip_fraction_low + stats.clip_fraction_high)
