"""Resume continues exactly: 4 steps straight == 2 steps, checkpoint, fresh objects, 2 more steps."""

from __future__ import annotations

import torch
from lightning.pytorch.loggers import Logger

from rl_lightning.algorithms import GRPO
from rl_lightning.callbacks import StepCheckpoint
from tests.conftest import RecordRollouts, tiny_datamodule, tiny_trainer


def _module() -> GRPO:
    return GRPO(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))


def test_resume_from_a_checkpoint_is_exact(tmp_path):
    straight_rec = RecordRollouts()
    straight = _module()
    tiny_trainer(tmp_path / "a", max_steps=4, callbacks=[straight_rec]).fit(straight, datamodule=tiny_datamodule())

    first_rec = RecordRollouts()
    first = _module()
    trainer = tiny_trainer(tmp_path / "b", max_steps=2, callbacks=[first_rec])
    trainer.fit(first, datamodule=tiny_datamodule())
    ckpt = tmp_path / "b" / "step2.ckpt"
    trainer.save_checkpoint(ckpt)

    second_rec = RecordRollouts()
    resumed = _module()  # fresh weights: everything must come from the checkpoint
    resumed_dm = tiny_datamodule()
    tiny_trainer(tmp_path / "c", max_steps=4, callbacks=[second_rec]).fit(
        resumed, datamodule=resumed_dm, ckpt_path=str(ckpt)
    )

    rewards = first_rec.rewards + second_rec.rewards
    assert len(rewards) == len(straight_rec.rewards) == 4
    for got, want in zip(rewards, straight_rec.rewards):
        assert torch.equal(got, want)
    for got, want in zip(first_rec.prompt_index + second_rec.prompt_index, straight_rec.prompt_index):
        assert torch.equal(got, want)
    assert resumed_dm.cursor == 4
    for (name, a), (_, b) in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().items()):
        assert torch.equal(a, b), name


def test_resume_restores_the_lagged_sampler(tmp_path):
    kwargs = dict(sync_interval=3)
    straight_rec = RecordRollouts()
    straight = _module()
    tiny_trainer(tmp_path / "a", max_steps=4, callbacks=[straight_rec]).fit(
        straight, datamodule=tiny_datamodule(**kwargs))

    first = _module()
    trainer = tiny_trainer(tmp_path / "b", max_steps=2)
    trainer.fit(first, datamodule=tiny_datamodule(**kwargs))
    ckpt = tmp_path / "b" / "step2.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed_rec = RecordRollouts()
    resumed = _module()
    tiny_trainer(tmp_path / "c", max_steps=4, callbacks=[resumed_rec]).fit(
        resumed, datamodule=tiny_datamodule(**kwargs), ckpt_path=str(ckpt)
    )
    # Step 2 samples with the copy taken at step 0 (stale), restored from the checkpoint.
    assert torch.equal(resumed_rec.rewards[0], straight_rec.rewards[2])
    assert resumed_rec.metrics[0]["train/sampler_logp_diff"] == straight_rec.metrics[2]["train/sampler_logp_diff"]
    for a, b in zip(straight.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b)


class _ValLog(Logger):
    """Keeps every ``val/reward`` the module logs, by step."""

    def __init__(self) -> None:
        super().__init__()
        self.val: dict[int, float] = {}

    @property
    def name(self) -> str:
        return "val"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if "val/reward" in metrics:
            self.val[int(step)] = float(metrics["val/reward"])


