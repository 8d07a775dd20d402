"""Trust-region pieces of TRPO (Schulman et al. 2015, "Trust Region Policy Optimization", arXiv 1502.05477): the
surrogate, the full-vocabulary KL whose Hessian is the Fisher matrix, conjugate gradient and the step scale.

TRPO approximately solves ``max_θ S(θ)  s.t.  KL(π_old ‖ π_θ) <= δ``: with ``g = ∇S`` and the Fisher matrix
``F = ∇² KL`` at θ_old, the step is ``sqrt(2δ / xᵀFx) · x`` with ``x = F⁻¹ g`` found by conjugate gradient
from Fisher-vector products only, then shrunk by a backtracking line search until the measured KL is within δ
and the surrogate improves. The products come either by double backpropagation through the KL
(``fisher_vector_product``) or, the same matrix to rounding at about half the cost, in Gauss-Newton form
``Jᵀ M J v`` from first-order passes only (``gauss_newton_vector_product``).

Shapes: ``N`` rows, ``T`` response tokens, ``V`` vocabulary; ``D`` = number of parameters (flat vectors).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from rl_lightning.functional.masked import masked_mean


def conjugate_gradient(
    matvec: Callable[[Tensor], Tensor], b: Tensor, iters: int, residual_tol: float = 1e-10,
    with_residual: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Solve ``F x = b`` for a symmetric positive-definite ``F`` given only ``v -> F v`` (TRPO;
    Schulman et al. 2015, Appendix C).

    Standard CG from ``x_0 = 0``::

        r_0 = p_0 = b
        α_k = r_kᵀr_k / p_kᵀF p_k ;  x_{k+1} = x_k + α_k p_k ;  r_{k+1} = r_k - α_k F p_k
        β_k = r_{k+1}ᵀr_{k+1} / r_kᵀr_k ;  p_{k+1} = r_{k+1} + β_k p_k

    stopping after ``iters`` products or once ``rᵀr < residual_tol``. In exact arithmetic it solves a ``D x D``
    system in ``D`` iterations. If a direction has ``pᵀFp <= 0`` (``F`` not positive definite along it) the
    iteration stops and returns the current ``x``.

    Args:
        matvec: ``v [D] -> F v [D]`` (same dtype as ``b``; TRPO passes Fisher-vector products).
        b: ``[D]`` right-hand side (TRPO: the surrogate gradient ``g``).
        iters: maximum number of iterations (>= 1).
        residual_tol: stop when the squared residual norm falls below this.
        with_residual: also return the final residual ``r``. It is updated by the recursion above, so
            ``b - r = Σ_k α_k F p_k = F x`` (exactly in exact arithmetic; to the rounding of the products in
            floating point): ``F x`` for ``trust_region_scale`` without another product.

    Returns:
        ``[D]`` the approximate solution ``x ≈ F⁻¹ b`` (dtype of ``b``; pass float64 for stability); with
        ``with_residual``, the pair ``(x, r)``.

    Example:
        >>> F = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> conjugate_gradient(lambda v: F @ v, torch.tensor([1.0, 2.0], dtype=torch.float64), iters=2)
        tensor([0.0909, 0.6364], dtype=torch.float64)   # = [1/11, 7/11] = F⁻¹ b
    """
    if iters < 1:
        raise ValueError(f"conjugate_gradient: iters must be >= 1, got {iters}")
    if b.dim() != 1:
        raise ValueError(f"conjugate_gradient: b must be a flat vector [D], got shape {tuple(b.shape)}")
    x = torch.zeros_like(b)
    r = b.clone()  # residual b - F x, with x = 0
    p = b.clone()  # search direction
    rr = r @ r
    for _ in range(iters):
        if rr < residual_tol:
            break
        fp = matvec(p)
        curvature = p @ fp
        if curvature <= 0:  # not positive definite along p: keep what we have
            break
        alpha = rr / curvature
        x = x + alpha * p
        r = r - alpha * fp
        rr_new = r @ r
        p = r + (rr_new / rr) * p
        rr = rr_new
    return (x, r) if with_residual else x


