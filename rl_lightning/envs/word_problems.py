"""Arithmetic word problems for chat models, and a verifier that reads the last number of a response.

``ArithmeticWordTask`` turns ``a + b`` / ``a - b`` into short templated stories such as::

    Tom has 12 apples and buys 7 more. How many apples does Tom have now? Answer with a number.

with the answer ``"19"``. It is the single-turn task of ``configs/grpo_smollm2.yaml``: a small instruct model
answers in free text, so ``NumericAnswerReward`` (its default verifier) scores 1.0 when the *last* number
written in the response equals the answer, whatever the words around it.
"""

from __future__ import annotations

import random
import re
from decimal import Decimal, InvalidOperation
from typing import Literal

from rl_lightning.envs.base import Prompt, RewardFunction, Task

WordOperation = Literal["+", "-"]

# (singular, plural) of the counted things.
ITEMS: tuple[tuple[str, str], ...] = (
    ("apple", "apples"), ("marble", "marbles"), ("sticker", "stickers"), ("book", "books"),
    ("pencil", "pencils"), ("cookie", "cookies"), ("coin", "coins"), ("stamp", "stamps"),
    ("card", "cards"), ("shell", "shells"),
)
NAMES: tuple[str, ...] = ("Tom", "Anna", "Ben", "Lucy", "Sam", "Maya", "Leo", "Nora", "Omar", "Zoe")

# Fields: {name}; {a_items}/{b_items} = "12 apples" / "1 apple"; {a}/{b} bare numbers; {items} = plural noun;
# {b_noun} = the noun agreeing with {b} ("apple" when b == 1).
TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "{name} has {a_items} and buys {b} more. How many {items} does {name} have now?",
        "{name} had {a_items}. A friend gave {name} {b} more {b_noun}. How many {items} does {name} have in total?",
        "There are {a_items} in a box and {b_items} on the table. How many {items} are there altogether?",
    ),
    "-": (
        "{name} has {a_items} and gives away {b}. How many {items} does {name} have left?",
        "{name} had {a_items} and lost {b} of them. How many {items} does {name} have now?",
        "There were {a_items} in a jar. {name} took {b} out. How many {items} are left in the jar?",
    ),
}

# A number: optional sign (only when not glued to a preceding word, so "5-3" reads as 5 and 3), digits with
# optional thousands commas ("1,234"), optional decimals. "19." ends the sentence: the dot is not taken.
NUMBER_RE = re.compile(r"(?:(?<![\w.])[-\u2212])?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` with its nested braces kept (``\\boxed{\\frac{84}{2}}``
    gives ``\\frac{84}{2}``), or ``None`` when there is no closed one."""
    start = text.rfind("\\boxed{")
    while start != -1:
        begin, depth, j = start + len("\\boxed{"), 1, start + len("\\boxed{")
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth == 0:
            return text[begin:j - 1]
        start = text.rfind("\\boxed{", 0, start)
    return None


def extract_answer(text: str) -> str:
    """The part of a response (or a reference answer) that holds its final answer: the last ``\\boxed{...}``, else
    what follows the last ``####`` (GSM8K's ``<work> #### 42``) up to the end of its line, else the whole text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0] if tail else ""
    return text


_FRAC = re.compile(r"^\\[dt]?frac\{\s*([-\u2212]?[\d.,]+)\s*\}\{\s*([-\u2212]?[\d.,]+)\s*\}$")


def answer_value(text: str) -> Decimal | None:
    """The numeric value of ``extract_answer(text)``: a ``\\frac{a}{b}`` (also ``\\dfrac``/``\\tfrac``) as ``a / b``,
    else its last number (``parse_number``); ``None`` when it has none."""
    part = extract_answer(text).strip()
    frac = _FRAC.match(part)
    if frac:
        a, b = parse_number(frac.group(1)), parse_number(frac.group(2))
        return a / b if a is not None and b not in (None, 0) else None
    return parse_number(part)


