"""The engine boundary (``rollout.engine``): an engine that is only the interface, capabilities refused at setup
in one line, ``n`` samples per prompt, finish reasons, and the sampler sync's weight versions."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import fake_trainer

from rl_lightning.algorithms import GRPO
from rl_lightning.envs import ArithmeticTask
from rl_lightning.rollout import (
    Generation, GroupRollout, HFGenerateEngine, KVCacheEngine, RolloutDataModule, SamplerSync, Sampling,
    SamplingParams,
)
from tests.helpers.engines import ListEngine
from tests.tolerances import decoder_logprob_bound
from tests.helpers.settings import data_kwargs


def _dm(module, **kwargs) -> RolloutDataModule:
    dm = RolloutDataModule(**data_kwargs(task=ArithmeticTask(num_heldout=4), prompts_per_step=2, group_size=3,
                                         sampling=Sampling(max_new_tokens=4), **kwargs))
    dm.trainer = fake_trainer(module)
    return dm


@pytest.mark.parametrize("strategy", [None, GroupRollout(max_turns=2)], ids=["single_turn", "episodes"])
def test_an_engine_that_is_only_the_interface_draws_the_built_in_tokens_and_takes_every_sync(strategy):
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    engine = ListEngine()
    ours, ref = _dm(module, engine=engine, strategy=strategy, topk=2), _dm(module, strategy=strategy,
                                                                                 topk=2)
    for step in range(3):
        got, want = ours.rollout(ours.prompt_batch(step)), ref.rollout(ref.prompt_batch(step))
        for name in ("input_ids", "attention_mask", "loss_mask", "truncated"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)
        assert torch.equal(got.record.topk_ids, want.record.topk_ids), step
        # the same weights in another allocation: the kernels may round differently (1 ulp seen at step 2)
        bound = decoder_logprob_bound(module.policy, got.temperature, got.input_ids.shape[1])
        assert (got.sampler_logprobs - want.sampler_logprobs).abs().max() <= bound, step
        with torch.no_grad():
            module.policy.lm_head.weight.add_(0.01)  # an "update": the next step must see it
    assert engine.loads == [1, 2]  # set up at step 0, synced before steps 1 and 2 (interval 1)
    ours.trainer.global_step = 3
    ours.rollout(ours.val_prompt_batches()[0])  # held-out: the learner's weights now
    assert engine.loads == [1, 2, 3] and engine.version == 3


def test_a_capability_the_engine_lacks_is_refused_at_setup_in_one_line():
    module = GRPO(model_name_or_path="embedded:random")
    dm = _dm(module, engine=HFGenerateEngine(), topk=2, aux_draws=1)
    with pytest.raises(ValueError) as info:
        dm.setup("fit")
    message = str(info.value)
    assert "\n" not in message and "record.topk=2 needs 'topk'" in message
    assert "record.aux_draws=1 needs 'aux_draws'" in message and message.startswith("HFGenerateEngine")

    class SingleTurnOnly(ListEngine):
        capabilities = frozenset()

    with pytest.raises(ValueError, match=r"GroupRollout\(max_turns=3\) needs 'sessions'"):
        _dm(module, engine=SingleTurnOnly(), strategy=GroupRollout(max_turns=3)).setup("fit")


def test_n_samples_per_prompt_are_the_prompt_repeated_and_finish_reasons_follow_eos():
    module = GRPO(model_name_or_path="embedded:random")
    tok = module.tokenizer
    engine = KVCacheEngine().bound(module.policy)
    prompts = [tok("12+3=")["input_ids"], tok("4+56=")["input_ids"]]
    params = SamplingParams(max_tokens=5, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=3)
    grouped = engine.generate(prompts, params, n=3)
    rows = engine.generate([p for p in prompts for _ in range(3)], params)
    assert torch.equal(grouped.response_ids, rows.response_ids) and torch.equal(grouped.logprobs, rows.logprobs)
    ended = (grouped.response_ids == tok.eos_token_id).any(1).tolist()
    assert grouped.finish_reasons == ["stop" if e else "length" for e in ended]


def test_from_lists_lays_out_an_external_engines_rows():
    gen = Generation.from_lists([[5, 2], [7]], [[-0.5, -0.25], [-1.0]], ["stop", "length"], pad_token_id=0)
    assert gen.response_ids.tolist() == [[5, 2], [7, 0]]  # right-padded with the pad id
    assert gen.mask.tolist() == [[1, 1], [1, 0]] and gen.logprobs.tolist() == [[-0.5, -0.25], [-1.0, 0.0]]
    assert gen.truncated.tolist() == [False, True] and gen.finish_reasons == ["stop", "length"]


def test_the_sampler_sync_owns_lag_dtype_and_version():
    module = GRPO(model_name_or_path="embedded:random")
    policy = module.policy
    live = SamplerSync(KVCacheEngine())
    assert live.shares(policy) and live.for_step(policy, 0).model is policy  # no copy, nothing to sync
    lagged = SamplerSync(KVCacheEngine(), interval=2, dtype="bfloat16")
    copy = lagged.for_step(policy, 0).model
    assert copy is not policy and next(copy.parameters()).dtype == torch.bfloat16 and lagged.version == 0
    assert lagged.for_step(policy, 1).model is copy and lagged.version == 0  # one step: still the old weights
    assert lagged.for_step(policy, 2).model is copy and lagged.version == 2 and lagged.synced_at == 2
    assert lagged.current(policy, 2).model is policy  # held-out: the learner's weights, never the copy
    state = lagged.state_dict()
    assert state["sampler_synced_at"] == 2 and state["sampler"]["lm_head.weight"].dtype == torch.bfloat16
    producer = SamplerSync(KVCacheEngine(), asynchronous=True)
    assert not producer.shares(policy) and producer.start(policy, 4).model is not policy and producer.version == 4
    producer.publish(policy, 3)
    producer.refresh()
    assert producer.version == 4  # older than what it holds: not loaded
    producer.publish(policy, 6)
    producer.refresh()
    assert producer.version == 6 and producer.state_dict() == {}  # the producer's weights are the learner's