def trust_region_scale(x: Tensor, Fx: Tensor, delta: float) -> Tensor:  # noqa: N803 (F is the paper's name)
    """Scale ``β`` of the maximal step ``β x`` inside the quadratic trust region (TRPO;
    Schulman et al. 2015, Appendix C).

    The quadratic KL model ``½ (βx)ᵀF(βx) = δ`` gives ``β = sqrt(2δ / xᵀFx)``. When ``xᵀFx <= 0`` (a
    degenerate direction, e.g. ``x = 0``) no finite step is defined and ``β = 0`` (no step).

    Args:
        x: ``[D]`` the search direction (``F⁻¹ g`` from conjugate gradient).
        Fx: ``[D]`` the Fisher-vector product ``F x``.
        delta: trust-region radius δ > 0 (a KL in nats).

    Returns:
        A 0-d tensor ``β >= 0`` (dtype of ``x``).

    Example:
        >>> x = torch.tensor([1.0, 0.0]); F = 2 * torch.eye(2)
        >>> trust_region_scale(x, F @ x, delta=0.01)   # sqrt(2 * 0.01 / 2)
        tensor(0.1000)
    """
    if delta <= 0:
        raise ValueError(f"trust_region_scale: delta must be > 0, got {delta}")
    if x.shape != Fx.shape:
        raise ValueError(f"trust_region_scale: x and Fx must have one shape, got {tuple(x.shape)}, {tuple(Fx.shape)}")
    shs = x @ Fx  # xᵀFx
    if not torch.isfinite(shs) or shs <= 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.sqrt(2.0 * delta / shs)


def categorical_kl(old_logp: Tensor, new_logp: Tensor, mask: Tensor) -> Tensor:
    """Token-mean full-vocabulary ``KL(π_old ‖ π_new)`` over the masked positions (TRPO;
    Schulman et al. 2015, the constraint ``D̄_KL(θ_old, θ) <= δ``)::

        KL = (1 / Σ mask) Σ_{i,t: mask=1} Σ_v p_old(v) (log p_old(v) - log p_new(v))

    Vocabulary entries outside ``π_old``'s support (``old_logp = -inf``, e.g. cut by top-p) contribute 0; an
    entry in ``π_old``'s support that ``π_new`` excludes gives ``+inf``. Its Hessian in the parameters of
    ``π_new`` at ``π_new = π_old`` is the Fisher matrix TRPO's conjugate gradient uses; ``old_logp`` should
    be detached for that.

    Args:
        old_logp: ``[N, T, V]`` log-probs of π_old over the whole vocabulary (constants).
        new_logp: ``[N, T, V]`` log-probs of π_new (may carry the gradient).
        mask: ``[N, T]`` 1 on the positions that count (model-generated tokens).

    Returns:
        A 0-d tensor, ``>= 0`` (0 when the mask is empty).

    Example:
        >>> old = torch.tensor([[[0.5, 0.5]]]).log(); new = torch.tensor([[[0.25, 0.75]]]).log()
        >>> categorical_kl(old, new, torch.ones(1, 1))   # 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75)
        tensor(0.1438)
    """
    if old_logp.shape != new_logp.shape or old_logp.dim() != 3 or tuple(mask.shape) != tuple(old_logp.shape[:2]):
        raise ValueError(
            f"categorical_kl: need old_logp, new_logp [N, T, V] and mask [N, T], got {tuple(old_logp.shape)}, "
            f"{tuple(new_logp.shape)}, {tuple(mask.shape)}"
        )
    support = torch.isfinite(old_logp)  # [N, T, V]; -inf = outside π_old's support
    p_old = old_logp.exp()  # 0 outside the support
    diff = old_logp.masked_fill(~support, 0.0) - new_logp.masked_fill(~support, 0.0)
    per_token = (p_old * diff).sum(-1)  # [N, T]
    return masked_mean(per_token, mask)


