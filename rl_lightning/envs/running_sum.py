"""Running sums written out step by step: ``"3+7+2+9="`` -> ``"3+7=10;10+2=12;12+9=21;#21"``.

A single-turn task whose answers are long and written out (the study task of length-aware methods: BPCO's
length-adaptive lambda, EasyPPO's truncation filter, Score Centering's top-k head; docs/environments.md). With
the word-level tokenizer of ``embedded:running_sum`` (``models.tokenizer.build_number_tokenizer``: every number
0..999 one token) a step ``a+b=c;`` is 6 tokens, so the well-formed response to ``n`` terms is ``6n - 3`` tokens
with its EOS: 21 tokens for 4 terms, 69 for 12.
"""

from __future__ import annotations

import random
import re

from rl_lightning.envs.base import Prompt, RewardFunction, Task

_NUMBER = r"(0|[1-9][0-9]*)"
_STEP = re.compile(rf"{_NUMBER}\+{_NUMBER}={_NUMBER};")
_FINAL = re.compile(rf"#{_NUMBER}")


def running_sum_steps(terms: list[int]) -> str:
    """The well-formed, correct response to ``terms``: the running totals, then ``#`` and the sum.

    Example:
        >>> running_sum_steps([12, 35, 7, 40])
        '12+35=47;47+7=54;54+40=94;#94'
    """
    total, steps = terms[0], []
    for term in terms[1:]:
        steps.append(f"{total}+{term}={total + term};")
        total += term
    return "".join(steps) + f"#{total}"


def parse_running_sum(terms: list[int], response: str) -> int | None:
    """The final answer of ``response`` if it is well-formed for ``terms``, else ``None``.

    Well-formed: exactly ``len(terms) - 1`` steps ``a+b=c;`` (numbers without sign or leading zero), where step
    ``k``'s ``b`` is ``terms[k + 1]`` and its ``a`` is the previous step's ``c`` (the first step's: ``terms[0]``),
    then ``#`` and a number equal to the last step's ``c``, and nothing else (no spaces). The intermediate
    results ``c`` are not checked (a wrong one shows in the final answer).
    """
    pos, previous = 0, terms[0]
    for term in terms[1:]:
        step = _STEP.match(response, pos)
        if step is None:
            return None
        a, b, c = (int(g) for g in step.groups())
        if a != previous or b != term:
            return None
        previous, pos = c, step.end()
    final = _FINAL.fullmatch(response, pos)
    if final is None or int(final.group(1)) != previous:
        return None
    return previous


class RunningSumReward(RewardFunction):
    """1.0 for a well-formed response whose final answer is the exact sum, else 0.0.

    ``response`` is the decoded response without its EOS (as every reward function gets it). Well-formed is
    ``parse_running_sum``: the ``n - 1`` steps ``a+b=c;`` chaining the prompt's terms in order, each ``a`` the
    previous result, then ``#`` and the last result, nothing before, between or after. So:

    * correct: ``"3+7=10;10+2=12;#12"`` to ``3+7+2=`` -> 1.0;
    * a wrong step (``"3+7=11;11+2=13;#13"``) or wrong final answer (``"...;#11"``) -> 0.0;
    * malformed (a repeated, missing or extra step, a skipped or reordered term, a final answer that is not the last
      result, text after the answer, ``"#12"`` alone) -> 0.0;
    * cut at the token cap (no EOS) -> 0.0: a cut response either stops inside the grammar (no ``#N`` at its end)
      or holds more than ``n - 1`` steps, because the task preset's cap (``max_new_tokens``) holds the longest
      well-formed response with its EOS (69 tokens for 12 terms) -- a cap below that would let a response cut
      right after its answer score.

    Special tokens inside a response (``<unk>``, ``<pad>``) are dropped by the decoding before the reward sees it.
    The prompt's ``metadata["terms"]`` gives the terms (else they are parsed from its text ``"3+7+2="``).
    """

    def __call__(self, prompt: Prompt, response: str) -> float:
        terms = prompt.metadata.get("terms")
        if terms is None:
            terms = [int(t) for t in prompt.text.rstrip("=").split("+")]
        answer = parse_running_sum(list(terms), response)
        return 1.0 if answer is not None and answer == sum(terms) else 0.0


