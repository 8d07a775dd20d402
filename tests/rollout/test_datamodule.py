"""``RolloutDataModule`` driven without a Trainer: sharding, rollouts, resume, lagged sampler, validation."""

from __future__ import annotations

import io

import pytest
import torch
from rollout_helpers import ScriptedLM, char_tokenizer_specials_last, fake_trainer

from rl_lightning.algorithms import GRPO
from rl_lightning.envs import ArithmeticTask, ExactMatchReward, Prompt, RewardError, RewardFunction
from rl_lightning.rollout import (
    AsyncRollout, Evaluation, Recording, RolloutBatch, RolloutDataModule, Sampling, StepRequest,
    position_ids_from_mask,
)
from tests.tolerances import decoder_logprob_bound
from tests.helpers.settings import data_kwargs

TASK = ArithmeticTask(num_heldout=10, seed=1234)


def _bound(module, batch: RolloutBatch) -> float:  # noqa: ANN001
    """The float32 rounding bound of a recomputed log-prob (``tolerances.decoder_logprob_bound``)."""
    return decoder_logprob_bound(module.policy, batch.temperature, batch.input_ids.shape[1])


def _dm(module=None, rank=0, world=1, task=TASK, **kwargs) -> RolloutDataModule:
    kwargs = {"prompts_per_step": 2, "group_size": 3, "sampling": Sampling(max_new_tokens=4), **kwargs}
    dm = RolloutDataModule(task, **data_kwargs(**kwargs))
    dm.trainer = fake_trainer(module, rank, world)
    return dm


@pytest.fixture
def module() -> GRPO:
    return GRPO(model_name_or_path="embedded:random")


@pytest.fixture(scope="module")
def warm() -> GRPO:
    return GRPO(model_name_or_path="embedded:arithmetic")


