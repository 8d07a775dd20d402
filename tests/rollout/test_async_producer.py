"""Asynchronous rollouts (SAO's single-rollout asynchronous sampling): a background producer with its own copy of
the policy, version stamps, the staleness bound, and checkpoints that lose and duplicate nothing."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from rollout_helpers import VersionedTrainer as _Trainer, fake_trainer, model_logprob_tolerance, wait_full as _wait_full

from rl_lightning.algorithms import GRPO
from rl_lightning.envs import ArithmeticTask
from rl_lightning.rollout import AsyncRollout, GroupRollout, RolloutDataModule, Sampling
from rl_lightning.rollout.generation import position_ids_from_mask
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.helpers.settings import data_kwargs


def _dm(module, version: list[int], **kwargs) -> RolloutDataModule:
    dm = RolloutDataModule(**data_kwargs(task=ArithmeticTask(num_heldout=4), prompts_per_step=2, group_size=2,
                                         sampling=Sampling(max_new_tokens=3), async_rollout=AsyncRollout(queue=3),
                                         **kwargs))
    dm.trainer = _Trainer(fake_trainer(module), version)
    return dm


def _take(dm, step: int):
    return dm.rollout(SimpleNamespace(split="train", step=step, prompts=[]))


def test_the_learner_never_consumes_a_batch_older_than_the_bound():
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    version = [0]
    dm = _dm(module, version, max_staleness=1)
    try:
        first = _take(dm, 0)
        assert first.prompt_index.tolist() == [0, 0, 1, 1]  # stream step 0
        _wait_full(dm)  # three batches drawn with the version-0 weights
        with torch.no_grad():
            module.policy.lm_head.weight.add_(1.0)  # "five updates later" the learner's weights differ
        version[0] = 5
        taken = [dm._take_produced() for _ in range(3)]
        assert all(5 - item.version <= 1 for item in taken)  # never older than the bound
        assert dm.dropped_batches >= 3  # the version-0 batches were dropped, not trained on
        steps = [item.step for item in taken]
        assert steps == sorted(steps) and len(set(steps)) == 3
        # a fresh batch was drawn with the published weights: its log-probs are the new learner's
        batch = taken[-1].batch
        with torch.no_grad():
            learner = module.forward_policy(batch).logprobs
        assert (learner - batch.sampler_logprobs)[batch.loss_mask.bool()].abs().max() < 1e-4
    finally:
        dm.teardown("fit")


@pytest.mark.parametrize("strategy", [None, GroupRollout(max_turns=2)], ids=["single_turn", "episodes"])
def test_an_asynchronous_batch_is_the_synchronous_batch_of_its_step_extras_included(strategy):
    """With the same weights (the learner never updates here), the producer's batch of stream step k is the
    synchronous rollout of step k: sampled ids, log-probs, top-k and the auxiliary draws, whichever step the
    learner's cursor is at while the producer draws."""
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    extras = dict(topk=2, aux_draws=3, strategy=strategy)
    sync = RolloutDataModule(**data_kwargs(task=ArithmeticTask(num_heldout=4), prompts_per_step=2, group_size=2,
                                           sampling=Sampling(max_new_tokens=3), **extras))
    sync.trainer = fake_trainer(module)
    dm = _dm(module, [0], **extras)
    try:
        for step in range(3):
            got, want = _take(dm, step), sync.rollout(sync.prompt_batch(step))
            for name in ("input_ids", "loss_mask"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)
            for name in ("topk_ids", "aux_ids"):
                assert torch.equal(getattr(got.record, name), getattr(want.record, name)), (step, name)
            # the log-probs: the same arithmetic, but on the producer's thread the kernels may split their
            # reductions differently (1-ulp differences seen), so within float32 rounding of this model
            with torch.no_grad():
                hidden = module.policy(input_ids=got.input_ids, attention_mask=got.attention_mask,
                                       position_ids=position_ids_from_mask(got.attention_mask),
                                       output_hidden_states=True).hidden_states[-1][:, got.prompt_length - 1:-1]
            tol = model_logprob_tolerance(module.policy, hidden[got.loss_mask.bool()], got.temperature,
                                          context_length=got.input_ids.shape[1])
            for a, b in ((got.sampler_logprobs, want.sampler_logprobs),
                         (got.record.topk_logprobs, want.record.topk_logprobs)):
                assert (a - b).abs().max() <= tol, (step, tol)
    finally:
        dm.teardown("fit")