def parse_number(text: str) -> Decimal | None:
    """The value of the last number in ``text`` (see ``NUMBER_RE``), or ``None`` when it has none."""
    matches = NUMBER_RE.findall(text)
    if not matches:
        return None
    token = matches[-1].replace(",", "").replace("\u2212", "-")
    try:
        return Decimal(token)
    except InvalidOperation:  # pragma: no cover - the regex only admits valid literals
        return None


class NumericAnswerReward(RewardFunction):
    """1.0 when the response's answer equals the reference answer numerically, else 0.0.

    The answer is read by ``answer_value``: the last ``\\boxed{...}`` (nested braces kept; ``\\frac{84}{2}`` is 42),
    else what follows the last ``####`` (GSM8K), else the last number of the response. Numbers may carry a sign
    (``-3``, also the Unicode minus), thousands commas (``1,234``) and decimals (``19.0`` equals ``19``). So
    ``"12 + 7 = 19"``, ``"The answer is 19."`` and ``"\\boxed{19} (checked in 2 steps)"`` score 1 for ``19`` while
    ``"19 or 20"`` scores 0. The reference answer is read the same way, so a GSM8K answer (``"... #### 42"``) works
    as it is. A response without any number scores 0.

    Raises:
        ValueError: the prompt has no answer, or its answer holds no number.
    """

    def __call__(self, prompt: Prompt, response: str) -> float:
        if prompt.answer is None:
            raise ValueError(f"NumericAnswerReward needs a reference answer; prompt {prompt.text!r} has none")
        reference = str(prompt.answer)
        want = answer_value(reference)
        plain = reference.strip() if extract_answer(reference) is reference else extract_answer(reference).strip()
        if want is None or (NUMBER_RE.fullmatch(plain) is None and _FRAC.match(plain) is None):
            raise ValueError(f"NumericAnswerReward: the reference answer {prompt.answer!r} is not a number (nor "
                             "'... #### <number>', nor a \\boxed{} number)")
        got = answer_value(response)
        return 1.0 if got is not None and got == want else 0.0


