"""Resume continues exactly: 4 steps straight == 2 steps, checkpoint, fresh objects, 2 more steps."""

from __future__ import annotations

import torch

from rl_lightning.algorithms import GRPO
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
    kwargs = dict(sampler_sync_interval=3)
    straight_rec = RecordRollouts()
    straight = _module()
    tiny_trainer(tmp_path / "a", max_steps=4, callbacks=[straight_rec]).fit(straight, datamodule=tiny_datamodule(**kwargs))

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
