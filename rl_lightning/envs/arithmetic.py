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
        num_heldout: size of the fixed held-out set, the test split (greedy exact match on it is ``val/reward``).
        num_validation: size of the validation split (``validation_prompts``), drawn after the test split with the
            same generator, apart from it; the training stream skips it too. 0 (the default, which keeps the
            training stream of the earlier studies) means no validation split.
        seed: seeds both held-out splits and the training stream.
    """

    def __init__(
        self,
        num_digits: int = 2,
        operations: list[Operation] | None = None,
        num_heldout: int = 500,
        seed: int = 1234,
        num_validation: int = 0,
    ) -> None:
        if num_digits < 1:
            raise ValueError(f"ArithmeticTask: num_digits must be >= 1, got {num_digits}")
        if num_heldout < 0:
            raise ValueError(f"ArithmeticTask: num_heldout must be >= 0, got {num_heldout}")
        if num_validation < 0:
            raise ValueError(f"ArithmeticTask: num_validation must be >= 0, got {num_validation}")
        self.num_digits = num_digits
        self.operations: list[str] = list(operations or ["+"])
        for op in self.operations:
            if op not in ("+", "-", "*"):
                raise ValueError(f"ArithmeticTask: unknown operation {op!r} (use '+', '-' or '*')")
        self.low = 0 if num_digits == 1 else 10 ** (num_digits - 1)
        self.high = 10**num_digits - 1
        span = self.high - self.low + 1
        total = span * span * len(self.operations)
        if num_heldout + num_validation >= total:
            raise ValueError(f"ArithmeticTask: num_heldout + num_validation = {num_heldout + num_validation} must "
                             f"be below the {total} problems")
        self.seed = seed
        rng = random.Random(seed)
        keys: dict[tuple[int, str, int], None] = {}  # draw order, so any prefix is a random sample
        while len(keys) < num_heldout + num_validation:
            keys[self._draw(rng)] = None
        drawn = list(keys)
        self._heldout_keys, self._validation_keys = drawn[:num_heldout], drawn[num_heldout:]
        self._heldout_set = set(keys)  # both splits: the training stream never draws them

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

    def validation_prompts(self) -> list[Prompt]:
        if not self._validation_keys:
            raise NotImplementedError("ArithmeticTask has no validation split: set num_validation > 0")
        return [self.make_prompt(*key) for key in self._validation_keys]
