"""GradientCheckpointing: on for every HF model of the module, and the update it gives is the same update."""

from __future__ import annotations

import torch

from rl_lightning.algorithms import GRPO, PPO
from rl_lightning.callbacks import GradientCheckpointing
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.helpers.ddp_run import GradedMatch
from tests.tolerances import decoder_gradient_tolerance, unit_roundoff


def _one_step(tmp_path, callbacks):  # noqa: ANN001, ANN202
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
                  max_grad_norm=None)
    tiny_trainer(tmp_path, max_steps=1, callbacks=callbacks).fit(
        module, datamodule=tiny_datamodule(temperature=1.5, reward_fn=GradedMatch()))
    return module


def test_checkpointing_gives_the_same_update_up_to_float32_rounding(tmp_path):
    """SGD(lr = 1) on a dense reward: the weights after one step are the gradient. Recomputing each layer's
    forward in the backward sums the same terms in another order (measured here: 2.4e-7 against an update of
    0.43), so the two agree within ``decoder_gradient_tolerance`` of the update's size, as two micro-batch splits
    do (tests/algorithms/test_grpo.py)."""
    plain = _one_step(tmp_path / "a", [])
    callback = GradientCheckpointing()
    checkpointed = _one_step(tmp_path / "b", [callback])
    assert checkpointed.policy.is_gradient_checkpointing and not plain.policy.is_gradient_checkpointing
    assert callback.enabled == ["policy"]
    start = GRPO(model_name_or_path="embedded:arithmetic").policy
    scale = max(float((a - b).abs().max()) for a, b in zip(plain.policy.parameters(), start.parameters()))
    assert scale > 0  # the step did something
    config = start.config
    atol = float(decoder_gradient_tolerance(config, config.max_position_embeddings,
                                            16 * config.max_position_embeddings, scale))
    for a, b in zip(plain.policy.parameters(), checkpointed.policy.parameters()):
        torch.testing.assert_close(b, a, atol=atol, rtol=2 * unit_roundoff())


def test_a_separate_critic_is_checkpointed_too(tmp_path):
    module = PPO(model_name_or_path="embedded:arithmetic", critic="separate")
    callback = GradientCheckpointing()
    tiny_trainer(tmp_path, max_steps=1, callbacks=[callback]).fit(module, datamodule=tiny_datamodule())
    assert callback.enabled == ["policy", "critic.backbone"]