class ArithmeticWordTask(Task):
    """Templated word problems over ``+`` and ``-`` with operands in ``[min_operand, max_operand]``.

    A problem is the triple ``(a, op, b)``; its wording (template, name, object) is drawn with it. Subtraction
    orders the operands so the answer is never negative. The held-out set is ``num_heldout`` distinct triples
    drawn once with ``seed`` (kept in draw order, so any prefix of it is a random sample); the training stream
    never yields a held-out triple in *any* wording. ``train_prompt(i)`` is a pure function of ``(seed, i)``.

    Args:
        min_operand: smallest operand (>= 0).
        max_operand: largest operand (>= ``min_operand``).
        operations: operators to draw from, a subset of ``["+", "-"]`` (default both).
        num_heldout: size of the fixed held-out set (greedy accuracy on it is ``val/reward``).
        instruction: appended to every problem after a space (``""`` for none).
        seed: seeds the held-out split, its wording and the training stream.
        num_validation: size of the validation split (settings are tuned on it): the next distinct triples of the
            same draw, after the test split's (which is the same with or without it); never trained on.
    """

    def __init__(
        self,
        min_operand: int = 2,
        max_operand: int = 50,
        operations: list[WordOperation] | None = None,
        num_heldout: int = 200,
        instruction: str = "Answer with a number.",
        seed: int = 1234,
        num_validation: int = 0,
    ) -> None:
        if min_operand < 0:
            raise ValueError(f"ArithmeticWordTask: min_operand must be >= 0, got {min_operand}")
        if max_operand < min_operand:
            raise ValueError(
                f"ArithmeticWordTask: max_operand={max_operand} must be >= min_operand={min_operand}"
            )
        self.operations: list[str] = list(operations) if operations is not None else ["+", "-"]
        if not self.operations:
            raise ValueError("ArithmeticWordTask: operations must not be empty (use '+' and/or '-')")
        for op in self.operations:
            if op not in TEMPLATES:
                raise ValueError(f"ArithmeticWordTask: unknown operation {op!r} (use '+' or '-')")
        if num_heldout < 0 or num_validation < 0:
            raise ValueError(f"ArithmeticWordTask: num_heldout and num_validation must be >= 0, got {num_heldout} "
                             f"and {num_validation}")
        self.min_operand, self.max_operand = min_operand, max_operand
        self.instruction = instruction
        self.seed = seed
        total = len(self._all_keys())
        if num_heldout + num_validation >= total:
            raise ValueError(
                f"ArithmeticWordTask: num_heldout + num_validation = {num_heldout + num_validation} must be below "
                f"the {total} distinct problems of operands {min_operand}..{max_operand} with operations "
                f"{self.operations}"
            )
        rng = random.Random(f"{seed}:heldout")
        keys: list[tuple[int, str, int]] = []
        seen: set[tuple[int, str, int]] = set()
        while len(keys) < num_heldout + num_validation:
            key = self._draw_key(rng)
            if key not in seen:
                seen.add(key)
                keys.append(key)
        self._heldout_set = seen  # test and validation: never drawn for training
        rendered = [self._render(key, random.Random(f"{seed}:heldout-wording:{n}")) for n, key in enumerate(keys)]
        self._heldout, self._validation = rendered[:num_heldout], rendered[num_heldout:]

    def _all_keys(self) -> set[tuple[int, str, int]]:
        """Every distinct problem triple (subtraction counted once per unordered pair)."""
        span = range(self.min_operand, self.max_operand + 1)
        keys = set()
        for op in self.operations:
            for a in span:
                for b in span:
                    keys.add((max(a, b), op, min(a, b)) if op == "-" else (a, op, b))
        return keys

    def _draw_key(self, rng: random.Random) -> tuple[int, str, int]:
        a = rng.randint(self.min_operand, self.max_operand)
        b = rng.randint(self.min_operand, self.max_operand)
        op = rng.choice(self.operations)
        if op == "-" and b > a:
            a, b = b, a
        return a, op, b

    def _render(self, key: tuple[int, str, int], rng: random.Random) -> Prompt:
        a, op, b = key
        template_index = rng.randrange(len(TEMPLATES[op]))
        name = rng.choice(NAMES)
        singular, plural = rng.choice(ITEMS)
        return self.make_prompt(a, op, b, template_index, name, (singular, plural), self.instruction)

    @staticmethod
    def make_prompt(
        a: int, op: str, b: int, template_index: int = 0, name: str = "Tom",
        item: tuple[str, str] = ("apple", "apples"), instruction: str = "Answer with a number.",
    ) -> Prompt:
        """The prompt for ``a op b`` in one wording; ``answer`` is the result as a decimal string.

        ``metadata`` holds ``a``, ``op``, ``b``, the template index, the name (``None`` when the template
        names nobody) and the plural noun.
        """
        if op not in TEMPLATES:
            raise ValueError(f"ArithmeticWordTask.make_prompt: unknown operation {op!r} (use '+' or '-')")
        singular, plural = item

        def count(n: int) -> str:
            return f"{n} {singular if n == 1 else plural}"

        template = TEMPLATES[op][template_index]
        story = template.format(
            name=name, a=a, b=b, a_items=count(a), b_items=count(b), items=plural,
            b_noun=singular if b == 1 else plural,
        )
        text = f"{story} {instruction}" if instruction else story
        result = a + b if op == "+" else a - b
        metadata = {"a": a, "op": op, "b": b, "template": template_index,
                    "name": name if "{name}" in template else None, "item": plural}
        return Prompt(text=text, answer=str(result), metadata=metadata)

    def train_prompt(self, index: int) -> Prompt:
        if index < 0:
            raise ValueError(f"ArithmeticWordTask.train_prompt: index must be >= 0, got {index}")
        rng = random.Random(f"{self.seed}:train:{index}")
        while True:
            key = self._draw_key(rng)
            if key not in self._heldout_set:
                return self._render(key, rng)

    def heldout_prompts(self) -> list[Prompt]:
        return list(self._heldout)

    def validation_prompts(self) -> list[Prompt]:
        if not self._validation:
            raise NotImplementedError("ArithmeticWordTask has no validation split (set num_validation)")
        return list(self._validation)

    def default_reward(self) -> RewardFunction:
        return NumericAnswerReward()
