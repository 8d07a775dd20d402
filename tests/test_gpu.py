"""CUDA paths (``-m gpu``; deselected by default, run by ``experiments/gpu_check.sh`` on a machine with a GPU).

* fp32 on CUDA keeps the sampler contract: the learner's recomputed log-probs equal the recorded ones on-policy.
  Generation (KV cache, one token at a time) and the learner (one forward over the whole sequence) run
  different kernels; with TF32 off every product is an fp32 sum in another order, so the difference is within
  ``tests/tolerances.decoder_logprob_bound`` (2^-24 times the logits' scale times sqrt of the depth, the same
  bound as on CPU: it counts reductions, not which kernel does them).
* bf16 weights train: a 3-step GRPO fit of the embedded default stays finite and changes the weights. Its
  ``train/sampler_logp_diff`` is measured and printed (bf16 rounds to 2^-8: no tight bound is claimed).
"""

from __future__ import annotations

import pytest
import torch

from rl_lightning.algorithms import GRPO
from tests.conftest import RecordRollouts, tiny_datamodule, tiny_trainer
from tests.tolerances import decoder_logprob_bound

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on a GPU machine)"),
]


def test_on_policy_logprobs_match_on_cuda_in_fp32(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    module = GRPO(model_name_or_path="embedded:arithmetic")
    dm = tiny_datamodule()
    record = RecordRollouts()
    tiny_trainer(tmp_path, max_steps=1, callbacks=[record], accelerator="gpu", devices=1).fit(module, datamodule=dm)
    bound = decoder_logprob_bound(module.policy, 1.0, module.policy.config.max_position_embeddings)
    assert record.metrics[0]["train/sampler_logp_diff"] <= bound


def test_bf16_weights_train_on_cuda(tmp_path):
    module = GRPO(model_name_or_path="embedded:arithmetic", dtype="bfloat16")
    before = [p.detach().float().cpu().clone() for p in module.policy.parameters()]
    record = RecordRollouts()
    tiny_trainer(tmp_path, max_steps=3, callbacks=[record], accelerator="gpu", devices=1).fit(
        module, datamodule=tiny_datamodule())
    after = [p.detach().float().cpu() for p in module.policy.parameters()]
    assert all(torch.isfinite(a).all() for a in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
    diffs = [m["train/sampler_logp_diff"] for m in record.metrics]
    print(f"bf16 train/sampler_logp_diff per step: {diffs}")
    assert all(d == d for d in diffs)  # finite, not NaN
