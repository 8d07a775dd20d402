"""``ArithmeticTask``: prompt format, seeded stream, held-out split never trained on, argument checks."""

from __future__ import annotations

import re

import pytest

from rl_lightning.envs import ArithmeticTask, ExactMatchReward, Prompt, Task

PROMPT_RE = re.compile(r"^(\d+)([+\-*])(\d+)=$")


def _parse(prompt: Prompt) -> tuple[int, str, int]:
    m = PROMPT_RE.match(prompt.text)
    assert m, f"prompt {prompt.text!r} is not of the form 'a<op>b='"
    return int(m.group(1)), m.group(2), int(m.group(3))


def _expected(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_is_a_task_with_exact_match_default():
    task = ArithmeticTask(num_heldout=10)
    assert isinstance(task, Task)
    assert isinstance(task.default_reward(), ExactMatchReward)


def test_prompts_look_like_sum_with_right_answer():
    task = ArithmeticTask(num_heldout=10, seed=3)
    for i in range(200):
        p = task.train_prompt(i)
        a, op, b = _parse(p)
        assert op == "+"
        assert 10 <= a <= 99 and 10 <= b <= 99, p.text  # two-digit operands, no leading zero
        assert p.answer == str(a + b)
        assert p.metadata == {"a": a, "op": "+", "b": b}
    assert ArithmeticTask.make_prompt(37, "+", 48) == Prompt("37+48=", "85", {"a": 37, "op": "+", "b": 48})


def test_num_digits_controls_operand_range():
    one = ArithmeticTask(num_digits=1, num_heldout=5, seed=0)
    three = ArithmeticTask(num_digits=3, num_heldout=5, seed=0)
    ones = [_parse(one.train_prompt(i)) for i in range(300)]
    assert all(0 <= a <= 9 and 0 <= b <= 9 for a, _, b in ones)
    assert any(a == 0 or b == 0 for a, _, b in ones)  # 0 is a valid single-digit operand
    for i in range(100):
        a, _, b = _parse(three.train_prompt(i))
        assert 100 <= a <= 999 and 100 <= b <= 999


def test_train_prompt_deterministic_for_seed_and_differs_across_seeds():
    a1, a2 = ArithmeticTask(num_heldout=20, seed=7), ArithmeticTask(num_heldout=20, seed=7)
    b = ArithmeticTask(num_heldout=20, seed=8)
    s1 = [a1.train_prompt(i).text for i in range(100)]
    assert s1 == [a2.train_prompt(i).text for i in range(100)]
    # random access: the order of calls does not matter
    assert [a1.train_prompt(i).text for i in reversed(range(100))] == s1[::-1]
    sb = [b.train_prompt(i).text for i in range(100)]
    assert sum(x != y for x, y in zip(s1, sb)) > 80
    # the stream is not constant either
    assert len(set(s1)) > 80


def test_heldout_never_in_first_20k_training_prompts():
    task = ArithmeticTask(num_heldout=500, seed=1234)
    heldout = {p.text for p in task.heldout_prompts()}
    assert len(heldout) == 500
    train = [task.train_prompt(i).text for i in range(20_000)]
    assert not heldout.intersection(train)
    # the stream still covers (almost) every non-held-out problem: 8100 - 500 = 7600 problems
    assert len(set(train)) > 7000


def test_heldout_distinct_fixed_order():
    task = ArithmeticTask(num_heldout=50, seed=11)
    held = task.heldout_prompts()
    assert len(held) == 50
    assert len({p.text for p in held}) == 50
    assert [p.text for p in held] == [p.text for p in task.heldout_prompts()]
    assert [p.text for p in held] == [p.text for p in ArithmeticTask(num_heldout=50, seed=11).heldout_prompts()]
    assert [p.text for p in held] != [p.text for p in ArithmeticTask(num_heldout=50, seed=12).heldout_prompts()]
    for p in held:
        a, op, b = _parse(p)
        assert p.answer == str(_expected(a, op, b))


def test_subtraction_keeps_results_non_negative():
    task = ArithmeticTask(operations=["-"], num_heldout=30, seed=5)
    prompts = [task.train_prompt(i) for i in range(500)] + task.heldout_prompts()
    for p in prompts:
        a, op, b = _parse(p)
        assert op == "-" and a >= b, p.text
        assert p.answer == str(a - b)
        assert int(p.answer) >= 0
    # heldout/train disjoint also holds with reordered operands
    held = {p.text for p in task.heldout_prompts()}
    assert not held.intersection(p.text for p in prompts[:500])


def test_multiplication_and_mixed_operations():
    task = ArithmeticTask(operations=["*"], num_heldout=10, seed=2)
    for i in range(100):
        p = task.train_prompt(i)
        a, op, b = _parse(p)
        assert op == "*" and p.answer == str(a * b)
    mixed = ArithmeticTask(operations=["+", "-", "*"], num_heldout=10, seed=2)
    ops = set()
    for i in range(300):
        p = mixed.train_prompt(i)
        a, op, b = _parse(p)
        ops.add(op)
        assert p.answer == str(_expected(a, op, b))
    assert ops == {"+", "-", "*"}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_digits": 0}, "num_digits"),
        ({"num_digits": -2}, "num_digits"),
        ({"operations": ["/"]}, "operation"),
        ({"operations": ["+", "^"]}, "operation"),
        ({"num_digits": 1, "num_heldout": 100}, "num_heldout"),  # only 10*10 one-digit sums exist
        ({"num_digits": 1, "num_heldout": 1000}, "num_heldout"),
        # a negative held-out size is nonsense and should be refused, not silently turned into "no held-out set"
        ({"num_heldout": -1}, "num_heldout"),
    ],
)
def test_bad_arguments_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ArithmeticTask(**kwargs)


def test_num_heldout_just_below_total_is_fine():
    task = ArithmeticTask(num_digits=1, num_heldout=99, seed=0)
    held = {p.text for p in task.heldout_prompts()}
    assert len(held) == 99
    # only one problem is left to train on
    assert {task.train_prompt(i).text for i in range(20)} == {
        f"{a}+{b}=" for a in range(10) for b in range(10)
    } - held


def test_validation_split_is_apart_from_test_and_training_and_keeps_the_test_split():
    plain = ArithmeticTask(num_heldout=300, seed=7)
    task = ArithmeticTask(num_heldout=300, num_validation=200, seed=7)
    test = [p.text for p in task.heldout_prompts()]
    validation = [p.text for p in task.validation_prompts()]
    assert test == [p.text for p in plain.heldout_prompts()]  # adding a validation split keeps the test split
    assert len(validation) == len(set(validation)) == 200 and not set(validation) & set(test)
    held = set(test) | set(validation)
    assert not any(task.train_prompt(i).text in held for i in range(3000))
    assert validation == [p.text for p in
                          ArithmeticTask(num_heldout=300, num_validation=200, seed=7).validation_prompts()]
    # without one (num_validation=0, the default) the training stream is the one of the earlier studies: these
    # prompts were printed by the code before the validation split existed
    assert [ArithmeticTask().train_prompt(i).text for i in (0, 1, 2, 100, 1000)] == [
        "81+78=", "76+19=", "69+65=", "22+59=", "92+90="]
    with pytest.raises(NotImplementedError, match="num_validation > 0"):
        plain.validation_prompts()
    with pytest.raises(ValueError, match="num_heldout \\+ num_validation"):
        ArithmeticTask(num_digits=1, num_heldout=50, num_validation=50)
