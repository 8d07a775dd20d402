"""``ConstantRewardWarning``: one line when the first steps' training rewards never moved (a reward/answer-format
mismatch), naming the reward function and the instruction; nothing when they moved."""

from __future__ import annotations

import torch

from rl_lightning.algorithms import GRPO
from rl_lightning.callbacks import ConstantRewardWarning
from rl_lightning.envs import ArithmeticWordTask, ExactMatchReward
from tests.conftest import tiny_datamodule, tiny_trainer


class Never(ExactMatchReward):
    def __call__(self, prompt, response) -> float:
        return 0.0


def _fit(tmp_path, callback, **data):
    module = GRPO(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    tiny_trainer(tmp_path, max_steps=3, callbacks=[callback]).fit(module, datamodule=tiny_datamodule(**data))


def test_a_reward_that_never_moves_is_named_in_one_line(tmp_path, caplog):
    check = ConstantRewardWarning(steps=2)
    # the embedded model writes digits; a word-problem task with its instruction and a verifier that never pays
    _fit(tmp_path, check, task=ArithmeticWordTask(num_heldout=4), reward_fn=Never())
    assert check.message is not None and "\n" not in check.message
    assert "the first 2 steps got reward 0" in check.message
    assert "(Never)" in check.message and "ArithmeticWordTask, instruction 'Answer with a number.'" in check.message
    assert check.seen == 2  # checked once, then never again


def test_a_reward_that_moves_says_nothing(tmp_path):
    check = ConstantRewardWarning(steps=3)
    _fit(tmp_path, check)  # 2-digit addition from the warm start: some responses right, some wrong
    assert check.message is None and len(check.values) > 1
    state = check.state_dict()
    again = ConstantRewardWarning(steps=3)
    again.load_state_dict(state)
    assert again.seen == 3 and again.values == check.values
