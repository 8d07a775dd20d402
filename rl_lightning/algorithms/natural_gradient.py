"""The forwards of TRPO's natural-gradient step (Schulman et al. 2015, arXiv 1502.05477): full-vocabulary log-probs
and logits that carry a graph a backward of a backward can go through (SDPA on its math backend: the fused kernels
have none).

Kept apart from ``algorithms/trpo.py`` so that any natural-gradient method (a natural policy gradient, a
trust-region variant) can reuse them with ``functional.trpo``'s Fisher-vector products and line search.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from rl_lightning.algorithms.forward import shared_prompt_forward
from rl_lightning.functional import masked_mean, sampling_log_softmax
from rl_lightning.functional.trpo import conjugate_gradient, trust_region_scale
from rl_lightning.rollout.batch import RolloutBatch
from rl_lightning.rollout.generation import position_ids_from_mask


def vocab_logprobs(policy: nn.Module, batch: RolloutBatch) -> Tensor:
    """``[N, T, V]`` full-vocabulary log-probs of the sampling distribution (temperature, top-p) per position.

    Attention runs on SDPA's math backend: the fused kernels have no double backward, which the
    Fisher-vector products need (every call uses it, so all measurements share one numeric path).
    """
    width = batch.input_ids.shape[1] - batch.prompt_length  # T
    with sdpa_kernel(SDPBackend.MATH):
        out = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                     position_ids=position_ids_from_mask(batch.attention_mask), logits_to_keep=width + 1,
                     use_cache=False)
    logits = out.logits[:, :-1]  # [N, T, V]: position P-1+t predicts response token t
    return sampling_log_softmax(logits, batch.temperature, batch.top_p, keep=batch.response_ids)


def fisher_logits(policy: nn.Module, batch: RolloutBatch) -> Tensor:
    """``[N, T, V]`` float32 raw logits of the positions that predict the response tokens, carrying the graph:
    those of ``vocab_logprobs``'s forward (the same function of the weights, equal to rounding), with each
    distinct prompt through the network once (``forward.shared_prompt_forward``, whatever the module's
    ``share_prompt_forward``: every position saved here is saved in each of the conjugate gradient's products).

    On ``configs/trpo.yaml`` (16 prompts x 8, 7 prompt + 4 response positions) that is 496 positions through
    the network instead of 1408. Where sharing cannot apply (no repeated prompts, dropout active, gradient
    checkpointing, a cache other than a plain ``DynamicCache``) it is ``vocab_logprobs``'s forward. SDPA runs
    on the math backend, as there (the products need a backward of a backward).
    """
    width = batch.input_ids.shape[1] - batch.prompt_length  # T
    with sdpa_kernel(SDPBackend.MATH):
        shared = shared_prompt_forward(policy, batch.input_ids, batch.attention_mask, batch.prompt_length)
        if shared is not None:
            return shared[0].float()
        out = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                     position_ids=position_ids_from_mask(batch.attention_mask.long()),
                     logits_to_keep=width + 1, use_cache=False)
    return out.logits[:, :-1].float()


def apply_step(optimizer: Any, params: list[nn.Parameter], step: Tensor | None) -> None:
    """Apply the flat ``step`` (``None``: no change) through Lightning's ``optimizer`` (an ``SGD(lr=1)``), with
    ``grad = -step``, so the update is exactly one step that Lightning counts (``global_step``)."""
    optimizer.zero_grad()
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = (-step[offset:offset + n]).view_as(p).clone() if step is not None else torch.zeros_like(p)
        offset += n
    optimizer.step()
    optimizer.zero_grad()


def trust_region_step(fvp: Callable[[Tensor], Tensor], g: Tensor, cg_iters: int, delta: float,
                      fx_from_residual: bool) -> Tensor:
    """TRPO's full step (Schulman et al. 2015, Appendix C): ``sqrt(2δ / xᵀFx) · x`` with ``x ≈ F⁻¹ g`` by conjugate
    gradient (float64), in ``g``'s dtype.

    ``F x`` comes from CG's residual (``(F + damping) x = g - r``, no product) when ``fx_from_residual`` (the
    Gauss-Newton products), else from one more product (the double-backward path, as originally).
    """
    x, residual = conjugate_gradient(fvp, g.double(), cg_iters, with_residual=True)
    fx = g.double() - residual if fx_from_residual else fvp(x)
    return (trust_region_scale(x, fx, delta) * x).to(g.dtype)  # [D]


@torch.no_grad()
def step_metrics(
    accepted: tuple[int, Tensor, Tensor, Tensor] | None, g: Tensor, full_step: Tensor, surrogate: Tensor,
    old_logp: Tensor, logprobs: Tensor, batch: RolloutBatch, backtrack_iters: int,
) -> dict[str, list[Tensor]]:
    """TRPO's logged metrics of one step: the line search's outcome (``accepted``: ``(k, step, kl, improvement)`` or
    ``None``), the linear prediction ``gᵀs``, the surrogate before the step, and the entropy and sampler gap of
    ``π_old`` (``old_logp`` ``[N, T, V]``, ``logprobs`` ``[N, T]`` at the generated tokens)."""
    mask = batch.loss_mask
    p_old = old_logp.exp()
    entropy = -(p_old * old_logp.masked_fill(p_old == 0, 0.0)).sum(-1)  # [N, T]
    zero = torch.zeros((), device=g.device)
    return {
        "train/kl_after_step": [accepted[2] if accepted else zero],
        "train/line_search_steps": [torch.tensor(float(accepted[0] if accepted else backtrack_iters + 1))],
        "train/step_accepted": [torch.tensor(1.0 if accepted else 0.0)],
        "train/surrogate_improvement": [accepted[3] if accepted else zero],
        "train/expected_improvement": [(g.double() @ full_step.double()).float()],
        "train/surrogate": [surrogate],
        "train/loss": [-surrogate],  # the fixed name: what the step lowers, at the weights before it
        "train/grad_norm": [g.norm()],
        "train/sampler_logp_diff": [masked_mean((logprobs - batch.sampler_logprobs).abs(), mask)],
        "train/entropy": [masked_mean(entropy, mask)],
    }
