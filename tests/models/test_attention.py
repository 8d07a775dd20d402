"""``sdpa_gqa``: Hugging Face's ``sdpa`` arithmetic on grouped key/value heads without copying them per query head.

Outputs are compared bit for bit with Hugging Face's ``sdpa`` (the same kernel reads the same numbers). Gradients
of the keys and values are sums over the query heads of a group, taken by the kernel instead of by ``repeat_kv``'s
backward: the same terms in another order. So both are float32 computations of the same float64 quantity, and the
check is that ours is as accurate as Hugging Face's: its distance from the float64 result at most a few times
Hugging Face's own, plus a few ulps of the largest entry (``as_accurate``).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rl_lightning.models.attention import SDPA_GQA, gqa_sdpa_forward, use_grouped_attention
from rl_lightning.models.policy import build_tiny_policy, load_policy, tiny_llama_config

EPS = torch.finfo(torch.float32).eps


class Heads(torch.nn.Module):
    """What the attention functions read from an attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def grouped_inputs(batch=3, heads=6, kv_heads=2, q_len=5, kv_len=9, dim=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, q_len, dim, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_heads, kv_len, dim, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, kv_heads, kv_len, dim, generator=gen, dtype=dtype, requires_grad=True)
    mask = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    mask[0, :, :, :3] = False  # a left-padded row
    return q, k, v, mask


def as_accurate(ours, theirs, exact) -> bool:
    """``ours`` is no further from the float64 ``exact`` than 4 x ``theirs`` is, plus 4 ulps of its largest entry."""
    exact = exact.double()
    slack = 4 * (theirs.double() - exact).abs().max() + 4 * EPS * exact.abs().max()
    return bool((ours.double() - exact).abs().max() <= slack)


def float64(*tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


@pytest.mark.parametrize("q_len, masked", [(5, True), (5, False), (1, True), (1, False)])
def test_outputs_equal_hugging_faces_sdpa_bit_for_bit_and_gradients_to_summation_error(q_len, masked):
    q, k, v, mask = grouped_inputs(q_len=q_len)
    mask = mask if masked else None
    module = Heads(groups=3)
    ours, none = gqa_sdpa_forward(module, q, k, v, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert none is None and ours.shape == (3, q_len, 6, 8)
    assert torch.equal(ours, theirs)
    upstream = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1))
    g_ours = torch.autograd.grad(ours, (q, k, v), upstream)
    g_theirs = torch.autograd.grad(theirs, (q, k, v), upstream)
    exact_inputs = float64(q, k, v)
    exact_out, _ = sdpa_attention_forward(module, *exact_inputs, mask, scaling=0.3)
    g_exact = torch.autograd.grad(exact_out, exact_inputs, upstream.double())
    for a, b, c in zip(g_ours, g_theirs, g_exact):
        assert as_accurate(a, b, c)


def test_a_prefill_without_mask_crops_the_keys_to_the_queries_as_hugging_face_does():
    q, k, v, _ = grouped_inputs(q_len=4, kv_len=10)
    ours, _ = gqa_sdpa_forward(Heads(3), q, k, v, None)
    theirs, _ = sdpa_attention_forward(Heads(3), q, k, v, None)
    assert torch.equal(ours, theirs)


def test_bfloat16_outputs_equal_hugging_faces():
    q, k, v, mask = grouped_inputs(dtype=torch.bfloat16)
    assert torch.equal(gqa_sdpa_forward(Heads(3), q, k, v, mask)[0], sdpa_attention_forward(Heads(3), q, k, v, mask)[0])


def test_what_it_does_not_handle_goes_to_hugging_faces_sdpa(monkeypatch):
    import transformers.integrations.sdpa_attention as hf

    calls = []
    monkeypatch.setattr(hf, "sdpa_attention_forward", lambda *args, **kwargs: calls.append(kwargs) or ("hf", None))
    q, k, v, mask = grouped_inputs()
    cases = {
        "soft-capping": (Heads(3), q, k, v, mask, {"softcap": 30.0}),
        "a position bias": (Heads(3), q, k, v, mask, {"position_bias": torch.zeros(1, 6, 5, 9)}),
        "attention weights": (Heads(3), q, k, v, mask, {"output_attentions": True}),
        "one key/value head per query head": (Heads(1), *grouped_inputs(kv_heads=6), {}),
        "a single query": (Heads(3), *grouped_inputs(q_len=1), {}),
        "another device": (Heads(3), *(t.to("meta") for t in (q, k, v, mask)), {}),
    }
    for what, (module, *tensors, kwargs) in cases.items():
        assert gqa_sdpa_forward(module, *tensors, **kwargs) == ("hf", None), what
    assert len(calls) == len(cases)
    assert gqa_sdpa_forward(Heads(3), q, k, v, mask)[0].shape == (3, 5, 6, 8)  # the grouped CPU case: its own
    assert len(calls) == len(cases)


def test_the_math_kernel_gives_a_double_backward():
    """The natural-gradient methods differentiate twice under ``sdpa_kernel(SDPBackend.MATH)``."""
    q, k, v, mask = grouped_inputs()
    with sdpa_kernel(SDPBackend.MATH):
        out, _ = gqa_sdpa_forward(Heads(3), q, k, v, mask)
        (gq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
        (ggk,) = torch.autograd.grad(gq.pow(2).sum(), k)
    assert ggk.shape == k.shape and torch.isfinite(ggk).all() and ggk.abs().sum() > 0


def grouped_llama(seed: int = 0) -> LlamaForCausalLM:
    config = tiny_llama_config(vocab_size=99, hidden_size=48, num_layers=2, num_heads=6, intermediate_size=64)
    config.num_key_value_heads = 2
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def test_a_grouped_llama_switches_and_computes_the_same_logits_and_gradients():
    ids = torch.randint(4, 99, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    results = []
    for switch, dtype in ((False, torch.float32), (True, torch.float32), (False, torch.float64)):
        model = grouped_llama().to(dtype)
        assert model.config._attn_implementation == "sdpa"
        if switch:
            assert use_grouped_attention(model) and model.config._attn_implementation == SDPA_GQA
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits.logsumexp(-1).sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, g_plain), (grouped, g_grouped), (_, g_exact) = results
    assert torch.equal(plain, grouped)
    for name, grad in g_plain.items():
        assert as_accurate(g_grouped[name], grad, g_exact[name]), name


def test_eager_models_and_models_without_sdpa_are_left_alone():
    model = grouped_llama()
    model.set_attn_implementation("eager")
    assert not use_grouped_attention(model) and model.config._attn_implementation == "eager"
    assert not use_grouped_attention(torch.nn.Linear(2, 2))


def test_load_policy_switches_a_checkpoint_and_the_saved_config_says_sdpa(tmp_path):
    model = grouped_llama()
    _, tok = build_tiny_policy()
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    loaded, _ = load_policy(str(tmp_path / "ckpt"))
    assert loaded.config._attn_implementation == SDPA_GQA
    loaded.save_pretrained(tmp_path / "again")
    assert SDPA_GQA not in (tmp_path / "again" / "config.json").read_text()
    assert "sdpa_gqa" not in json.dumps(loaded.config.to_dict())
    assert LlamaForCausalLM.from_pretrained(tmp_path / "again").config._attn_implementation == "sdpa"


def test_models_without_grouped_heads_are_not_switched():
    model, _ = load_policy("embedded:arithmetic")  # the embedded default: one key/value head per query head
    assert model.config._attn_implementation == "sdpa" and not use_grouped_attention(model)
    assert not use_grouped_attention(build_tiny_policy()[0])
