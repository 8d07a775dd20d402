"""The end of a branch (issue 22, items 1, 2, 6, 7, 8): terminated versus cut per row, the final observation a
limit keeps out of the trajectory, continuing any cut row without replaying it, per-branch horizons and token
budgets, one-off rollouts through the data module, the strategy's group size, and replay stores that survive
``weights_only`` checkpoints."""

from __future__ import annotations

import pytest
import torch

from rl_lightning.algorithms import GRPO
from rl_lightning.envs import ArithmeticTask, GuessNumberTask, Prompt
from rl_lightning.rollout import (
    Branch, BranchRollout, BranchStore, GroupRollout, PromptBatch, RolloutDataModule,
)
from rl_lightning.rollout.branching import BRANCH_PREFIX_TOKENS
from rl_lightning.rollout import Evaluation, PromptFormat, Sampling, StepRequest
from tests.rollout.rollout_helpers import fake_trainer


def _bound(dm: RolloutDataModule, module: GRPO) -> RolloutDataModule:
    dm.trainer = fake_trainer(module)
    return dm


def _real(batch, row: int) -> list[int]:
    """The row's response ids: sampled and observation ids, no padding."""
    keep = (batch.loss_mask[row] | batch.turns.obs_mask[row]).bool()
    return batch.response_ids[row][keep].tolist()


@pytest.fixture(scope="module")
def guess():
    return GRPO(model_name_or_path="embedded:guess")


def _heldout(module: GRPO, max_turns: int) -> tuple[RolloutDataModule, object]:
    """Greedy held-out episodes of guess-the-number (31 secrets) cut at ``max_turns`` turns."""
    dm = _bound(RolloutDataModule(task=GuessNumberTask(), prompts_per_step=1, group_size=1,
                                  strategy=GroupRollout(max_turns=max_turns, max_episode_tokens=32),
                                  sampling=Sampling(max_new_tokens=3), evaluation=Evaluation(batch_size=31)), module)
    (prompts,) = dm.val_prompt_batches()
    return dm, dm.rollout(prompts)


def test_the_batch_says_terminated_or_cut_and_keeps_the_cut_episodes_final_observation(guess):
    dm, batch = _heldout(guess, max_turns=2)
    tok = guess.tokenizer
    found = batch.rewards == 1
    assert batch.ends is not None and torch.equal(batch.ends.cut, ~batch.ends.terminated)
    assert bool(found.any()) and bool((~batch.ends.terminated).any())
    # found within 2 guesses: the environment ended it; otherwise max_turns cut it with a guess budget left
    assert torch.equal(batch.ends.terminated, found)
    for row in range(batch.num_rows):
        end = batch.ends.states[row]
        if batch.ends.terminated[row]:
            assert end is None
            continue
        assert end.env_state["guesses"] and len(end.env_state["guesses"]) == 2  # the state after both guesses
        # the environment's answer to the second guess ("hi:"/"lo:"/"bad:") is kept, not lost
        assert end.final_obs_ids and tok.decode(end.final_obs_ids) == end.turns[-1][1]
        assert end.turns[-1][1] in ("hi:", "lo:", "bad:") and len(end.turns) == 2
        assert end.prefix_ids == _real(batch, row) + end.final_obs_ids and end.pending_ids == []
    picked = batch.select(torch.tensor([1, 0])).ends
    assert picked.states == [batch.ends.states[1], batch.ends.states[0]]
    assert torch.equal(picked.terminated, batch.ends.terminated[[1, 0]])


