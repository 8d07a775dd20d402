"""TRPO's pure pieces as worked examples: CG solves SPD systems, the trust-region scale, the full-vocab KL, the
Fisher-vector product of a single categorical, the importance-weighted surrogate, and the Gauss-Newton Fisher
product equal to the double-backward one (TRPO: Schulman et al. 2015, arXiv 1502.05477, Appendix C)."""

from __future__ import annotations

import math

import pytest
import torch

from rl_lightning.functional.trpo import (
    categorical_kl,
    conjugate_gradient,
    fisher_vector_product,
    gauss_newton_vector_product,
    importance_surrogate,
    trust_region_scale,
)


# ------------------------------------------------------------------ conjugate_gradient
def test_cg_solves_a_3x3_spd_system_in_3_iterations():
    F = torch.tensor([[4.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 2.0]], dtype=torch.float64)  # SPD
    b = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    x = conjugate_gradient(lambda v: F @ v, b, iters=3)  # n iterations solve an n x n system
    torch.testing.assert_close(x, torch.linalg.solve(F, b), atol=1e-6, rtol=0)


def test_cg_hand_2x2_example():
    # [[4, 1], [1, 3]] x = [1, 2]: det = 11, inverse = [[3, -1], [-1, 4]] / 11 -> x = [1/11, 7/11]
    F = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    x = conjugate_gradient(lambda v: F @ v, torch.tensor([1.0, 2.0], dtype=torch.float64), iters=2)
    torch.testing.assert_close(x, torch.tensor([1 / 11, 7 / 11], dtype=torch.float64), atol=1e-12, rtol=0)


def test_cg_solves_a_random_20x20_spd_system():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(20, 20, generator=gen, dtype=torch.float64)
    F = q @ q.T + 20 * torch.eye(20, dtype=torch.float64)  # SPD, condition number ~ 4
    b = torch.randn(20, generator=gen, dtype=torch.float64)
    x = conjugate_gradient(lambda v: F @ v, b, iters=20)
    torch.testing.assert_close(x, torch.linalg.solve(F, b), atol=1e-6, rtol=0)
    # one iteration is only the steepest-descent point, far from the solution: the test can tell them apart
    one = conjugate_gradient(lambda v: F @ v, b, iters=1)
    assert (one - torch.linalg.solve(F, b)).abs().max() > 1e-3


def test_cg_of_a_zero_right_hand_side_is_zero_and_iters_is_validated():
    F = torch.eye(3, dtype=torch.float64)
    assert torch.equal(conjugate_gradient(lambda v: F @ v, torch.zeros(3, dtype=torch.float64), iters=5),
                       torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="iters"):
        conjugate_gradient(lambda v: F @ v, torch.ones(3), iters=0)


# ------------------------------------------------------------------ trust_region_scale
def test_trust_region_scale_hand_case():
    # x = [1, 0], F = 2 I: xᵀFx = 2 -> β = sqrt(2 * 0.01 / 2) = sqrt(0.01) = 0.1
    x = torch.tensor([1.0, 0.0])
    F = 2 * torch.eye(2)
    beta = trust_region_scale(x, F @ x, delta=0.01)
    torch.testing.assert_close(beta, torch.tensor(0.1))
    # and the scaled step sits on the edge of the quadratic trust region: ½ (βx)ᵀF(βx) = ½ * 0.01 * 2 = δ
    step = beta * x
    torch.testing.assert_close(0.5 * step @ (F @ step), torch.tensor(0.01))


def test_trust_region_scale_guards_non_positive_curvature_and_delta():
    x = torch.tensor([1.0, 0.0])
    assert trust_region_scale(x, torch.zeros(2), delta=0.01) == 0  # xᵀFx = 0: no step
    assert trust_region_scale(x, torch.tensor([-1.0, 0.0]), delta=0.01) == 0  # xᵀFx < 0: no step
    with pytest.raises(ValueError, match="delta"):
        trust_region_scale(x, 2 * x, delta=0.0)


# ------------------------------------------------------------------ categorical_kl
def test_categorical_kl_is_zero_for_identical_distributions():
    logp = torch.log_softmax(torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)), dim=-1)
    assert categorical_kl(logp, logp.clone(), torch.ones(2, 3)) == 0  # exact: every log-ratio is x - x = 0


