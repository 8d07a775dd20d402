"""Method classes named by class_path in the CLI tests."""

from __future__ import annotations

from typing import Any

from rl_lightning.algorithms import GRPO


class WideClipGRPO(GRPO):
    """GRPO whose own defaults differ from configs/grpo.yaml's clip_eps_low/high (0.2): a class switch test."""

    def __init__(self, clip_eps_low: float = 0.3, clip_eps_high: float = 0.4, **kwargs: Any) -> None:
        super().__init__(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, **kwargs)
