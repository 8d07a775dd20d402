"""Running sums written out step by step: the prompt and answer, the reward, the splits and the number tokenizer."""

from __future__ import annotations

import pytest

from rl_lightning.envs import Prompt, RunningSumReward, RunningSumTask
from rl_lightning.envs.running_sum import parse_running_sum, running_sum_steps
from rl_lightning.models.tokenizer import build_number_tokenizer


@pytest.fixture(scope="module")
def task():
    return RunningSumTask()


@pytest.fixture(scope="module")
def tok():
    return build_number_tokenizer()


def test_a_hand_worked_problem():
    prompt = RunningSumTask.make_prompt([12, 35, 7, 40])
    assert prompt.text == "12+35+7+40="
    assert prompt.answer == "94"
    assert prompt.metadata == {"terms": [12, 35, 7, 40]}
    assert running_sum_steps([12, 35, 7, 40]) == "12+35=47;47+7=54;54+40=94;#94"
    assert running_sum_steps([3, 7, 2, 9]) == "3+7=10;10+2=12;12+9=21;#21"


RIGHT = "3+7=10;10+2=12;12+9=21;#21"


@pytest.mark.parametrize("response, reward", [
    (RIGHT, 1.0),
    ("3+7=11;11+2=13;13+9=22;#22", 0.0),  # a wrong step carried to the end
    ("3+7=10;10+2=12;12+9=11;#11", 0.0),  # a dropped ten in the last step
    ("3+7=10;10+2=12;12+9=21;#20", 0.0),  # the final answer is not the last total
    ("3+7=10;10+2=12;12+9=21;#", 0.0),  # no final number
    ("3+7=10;10+2=12;12+9=21;", 0.0),  # no final answer
    ("#21", 0.0),  # the answer without its steps
    ("3+7=10;10+2=12;10+2=12;12+9=21;#21", 0.0),  # a repeated step
    ("3+7=10;12+9=21;#21", 0.0),  # a missing step
    ("3+7=10;10+9=19;19+2=21;#21", 0.0),  # terms out of order
    ("3+7=10;10+2=12;12+9=21;#21;", 0.0),  # text after the answer
    ("3+7=10; 10+2=12;12+9=21;#21", 0.0),  # a space
    ("3+7=10;10+2=12;12+9=021;#021", 0.0),  # a leading zero
    ("3+7=10;10+2=12;12+9=21;12+9=21;12+9=21;12+9=", 0.0),  # a loop cut at the cap
    ("3+7=10;10+2=12;12+", 0.0),  # cut inside a step
    ("", 0.0),
])
def test_reward(response, reward):
    prompt = RunningSumTask.make_prompt([3, 7, 2, 9])
    assert RunningSumReward()(prompt, response) == reward
    assert RunningSumReward()(Prompt(prompt.text, prompt.answer), response) == reward  # terms from the text


def test_parse_returns_the_final_answer_of_well_formed_wrong_steps():
    assert parse_running_sum([3, 7, 2, 9], "3+7=11;11+2=13;13+9=22;#22") == 22
    assert parse_running_sum([3, 7, 2, 9], "3+7=11;10+2=12;12+9=21;#21") is None  # a step that does not chain


def test_a_response_cut_at_the_cap_never_scores(task, tok):
    """The cap holds the longest well-formed response with its EOS; any longer one has more than n - 1 steps."""
    terms = [9] * task.max_terms
    assert len(tok(running_sum_steps(terms))["input_ids"]) + 1 == task.max_response_tokens() == 69
    prompt = RunningSumTask.make_prompt(terms)
    right = running_sum_steps(terms)
    assert RunningSumReward()(prompt, right) == 1.0
    looped = right.split("#")[0] + right.split(";")[-2] + ";" + "#" + prompt.answer
    assert RunningSumReward()(prompt, looped) == 0.0


def test_splits_are_deterministic_disjoint_and_never_trained_on(task):
    test, validation = task.heldout_prompts(), task.validation_prompts()
    assert len(test) == 500 and len(validation) == 200
    assert len({p.text for p in test}) == 500 and len({p.text for p in validation}) == 200
    assert {p.text for p in test}.isdisjoint(p.text for p in validation)
    again = RunningSumTask()
    assert again.heldout_prompts() == test and again.validation_prompts() == validation
    held = {p.text for p in test} | {p.text for p in validation}
    assert held.isdisjoint(task.train_prompt(i).text for i in range(5000))
    assert task.train_prompt(17) == again.train_prompt(17)
    assert RunningSumTask(seed=1).heldout_prompts() != test


