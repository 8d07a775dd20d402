"""Evaluation statistics of k samples per problem."""

from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code", arXiv 2107.03374, §2.1): ``1 - C(n-c, k) / C(n, k)``, the chance that
    ``k`` of the ``n`` samples drawn without replacement hold at least one correct one (docs/algorithms.md).

    1 when ``n - c < k`` (every draw of ``k`` holds a correct one), 0 when ``c = 0``; computed as the product
    ``Π_{i=n-c+1}^{n} (1 - k/i)`` so that large ``n`` does not overflow.

    Raises:
        ValueError: ``k`` not in ``1..n`` or ``c`` not in ``0..n``.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in 1..n (n={n})")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} must be in 0..n (n={n})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
