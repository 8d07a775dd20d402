"""Critics: a scalar value per generated-token position, on the policy's backbone, a separate network, or LoRA
adapters of the critic's own on the (LoRA) policy's frozen base.

``V(s_t)`` is read from the hidden state at the position that predicts response token ``t`` (the state
before ``t`` is generated), so a value never sees the token it evaluates or anything after it.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from rl_lightning.functional.critics import bounded_value
from rl_lightning.models.adapters import AdapterView, adapter_parameters, add_adapter
from rl_lightning.models.policy import DType, load_policy

CriticMode = Literal["shared", "separate", "adapter"]
#: the name of the value critic's adapters on the policy (``adapter`` mode)
CRITIC_ADAPTER = "critic"


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
    """A value model in one of three modes.

    * ``shared``: a ``ValueHead`` on the policy's final hidden states (one forward serves both; the
      backbone is trained by both losses). ``values`` needs the policy's ``hidden``.
    * ``separate``: its own decoder (initialised from a causal-LM checkpoint, LM head dropped) plus a
      ``ValueHead``.
    * ``adapter``: the LoRA policy's decoder run with only the critic's adapters on (an ``AdapterView``: the frozen
      base plus adapters of its own, no second model) plus a ``ValueHead``. The adapters live in the policy (and
      its checkpoint); ``trainable`` lists them with the head.

    Args:
        mode: ``shared``, ``separate`` or ``adapter``.
        hidden_size: width of the hidden states the head reads.
        backbone: the separate critic's decoder (a causal LM without its LM head), the adapter critic's
            ``AdapterView``; ``None`` in shared mode.
        bounds: ``(R_min, R_max)`` for a bounded head (``ValueHead``), ``None`` for a linear one.
    """

    def __init__(self, mode: CriticMode, hidden_size: int, backbone: Any = None,
                 bounds: tuple[float, float] | None = None) -> None:
        super().__init__()
        if (mode == "shared") != (backbone is None) or (mode == "adapter") != isinstance(backbone, AdapterView):
            raise ValueError("Critic: 'separate' mode needs a decoder, 'adapter' mode an AdapterView, 'shared' mode "
                             "no backbone")
        self.mode = mode
        self.backbone = backbone
        self.head = ValueHead(hidden_size, bounds)

    def named_trainable(self) -> list[tuple[str, nn.Parameter]]:
        """The critic's own named parameters: its module's, and in ``adapter`` mode its adapters (named as in the
        policy, after ``adapter.``), which live in the policy."""
        own = list(self.named_parameters())
        if self.mode == "adapter":
            target, name = self.backbone.target, self.backbone.adapter
            ids = {id(p) for p in adapter_parameters(target, name)}
            own += [(f"adapter.{n}", p) for n, p in target.named_parameters() if id(p) in ids]
        return own

    def trainable(self) -> list[nn.Parameter]:
        """The parameters the critic's optimiser group holds (``named_trainable``)."""
        return [p for _, p in self.named_trainable()]

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
        if self.mode == "adapter":  # the policy's decoder (no LM head) with the critic's adapters alone
            with self.backbone.running():
                out = self.backbone.target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                                         position_ids=position_ids, use_cache=False)
        else:
            out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=False)
        states = out.last_hidden_state[:, prompt_length - 1:prompt_length - 1 + width]  # [N, T, H]
        return self.head(states)


def build_critic(mode: CriticMode, policy: PreTrainedModel, model_name_or_path: str, dtype: DType,
                 bounds: tuple[float, float] | None = None) -> Critic:
    """A critic for ``policy``: a head on it (``shared``), a fresh copy of ``model_name_or_path`` (``separate``) or
    adapters ``CRITIC_ADAPTER`` added to the LoRA ``policy`` (``adapter``; ``models.adapters.add_adapter``),
    bounded to ``bounds`` when given."""
    hidden_size = int(policy.config.hidden_size)
    if mode == "shared":
        return Critic("shared", hidden_size, bounds=bounds).to(dtype=getattr(torch, dtype))
    if mode == "adapter":
        add_adapter(policy, CRITIC_ADAPTER)
        view = AdapterView(policy, CRITIC_ADAPTER)
        return Critic("adapter", hidden_size, view, bounds).to(dtype=getattr(torch, dtype))
    model, _ = load_policy(model_name_or_path, dtype)
    # Only the decoder: the language-model head would be an unused parameter (DDP refuses those).
    backbone = model.get_decoder().train()
    return Critic("separate", int(model.config.hidden_size), backbone, bounds).to(dtype=getattr(torch, dtype))