def test_the_train_stream_redraws_a_held_out_problem():
    """A tiny problem space makes collisions certain: the stream must skip both splits."""
    task = RunningSumTask(min_terms=2, max_terms=2, max_term=9, num_heldout=20, num_validation=10)
    held = {p.text for p in task.heldout_prompts()} | {p.text for p in task.validation_prompts()}
    assert len(held) == 30
    drawn = {task.train_prompt(i).text for i in range(2000)}
    assert drawn.isdisjoint(held)
    assert len(drawn) == 81 - 30  # every other problem is drawn


def test_problems_follow_the_settings(task):
    for i in range(300):
        terms = task.train_prompt(i).metadata["terms"]
        assert 4 <= len(terms) <= 12 and all(1 <= t <= 9 for t in terms)
    with pytest.raises(ValueError, match="999"):
        RunningSumTask(max_terms=12, max_term=99)
    with pytest.raises(ValueError, match="min_terms"):
        RunningSumTask(min_terms=5, max_terms=4)


def test_the_number_tokenizer_round_trip(tok, tmp_path):
    from transformers import AutoTokenizer

    assert len(tok) == 1008
    assert tok("12+35=")["input_ids"] == [20, 4, 43, 5]
    assert [tok.convert_ids_to_tokens(i) for i in range(8)] == ["<pad>", "<bos>", "<eos>", "<unk>", "+", "=", ";", "#"]
    assert tok.convert_tokens_to_ids("999") == 1007
    text = running_sum_steps([12, 35, 7, 40, 900])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 6 * 5 - 3 - 1  # without its EOS
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=True) == text
    assert tok("1000+007")["input_ids"] == [3, 4, 3]  # not numbers of the vocabulary
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded(text, add_special_tokens=False)["input_ids"] == ids
    assert loaded.decode(ids) == text
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)


def test_the_default_reward_is_the_running_sum_reward(task):
    assert isinstance(task.default_reward(), RunningSumReward)
    env = task.make_env(task.heldout_prompts()[0], task.default_reward())
    text, _ = env.reset()
    assert env.step(running_sum_steps(task.heldout_prompts()[0].metadata["terms"]))[1] == 1.0
    assert text.endswith("=")


# ---------------------------------------------------------------- the shipped warm start (embedded:running_sum)
def test_the_warm_start_loads_with_its_number_tokenizer_and_records_its_build(tok):
    import json

    from rl_lightning.models.policy import ASSETS, load_policy

    model, loaded = load_policy("embedded:running_sum")
    assert len(loaded) == 1008 and model.config.vocab_size == 1008
    assert model.config.max_position_embeddings == 128 and model.config.hidden_size == 128
    text = running_sum_steps([3, 7, 2, 9])
    assert loaded(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    record = json.loads((ASSETS / "running_sum" / "warm_start.json").read_text())
    assert 0.2 <= record["heldout_accuracy"] <= 0.4 and 0.2 <= record["plateau"]["mean"] <= 0.4
    plateau = record["plateau"]["accuracies"]
    assert len(plateau) >= 4 and max(plateau) - min(plateau) <= record["plateau"]["tolerance"]
    sampled = record["sampled_temperature_1"]
    assert 0.1 <= sampled["truncation_rate"] <= 0.4  # 0.124: responses that loop into the cap
    assert sampled["tail_mass_top8_at_totals"] > 0.05


def test_the_warm_start_is_right_about_a_third_of_the_time_greedy(task):
    """Greedy success of ``embedded:running_sum`` on the first 100 test problems, as ``val/reward`` computes it
    (BOS + prompt, greedy, cut at the cap and at EOS, ``RunningSumReward``)."""
    import torch

    from rl_lightning.models.policy import load_policy
    from rl_lightning.rollout import SamplingParams, sample

    torch.set_num_threads(1)
    prompts = task.heldout_prompts()[:100]
    model, tok = load_policy("embedded:running_sum")
    model.eval()
    rows = [[tok.bos_token_id, *tok(p.text, add_special_tokens=False)["input_ids"]] for p in prompts]
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = sample(model, input_ids, attention_mask, SamplingParams(72, tok.eos_token_id, tok.pad_token_id, greedy=True))
    reward, correct = task.default_reward(), 0
    for prompt, ids, mask in zip(prompts, out.response_ids.tolist(), out.mask.tolist()):
        ended = tok.eos_token_id in ids
        ids = [i for i, m in zip(ids, mask) if m and i != tok.eos_token_id]
        correct += ended and reward(prompt, tok.decode(ids, skip_special_tokens=True))
    assert 0.1 <= correct / len(prompts) <= 0.5, correct
