"""The library's KV-cache engine and Hugging Face ``generate`` agree token for token for the same RNG state."""

from __future__ import annotations

import pytest
import torch

from rl_lightning.models import load_policy
from rl_lightning.rollout import HFGenerateEngine, KVCacheEngine


@pytest.fixture(scope="module")
def policy():
    model, tok = load_policy("embedded:arithmetic")
    return model.eval(), tok


def _prompts(tok, texts):
    rows = [[tok.bos_token_id, *tok(t, add_special_tokens=False)["input_ids"]] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    return ids, (ids != tok.pad_token_id).long()


@pytest.mark.parametrize("greedy, temperature", [(True, 1.0), (False, 1.0), (False, 0.7)])
def test_engines_draw_the_same_tokens_and_logprobs(policy, greedy, temperature):
    model, tok = policy
    ids, mask = _prompts(tok, ["37+48=", "5+5=", "99+1=", "12+34="] * 4)
    kwargs = dict(max_new_tokens=6, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  temperature=temperature, greedy=greedy)
    torch.manual_seed(123)
    ours = KVCacheEngine().generate(model, ids, mask, **kwargs)
    torch.manual_seed(123)
    ref = HFGenerateEngine().generate(model, ids, mask, **kwargs)
    assert torch.equal(ours.mask, ref.mask)
    assert torch.equal(ours.response_ids, ref.response_ids)
    assert torch.equal(ours.truncated, ref.truncated)
    assert (ours.logprobs - ref.logprobs).abs().max() < 1e-5
    if not greedy:  # sampling really happened: rows with one prompt differ among themselves
        assert len({tuple(r) for r in ours.response_ids[0::4].tolist()}) > 1


def test_hf_engine_with_a_generator_is_reproducible_and_leaves_the_global_rng_alone(policy):
    model, tok = policy
    ids, mask = _prompts(tok, ["37+48="] * 8)
    kwargs = dict(max_new_tokens=5, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    state = torch.get_rng_state()
    a = HFGenerateEngine().generate(model, ids, mask, generator=torch.Generator().manual_seed(7), **kwargs)
    b = HFGenerateEngine().generate(model, ids, mask, generator=torch.Generator().manual_seed(7), **kwargs)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.response_ids, b.response_ids)
