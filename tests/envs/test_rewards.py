"""Reward functions and ``score``: exact match, and errors that name the prompt and response."""

from __future__ import annotations

import math

import pytest

from rl_lightning.envs import ExactMatchReward, Prompt, RewardError, RewardFunction, score

P = Prompt("37+48=", "85")


@pytest.mark.parametrize(
    ("response", "strip", "expected"),
    [
        ("85", True, 1.0),
        (" 85\n", True, 1.0),
        ("85 ", True, 1.0),
        ("86", True, 0.0),
        ("8 5", True, 0.0),
        ("", True, 0.0),
        ("85", False, 1.0),
        (" 85", False, 0.0),
        ("85\n", False, 0.0),
    ],
)
def test_exact_match(response, strip, expected):
    assert ExactMatchReward(strip=strip)(P, response) == expected


def test_exact_match_strips_the_reference_too():
    padded = Prompt("q", " 85 ")
    assert ExactMatchReward()(padded, "85") == 1.0
    assert ExactMatchReward(strip=False)(padded, "85") == 0.0
    assert ExactMatchReward(strip=False)(padded, " 85 ") == 1.0


def test_exact_match_without_answer_raises_and_score_wraps_it():
    no_answer = Prompt("what?", None)
    with pytest.raises(ValueError, match="what"):
        ExactMatchReward()(no_answer, "x")
    with pytest.raises(RewardError, match="what"):
        score(ExactMatchReward(), no_answer, "x")


def test_score_returns_float():
    class IntReward(RewardFunction):
        def __call__(self, prompt, response):
            return len(response)

    value = score(IntReward(), P, "abc")
    assert value == 3.0 and isinstance(value, float)
    assert score(ExactMatchReward(), P, "85") == 1.0


class Exploding(RewardFunction):
    def __call__(self, prompt, response):
        return {"85": 1.0}[response]  # KeyError for anything else


def test_score_wraps_exception_with_prompt_and_response():
    with pytest.raises(RewardError) as info:
        score(Exploding(), Prompt("12+13=", "25"), "2 5 oops")
    msg = str(info.value)
    assert "12+13=" in msg
    assert "2 5 oops" in msg
    assert "Exploding" in msg
    assert "KeyError" in msg
    assert isinstance(info.value.__cause__, KeyError)
    assert isinstance(info.value, RuntimeError)


def test_score_wraps_plain_callables_and_unconvertible_values():
    def returns_text(prompt, response):
        return "high"

    with pytest.raises(RewardError, match="12"):
        score(returns_text, Prompt("12=", "12"), "resp-xyz")
    with pytest.raises(RewardError, match="resp-xyz"):
        score(returns_text, Prompt("12=", "12"), "resp-xyz")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_raises(bad):
    class Bad(RewardFunction):
        def __call__(self, prompt, response):
            return bad

    with pytest.raises(RewardError) as info:
        score(Bad(), Prompt("9+9=", "18"), "17")
    msg = str(info.value)
    assert "9+9=" in msg and "17" in msg
