"""CoPE (no public paper: docs/algorithms.md, CoPE) on real guess-the-number episodes: the forecast targets, the AF
term's value and gradient, η = 0 = GRPO, split invariance, a short fit, the config and the refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rl_lightning.algorithms import Advantages, CoPE, GRPO
from rl_lightning.envs import GuessNumberTask
from rl_lightning.functional import forecast_pairs
from rl_lightning.rollout import Evaluation, GroupRollout, RolloutBatch, RolloutDataModule, Sampling
from tests.conftest import REPO, tiny_datamodule, tiny_trainer
from tests.rollout.rollout_helpers import FP32_UNIT_ROUNDOFF as U
from tests.rollout.rollout_helpers import fake_trainer, model_logprob_tolerance

GUESS = dict(task=GuessNumberTask(), prompts_per_step=4, group_size=4, sampling=Sampling(max_new_tokens=3),
             strategy=GroupRollout(max_turns=5, max_episode_tokens=32), evaluation=Evaluation(batch_size=31), seed=0)


def make(cls: type = CoPE, **kwargs) -> GRPO:
    return cls(model_name_or_path="embedded:guess", **kwargs)


@pytest.fixture(scope="module")
def episodes() -> RolloutBatch:
    """16 real episodes (4 secrets x 4) sampled from the guess warm start, as the data module makes them."""
    torch.manual_seed(0)
    sampler = make(GRPO)
    dm = RolloutDataModule(**GUESS)
    dm.trainer = fake_trainer(sampler)
    batch = dm.rollout(dm.prompt_batch(0))
    assert batch.turns.index is not None and (batch.turns.count >= 3).sum() >= 8  # real multi-turn episodes
    return batch


def with_rewards(batch: RolloutBatch, rewards: list[float]) -> RolloutBatch:
    return dataclasses.replace(batch, rewards=torch.tensor(rewards, dtype=torch.float32), extras={})


def reference_pairs(batch: RolloutBatch, row: int, instruction: list[int], k: int) -> list[tuple[list, list]]:
    """The pairs by a plain loop over the row's turns (the test's own reading of the method)."""
    p, n = batch.prompt_length, int(batch.turns.count[row])
    real = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()  # the whole trajectory, no padding
    lead = int((batch.attention_mask[row, :p] == 0).sum())  # left padding of the prompt
    actions = [(batch.turns.index[row] == t).nonzero().flatten() for t in range(n)]
    pairs = []
    for t in range(n):
        target = sum((batch.response_ids[row, actions[j]].tolist() for j in range(t, min(t + k, n))), [])
        pairs.append((real[:p - lead + int(actions[t][0])] + instruction, target))
    return pairs


def advantages(module: GRPO, batch: RolloutBatch) -> Advantages:
    """``compute_advantages`` as ``RLModule.training_step`` takes it: an ``Advantages`` with ``[N, 1]`` advantages."""
    adv = module.compute_advantages(batch)
    adv = adv if isinstance(adv, Advantages) else Advantages(adv)
    return dataclasses.replace(adv, advantages=adv.advantages.detach().reshape(batch.num_rows, -1))


def gradients(module: GRPO, batch: RolloutBatch, splits: list[torch.Tensor]) -> list[torch.Tensor]:
    """The flat gradient of each split, computed as ``RLModule.update`` does (advantages and weights once per
    rollout batch, the weights scaled by ``num_minibatches``; each split's rows selected, scored and
    back-propagated on their own, ``policy_loss`` plus the ``extra_losses``)."""
    adv = advantages(module, batch)
    weights = module.loss_weights(batch) * module.num_minibatches
    grads = []
    for rows in splits:
        module.policy.zero_grad(set_to_none=False)
        mb, mb_adv = batch.select(rows), adv.select(rows)
        out = module.forward_policy(mb)
        loss, _ = module.policy_loss(mb, out, mb_adv, weights[rows])
        for term, _ in module.extra_losses(mb, out, mb_adv, weights[rows]):
            loss = loss + term
        loss.backward()
        grads.append(torch.cat([p.grad.flatten().clone() for p in module.policy.parameters()]))
    return grads


def rounding_bound(module: GRPO, per_row_abs: torch.Tensor, length: int, terms: int) -> torch.Tensor:
    """Float32 rounding bound of a gradient summed from row contributions computed in other shapes.

    Each row's gradient goes through a forward and a backward whose reductions in series have total length
    ``depth`` each (as in ``rollout_helpers.fp32_logprob_tolerance``: per layer 4 hidden-size projections, the
    MLP, the attention scores and the two context-length sums; then the final norm and the head), so it
    carries a relative rounding error of about ``sqrt(2 · depth) · u``; two computations round independently
    (``x 2``); summing ``terms`` contributions adds at most ``terms · u`` of ``Σ |g_r|`` (worst-case order)."""
    cfg = module.policy.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    depth = cfg.num_hidden_layers * (4 * cfg.hidden_size + cfg.intermediate_size + head_dim + 2 * length)
    depth += 2 * cfg.hidden_size
    return 2 * (math.sqrt(2 * depth) + terms) * U * per_row_abs


def test_the_targets_are_the_recorded_action_ids_after_exactly_the_history(episodes):
    module = make()
    instruction = module.instruction_ids
    assert module.tokenizer.decode(instruction) == "forecast:"
    checked_truncation = 0
    for row in range(episodes.num_rows):
        n = int(episodes.turns.count[row])
        turns = episodes.turns.index[row]
        pairs = forecast_pairs(episodes.input_ids[row], episodes.attention_mask[row], episodes.prompt_length,
                               episodes.loss_mask[row], turns, instruction, horizon=2)
        assert pairs == reference_pairs(episodes, row, instruction, k=2)
        assert len(pairs) == n
        for t, (context, target) in enumerate(pairs):
            first = int((turns == t).nonzero()[0])
            assert context[-len(instruction):] == instruction
            history = context[:-len(instruction)]
            # h_t: the real prompt ids, then the response up to action t's first id (actions and observations)
            prompt = episodes.input_ids[row, :episodes.prompt_length][episodes.attention_mask[row,
                                                                      :episodes.prompt_length].bool()]
            assert history == prompt.tolist() + episodes.response_ids[row, :first].tolist()
            if t > 0:
                assert episodes.turns.obs_mask[row, first - 1] == 1  # h_t ends with the observation o_t
            own = episodes.response_ids[row, turns == t].tolist()
            assert target[:len(own)] == own
            if t + 1 < n:
                assert target == own + episodes.response_ids[row, turns == t + 1].tolist()
            else:  # the last action: truncated to a 1-action chunk
                assert target == own
                checked_truncation += 1
            assert module.tokenizer.pad_token_id not in target
    assert checked_truncation == episodes.num_rows


def test_without_instruction_and_k_1_the_pairs_score_exactly_the_sampled_actions(episodes):
    """The model itself checks the contexts: after ``h_t`` (no instruction), action ``t``'s ids get the log-probs
    the sampler recorded while acting -- a context one token off would change them by O(0.1)."""
    module = make(GRPO)
    contexts, targets, where = [], [], []
    for row in range(episodes.num_rows):
        for t, (context, target) in enumerate(forecast_pairs(
                episodes.input_ids[row], episodes.attention_mask[row], episodes.prompt_length,
                episodes.loss_mask[row], episodes.turns.index[row], [], horizon=1)):
            contexts.append(context)
            targets.append(target)
            where.append(episodes.turns.index[row] == t)
    with torch.no_grad():
        out, mask = module.score_sequences(contexts, targets, temperature=episodes.temperature)
        hidden = module.forward_policy(episodes, with_hidden=True).hidden[episodes.loss_mask.bool()]
    rows = torch.tensor([row for row in range(episodes.num_rows) for _ in range(int(episodes.turns.count[row]))])
    tol = model_logprob_tolerance(module.policy, hidden, episodes.temperature,
                                  module.policy.config.max_position_embeddings)
    for i, (row, positions) in enumerate(zip(rows.tolist(), where)):
        recorded = episodes.sampler_logprobs[row, positions]
        assert (out.logprobs[i, mask[i].bool()] - recorded).abs().max() <= tol


def test_zero_success_gives_zero_forecast_loss_and_grpos_gradient_exactly(episodes):
    batch = with_rewards(episodes, [0.0] * 8 + [0.5] * 8)  # 0.5 < success_threshold 1.0: no success anywhere
    cope, grpo = make(forecast_coef=0.1), make(GRPO)
    full = [torch.arange(16)]
    (g_cope,), (g_grpo,) = gradients(cope, batch, full), gradients(grpo, batch, full)
    adv = advantages(cope, batch)
    assert (adv.rows["forecast_weight"] == 0).all()
    assert cope.forecast_term(batch, adv).item() == 0.0
    assert torch.equal(g_cope, g_grpo)


def test_eta_zero_reproduces_grpos_gradient_exactly(episodes):
    batch = with_rewards(episodes, [1, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0])
    full = [torch.arange(16)]
    (g_cope,), (g_grpo,) = gradients(make(forecast_coef=0.0), batch, full), gradients(make(GRPO), batch, full)
    assert torch.equal(g_cope, g_grpo)


def test_two_successes_give_the_mean_of_their_two_nll_sums(episodes):
    rewards = [1.0, 0.0, 1.0, 0.0] + [0.0] * 12  # S = {rows 0, 2} for the first prompt, no success elsewhere
    batch = with_rewards(episodes, rewards)
    eta = 0.5
    # one forward per loss term (no shared prompt forward, whose prefix and response parts are two gradient
    # contributions of their own): the bound below counts a single addition between g_GRPO and g_ref
    cope, grpo = make(forecast_coef=eta, share_prompt_forward=False), make(GRPO, share_prompt_forward=False)
    assert episodes.turns.count[0] >= 2 and episodes.turns.count[2] >= 2  # chunks of 2 actions really occur
    (g_cope,) = gradients(cope, batch, [torch.arange(16)])
    (g_grpo,) = gradients(grpo, batch, [torch.arange(16)])
    value = cope.forecast_term(batch, advantages(cope, batch))  # the weights compute_advantages returns
    # by hand: score each pair of rows 0 and 2 with score_sequences, sum each row's NLL, average the two, / X
    pairs = [pair for row in (0, 2) for pair in reference_pairs(episodes, row, cope.instruction_ids, 2)]
    owner = torch.tensor([0] * int(episodes.turns.count[0]) + [2] * int(episodes.turns.count[2]))
    cope.policy.zero_grad(set_to_none=False)
    out, mask = cope.score_sequences([c for c, _ in pairs], [t for _, t in pairs])
    nll_per_pair = -(out.logprobs * mask).sum(dim=1)
    nll_0, nll_2 = nll_per_pair[owner == 0].sum(), nll_per_pair[owner == 2].sum()
    expected = eta * (nll_0 + nll_2) / 2 / 4  # mean over |S| = 2, then E_x over the 4 prompts
    expected.backward()
    g_ref = torch.cat([p.grad.flatten().clone() for p in cope.policy.parameters()])
    terms = int(mask.sum())
    token_terms = (out.logprobs * mask).detach().abs().sum().item() * eta / 8
    assert abs(value.item() - expected.item()) <= 2 * terms * U * token_terms  # two summation orders
    # the AF part of CoPE's gradient is the hand loss's gradient: g_CoPE = g_GRPO + g_ref up to one addition
    bound = 2 * U * (g_grpo.abs() + g_ref.abs()) + 2 * U * g_cope.abs()
    assert ((g_cope - g_grpo) - g_ref).abs().le(bound).all()
    assert g_ref.abs().max() > 1e3 * bound.max()  # the check separates the AF gradient from rounding


@pytest.mark.parametrize("num_minibatches", [1, 2])
def test_the_gradient_does_not_depend_on_the_split(episodes, num_minibatches):
    batch = with_rewards(episodes, [1, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0])
    # the per-entry bound sums per-row gradients: every row forwarded on its own (a shared prompt forward sums a
    # group's rows inside the backward, whose rounding is bounded relative to max|grad|: test_shared_prefix)
    plain = {"share_prompt_forward": False}
    (reference,) = gradients(make(forecast_coef=0.1, **plain), batch, [torch.arange(16)])  # one step, whole batch
    module = make(forecast_coef=0.1, num_minibatches=num_minibatches, **plain)
    rows = torch.randperm(16, generator=torch.Generator().manual_seed(3))
    halves = list(rows.chunk(num_minibatches))  # each is one optimiser step, at full-batch scale
    singles = gradients(module, batch, [r.reshape(1) for r in rows])  # micro_batch_size = 1
    splits = {
        "minibatches": sum(gradients(module, batch, [h])[0] for h in halves) / num_minibatches,
        "micro_batch_size=1": sum(singles) / num_minibatches,
        "micro_batch_size=3": sum(gradients(module, batch, list(rows.split(3)))) / num_minibatches,
    }
    per_row_abs = sum(g.abs() for g in singles) / num_minibatches
    bound = rounding_bound(module, per_row_abs, module.policy.config.max_position_embeddings, terms=16)
    for name, gradient in splits.items():
        assert (gradient - reference).abs().le(bound).all(), name
    (grpo,) = gradients(make(GRPO, **plain), batch, [torch.arange(16)])
    forecast_part = reference - grpo
    assert forecast_part.abs().max() > 100 * bound.max()  # a missing 1/2 (or x 2) on the AF part would show


def test_under_data_parallelism_the_mean_is_over_every_ranks_prompts(episodes):
    """Two ranks holding 2 prompts each: the weights use X = 4 (the reduced count) and are scaled by the world
    size to cancel DDP's gradient averaging, so ``(rank 0 + rank 1) / 2`` is the single-process loss."""
    from types import SimpleNamespace

    batch = with_rewards(episodes, [1, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0])
    single = make().compute_advantages(batch).rows["forecast_weight"]
    ranked = make()
    ranked._trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace(reduce=lambda t, reduce_op: t * 2))
    for rows in (torch.arange(8), torch.arange(8, 16)):
        part = batch.select(rows)  # whole groups: group_size stays 4
        assert torch.equal(ranked.compute_advantages(part).rows["forecast_weight"] / 2, single[rows])


