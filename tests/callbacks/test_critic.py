"""Critic schedules on PPO: warm-up trains only the critic, attention freezing, clear refusals, exact resume."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from rl_lightning.algorithms import GRPO
from rl_lightning.algorithms.ppo import PPO
from rl_lightning.callbacks.critic import CriticWarmup, FreezeCriticModules
from tests.conftest import tiny_datamodule, tiny_trainer


def _ppo(critic: str) -> PPO:
    return PPO(model_name_or_path="embedded:arithmetic", critic=critic,
               optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys=None) -> bool:  # noqa: ANN001
    return all(torch.equal(a[k], b[k]) for k in (keys or a))


class Snapshots(Callback):
    """Policy and critic weights after every training step, plus the logged warm-up flag."""

    def __init__(self) -> None:
        self.policy: list[dict[str, torch.Tensor]] = []
        self.critic: list[dict[str, torch.Tensor]] = []
        self.warmup: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.policy.append(_state(pl_module.policy))
        self.critic.append(_state(pl_module.critic))
        self.warmup.append(float(trainer.callback_metrics.get("train/critic_warmup", float("nan"))))


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_warmup_trains_only_the_critic_then_the_actor(tmp_path, critic):
    module = _ppo(critic)
    policy0, critic0 = _state(module.policy), _state(module.critic)
    snaps = Snapshots()
    tiny_trainer(tmp_path, max_steps=3, callbacks=[CriticWarmup(2), snaps]).fit(module, datamodule=tiny_datamodule())
    assert snaps.warmup == [1.0, 1.0, 0.0]
    # Steps 0 and 1: the actor is bit-identical (no Adam drift, no weight decay), the critic learned.
    assert _equal(snaps.policy[0], policy0) and _equal(snaps.policy[1], policy0)
    assert not _equal(snaps.critic[0], critic0)
    assert not _equal(snaps.critic[1], snaps.critic[0])
    # Step 2: the actor trains.
    assert not _equal(snaps.policy[2], policy0)
    # The module is left as found: every flag restored.
    assert all(p.requires_grad for p in module.parameters())


def test_freeze_critic_attention_after_a_step(tmp_path):
    module = _ppo("separate")
    critic0 = _state(module.critic)
    attn = [k for k in critic0 if "self_attn" in k]
    other = [k for k in critic0 if "self_attn" not in k and ".layers." in k]
    assert attn and other
    snaps = Snapshots()
    callback = FreezeCriticModules(["self_attn"], after_step=1)
    tiny_trainer(tmp_path, max_steps=3, callbacks=[callback, snaps]).fit(module, datamodule=tiny_datamodule())
    assert not _equal(snaps.critic[0], critic0, attn)  # step 0: attention still trains
    assert _equal(snaps.critic[2], snaps.critic[0], attn)  # steps 1, 2: frozen
    assert not _equal(snaps.critic[2], snaps.critic[0], other)  # MLPs/norms keep learning
    policy_attn = [k for k in snaps.policy[0] if "self_attn" in k]
    assert not _equal(snaps.policy[2], snaps.policy[0], policy_attn)  # the policy is never touched
    assert all(p.requires_grad for p in module.parameters())


def test_pattern_matching_nothing_is_refused_with_the_names(tmp_path):
    with pytest.raises(ValueError, match=r"'no_such_module' matches no parameter of PPO\.critic .*self_attn"):
        tiny_trainer(tmp_path, max_steps=1, callbacks=[FreezeCriticModules(["self_attn", "no_such_module"])]).fit(
            _ppo("separate"), datamodule=tiny_datamodule())
    # A shared critic is only a value head: there is no attention to freeze.
    with pytest.raises(ValueError, match=r"'self_attn' matches no parameter .*head\.proj\.weight"):
        tiny_trainer(tmp_path, max_steps=1, callbacks=[FreezeCriticModules(["self_attn"])]).fit(
            _ppo("shared"), datamodule=tiny_datamodule())


@pytest.mark.parametrize("callback", [CriticWarmup(1), FreezeCriticModules(["head"])], ids=lambda c: type(c).__name__)
def test_a_method_without_critic_is_refused(tmp_path, callback):
    name = type(callback).__name__
    module = GRPO(model_name_or_path="embedded:random")
    with pytest.raises(TypeError, match=rf"^{name} needs a method with a critic \(module\.critic\); GRPO has none$"):
        tiny_trainer(tmp_path, max_steps=1, callbacks=[callback]).fit(module, datamodule=tiny_datamodule())
    assert module.global_step == 0


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="steps must be an integer >= 0"):
        CriticWarmup(-1)
    with pytest.raises(ValueError, match="after_step must be an integer >= 0"):
        FreezeCriticModules(["head"], after_step=-2)
    with pytest.raises(ValueError, match="non-empty list"):
        FreezeCriticModules([])
    with pytest.raises(ValueError, match=r"invalid pattern '\('"):
        FreezeCriticModules(["("])
    # Different configurations never share a checkpoint slot.
    assert CriticWarmup(2).state_key != CriticWarmup(3).state_key
    assert FreezeCriticModules(["a"]).state_key != FreezeCriticModules(["a"], after_step=1).state_key
    assert FreezeCriticModules(["a"]).state_key != FreezeCriticModules(["b"]).state_key


def test_warmup_resumes_in_the_right_phase(tmp_path):
    straight = _ppo("shared")
    tiny_trainer(tmp_path / "a", max_steps=4, callbacks=[CriticWarmup(3)]).fit(straight, datamodule=tiny_datamodule())

    first = _ppo("shared")
    trainer = tiny_trainer(tmp_path / "b", max_steps=2, callbacks=[CriticWarmup(3)])
    trainer.fit(first, datamodule=tiny_datamodule())
    ckpt = tmp_path / "b" / "step2.ckpt"
    trainer.save_checkpoint(ckpt)
    saved_policy = _state(first.policy)

    resumed = _ppo("shared")  # fresh weights: everything comes from the checkpoint
    snaps = Snapshots()
    tiny_trainer(tmp_path / "c", max_steps=4, callbacks=[CriticWarmup(3), snaps]).fit(
        resumed, datamodule=tiny_datamodule(), ckpt_path=str(ckpt))
    assert snaps.warmup == [1.0, 0.0]
    assert _equal(snaps.policy[0], saved_policy)  # step 2: still warm-up
    assert not _equal(snaps.policy[1], saved_policy)  # step 3: the actor trains
    for got, want in ((resumed.policy, straight.policy), (resumed.critic, straight.critic)):
        for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items()):
            assert torch.equal(a, b), name
