"""``ArithmeticWordTask`` and ``NumericAnswerReward``: wording, seeded stream, held-out exclusion, the verifier."""

from __future__ import annotations

from decimal import Decimal

import pytest

from rl_lightning.envs.base import Prompt, Task
from rl_lightning.envs.word_problems import (
    ITEMS,
    NAMES,
    TEMPLATES,
    ArithmeticWordTask,
    NumericAnswerReward,
    parse_number,
)


def _key(prompt: Prompt) -> tuple[int, str, int]:
    return prompt.metadata["a"], prompt.metadata["op"], prompt.metadata["b"]


def test_is_a_task_with_numeric_default_reward():
    task = ArithmeticWordTask(num_heldout=10)
    assert isinstance(task, Task)
    assert isinstance(task.default_reward(), NumericAnswerReward)


def test_the_example_wording_and_answer():
    p = ArithmeticWordTask.make_prompt(12, "+", 7, 0, "Tom", ("apple", "apples"))
    assert p.text == "Tom has 12 apples and buys 7 more. How many apples does Tom have now? Answer with a number."
    assert p.answer == "19"
    assert p.metadata == {"a": 12, "op": "+", "b": 7, "template": 0, "name": "Tom", "item": "apples"}
    assert ArithmeticWordTask.make_prompt(1, "-", 1, 0, "Zoe", ("coin", "coins"), instruction="").text == (
        "Zoe has 1 coin and gives away 1. How many coins does Zoe have left?"  # singular, no instruction
    )


def test_prompts_are_well_formed_with_right_answers_in_range():
    task = ArithmeticWordTask(min_operand=3, max_operand=30, num_heldout=20, seed=5)
    ops = set()
    for i in range(300):
        p = task.train_prompt(i)
        a, op, b = _key(p)
        ops.add(op)
        assert 3 <= a <= 30 and 3 <= b <= 30, p.text
        assert p.answer == str(a + b if op == "+" else a - b)
        assert int(p.answer) >= 0  # subtraction is ordered
        assert p.text.endswith(" Answer with a number.")
        assert f" {a} " in p.text and f" {b}" in p.text and p.metadata["item"] in p.text
        assert p.metadata["name"] is None or (p.metadata["name"] in NAMES and p.metadata["name"] in p.text)
        assert p.metadata["item"] in {pl for _, pl in ITEMS}
        assert "{" not in p.text and "}" not in p.text
    assert ops == {"+", "-"}
    only_plus = ArithmeticWordTask(operations=["+"], num_heldout=5)
    assert {only_plus.train_prompt(i).metadata["op"] for i in range(100)} == {"+"}


def test_every_template_renders():
    for op, templates in TEMPLATES.items():
        for t in range(len(templates)):
            p = ArithmeticWordTask.make_prompt(9, op, 4, t, "Anna", ("book", "books"))
            assert "9 books" in p.text and " 4" in p.text
            assert ("Anna" in p.text) == (p.metadata["name"] == "Anna")
            assert p.answer == ("13" if op == "+" else "5")


def test_train_prompt_is_a_pure_function_of_seed_and_index():
    a1, a2 = ArithmeticWordTask(num_heldout=20, seed=7), ArithmeticWordTask(num_heldout=20, seed=7)
    b = ArithmeticWordTask(num_heldout=20, seed=8)
    s1 = [a1.train_prompt(i) for i in range(100)]
    assert s1 == [a2.train_prompt(i) for i in range(100)]
    assert [a1.train_prompt(i) for i in reversed(range(100))] == s1[::-1]  # random access
    assert [p.text for p in s1] != [b.train_prompt(i).text for i in range(100)]
    assert len({p.text for p in s1}) > 90  # the stream varies


def test_heldout_is_fixed_distinct_and_never_trained_on():
    task = ArithmeticWordTask(min_operand=2, max_operand=12, num_heldout=60, seed=3)
    held = task.heldout_prompts()
    assert len(held) == 60
    assert held == ArithmeticWordTask(min_operand=2, max_operand=12, num_heldout=60, seed=3).heldout_prompts()
    held_keys = {_key(p) for p in held}
    assert len(held_keys) == 60  # distinct problems
    # A small space (11 x 11 operand pairs): the stream hits every other problem often, never a held-out one.
    train_keys = {_key(task.train_prompt(i)) for i in range(5000)}
    assert not train_keys & held_keys
    assert len(train_keys) > 100
    held[0] = Prompt("mutated")
    assert task.heldout_prompts()[0].text != "mutated"  # a copy is returned


def test_the_validation_split_follows_the_test_split_and_is_never_trained_on():
    """num_validation takes the next distinct problems of the same draw: the test split is the one without it (so
    configs' test sets do not move), the two share no problem, and training draws neither."""
    plain = ArithmeticWordTask(min_operand=2, max_operand=12, num_heldout=40, seed=3)
    task = ArithmeticWordTask(min_operand=2, max_operand=12, num_heldout=40, num_validation=30, seed=3)
    assert task.heldout_prompts() == plain.heldout_prompts()
    val_keys, test_keys = {_key(p) for p in task.validation_prompts()}, {_key(p) for p in task.heldout_prompts()}
    assert len(val_keys) == 30 and not val_keys & test_keys
    assert not {_key(task.train_prompt(i)) for i in range(5000)} & (val_keys | test_keys)
    with pytest.raises(NotImplementedError, match="set num_validation"):
        plain.validation_prompts()


