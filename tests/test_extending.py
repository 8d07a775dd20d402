"""docs/extending.md and docs/extending_advanced.md stay true: their code is the example files, the command runs, and
Dr. GRPO's math is right; extending.md stays the one-page path (at most 8 hook rows, under 400 lines)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from rl_lightning.algorithms import Advantages
from lightning.pytorch import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rl_lightning.algorithms import LossTerm, PolicyOutput
from rl_lightning.rollout import Recording, RolloutBatch, Sampling
from tests.conftest import REPO, RecordBatches

DOC = REPO / "docs" / "extending.md"
ADVANCED = REPO / "docs" / "extending_advanced.md"
EXAMPLES = REPO / "docs" / "examples"
COMMAND = "PYTHONPATH=docs/examples .venv/bin/rl-lightning fit --config docs/examples/dr_grpo.yaml"
TINY = [
    "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--data.init_args.prompts_per_step", "4",
    "--data.init_args.group_size", "4", "--data.init_args.task.init_args.num_heldout", "16",
]


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(info string, content)`` of every fenced block, content with its trailing newline."""
    blocks, info, lines = [], None, []
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if info is None:
                info, lines = line[3:].strip(), []
            else:
                blocks.append((info, "".join(lines)))
                info = None
        elif info is not None:
            lines.append(line)
    assert info is None, "unclosed fenced block in docs/extending*.md"
    return blocks


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dr_grpo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dr_grpo", EXAMPLES / "dr_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_shows_the_example_files_verbatim():
    blocks = _fenced_blocks(DOC.read_text()) + _fenced_blocks(ADVANCED.read_text())
    titled = {}
    for info, content in blocks:
        match = re.search(r'title="([^"]+)"', info)
        if match:
            titled[match.group(1)] = content
    assert set(titled) == {"docs/examples/dr_grpo.py", "docs/examples/dr_grpo.yaml", "docs/examples/steering.py",
                           "docs/examples/head_kl.py", "docs/examples/value_rows.py", "docs/examples/branching.py",
                           "docs/examples/group_filters.py", "docs/examples/sequence_clip.py",
                           "docs/examples/reward_parts.py"}
    for path, content in titled.items():
        assert content == (REPO / path).read_text(), f"docs/extending*.md is out of date with {path}"
    assert len((EXAMPLES / "dr_grpo.py").read_text().splitlines()) < 60
    # The command block is exactly the one the run test executes.
    assert [c.strip() for i, c in blocks if i == "bash"] == [COMMAND]
    # The untitled python snippet (a LossTerm callback) is valid and does what it says.
    snippets = [c for i, c in blocks if i == "python"]
    assert len(snippets) == 1
    namespace: dict = {}
    exec(compile(snippets[0], "extending.md", "exec"), namespace)  # noqa: S102
    callback = namespace["PositiveNLL"](coef=0.5)
    assert isinstance(callback, LossTerm)
    logprobs = torch.tensor([[-1.0, -2.0], [-3.0, 0.0]])
    term, stats = callback.loss_term(None, SimpleNamespace(rewards=torch.tensor([1.0, 0.0])), logprobs,
                                     torch.full((2, 2), 0.25))
    assert term.item() == pytest.approx(0.5 * 0.25 * 3.0)  # only row 0 (reward 1): 0.5 · 0.25 · (1 + 2)
    assert set(stats) == {"train/positive_nll"}


