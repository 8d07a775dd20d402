"""``VLLMEngine`` (vLLM's offline ``LLM`` in this process) against the project's contracts, on the embedded model.

Marked ``vllm``: run in the venv that has vLLM (``./install_vllm.sh``; ``.ci/run`` does it):
``.venv-vllm/bin/python -m pytest -m vllm tests/vllm``. Without vLLM these tests fail (they are never skipped).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import LlamaConfig, LlamaForCausalLM

from rl_lightning.algorithms import GRPO
from rl_lightning.envs import GuessNumberTask
from rl_lightning.functional.logprobs import sampling_log_softmax
from rl_lightning.models.policy import load_policy
from rl_lightning.rollout import GroupRollout, RolloutDataModule, Sampling, VLLMEngine
from rl_lightning.rollout.engine import SamplingParams
from tests.conftest import REPO
from tests.rollout.rollout_helpers import fake_trainer
from tests.tolerances import decoder_logprob_bound

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def arithmetic():
    policy, tokenizer = load_policy("embedded:arithmetic")
    engine = VLLMEngine(max_logprobs=3)
    engine.setup(policy)
    yield policy, tokenizer, engine
    engine.close()


def _params(tok, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 8), eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, **kw)


def _learner_logprobs(policy, prompt: list[int], ids: list[int], temperature: float, top_p: float):
    """The sampled ids' log-probs under ``softmax(top_p(logits / T))`` from one fp32 forward of ``policy``,
    with the distribution's log-probs at every position."""
    with torch.no_grad():
        logits = policy(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    dist = sampling_log_softmax(logits, temperature, top_p)
    return dist.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1), dist