def test_a_checkpoint_with_the_producer_running_loses_and_duplicates_nothing():
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    version = [0]
    a = _dm(module, version, max_staleness=10)
    try:
        consumed = [_take(a, 0).prompt_index.tolist()]
        version[0] = 1
        consumed.append(_take(a, 1).prompt_index.tolist())
        version[0] = 2  # the step's update is done: a step checkpoint
        _wait_full(a)
        state = a.state_dict()
        queued = [b["prompt_index"].tolist() for _, _, b in state["producer"]["items"]]
        assert len(queued) == 3
    finally:
        a.teardown("fit")
    b = _dm(module, version, max_staleness=10)
    b.load_state_dict(state)
    try:
        resumed = []
        for step in range(2, 6):
            b.cursor = step  # the resumed learner's position
            resumed.append(_take(b, step).prompt_index.tolist())
            version[0] += 1
        assert resumed[:3] == queued  # the saved batches first, exactly
    finally:
        b.teardown("fit")
    # stream steps 0, 1, 2, ... each consumed exactly once: prompts [2k, 2k+1] at step k
    assert [rows[::2] for rows in consumed + resumed] == [[2 * k, 2 * k + 1] for k in range(6)]


def test_a_checkpoint_in_the_middle_of_a_step_keeps_the_batch_being_trained_on():
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    version = [0]
    a = _dm(module, version)
    try:
        taken = _take(a, 0)  # the learner took step 0's batch and is updating when the interrupt comes
        state = a.state_dict()  # cursor 1 > global_step 0: mid-step
    finally:
        a.teardown("fit")
    b = _dm(module, version)
    b.load_state_dict(state)
    try:
        again = _take(b, 0)
        assert torch.equal(again.input_ids, taken.input_ids)  # step 0 is trained on after the resume
    finally:
        b.teardown("fit")


def test_async_rollouts_train_in_a_fit_and_refuse_a_lagged_sampler(tmp_path):
    with pytest.raises(ValueError, match="sampling.sync_interval=1"):
        RolloutDataModule(ArithmeticTask(num_heldout=4), async_rollout=AsyncRollout(queue=2),
                          sampling=Sampling(sync_interval=2))
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    dm = tiny_datamodule(queue=2, max_staleness=2)
    trainer = tiny_trainer(tmp_path, max_steps=3)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 3
    assert dm._producer._thread is None  # stopped at teardown


def test_a_resumed_asynchronous_fit_trains_on_the_same_stream_steps_as_a_straight_one(tmp_path):
    from tests.conftest import RecordRollouts

    def module():
        torch.manual_seed(0)
        return GRPO(model_name_or_path="embedded:random")

    settings = dict(queue=2, max_staleness=10)  # nothing is stale enough to drop here
    straight = RecordRollouts()
    tiny_trainer(tmp_path / "a", max_steps=5, callbacks=[straight]).fit(
        module(), datamodule=tiny_datamodule(**settings))
    first = RecordRollouts()
    trainer = tiny_trainer(tmp_path / "b", max_steps=2, callbacks=[first])
    trainer.fit(module(), datamodule=tiny_datamodule(**settings))
    trainer.save_checkpoint(tmp_path / "b" / "step2.ckpt")
    second = RecordRollouts()
    tiny_trainer(tmp_path / "c", max_steps=5, callbacks=[second]).fit(
        module(), datamodule=tiny_datamodule(**settings), ckpt_path=str(tmp_path / "b" / "step2.ckpt"))
    got = [p.tolist() for p in first.prompt_index + second.prompt_index]
    assert got == [p.tolist() for p in straight.prompt_index]  # each stream step once, none lost, none twice
    assert len(got) == 5 and len({tuple(p) for p in got}) == 5