def test_the_documented_command_runs(tmp_path):
    env_part, *argv = shlex.split(COMMAND)
    key, value = env_part.split("=")
    assert (key, value) == ("PYTHONPATH", "docs/examples")
    assert argv[:3] == [".venv/bin/rl-lightning", "fit", "--config"]  # as the README writes it
    exe = Path(sys.executable).with_name("rl-lightning")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "rl_lightning"]
    command += [argv[1], argv[2], str(REPO / argv[3]), *TINY]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / value), str(REPO)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    acc = EventAccumulator(str(tmp_path / "runs" / "dr_grpo" / "version_0"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/reward")] == [0, 1]
    assert (tmp_path / "runs" / "dr_grpo" / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_dr_grpo_advantages_and_weights_on_a_hand_batch():
    module = _dr_grpo().DrGRPO(model_name_or_path="embedded:random")
    assert module.scale_rewards is False and module.loss_aggregation == "seq_mean_token_sum"
    with pytest.raises(RuntimeError, match="L_max is unknown"):
        module.loss_weights(None)
    module.check_datamodule(SimpleNamespace(group_size=2, sampling=Sampling(max_new_tokens=5)))  # L_max 5, T 4

    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])  # ragged, one empty row
    n, t = mask.shape
    batch = RolloutBatch(
        input_ids=torch.zeros(n, 2 + t, dtype=torch.long), attention_mask=torch.ones(n, 2 + t, dtype=torch.long),
        prompt_length=2, loss_mask=mask, sampler_logprobs=torch.full((n, t), -1.0) * mask,
        rewards=torch.tensor([1.0, 0.0, 0.5, 0.5]), group_size=2, prompt_index=torch.tensor([0, 0, 1, 1]),
        truncated=torch.zeros(n, dtype=torch.bool),
    )
    # Group means 0.5 and 0.5: A = R - mean_G = [0.5, -0.5, 0, 0] (GRPO's std scaling would give ±1).
    advantages = module.compute_advantages(batch)
    torch.testing.assert_close(advantages, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    # Weights mask / (N · L_max) = mask / 20, whatever the response lengths.
    weights = module.loss_weights(batch)
    torch.testing.assert_close(weights, mask.float() / 20)
    # On-policy (ρ = 1): loss = -Σ w A = -(3 · 0.5 + 1 · (-0.5)) / 20 = -0.05.
    out = PolicyOutput(logprobs=batch.sampler_logprobs.clone())
    loss, _ = module.policy_loss(batch, out, Advantages(advantages.unsqueeze(-1)), weights)
    assert loss.item() == pytest.approx(-0.05)


def test_the_head_kl_example_adds_the_sampler_head_kl_from_the_same_forward():
    from rl_lightning.envs import ArithmeticTask
    from rl_lightning.rollout import RolloutDataModule
    from tests.rollout.rollout_helpers import fake_trainer

    head_kl = _example("head_kl")
    torch.manual_seed(0)
    module = head_kl.HeadKL(model_name_or_path="embedded:random", head_kl_coef=0.5, baseline="batch_mean")
    with pytest.raises(ValueError, match="data.init_args.record.topk >= 1"):
        module.check_datamodule(SimpleNamespace(record=Recording(topk=0)))
    dm = RolloutDataModule(task=ArithmeticTask(num_heldout=4), prompts_per_step=2, group_size=2,
                           sampling=Sampling(max_new_tokens=4), record=Recording(topk=3))
    dm.trainer = fake_trainer(module)
    batch = dm.rollout(dm.prompt_batch(0))
    with torch.no_grad():
        for p in module.policy.parameters():  # the learner moves away from the sampler
            p.add_(0.1 * torch.randn_like(p))
    advantages, weights = Advantages(module.compute_advantages(batch).unsqueeze(-1)), module.loss_weights(batch)
    out = module.forward_policy(batch, extra_ids=module.extra_logprob_ids(batch))
    plain, _ = module.policy_loss(batch, out, advantages, weights)
    (term, stats), = module.extra_losses(batch, out, advantages, weights)
    loss = plain + term
    logits = module.policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=(batch.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits[:, batch.prompt_length - 1:-1], dim=-1).gather(-1, batch.record.topk_ids)
    q_log = batch.record.topk_logprobs
    want = 0.5 * ((q_log.exp() * (q_log - logp)).sum(-1) * batch.loss_mask * weights).sum()
    assert want.item() > 0  # the sampler's head KL is positive off-policy
    # the module's log-probs come from another forward (other shapes) of the same weights: within δ each, which
    # moves the term by 0.5 Σ w Σ_k q_k δ; plus the sums' rounding relative to the terms' size (n tokens x k ids)
    from tests.tolerances import decoder_logprob_tolerance, gamma

    hidden = module.forward_policy(batch, with_hidden=True).hidden[batch.loss_mask.bool()]
    delta = decoder_logprob_tolerance(module.policy, hidden, batch.temperature, batch.input_ids.shape[1])
    mass = float(0.5 * (q_log.exp().sum(-1) * batch.loss_mask * weights).sum())
    terms = float(0.5 * ((q_log.exp() * (q_log - logp).abs()).sum(-1) * batch.loss_mask * weights).sum())
    tol = mass * delta + 2 * gamma(batch.loss_mask.numel() * 4) * terms
    assert abs(stats["train/head_kl_loss"].value.item() - want.item()) <= tol
    plain_size = float((out.logprobs.detach() * weights).abs().sum())  # the policy loss it is added to
    assert abs((loss - plain).item() - want.item()) <= tol + 2 * gamma(2) * (plain_size + terms)
    assert module.inert_rows(batch, advantages) is None  # its KL term reaches zero-advantage rows too


def test_the_countdown_environment_runs_as_multi_turn_episodes():
    from rl_lightning.algorithms import GRPO
    from rl_lightning.rollout import GroupRollout, RolloutDataModule
    from tests.rollout.rollout_helpers import fake_trainer

    steering = _example("steering")
    env = steering.CountdownEnv(42)
    assert env.reset() == ("42:", {})
    assert env.step("41") == ("41:", 1.0, False, False, {})
    assert env.step("x")[1:3] == (0.0, False) and env.step("39")[1:3] == (1.0, True)
    task = steering.CountdownTask()
    assert {p.text for p in task.heldout_prompts()}.isdisjoint(task.train_prompt(i).text for i in range(500))
    module = GRPO(model_name_or_path="embedded:random")
    dm = RolloutDataModule(task=task, prompts_per_step=2, group_size=2, strategy=GroupRollout(max_turns=3),
                           sampling=Sampling(max_new_tokens=3))
    dm.trainer = fake_trainer(module)
    batch = dm.rollout(dm.prompt_batch(0))
    assert (batch.turns.count == 3).all() and batch.turns.obs_mask.sum() > 0


def test_prioritized_grpo_draws_the_prompts_it_fails_more_often(tmp_path):
    from rl_lightning.rollout import RolloutDataModule, WeightedSampler
    from tests.conftest import tiny_trainer
    from rl_lightning.envs import ArithmeticTask

    steering = _example("steering")
    module = steering.PrioritizedGRPO(model_name_or_path="embedded:arithmetic", floor=0.01)
    sampler = WeightedSampler(pool_size=8, replacement=True)
    dm = RolloutDataModule(task=ArithmeticTask(num_heldout=4), prompts_per_step=4, group_size=4,
                           prompt_sampler=sampler, sampling=Sampling(max_new_tokens=4))
    tiny_trainer(tmp_path, max_steps=3).fit(module, datamodule=dm)
    assert sampler.weight_fn == module.prompt_weights and module.success
    pool = sampler.pool(dm.task)
    weights = module.prompt_weights(pool)
    for prompt, weight in zip(pool, weights.tolist()):  # weight = 1 - running success + floor
        assert weight == pytest.approx(1.0 - module.success.get(prompt.uid, 0.0) + 0.01)
    with pytest.raises(ValueError, match="PrioritizedGRPO weights the prompts it draws .*prompt_sampler must"):
        RolloutDataModule(task=ArithmeticTask(num_heldout=4)).take_inputs(module.rollout_inputs(), "PrioritizedGRPO")


class _Capture(Callback):
    """Keeps each step's rollout batch and logged metrics."""

    def __init__(self) -> None:
        self.batches: list = []
        self.metrics: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        self.batches.append(batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _value_rows_step(tmp_path, **kwargs):
    from rl_lightning.algorithms import GRPO
    from tests.conftest import tiny_datamodule, tiny_trainer
    from tests.helpers.ddp_run import GradedMatch

    value_rows = _example("value_rows")
    torch.manual_seed(0)
    cls = value_rows.ValueRowsGRPO if kwargs.pop("aux", True) else GRPO
    module = cls(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
                 max_grad_norm=None, **kwargs)
    capture = _Capture()
    tiny_trainer(tmp_path, max_steps=1, callbacks=[capture]).fit(
        module, datamodule=tiny_datamodule(temperature=1.5, reward_fn=GradedMatch()))
    return module, capture


def test_auxiliary_rows_join_the_same_update_with_their_own_loss(tmp_path):
    """One SGD(lr = 1) step of ``ValueRowsGRPO`` moves the weights by minus the gradient of GRPO's loss plus the
    value-token term, the term computed here independently (``candidate_logprobs`` of the grid digit after each
    group's prompt + query); the term is logged, included in ``train/loss``, and micro-batching leaves it as is."""
    from rl_lightning.algorithms import GRPO, Advantages
    from tests.tolerances import decoder_gradient_tolerance, decoder_logprob_bound, unit_roundoff

    module, capture = _value_rows_step(tmp_path, value_coef=0.5)
    (batch,), (logged,) = capture.batches, capture.metrics
    torch.manual_seed(0)
    fresh = GRPO(model_name_or_path="embedded:arithmetic")
    start = {k: v.detach().clone() for k, v in fresh.policy.named_parameters()}
    adv = Advantages(fresh.compute_advantages(batch).reshape(batch.num_rows, -1))
    main, _ = fresh.policy_loss(batch, fresh.forward_policy(batch), adv, fresh.loss_weights(batch))
    tok, g, p = fresh.tokenizer, batch.group_size, batch.prompt_length
    query = tok(" V:", add_special_tokens=False)["input_ids"]
    contexts = [batch.input_ids[k, :p][batch.attention_mask[k, :p].bool()].tolist() + query
                for k in range(0, batch.num_rows, g)]
    means = batch.rewards.view(-1, g).mean(dim=1).clamp(0, 1)
    digits = torch.tensor([[tok(str(round(float(m) * 9)), add_special_tokens=False)["input_ids"][0]]
                           for m in means])
    value_term = 0.5 * -fresh.candidate_logprobs(contexts, digits).mean()  # token mean: one target per group
    (main + value_term).backward()
    config = fresh.policy.config
    scale = max(float(q.grad.abs().max()) for q in fresh.policy.parameters())
    atol = float(decoder_gradient_tolerance(config, config.max_position_embeddings,
                                            20 * config.max_position_embeddings, scale))
    for name, param in module.policy.named_parameters():
        want = start[name] - dict(fresh.policy.named_parameters())[name].grad
        torch.testing.assert_close(param.detach(), want, atol=atol, rtol=2 * unit_roundoff())
    # the value rows really moved the weights: without them the step differs by far more than the tolerance
    plain, _ = _value_rows_step(tmp_path, aux=False)
    gap = max(float((a - b).detach().abs().max())
              for a, b in zip(plain.policy.parameters(), module.policy.parameters()))
    assert gap > 100 * atol
    tol = 4 * decoder_logprob_bound(fresh.policy, 1.0, config.max_position_embeddings)
    assert logged["train/value_token_loss"] == pytest.approx(float(value_term), abs=tol)
    assert logged["train/loss"] == pytest.approx(logged["train/policy_loss"] + logged["train/value_token_loss"],
                                                 abs=1e-6)
    # split into micro-batches of one row (the value rows too): the same step
    split, _ = _value_rows_step(tmp_path, value_coef=0.5, micro_batch_size=1)
    for a, b in zip(split.policy.parameters(), module.policy.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), atol=atol, rtol=2 * unit_roundoff())


def test_the_branching_example_continues_from_stored_end_states(tmp_path):
    from rl_lightning.envs import GuessNumberTask
    from rl_lightning.rollout import BranchRollout, RolloutDataModule
    from tests.conftest import tiny_trainer

    branching = _example("branching")
    module = branching.ReplayGRPO(model_name_or_path="embedded:guess", replay=2, horizon=2)
    with pytest.raises(ValueError, match="ReplayGRPO sets where its rollouts start .* must be a .*BranchRollout"):
        RolloutDataModule(task=GuessNumberTask(), group_size=4).take_inputs(module.rollout_inputs(), "ReplayGRPO")
    dm = RolloutDataModule(task=GuessNumberTask(), prompts_per_step=2, group_size=4,
                           strategy=BranchRollout(n=4, max_turns=5, max_episode_tokens=32),
                           sampling=Sampling(max_new_tokens=3))
    capture = _Capture()
    tiny_trainer(tmp_path, max_steps=3, callbacks=[capture]).fit(module, datamodule=dm)
    first, second, _ = capture.batches
    assert first.num_rows == 8 and second.num_rows == 16 and second.group_size == 4  # 2 fresh + 2 replayed
    assert (first.turns.count <= 2).all()  # the horizon, not the strategy's 5 turns
    tok, p = module.tokenizer, second.prompt_length
    fresh = len(tok("guess 1-31:", add_special_tokens=False)["input_ids"]) + 1  # BOS + the first observation
    context = second.attention_mask[:, :p].sum(dim=1)
    assert (context[:8] == fresh).all() and (context[8:] > fresh).all()  # replayed rows carry their prefix
    assert (context[8:] + (second.loss_mask | second.turns.obs_mask).sum(dim=1)[8:] <= fresh + 32).all()  # the budget
    stored = module.store.items[-1]
    assert stored.max_turns == 2 and stored.env_state is not None and len(module.store) > 2
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / "c.ckpt")
    again = branching.ReplayGRPO(model_name_or_path="embedded:guess")
    again.on_load_checkpoint(torch.load(tmp_path / "c.ckpt", weights_only=True))
    assert again.store.items == module.store.items


def test_the_group_filter_and_reward_shaper_example_run_and_compute_what_they_say(tmp_path):
    """docs/examples/group_filters.py: MixedAccuracy on a hand batch, then both in a 2-step fit (the filter keeps
    only mixed groups when enough exist; the shaper's term is bonus x the unused budget share)."""
    from rl_lightning.algorithms import GRPO
    from tests.conftest import RecordRollouts, tiny_datamodule, tiny_trainer

    example = _example("group_filters")
    batch = SimpleNamespace(rewards=torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), group_size=2)
    assert example.MixedAccuracy(0.0, 1.0).keep(batch).tolist() == [False, True, False]
    shaper = example.BrevityBonus(bonus=0.2)
    shaper.bind(SimpleNamespace(sampling=Sampling(max_new_tokens=4)))
    shaped = shaper.term(SimpleNamespace(loss_mask=torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]]),
                                         rewards=torch.zeros(2)))
    assert shaped.tolist() == pytest.approx([0.15, 0.0])  # 0.2 x (1 - 1/4), 0.2 x (1 - 4/4)
    record = RecordRollouts()
    data = tiny_datamodule(group_filter=example.MixedAccuracy(), max_rounds=2, temperature=1.5,
                           reward_shapers=[example.BrevityBonus(bonus=0.1)])
    tiny_trainer(tmp_path, max_steps=2, callbacks=[record]).fit(GRPO(model_name_or_path="embedded:arithmetic"),
                                                              datamodule=data)
    assert len(record.rewards) == 2 and all(r.numel() == 16 for r in record.rewards)
    assert all(r.max() <= 1.1 and r.min() >= 0.0 for r in record.rewards)  # task reward 0 or 1, plus up to 0.1


