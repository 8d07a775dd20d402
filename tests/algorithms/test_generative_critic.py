"""``GenerativeCritic`` on the embedded guess model: its value is the grid expectation of ``candidate_logprobs``
(one row per context), its contexts carry privileged text and fit the 64 positions, its auxiliary rows' losses
and gradients equal the cross-entropy / accuracy-GRPO terms computed independently, and a grid the tokenizer
cannot encode as single distinct ids is refused naming ``value_tokens``."""

from __future__ import annotations

import pytest
import torch

from rl_lightning.algorithms import GRPO
from rl_lightning.algorithms.generative_critic import ADVANTAGE, GenerativeCritic
from rl_lightning.envs.base import Prompt
from rl_lightning.functional import nearest_bin, value_from_grid, value_token_ce


@pytest.fixture(scope="module")
def module() -> GRPO:
    torch.manual_seed(0)
    return GRPO(model_name_or_path="embedded:guess")


def contexts(module: GRPO, critic: GenerativeCritic) -> list[list[int]]:
    tok = module.tokenizer
    histories = ["<bos>guess 1-31:16<eos>hi:24<eos>", "<bos>guess 1-31:", "<bos>guess 1-31:8<eos>lo:"]
    return [critic.context(module, list(tok(h, add_special_tokens=False)["input_ids"])) for h in histories]


def grads(module: GRPO, term: torch.Tensor) -> torch.Tensor:
    module.policy.zero_grad()
    term.backward()
    return torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])


def test_values_are_the_grid_expectation_of_the_next_token_distribution(module):
    critic = GenerativeCritic()
    ctx = contexts(module, critic)
    grid = critic.grid_ids(module.tokenizer)
    assert len(grid) == 11 and len(set(grid)) == 11
    values = critic.values(module, ctx)
    assert critic.calls == 3 and not values.requires_grad
    with torch.no_grad():  # by hand: the full next-token softmax at the last position, restricted and renormalised
        for c, expected in zip(ctx, values):
            logits = module.policy(input_ids=torch.tensor([c])).logits[0, -1]
            p = torch.softmax(logits, dim=-1)[grid]
            assert float((p / p.sum()) @ torch.linspace(0, 1, 11)) == pytest.approx(float(expected), abs=1e-5)
    assert bool(((values >= 0) & (values <= 1)).all())


def test_contexts_carry_privileged_text_and_fit_the_positions(module):
    tok = module.tokenizer
    critic = GenerativeCritic(privileged=" s={secret}", instruction="C:")
    prompt = Prompt(text="guess 1-31:", answer="17", metadata={"secret": 17})
    history = list(tok("<bos>guess 1-31:16<eos>", add_special_tokens=False)["input_ids"])
    ctx = critic.context(module, history, prompt)
    assert tok.decode(ctx, skip_special_tokens=False) == "C:<bos>guess 1-31:16<eos> s=17 V:"
    assert critic.context(module, history) == ctx[:2] + history + ctx[-3:]  # no prompt: no privileged text
    long = history * 10  # 130 ids: cut from the left, one position left for the value token
    cut = critic.context(module, long, prompt)
    assert len(cut) == 63 and cut[2:-8] == long[-(63 - 10):]


def test_a_grid_the_tokenizer_cannot_encode_as_single_distinct_ids_is_refused(module):
    with pytest.raises(ValueError, match=r"^GenerativeCritic: value_tokens \['10'\] are not single tokens"):
        GenerativeCritic(value_tokens=("0", "10")).grid_ids(module.tokenizer)
    with pytest.raises(ValueError, match="value_tokens .* do not encode to distinct ids"):
        GenerativeCritic(value_tokens=("a", "b", "a")).grid_ids(module.tokenizer)
    with pytest.raises(ValueError, match="R_min < R_max"):
        GenerativeCritic(value_range=(1.0, 1.0))