def test_categorical_kl_two_token_hand_case_and_mask():
    # p_old = [0.5, 0.5], p_new = [0.25, 0.75]:
    # KL = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln 2 + 0.5 ln(2/3) = 0.5 (0.693147 - 0.405465) = 0.143841
    expected = 0.5 * math.log(2.0) + 0.5 * math.log(2.0 / 3.0)
    old = torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.5, 0.5]]]).log()  # [1, 3, 2]
    new = torch.tensor([[[0.25, 0.75], [0.1, 0.9], [0.5, 0.5]]]).log()
    mask = torch.tensor([[1.0, 0.0, 1.0]])  # position 1 (a very different pair) does not count
    # token mean over the 2 masked positions: (0.143841 + 0) / 2
    torch.testing.assert_close(categorical_kl(old, new, mask), torch.tensor(expected / 2))
    torch.testing.assert_close(categorical_kl(old[:, :1], new[:, :1], mask[:, :1]), torch.tensor(expected))


def test_categorical_kl_outside_the_old_support_counts_zero():
    # p_old = [1, 0] (token 1 cut by top-p, log-prob -inf), p_new = [0.5, 0.5]: KL = 1 * ln(1 / 0.5) = ln 2
    old = torch.tensor([[[0.0, float("-inf")]]])
    new = torch.tensor([[[0.5, 0.5]]]).log()
    torch.testing.assert_close(categorical_kl(old, new, torch.ones(1, 1)), torch.tensor(math.log(2.0)))


# ------------------------------------------------------------------ fisher_vector_product
def test_fisher_vector_product_of_one_categorical_is_diag_p_minus_ppT():
    # logits θ = log p with p = [0.5, 0.25, 0.25]: the Hessian of KL(p ‖ softmax(θ)) is F = diag(p) - p pᵀ.
    # F e_0 = [0.5 - 0.5*0.5, -0.25*0.5, -0.25*0.5] = [0.25, -0.125, -0.125]; damping 0.1 adds [0.1, 0, 0].
    p = torch.tensor([0.5, 0.25, 0.25])
    theta = p.log().clone().requires_grad_(True)
    new = torch.log_softmax(theta, -1).view(1, 1, 3)
    kl = categorical_kl(new.detach(), new, torch.ones(1, 1))
    fvp = fisher_vector_product(kl, [theta], damping=0.1)
    torch.testing.assert_close(fvp(torch.tensor([1.0, 0.0, 0.0])), torch.tensor([0.35, -0.125, -0.125]))
    # reusable (the graph is kept) and exact on every vector: F v = (diag(p) - p pᵀ) v + 0.1 v
    v = torch.tensor([0.3, -1.0, 2.0])
    torch.testing.assert_close(fvp(v), (torch.diag(p) - torch.outer(p, p)) @ v + 0.1 * v)
    # float64 vectors come back float64 (CG runs in float64)
    assert fvp(v.double()).dtype == torch.float64


def test_cg_on_fisher_products_recovers_the_natural_gradient():
    # F = diag(p) - p pᵀ + 0.1 I with p = [0.5, 0.25, 0.25]; 3 CG iterations solve the 3 x 3 system
    p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    theta = p.log().clone().requires_grad_(True)
    new = torch.log_softmax(theta, -1).view(1, 1, 3)
    fvp = fisher_vector_product(categorical_kl(new.detach(), new, torch.ones(1, 1)), [theta], damping=0.1)
    g = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    dense = torch.diag(p) - torch.outer(p, p) + 0.1 * torch.eye(3, dtype=torch.float64)
    torch.testing.assert_close(conjugate_gradient(fvp, g, iters=3), torch.linalg.solve(dense, g), atol=1e-6, rtol=0)