def test_the_sequence_level_example_equals_the_library_gspo():
    """docs/examples/sequence_clip.py on two responses: token ratios 2 and 0.5 (s = 1) and 1.0005 twice
    (s = 1.0005, outside [1 - 3e-4, 1 + 4e-4]): the same objective and gradient as rl_lightning's GSPO, and
    not GRPO's (which clips the first response's ratio-2 token)."""
    import math

    from rl_lightning.algorithms import GRPO, GSPO
    from rl_lightning.algorithms.forward import PolicyOutput

    mine = _example("sequence_clip").SequenceClipGRPO(model_name_or_path="embedded:random")
    sampler = torch.log(torch.tensor([[0.25, 0.5], [0.5, 0.5]]))
    mask = torch.ones(2, 2, dtype=torch.long)
    batch = RolloutBatch(input_ids=torch.ones(2, 4, dtype=torch.long),
                         attention_mask=torch.ones(2, 4, dtype=torch.long),
                         prompt_length=2, loss_mask=mask, sampler_logprobs=sampler, rewards=torch.zeros(2),
                         group_size=2, prompt_index=torch.zeros(2, dtype=torch.long),
                         truncated=torch.zeros(2, dtype=torch.bool))
    learner = torch.log(torch.tensor([[0.5, 0.25], [0.5 * 1.0005, 0.5 * 1.0005]]))
    adv = Advantages(torch.tensor([[1.0], [1.0]]))

    def run(module):  # noqa: ANN001, ANN202
        logp = learner.clone().requires_grad_(True)
        out = PolicyOutput(logprobs=logp)
        ratio = torch.exp(logp - sampler)
        objective, _ = module.policy_objective(batch, out, ratio, adv)
        (objective * mask / 4).sum().backward()  # seq_mean_token_mean weights: 1 / (N T_i)
        return objective.detach(), logp.grad

    got, want = run(mine), run(GSPO(model_name_or_path="embedded:random"))
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert got[0][0].tolist() == pytest.approx([1.0, 1.0]) and got[1][1].abs().sum() == 0  # row 1 clipped
    grpo, _ = run(GRPO(model_name_or_path="embedded:random"))
    assert grpo[0, 0].item() == pytest.approx(1.2) and not math.isclose(grpo[0, 0].item(), got[0][0, 0].item())


