"""``candidate_logprobs``: next-token log-probs over candidate ids at given contexts, one forward row per context,
equal to the documented ``score_sequences`` path (one row per context and candidate) on numbers."""

from __future__ import annotations

import pytest
import torch

from rl_lightning.algorithms import GRPO
from tests.tolerances import decoder_logprob_bound


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_candidate_logprobs_equal_the_score_sequences_path(temperature):
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:guess")
    tok = module.tokenizer
    texts = ["guess 1-31:16", "guess 1-31:16\nhi:24", "guess 1-31:8\nlo:4\nhi:6 V:", "7"]
    contexts = [[tok.bos_token_id, *tok(t, add_special_tokens=False)["input_ids"]] for t in texts]  # ragged
    grid = [tok(str(d), add_special_tokens=False)["input_ids"][0] for d in range(10)] + [tok.eos_token_id]  # 11
    fast = module.candidate_logprobs(contexts, grid, temperature=temperature)
    assert fast.shape == (4, 11) and fast.requires_grad
    pairs = [(c, [g]) for c in contexts for g in grid]  # the documented path: one row per (context, candidate)
    out, mask = module.score_sequences([c for c, _ in pairs], [t for _, t in pairs], temperature=temperature)
    slow = out.logprobs[:, 0].reshape(4, 11)
    tol = decoder_logprob_bound(module.policy, temperature, max(len(c) for c in contexts) + 1)
    assert float((fast - slow).detach().abs().max()) <= tol
    assert float(slow.exp().sum(-1).max()) < 1.0 and float(fast.detach().std()) > 10 * tol  # a real spread
    # per-context candidates [C, K]: each row's own ids
    own = torch.tensor([grid[:3], grid[3:6], grid[6:9], grid[8:11]])
    picked = module.candidate_logprobs(contexts, own, temperature=temperature)
    torch.testing.assert_close(picked, torch.stack([fast[i, [3 * i + j if i < 3 else 8 + j for j in range(3)]]
                                                    for i in range(4)]), rtol=0, atol=tol)
    fast.logsumexp(-1).sum().backward()  # the gradient reaches the policy
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in module.policy.parameters())
    with pytest.raises(ValueError, match="at least one id"):
        module.candidate_logprobs([[1], []], grid)
