"""``sample`` and the sampler contract: the learner's recomputed log-probs equal the recorded ones on-policy."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import ScriptedLM, batch_like_datamodule, encode, model_logprob_tolerance

from rl_lightning.algorithms import GRPO
from rl_lightning.functional import sampling_log_softmax
from rl_lightning.rollout import SamplingParams, position_ids_from_mask, sample

# 4 prompts of different lengths, 2 rows each (groups are contiguous), so prompts are left-padded
TEXTS = ["1+2=", "37+48=", "123+456=", "9*9="]
ROWS = [t for t in TEXTS for _ in range(2)]
#: a settings bug (wrong temperature, positions or mask) moves log-probs by far more than this; the derived
#: rounding tolerance must stay below it, or the contract tests could no longer tell rounding from a bug
BUG_SCALE = 1e-2


@pytest.fixture(scope="module")
def modules() -> dict[str, GRPO]:
    return {
        "random": GRPO(model_name_or_path="embedded:random"),
        "arithmetic": GRPO(model_name_or_path="embedded:arithmetic"),
    }


def _generate(module: GRPO, max_new_tokens=6, temperature=1.0, top_p=1.0, greedy=False, seed=0, texts=ROWS):
    tok = module.tokenizer
    ids, mask = encode(tok, texts)
    policy = module.policy
    was_training = policy.training
    policy.eval()
    params = SamplingParams(max_tokens=max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            temperature=temperature, top_p=top_p, greedy=greedy)
    gen = sample(policy, ids, mask, params, torch.Generator().manual_seed(seed))
    policy.train(was_training)
    return ids, mask, gen


def _final_hidden(module: GRPO, ids: torch.Tensor, mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """``[N, T, H]`` final (normed) hidden states of one full forward at the positions predicting the response."""
    with torch.no_grad():
        out = module.policy(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                            use_cache=False, output_hidden_states=True)
    return out.hidden_states[-1][:, prompt_length - 1:-1]


def _rounding_tolerance(module: GRPO, ids: torch.Tensor, mask: torch.Tensor, prompt_length: int,
                        response_mask: torch.Tensor, temperature: float) -> float:
    """The float32 rounding tolerance of the response tokens of ``ids`` (``[N, P+T]``), checked to stay far below
    a bug's effect."""
    hidden = _final_hidden(module, ids, mask, prompt_length)[response_mask.bool()]
    tol = model_logprob_tolerance(module.policy, hidden, temperature, context_length=ids.shape[1])
    assert tol < BUG_SCALE / 10, f"the rounding tolerance {tol:.2e} no longer separates rounding from a bug"
    return tol


def test_position_ids_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 1, 2, 2]]


@pytest.mark.parametrize("model_name", ["random", "arithmetic"])
@pytest.mark.parametrize(
    ("temperature", "top_p", "greedy"),
    [(1.0, 1.0, False), (0.7, 1.0, False), (1.0, 0.9, False), (0.5, 0.8, False), (0.7, 1.0, True)],
)
def test_sampler_contract_recomputed_logprobs_match(modules, model_name, temperature, top_p, greedy):
    module = modules[model_name]
    ids, mask, gen = _generate(module, temperature=temperature, top_p=top_p, greedy=greedy, seed=11)
    assert ids.shape[0] == 8 and (mask == 0).any()  # left padding really present
    batch = batch_like_datamodule(ids, mask, gen, group_size=2, temperature=temperature, top_p=top_p)
    assert module.policy.training  # the learner scores in train mode
    with torch.no_grad():
        recomputed, entropy = module.token_logprobs(batch, with_entropy=True)
    m = batch.loss_mask.bool()
    assert m.sum() >= 8
    diff = (recomputed - batch.sampler_logprobs)[m].abs().max().item()
    tol = _rounding_tolerance(module, batch.input_ids, batch.attention_mask, batch.prompt_length, m, temperature)
    assert diff < tol, f"max |recomputed - recorded| = {diff:.2e} >= float32 rounding tolerance {tol:.2e}"
    assert (recomputed[~m] == 0).all()
    assert torch.isfinite(batch.sampler_logprobs).all() and (batch.sampler_logprobs[m] <= 0).all()
    assert torch.isfinite(entropy).all()


def test_contract_breaks_when_the_learner_uses_other_settings(modules):
    """Guard that the check above can fail: scoring at another temperature gives visibly different log-probs."""
    module = modules["random"]
    ids, mask, gen = _generate(module, temperature=0.7, seed=2)
    wrong = batch_like_datamodule(ids, mask, gen, group_size=2, temperature=1.0, top_p=1.0)
    with torch.no_grad():
        recomputed, _ = module.token_logprobs(wrong)
    m = wrong.loss_mask.bool()
    assert (recomputed - wrong.sampler_logprobs)[m].abs().max() > BUG_SCALE


