"""The calculator tool-use environment: expression evaluation, tool calls, answers, limits."""

from __future__ import annotations

import pytest

from rl_lightning.envs import CalculatorEnv, CalculatorTask, calculate


@pytest.mark.parametrize("expression, value", [("37*8", 296), ("3+4*2", 11), ("5-2", 3), ("2*3*4", 24),
                                               ("10-2*3+1", 5), ("7", 7), (" 6 * 7 ", 42)])
def test_calculate(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression", ["", "3+", "*3", "3**2", "a+1", "3/2", "1+2+3+4+5", "1234567*2"])
def test_malformed_expressions_are_none(expression):
    assert calculate(expression) is None


def test_an_episode_with_a_tool_call_then_the_answer():
    task = CalculatorTask(num_heldout=10)
    env = task.make_env(task.make_prompt(37, 8), None)
    assert env.reset() == ("37*8=", {})
    assert env.step("c37*8") == ("=296:", 0.0, False, False, {"tool": True})
    assert env.step("c3+") == ("=?:", 0.0, False, False, {"tool": False})  # a defined outcome, not a crash
    assert env.step("296") == ("", 1.0, True, False, {"answered": True})


def test_wrong_answers_and_too_many_calls_end_with_zero():
    env = CalculatorEnv(CalculatorTask.make_prompt(12, 3), max_calls=1)
    env.reset()
    assert env.step("35")[1:3] == (0.0, True)
    env.reset()
    env.step("c12*3")
    assert env.step("c12*3")[1:3] == (0.0, True)


def test_the_held_out_problems_are_never_trained_on():
    task = CalculatorTask(num_heldout=100)
    heldout = {p.text for p in task.heldout_prompts()}
    assert len(heldout) == 100
    assert heldout.isdisjoint(task.train_prompt(i).text for i in range(3000))
    assert task.train_prompt(5) == task.train_prompt(5)
