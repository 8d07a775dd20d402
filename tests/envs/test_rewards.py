"""Reward functions and ``score``: exact match, and errors that name the prompt and response."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

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


class Returns(RewardFunction):
    """A reward function that returns a fixed value, whatever the response."""

    def __init__(self, value):
        self.value = value

    def __call__(self, prompt, response):
        return self.value


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, 1.0), (0.25, 0.25), (True, 1.0), (False, 0.0), (np.float32(0.5), 0.5), (np.int64(-2), -2.0),
     (np.bool_(True), 1.0), (np.array(0.75), 0.75), (torch.tensor(0.5), 0.5), (torch.tensor(3), 3.0),
     (torch.tensor(True), 1.0)],
)
def test_score_accepts_real_numbers(value, expected):
    got = score(Returns(value), P, "85")
    assert got == expected and type(got) is float


@pytest.mark.parametrize(
    ("value", "type_name"),
    [("1", "str"), ("0.5", "str"), (None, "NoneType"), ([1.0], "list"), ((1.0,), "tuple"), ({"r": 1.0}, "dict"),
     (torch.tensor([1.0]), "Tensor"), (torch.ones(2, 2), "Tensor"), (np.array([1.0, 0.0]), "ndarray"),
     (np.str_("1"), "str_"), (1 + 0j, "complex")],
)
def test_score_refuses_what_is_not_a_real_number(value, type_name):
    """``float()`` would take ``"1"`` as 1.0 (and a one-element list or tensor): a reward bug, not a reward."""
    with pytest.raises(RewardError) as info:
        score(Returns(value), Prompt("12+13=", "25"), "25 oops")
    msg = str(info.value)
    assert "\n" not in msg, msg  # one line, even for a 2x2 tensor's repr
    assert "Returns" in msg and f"returned {type_name} " in msg and "not a real number" in msg
    assert " ".join(repr(value).split()) in msg
    assert "12+13=" in msg and "25 oops" in msg


def test_score_names_a_plain_function():
    def my_reward(prompt, response):
        return "1"

    with pytest.raises(RewardError, match="reward function .*my_reward returned str '1'"):
        score(my_reward, P, "85")