def test_rows_stop_at_eos_real_model(modules):
    module = modules["arithmetic"]
    eos, pad = module.tokenizer.eos_token_id, module.tokenizer.pad_token_id
    _, _, gen = _generate(module, max_new_tokens=3, seed=4)
    ids, mask, trunc = gen.response_ids, gen.mask, gen.truncated
    assert ids.shape == mask.shape == gen.logprobs.shape and ids.shape[1] <= 3
    assert trunc.dtype == torch.bool
    for r in range(ids.shape[0]):
        hits = (ids[r] == eos).nonzero().flatten().tolist()
        if hits:
            first = hits[0]
            assert mask[r, : first + 1].tolist() == [1] * (first + 1)  # EOS itself is a generated token
            assert mask[r, first + 1:].sum() == 0
            assert (ids[r, first + 1:] == pad).all()
            assert (gen.logprobs[r, first + 1:] == 0).all()
            assert not trunc[r]
        else:
            assert mask[r].all() and trunc[r]
            assert ids.shape[1] == 3
    # this seed gives both kinds: short answers end with EOS, 3-digit sums are cut at 3 tokens
    assert trunc.any() and (~trunc).any()


def test_rows_stop_at_eos_scripted():
    eos, pad, a = 2, 0, 10
    script = [
        [eos, a, a, a, a],
        [a, eos, a, a, a],
        [a, a, eos, a, a],
        [a, a, a, a, a],   # never ends: truncated
        [a, a, a, a, eos],  # EOS on the very last allowed step: not truncated
    ]
    model = ScriptedLM(script, vocab_size=20)
    ids = torch.tensor([[0, 1, 5], [1, 5, 6], [0, 0, 1], [1, 7, 7], [0, 1, 9]])
    mask = (ids != 0).long()
    gen = sample(model, ids, mask, SamplingParams(max_tokens=5, eos_token_id=eos, pad_token_id=pad),
                 torch.Generator().manual_seed(0))
    assert gen.response_ids.tolist() == [
        [eos, pad, pad, pad, pad],
        [a, eos, pad, pad, pad],
        [a, a, eos, pad, pad],
        [a, a, a, a, a],
        [a, a, a, a, eos],
    ]
    assert gen.mask.tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1],
    ]
    assert gen.truncated.tolist() == [False, False, False, True, False]
    assert gen.logprobs.abs().max() < 1e-3  # the scripted token has probability ~1
    # the model saw finished rows masked out: the last call's mask is the prompt mask + response mask[:, :-1]
    assert torch.equal(model.calls[-1], torch.cat([mask, gen.mask[:, :-1]], dim=1))


def test_loop_ends_when_every_row_has_stopped():
    eos, a = 2, 10
    model = ScriptedLM([[a, eos, a, a], [eos, a, a, a]], vocab_size=20)
    ids = torch.tensor([[1, 5], [1, 6]])
    gen = sample(model, ids, torch.ones_like(ids), SamplingParams(max_tokens=50, eos_token_id=eos, pad_token_id=0))
    assert gen.response_ids.shape == (2, 2)
    assert gen.response_ids.tolist() == [[a, eos], [eos, 0]]
    assert not gen.truncated.any()
    assert len(model.calls) == 2  # prompt forward + one decode step


def test_same_generator_seed_same_tokens(modules):
    module = modules["random"]
    _, _, g1 = _generate(module, seed=7)
    _, _, g2 = _generate(module, seed=7)
    _, _, g3 = _generate(module, seed=8)
    assert torch.equal(g1.response_ids, g2.response_ids)
    assert torch.equal(g1.logprobs, g2.logprobs)
    assert not torch.equal(g1.response_ids, g3.response_ids)