# ------------------------------------------------------------------ importance_surrogate
def test_importance_surrogate_hand_case_and_its_gradient_is_the_policy_gradient():
    # ρ = [0.5/0.25, 0.2/0.2] = [2, 1], A = 1, w = 0.5 each: S = 0.5*2*1 + 0.5*1*1 = 1.5
    lp = torch.log(torch.tensor([[0.5, 0.2]]))
    old = torch.log(torch.tensor([[0.25, 0.2]]))
    s = importance_surrogate(lp, old, torch.tensor([1.0]), torch.ones(1, 2), torch.full((1, 2), 0.5))
    torch.testing.assert_close(s, torch.tensor(1.5))
    # at ρ = 1, dS/dlogπ_t = w_t A_t: [0.5*2, 0.5*(-1)] for A = [2, -1] per token; padding (mask 0) gets 0
    lp = old.clone().requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0]])
    importance_surrogate(lp, old, torch.tensor([[2.0, -1.0]]), mask, 0.5 * mask).backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[1.0, -0.5]]))


# ------------------------------------------------------------------ gauss_newton_vector_product
# The Gauss-Newton product must be the double-backward product (the Hessian of the KL at θ_old): exactly in exact
# arithmetic, so in float64 both agree to ~1e-15 x the conditioning; in float32 to ~1e-6 (tests/algorithms).

class _TinyCausalLM(torch.nn.Module):
    """``[N, T]`` ids -> ``[N, T, V]`` logits; position t sees tokens <= t (a running mean), so J mixes positions."""

    def __init__(self, vocab: int = 7, hidden: int = 5) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(ids))
        h = h.cumsum(1) / torch.arange(1, ids.shape[1] + 1, dtype=h.dtype).view(1, -1, 1)
        return self.head(torch.tanh(self.mix(h)))


def _sampling_logp(logits: torch.Tensor, temperature: float, top_p: float, keep: torch.Tensor) -> torch.Tensor:
    """The sampling distribution's log-probs (temperature, top-p nucleus plus the kept token) in the logits'
    dtype (``functional.sampling_log_softmax`` computes in float32)."""
    from rl_lightning.functional import top_p_mask

    scaled = logits / temperature
    support = top_p_mask(scaled.detach(), top_p).scatter(-1, keep.unsqueeze(-1), True)
    return torch.log_softmax(scaled.masked_fill(~support, float("-inf")), dim=-1)


def _tiny_products(temperature: float = 0.7, top_p: float = 0.8, damping: float = 0.0):
    """(double-backward product, Gauss-Newton product, D) of one float64 tiny model on a 3 x 4 batch."""
    gen = torch.Generator().manual_seed(0)
    model = _TinyCausalLM().double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    ids = torch.randint(0, 7, (3, 4), generator=gen)
    keep = torch.randint(0, 7, (3, 4), generator=gen)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    params = list(model.parameters())
    logits = model(ids)
    new = _sampling_logp(logits, temperature, top_p, keep)
    assert torch.isinf(new).any()  # top-p really cut tokens: M must vanish off the support
    double = fisher_vector_product(categorical_kl(new.detach(), new, mask), params, damping)
    gauss = gauss_newton_vector_product(model(ids), new.detach(), mask, params, temperature, damping)
    return double, gauss, sum(p.numel() for p in params)


def test_gauss_newton_product_of_one_categorical_with_temperature():
    # logits θ at τ = 2: p = softmax(θ / 2) and the Hessian of KL in θ is (diag(p) - p pᵀ) / τ², here / 4.
    # θ = 2 log [0.5, 0.25, 0.25] -> p = [0.5, 0.25, 0.25]; F e_0 = [0.25, -0.125, -0.125] / 4 = [0.0625, -0.03125,
    # -0.03125]; damping 0.1 adds [0.1, 0, 0].
    p = torch.tensor([0.5, 0.25, 0.25])
    theta = (2 * p.log()).requires_grad_(True)
    logits = theta.view(1, 1, 3)
    old = torch.log_softmax(logits.detach() / 2, -1)
    fvp = gauss_newton_vector_product(logits, old, torch.ones(1, 1), [theta], temperature=2.0, damping=0.1)
    torch.testing.assert_close(fvp(torch.tensor([1.0, 0.0, 0.0])), torch.tensor([0.1625, -0.03125, -0.03125]))
    # the double-backward product of the same KL gives the same
    new = torch.log_softmax(logits / 2, -1)
    double = fisher_vector_product(categorical_kl(new.detach(), new, torch.ones(1, 1)), [theta], damping=0.1)
    v = torch.tensor([0.3, -1.0, 2.0])
    torch.testing.assert_close(fvp(v), double(v))
    assert fvp(v.double()).dtype == torch.float64


