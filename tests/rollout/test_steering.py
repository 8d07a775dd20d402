"""Steerable rollouts: prompt samplers (weights read at draw time), extra sampler outputs, scoring sequences."""

from __future__ import annotations

import pytest
import torch

from rl_lightning.algorithms import GRPO
from rl_lightning.envs import ArithmeticTask
from rl_lightning.rollout import Evaluation, Recording, RolloutDataModule, Sampling, SequentialSampler, WeightedSampler
from tests.conftest import tiny_trainer
from tests.rollout.rollout_helpers import fake_trainer


def test_the_sequential_sampler_is_the_stream_in_order():
    task = ArithmeticTask(num_heldout=4)
    assert SequentialSampler().indices(task, 3, 4, seed=0) == [12, 13, 14, 15]


def test_the_weighted_sampler_follows_the_weights_and_agrees_across_ranks():
    task = ArithmeticTask(num_heldout=4)
    sampler = WeightedSampler(pool_size=10, replacement=True)
    sampler.weights_from(lambda prompts: [1.0 if i in (2, 7) else 0.0 for i in range(len(prompts))])
    drawn = [i for step in range(20) for i in sampler.indices(task, step, 8, seed=0)]
    assert set(drawn) == {2, 7}
    assert sampler.indices(task, 5, 8, seed=0) == sampler.indices(task, 5, 8, seed=0)  # (seed, step) only
    assert sampler.indices(task, 5, 8, seed=0) != sampler.indices(task, 6, 8, seed=0)
    dms = [RolloutDataModule(task=task, prompts_per_step=4, group_size=2, prompt_sampler=sampler) for _ in range(3)]
    for dm, (rank, world) in zip(dms, [(0, 1), (0, 2), (1, 2)]):
        dm.trainer = fake_trainer(None, global_rank=rank, world_size=world)
    whole = dms[0].prompt_batch(3).indices
    assert dms[1].prompt_batch(3).indices + dms[2].prompt_batch(3).indices == whole
    bad = WeightedSampler(4)
    bad.weights_from(lambda p: [1.0, -1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="finite values >= 0"):
        bad.indices(task, 0, 2, seed=0)


class _Steer(GRPO):
    """Sets the sampler's weights in every training step: step k's update makes prompt k+1 the only one."""

    drawn: list[list[int]]

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        self.drawn.append(batch.prompt_index.unique().tolist())
        target = self.global_step + 1
        self.trainer.datamodule.prompt_sampler.weights_from(
            lambda prompts: [1.0 if i == target else 0.0 for i in range(len(prompts))])
        return super().training_step(batch, batch_idx)


def test_weights_set_in_a_step_decide_the_next_steps_prompts(tmp_path):
    """The data loader prefetches the next batch before the step runs; the prompts must still be drawn at
    rollout time, with the weights as the previous update left them (not a step ahead)."""
    module = _Steer(model_name_or_path="embedded:random")
    module.drawn = []
    dm = RolloutDataModule(task=ArithmeticTask(num_heldout=4), prompts_per_step=2, group_size=2,
                           prompt_sampler=WeightedSampler(pool_size=6, replacement=True),
                           sampling=Sampling(max_new_tokens=2))
    tiny_trainer(tmp_path, max_steps=4).fit(module, datamodule=dm)
    assert module.drawn[1:] == [[1], [2], [3]]


def _bound(dm: RolloutDataModule, module: GRPO) -> RolloutDataModule:
    dm.trainer = fake_trainer(module)
    return dm


def test_extra_sampler_outputs_leave_the_sampled_tokens_unchanged():
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    task = ArithmeticTask(num_heldout=4)
    plain = _bound(RolloutDataModule(task=task, prompts_per_step=2, group_size=2,
                                     sampling=Sampling(max_new_tokens=4)), module)
    rich = _bound(RolloutDataModule(task=task, prompts_per_step=2, group_size=2, sampling=Sampling(max_new_tokens=4),
                                    record=Recording(topk=3, aux_draws=5)), module)
    a, b = plain.rollout(plain.prompt_batch(0)), rich.rollout(rich.prompt_batch(0))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.sampler_logprobs, b.sampler_logprobs)
    assert a.record.topk_ids is None and a.record.aux_ids is None
    n, t = b.loss_mask.shape
    r = b.record
    assert r.topk_ids.shape == (n, t, 3) and r.topk_logprobs.shape == (n, t, 3) and r.aux_ids.shape == (n, t, 5)
    with torch.no_grad():  # the top-k log-probs are the full-vocabulary log-probs of those ids
        full = torch.log_softmax(module.policy(input_ids=b.input_ids, attention_mask=b.attention_mask,
                                               position_ids=(b.attention_mask.cumsum(-1) - 1).clamp(min=0)
                                               ).logits[:, b.prompt_length - 1:-1], dim=-1)
    m = b.loss_mask.bool()
    assert torch.allclose(full.gather(-1, b.record.topk_ids)[m], b.record.topk_logprobs[m], atol=1e-4)
    assert (b.record.topk_logprobs[m][:, :-1] >= b.record.topk_logprobs[m][:, 1:]).all()  # sorted, most likely first
    assert (b.record.aux_ids[~m] == 0).all() and (b.record.topk_logprobs[~m] == 0).all()
    # the aux draws follow the sampling distribution: over many positions their frequency of the top id
    # is near its probability (a random 20-token-vocabulary model: p(top) is well inside (0, 1))
    p_top = b.record.topk_logprobs[m][:, 0].exp().mean()
    f_top = (b.record.aux_ids[m] == b.record.topk_ids[m][:, :1]).float().mean()
    assert abs(float(p_top - f_top)) < 0.25