def test_a_cut_row_continued_from_its_end_state_is_the_uncut_episode(guess):
    """2 greedy turns, then 3 more from each cut row's end state (no replay) = 5 greedy turns straight: the same
    ids, returns and terminations."""
    _, straight = _heldout(guess, max_turns=5)
    dm, first = _heldout(guess, max_turns=2)
    rows = [r for r in range(first.num_rows) if first.ends.states[r] is not None
            and len(first.ends.states[r].prefix_ids) < 32]
    assert len(rows) >= 10
    branches = [Branch.from_rollout(first, r, max_turns=3, max_tokens=32 - len(first.ends.states[r].prefix_ids))
                for r in rows]
    cursor = dm.cursor
    rest = dm.rollout_branches(branches, n=1, greedy=True)
    assert dm.cursor == cursor  # a one-off rollout does not move the stream
    assert rest.num_rows == len(rows) and rest.group_size == 1
    for k, r in enumerate(rows):
        assert first.ends.states[r].prefix_ids + _real(rest, k) == _real(straight, r)
        assert float(first.rewards[r] + rest.rewards[k]) == float(straight.rewards[r])
        assert bool(rest.ends.terminated[k]) == bool(straight.ends.terminated[r])
        assert int(first.turns.count[r] + rest.turns.count[k]) == int(straight.turns.count[r])
    with pytest.raises(ValueError, match="terminated"):
        Branch.from_rollout(first, int(first.ends.terminated.nonzero()[0]))


def test_each_branch_has_its_own_horizon_and_token_budget():
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:guess")
    task = GuessNumberTask()
    strategy = BranchRollout(n=4, max_turns=5, max_episode_tokens=32)
    dm = _bound(RolloutDataModule(task=task, prompts_per_step=1, group_size=4, strategy=strategy,
                                  sampling=Sampling(max_new_tokens=3, temperature=1.5)), module)
    prompt = task.train_prompt(0)
    strategy.set_branches([Branch(prompt, max_turns=1), Branch(prompt, max_turns=2), Branch(prompt, max_tokens=4)])
    batch = dm.rollout(dm.prompt_batch(0))
    assert (batch.turns.count[:4] == 1).all()  # horizon 1
    assert (batch.turns.count[4:8] <= 2).all() and (batch.turns.count[4:8] == 2).any()  # horizon 2
    assert (batch.turns.count[8:] > 2).any() or (batch.truncated[8:]).all()  # the third: its budget, not 5 turns
    lengths = (batch.loss_mask | batch.turns.obs_mask).sum(dim=1)
    assert (lengths[8:] <= 4).all() and (lengths[:8] > 0).all()
    assert strategy.max_turns == 5  # the strategy itself is untouched


def test_a_completion_never_overruns_the_turn_and_a_chunk_is_held_from_the_environment():
    """AC2's chunks on a single-turn task: a prefix of 3 pending ids leaves 3 of ``max_new_tokens = 6`` to the
    completion; a token budget of 2 cuts the turn before EOS, and that chunk is not scored (reward 0, cut, its ids
    pending) but continues to a completed, scored answer."""
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")  # rarely emits EOS: turns run to their limit
    tok = module.tokenizer
    task = ArithmeticTask(num_heldout=4)
    strategy = BranchRollout(n=4, max_turns=1)
    scored: list[str] = []
    dm = _bound(RolloutDataModule(task=task, prompts_per_step=1, group_size=4, strategy=strategy,
                                  reward_fn=lambda prompt, response: scored.append(response) or 0.5,
                                  sampling=Sampling(max_new_tokens=6)), module)
    prompt = task.train_prompt(0)
    pending = tok("12", add_special_tokens=False)["input_ids"] + tok("3", add_special_tokens=False)["input_ids"]
    strategy.set_branches([Branch(prompt, list(pending), pending_ids=list(pending)),
                           Branch(prompt, list(pending), pending_ids=list(pending), max_tokens=2)])
    batch = dm.rollout(dm.prompt_batch(0))
    lengths = batch.loss_mask.sum(dim=1)
    assert (lengths[:4] <= 3).all() and (lengths[4:] <= 2).all()
    assert batch.extras[BRANCH_PREFIX_TOKENS].tolist() == [3] * 8  # every row continued from 3 prefix ids
    assert len(scored) == 4 + int((batch.ends.terminated[4:]).sum())  # the held chunks were not scored
    assert all(s.startswith("123") for s in scored)  # the environment sees the pending ids first
    for row in range(4, 8):
        if batch.ends.terminated[row]:  # EOS within the chunk: a finished answer, scored
            assert batch.rewards[row] == 0.5
            continue
        end = batch.ends.states[row]
        chunk = batch.response_ids[row][batch.loss_mask[row].bool()].tolist()
        assert batch.rewards[row] == 0 and batch.truncated[row] and len(chunk) == 2
        assert end.pending_ids == pending + chunk and end.prefix_ids == pending + chunk
        rest = dm.rollout_branches([Branch.from_rollout(batch, row)], n=2, seed=3)
        assert rest.extras[BRANCH_PREFIX_TOKENS].tolist() == [5, 5]
        assert (rest.loss_mask.sum(dim=1) <= 1).all()  # 6 - 3 - 2: the turn's own limit still holds
        assert rest.ends.terminated.all() and (rest.rewards == 0.5).all()  # finished and scored
    with pytest.raises(ValueError, match="no room in a turn of 6"):
        dm.rollout_branches([Branch(prompt, [5] * 6, pending_ids=[5] * 6)])