def test_a_queued_batch_round_trips_through_a_weights_only_checkpoint_with_its_record_turns_and_ends(tmp_path):
    """``record`` (top-k ids and log-probs, auxiliary draws), ``turns`` and ``ends`` are saved as plain values and
    come back the same; a checkpoint written before they were groups (their parts as fields of the batch) loads
    into them."""
    from rl_lightning.envs import Prompt
    from rl_lightning.rollout import EndState, EpisodeEnds, RolloutBatch, SamplerRecord, Turns
    from rl_lightning.rollout.async_producer import RolloutProducer

    g = torch.Generator().manual_seed(0)
    n, p, t = 4, 2, 3
    record = SamplerRecord(topk_ids=torch.randint(0, 9, (n, t, 2), generator=g),
                           topk_logprobs=-torch.rand(n, t, 2, generator=g),
                           aux_ids=torch.randint(0, 9, (n, t, 5), generator=g))
    batch = RolloutBatch(input_ids=torch.arange(n * (p + t)).reshape(n, p + t),
                         attention_mask=torch.ones(n, p + t, dtype=torch.long), prompt_length=p,
                         loss_mask=torch.ones(n, t, dtype=torch.long), sampler_logprobs=-torch.rand(n, t, generator=g),
                         rewards=torch.arange(n, dtype=torch.float32), group_size=2, prompt_index=torch.arange(n) // 2,
                         truncated=torch.zeros(n, dtype=torch.bool), prompts=[Prompt(str(i), "1") for i in range(n)],
                         responses=["r"] * n, record=record)
    path = tmp_path / "state.pt"
    torch.save(RolloutProducer._pack(batch), path)
    back = RolloutProducer._unpack(torch.load(path, weights_only=True), "cpu")
    assert set(back.record.tensors()) == {"topk_ids", "topk_logprobs", "aux_ids"}
    for name, value in record.tensors().items():
        assert torch.equal(getattr(back.record, name), value), name
    assert torch.equal(back.input_ids, batch.input_ids) and back.prompts == batch.prompts
    old = RolloutProducer._pack(batch)
    old.update(old.pop("record"))  # the earlier layout: topk_ids, topk_logprobs, aux_ids beside the other fields
    torch.save(old, path)
    back = RolloutProducer._unpack(torch.load(path, weights_only=True), "cpu")
    for name, value in record.tensors().items():
        assert torch.equal(getattr(back.record, name), value), name
    partial = RolloutProducer._unpack(RolloutProducer._pack(replace(batch, record=SamplerRecord())), "cpu")
    assert partial.record.tensors() == {} and partial.ends is None and partial.turns is None
    # the episode ends, likewise: the group, and the earlier layout (terminated and end_states as fields)
    ends = EpisodeEnds(torch.tensor([True, False, False, True]), [None, EndState({"v": 1}, [5, 6]), EndState(None, [7]),
                                                                  None])
    packed = RolloutProducer._pack(replace(batch, ends=ends))
    for state in (packed, {**{k: v for k, v in packed.items() if k != "ends"}, "terminated": ends.terminated,
                           "end_states": packed["ends"]["states"]}):
        torch.save(state, path)
        back = RolloutProducer._unpack(torch.load(path, weights_only=True), "cpu")
        assert torch.equal(back.ends.terminated, ends.terminated) and back.ends.states == ends.states
    # the turns, likewise: the group, and the earlier layout (obs_mask, turn_index, num_turns and turn_rewards as
    # fields of the batch, all None in a single-turn batch)
    nan = float("nan")
    turns = Turns(obs_mask=torch.tensor([[0, 1, 0]] * n), index=torch.tensor([[0, -1, 1], [0, -1, -1]] * 2),
                  count=torch.tensor([2, 1, 2, 1]), rewards=torch.tensor([[0.5, 0.5], [1.0, nan]] * 2))
    packed = RolloutProducer._pack(replace(batch, turns=turns))
    assert isinstance(packed["turns"], dict)
    flat = {k: v for k, v in packed.items() if k != "turns"}
    old = {**flat, "obs_mask": turns.obs_mask, "turn_index": turns.index, "num_turns": turns.count,
           "turn_rewards": turns.rewards}
    for state in (packed, old):
        torch.save(state, path)
        back = RolloutProducer._unpack(torch.load(path, weights_only=True), "cpu")
        assert set(back.turns.tensors()) == set(turns.tensors())
        for name, value in turns.tensors().items():
            torch.testing.assert_close(getattr(back.turns, name), value, rtol=0, atol=0, equal_nan=True)
    torch.save({**flat, "obs_mask": None, "turn_index": None, "num_turns": None, "turn_rewards": None}, path)
    assert RolloutProducer._unpack(torch.load(path, weights_only=True), "cpu").turns is None