def test_sampling_with_a_generator_leaves_the_global_rng_alone(modules):
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    _generate(modules["random"], seed=3)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("model_name", ["random", "arithmetic"])
def test_greedy_is_deterministic_and_argmax_of_full_forward(modules, model_name):
    module = modules[model_name]
    ids, mask, g1 = _generate(module, greedy=True, temperature=0.7, seed=1)
    _, _, g2 = _generate(module, greedy=True, temperature=0.7, seed=999)  # the generator is irrelevant
    assert torch.equal(g1.response_ids, g2.response_ids) and torch.equal(g1.mask, g2.mask)
    full_ids = torch.cat([ids, g1.response_ids], dim=1)
    full_mask = torch.cat([mask, g1.mask], dim=1)
    policy = module.policy.eval()
    with torch.no_grad():
        logits = policy(input_ids=full_ids, attention_mask=full_mask,
                        position_ids=position_ids_from_mask(full_mask)).logits
    module.policy.train()
    p, t = ids.shape[1], g1.response_ids.shape[1]
    pred = logits[:, p - 1:p - 1 + t]  # position p-1+k predicts response token k
    m = g1.mask.bool()
    assert torch.equal(pred.argmax(-1)[m], g1.response_ids[m])
    # recorded greedy log-probs are those of the temperature-scaled distribution
    want = sampling_log_softmax(pred, 0.7).gather(-1, g1.response_ids.unsqueeze(-1)).squeeze(-1)
    diff = (want - g1.logprobs)[m].abs().max().item()
    tol = _rounding_tolerance(module, full_ids, full_mask, p, m, 0.7)
    assert diff < tol, f"max |full forward - recorded| = {diff:.2e} >= float32 rounding tolerance {tol:.2e}"


def test_diverged_weights_stop_the_rollout_with_the_step_named(tmp_path):
    from tests.conftest import tiny_datamodule, tiny_trainer

    class Diverged(GRPO):  # what a huge learning rate can leave behind without a non-finite loss or gradient
        def on_train_batch_end(self, outputs, batch, batch_idx):  # noqa: ANN001
            if batch_idx == 0:  # after step 0's update
                with torch.no_grad():
                    self.policy.get_output_embeddings().weight.fill_(float("inf"))

    module = Diverged(model_name_or_path="embedded:arithmetic")
    ids, mask = encode(module.tokenizer, ROWS)
    with torch.no_grad():
        module.policy.get_output_embeddings().weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="logits for the prompts are not finite"):
        tok = module.tokenizer
        sample(module.policy.eval(), ids, mask, SamplingParams(4, tok.eos_token_id, tok.pad_token_id))

    module = Diverged(model_name_or_path="embedded:arithmetic")
    with pytest.raises(FloatingPointError, match="rollout at step 1: sample: the model's next-token logits"):
        tiny_trainer(tmp_path, max_steps=3).fit(module, datamodule=tiny_datamodule())


def _probabilities(rows: int, vocab: int, seed: int, zero_every: int = 0) -> torch.Tensor:
    """Softmax rows at several sharpnesses (flat to near one-hot); every ``zero_every``-th entry 0 (a top-p cut)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.1, 1.0, 4.0, 20.0]).repeat(rows // 4 + 1)[:rows].unsqueeze(1)
    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * scale, dim=-1)
    if zero_every:
        probs[:, ::zero_every] = 0
    return probs


@pytest.mark.parametrize("vocab, rows, zero_every", [
    (2, 8, 0), (300, 16, 3), (1024, 16, 3), (5000, 16, 0), (49152, 8, 0), (49152, 3, 2), (300_000, 2, 0),
])
def test_categorical_draw_is_torch_multinomial(vocab, rows, zero_every):
    """The same index as ``torch.multinomial(p, 1)`` for the same generator state, on vocabularies from 2 entries
    (under ``DRAW_MIN_VOCAB``: multinomial itself) to more than a chunk (``DRAW_CHUNK``: rows then go several at a
    time, or one row spans it), and the generator ends
    in the same state (the next draw is the same too). 20 seeds x ``rows`` draws each: a wrong exponential, stream
    order or margin shows as a different index in some of them."""
    from rl_lightning.rollout.generation import categorical_draw

    for seed in range(20):
        probs = _probabilities(rows, vocab, seed, zero_every)
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        drawn = categorical_draw(probs, ours)
        assert torch.equal(drawn, torch.multinomial(probs, 1, generator=theirs).squeeze(-1))
        assert torch.equal(ours.get_state(), theirs.get_state())
        if zero_every:
            assert not bool((drawn % zero_every == 0).any())  # never an entry of probability 0


def test_categorical_draw_uses_the_global_generator_without_one():
    from rl_lightning.rollout.generation import categorical_draw

    probs = _probabilities(8, 5000, seed=3)
    torch.manual_seed(11)
    drawn = categorical_draw(probs)
    torch.manual_seed(11)
    assert torch.equal(drawn, torch.multinomial(probs, 1).squeeze(-1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.1])
def test_categorical_draw_refuses_what_multinomial_refuses(bad):
    from rl_lightning.rollout.generation import categorical_draw

    probs = _probabilities(4, 2000, seed=0)
    probs[2, 7] = bad
    with pytest.raises(RuntimeError, match="inf, nan or element < 0"):
        categorical_draw(probs, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError):
        torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(0))
