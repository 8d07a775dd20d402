"""Token-mean loss metrics (clip fractions, ratio mean, approx. KL, mean log-prob ...) are means over the step's
tokens, whatever the micro-batching: the same numbers with one micro-batch of 16 rows as with 3+3+3+3+3+1 rows
of different token counts (the DDP test checks the same reduction across ranks for ``train/entropy``)."""

from __future__ import annotations

import pytest
import torch

from rl_lightning.algorithms import GRPO, PolicyGradient
from tests.conftest import RecordRollouts, tiny_datamodule, tiny_trainer
from tests.helpers.ddp_run import GradedMatch


def _logged(tmp_path, cls, **kwargs) -> tuple[dict[str, float], torch.Tensor]:
    torch.manual_seed(0)
    recorder = RecordRollouts()
    tokens: list[torch.Tensor] = []

    class Tokens(RecordRollouts):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            tokens.append(batch.loss_mask.sum(dim=1))

    module = cls(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.AdamW(p, lr=3e-2),
                 max_grad_norm=None, **kwargs)
    tiny_trainer(tmp_path, max_steps=1, callbacks=[recorder, Tokens()]).fit(
        module, datamodule=tiny_datamodule(temperature=1.5, reward_fn=GradedMatch()))  # dense: advantages != 0
    return recorder.metrics[0], tokens[0]


@pytest.mark.parametrize(
    ("cls", "kwargs", "names"),
    [
        (PolicyGradient, {}, ["train/logprob_mean", "train/advantage_mean"]),
        # a second pass over the batch after one update: ratios move away from 1 and, with tight clip bounds,
        # some tokens are clipped
        (GRPO, {"num_iterations": 2, "clip_eps_low": 0.01, "clip_eps_high": 0.01},
         ["train/ratio_mean", "train/approx_kl", "train/clip_fraction", "train/clip_fraction_low",
          "train/clip_fraction_high"]),
    ],
)
def test_token_mean_metrics_do_not_depend_on_micro_batching(tmp_path, cls, kwargs, names):
    whole, tokens = _logged(tmp_path, cls, **kwargs)
    split, tokens_split = _logged(tmp_path, cls, micro_batch_size=3, **kwargs)  # 16 rows -> 3+3+3+3+3+1
    assert torch.equal(tokens, tokens_split)  # the same rollout
    chunks = [int(c.sum()) for c in tokens.split(3)]
    assert len(set(chunks)) > 1  # micro-batches of different token counts: a mean of means would differ
    for name in names:
        assert split[name] == pytest.approx(whole[name], rel=1e-4, abs=1e-7), name
    if cls is GRPO:
        assert whole["train/clip_fraction"] > 0  # the check above is not 0 == 0
        assert abs(whole["train/ratio_mean"] - 1.0) > 1e-4
