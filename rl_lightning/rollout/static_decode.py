"""A lean decode step for Llama-family decoders on a pre-allocated KV cache.

Hugging Face's forward is general: per token it builds masks, walks module hooks, resolves the attention
backend and grows a ``DynamicCache`` by concatenation (every step copies the whole cache). For the small
batches of one sampled token per row that make up RL rollouts, that per-step work costs more than the
arithmetic itself on models of a few million parameters (``experiments/bench_vs_trl.py`` measures it).

``StaticDecoder`` runs the same arithmetic as ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``MistralForCausalLM`` (pre-norm RMSNorm, rotary q/k from the model's own ``rotary_emb``, grouped-query
attention, SiLU-gated MLP, optional q/k/v/o and MLP biases), reading the model's own parameters (nothing is
copied or converted), with:

* one pre-allocated ``[layers, 2, rows, kv_heads, length, head_dim]`` cache written in place (no copy of
  the whole cache per token),
* attention as two batched matrix products over the filled part of the cache, grouped-query heads without
  repeating keys and values,
* prompt padding as one additive mask row per sequence, made once, and no per-step mask building,
* in a rollout of at least ``MERGE_MIN_STEPS`` decode steps, a projection with LoRA adapters
  (``models.adapters.add_lora``) multiplied by its effective weight, the base weight with its active adapters merged
  (``adapters.effective_weight``, computed once per rollout and held for its duration, a copy of each adapted weight:
  one product per token instead of the base's and the adapters' three; rounding differs from the adapters' own
  forward by a few fp32 ulps of the output, which the sampler contract's bound covers). In shorter rollouts, and where
  the adapted forward is not a plain product (DoRA, active adapter dropout), the projection runs its own forward.

(Fusing q/k/v and gate/up into single matrix products was measured too: on this project's CPU it was slower
for models from 10M parameters up, and it needs a weight copy per rollout, so the projections stay separate.)

The prompt itself goes through the model's own forward (one call, so its cost does not matter); its keys and
values are copied into the static cache. ``supports(model)`` says whether a model has exactly this
structure; anything else keeps the general loop (``generation.sample``), so the fast path never changes what
a model computes (beyond the rounding of merged adapter weights), only how fast -- the tests compare its tokens and
log-probs with Hugging Face ``generate``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from rl_lightning.models.adapters import effective_weight, is_adapted_linear

#: ``config.model_type`` values whose decoder layers have exactly the structure computed here
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def _config_reason(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model_type {getattr(config, 'model_type', None)!r} not in {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    window = getattr(config, "sliding_window", None)
    if window is not None and (config.model_type == "mistral" or getattr(config, "use_sliding_window", False)):
        return "sliding-window attention"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    return None


def unsupported_reason(model: nn.Module) -> str | None:
    """``None`` when ``StaticDecoder`` computes exactly ``model``'s forward; otherwise why not."""
    reason = _config_reason(model)
    if reason is not None:
        return reason
    base = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in needed) or not hasattr(model, "lm_head"):
        return "not a <Model>ForCausalLM with model.{embed_tokens, layers, norm, rotary_emb} and lm_head"
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(
            hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")
        ) or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "a decoder layer without self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj"
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if not all(type(p) is nn.Linear or is_adapted_linear(p) for p in projections):
            return "projections that are neither plain nn.Linear nor LoRA adapters on one (quantised layers)"
    if model.training and getattr(model.config, "attention_dropout", 0.0):  # eval-mode arithmetic only
        return "attention dropout in training mode"
    return None


def supports(model: nn.Module) -> bool:
    """Whether ``StaticDecoder`` computes exactly ``model``'s forward (see ``unsupported_reason``)."""
    return unsupported_reason(model) is None


def _rms_norm(x: Tensor, norm: nn.Module) -> Tensor:
    """Hugging Face's Llama RMSNorm: normalise in float32, cast back, then scale."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    xf = x.float()
    return norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


#: the fewest decode steps for which a rollout merges LoRA adapters into effective weights: merging all of a
#: model's adapted projections costs about what running their adapters for that many steps does
#: (``experiments/bench_lora_decode.py`` on SmolLM2, rank 16 on seven projections: merged/through the adapters 1.05
#: at 8 rows x 16 steps, 1.09 at 32 x 8, 0.96 at 8 x 32, 0.92 at 32 x 32)
MERGE_MIN_STEPS = 32


def projection(layer: nn.Module, merge: bool = True) -> tuple[Tensor | None, Tensor | None, nn.Module]:
    """How the decode step multiplies by one projection: ``(weight, bias, layer)`` with the weight to use -- a plain
    ``nn.Linear``'s own, or with ``merge`` a LoRA-adapted one's with its active adapters merged
    (``adapters.effective_weight``: what its adapters add, or while they are disabled do not add, is never skipped)
    -- or ``weight`` ``None``: run ``layer``'s own forward."""
    if type(layer) is nn.Linear:
        return layer.weight, layer.bias, layer
    return (effective_weight(layer) if merge else None), layer.base_layer.bias, layer