def test_resume_from_a_step_checkpoint_runs_that_steps_validation(tmp_path):
    """A step checkpoint is written at the end of the training step, before that step's validation; the
    resumed run logs the validation it would otherwise skip, with the uninterrupted run's value."""
    validate = dict(limit_val_batches=None, val_check_interval=2, check_val_every_n_epoch=None)
    straight = _ValLog()
    tiny_trainer(tmp_path / "a", max_steps=4, logger=straight, **validate).fit(
        _module(), datamodule=tiny_datamodule())
    assert sorted(straight.val) == [0, 2, 4]

    first = _ValLog()
    steps = StepCheckpoint(dirpath=tmp_path / "b", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    tiny_trainer(tmp_path / "b", max_steps=2, logger=first, enable_checkpointing=True, callbacks=[steps],
                 **validate).fit(_module(), datamodule=tiny_datamodule())
    ckpt = tmp_path / "b" / "step=2.ckpt"
    state = torch.load(ckpt, weights_only=False)
    # the HeldoutEvaluation callback's state: written before step 2's validation, after step 0's
    assert state["callbacks"]["HeldoutEvaluation"]["last_step"] == 0
    assert state["callbacks"]["HeldoutEvaluation"]["history"] == [[0, first.val[0]]]
    assert "rl_lightning_val_step" not in state

    resumed = _ValLog()
    tiny_trainer(tmp_path / "c", max_steps=4, logger=resumed, **validate).fit(
        _module(), datamodule=tiny_datamodule(), ckpt_path=str(ckpt))
    assert sorted(resumed.val) == [2, 4]
    assert resumed.val == {2: straight.val[2], 4: straight.val[4]}

    # a checkpoint written after the step's validation (here: at the end of fit) does not repeat it: the value
    # it holds is written again at its step (a resumed TensorBoard run has purged it), with no new evaluation
    again = _ValLog()
    after = tiny_trainer(tmp_path / "d", max_steps=2, **validate)
    after.fit(_module(), datamodule=tiny_datamodule())
    after.save_checkpoint(tmp_path / "d" / "end.ckpt")
    data = tiny_datamodule()
    rollout, held_out = data.rollout, []

    def counting(batch):
        held_out.append(getattr(batch, "split", "train") == "val")  # a StepRequest is training
        return rollout(batch)

    data.rollout = counting
    tiny_trainer(tmp_path / "e", max_steps=4, logger=again, **validate).fit(
        _module(), datamodule=data, ckpt_path=str(tmp_path / "d" / "end.ckpt"))
    assert again.val == {2: straight.val[2], 4: straight.val[4]}
    assert sum(held_out) == 1  # one held-out batch of 16 prompts: the validation at step 4 only

    # the same checkpoint in the earlier format (the state in the module's entries, rl_lightning_val_step and
    # rl_lightning_val_history) is read the same way: no new evaluation at step 2
    end = torch.load(tmp_path / "d" / "end.ckpt", weights_only=False)
    heldout = end["callbacks"]["HeldoutEvaluation"]
    assert heldout["last_step"] == 2
    legacy = dict(end, callbacks={k: v for k, v in end["callbacks"].items() if k != "HeldoutEvaluation"},
                  rl_lightning_val_step=heldout["last_step"], rl_lightning_val_history=heldout["history"])
    torch.save(legacy, tmp_path / "d" / "legacy.ckpt")
    old, held_out[:] = _ValLog(), []
    data = tiny_datamodule()
    rollout, data.rollout = data.rollout, counting  # counting() calls this data module's rollout
    module = _module()
    tiny_trainer(tmp_path / "f", max_steps=4, logger=old, **validate).fit(
        module, datamodule=data, ckpt_path=str(tmp_path / "d" / "legacy.ckpt"))
    assert old.val == {2: straight.val[2], 4: straight.val[4]} and sum(held_out) == 1
    assert module.val_history == [(s, v) for s, v in heldout["history"]] + [(4, straight.val[4])]


def test_resume_restores_a_lagged_sampler_whose_engine_cannot_give_its_weights_back(tmp_path):
    """An external engine (vLLM) cannot return the weights it samples with (``weights()`` is ``None``): the sampler
    sync keeps a copy of what it loaded, so the checkpoint of a lagged sampler still holds them."""
    from tests.helpers.engines import ListEngine

    assert ListEngine().weights() is None
    kwargs = dict(sync_interval=3)
    straight_rec, straight = RecordRollouts(), _module()
    tiny_trainer(tmp_path / "a", max_steps=4, callbacks=[straight_rec]).fit(
        straight, datamodule=tiny_datamodule(engine=ListEngine(), **kwargs))
    first = _module()
    trainer = tiny_trainer(tmp_path / "b", max_steps=2)
    trainer.fit(first, datamodule=tiny_datamodule(engine=ListEngine(), **kwargs))
    trainer.save_checkpoint(tmp_path / "b" / "step2.ckpt")
    resumed_rec, resumed = RecordRollouts(), _module()
    tiny_trainer(tmp_path / "c", max_steps=4, callbacks=[resumed_rec]).fit(
        resumed, datamodule=tiny_datamodule(engine=ListEngine(), **kwargs),
        ckpt_path=str(tmp_path / "b" / "step2.ckpt"))
    # step 2 samples with the step-0 weights (stale), which only the checkpoint can have given the fresh engine
    assert torch.equal(resumed_rec.rewards[0], straight_rec.rewards[2])
    assert resumed_rec.metrics[0]["train/sampler_logp_diff"] == straight_rec.metrics[2]["train/sampler_logp_diff"]
    for a, b in zip(straight.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b)
