"""Numerical tolerances derived from the arithmetic, never tuned to one CPU.

PyTorch picks its CPU kernels at run time (``ATEN_CPU_CAPABILITY=default|avx2|avx512``) and splits reductions over
threads, so the same float computation rounds differently on another machine, with another kernel set or another
thread count. A tolerance in this suite is therefore a bound of the rounding error, written from

* the unit roundoff ``u`` of the dtype (``2^-24`` for float32, ``2^-53`` for float64; ``unit_roundoff``),
* the length ``n`` of the longest reduction involved (a sum of ``n`` terms computed in any order is within
  ``gamma(n) · Σ|terms|`` of the exact sum, ``gamma(n) = n u / (1 - n u)``; Higham, *Accuracy and Stability of
  Numerical Algorithms*, §4.2), and
* the magnitude of the terms (``Σ|terms|``, or ``n · max|term|``), not of the result, which cancellation can make
  arbitrarily small.

A value that is "exactly zero" is asserted with ``== 0`` only where it is zero by construction (a multiplication
by an exact 0, a masked ``where``); a difference of rounded terms is bounded relative to the scale of the terms
(``assert_small_relative``). Likewise ``torch.equal`` between two computations only where they are the same
operations on the same shapes (bitwise deterministic), or exact by construction (integers, a copy, a power of 2).

The defaults of ``torch.testing.assert_close`` (float32: ``rtol = 1.3e-6 ≈ 22 u``, ``atol = 1e-5``; float64:
``1e-7`` both) and of ``pytest.approx`` (``rel = 1e-6 ≈ 17 u``) are kept only for hand examples: a few operations
on O(1) values with no cancelling sum, whose rounding is a few ``u``. Anything longer or cancelling gets a bound
from the three quantities above.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """``u = eps / 2``: the largest relative error of one correctly rounded operation (float32: ``2^-24``)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """``gamma(n) = n u / (1 - n u)``: the relative bound of a sum (or dot product) of ``n`` terms in any order."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma({n}) undefined for {dtype}: n u >= 1")
    return nu / (1 - nu)


def gamma_probabilistic(n: int, dtype: torch.dtype = torch.float32, lam: float = 6.0) -> float:
    """``min(gamma(n), λ sqrt(n) u)``: the probabilistic bound of a sum of ``n`` terms (Higham & Mary, *A New
    Approach to Probabilistic Rounding Error Analysis*, 2019: it holds with probability at least
    ``1 - 2 n exp(-λ²/2)``, ``> 1 - 3e-8 n`` at ``λ = 6``, the rounding errors being independent and mean zero).
    For the long sums (a vocabulary, a hidden size): there the worst case ``n u`` is 10^2-10^3 times the actual
    error and would hide a bug."""
    return min(gamma(n, dtype), lam * math.sqrt(n) * unit_roundoff(dtype))


def sum_tolerance(n: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """Absolute bound of the rounding of a sum of ``n`` terms whose absolute values add up to ``magnitude``."""
    return gamma(n, dtype) * magnitude


def assert_small_relative(value: Tensor, scale: float, n: int, dtype: torch.dtype, what: str = "value") -> None:
    """``|value| <= gamma(n) · scale`` everywhere: ``value`` is zero up to the rounding of ``n``-term sums whose
    terms are at most ``scale`` in magnitude (``scale`` e.g. ``max |g|`` of the quantity it is compared with)."""
    bound = gamma(n, dtype) * scale
    worst = float(value.abs().max()) if value.numel() else 0.0
    assert worst <= bound, f"{what}: max |x| = {worst:.3g} > {bound:.3g} (gamma({n}) x scale {scale:.3g})"


# ------------------------------------------------------------------------------------ a decoder's forward/backward
def decoder_shape(config) -> tuple[int, int, int, int]:  # noqa: ANN001
    """``(layers, hidden, intermediate, head_dim)`` of a Hugging Face decoder config (Llama, Qwen2, GPT-2)."""
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    return config.num_hidden_layers, hidden, intermediate, head_dim


def decoder_depth(config, context_length: int) -> int:  # noqa: ANN001
    """``K``: the reduction lengths in series along one forward of a decoder (as in
    ``tests/rollout/rollout_helpers.fp32_logprob_tolerance``): per layer the two norms, the q/k/v, o and gate/up
    projections (``4 · hidden``), the down projection (``intermediate``), the attention scores (``head_dim``) and
    the softmax sum and weighted sum over the context (``2 · context_length``); then the final norm and the head."""
    layers, hidden, intermediate, head_dim = decoder_shape(config)
    return layers * (4 * hidden + intermediate + head_dim + 2 * context_length) + 2 * hidden


def decoder_logprob_tolerance(model, hidden: Tensor, temperature: float, context_length: int) -> float:  # noqa: ANN001
    """How far two float32 computations of the same log-prob may differ (other shapes, kernels, orders):
    ``rollout_helpers.fp32_logprob_tolerance`` (its docstring has the derivation) for any decoder config;
    ``hidden [..., H]``: the final hidden states of the scored positions, for ``S = max Σ_i |W_vi h_i|``."""
    from tests.rollout.rollout_helpers import fp32_logprob_tolerance

    head = model.get_output_embeddings().weight.detach().float()
    scale = float((hidden.detach().float().abs() @ head.abs().T).max())
    layers, width, intermediate, head_dim = decoder_shape(model.config)
    return fp32_logprob_tolerance(scale, temperature, model.config.vocab_size, layers, width, intermediate,
                                  head_dim, context_length)


def decoder_gradient_tolerance(config, context_length: int, terms: int, scale, passes: int = 2):  # noqa: ANN001
    """Bound of ``|g - g'|`` for two float32 computations of a gradient summed from per-row contributions ``g_r``
    computed in other shapes and orders (micro-batches, bucketing, skipped rows).

    Each ``g_r`` goes through a forward and a backward (``passes = 2``; a Fisher-vector product by double
    backward or Jacobian products: 4) with ``decoder_depth`` reductions in series each: a relative error of about
    ``sqrt(passes K) · u`` (the probabilistic bound of Higham & Mary, 2019, as for the log-probs); the two
    computations round independently (``x 2``); adding up ``terms`` contributions (rows x positions of a weight
    gradient's matrix product) in any order adds at most ``terms · u`` (worst case). Both relative to ``scale``,
    the magnitude of the terms (e.g. ``Σ_r |g_r|`` entrywise, or the gradient's ``max |g|``), never to the
    (cancelling) sum itself."""
    depth = decoder_depth(config, context_length)
    return 2 * (math.sqrt(passes * depth) + terms) * unit_roundoff(torch.float32) * scale


# ------------------------------------------------------------------------------------------------ log-softmax
def log_softmax_tolerance(logits: Tensor, temperature: float = 1.0, dtype: torch.dtype | None = None) -> float:
    """How far two computations of ``ℓ = log_softmax(z / T)`` (any kernels, reduction orders or formulas) may
    differ, for the ``[..., V]`` ``logits`` z, in ``dtype`` (default: the logits'), ``S = max |z| / T``.

    Per path: the division (``u S``), ``s - max s`` (``2 u S``), the exponentials (1 ulp = ``2 u`` relative each)
    and their sum of ``V`` positive terms (``gamma_probabilistic(V)`` relative), which the log turns into the same
    absolute error (plus its own ``u log V``), and the last subtraction (``u |ℓ| <= u (2 S + log V)``):
    ``gamma_probabilistic(V) + u (5 S + 2 log V + 4)``. Twice that for two paths."""
    dtype = logits.dtype if dtype is None else dtype
    vocab, u = logits.shape[-1], unit_roundoff(dtype)
    scale = float(logits.detach().abs().max()) / temperature
    return 2 * (gamma_probabilistic(vocab, dtype) + u * (5 * scale + 2 * math.log(vocab) + 4))


def entropy_tolerance(logits: Tensor, temperature: float, entropy: float, dtype: torch.dtype | None = None) -> float:
    """``H = -Σ_v p_v ℓ_v`` of two paths: the log-probs' error ``δ`` (``log_softmax_tolerance``) weighted by
    ``Σ p = 1``; ``p = exp ℓ``'s relative error ``δ + 2u`` times ``Σ p |ℓ| = H``; the sum of ``V`` terms,
    ``gamma_probabilistic(V)`` of ``H`` in each path. ``entropy``: the largest ``H`` compared."""
    dtype = logits.dtype if dtype is None else dtype
    delta = log_softmax_tolerance(logits, temperature, dtype)
    vocab = logits.shape[-1]
    return delta * (1 + entropy) + 2 * (gamma_probabilistic(vocab, dtype) + 2 * unit_roundoff(dtype)) * entropy


def softmax_gradient_tolerance(logits: Tensor, temperature: float, entropy: float, upstream: float,
                               dtype: torch.dtype | None = None) -> float:
    """The logit gradient of ``Σ g ℓ_a + Σ h H`` (two paths): ``[g (e_a - p_v) - h p_v (ℓ_v + H)] / T`` per entry.
    ``p_v`` carries ``δ + 2u`` relative (``δ``: ``log_softmax_tolerance``), ``ℓ_v`` ``δ``, ``H`` ``δ_H``
    (``entropy_tolerance``); with ``p_v <= 1`` and ``p_v |ℓ_v| <= 1/e`` every entry is within
    ``upstream ((δ + 2u)(2 + 1/e + H) + δ_H) / T``, ``upstream`` the largest ``|g|``, ``|h|``."""
    dtype = logits.dtype if dtype is None else dtype
    delta = log_softmax_tolerance(logits, temperature, dtype) + 2 * unit_roundoff(dtype)
    delta_h = entropy_tolerance(logits, temperature, entropy, dtype)
    return upstream * (delta * (2 + 1 / math.e + entropy) + delta_h) / temperature


def decoder_logit_scale_bound(model) -> float:  # noqa: ANN001
    """An upper bound of ``S = max_v Σ_i |W_vi h_i|`` over every input: the final norm's output ``γ ⊙ x̂ (+ β)``
    has ``‖x̂‖₂ <= sqrt(H)`` (RMS norm: equal; layer norm: the centred vector's), so by Cauchy-Schwarz
    ``S <= sqrt(H) · max_v ‖W_v ⊙ γ‖₂ (+ Σ_i |W_vi β_i|)`` (Llama/Qwen2 ``model.model.norm``, GPT-2
    ``model.transformer.ln_f``)."""
    head = model.get_output_embeddings().weight.detach().float()
    norm = model.model.norm if hasattr(model, "model") else model.transformer.ln_f
    gain = norm.weight.detach().float()
    bound = math.sqrt(head.shape[1]) * (head * gain).norm(dim=1)
    if getattr(norm, "bias", None) is not None:
        bound = bound + (head.abs() @ norm.bias.detach().float().abs())
    return float(bound.max())


def decoder_logit_tolerance(model, context_length: int) -> float:  # noqa: ANN001
    """Two float32 computations of the same logits (other kernels, shapes, orders): ``2 sqrt(K) u S``
    (``rollout_helpers.fp32_logprob_tolerance``, step 1), ``S`` from ``decoder_logit_scale_bound``."""
    depth = decoder_depth(model.config, context_length)
    return 2 * math.sqrt(depth) * unit_roundoff(torch.float32) * decoder_logit_scale_bound(model)


def decoder_logprob_bound(model, temperature: float, context_length: int) -> float:  # noqa: ANN001
    """``decoder_logprob_tolerance`` without the hidden states, for a metric logged inside a fit: ``S`` from
    ``decoder_logit_scale_bound``."""
    from tests.rollout.rollout_helpers import fp32_logprob_tolerance

    scale = decoder_logit_scale_bound(model)
    layers, width, intermediate, head_dim = decoder_shape(model.config)
    return fp32_logprob_tolerance(scale, temperature, model.config.vocab_size, layers, width, intermediate,
                                  head_dim, context_length)
