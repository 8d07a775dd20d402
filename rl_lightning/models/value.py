"""Critics: a scalar value per generated-token position, on the policy's backbone or a separate network.

``V(s_t)`` is read from the hidden state at the position that predicts response token ``t`` (the state
before ``t`` is generated), so a value never sees the token it evaluates or anything after it.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from rl_lightning.functional.critics import bounded_value
from rl_lightning.models.policy import DType, load_policy

CriticMode = Literal["shared", "separate"]


class ValueHead(nn.Module):
    """``V = w · h + b``, initialised to output 0 (so early advantages are the raw returns); with ``bounds``
    ``(R_min, R_max)`` BPCO's bounded head ``V = R_min + (R_max - R_min) sigmoid(w · h + b)``
    (``functional.bounded_value``; it starts at the middle of the range)."""

    def __init__(self, hidden_size: int, bounds: tuple[float, float] | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        self.bounds = None if bounds is None else (float(bounds[0]), float(bounds[1]))
        if self.bounds is not None:
            bounded_value(torch.zeros(1), *self.bounds)  # refuses a bad range now, not at the first forward
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        raw = self.proj(hidden.to(self.proj.weight.dtype)).squeeze(-1)
        return raw if self.bounds is None else bounded_value(raw, *self.bounds)


class Critic(nn.Module):
    """A value model in one of two modes.

    * ``shared``: a ``ValueHead`` on the policy's final hidden states (one forward serves both; the
      backbone is trained by both losses). ``values`` needs the policy's ``hidden``.
    * ``separate``: its own decoder (initialised from a causal-LM checkpoint, LM head dropped) plus a
      ``ValueHead``.

    Args:
        mode: ``shared`` or ``separate``.
        hidden_size: width of the hidden states the head reads.
        backbone: the separate critic's decoder (a causal LM without its LM head; ``None`` in shared mode).
        bounds: ``(R_min, R_max)`` for a bounded head (``ValueHead``), ``None`` for a linear one.
    """

    def __init__(self, mode: CriticMode, hidden_size: int, backbone: PreTrainedModel | None = None,
                 bounds: tuple[float, float] | None = None) -> None:
        super().__init__()
        if (mode == "separate") != (backbone is not None):
            raise ValueError("Critic: a backbone is required in 'separate' mode and not allowed in 'shared' mode")
        self.mode = mode
        self.backbone = backbone
        self.head = ValueHead(hidden_size, bounds)

    def values(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        prompt_length: int,
        hidden: Tensor | None = None,
    ) -> Tensor:
        """``[N, T]`` values of the states before each response token (``T = width - prompt_length``)."""
        width = input_ids.shape[1] - prompt_length
        if self.mode == "shared":
            if hidden is None:
                raise ValueError("Critic(shared) needs the policy's hidden states")
            return self.head(hidden)
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False)
        states = out.last_hidden_state[:, prompt_length - 1:prompt_length - 1 + width]  # [N, T, H]
        return self.head(states)


def build_critic(mode: CriticMode, policy: PreTrainedModel, model_name_or_path: str, dtype: DType,
                 bounds: tuple[float, float] | None = None) -> Critic:
    """A critic for ``policy``: a head on it (``shared``) or a fresh copy of ``model_name_or_path`` (``separate``),
    bounded to ``bounds`` when given."""
    hidden_size = int(policy.config.hidden_size)
    if mode == "shared":
        return Critic("shared", hidden_size, bounds=bounds).to(dtype=getattr(torch, dtype))
    model, _ = load_policy(model_name_or_path, dtype)
    # Only the decoder: the language-model head would be an unused parameter (DDP refuses those).
    backbone = model.get_decoder().train()
    return Critic("separate", int(model.config.hidden_size), backbone, bounds).to(dtype=getattr(torch, dtype))