def _roundtrip(state):
    """What a checkpoint does to the state: save to bytes and load back."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---------------------------------------------------------------------------------------------------------------
# construction and prompt stream
@pytest.mark.parametrize(("name", "value"), [("prompts_per_step", 0), ("group_size", 0), ("max_rounds", 0)])
def test_invalid_arguments_name_the_field(name, value):
    with pytest.raises(ValueError, match=rf"invalid data\.init_args\.{name}={value}"):
        RolloutDataModule(TASK, **{name: value})


@pytest.mark.parametrize(
    ("group", "name", "value"),
    [(Sampling, "max_new_tokens", 0), (Sampling, "temperature", 0.0), (Sampling, "top_p", 0.0),
     (Sampling, "top_p", 1.5), (Sampling, "sync_interval", 0), (Sampling, "dtype", "float8"),
     (Evaluation, "batch_size", 0), (Evaluation, "num_prompts", -1), (Evaluation, "split", "train"),
     (Recording, "topk", -1), (Recording, "aux_draws", -1), (AsyncRollout, "queue", -1),
     (AsyncRollout, "max_staleness", -1)],
)
def test_invalid_settings_name_the_group_and_field(group, name, value):
    key = {Sampling: "sampling", Evaluation: "evaluation", Recording: "record", AsyncRollout: "async_rollout"}[group]
    with pytest.raises(ValueError, match=rf"invalid data\.init_args\.{key}\.{name}="):
        group(**{name: value})


def test_grouped_builds_the_settings_groups_of_a_config_read_as_yaml():
    import yaml

    from rl_lightning.rollout.settings import grouped
    from tests.conftest import REPO

    init = yaml.safe_load((REPO / "configs" / "score_centering.yaml").read_text())["data"]["init_args"]
    args = grouped(init)
    assert args["sampling"] == Sampling(max_new_tokens=6, temperature=1.0, top_p=1.0, sync_interval=4, dtype=None)
    assert args["record"] == Recording(topk=8) and args["evaluation"] == Evaluation(batch_size=500)
    assert args["task"] == init["task"] and args["prompts_per_step"] == 16  # not groups: as read
    assert isinstance(init["sampling"], dict)  # the mapping read is not changed


def test_prompt_batch_shards_a_contiguous_global_slice():
    single = _dm(prompts_per_step=4)
    r0, r1 = _dm(prompts_per_step=4, rank=0, world=2), _dm(prompts_per_step=4, rank=1, world=2)
    for step in (0, 3):
        whole, a, b = single.prompt_batch(step), r0.prompt_batch(step), r1.prompt_batch(step)
        assert whole.split == a.split == "train" and whole.step == a.step == b.step == step
        assert whole.indices == list(range(4 * step, 4 * step + 4))
        assert a.indices == whole.indices[:2] and b.indices == whole.indices[2:]
        assert not set(a.indices) & set(b.indices)
        assert [p.text for p in a.prompts + b.prompts] == [p.text for p in whole.prompts]
        assert [p.text for p in whole.prompts] == [TASK.train_prompt(i).text for i in whole.indices]


def test_setup_rejects_prompts_per_step_not_divisible_by_world():
    dm = _dm(prompts_per_step=3, rank=0, world=2)
    with pytest.raises(ValueError, match="prompts_per_step=3"):
        dm.setup("fit")
    _dm(prompts_per_step=4, world=2).setup("fit")  # fine


def test_train_dataloader_starts_at_cursor():
    dm = _dm()
    dm.cursor = 5
    it = iter(dm.train_dataloader())
    first, second = next(it), next(it)
    # the loader only names the step: its prompts are drawn when the rollout starts (after the previous update)
    assert (first, second) == (StepRequest(5), StepRequest(6)) and dm.prompt_batch(first.step).indices == [10, 11]


def test_needs_a_module_with_policy_and_tokenizer():
    dm = _dm(module=object())
    with pytest.raises(RuntimeError, match="policy"):
        dm.rollout(dm.prompt_batch(0))


# ---------------------------------------------------------------------------------------------------------------
# rollouts
class ResponseLength(RewardFunction):
    def __call__(self, prompt, response):
        return float(len(response))


def test_rollout_structure_groups_rewards_and_cursor(module):
    dm = _dm(module, prompts_per_step=2, group_size=3, reward_fn=ResponseLength())
    pb = dm.prompt_batch(0)
    batch = dm.on_after_batch_transfer(pb, 0)
    assert isinstance(batch, RolloutBatch)
    assert batch.num_rows == 6 and batch.group_size == 3
    assert batch.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert [p.text for p in batch.prompts] == [pb.prompts[0].text] * 3 + [pb.prompts[1].text] * 3
    # rows of one group share the (left-padded, BOS-prefixed) prompt tokens
    tok = module.tokenizer
    for g, prompt in enumerate(pb.prompts):
        want = [tok.bos_token_id, *tok(prompt.text, add_special_tokens=False)["input_ids"]]
        for r in range(3 * g, 3 * g + 3):
            row = batch.input_ids[r, : batch.prompt_length][batch.attention_mask[r, : batch.prompt_length].bool()]
            assert row.tolist() == want
    assert batch.loss_mask.shape[1] <= 4
    assert batch.rewards.tolist() == [float(len(r)) for r in batch.responses]
    assert batch.responses == tok.batch_decode(
        [ids[m.bool()].tolist() for ids, m in zip(batch.response_ids, batch.loss_mask)], skip_special_tokens=True
    )
    assert (batch.temperature, batch.top_p) == (1.0, 1.0)
    assert dm.cursor == 1
    assert module.policy.training  # rollout restores the policy's mode
    # a stale batch is refused, and so is one from the future
    with pytest.raises(RuntimeError, match="step 0"):
        dm.rollout(pb)
    with pytest.raises(RuntimeError, match="cursor at 1"):
        dm.rollout(dm.prompt_batch(2))
    dm.rollout(dm.prompt_batch(1))
    assert dm.cursor == 2
    # non-prompt batches pass through untouched
    assert dm.on_after_batch_transfer(batch, 0) is batch


def test_rollout_rewards_from_default_verifier(warm):
    dm = _dm(warm, prompts_per_step=4, group_size=2, max_new_tokens=5, temperature=0.5)
    batch = dm.rollout(dm.prompt_batch(0))
    verifier = ExactMatchReward()
    assert batch.rewards.tolist() == [verifier(p, r) for p, r in zip(batch.prompts, batch.responses)]
    assert batch.rewards.dtype == torch.float32


def test_rollout_is_on_policy(module):
    """End to end: the data module's recorded log-probs equal the learner's recomputation."""
    dm = _dm(module, prompts_per_step=2, group_size=2, temperature=0.8, top_p=0.9)
    batch = dm.rollout(dm.prompt_batch(0))
    with torch.no_grad():
        lp, _ = module.token_logprobs(batch)
    m = batch.loss_mask.bool()
    # the same model scores the same tokens in other shapes: the float32 log-prob bound of this decoder
    assert (lp - batch.sampler_logprobs)[m].abs().max() <= _bound(module, batch)


def test_val_batch_does_not_advance_cursor(module):
    dm = _dm(module, num_prompts=4, batch_size=4)
    dm.rollout(dm.val_prompt_batches()[0])
    assert dm.cursor == 0 and dm.sampling_params(dm.val_prompt_batches()[0]).seed is None  # greedy, unseeded


def test_reward_error_names_prompt_and_response(module):
    seen = []

    class Broken(RewardFunction):
        def __call__(self, prompt, response):
            seen.append((prompt, response))
            raise ZeroDivisionError("boom")

    dm = _dm(module, reward_fn=Broken())
    with pytest.raises(RewardError) as info:
        dm.rollout(dm.prompt_batch(0))
    prompt, response = seen[0]
    msg = str(info.value)
    assert prompt.text in msg and repr(response) in msg and "boom" in msg
    # the data module keeps the failed rollout's responses (FailureDump saves them); the exception carries nothing
    failed = dm.failed_rollout
    assert failed is not None and failed.responses[0] == response and failed.num_rows == len(failed.responses)
    assert not hasattr(info.value, "rollout_batch")
    dm.reward_fn = ExactMatchReward()
    dm.rollout(dm.prompt_batch(0))  # the next rollout starts afresh
    assert dm.failed_rollout is None


def test_responses_after_eos_decode_cleanly_with_a_nonzero_pad_id():
    """A row that stops early must decode to its own tokens only, whatever the tokenizer's id 0 is.

    With a tokenizer whose id 0 is an ordinary token (GPT-2, Llama 3, Qwen: ``"!"``; here ``"0"``) and whose
    pad id is not 0, the padding after EOS must not turn into text.
    """
    tok = char_tokenizer_specials_last()
    assert tok.convert_ids_to_tokens(0) == "0" and tok.pad_token_id != 0
    c = tok.convert_tokens_to_ids
    eos = tok.eos_token_id
    script = [[c("8"), c("5"), eos, eos, eos], [c("1"), c("2"), c("3"), c("4"), c("5")]]
    lm = ScriptedLM(script, vocab_size=len(tok))
    module = type("M", (), {"policy": lm, "tokenizer": tok})()
    task = type("OneTask", (ArithmeticTask,), {"train_prompt": lambda self, i: Prompt("37+48=", "85")})(num_heldout=1)
    dm = _dm(module, task=task, prompts_per_step=1, group_size=2, max_new_tokens=5)
    batch = dm.rollout(dm.prompt_batch(0))
    assert batch.loss_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch.responses[1] == "12345"
    assert batch.responses[0] == "85"
    assert batch.rewards.tolist() == [1.0, 0.0]


# ---------------------------------------------------------------------------------------------------------------
# resume
def test_state_dict_resumes_stream_and_sampling(module):
    """Sampling at step k is seeded by (seed, rank, k): the cursor alone resumes it exactly."""
    a = _dm(module, seed=3)
    a.rollout(a.prompt_batch(0))
    state = _roundtrip(a.state_dict())
    assert state == {"cursor": 1}  # no generator state to carry (or to lose on other ranks)
    expected = a.rollout(a.prompt_batch(1))

    b = _dm(module, seed=3)
    b.load_state_dict(state)
    assert b.cursor == 1
    resumed = b.rollout(b.prompt_batch(b.cursor))
    assert torch.equal(resumed.input_ids, expected.input_ids)
    assert torch.equal(resumed.sampler_logprobs, expected.sampler_logprobs)
    assert resumed.prompt_index.tolist() == expected.prompt_index.tolist()

    # another seed samples differently at the same step (so the check above is meaningful)
    c = _dm(module, seed=4)
    c.cursor = 1
    assert not torch.equal(c.rollout(c.prompt_batch(1)).input_ids, expected.input_ids)


def test_state_dict_resumes_lagged_sampler(module):
    a = _dm(module, sync_interval=3)
    a.rollout(a.prompt_batch(0))
    with torch.no_grad():
        module.policy.lm_head.weight.mul_(3.0)  # "an update": the sampler stays stale until step 3
    a.rollout(a.prompt_batch(1))
    state = _roundtrip(a.state_dict())
    assert state["sampler_synced_at"] == 0
    expected = a.rollout(a.prompt_batch(2))

    b = _dm(module, sync_interval=3)
    b.load_state_dict(state)
    resumed = b.rollout(b.prompt_batch(2))
    assert torch.equal(resumed.input_ids, expected.input_ids)
    assert torch.equal(resumed.sampler_logprobs, expected.sampler_logprobs)


def test_every_rank_resumes_its_generator_from_the_saved_checkpoint(module):
    """Lightning persists one checkpoint, written by global rank 0 (``Strategy.save_checkpoint`` is rank-zero
    only), and every rank restores from it. Rank 1 must still continue its own sampling stream exactly."""
    r0, r1 = _dm(module, rank=0, world=2, seed=3), _dm(module, rank=1, world=2, seed=3)
    for dm in (r0, r1):
        dm.rollout(dm.prompt_batch(0))
    checkpoint = _roundtrip(r0.state_dict())  # the only datamodule state that reaches the file
    expected = {0: r0.rollout(r0.prompt_batch(1)), 1: r1.rollout(r1.prompt_batch(1))}
    for rank in (0, 1):
        dm = _dm(module, rank=rank, world=2, seed=3)
        dm.load_state_dict(checkpoint)
        resumed = dm.rollout(dm.prompt_batch(1))
        assert torch.equal(resumed.input_ids, expected[rank].input_ids), f"rank {rank} resumed a different stream"


# ---------------------------------------------------------------------------------------------------------------
# lagged sampler
def _same_weights(m1, m2) -> bool:
    s1, s2 = m1.state_dict(), m2.state_dict()
    return s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)


def test_sampler_sync_interval_one_uses_the_policy(module):
    dm = _dm(module)
    assert dm.sampler() is module.policy


def test_sampler_sync_interval_two(module):
    dm = _dm(module, prompts_per_step=1, group_size=2, sync_interval=2)
    b0 = dm.rollout(dm.prompt_batch(0))
    sampler = dm.sampler()
    assert sampler is not module.policy
    assert _same_weights(sampler, module.policy)
    assert not any(p.requires_grad for p in sampler.parameters())
    with torch.no_grad():
        lp, _ = module.token_logprobs(b0)
    assert (lp - b0.sampler_logprobs)[b0.loss_mask.bool()].abs().max() <= _bound(module, b0)

    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert not _same_weights(sampler, module.policy)  # a separate copy: the update does not reach it

    b1 = dm.rollout(dm.prompt_batch(1))  # step 1: 1 step since the sync, still stale
    assert dm.sync.engine.model is sampler  # the same copy, not re-created
    assert not _same_weights(sampler, module.policy)
    with torch.no_grad():
        lp_policy, _ = module.token_logprobs(b1)
        lp_sampler, _ = module.token_logprobs(b1, model=sampler)
    m = b1.loss_mask.bool()
    assert (lp_sampler - b1.sampler_logprobs)[m].abs().max() <= _bound(module, b1)  # recorded under the stale sampler
    assert (lp_policy - b1.sampler_logprobs)[m].abs().max() > 1e-3  # ... so the mismatch is real

    b2 = dm.rollout(dm.prompt_batch(2))  # step 2: two steps passed, synced before generating
    assert _same_weights(sampler, module.policy) and dm.sync.synced_at == 2 and dm.sync.version == 2
    assert dm.sync.engine.model is sampler and sampler is not module.policy
    with torch.no_grad():
        lp2, _ = module.token_logprobs(b2)
    assert (lp2 - b2.sampler_logprobs)[b2.loss_mask.bool()].abs().max() <= _bound(module, b2)


# ---------------------------------------------------------------------------------------------------------------
# validation
def test_val_batches_shard_heldout_across_ranks():
    held = [p.text for p in TASK.heldout_prompts()[:7]]
    r0 = _dm(num_prompts=7, batch_size=2, rank=0, world=2).val_prompt_batches()
    r1 = _dm(num_prompts=7, batch_size=2, rank=1, world=2).val_prompt_batches()
    for batches in (r0, r1):
        assert all(b.split == "val" and b.step == -1 and len(b.indices) <= 2 for b in batches)
    i0 = [i for b in r0 for i in b.indices]
    i1 = [i for b in r1 for i in b.indices]
    assert not set(i0) & set(i1)
    assert sorted(i0 + i1) == list(range(7))
    assert [p.text for b in r0 + r1 for p in b.prompts] == [held[i] for i in i0 + i1]
    single = _dm(num_prompts=None, batch_size=256).val_prompt_batches()
    assert len(single) == 1 and len(single[0].indices) == 10  # all held-out prompts by default


def test_val_rollout_is_greedy_group_one(warm):
    dm = _dm(warm, group_size=4, num_prompts=6, batch_size=6, temperature=1.0, sync_interval=2)
    vb = dm.val_prompt_batches()[0]
    out1, out2 = dm.rollout(vb), dm.rollout(vb)
    assert out1.group_size == 1 and out1.num_rows == 6
    assert out1.prompt_index.tolist() == vb.indices
    assert torch.equal(out1.input_ids, out2.input_ids)
    # greedy: every generated token is the argmax of the policy at that position
    with torch.no_grad():
        logits = warm.policy(input_ids=out1.input_ids, attention_mask=out1.attention_mask,
                             position_ids=position_ids_from_mask(out1.attention_mask)).logits
    t = out1.response_ids.shape[1]
    pred = logits[:, out1.prompt_length - 1: out1.prompt_length - 1 + t].argmax(-1)
    m = out1.loss_mask.bool()
    assert torch.equal(pred[m], out1.response_ids[m])
    assert not dm.sync.ready  # validation uses the policy itself, never the lagged copy
    total, count = dm.evaluate()
    assert count == 6 and total == float(out1.rewards.sum())
