"""The library's KV-cache engine and Hugging Face ``generate`` agree token for token for the same RNG state."""

from __future__ import annotations

import pytest
import torch

from rl_lightning.models import load_policy
from rl_lightning.rollout import HFGenerateEngine, KVCacheEngine, SamplingParams
from tests.tolerances import decoder_logprob_bound


@pytest.fixture(scope="module")
def policy():
    model, tok = load_policy("embedded:arithmetic")
    return model.eval(), tok


def _prompts(tok, texts):
    rows = [[tok.bos_token_id, *tok(t, add_special_tokens=False)["input_ids"]] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    return ids, (ids != tok.pad_token_id).long()


@pytest.mark.parametrize("static_cache", [True, False])
@pytest.mark.parametrize("greedy, temperature", [(True, 1.0), (False, 1.0), (False, 0.7)])
def test_engines_draw_the_same_tokens_and_logprobs(policy, greedy, temperature, static_cache):
    model, tok = policy
    ids, mask = _prompts(tok, ["37+48=", "5+5=", "99+1=", "12+34="] * 4)
    params = SamplingParams(max_tokens=6, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  temperature=temperature, greedy=greedy)
    torch.manual_seed(123)
    ours = KVCacheEngine(static_cache=static_cache).sample_padded(model, ids, mask, params)
    torch.manual_seed(123)
    ref = HFGenerateEngine().sample_padded(model, ids, mask, params)
    assert torch.equal(ours.mask, ref.mask)
    assert torch.equal(ours.response_ids, ref.response_ids)
    assert torch.equal(ours.truncated, ref.truncated)
    # the same model and tokens in other forward shapes: the float32 log-prob bound of this decoder
    bound = decoder_logprob_bound(model, params.temperature, ids.shape[1] + params.max_tokens)
    assert (ours.logprobs - ref.logprobs).abs().max() <= bound
    if not greedy:  # sampling really happened: rows with one prompt differ among themselves
        assert len({tuple(r) for r in ours.response_ids[0::4].tolist()}) > 1


def test_hf_engine_with_a_generator_is_reproducible_and_leaves_the_global_rng_alone(policy):
    model, tok = policy
    ids, mask = _prompts(tok, ["37+48="] * 8)
    params = SamplingParams(max_tokens=5, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    state = torch.get_rng_state()
    a = HFGenerateEngine().sample_padded(model, ids, mask, params, torch.Generator().manual_seed(7))
    b = HFGenerateEngine().sample_padded(model, ids, mask, params, torch.Generator().manual_seed(7))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.response_ids, b.response_ids)


def _forward_batch_sizes(model):
    """Rows fed to every forward (prompt and decode steps, on either decode path): a hook on the embedding."""
    sizes: list[int] = []
    handle = model.get_input_embeddings().register_forward_pre_hook(lambda mod, args: sizes.append(args[0].shape[0]))
    return sizes, handle


@pytest.mark.parametrize("static_cache", [True, False])
@pytest.mark.parametrize("name, temperature, compact_below", [
    ("embedded:random", 1.0, 0.75), ("embedded:random", 0.7, 1.0), ("embedded:arithmetic", 1.0, 0.5),
])
def test_dropping_finished_rows_changes_no_token(name, temperature, compact_below, static_cache):
    """Cutting finished rows out of the forward batch gives the same draws as keeping them."""
    model, tok = load_policy(name)
    model.eval()
    ids, mask = _prompts(tok, ["37+48=", "5+5=", "99+1=", "12+34=", "1+2=", "60+7="] * 4)  # 24 rows, padded
    params = SamplingParams(max_tokens=24, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  temperature=temperature)
    sizes, handle = _forward_batch_sizes(model)
    try:
        lean = KVCacheEngine(compact_below=compact_below, static_cache=static_cache).sample_padded(
            model, ids, mask, params, torch.Generator().manual_seed(5))
    finally:
        handle.remove()
    full = KVCacheEngine(drop_finished=False, static_cache=False).sample_padded(
        model, ids, mask, params, torch.Generator().manual_seed(5))
    lengths = full.mask.sum(1)
    assert lengths.min() < lengths.max()  # rows really finish at different steps
    assert sizes[0] == 6  # the prompt forward: each distinct prompt once (share_prefill)
    assert min(sizes[1:]) < ids.shape[0]  # and some decode forwards really ran on fewer rows
    assert sizes[1:] == sorted(sizes[1:], reverse=True)  # the forward batch only ever shrinks
    assert torch.equal(lean.response_ids, full.response_ids)
    assert torch.equal(lean.mask, full.mask)
    assert torch.equal(lean.truncated, full.truncated)
    # the same model and tokens in other forward shapes: the float32 log-prob bound of this decoder
    bound = decoder_logprob_bound(model, params.temperature, ids.shape[1] + params.max_tokens)
    assert (lean.logprobs - full.logprobs).abs().max() <= bound


@pytest.mark.parametrize("static_cache", [True, False])
def test_forward_batch_shrinks_to_the_running_rows(policy, static_cache):
    """With ``compact_below=1`` every decode forward runs exactly the rows that have not emitted EOS yet."""
    model, tok = policy
    ids, mask = _prompts(tok, ["37+48=", "5+5=", "99+1=", "12+34="] * 3)
    sizes, handle = _forward_batch_sizes(model)
    try:
        gen = KVCacheEngine(compact_below=1.0, static_cache=static_cache).sample_padded(
            model, ids, mask, SamplingParams(8, tok.eos_token_id, tok.pad_token_id), torch.Generator().manual_seed(3))
    finally:
        handle.remove()
    ended = (gen.response_ids == tok.eos_token_id).long().cumsum(1) > 0  # [N, T]: EOS at or before step t
    running_after = (~ended).sum(0).tolist()  # rows still running after drawing token t
    assert sizes[0] == 4  # the prompt forward: each distinct prompt once (share_prefill)
    assert sizes[1:] == running_after[:len(sizes) - 1]
    assert sizes[-1] < ids.shape[0]


def test_compact_below_zero_never_cuts_and_bad_values_are_refused(policy):
    model, tok = policy
    ids, mask = _prompts(tok, ["37+48=", "5+5="] * 4)
    sizes, handle = _forward_batch_sizes(model)
    try:
        KVCacheEngine(compact_below=0.0).sample_padded(model, ids, mask,
                                                       SamplingParams(8, tok.eos_token_id, tok.pad_token_id))
    finally:
        handle.remove()
    assert sizes[0] == 2 and set(sizes[1:]) == {ids.shape[0]}  # the prompt forward: each distinct prompt once
    with pytest.raises(ValueError, match="compact_below"):
        KVCacheEngine(compact_below=1.5)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_engines_agree_on_a_vocabulary_larger_than_generates_default_top_k(top_p):
    """``generate`` falls back to top-k 50 when ``top_k`` is unset; the reference engine must switch it off."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64)).eval()
    ids = torch.randint(3, 300, (16, 5))
    mask = torch.ones_like(ids)
    mask[::3, :2] = 0  # some left padding
    params = SamplingParams(max_tokens=8, eos_token_id=2, pad_token_id=0, top_p=top_p)
    torch.manual_seed(9)
    ours = KVCacheEngine().sample_padded(model, ids.masked_fill(mask == 0, 0), mask, params)
    torch.manual_seed(9)
    ref = HFGenerateEngine().sample_padded(model, ids.masked_fill(mask == 0, 0), mask, params)
    assert torch.equal(ours.response_ids, ref.response_ids)
    # the same model and tokens in other forward shapes: the float32 log-prob bound of this decoder
    bound = decoder_logprob_bound(model, params.temperature, ids.shape[1] + params.max_tokens)
    assert (ours.logprobs - ref.logprobs).abs().max() <= bound
    # a near-uniform random model over 300 tokens: plenty of the drawn tokens are outside any top 50
    ranks = (model(input_ids=ids).logits[:, -1].argsort(-1, descending=True) == ours.response_ids[:, :1]).float()
    assert ranks.argmax(-1).max() >= 50
