"""Grouped-query attention without repeated keys and values on the CPU: ``sdpa_gqa``, a Hugging Face attention
implementation that ``load_policy`` gives every grouped-query checkpoint loaded with ``sdpa``.

A model with fewer key/value heads than query heads (grouped-query attention: SmolLM2, Llama 3, Qwen 2) runs, under
Hugging Face's ``sdpa`` with a padding mask on a CPU, ``repeat_kv``: every key and value head is copied
``heads / kv_heads`` times before ``torch.nn.functional.scaled_dot_product_attention``, and the learner's backward
keeps those copies (on SmolLM2, 9 query and 3 key/value heads: three times the keys and values). PyTorch's CPU
flash-attention kernel takes the grouped heads as they are (``enable_gqa=True``); Hugging Face asks for it only
where no mask is given, because CUDA's kernels fall back to the math kernel with a mask. The outputs are the same
bits; the key and value gradients are the same sums over a group's heads taken in another order
(``tests/models/test_attention.py``). ``experiments/bench_update_levers.py`` measures the memory and time it saves.

``sdpa_gqa`` runs that grouped kernel for CPU tensors of a grouped model and hands everything else (CUDA and other
devices, one key/value head per query head, a single query -- which Hugging Face already runs without copies --, a
position bias, soft-capping, asked-for attention weights) to Hugging Face's own ``sdpa`` unchanged. Its masks are
``sdpa``'s. The name lives in the loaded model's config only: ``save_pretrained`` writes no attention implementation,
so an exported checkpoint loads with ``sdpa`` anywhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

SDPA_GQA = "sdpa_gqa"
"""The attention implementation's name in Hugging Face's ``AttentionInterface`` and ``AttentionMaskInterface``."""


def gqa_sdpa_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                     **kwargs: Any) -> tuple[Tensor, None]:
    """Hugging Face's ``sdpa_attention_forward`` with grouped key/value heads kept grouped on the CPU.

    ``query`` ``[B, H, Q, D]``, ``key``/``value`` ``[B, H_kv, K, D]``; returns ``([B, Q, H, D], None)`` as Hugging
    Face's does. The causal flag follows Hugging Face's rule (causal only without a mask and for more than one query,
    with the keys cropped to the queries in a prefill of an empty static cache).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = getattr(module, "num_key_value_groups", 1) > 1
    special = any(kwargs.get(name) is not None for name in ("position_bias", "softcap")) \
        or kwargs.get("output_attentions", False)
    q_length = query.shape[2]  # one query: Hugging Face folds the group into the queries (pack_gqa), copying nothing
    if query.device.type != "cpu" or not grouped or special or q_length == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = attention_mask is None and bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if causal and key.shape[2] > q_length:
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=causal,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``sdpa_gqa`` with Hugging Face's attention and mask interfaces (idempotent)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(SDPA_GQA, gqa_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_GQA, sdpa_mask)


def use_grouped_attention(model: nn.Module) -> bool:
    """Switch ``model`` from Hugging Face's ``sdpa`` to ``sdpa_gqa``, in place; whether it did.

    Only a model with grouped heads (``num_key_value_heads < num_attention_heads`` in its config) that runs ``sdpa``
    and can switch its implementation (``set_attn_implementation``: Hugging Face's ``AttentionInterface`` models)
    switches; every other model (one key/value head per query head, eager or flash attention, custom code) is left
    as it is.
    """
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    grouped = heads is not None and getattr(config, "num_key_value_heads", None) not in (None, heads)
    can_set = getattr(model, "_can_set_attn_implementation", None)  # with set_attn_implementation: PreTrainedModel's
    if not grouped or getattr(config, "_attn_implementation", None) != "sdpa" or can_set is None or not can_set():
        return False
    register()
    model.set_attn_implementation(SDPA_GQA)
    return config._attn_implementation == SDPA_GQA
