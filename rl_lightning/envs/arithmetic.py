"""The embedded default task: integer arithmetic such as ``"37+48="`` -> ``"85"``, exactly verifiable."""

from __future__ import annotations

import random
from typing import Literal

from rl_lightning.envs.base import Prompt, Task

Operation = Literal["+", "-", "*"]


class ArithmeticTask(Task):
    """Arithmetic on ``num_digits``-digit operands (leading digit may be 0 only when ``num_digits`` is 1).

    The held-out set is ``num_heldout`` distinct problems drawn once with ``seed`` (kept in draw order, so a
    prefix of it is a random sample); the training stream draws uniformly from all other problems, so no
    held-out problem is ever trained on.

    Args:
        num_digits: digits per operand (2 gives ``10..99``).
        operations: operators to draw from; ``-`` keeps the result non-negative by ordering the operands.
        num_heldout: size of the fixed held-out set (greedy exact match on it is ``val/reward``).
        seed: seeds both the held-out split and the training stream.
    """

    def __init__(
        self,
        num_digits: int = 2,
        operations: list[Operation] | None = None,
        num_heldout: int = 500,
        seed: int = 1234,
    ) -> None:
        if num_digits < 1:
            raise ValueError(f"ArithmeticTask: num_digits must be >= 1, got {num_digits}")
        if num_heldout < 0:
            raise ValueError(f"ArithmeticTask: num_heldout must be >= 0, got {num_heldout}")
        self.num_digits = num_digits
        self.operations: list[str] = list(operations or ["+"])
        for op in self.operations:
            if op not in ("+", "-", "*"):
                raise ValueError(f"ArithmeticTask: unknown operation {op!r} (use '+', '-' or '*')")
        self.low = 0 if num_digits == 1 else 10 ** (num_digits - 1)
        self.high = 10**num_digits - 1
        span = self.high - self.low + 1
        total = span * span * len(self.operations)
        if num_heldout >= total:
            raise ValueError(f"ArithmeticTask: num_heldout={num_heldout} must be below the {total} problems")
        self.seed = seed
        rng = random.Random(seed)
        keys: dict[tuple[int, str, int], None] = {}  # draw order, so any prefix is a random sample
        while len(keys) < num_heldout:
            keys[self._draw(rng)] = None
        self._heldout_keys = list(keys)
        self._heldout_set = set(keys)

    def _draw(self, rng: random.Random) -> tuple[int, str, int]:
        a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        op = rng.choice(self.operations)
        if op == "-" and b > a:
            a, b = b, a
        return a, op, b

    @staticmethod
    def make_prompt(a: int, op: str, b: int) -> Prompt:
        result = a + b if op == "+" else a - b if op == "-" else a * b
        return Prompt(text=f"{a}{op}{b}=", answer=str(result), metadata={"a": a, "op": op, "b": b})

    def train_prompt(self, index: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + 7919 * index + 1)
        while True:
            key = self._draw(rng)
            if key not in self._heldout_set:
                return self.make_prompt(*key)

    def heldout_prompts(self) -> list[Prompt]:
        return [self.make_prompt(*key) for key in self._heldout_keys]