def test_a_short_fit_on_guess_logs_the_forecast_metrics(tmp_path, recorder):
    module = make(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    before = [p.detach().clone() for p in module.policy.parameters()]
    tiny_trainer(tmp_path, max_steps=2, callbacks=[recorder]).fit(module, datamodule=RolloutDataModule(**GUESS))
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))
    for metrics, rewards in zip(recorder.metrics, recorder.rewards):
        assert metrics["train/success_fraction"] == pytest.approx(float((rewards >= 1.0).float().mean()))
        assert (metrics["train/forecast_loss"] > 0) == bool((rewards >= 1.0).any())


def test_single_turn_responses_are_one_action(tmp_path, recorder):
    module = CoPE(model_name_or_path="embedded:arithmetic")
    tiny_trainer(tmp_path, max_steps=1, callbacks=[recorder]).fit(module, datamodule=tiny_datamodule())
    assert recorder.metrics[0]["train/success_fraction"] > 0 and recorder.metrics[0]["train/forecast_loss"] > 0


def test_bad_settings_are_refused(episodes):
    with pytest.raises(ValueError, match=r"'é' map to the unknown token"):
        make(forecast_instruction="plan é:")
    with pytest.raises(ValueError, match="no tokens"):
        make(forecast_instruction="")
    with pytest.raises(ValueError, match="forecast_horizon"):
        make(forecast_horizon=0)
    long = make(forecast_instruction="x" * 40)
    with pytest.raises(ValueError, match="64 positions"):
        gradients(long, with_rewards(episodes, [1.0] * 16), [torch.arange(16)])


def test_the_config_stacks_with_the_guess_preset(tmp_path, monkeypatch):
    from rl_lightning.cli import build_cli

    monkeypatch.chdir(tmp_path)
    cli = build_cli(["--config", str(REPO / "configs" / "cope.yaml"), "--config",
                     str(REPO / "configs" / "tasks" / "guess.yaml"), f"--trainer.default_root_dir={tmp_path}"],
                    run=False)
    assert isinstance(cli.model, CoPE) and isinstance(cli.datamodule.task, GuessNumberTask)
    assert (cli.model.forecast_coef, cli.model.forecast_horizon, cli.model.success_threshold) == (0.001, 2, 1.0)
    assert cli.model.hparams.model_name_or_path == "embedded:guess"
    assert cli.config.trainer.logger.init_args.name == "guess"  # the task preset names its runs (runs/guess)