def importance_surrogate(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                         weights: Tensor) -> Tensor:
    """TRPO's surrogate objective, to be *maximised* (TRPO;
    Schulman et al. 2015, eq. 14)::

        S(θ) = Σ_{i,t} w_{i,t} ρ_{i,t} A_{i,t},   ρ = exp(log π_θ - log π_old)

    with ``w`` the aggregation weights of the rollout batch. At θ = θ_old (on-policy) ``∇S = ∇ Σ w A log π``,
    the policy gradient.

    Args:
        logprobs: ``[N, T]`` learner log-probs of the generated tokens (carry the gradient).
        old_logprobs: ``[N, T]`` π_old's (the sampler's) log-probs, constants.
        advantages: ``[N, T]``, ``[N, 1]`` or ``[N]``, constants.
        mask, weights: ``[N, T]``; ``weights`` zero off the mask.

    Returns:
        A 0-d tensor.

    Example:
        >>> lp = torch.log(torch.tensor([[0.5, 0.2]])); old = torch.log(torch.tensor([[0.25, 0.2]]))
        >>> importance_surrogate(lp, old, torch.tensor([1.0]), torch.ones(1, 2), torch.full((1, 2), 0.5))
        tensor(1.5000)   # 0.5 * (0.5/0.25) * 1 + 0.5 * 1 * 1
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # one advantage per row, broadcast over tokens
    ratio = torch.exp((logprobs - old_logprobs.detach()) * mask)  # [N, T]; 1 on padding
    return (ratio * advantages.detach() * weights).sum()


def fisher_vector_product(
    kl: Tensor, params: Sequence[Tensor], damping: float = 0.0
) -> Callable[[Tensor], Tensor]:
    """``v -> F v + damping · v`` with ``F = ∇²_θ KL`` by double backpropagation (TRPO;
    Schulman et al. 2015, Appendix C.1 "Computing the Fisher-Vector Product")::

        F v = ∇_θ ( (∇_θ KL)ᵀ v )

    ``kl`` must be ``KL(π_old ‖ π_θ)`` with π_old detached and evaluated at θ = θ_old, where its gradient is
    0 and its Hessian is the Fisher information matrix (symmetric positive semi-definite; ``damping > 0``
    makes it definite). The first derivative graph is built once and reused for every product.

    Args:
        kl: 0-d tensor carrying the graph to ``params``.
        params: the ``D`` parameters (in total) the step is taken in; ones that ``kl`` does not depend on get 0.
        damping: added multiple of the identity (Tikhonov damping, > 0 keeps CG well posed).

    Returns:
        A closure ``v [D] -> F v + damping v [D]``; ``v`` may be of any float dtype, the result has ``v``'s dtype.

    Example:
        >>> theta = torch.zeros(2, requires_grad=True)   # one categorical with logits θ, p_old = [0.5, 0.5]
        >>> old = torch.log_softmax(theta.detach(), -1).view(1, 1, 2)
        >>> kl = categorical_kl(old, torch.log_softmax(theta, -1).view(1, 1, 2), torch.ones(1, 1))
        >>> fisher_vector_product(kl, [theta])(torch.tensor([1.0, 0.0]))   # (diag(p) - p pᵀ) v
        tensor([ 0.2500, -0.2500])
    """
    params = list(params)
    grads = torch.autograd.grad(kl, params, create_graph=True, allow_unused=True)
    flat_grad = torch.cat([
        (g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)
    ])  # [D], carries the graph

    def product(v: Tensor) -> Tensor:
        if v.shape != flat_grad.shape:
            raise ValueError(f"fisher_vector_product: v must have shape {tuple(flat_grad.shape)}, got {tuple(v.shape)}")
        if not flat_grad.requires_grad:  # KL independent of every parameter: F = 0
            return damping * v
        grad_v = flat_grad @ v.to(flat_grad.dtype).detach()
        hv = torch.autograd.grad(grad_v, params, retain_graph=True, allow_unused=True)
        flat = torch.cat([(h if h is not None else torch.zeros_like(p)).reshape(-1) for h, p in zip(hv, params)])
        return flat.to(v.dtype) + damping * v

    return product


def gauss_newton_vector_product(
    logits: Tensor, old_logp: Tensor, mask: Tensor, params: Sequence[Tensor], temperature: float = 1.0,
    damping: float = 0.0,
) -> Callable[[Tensor], Tensor]:
    """``v -> F v + damping · v`` with the Fisher matrix in Gauss-Newton form, without a double backward through
    the model (TRPO; Schulman et al. 2015, Appendix C.1; Martens 2014, "New insights and
    perspectives on the natural gradient method", §9)::

        F v = Jᵀ M (J v),   M = ⊕_{i,t: mask=1} (diag(p) - p pᵀ) / (τ² Σ mask),   p = exp(old_logp[i, t])

    with ``J = ∂ logits / ∂θ``. This *is* the Hessian ``∇²_θ KL(π_old ‖ π_θ)`` that
    ``fisher_vector_product`` computes from ``categorical_kl(old_logp, sampling_log_softmax(logits, τ, top_p),
    mask)`` at θ = θ_old (``old_logp`` = those log-probs, detached): by the chain rule that Hessian is
    ``Jᵀ (∂²KL/∂logits²) J + Σ_k (∂KL/∂logits_k) ∇²_θ logits_k``; the KL's gradient in the logits,
    ``(p_θ - p_old) / (τ Σ mask)``, is 0 at θ_old, and its Hessian in the logits is ``M``: the log-softmax's
    ``diag(p) - p pᵀ`` in the scaled logits ``logits / τ`` (hence ``1/τ²``), zero outside ``π_old``'s support
    (``p = 0`` there, e.g. cut by top-p) and on the masked-out positions. The two differ by rounding only.

    Each product is two first-order passes through the kept graph of ``logits``: ``J v`` as the derivative of
    ``u -> Jᵀu`` along ``v`` (the graph of that backward is made once, here, with ``create_graph``), then one
    ordinary backward of ``M J v``. ``J`` is thus the transpose of autograd's own backward, so ``F`` is exactly
    symmetric even where a backward is not the derivative (an embedding's ``padding_idx`` row gets 0 both ways, as
    in ``fisher_vector_product``). ``fisher_vector_product`` backpropagates through the whole first backward
    instead, second-order terms of every layer included: 1.5x the time of these two passes on the same graph
    (``configs/trpo.yaml``'s batch).

    Args:
        logits: ``[N, T, V]`` raw (not temperature-scaled) logits carrying the graph to ``params``.
        old_logp: ``[N, T, V]`` log-probs of π_old = the sampling distribution of ``logits`` (``-inf`` off its
            support); constants.
        mask: ``[N, T]`` 1 on the positions that count.
        params: the ``D`` parameters (in total); ones that ``logits`` does not depend on get 0.
        temperature: the sampling temperature τ > 0 the log-probs were computed with.
        damping: added multiple of the identity.

    Returns:
        A closure ``v [D] -> F v + damping v [D]`` (symmetric positive semi-definite for ``damping = 0``);
        ``v`` may be of any float dtype, the result has ``v``'s dtype.

    Example:
        >>> theta = torch.zeros(2, requires_grad=True)   # one categorical with logits θ, p_old = [0.5, 0.5]
        >>> logits = theta.view(1, 1, 2)
        >>> gauss_newton_vector_product(logits, torch.log_softmax(logits.detach(), -1), torch.ones(1, 1),
        ...                             [theta])(torch.tensor([1.0, 0.0]))   # (diag(p) - p pᵀ) v
        tensor([ 0.2500, -0.2500])
    """
    if logits.dim() != 3 or old_logp.shape != logits.shape or tuple(mask.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"gauss_newton_vector_product: need logits, old_logp [N, T, V] and mask [N, T], got "
            f"{tuple(logits.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"gauss_newton_vector_product: temperature must be > 0, got {temperature}")
    params = list(params)
    sizes = [p.numel() for p in params]
    dim = sum(sizes)
    p_old = old_logp.detach().to(logits.dtype).exp()  # [N, T, V]; 0 off the support
    mask = mask.to(logits.dtype)
    # the per-position factor of M: masked_mean's 1 / Σ mask and the 1/τ of each of the two logit derivatives
    weight = (mask / (mask.sum().clamp(min=1.0) * temperature ** 2)).unsqueeze(-1)  # [N, T, 1]
    live: list[int] = []
    jt_u: list[Tensor] = []
    u = torch.zeros_like(logits, requires_grad=True)
    if logits.requires_grad:
        grads = torch.autograd.grad(logits, params, grad_outputs=u, create_graph=True, allow_unused=True)
        for i, grad in enumerate(grads):  # Jᵀu, linear in u, one entry per parameter
            if grad is not None and grad.requires_grad:
                live.append(i)
                jt_u.append(grad)
    live_params = [params[i] for i in live]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)

    def product(v: Tensor) -> Tensor:
        if v.shape != (dim,):
            raise ValueError(f"gauss_newton_vector_product: v must have shape ({dim},), got {tuple(v.shape)}")
        if not live:  # logits independent of every parameter: F = 0
            return damping * v
        pieces = v.detach().split(sizes)
        tangents = [pieces[i].view_as(params[i]).to(g.dtype) for i, g in zip(live, jt_u)]
        jv = torch.autograd.grad(jt_u, u, grad_outputs=tangents, retain_graph=True, allow_unused=True)[0]
        if jv is None:  # Jᵀu does not depend on u: J = 0
            return damping * v
        pjv = p_old * jv  # J v, [N, T, V]
        mjv = (pjv - p_old * pjv.sum(-1, keepdim=True)) * weight  # M J v
        jt = torch.autograd.grad(logits, live_params, grad_outputs=mjv, retain_graph=True)
        flat = v.new_zeros(dim)
        for i, h in zip(live, jt):
            flat[offsets[i]:offsets[i + 1]] = h.reshape(-1).to(v.dtype)
        return flat + damping * v

    return product


def write_parameters_(params: Sequence[Tensor], vector: Tensor) -> None:
    """Copy the flat ``vector`` into ``params`` in place, in order (each keeps its own storage, unlike
    ``torch.nn.utils.vector_to_parameters``, which makes them views of one shared vector)."""
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(vector[offset:offset + n].view_as(p))
            offset += n


def backtracking_line_search(
    params: Sequence[Tensor], full_step: Tensor, evaluate: Callable[[], tuple[Tensor, Tensor]],
    accept: Callable[[Tensor, Tensor], bool], backtrack_iters: int, coeff: float,
) -> tuple[int, Tensor, Tensor, Tensor] | None:
    """TRPO's line search (Schulman et al. 2015, Appendix C): try ``θ_old + c^k s`` for ``k = 0 .. backtrack_iters``
    and keep the first trial that ``accept(improvement, kl)`` takes, ``(improvement, kl) = evaluate()`` measured at
    the trial weights.

    Returns ``(k, step, kl, improvement)`` of the accepted trial or ``None``; either way the parameters are put back
    to ``θ_old`` bit for bit (the caller applies the step).
    """
    theta_old = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    accepted = None
    with torch.no_grad():
        for k in range(backtrack_iters + 1):
            step = full_step * coeff ** k
            write_parameters_(params, theta_old + step)
            improvement, kl = evaluate()
            if accept(improvement, kl):
                accepted = (k, step, kl, improvement)
                break
        write_parameters_(params, theta_old)
    return accepted