def test_ce_rows_train_the_rounded_target_bin(module):
    critic = GenerativeCritic()
    ctx = contexts(module, critic)
    targets = torch.tensor([0.26, -2.0, 0.05])  # bins 3, 0 (clipped), 1 (half up)
    rows = critic.ce_rows(module, ctx, targets, coef=0.5)
    out = module.forward_policy(rows.batch, extra_ids=rows.extra_ids)
    term, stats = rows.loss(rows.batch, out, rows.weights)
    independent = 0.5 * value_token_ce(critic.logprobs(module, ctx), torch.tensor([3, 0, 1])).mean()
    assert nearest_bin(targets, critic.levels()).tolist() == [3, 0, 1]
    assert float(term.detach()) == pytest.approx(float(independent.detach()), rel=1e-5)
    assert float(stats["train/critic_loss"].value) == pytest.approx(float(term.detach()))
    torch.testing.assert_close(grads(module, term), grads(module, independent), rtol=1e-4, atol=1e-7)


def test_accuracy_rows_are_grpo_on_sampled_value_tokens_centred_per_state(module):
    critic = GenerativeCritic()
    ctx = contexts(module, critic)
    targets = torch.tensor([1.0, 0.0, 0.5])
    rows, stats = critic.accuracy_rows(module, ctx, targets, samples=4, generator=torch.Generator().manual_seed(0),
                                       coef=2.0)
    assert rows.batch.num_rows == 12
    adv, bins = rows.batch.extras[ADVANTAGE], rows.batch.extras["value_bin"]
    reward = -(critic.levels()[bins] - targets.repeat_interleave(4)).abs()
    torch.testing.assert_close(adv, (reward.view(3, 4) - reward.view(3, 4).mean(1, keepdim=True)).flatten())
    torch.testing.assert_close(stats["critic_reward"], reward.view(3, 4).mean(1))
    torch.testing.assert_close(stats["critic_value"], critic.values(module, ctx), rtol=1e-5, atol=1e-6)
    out = module.forward_policy(rows.batch, extra_ids=rows.extra_ids)
    term, _ = rows.loss(rows.batch, out, rows.weights)
    # on-policy (ρ = 1): the term is -2 · mean(A) and its gradient -2 · mean(A ∇ log p_grid(v))
    logp = torch.log_softmax(critic.logprobs(module, [c for c in ctx for _ in range(4)]), dim=-1)
    independent = -2.0 * (adv * logp.gather(1, bins.unsqueeze(1)).squeeze(1)).mean()
    assert float(term.detach()) == pytest.approx(-2.0 * float(adv.mean()), abs=1e-6)
    torch.testing.assert_close(grads(module, term), grads(module, independent), rtol=1e-4, atol=1e-7)
    assert value_from_grid(torch.zeros(1, 11), critic.levels()).item() == pytest.approx(0.5)


def test_reasoning_before_the_value_token_is_greedy_context_then_the_query(module):
    tok = module.tokenizer
    critic = GenerativeCritic(reasoning_tokens=3, reasoning_prompt=" T:")
    history = list(tok("<bos>guess 1-31:16<eos>hi:", add_special_tokens=False)["input_ids"])
    ctx = critic.context(module, history)
    assert tok.decode(ctx, skip_special_tokens=False).endswith("hi: T:")
    assert len(critic.context(module, history * 10)) == 63 - 3 - 3  # room for 3 reasoning ids and " V:"
    thought, ids = [], list(ctx)
    with torch.no_grad():  # greedy by hand, stopped at EOS (dropped)
        for _ in range(3):
            nxt = int(module.policy(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            thought.append(nxt)
            ids.append(nxt)
    full = ctx + thought + list(tok(" V:", add_special_tokens=False)["input_ids"])
    assert module.policy.training
    assert critic.reasoned(module, [ctx]) == [full] and module.policy.training  # train mode restored
    grid = critic.grid_ids(tok)
    expected = value_from_grid(module.candidate_logprobs([full], grid).detach(), critic.levels())
    torch.testing.assert_close(critic.values(module, [ctx]), expected)
    rows = critic.ce_rows(module, [ctx], torch.tensor([0.5]))
    assert rows.batch.input_ids[0][rows.batch.attention_mask[0].bool()].tolist()[:-1] == full  # value token after it
    with pytest.raises(ValueError, match="reasoning_tokens must be >= 0"):
        GenerativeCritic(reasoning_tokens=-1)
