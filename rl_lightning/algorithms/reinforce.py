"""REINFORCE with a baseline (Williams 1992): ``L = -(R_i - b) log π_θ(o_i)``.

The loss and the baselines (``batch_mean``, ``ema``, ``none``) are ``PolicyGradient``'s; REINFORCE is the
policy gradient with a baseline, an exponential moving average of earlier batches' mean rewards by default.
"""

from __future__ import annotations

from typing import Any

from rl_lightning.algorithms.pg import Baseline, PolicyGradient


class REINFORCE(PolicyGradient):
    """Policy gradient on ``R_i - b``, with the baseline chosen in the config.

    Args:
        baseline: ``ema`` (default), ``batch_mean`` or ``none`` (``PolicyGradient``'s baselines).
        ema_decay: decay of the ``ema`` baseline (0.9 keeps about the last 10 batches).
        **kwargs: ``PolicyGradient`` / ``RLModule`` arguments.
    """

    def __init__(self, baseline: Baseline = "ema", ema_decay: float = 0.9, **kwargs: Any) -> None:
        super().__init__(baseline=baseline, ema_decay=ema_decay, **kwargs)
