"""Loss metrics do not depend on the micro-batching: token means (clip fractions, ratio mean, approx. KL, mean
log-prob ...) are means over the step's tokens, and loss values (``train/loss``, PPO's policy and value losses)
are the optimiser step's whole loss, the same with one micro-batch of 16 rows as with 3+3+3+3+3+1 rows of
different token counts (the DDP test checks the same token reduction across ranks for ``train/entropy``).
Also: ``train/zero_std_fraction`` sees a constant group of fractional rewards, and validation switched off
(``limit_val_batches=0``) runs no step-0 evaluation either."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_lightning.algorithms import GRPO, PPO, PolicyGradient
from rl_lightning.envs.base import Prompt, RewardFunction
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
        (PolicyGradient, {}, ["train/logprob_mean", "train/advantage_mean", "train/loss"]),
        (PPO, {}, ["train/loss", "train/policy_loss", "train/value_loss", "train/explained_variance",
                   "train/clip_fraction"]),
        # a second pass over the batch after one update: ratios move away from 1 and, with tight clip bounds,
        # some tokens are clipped
        (GRPO, {"num_iterations": 2, "clip_eps_low": 0.01, "clip_eps_high": 0.01},
         ["train/ratio_mean", "train/approx_kl", "train/clip_fraction", "train/clip_fraction_low",
          "train/clip_fraction_high", "train/loss", "train/policy_loss"]),
    ],
)
def test_loss_metrics_do_not_depend_on_micro_batching(tmp_path, cls, kwargs, names):
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


class _Constant(RewardFunction):
    def __call__(self, prompt: Prompt, response: str) -> float:
        return 0.9  # torch.std of [0.9] * 8 in float32 is 6e-8, not 0


def test_a_single_constant_group_counts_as_zero_std(tmp_path):
    recorder = RecordRollouts()
    module = GRPO(model_name_or_path="embedded:arithmetic")
    tiny_trainer(tmp_path, max_steps=1, callbacks=[recorder]).fit(
        module, datamodule=tiny_datamodule(prompts_per_step=1, group_size=8, reward_fn=_Constant()))
    assert recorder.metrics[0]["train/zero_std_fraction"] == 1.0


def test_no_step_zero_evaluation_when_validation_is_off(tmp_path):
    class Counting(type(tiny_datamodule())):
        calls = 0  # held-out (greedy) rollouts

        def rollout(self, batch):  # noqa: ANN001, ANN201
            Counting.calls += getattr(batch, "split", "train") == "val"  # a StepRequest is training
            return super().rollout(batch)

    dm = tiny_datamodule()
    dm.__class__ = Counting
    tiny_trainer(tmp_path, max_steps=1).fit(GRPO(model_name_or_path="embedded:arithmetic"), datamodule=dm)
    assert Counting.calls == 0  # tiny_trainer has limit_val_batches=0
    dm = tiny_datamodule()
    dm.__class__ = Counting
    tiny_trainer(tmp_path, max_steps=1, limit_val_batches=None).fit(GRPO(model_name_or_path="embedded:arithmetic"),
                                                                    datamodule=dm)
    # the step-0 evaluation and the one after the last step (not on the validation interval): one batch each
    assert Counting.calls == 2


def test_env_errors_are_logged_for_a_single_turn_batch_that_had_one():
    from tests.algorithms.test_skipping import SPREAD, _batch
    module = GRPO(model_name_or_path="embedded:random")
    batch = _batch(SPREAD)  # single-turn: turns is None
    assert "train/env_errors" not in module.rollout_metrics(batch)
    # e.g. GroupRollout(max_turns=1, env_errors="fail_episode") on an environment that raised
    batch = dataclasses.replace(batch, env_errors=2)
    assert module.rollout_metrics(batch)["train/env_errors"].item() == 2.0