def test_heldout_prefix_is_not_sorted_by_operand():
    # the first few (what evaluation.num_prompts keeps) should look like a random sample, not the smallest operands
    held = ArithmeticWordTask(num_heldout=200, seed=1234).heldout_prompts()[:8]
    assert len({p.metadata["a"] for p in held}) > 3
    assert len({p.metadata["op"] for p in ArithmeticWordTask(num_heldout=200).heldout_prompts()[:16]}) == 2


@pytest.mark.parametrize(
    "kwargs, needle",
    [({"min_operand": -1}, "min_operand"), ({"min_operand": 5, "max_operand": 4}, "max_operand"),
     ({"operations": ["*"]}, "unknown operation"), ({"operations": []}, "operations"),
     ({"num_heldout": -1}, "num_heldout"), ({"min_operand": 1, "max_operand": 2, "num_heldout": 7}, "num_heldout")],
)
def test_bad_arguments_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ArithmeticWordTask(**kwargs)


def test_negative_index_is_refused():
    with pytest.raises(ValueError, match="index"):
        ArithmeticWordTask(num_heldout=1).train_prompt(-1)


# ---------------------------------------------------------------- NumericAnswerReward
@pytest.mark.parametrize(
    "answer, response, expected",
    [
        ("19", "The answer is 19.", 1.0),
        ("19", "19 or 20", 0.0),  # the last number (20) counts
        ("20", "19 or 20", 1.0),
        ("19", "12 + 7 = 19", 1.0),
        ("19", "Tom has 19 apples now.", 1.0),
        ("19", "19.0", 1.0),
        ("19", "19.5", 0.0),
        ("19", "I don't know.", 0.0),  # no number
        ("19", "", 0.0),
        ("-3", "-3", 1.0),
        ("-3", "The result is -3.", 1.0),
        ("-3", "3", 0.0),
        ("3", "-3", 0.0),
        ("-3", "x = \u22123", 1.0),  # Unicode minus sign
        ("2", "5-3=2", 1.0),
        ("3", "10-7", 0.0),  # '-' glued to a digit is an operator: the last number is 7
        ("7", "10-7", 1.0),
        ("1234", "That makes 1,234 coins.", 1.0),
        ("1,234", "1234", 1.0),
        ("19", "  19\n", 1.0),
    ],
)
def test_numeric_reward_on_hand_cases(answer, response, expected):
    assert NumericAnswerReward()(Prompt("q", answer), response) == expected


def test_numeric_reward_needs_a_numeric_answer():
    with pytest.raises(ValueError, match="reference answer"):
        NumericAnswerReward()(Prompt("q"), "19")
    with pytest.raises(ValueError, match="not a number"):
        NumericAnswerReward()(Prompt("q", "nineteen"), "19")
    with pytest.raises(ValueError, match="not a number"):
        NumericAnswerReward()(Prompt("q", "19 or 20"), "19")


def test_parse_number():
    assert parse_number("no digits") is None
    assert parse_number("1,234.5 and") == parse_number("1234.5")
    assert parse_number("19, 20") == 20
    assert parse_number("end.") is None


def test_task_prompts_score_with_their_own_answer():
    task = ArithmeticWordTask(num_heldout=10)
    reward = task.default_reward()
    for i in range(50):
        p = task.train_prompt(i)
        assert reward(p, f"The answer is {p.answer}.") == 1.0
        assert reward(p, f"The answer is {int(p.answer) + 1}.") == 0.0


# ---------------------------------------------------------------- answer extraction: \boxed{} and GSM8K's ####
def test_answer_extraction_reads_the_last_box_with_nested_braces_and_gsm8k_answers():
    from rl_lightning.envs.word_problems import answer_value, extract_answer, last_boxed

    assert last_boxed(r"first \boxed{1} then \boxed{\frac{84}{2}} done") == r"\frac{84}{2}"
    assert last_boxed(r"\boxed{a{b}c}") == "a{b}c" and last_boxed(r"\boxed{unclosed") is None
    assert last_boxed(r"\boxed{7} and \boxed{8") == "7"  # the last *closed* box
    assert extract_answer("Natalia sold 48/2 = 24 clips in May. #### 72") == "72"
    assert extract_answer("work #### 1,234\nmore text") == "1,234"
    assert answer_value(r"\boxed{\frac{84}{2}}") == 42 and answer_value(r"\boxed{\dfrac{-3}{4}}") == Decimal("-0.75")
    assert answer_value(r"\boxed{\frac{1}{0}}") is None and answer_value("no number") is None
    reward = NumericAnswerReward()
    # these scored 0 before: the last number was 2, 84 or 2
    assert reward(Prompt("q", "42"), r"\boxed{42} (checked in 2 steps)") == 1.0
    assert reward(Prompt("q", "42"), r"so the answer is \boxed{\frac{84}{2}}") == 1.0
    assert reward(Prompt("q", "42"), r"\boxed{41}, no: \boxed{42}") == 1.0
    assert reward(Prompt("q", "42"), r"\boxed{41} (I checked 42 cases)") == 0.0  # the box wins over the last number
    # a GSM8K reference answer works as it is (it was refused as "not a number")
    gsm8k = Prompt("Natalia sold clips ...", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72")
    assert reward(gsm8k, "She sold 72 clips altogether.") == 1.0 and reward(gsm8k, "#### 24") == 0.0
    with pytest.raises(ValueError, match="not a number"):
        reward(Prompt("q", "work #### seventy-two"), "72")
