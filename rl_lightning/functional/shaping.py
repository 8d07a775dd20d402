"""Reward shaping terms computed from a rollout's token counts (added to the task's reward for training only)."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_tokens: int, cache_tokens: int) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", arXiv 2503.14476, eq. 13; docs/algorithms.md,
    DAPO): 0 up to ``L_max - L_cache`` generated tokens, then falling linearly to -1 at ``L_max``, and -1 beyond::

        R_length(y) = 0                                 |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
                      -1                                L_max < |y|

    Args:
        lengths: ``[N]`` generated tokens per response (``|y|``).
        max_tokens: ``L_max``, the generation budget. cache_tokens: ``L_cache`` (``1 <= L_cache <= L_max``).

    Example:
        >>> overlong_penalty(torch.tensor([10, 12, 14, 16, 17]), max_tokens=16, cache_tokens=4)
        tensor([ 0.0000,  0.0000, -0.5000, -1.0000, -1.0000])
    """
    if not 1 <= cache_tokens <= max_tokens:
        raise ValueError(f"overlong_penalty: cache_tokens must be in [1, max_tokens={max_tokens}], got {cache_tokens}")
    free = max_tokens - cache_tokens
    penalty = (free - lengths.to(torch.float32)) / cache_tokens
    return penalty.clamp(min=-1.0, max=0.0)