def _max_logprob_error(policy, prompts, gen, n, temperature, top_p) -> float:
    worst = 0.0
    for i in range(gen.response_ids.shape[0]):
        length = int(gen.mask[i].sum())
        ref, _ = _learner_logprobs(policy, prompts[i // n], gen.response_ids[i, :length].tolist(), temperature, top_p)
        worst = max(worst, float((ref - gen.logprobs[i, :length]).abs().max()))
    return worst


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_vllm_tokens_follow_the_sampler_contract(arithmetic, temperature, top_p):
    policy, tok, engine = arithmetic
    prompts = [tok(t)["input_ids"] for t in ("12+3=", "4+56=", "7+8=")]
    params = _params(tok, temperature=temperature, top_p=top_p, seed=11)
    gen = engine.generate(prompts, params, n=4)
    assert gen.response_ids.shape[0] == 12
    bound = decoder_logprob_bound(policy, temperature, max(map(len, prompts)) + gen.response_ids.shape[1])
    assert _max_logprob_error(policy, prompts, gen, 4, temperature, top_p) <= bound
    again = engine.generate(prompts, params, n=4)
    assert torch.equal(gen.response_ids, again.response_ids)  # the same seed, the same tokens
    other = engine.generate(prompts, _params(tok, temperature=temperature, top_p=top_p, seed=12), n=4)
    assert not torch.equal(gen.response_ids, other.response_ids)
    for i in range(12):  # a row ends with its EOS ("stop") or at the budget ("length")
        row = gen.response_ids[i, :int(gen.mask[i].sum())].tolist()
        assert gen.finish_reasons[i] == ("stop" if row[-1] == tok.eos_token_id else "length")
        assert row.count(tok.eos_token_id) <= 1 and (gen.finish_reasons[i] == "stop" or len(row) == 8)


def test_vllm_topk_is_the_sampling_distributions(arithmetic):
    policy, tok, engine = arithmetic
    prompts = [tok("12+3=")["input_ids"]]
    gen = engine.generate(prompts, _params(tok, temperature=0.7, top_p=0.9, seed=3, topk=3), n=2)
    for i in range(2):
        length = int(gen.mask[i].sum())
        _, dist = _learner_logprobs(policy, prompts[0], gen.response_ids[i, :length].tolist(), 0.7, 0.9)
        top, _ = dist.topk(3, dim=-1)
        finite = top.isfinite()  # top-p may leave fewer than 3 ids: vLLM's and ours are -inf there alike
        got = gen.topk_logprobs[i, :length]
        bound = decoder_logprob_bound(policy, 0.7, len(prompts[0]) + length)
        assert (got[finite] - top[finite]).abs().max() <= bound
        picked = dist.gather(-1, gen.topk_ids[i, :length])  # vLLM's ids carry the forward's top log-probs
        assert (picked[finite] - top[finite]).abs().max() <= bound


def _step(policy) -> None:
    """One AdamW step on a next-token loss: an update a sync must carry to the engine."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 2]])
    policy(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _tied_llama(tmp_path) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=99, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_after_an_optimizer_step_and_a_sync_vllm_logprobs_equal_the_learners(tied, tmp_path):
    policy = _tied_llama(tmp_path) if tied else load_policy("embedded:arithmetic")[0]
    assert (policy.lm_head.weight is policy.model.embed_tokens.weight) == tied
    engine = VLLMEngine()
    engine.setup(policy, version=0)
    try:
        prompts = [[1, 5, 6, 7], [1, 8, 9, 10, 11]]
        params = SamplingParams(max_tokens=12, eos_token_id=2, pad_token_id=0, seed=5)
        before = copy.deepcopy(policy)
        _step(policy)
        engine.load_weights(policy.state_dict(), version=1)
        assert engine.version == 1
        gen = engine.generate(prompts, params, n=4)
        bound = decoder_logprob_bound(policy, 1.0, 5 + gen.response_ids.shape[1])
        assert _max_logprob_error(policy, prompts, gen, 4, 1.0, 1.0) <= bound
        # the update moved the log-probs by far more than the bound: the check above could not pass unsynced
        assert _max_logprob_error(before, prompts, gen, 4, 1.0, 1.0) > 100 * bound
    finally:
        engine.close()


def test_lora_adapters_reach_vllm_merged_after_an_update_and_a_sync():
    """A policy with LoRA adapters (configs/presets/lora.yaml) on vLLM, through ``SamplerSync``: vLLM knows nothing
    of adapters, so it is set up from, and synced with, the merged weights. After an update of the adapters and a
    sync, its log-probs are the adapted learner's within the float32 bound, and far from the base model's (the
    weights without the adapters, which an engine that missed them would sample from)."""
    from rl_lightning.models.adapters import LoraSettings, add_lora
    from rl_lightning.rollout.sync import SamplerSync

    torch.manual_seed(0)
    policy = add_lora(load_policy("embedded:arithmetic")[0], LoraSettings(rank=4, alpha=8.0))
    sync = SamplerSync(VLLMEngine())
    engine = sync.for_step(policy, 0)
    try:
        optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(3):  # B starts at 0: a few steps make the adapters matter
            ids = torch.tensor([[1, 5, 6, 7, 8, 9, 2]])
            policy(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert sync.for_step(policy, 1) is engine and engine.version == 1
        prompts = [[1, 5, 6, 7], [1, 8, 9, 10, 11]]
        gen = engine.generate(prompts, SamplingParams(max_tokens=12, eos_token_id=2, pad_token_id=0, seed=5), n=4)
        bound = decoder_logprob_bound(policy, 1.0, 5 + gen.response_ids.shape[1])
        assert _max_logprob_error(policy, prompts, gen, 4, 1.0, 1.0) <= bound
        base = load_policy("embedded:arithmetic")[0]
        assert _max_logprob_error(base, prompts, gen, 4, 1.0, 1.0) > 100 * bound
    finally:
        engine.close()


def test_a_multi_turn_guess_episode_through_vllm_has_exactly_the_conversations_tokens():
    policy, tok = load_policy("embedded:guess")
    engine = VLLMEngine()
    engine.setup(policy)
    sent = []
    complete = engine._complete

    def recording(prompts, params, n, budgets, seeds):  # noqa: ANN001
        sent.extend(list(p) for p in prompts)
        return complete(prompts, params, n, budgets, seeds)

    engine._complete = recording
    try:
        task = GuessNumberTask(low=1, high=31, max_guesses=5, seed=1234)
        dm = RolloutDataModule(task, prompts_per_step=4, group_size=2, engine=engine,
                               strategy=GroupRollout(max_turns=5, max_episode_tokens=32), seed=0,
                               sampling=Sampling(max_new_tokens=3))
        dm.trainer = fake_trainer(GRPO(model_name_or_path="embedded:guess"))
        dm.setup("fit")
        batch = dm.rollout(dm.prompt_batch(0))
    finally:
        engine.close()
    assert int(batch.turns.count.max()) >= 2  # episodes that went on after an observation
    # every history vLLM was sent is a prefix of its row's trajectory: prompt, turns, observations, nothing else
    rows = [batch.input_ids[i][batch.attention_mask[i].bool()].tolist() for i in range(batch.input_ids.shape[0])]
    for history in sent:
        assert any(row[:len(history)] == history for row in rows), history
    # and the sampler's log-prob of every sampled id is the learner's on that exact sequence
    P, worst = batch.prompt_length, 0.0
    for i, row in enumerate(rows):
        start = P - int(batch.attention_mask[i, :P].sum())  # the row's first real position
        sampled = batch.loss_mask[i].bool()
        with torch.no_grad():
            logits = policy(torch.tensor([row])).logits[0, :-1]
        dist = sampling_log_softmax(logits, 1.0, 1.0)
        learner = dist.gather(-1, torch.tensor(row[1:]).unsqueeze(-1)).squeeze(-1)[P - start - 1:]
        T = sampled.shape[0]
        learner = torch.nn.functional.pad(learner, (0, T - learner.shape[0]))[:T]
        worst = max(worst, float((learner[sampled] - batch.sampler_logprobs[i][sampled]).abs().max()))
    assert worst <= decoder_logprob_bound(policy, 1.0, batch.input_ids.shape[1])


def fit(tmp_path, seed: int, *presets: str, steps: int = 3) -> dict[str, dict[int, float]]:
    """``rl-lightning fit --config configs/grpo.yaml [--config PRESET ...]`` for ``steps`` steps with ``seed``, as
    a user runs it; every logged scalar by step."""
    run = tmp_path / f"{'_'.join(Path(p).stem for p in presets) or 'builtin'}_{seed}"
    run.mkdir(parents=True)
    args = ["--config", str(REPO / "configs" / "grpo.yaml")]
    for preset in presets:
        args += ["--config", str(REPO / preset)]
    proc = subprocess.run([sys.executable, "-m", "rl_lightning", "fit", *args, "--trainer.max_steps", str(steps),
                           "--seed_everything", str(seed), "--data.init_args.seed", str(seed)],
                          cwd=run, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    acc = EventAccumulator(str(run / "runs" / "grpo" / "version_0"))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_a_3_step_grpo_fit_through_vllm_learns_like_the_built_in_engine(tmp_path):
    builtin = [fit(tmp_path, seed) for seed in (0, 1, 2)]
    vllm = [fit(tmp_path, seed, "configs/presets/vllm.yaml") for seed in (0, 1, 2)]
    gain = lambda runs: torch.tensor([r["val/reward"][3] - r["val/reward"][0] for r in runs])  # noqa: E731
    ours, ref = gain(vllm), gain(builtin)
    spread = float(torch.cat([ours, ref]).std())
    print(f"held-out gain after 3 steps: built-in {ref.tolist()}, vLLM {ours.tolist()}")
    assert all(r["val/reward"][0] == builtin[0]["val/reward"][0] for r in builtin + vllm)  # one greedy start
    assert float(ours.mean()) > 0 and float(ref.mean()) > 0  # both learn ...
    assert abs(float(ours.mean() - ref.mean())) <= 3 * spread  # ... by the same amount within seed noise
    bound = decoder_logprob_bound(load_policy("embedded:arithmetic")[0], 1.0, 16)
    assert all(d <= bound for r in vllm for d in r["train/sampler_logp_diff"].values())  # synced at every step


def test_a_run_on_vllm_resumes_exactly(tmp_path):
    """4 steps straight == 2 steps, a checkpoint, fresh objects (and a fresh vLLM), 2 more steps: the same rewards
    and bit-identical weights (vLLM's draws depend only on the per-prompt seeds and the synced weights)."""
    from lightning.pytorch import seed_everything

    from tests.conftest import RecordRollouts, tiny_datamodule, tiny_trainer

    def module() -> GRPO:
        return GRPO(model_name_or_path="embedded:arithmetic", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))

    seed_everything(0)
    straight_rec, straight = RecordRollouts(), module()
    tiny_trainer(tmp_path / "a", 4, callbacks=[straight_rec]).fit(straight, tiny_datamodule(engine=VLLMEngine()))
    seed_everything(0)
    first_rec, first = RecordRollouts(), module()
    trainer = tiny_trainer(tmp_path / "b", 2, callbacks=[first_rec])
    trainer.fit(first, tiny_datamodule(engine=VLLMEngine()))
    trainer.save_checkpoint(tmp_path / "b" / "step2.ckpt")
    second_rec, resumed = RecordRollouts(), module()
    tiny_trainer(tmp_path / "c", 4, callbacks=[second_rec]).fit(
        resumed, tiny_datamodule(engine=VLLMEngine()), ckpt_path=str(tmp_path / "b" / "step2.ckpt"))
    for got, want in zip(first_rec.rewards + second_rec.rewards, straight_rec.rewards, strict=True):
        assert torch.equal(got, want)
    for (name, a), (_, b) in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().items()):
        assert torch.equal(a, b), name