def test_one_off_rollouts_are_seeded_in_eval_mode_and_leave_the_policy_training():
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    modes: list[bool] = []
    dm = _bound(RolloutDataModule(task=ArithmeticTask(num_heldout=4), prompts_per_step=1, group_size=4,
                                  strategy=GroupRollout(),
                                  reward_fn=lambda p, r: modes.append(module.policy.training) or 0.0,
                                  sampling=Sampling(max_new_tokens=4)), module)
    module.policy.train()
    branches = [Branch(ArithmeticTask(num_heldout=4).train_prompt(i)) for i in range(2)]
    a, b = dm.rollout_branches(branches, n=3, seed=11), dm.rollout_branches(branches, n=3, seed=11)
    c = dm.rollout_branches(branches, n=3, seed=12)
    assert a.num_rows == 6 and a.group_size == 3
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.sampler_logprobs, b.sampler_logprobs)
    assert not torch.equal(a.input_ids, c.input_ids)
    assert modes and not any(modes) and module.policy.training  # eval during, training again after
    assert dm.cursor == 0


def test_the_strategy_owns_the_group_size_and_branches_from_gets_the_steps_prompts():
    with pytest.raises(ValueError, match=r"data.init_args.group_size=8 differs from "
                                         r"data.init_args.strategy.init_args.n=4"):
        RolloutDataModule(task=GuessNumberTask(), group_size=8, strategy=BranchRollout(n=4))
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    strategy = BranchRollout(n=2, max_turns=2)
    dm = _bound(RolloutDataModule(task=GuessNumberTask(), prompts_per_step=2, group_size=2, strategy=strategy,
                                  sampling=Sampling(max_new_tokens=3)), module)
    seen: list[tuple[int, PromptBatch]] = []

    def from_prompts(step: int, prompts: PromptBatch) -> list[Branch]:
        seen.append((step, prompts))
        return [Branch(p, prompt_index=i) for i, p in zip(prompts.indices, prompts.prompts)]

    strategy.branches_from(from_prompts)
    batch = dm.rollout(StepRequest(0))  # what the loader yields: the data module draws the step's prompts
    ((step, prompts),) = seen
    assert step == 0 and prompts.indices == dm.prompt_batch(0).indices == [0, 1]
    assert batch.prompt_index.tolist() == [0, 0, 1, 1]
    with pytest.raises(TypeError, match=r"\(step, prompts\)"):
        strategy.branches_from(lambda step: [])