def test_the_reward_parts_example_logs_each_part_and_trains_on_their_combination(tmp_path):
    """docs/examples/reward_parts.py: on hand responses, then in a 2-step fit where ``train/reward`` is the mean of
    ``correct * (1 + 0.5 brief)`` and each part is logged (every value a multiple of 1/32: exact sums)."""
    from rl_lightning.algorithms import GRPO
    from rl_lightning.envs import Prompt, score_parts
    from tests.conftest import tiny_datamodule, tiny_trainer

    reward = _example("reward_parts").CorrectAndBrief(bonus=0.5, max_chars=2)
    assert score_parts(reward, Prompt("1+1=", "2"), "2") == (1.5, {"correct": 1.0, "brief": 1.0})
    assert score_parts(reward, Prompt("1+1=", "2"), "222") == (0.0, {"correct": 0.0, "brief": 0.0})
    record = RecordBatches()
    tiny_trainer(tmp_path, max_steps=2, callbacks=[record]).fit(GRPO(model_name_or_path="embedded:arithmetic"),
                                                              datamodule=tiny_datamodule(reward_fn=reward))
    for metrics, batch in zip(record.metrics, record.batches):
        correct, brief = batch.extras["reward/correct"], batch.extras["reward/brief"]
        assert torch.equal(batch.rewards, correct * (1 + 0.5 * brief))
        assert metrics["train/reward/correct"] == float(correct.mean())
        assert metrics["train/reward/brief"] == float(brief.mean())


def test_the_one_page_path_stays_one_page():
    """extending.md: the eight hooks a method author needs (the rest under extending_advanced.md), under 400 lines."""
    text = DOC.read_text()
    table = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(table) <= 8 and len(text.splitlines()) < 400
    assert "extending_advanced.md" in text
