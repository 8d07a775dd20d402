"""train/lr (and train/lr_<group>): the learning rate each step's update was taken with, scheduler included."""

from __future__ import annotations

import pytest
import torch

from rl_lightning.algorithms import GRPO, PPO, TRPO
from tests.conftest import RecordRollouts, tiny_datamodule, tiny_trainer
from tests.tolerances import unit_roundoff

#: a logged rate is the float32 metric of the optimiser's float64 rate (halvings are exact): one rounding
LOGGED = unit_roundoff(torch.float32)


class RecordUsedRates(RecordRollouts):
    """Also keeps the learning rates of every group at the step Lightning counts (the update's last)."""

    def __init__(self) -> None:
        super().__init__()
        self.used: list[list[float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        self.used.append([float(g["lr"]) for g in optimizer.param_groups])


def _halving(optimizer):  # noqa: ANN001
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def test_train_lr_is_the_rate_of_the_steps_update_after_scheduler_steps(tmp_path):
    record = RecordUsedRates()
    module = GRPO(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                  lr_scheduler=_halving)
    tiny_trainer(tmp_path, max_steps=3, callbacks=[record]).fit(module, datamodule=tiny_datamodule())
    logged = [m["train/lr"] for m in record.metrics]
    assert logged == pytest.approx([1e-3, 5e-4, 2.5e-4], rel=LOGGED)
    assert logged == pytest.approx([used[0] for used in record.used], rel=LOGGED)
    assert not any(k.startswith("train/lr_") for k in record.metrics[0])  # one group, one rate
    # now: the optimiser's rate after the third scheduler step
    optimizer = module.optimizers(use_pl_optimizer=False)
    assert module.learning_rates() == {"train/lr": pytest.approx(optimizer.param_groups[0]["lr"])}
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1.25e-4)


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_ppo_logs_the_critic_groups_own_rate(tmp_path, critic):
    record = RecordUsedRates()
    module = PPO(model_name_or_path="embedded:arithmetic", critic=critic, critic_lr=1e-2,
                 optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), lr_scheduler=_halving)
    tiny_trainer(tmp_path, max_steps=2, callbacks=[record]).fit(module, datamodule=tiny_datamodule())
    assert [m["train/lr"] for m in record.metrics] == pytest.approx([1e-3, 5e-4], rel=LOGGED)
    assert [m["train/lr_critic"] for m in record.metrics] == pytest.approx([1e-2, 5e-3], rel=LOGGED)
    logged = [x for m in record.metrics for x in (m["train/lr"], m["train/lr_critic"])]
    assert logged == pytest.approx([x for used in record.used for x in used], rel=LOGGED)
    groups = module.optimizers(use_pl_optimizer=False).param_groups
    assert [g["name"] for g in groups] == ["policy", "critic"]


def test_ppo_without_a_critic_lr_logs_the_shared_rate_for_both_groups(tmp_path):
    record = RecordUsedRates()
    module = PPO(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4))
    tiny_trainer(tmp_path, max_steps=1, callbacks=[record]).fit(module, datamodule=tiny_datamodule())
    assert record.metrics[0]["train/lr"] == pytest.approx(3e-4)
    assert record.metrics[0]["train/lr_critic"] == pytest.approx(3e-4)


def test_unnamed_groups_are_logged_by_index():
    class TwoGroups(GRPO):
        def parameter_groups(self):  # noqa: ANN202
            params = list(self.policy.parameters())
            return [{"params": params[:1]}, {"params": params[1:], "lr": 0.5}]

    class FakeTrainer:  # what learning_rates reads
        def __init__(self, optimizers) -> None:  # noqa: ANN001
            self.optimizers = optimizers

    module = TwoGroups(model_name_or_path="embedded:random", optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    module._trainer = FakeTrainer([module.optimizer_factory(module.parameter_groups())])
    assert module.learning_rates() == {"train/lr": pytest.approx(0.1), "train/lr_1": pytest.approx(0.5)}


def test_trpo_logs_only_its_critics_rate(tmp_path):
    record = RecordRollouts()
    module = TRPO(model_name_or_path="embedded:arithmetic", advantage_estimator="gae", critic_lr=2e-3,
                  critic_steps=1, cg_iters=2, backtrack_iters=1)
    tiny_trainer(tmp_path, max_steps=1, callbacks=[record]).fit(module, datamodule=tiny_datamodule())
    assert "train/lr" not in record.metrics[0]  # the policy step's length comes from δ, not a learning rate
    assert record.metrics[0]["train/lr_critic"] == pytest.approx(2e-3)
