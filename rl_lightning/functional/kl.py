"""Per-token KL estimators (Schulman's k1/k2/k3): GRPO's KL to a reference, the Tinker-style KL to the sampler."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KLKind = Literal["k1", "k2", "k3"]


def kl_estimate(logp: Tensor, logp_other: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token estimate of ``KL(p || other)`` at tokens drawn from ``p`` (the distribution of ``logp``).

    With ``log_r = logp_other - logp``::

        k1 = -log_r                       (unbiased, can be negative)
        k2 = log_r**2 / 2                 (biased, low variance, >= 0)
        k3 = exp(log_r) - 1 - log_r       (unbiased, >= 0; GRPO's: Shao et al. 2024, arXiv 2402.03300, eq. 4)

    All three are 0 where ``logp == logp_other``. Differentiating k3 as a loss gives the gradient of the
    *forward* KL(other || p) in expectation (Tang & Munos 2025); it is kept for parity with GRPO.

    Example:
        >>> kl_estimate(torch.tensor([0.0]), torch.tensor([-1.0]), "k3")   # e^-1 - 1 + 1
        tensor([0.3679])
    """
    log_r = logp_other - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {kind!r}; use 'k1', 'k2' or 'k3'")