def test_replay_stores_survive_weights_only_checkpoints(tmp_path, guess):
    _, batch = _heldout(guess, max_turns=2)
    cut = [r for r in range(batch.num_rows) if not batch.ends.terminated[r]]
    store = BranchStore(capacity=5)
    store.add([Branch.from_rollout(batch, r, max_turns=3) for r in cut])
    assert len(store) == 5 and store.items[0].prompt == batch.prompts[cut[-5]]  # the oldest went
    prompts = [Prompt("7+8=", "15", {"uid": 3, "tags": ["a"]}), batch.prompts[0]]
    torch.save({"store": store.state_dict(), "prompts": [p.to_state() for p in prompts]}, tmp_path / "s.ckpt")
    loaded = torch.load(tmp_path / "s.ckpt", weights_only=True)
    again = BranchStore()
    again.load_state_dict(loaded["store"])
    assert again.capacity == 5 and again.items == store.items
    assert [Prompt.from_state(p) for p in loaded["prompts"]] == prompts
    # and the batch's end states, as the asynchronous producer checkpoints a queued batch
    from rl_lightning.rollout.async_producer import RolloutProducer

    torch.save(RolloutProducer._pack(batch), tmp_path / "b.ckpt")
    back = RolloutProducer._unpack(torch.load(tmp_path / "b.ckpt", weights_only=True), "cpu")
    assert back.ends.states == batch.ends.states and torch.equal(back.ends.terminated, batch.ends.terminated)