def _linear(x: Tensor, proj: tuple[Tensor | None, Tensor | None, nn.Module]) -> Tensor:
    weight, bias, layer = proj
    return layer(x) if weight is None else F.linear(x, weight, bias)


def _cache_tensors(cache: object, layer: int) -> tuple[Tensor, Tensor]:
    """Keys and values of one layer of a Hugging Face cache (``layers[i].keys`` or the older ``key_cache[i]``)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


class StaticDecoder:
    """One rollout's decode state: the model's layers, a pre-allocated KV cache and the padding mask.

    Build it right after the prompt forward (``from_prefill``), then call ``step`` once per new token.
    ``select(rows)`` keeps only some rows (finished ones leave the batch).
    """

    def __init__(self, model: nn.Module, batch: int, capacity: int, dtype: torch.dtype, device: torch.device,
                 merge_adapters: bool = True):
        config = model.config
        self.model = model
        self.base = model.model
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.layers = [
            (layer.input_layernorm,
             *(projection(p, merge_adapters) for p in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                       layer.self_attn.v_proj, layer.self_attn.o_proj)),
             layer.post_attention_layernorm,
             *(projection(p, merge_adapters) for p in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)))
            for layer in self.base.layers
        ]
        self.capacity = capacity
        self.cache = torch.zeros(len(self.layers), 2, batch, self.kv_heads, capacity, self.head_dim,
                                 dtype=dtype, device=device)
        self.bias = torch.zeros(batch, 1, 1, capacity, dtype=torch.float32, device=device)  # additive pad mask
        self.length = 0  # filled cache columns

    @classmethod
    def from_prefill(cls, model: nn.Module, cache: object, attention_mask: Tensor, max_new_tokens: int
                     ) -> StaticDecoder:
        """Copy the prompt's keys/values out of the Hugging Face ``cache`` its forward returned."""
        keys, _ = _cache_tensors(cache, 0)
        batch, _, prompt_len, _ = keys.shape
        decoder = cls(model, batch, prompt_len + max_new_tokens, keys.dtype, keys.device,
                      merge_adapters=max_new_tokens >= MERGE_MIN_STEPS)
        for i in range(len(decoder.layers)):
            k, v = _cache_tensors(cache, i)
            decoder.cache[i, 0, :, :, :prompt_len] = k
            decoder.cache[i, 1, :, :, :prompt_len] = v
        decoder.bias[:, 0, 0, :prompt_len].masked_fill_(attention_mask[:, :prompt_len] == 0,
                                                        torch.finfo(torch.float32).min)
        decoder.length = prompt_len
        return decoder

    def select(self, rows: Tensor) -> None:
        """Keep only ``rows`` (indices into the current batch)."""
        self.cache = self.cache.index_select(2, rows)
        self.bias = self.bias.index_select(0, rows)

    @torch.no_grad()
    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Feed one token per row (``[B]`` ids at ``[B, 1]`` positions); returns the next-token logits ``[B, V]``."""
        if self.length >= self.capacity:
            raise RuntimeError(f"StaticDecoder: cache full ({self.capacity} positions)")
        batch = tokens.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        group = heads // kv_heads
        col, end = self.length, self.length + 1
        h = self.base.embed_tokens(tokens.unsqueeze(-1))  # [B, 1, H]
        cos, sin = self.base.rotary_emb(h, positions)  # [B, 1, D]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, 1, D]
        bias = self.bias[..., :end]  # [B, 1, 1, S]
        for i, (norm1, q_proj, k_proj, v_proj, o_proj, norm2, gate_proj, up_proj, down) in enumerate(self.layers):
            x = _rms_norm(h, norm1)
            q = _rotate(_linear(x, q_proj).view(batch, heads, 1, dim), cos, sin)  # [B, 1, h*d] -> [B, h, 1, d]
            k = _rotate(_linear(x, k_proj).view(batch, kv_heads, 1, dim), cos, sin)
            v = _linear(x, v_proj)
            keys, values = self.cache[i, 0], self.cache[i, 1]  # [B, kv, S_max, D]
            keys[:, :, col:end] = k
            values[:, :, col:end] = v.view(batch, kv_heads, 1, dim)
            # grouped-query attention: the `group` query heads of one kv head share its keys and values
            scores = torch.matmul(q.view(batch, kv_heads, group, dim), keys[:, :, :end].transpose(-1, -2))
            probs = torch.softmax(scores.float() * self.scale + bias, dim=-1).to(values.dtype)  # [B, kv, g, S]
            attn = torch.matmul(probs, values[:, :, :end])  # [B, kv, group, D]
            h = h + _linear(attn.reshape(batch, 1, heads * dim), o_proj)
            x = _rms_norm(h, norm2)
            h = h + _linear(F.silu(_linear(x, gate_proj)) * _linear(x, up_proj), down)
        self.length = end
        return self.model.lm_head(_rms_norm(h[:, -1], self.base.norm))
