"""The shared prompt forward (issue 14, item 1): a prompt that several rows share runs once, in the update and in
generation's prefill, with the same result as the plain path.

* ``forward.shared_prompt_forward`` (``RLModule.forward_policy``): log-probs, entropies and hidden states, and in
  ``update`` the loss and every parameter's gradient, equal those of one forward of every row -- for GRPO and PPO (whose
  shared critic reads the hidden states), on the embedded Llama and on GPT-2 (learned absolute positions, fused
  q/k/v, another cache code path; Qwen2 too at the forward level), for whole-batch and odd micro-batches, with and
  without length bucketing, with shuffled minibatches, and on batches where some groups do not share a prompt.
* It switches itself off where it cannot be exact: prompts that differ within a group (detected from the ids, as
  multi-turn episodes whose first observation depends on the episode's seed), dropout in training mode, gradient
  checkpointing, a sliding-window cache, a non-Hugging-Face model, or a saving below ``share_prompt_min_tokens``.
* ``generation.sample`` with ``share_prefill`` draws the same tokens with the same generator, and the same
  log-probs to float rounding.

Tolerance: both paths compute the same sums -- over a group's rows, of every row's contributions to each
gradient entry -- in another order (the rows of a group meet in the index's backward instead of in the weight
gradient's matrix product) and with matrix products of other shapes, so they differ by float32 rounding only: each
is within its rounding error of the exact value, and so within the sum of the two errors of the other. The tests
measure that error rather than guess it: the plain path's distance to the same update in float64 (``_reference``;
its log-softmax stage stays float32, so this over- rather than under-estimates), and allow the shared path twice
that distance from the plain path, plus 2^-24 of the largest entry (``_tolerance``). A bug (a wrong position,
mask or row) moves the gradient by a sizeable fraction of its largest entry, so the derived tolerance is checked
to stay below 1e-4 of it (measured: the plain path is up to 4e-5 of max|grad| from float64 here, the most on
the multi-turn batch, whose gradient cancels most; the shared path is within 2e-5 of the plain one).
Log-probs, entropies and hidden states: the float32 bounds of ``tests/tolerances.py`` (``decoder_logprob_tolerance``
for the log-probs, propagated to the entropy; ``2 sqrt(K) u`` of the largest hidden entry, ``K`` the decoder's
reduction depth); the update's logged metrics as in ``test_skipping._metric_tolerances`` (relative to the size of
their terms: the loss cancels).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

import rl_lightning.algorithms.forward as forward
from rl_lightning.algorithms import GRPO, PPO
from rl_lightning.algorithms.planning import prompt_blocks
from rl_lightning.envs import Prompt, Task
from rl_lightning.rollout import GroupRollout, KVCacheEngine, RolloutBatch, RolloutDataModule, SamplingParams, sample
from rl_lightning.rollout.generation import DecodeOptions
from rl_lightning.rollout.generation import can_share_prompts, distinct_rows
from rl_lightning.rollout import Sampling
from tests.algorithms.test_skipping import _advantages, _Capture, _metric_tolerances, _off_policy, _plan
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.rollout.rollout_helpers import ScriptedLM, fake_trainer
from tests.rollout.test_episodes import CountdownEnv, CountdownTask
from tests.tolerances import (
    decoder_depth, decoder_gradient_tolerance, decoder_logprob_bound, decoder_logprob_tolerance, gamma,
    gamma_probabilistic, unit_roundoff,
)

BUG_SCALE = 1e-4  # relative to max |grad|: the derived tolerance must stay below it, see the module docstring
G = 4
#: response lengths of the hand batch (4 groups of 4; width 8): very different within every group
LENGTHS = [8, 1, 5, 3, 2, 7, 1, 6, 4, 8, 2, 1, 6, 3, 8, 5]
PROMPTS = [3, 6, 4, 5]  # real prompt tokens of each group (left-padded to 6)
SPREAD = [1.0, 0.0, 0.0, 1.0, 0.75, 0.0, 1.0, 0.5, 0.0, 1.0, 0.25, 0.0, 1.0, 0.0, 0.5, 1.0]


def _batch(vocab: int, per_row: tuple[int, ...] = (), prompt: int = 6, lengths: list[int] = LENGTHS,
           width: int = 8, prompts: list[int] = PROMPTS) -> RolloutBatch:
    """4 groups of 4 rows; a group's rows share its (left-padded) prompt, except the groups in ``per_row``, whose
    rows each get their own prompt of the group's length (e.g. a first observation that depends on the seed)."""
    n = len(lengths)
    gen = torch.Generator().manual_seed(0)
    group_prompts = torch.randint(3, vocab, (n // G, prompt), generator=gen)
    row_prompts = group_prompts.repeat_interleave(G, 0)
    for g in per_row:
        row_prompts[g * G:(g + 1) * G] = torch.randint(3, vocab, (G, prompt), generator=gen)
    real = torch.tensor([prompts[i // G % len(prompts)] for i in range(n)])
    prompt_mask = (torch.arange(prompt)[None] >= prompt - real[:, None]).long()
    loss_mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    response = torch.randint(3, vocab, (n, width), generator=gen)
    attention = torch.cat([prompt_mask, loss_mask], dim=1)
    return RolloutBatch(
        input_ids=torch.cat([row_prompts, response], dim=1) * attention, attention_mask=attention,
        prompt_length=prompt, loss_mask=loss_mask, sampler_logprobs=torch.zeros(n, width),
        rewards=torch.tensor(SPREAD[:n]), group_size=G, prompt_index=torch.arange(n) // G,
        truncated=torch.zeros(n, dtype=torch.bool), prompt_id=torch.arange(n) // G,
    )


def _gpt2(vocab: int, **overrides) -> GPT2LMHeadModel:  # noqa: ANN003
    config = dict(vocab_size=vocab, n_positions=64, n_embd=128, n_layer=2, n_head=4, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(1)
    return GPT2LMHeadModel(GPT2Config(**{**config, **overrides})).train()


def _qwen2(vocab: int, **overrides) -> Qwen2ForCausalLM:  # noqa: ANN003
    config = dict(vocab_size=vocab, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=256, max_position_embeddings=64, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    torch.manual_seed(2)
    return Qwen2ForCausalLM(Qwen2Config(**{**config, **overrides})).train()


def _module(cls: type, arch: str, **kwargs):  # noqa: ANN003, ANN202
    torch.manual_seed(0)
    extra = {"critic": "shared"} if cls is PPO else {}
    module = cls(model_name_or_path="embedded:arithmetic" if arch == "llama" else "embedded:random",
                 max_grad_norm=None, **extra, **kwargs)
    vocab = len(module.tokenizer)
    if arch == "gpt2":
        module.policy = _gpt2(vocab)
    elif arch == "qwen2":
        module.policy = _qwen2(vocab)
    module.share_prompt_min_tokens = 1  # share in the small micro-batches of these tests too
    return module


class _Counter:
    """Wraps ``forward.shared_prompt_forward``: how many forwards shared their prompts."""

    def __init__(self, monkeypatch) -> None:  # noqa: ANN001
        self.shared = self.plain = 0
        inner = forward.shared_prompt_forward

        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out = inner(*args, **kwargs)
            self.shared, self.plain = self.shared + (out is not None), self.plain + (out is None)
            return out
        monkeypatch.setattr(forward, "shared_prompt_forward", counted)


def _update(module, batch: RolloutBatch, monkeypatch):  # noqa: ANN001, ANN202
    """``RLModule.update`` without a Trainer: ``(gradients of each optimiser step, metrics)``."""
    capture = _Capture(list(module.parameters()))
    monkeypatch.setattr(module, "optimizers", lambda: capture)
    monkeypatch.setattr(module, "manual_backward", lambda loss: loss.backward())
    monkeypatch.setattr(module, "_loss_terms", lambda: [])
    stats = module.update(batch, _advantages(module, batch), module.loss_weights(batch))
    return capture.steps, {k: torch.stack([v.float().reshape(()) for v in vs]).mean().item() for k, vs in stats.items()}


def _reference(module, batch: RolloutBatch, monkeypatch) -> list:  # noqa: ANN001
    """The plain path's gradients of every optimiser step, computed in float64 (the module is restored after)."""
    state = {k: v.clone() for k, v in module.state_dict().items()}
    share = module.share_prompt_forward
    module.share_prompt_forward = False
    module.to(torch.float64)
    try:
        steps, _ = _update(module, batch, monkeypatch)
    finally:
        module.to(torch.float32)
        module.load_state_dict(state)
        module.share_prompt_forward = share
    return steps


def _tolerance(plain: list, reference: list, derived=None) -> list[float]:  # noqa: ANN001
    """Per optimiser step: twice the plain path's largest distance to float64, plus 2^-24 of the largest entry, and
    at least ``derived(scale)`` (the bound of two float32 orders of the same sum: the shared path's own rounding
    need not be as small as the plain path's, measured 1.0e-5 against a plain error of 3.3e-6 with AVX2 kernels)."""
    tolerances = []
    for step_plain, step_ref in zip(plain, reference):
        scale = max(float(g.abs().max()) for g in step_ref if g is not None)
        assert scale > 0
        error = max(float((g.double() - r).abs().max()) for g, r in zip(step_plain, step_ref) if r is not None)
        tolerance = max(2 * error + 2.0**-24 * scale, derived(scale) if derived is not None else 0.0)
        assert tolerance < BUG_SCALE * scale, f"rounding {tolerance / scale:.1e} of max|grad| would hide a bug"
        tolerances.append(tolerance)
    return tolerances


def _assert_same_gradient(got: list, want: list, tolerances: list[float]) -> None:
    assert len(got) == len(want) == len(tolerances)
    for step_got, step_want, atol in zip(got, want, tolerances):
        assert [g is None for g in step_got] == [g is None for g in step_want]  # the same parameters reached
        for g, w in zip(step_got, step_want):
            if w is not None:
                torch.testing.assert_close(g, w, rtol=0, atol=atol)


def _compare(module, batch: RolloutBatch, monkeypatch) -> tuple[dict, dict]:  # noqa: ANN001
    """Update with sharing off and on from the same weights; asserts the same gradients (derived tolerance) and
    returns ``(metrics, number of shared forwards)`` per setting."""
    state = {k: v.clone() for k, v in module.state_dict().items()}
    runs, counts = {}, {}
    for share in (False, True):
        module.load_state_dict(state)
        module.share_prompt_forward = share
        counter = _Counter(monkeypatch)
        runs[share] = _update(module, batch, monkeypatch)
        counts[share] = counter.shared
    module.load_state_dict(state)
    config, length, terms = module.policy.config, batch.input_ids.shape[1], batch.input_ids.numel()
    tolerances = _tolerance(runs[False][0], _reference(module, batch, monkeypatch),
                            lambda scale: float(decoder_gradient_tolerance(config, length, terms, scale)))
    _assert_same_gradient(runs[True][0], runs[False][0], tolerances)
    return {k: v[1] for k, v in runs.items()}, counts


# ------------------------------------------------------------------------------------------------ the forward
@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_the_shared_forward_scores_like_the_plain_one(arch):
    module = _module(GRPO, arch)
    # group 2's rows do not share (13 distinct prefixes); group 0's prompt is one token (its prefix all padding)
    batch = _batch(len(module.tokenizer), per_row=(2,), prompts=[1, 6, 4, 5])
    ids, mask, p = batch.input_ids, batch.attention_mask, batch.prompt_length
    shared = forward.shared_prompt_forward(module.policy, ids, mask, p, with_hidden=True)
    assert shared is not None and shared[0].shape[:2] == (16, 8) and shared[1].shape == (16, 8, 128)
    outs = {}
    for share in (False, True):
        module.share_prompt_forward = share
        module.policy.zero_grad()
        out = module.forward_policy(batch, with_entropy=True, with_hidden=True)
        real = batch.loss_mask.unsqueeze(-1)
        loss = out.logprobs.sum() + 0.1 * out.entropy.sum() + 0.01 * (out.hidden * real).square().sum()
        loss.backward()
        outs[share] = (out, loss.detach(), [p.grad.clone() for p in module.policy.parameters()])
    (plain, plain_loss, plain_grad), (got, got_loss, got_grad) = outs[False], outs[True]
    real = batch.loss_mask.bool()
    length, vocab = batch.input_ids.shape[1], module.policy.config.vocab_size
    lp_tol = decoder_logprob_tolerance(module.policy, plain.hidden[real], batch.temperature, length)
    entropy = float(plain.entropy[real].max())
    ent_tol = lp_tol * (1 + entropy) + 2 * (gamma_probabilistic(vocab) + 2 * unit_roundoff()) * entropy
    hidden_scale = float(plain.hidden[real].abs().max())
    hidden_tol = 2 * (decoder_depth(module.policy.config, length) ** 0.5) * unit_roundoff() * hidden_scale
    torch.testing.assert_close(got.logprobs, plain.logprobs, rtol=0, atol=lp_tol)
    torch.testing.assert_close(got.entropy, plain.entropy, rtol=0, atol=ent_tol)
    torch.testing.assert_close(got.hidden[real], plain.hidden[real], rtol=0, atol=hidden_tol)
    # the loss: n tokens' log-probs, 0.1 x entropies and 0.01 x squares of hidden entries, each within its bound
    n, count = int(real.sum()), int(real.sum()) * plain.hidden.shape[-1]
    terms = float(plain.logprobs.abs().sum() + 0.1 * plain.entropy.abs().sum()
                  + 0.01 * (plain.hidden * batch.loss_mask.unsqueeze(-1)).square().sum())
    loss_tol = n * (lp_tol + 0.1 * ent_tol) + 0.01 * count * 2 * hidden_scale * hidden_tol + 2 * gamma(count) * terms
    assert abs(got_loss.item() - plain_loss.item()) <= loss_tol
    scale = max(float(g.abs().max()) for g in plain_grad)
    worst = max(float((a - b).abs().max()) for a, b in zip(got_grad, plain_grad))
    # the same per-row contributions summed inside the backward in another order and shapes (module docstring)
    assert worst <= float(decoder_gradient_tolerance(module.policy.config, length, batch.input_ids.numel(), scale))


# ------------------------------------------------------------------------------------------------ the update
SETTINGS = [
    {},
    {"micro_batch_size": G},
    {"micro_batch_size": 3},
    {"micro_batch_size": 5, "length_bucketing": False},
    {"micro_batch_size": 3, "num_minibatches": 2},
    {"micro_batch_size": 6, "num_iterations": 2, "loss_aggregation": "token_mean"},
]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("cls", [GRPO, PPO])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "whole")
def test_the_update_is_the_plain_one(monkeypatch, arch, cls, settings):
    module = _module(cls, arch, **settings)
    batch = _off_policy(module, _batch(len(module.tokenizer), per_row=(2,)))
    metrics, counts = _compare(module, batch, monkeypatch)
    plain, shared = metrics[False], metrics[True]
    assert counts[False] == 0 and counts[True] > 0  # the shared path really ran
    keys = ("train/loss", "train/entropy", "train/grad_norm", "train/sampler_logp_diff")
    if cls is GRPO:  # relative to the terms' size (test_skipping._metric_tolerances): the loss cancels
        tolerances = _metric_tolerances(module, batch)
        for key in ("train/loss", "train/entropy"):
            absolute, relative = tolerances[key]
            assert abs(shared[key] - plain[key]) <= absolute + relative * abs(plain[key]), key
        keys = ("train/grad_norm", "train/sampler_logp_diff")
    # PPO (its loss adds the value loss of a critic head), grad_norm and sampler_logp_diff: not derived here (a
    # bound needs the critic head's rounding and the norm's); 1e-5 of the value, values without cancellation
    for key in keys:
        assert shared[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key
    if cls is PPO:
        assert shared["train/value_loss"] == pytest.approx(plain["train/value_loss"], rel=1e-5, abs=1e-7)


def test_bucketing_keeps_a_prompts_rows_together_when_that_costs_less():
    # long shared prompts (12 real tokens): whole groups in a micro-batch save far more than the padding they add
    module = _module(GRPO, "llama", micro_batch_size=G)
    batch = _batch(len(module.tokenizer), prompt=12, prompts=[12, 12, 12, 12])
    (_, _, _, micros), = _plan(module, batch)
    assert sorted(sorted(m.tolist()) for m in micros) == [list(range(g * G, (g + 1) * G)) for g in range(4)]
    # groups ordered by their longest response, each group's rows longest first
    assert [m.tolist() for m in micros][0] == [0, 2, 3, 1]
    # sharing off, or sharing too small to pay (a high threshold): rows by length, as without sharing
    for change in ({"share_prompt_forward": False}, {"share_prompt_min_tokens": 10_000}):
        other = _module(GRPO, "llama", micro_batch_size=G)
        for key, value in change.items():
            setattr(other, key, value)
        (_, _, _, micros), = _plan(other, batch)
        lengths = [LENGTHS[r] for m in micros for r in m.tolist()]
        assert lengths == sorted(lengths, reverse=True)
    # prompts that all differ: the plan is the one without sharing
    distinct = _batch(len(module.tokenizer), per_row=(0, 1, 2, 3))
    assert prompt_blocks(distinct, module.policy) is None
    assert prompt_blocks(batch, module.policy).tolist() == [r // G for r in range(16)]  # one block per group


# ------------------------------------------------------------------------------------------------ fall-backs
def test_prompts_that_differ_within_every_group_are_not_shared(monkeypatch):
    module = _module(GRPO, "llama", micro_batch_size=5)
    batch = _off_policy(module, _batch(len(module.tokenizer), per_row=(0, 1, 2, 3)))
    assert distinct_rows(batch.input_ids[:, :5]) is None
    assert forward.shared_prompt_forward(module.policy, batch.input_ids, batch.attention_mask, 6) is None
    state = {k: v.clone() for k, v in module.state_dict().items()}
    runs = {}
    for share in (False, True):
        module.load_state_dict(state)
        module.share_prompt_forward = share
        runs[share] = _update(module, batch, monkeypatch)[0]
    for got, want in zip(runs[True][0], runs[False][0]):
        assert torch.equal(got, want)  # the very same computation


class _SeededStartEnv(CountdownEnv):
    """The first observation depends on the episode's seed: the G episodes of a prompt start differently."""

    def reset(self, seed=None, options=None):  # noqa: ANN001, ANN201
        super().reset(seed, options)
        return f"go{seed % 3}:", {}


class _SeededStartTask(CountdownTask):
    def make_env(self, prompt: Prompt, reward_fn) -> _SeededStartEnv:  # noqa: ANN001
        return _SeededStartEnv(self.turns)


@pytest.mark.parametrize("task", [CountdownTask(turns=2), _SeededStartTask(turns=2)], ids=["same-start", "seeded"])
def test_episodes_share_only_the_first_observations_that_are_equal(monkeypatch, task: Task):
    module = _module(GRPO, "llama")
    dm = RolloutDataModule(task=task, prompts_per_step=2, group_size=3, strategy=GroupRollout(max_turns=2),
                           sampling=Sampling(max_new_tokens=3))
    dm.trainer = fake_trainer(module)
    batch = _off_policy(module, dm.rollout(dm.prompt_batch(0)))
    # spread in both groups: every row has a gradient
    batch = dataclasses.replace(batch, rewards=torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.25]))
    first, inverse = distinct_rows(batch.input_ids[:, :batch.prompt_length])
    groups = inverse.view(-1, 3)
    if isinstance(task, _SeededStartTask):  # 3 different starts per group, each shared with the other group
        assert all(len(set(g.tolist())) == 3 for g in groups) and first.numel() == 3
    else:
        assert first.numel() == 1
    counts = _compare(module, batch, monkeypatch)[1]
    assert counts[True] > 0


def test_the_single_turn_rollout_gives_a_group_one_prompt():
    module = _module(GRPO, "llama")
    dm = tiny_datamodule()
    dm.trainer = fake_trainer(module)
    batch = dm.rollout(dm.prompt_batch(0))
    p = batch.prompt_length
    prompts = torch.cat([batch.input_ids[:, :p], batch.attention_mask[:, :p]], dim=1).view(-1, G, 2 * p)
    assert (prompts == prompts[:, :1]).all()
    first, inverse = distinct_rows(prompts.view(-1, 2 * p))
    assert first.tolist() == [0, 4, 8, 12] and inverse.tolist() == [r // G for r in range(16)]


def test_sharing_switches_off_where_it_cannot_be_exact():
    vocab = 60
    batch = _batch(vocab)
    ids, mask, p = batch.input_ids, batch.attention_mask, batch.prompt_length
    dropout = _gpt2(vocab, resid_pdrop=0.1)
    assert not can_share_prompts(dropout)  # one dropout mask per group would not be one per row
    assert can_share_prompts(dropout.eval())  # no dropout in eval mode
    functional_dropout = _qwen2(vocab, attention_dropout=0.1)
    assert not can_share_prompts(functional_dropout) and can_share_prompts(functional_dropout.eval())
    checkpointed = _qwen2(vocab)
    enable = (getattr(checkpointed, "activation_checkpointing_enable", None)
              or checkpointed.gradient_checkpointing_enable)
    enable()
    assert not can_share_prompts(checkpointed)
    assert not can_share_prompts(ScriptedLM([[3]], vocab))  # not a Hugging Face model: no cache to trust
    # a sliding-window layer keeps only part of the history: found at the first try, then not tried again
    sliding = _qwen2(vocab, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert can_share_prompts(sliding)
    assert forward.shared_prompt_forward(sliding, ids, mask, p) is None
    assert not can_share_prompts(sliding)
    plain = _qwen2(vocab)
    assert forward.shared_prompt_forward(plain, ids, mask, 1) is None  # P = 1: no prefix to share
    saved = (16 - 4) * (p - 1)
    assert forward.shared_prompt_forward(plain, ids, mask, p, min_tokens=saved + 1) is None
    assert forward.shared_prompt_forward(plain, ids, mask, p, min_tokens=saved) is not None


def test_the_flags_are_validated():
    with pytest.raises(ValueError, match="share_prompt_forward must be true or false"):
        GRPO(model_name_or_path="embedded:random", share_prompt_forward="yes")
    with pytest.raises(ValueError, match="share_prefill must be true or false"):
        KVCacheEngine(share_prefill=1)


def test_distinct_rows():
    key = torch.tensor([[5, 1], [5, 1], [2, 0], [5, 1], [2, 0], [7, 7]])
    first, inverse = distinct_rows(key)
    assert first.tolist() == [0, 2, 5] and inverse.tolist() == [0, 0, 1, 0, 1, 2]
    assert torch.equal(key[first][inverse], key)
    assert distinct_rows(torch.tensor([[1], [2], [3]])) is None and distinct_rows(torch.tensor([[1]])) is None


def test_a_short_fit_is_the_same_with_and_without_sharing(tmp_path, recorder):
    finals, rewards = {}, {}
    for share in (False, True):
        torch.manual_seed(0)
        module = GRPO(model_name_or_path="embedded:arithmetic", share_prompt_forward=share)
        recorder.rewards.clear()
        tiny_trainer(tmp_path, max_steps=2, callbacks=[recorder]).fit(module, datamodule=tiny_datamodule())
        finals[share] = {k: v.clone() for k, v in module.policy.state_dict().items()}
        rewards[share] = [r.clone() for r in recorder.rewards]
    assert all(torch.equal(a, b) for a, b in zip(rewards[True], rewards[False]))  # the same samples
    # not derived: after two AdamW steps a gradient entry near 0 is divided by sqrt(v) + eps, which amplifies its
    # rounding by up to lr / eps; 1e-6 absolute holds here
    for key, value in finals[False].items():
        torch.testing.assert_close(finals[True][key], value, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------ generation
def _prompt_rows(module, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    tok = module.tokenizer
    rows = [[tok.bos_token_id, *tok(t, add_special_tokens=False)["input_ids"]] for t in texts for _ in range(G)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "gpt2", "sliding-qwen2"])
@pytest.mark.parametrize("static_cache", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_shared_prefill_draws_the_same_tokens(arch, static_cache, seed):
    module = _module(GRPO, "qwen2" if arch == "sliding-qwen2" else arch)
    if arch == "sliding-qwen2":
        module.policy = _qwen2(len(module.tokenizer), use_sliding_window=True, sliding_window=4, max_window_layers=1)
    ids, mask = _prompt_rows(module, ["1+2=", "37+48=", "123+456=", "9*9="])
    tok, model = module.tokenizer, module.policy.eval()
    gens = {}
    for share in (False, True):
        gens[share] = sample(model, ids, mask, SamplingParams(6, tok.eos_token_id, tok.pad_token_id, topk=2),
                             torch.Generator().manual_seed(seed),
                             options=DecodeOptions(static_cache=static_cache, share_prefill=share))
    plain, shared = gens[False], gens[True]
    assert torch.equal(shared.response_ids, plain.response_ids) and torch.equal(shared.mask, plain.mask)
    assert torch.equal(shared.truncated, plain.truncated) and torch.equal(shared.topk_ids, plain.topk_ids)
    # float32 rounding of the two prefills' log-probs (decoder_logprob_bound: no hidden states at hand)
    tol = decoder_logprob_bound(model, 1.0, ids.shape[1] + 6)
    torch.testing.assert_close(shared.logprobs, plain.logprobs, rtol=0, atol=tol)
    torch.testing.assert_close(shared.topk_logprobs, plain.topk_logprobs, rtol=0, atol=tol)
    assert (plain.mask.sum(dim=1) > 1).any()  # several tokens were drawn


def test_the_engine_prefills_each_prompt_once(monkeypatch):
    module = _module(GRPO, "llama")
    ids, mask = _prompt_rows(module, ["1+2=", "37+48="])
    tok, model = module.tokenizer, module.policy.eval()
    rows = []
    original = type(model).forward

    def recording(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        rows.append(kwargs["input_ids"].shape)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(type(model), "forward", recording)
    for share in (True, False):
        rows.clear()
        KVCacheEngine(share_prefill=share, static_cache=True).sample_padded(
            model, ids, mask, SamplingParams(4, tok.eos_token_id, tok.pad_token_id), torch.Generator().manual_seed(0))
        assert rows[0] == ((2, ids.shape[1]) if share else (8, ids.shape[1]))  # the prefill: one row per prompt


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("share", [True, False])
def test_the_logits_overwritten_by_their_gradient_change_no_gradient_bit(arch, share):
    """``forward_policy`` lets the backward write the logits' gradient over the logits (``overwrite_logits``):
    the same parameter gradients, bit for bit, on the shared-prompt path and the plain one (a view of the model's
    output logits there)."""
    grads = []
    for overwrite in (False, True):
        module = _module(GRPO, arch)
        module.share_prompt_forward, module.overwrite_logits = share, overwrite
        batch = _batch(len(module.tokenizer))
        out = module.forward_policy(batch, with_entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        grads.append([p.grad.clone() for p in module.policy.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))