def test_an_end_state_under_a_chat_template_continues_the_templates_rendering():
    """One turn (the single-turn path) cut by ``max_turns`` in a three-turn environment, then two more from its end
    state: the whole trajectory is the template's rendering of the whole conversation (the final observation,
    "n1:", was kept and is rendered as the third message)."""
    from tests.rollout.test_episodes import NUMBERED_TEMPLATE, CountdownTask

    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:arithmetic")
    tok = module.tokenizer
    tok.chat_template = NUMBERED_TEMPLATE
    common = dict(task=CountdownTask(), prompts_per_step=1, group_size=2, sampling=Sampling(max_new_tokens=4),
                  prompt_format=PromptFormat(use_chat_template=True))
    dm = _bound(RolloutDataModule(**common, strategy=GroupRollout(max_turns=1, max_episode_tokens=80)), module)
    first = dm.rollout(dm.prompt_batch(0))
    assert not first.ends.terminated.any() and first.truncated.all()  # the environment wanted more turns
    end = first.ends.states[0]
    assert end.turns[0][1] == "n1:" and "3u:n1:|4a:" in tok.decode(end.final_obs_ids)
    rest = dm.rollout_branches([Branch.from_rollout(first, 0, max_turns=2)], n=2, seed=1)
    assert rest.ends.terminated.all() and (rest.turns.count == 2).all()  # turns 2 and 3 end the environment's episode
    for row in range(2):
        context = rest.input_ids[row, : rest.prompt_length][rest.attention_mask[row, : rest.prompt_length].bool()]
        trajectory = context.tolist() + _real(rest, row)
        messages = [{"role": "user", "content": "go:"}, {"role": "assistant", "content": end.turns[0][0]},
                    {"role": "user", "content": "n1:"}]
        for turn in range(2):
            ids = rest.response_ids[row][rest.turns.index[row] == turn].tolist()
            messages.append({"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)})
            if turn == 0:
                messages.append({"role": "user", "content": "n2:"})
        rendered = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
        assert rendered[: len(trajectory)] == trajectory


def test_one_off_rollouts_can_sample_with_the_lagged_sampler():
    """``sampler=True``: the weights the training rollouts sample with (a copy refreshed every 4 steps), not the
    learner's: after the learner moves, the same seeded call draws the same rows; the default follows the learner."""
    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    dm = _bound(RolloutDataModule(task=ArithmeticTask(num_heldout=4), prompts_per_step=1, group_size=4,
                                  sampling=Sampling(max_new_tokens=6, sync_interval=4)), module)
    dm.rollout(dm.prompt_batch(0))  # step 0: the copy is made
    branches = [Branch(ArithmeticTask(num_heldout=4).train_prompt(5))]
    lagged, learner = dm.rollout_branches(branches, n=4, seed=2, sampler=True), dm.rollout_branches(branches, 4, 2)
    assert torch.equal(lagged.input_ids, learner.input_ids)  # no update yet: the same weights
    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(0.5 * torch.randn_like(p))
    again = dm.rollout_branches(branches, n=4, seed=2, sampler=True)
    assert torch.equal(again.input_ids, lagged.input_ids)
    assert torch.equal(again.sampler_logprobs, lagged.sampler_logprobs)
    moved = dm.rollout_branches(branches, n=4, seed=2)
    assert not torch.equal(moved.sampler_logprobs, lagged.sampler_logprobs)


def test_an_environment_that_cannot_be_snapshotted_still_trains_and_says_why_it_cannot_be_continued():
    from tests.rollout.test_episodes import CountdownEnv, CountdownTask

    class Unsnappable(CountdownEnv):
        def snapshot(self):  # noqa: ANN201
            raise TypeError("cannot pickle '_thread.lock' object")

    class Task(CountdownTask):
        def make_env(self, prompt, reward_fn):  # noqa: ANN001, ANN201
            return Unsnappable(3)

    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    dm = _bound(RolloutDataModule(task=Task(), prompts_per_step=1, group_size=2, strategy=GroupRollout(max_turns=2),
                                  sampling=Sampling(max_new_tokens=3)), module)
    batch = dm.rollout(dm.prompt_batch(0))
    assert batch.ends.cut.all() and batch.ends.states[0].snapshot_error.startswith("TypeError: cannot pickle")
    with pytest.raises(ValueError, match="could not be snapshotted"):
        Branch.from_rollout(batch, 0)


def test_sample_episodes_keeps_the_cut_observation_and_takes_per_row_limits():
    """``sample_episodes`` directly, on a bare model: rows with 1, 2 and 3 turns allowed (``max_turns`` per row), an
    observer that always answers ``[7, 8]``: a row cut by its turn limit keeps that last answer in ``final_obs``
    (not in the trajectory); with ``hold_at_budget`` a row whose token budget cuts its turn is not observed and keeps
    the turn as ``pending``; ``turn_used`` shortens the first turn."""
    from rl_lightning.rollout import SamplingParams, sample_episodes

    torch.manual_seed(0)
    module = GRPO(model_name_or_path="embedded:random")
    tok = module.tokenizer
    params = SamplingParams(max_tokens=3, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=4)
    observed: list[int] = []

    def observe(rows, actions):  # noqa: ANN001, ANN202
        observed.extend(rows)
        return [[7, 8] for _ in rows]

    gen = sample_episodes(module.policy, [[1, 5]] * 4, observe, params=params, max_turns=[1, 2, 3, 3],
                          max_episode_tokens=[100, 100, 100, 2], turn_used=[0, 0, 2, 0], hold_at_budget=True)
    assert gen.num_turns.tolist()[:3] == [1, 2, 3] and gen.truncated[:3].all()
    assert gen.final_obs[:3] == [[7, 8]] * 3  # the answer after the last turn, kept out of the trajectory
    assert ((gen.mask | gen.obs_mask).sum(dim=1)[:3] == gen.mask.sum(dim=1)[:3] + 2 * (gen.num_turns[:3] - 1)).all()
    assert (gen.turn_index[2] == 0).sum() <= 1  # 3 tokens per turn, 2 of them already used (pending ids)
    # row 3: a budget of 2 tokens cuts its first turn (3 tokens, no EOS from the random model): held, not observed
    assert gen.pending[3] and len(gen.pending[3]) == 2 and 3 not in observed
    assert gen.truncated[3] and gen.num_turns[3] == 1 and gen.final_obs[3] == []
    assert gen.pending[:3] == [[], [], []]