def test_gauss_newton_product_equals_the_double_backward_product_in_float64():
    # temperature 0.7, top-p 0.8 (tokens outside the nucleus), a ragged mask: every piece of M is exercised
    double, gauss, dim = _tiny_products()
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        v = torch.randn(dim, generator=gen, dtype=torch.float64)
        fd, fg = double(v), gauss(v)
        # float64 rounding (~1e-16) times the few hundred operations of a product: 1e-12 is loose
        torch.testing.assert_close(fg, fd, rtol=1e-12, atol=1e-12 * float(fd.abs().max()))
    # the whole matrix, column by column
    eye = torch.eye(dim, dtype=torch.float64)
    dense_d = torch.stack([double(e) for e in eye], 1)
    dense_g = torch.stack([gauss(e) for e in eye], 1)
    torch.testing.assert_close(dense_g, dense_d, rtol=0, atol=1e-12 * float(dense_d.abs().max()))


def test_gauss_newton_fisher_is_symmetric_positive_semi_definite():
    _, gauss, dim = _tiny_products()
    dense = torch.stack([gauss(e) for e in torch.eye(dim, dtype=torch.float64)], 1)
    torch.testing.assert_close(dense, dense.T, rtol=0, atol=1e-14 * float(dense.abs().max()))  # Jᵀ M J: symmetric
    eigenvalues = torch.linalg.eigvalsh(dense)
    assert eigenvalues.min() >= -1e-12 * eigenvalues.max()  # PSD (M is; the embedding rows never used give 0)
    assert eigenvalues.max() > 0
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        v = torch.randn(dim, generator=gen, dtype=torch.float64)
        assert float(v @ gauss(v)) >= 0


def test_cg_on_either_product_finds_the_same_direction_in_float64():
    # exact arithmetic: the same matrix gives the same CG iterates; in float64 they agree to rounding x conditioning
    double, gauss, dim = _tiny_products(damping=0.1)
    b = torch.randn(dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x_d = conjugate_gradient(double, b, iters=10)
    x_g, r_g = conjugate_gradient(gauss, b, iters=10, with_residual=True)
    torch.testing.assert_close(x_g, x_d, rtol=1e-9, atol=1e-9 * float(x_d.abs().max()))
    # and the step scale from CG's residual, F x = b - r, equals the one from a last product
    torch.testing.assert_close(trust_region_scale(x_g, b - r_g, 0.01), trust_region_scale(x_d, double(x_d), 0.01),
                               rtol=1e-9, atol=0)


def test_gauss_newton_product_of_parameters_the_logits_do_not_use_is_zero():
    theta, unused = torch.zeros(3, requires_grad=True), torch.ones(2, requires_grad=True)
    logits = theta.view(1, 1, 3)
    fvp = gauss_newton_vector_product(logits, torch.log_softmax(logits.detach(), -1), torch.ones(1, 1),
                                      [theta, unused], damping=0.5)
    out = fvp(torch.tensor([1.0, 0.0, 0.0, 3.0, -1.0]))
    torch.testing.assert_close(out[3:], torch.tensor([1.5, -0.5]))  # damping only
    torch.testing.assert_close(out[:3], torch.tensor([2 / 9 + 0.5, -1 / 9, -1 / 9]))  # p = 1/3: diag(p) - ppᵀ
    # logits that depend on no parameter: F = 0
    const = gauss_newton_vector_product(torch.zeros(1, 1, 3), torch.full((1, 1, 3), -1.0986), torch.ones(1, 1),
                                        [theta], damping=0.5)
    torch.testing.assert_close(const(torch.ones(3)), torch.full((3,), 0.5))
    with pytest.raises(ValueError, match="shape"):
        fvp(torch.ones(3))


def test_cg_residual_gives_the_product_of_the_solution():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    F = q @ q.T + 0.5 * torch.eye(8, dtype=torch.float64)
    b = torch.randn(8, generator=gen, dtype=torch.float64)
    for iters in (1, 3, 8):
        x, r = conjugate_gradient(lambda v: F @ v, b, iters=iters, with_residual=True)
        torch.testing.assert_close(x, conjugate_gradient(lambda v: F @ v, b, iters=iters), rtol=0, atol=0)
        torch.testing.assert_close(b - r, F @ x, rtol=0, atol=1e-10)
