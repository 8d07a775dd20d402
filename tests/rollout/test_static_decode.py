"""``StaticDecoder`` computes what the model's own forward computes, step by step, for each supported family."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rl_lightning.rollout import SamplingParams, sample
from rl_lightning.rollout.generation import DecodeOptions, cache_argument, returned_cache
from rl_lightning.rollout.static_decode import StaticDecoder, supports, unsupported_reason
from tests.tolerances import decoder_logprob_bound

SMALL = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)


def _models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "llama": LlamaForCausalLM(LlamaConfig(**SMALL)),
        "llama-gqa-tied": LlamaForCausalLM(LlamaConfig(**SMALL, num_key_value_heads=2, tie_word_embeddings=True)),
        "llama-head_dim-rope3": LlamaForCausalLM(LlamaConfig(
            **SMALL, head_dim=16, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
        "qwen2-bias": Qwen2ForCausalLM(Qwen2Config(**SMALL, num_key_value_heads=2)),
        "mistral": MistralForCausalLM(MistralConfig(**SMALL, num_key_value_heads=1, sliding_window=None)),
    }


MODELS = _models()


def _prompt_batch(vocab: int, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=g)
    mask = (torch.arange(width).unsqueeze(0) >= (width - torch.tensor(lengths)).unsqueeze(1)).long()
    return ids.masked_fill(mask == 0, 0), mask


def _hf_prefill(model, ids, mask):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    return returned_cache(out), positions[:, -1:] + 1


@pytest.mark.parametrize("name", list(MODELS))
def test_decode_steps_match_the_models_forward(name):
    model = MODELS[name].eval()
    assert supports(model), unsupported_reason(model)
    ids, mask = _prompt_batch(model.config.vocab_size, [5, 2, 4, 1])  # left-padded, one 1-token prompt
    with torch.no_grad():
        cache, pos = _hf_prefill(model, ids, mask)
        decoder = StaticDecoder.from_prefill(model, cache, mask, max_new_tokens=6)
        g = torch.Generator().manual_seed(1)
        attn = mask
        for _ in range(6):
            token = torch.randint(3, model.config.vocab_size, (ids.shape[0],), generator=g)
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
            ref = model(input_ids=token.unsqueeze(-1), attention_mask=attn, position_ids=pos, use_cache=True,
                        **{cache_argument(model): cache})
            cache = returned_cache(ref)
            ours = decoder.step(token, pos)
            assert ours.shape == (ids.shape[0], model.config.vocab_size)
            assert (ours - ref.logits[:, -1]).abs().max() < 1e-5
            pos = pos + 1
        with pytest.raises(RuntimeError, match="cache full"):
            decoder.step(token, pos)


def test_selected_rows_keep_their_own_context():
    model = MODELS["llama-gqa-tied"].eval()
    ids, mask = _prompt_batch(model.config.vocab_size, [3, 5, 2, 4], seed=2)
    keep = torch.tensor([1, 3])
    with torch.no_grad():
        cache, pos = _hf_prefill(model, ids, mask)
        decoder = StaticDecoder.from_prefill(model, cache, mask, max_new_tokens=4)
        token = torch.tensor([7, 8, 9, 10])
        decoder.step(token, pos)
        decoder.select(keep)
        later = decoder.step(torch.tensor([11, 12]), pos[keep] + 1)
        # reference: the kept rows alone, through the model's forward on the full sequences
        full = torch.cat([ids, token.unsqueeze(1), torch.tensor([[0], [11], [0], [12]])], dim=1)[keep]
        full_mask = torch.cat([mask, torch.ones(4, 2, dtype=torch.long)], dim=1)[keep]
        ref = model(input_ids=full, attention_mask=full_mask, position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0))
    assert (later - ref.logits[:, -1]).abs().max() < 1e-5


def test_bfloat16_decode_stays_close_to_the_models_forward():
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).to(torch.bfloat16).eval()
    ids, mask = _prompt_batch(model.config.vocab_size, [4, 2])
    with torch.no_grad():
        cache, pos = _hf_prefill(model, ids, mask)
        decoder = StaticDecoder.from_prefill(model, cache, mask, max_new_tokens=2)
        token = torch.tensor([5, 6])
        attn = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        ref = model(input_ids=token.unsqueeze(-1), attention_mask=attn, position_ids=pos, use_cache=True,
                    **{cache_argument(model): cache}).logits[:, -1]
        ours = decoder.step(token, pos)
    assert ours.dtype == torch.bfloat16 and decoder.cache.dtype == torch.bfloat16
    assert (ours.float() - ref.float()).abs().max() < 0.05  # bf16 rounding of a different summation order


def test_unsupported_models_say_why_and_keep_the_general_loop():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()
    assert not supports(gpt2) and "gpt2" in unsupported_reason(gpt2)
    windowed = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=8)).eval()
    assert "sliding-window" in unsupported_reason(windowed)
    ids, mask = _prompt_batch(40, [4, 2, 3])
    params = SamplingParams(max_tokens=5, eos_token_id=1, pad_token_id=0)
    a = sample(gpt2, ids, mask, params, torch.Generator().manual_seed(0), options=DecodeOptions(static_cache=True))
    b = sample(gpt2, ids, mask, params, torch.Generator().manual_seed(0), options=DecodeOptions(static_cache=False))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("name", ["llama", "qwen2-bias"])
def test_sampling_with_the_static_cache_equals_the_general_loop(name):
    model = MODELS[name].eval()
    ids, mask = _prompt_batch(model.config.vocab_size, [5, 2, 4, 1, 3, 3])
    params = SamplingParams(max_tokens=12, eos_token_id=1, pad_token_id=0, temperature=0.9)
    a = sample(model, ids, mask, params, torch.Generator().manual_seed(4), options=DecodeOptions(static_cache=True))
    b = sample(model, ids, mask, params, torch.Generator().manual_seed(4), options=DecodeOptions(static_cache=False))
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.mask, b.mask)
    bound = decoder_logprob_bound(model, params.temperature, ids.shape[1] + params.max_tokens)
    assert (a.logprobs - b.logprobs).abs().max() <= bound  # the same tokens, other kernels: fp32 rounding


@pytest.mark.parametrize("max_new_tokens", [2, 32], ids=["through-adapters", "merged-weights"])
def test_lora_adapted_projections_decode_through_their_adapters(max_new_tokens):
    """A policy with LoRA adapters (``add_lora``, nonzero ``B`` as after training) decodes on ``StaticDecoder``:
    each projection runs its adapters' forward (a short rollout) or multiplies by its weight with the active
    adapters merged (from ``MERGE_MIN_STEPS`` decode steps), so the logits are the adapted model's (and, with the
    adapters disabled, the base model's)."""
    from rl_lightning.rollout.static_decode import MERGE_MIN_STEPS

    assert (max_new_tokens >= MERGE_MIN_STEPS) == (max_new_tokens == 32)
    from rl_lightning.models.adapters import LoraSettings, add_lora, adapters_disabled

    torch.manual_seed(0)
    model = add_lora(LlamaForCausalLM(LlamaConfig(**SMALL, num_key_value_heads=2)), LoraSettings(rank=4)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    assert supports(model), unsupported_reason(model)
    ids, mask = _prompt_batch(model.config.vocab_size, [5, 2, 4])
    token = torch.tensor([7, 8, 9])
    attn = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    logits = {}
    for disabled in (False, True):
        with torch.no_grad(), (adapters_disabled(model) if disabled else nullcontext()):
            cache, pos = _hf_prefill(model, ids, mask)
            decoder = StaticDecoder.from_prefill(model, cache, mask, max_new_tokens=max_new_tokens)
            merged = [proj[0] is not None for layer in decoder.layers for proj in layer[1:5] + layer[6:]]
            assert all(merged) if max_new_tokens == 32 else not any(merged)
            ours = decoder.step(token, pos)
            ref = model(input_ids=token.unsqueeze(-1), attention_mask=attn, position_ids=pos, use_cache=True,
                        **{cache_argument(model): cache}).logits[:, -1]
        assert (ours - ref).abs().max() < 1e-5
        logits[disabled] = ours
    assert (logits[False] - logits[True]).abs().max() > 1e-2  # the adapters change what is computed


def test_quantised_projections_keep_the_general_loop():
    """A projection that is a subclass of ``nn.Linear`` (as quantised layers are) is not read as a plain one."""
    class Quantised(torch.nn.Linear):
        pass

    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    layer = model.model.layers[1].mlp
    layer.down_proj = Quantised(layer.down_proj.in_features, layer.down_proj.out_features, bias=False)
    assert not supports(model) and "quantised" in unsupported_reason(model)