class RunningSumTask(Task):
    """Sum ``min_terms..max_terms`` numbers of ``1..max_term``, writing every running total.

    Prompt ``"3+7+2+9="`` (no spaces), reference answer ``"21"``, ``metadata["terms"]`` the list of terms; the
    default reward is ``RunningSumReward`` (1 for the well-formed steps with the exact sum, ending with EOS).
    The number of terms is uniform in ``[min_terms, max_terms]``, each term uniform in ``[1, max_term]``.

    The test split (``heldout_prompts``: ``num_heldout`` problems) and the validation split (``validation_prompts``:
    ``num_validation``) are distinct problems drawn once with ``seed`` (test first, in draw order); the training
    stream (``train_prompt(i)``, a pure function of ``seed`` and ``i``) redraws any problem of either split, so
    training never sees one.

    Args:
        min_terms: fewest terms of a problem (>= 2).
        max_terms: most terms; with ``max_term`` the sum must stay <= 999, one token of the number tokenizer.
        max_term: largest term.
        num_heldout: size of the test split.
        num_validation: size of the validation split.
        seed: seeds both splits and the training stream.
    """

    def __init__(self, min_terms: int = 4, max_terms: int = 12, max_term: int = 9, num_heldout: int = 500,
                 num_validation: int = 200, seed: int = 1234) -> None:
        if not 2 <= min_terms <= max_terms:
            raise ValueError(f"RunningSumTask: need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
        if max_term < 1 or max_terms * max_term > 999:
            raise ValueError(f"RunningSumTask: need 1 <= max_term and max_terms * max_term <= 999 (one number "
                             f"token), got {max_terms} * {max_term}")
        if num_heldout < 0 or num_validation < 0:
            raise ValueError(f"RunningSumTask: num_heldout and num_validation must be >= 0, got {num_heldout}, "
                             f"{num_validation}")
        self.min_terms, self.max_terms, self.max_term = min_terms, max_terms, max_term
        self.seed = seed
        total = sum(max_term**n for n in range(min_terms, max_terms + 1))
        if num_heldout + num_validation >= total // 2:
            raise ValueError(f"RunningSumTask: num_heldout + num_validation = {num_heldout + num_validation} is "
                             f"too many for the {total} problems")
        rng = random.Random(seed)
        keys: dict[tuple[int, ...], None] = {}  # draw order
        while len(keys) < num_heldout + num_validation:
            keys[self._draw(rng)] = None
        drawn = list(keys)
        self._heldout_keys, self._validation_keys = drawn[:num_heldout], drawn[num_heldout:]
        self._held_set = set(drawn)

    def _draw(self, rng: random.Random) -> tuple[int, ...]:
        n = rng.randint(self.min_terms, self.max_terms)
        return tuple(rng.randint(1, self.max_term) for _ in range(n))

    @staticmethod
    def make_prompt(terms: tuple[int, ...] | list[int]) -> Prompt:
        terms = [int(t) for t in terms]
        return Prompt(text="+".join(map(str, terms)) + "=", answer=str(sum(terms)), metadata={"terms": terms})

    def train_prompt(self, index: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + 7919 * index + 1)
        while True:
            key = self._draw(rng)
            if key not in self._held_set:
                return self.make_prompt(key)

    def heldout_prompts(self) -> list[Prompt]:
        return [self.make_prompt(key) for key in self._heldout_keys]

    def validation_prompts(self) -> list[Prompt]:
        if not self._validation_keys:
            raise NotImplementedError("RunningSumTask has no validation split: set num_validation > 0")
        return [self.make_prompt(key) for key in self._validation_keys]

    def default_reward(self) -> RewardFunction:
        return RunningSumReward()

    def max_response_tokens(self) -> int:
        """Tokens of the longest well-formed response with its EOS under the number tokenizer: ``6 max_terms - 3``."""
        return 6 * self.max_terms - 3
