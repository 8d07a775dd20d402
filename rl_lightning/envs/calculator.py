"""A tool-use environment: multiplication with a calculator the model may call.

An episode: the first observation is the problem, ``"37*8="``. Each turn the model either calls the tool,
``"c37*8"`` (a ``c`` then an expression of non-negative integers with ``+ - *``), and receives the result as
the next observation, ``"=296:"``; or it answers, ``"296"``, which ends the episode with reward 1 when right,
0 when wrong. A malformed tool call gets ``"=?:"``. The episode ends with reward 0 after ``max_calls`` calls
without an answer. Multiplying a 2-digit number by a 1-digit one in its head is hard for the tiny model;
copying the calculator's result is easy: RL should learn to call the tool.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rl_lightning.envs.base import Prompt, RewardFunction, Task
from rl_lightning.envs.environment import Environment, StepResult

_EXPRESSION = re.compile(r"^\d{1,6}([+*-]\d{1,6}){0,3}$")


def calculate(expression: str) -> int | None:
    """The value of ``expression`` (integers with ``+ - *``, usual precedence), or ``None`` if malformed."""
    text = expression.replace(" ", "")
    if not _EXPRESSION.match(text):
        return None
    total, sign, term = 0, 1, None
    for token in re.findall(r"\d+|[+*-]", text):
        if token.isdigit():
            term = int(token) if term is None else term * int(token)
        elif token == "*":
            continue
        else:
            total += sign * term
            sign, term = (1 if token == "+" else -1), None
    return total + sign * term


class CalculatorEnv(Environment):
    """One problem with a calculator tool (see the module docstring).

    Args:
        prompt: the problem (``text`` like ``"37*8="``, ``answer`` the result).
        max_calls: tool calls allowed before the episode ends unanswered.
    """

    def __init__(self, prompt: Prompt, max_calls: int = 2) -> None:
        self.prompt, self.max_calls, self.calls = prompt, max_calls, 0

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.calls = 0
        return self.prompt.text, {}

    def step(self, action: str) -> StepResult:
        text = action.strip()
        if text.startswith("c"):
            self.calls += 1
            value = calculate(text[1:])
            if self.calls > self.max_calls:
                return "", 0.0, True, False, {"answered": False}
            return (f"={value}:" if value is not None else "=?:"), 0.0, False, False, {"tool": value is not None}
        return "", float(text == self.prompt.answer), True, False, {"answered": True}


class CalculatorTask(Task):
    """2-digit x 1-digit multiplication problems with a calculator (``CalculatorEnv``); a fixed held-out set
    of ``num_heldout`` problems that the training stream never yields.

    Args:
        num_heldout: held-out problems (of the 810 there are).
        max_calls: tool calls per episode (run it with ``GroupRollout(max_turns >= max_calls + 1)``).
        seed: seeds the held-out split and the training stream.
    """

    def __init__(self, num_heldout: int = 100, max_calls: int = 2, seed: int = 1234) -> None:
        problems = [(a, b) for a in range(10, 100) for b in range(1, 10)]
        if not 0 <= num_heldout < len(problems):
            raise ValueError(f"CalculatorTask: num_heldout must be in [0, {len(problems)}), got {num_heldout}")
        if max_calls < 0:
            raise ValueError(f"CalculatorTask: max_calls must be >= 0, got {max_calls}")
        random.Random(seed).shuffle(problems)
        self.heldout, self.train = problems[:num_heldout], problems[num_heldout:]
        self.max_calls, self.seed = max_calls, seed

    @staticmethod
    def make_prompt(a: int, b: int) -> Prompt:
        return Prompt(text=f"{a}*{b}=", answer=str(a * b), metadata={"a": a, "b": b})

    def train_prompt(self, index: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + 7919 * index + 1)
        return self.make_prompt(*self.train[rng.randrange(len(self.train))])

    def heldout_prompts(self) -> list[Prompt]:
        return [self.make_prompt(a, b) for a, b in self.heldout]

    def make_env(self, prompt: Prompt, reward_fn: RewardFunction) -> CalculatorEnv:
        return CalculatorEnv(prompt, self.max_calls)

    def episode_turns(self) -> int:
        return self.max_calls + 1  # the tool calls, then the answer