def test_score_sequences_gives_logprobs_with_gradient_and_the_target_mask():
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    out, mask = module.score_sequences([[1, 5, 6], [1, 7]], [[8, 9, 2], [10]], target_masks=[[0, 1, 1], [1]])
    assert mask.tolist() == [[0, 1, 1], [1, 0, 0]]
    assert out.logprobs.requires_grad
    assert (out.logprobs[mask == 0] == 0).all() and (out.logprobs[mask == 1] < 0).all()
    with torch.no_grad():  # the same numbers as one unpadded forward of context + target
        logits = module.policy(input_ids=torch.tensor([[1, 5, 6, 8, 9, 2]])).logits[0]
        want = torch.log_softmax(logits, dim=-1)[[3, 4], [9, 2]]
    assert torch.allclose(out.logprobs[0, 1:], want, atol=1e-5)
    out.logprobs.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.policy.parameters())


def test_branching_continues_n_times_from_a_saved_state_and_prefix(monkeypatch):
    from rl_lightning.envs import GuessNumberTask
    from rl_lightning.rollout import Branch, BranchRollout

    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    tok = module.tokenizer
    task = GuessNumberTask()
    prompt = task.train_prompt(0)
    env = task.make_env(prompt, None)
    env.reset()
    observation = env.step("99")[0]  # out of range: a defined outcome ("bad:"), one guess used
    prefix = tok("99", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] + tok(
        observation, add_special_tokens=False)["input_ids"]
    strategy = BranchRollout(n=3, max_turns=2, max_episode_tokens=30)
    dm = _bound(RolloutDataModule(task=task, prompts_per_step=1, group_size=3, strategy=strategy,
                                  sampling=Sampling(max_new_tokens=3)), module)
    strategy.set_branches([Branch(prompt, prefix, env.snapshot()),
                           Branch(prompt, tok("1", add_special_tokens=False)["input_ids"], None,
                                  pending_ids=tok("1", add_special_tokens=False)["input_ids"])])
    from rl_lightning.rollout import strategies

    seen = []  # (row's env: guesses made before this step, the action it receives)
    real_step = strategies.env_step
    monkeypatch.setattr(strategies, "env_step", lambda env, action, prompt, turn: (
        seen.append((len(env.guesses), action)), real_step(env, action, prompt, turn))[1])
    batch = dm.rollout(dm.prompt_batch(0))
    assert batch.num_rows == 6 and batch.group_size == 3
    firsts = seen[:6]  # the first turn of each row, in row order
    assert all(before == 1 for before, _ in firsts[:3])  # restored: the saved guess counts
    assert all(before == 0 and action.startswith("1") for before, action in firsts[3:])  # pending ids lead
    first = tok(f"{prompt.text}", add_special_tokens=False)["input_ids"]
    for row in range(3):  # the prefix is context: in the prompt part, not in the loss
        context = batch.input_ids[row, : batch.prompt_length][batch.attention_mask[row, : batch.prompt_length].bool()]
        assert context.tolist() == [tok.bos_token_id, *first, *prefix]
    assert (batch.turns.count <= 2).all()
    with pytest.raises(ValueError, match="no branches for step 1"):
        dm.rollout(dm.prompt_batch(1))


def test_a_branch_rows_prompt_index_is_its_prompts_stream_index():
    from rl_lightning.envs import GuessNumberTask
    from rl_lightning.rollout import Branch, BranchRollout

    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    task = GuessNumberTask()
    strategy = BranchRollout(n=2, max_turns=2)
    dm = _bound(RolloutDataModule(task=task, prompts_per_step=1, group_size=2, strategy=strategy,
                                  sampling=Sampling(max_new_tokens=3)), module)
    dm.cursor = 4  # step 4, from prompts an earlier step drew (stream indices 7 and 3), and one from no stream
    strategy.set_branches([Branch(task.train_prompt(7), prompt_index=7), Branch(task.train_prompt(3), prompt_index=3),
                           Branch(task.heldout_prompts()[0])])
    batch = dm.rollout(dm.prompt_batch(4))
    assert batch.prompt_index.tolist() == [7, 7, 3, 3, -1, -1]
    assert batch.prompt_id.tolist() == [p.uid for p in (task.train_prompt(i) for i in (7, 7, 3, 3))] + [1, 1]


def test_branch_rollout_plays_held_out_episodes_with_the_tasks_limits_not_the_branches():
    """Held-out evaluation does not depend on the training strategy: with ``BranchRollout(max_turns=2)`` (the
    continuations' limit) the greedy held-out episodes of guess-the-number are those of configs/tasks/guess.yaml's
    ``GroupRollout(max_turns=5)``: 11 of the 31 secrets found by the warm start (val/reward 0.355), not 3."""
    from rl_lightning.envs import GuessNumberTask
    from rl_lightning.rollout import BranchRollout, GroupRollout

    module = GRPO(model_name_or_path="embedded:guess")

    def heldout(strategy):
        dm = _bound(RolloutDataModule(task=GuessNumberTask(), prompts_per_step=1, group_size=2, strategy=strategy,
                                      sampling=Sampling(max_new_tokens=3), evaluation=Evaluation(batch_size=31)),
                    module)
        (batch,) = dm.val_prompt_batches()
        return dm.rollout(batch)

    plain = heldout(GroupRollout(max_turns=5, max_episode_tokens=32))
    branched = heldout(BranchRollout(n=2, max_turns=2, max_episode_tokens=32))
    assert plain.rewards.sum() == 11 and plain.num_rows == 31
    assert torch.equal(branched.rewards, plain.rewards) and torch.equal(branched.turns.count, plain.turns.count)
    assert torch.equal(branched.input_ids, plain.input_ids) and torch.equal(branched.truncated, plain.truncated)
