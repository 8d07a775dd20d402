"""Verifiers for math answers: ``MathVerifyReward`` (Hugging Face's ``math-verify``, an optional extra, with the
built-in ``NumericAnswerReward`` as its fallback) and ``BoxedFormatReward`` (a format reward to weigh beside a
correctness one with ``WeightedRewards``)."""

from __future__ import annotations

import threading
from typing import Any

from rl_lightning.envs.rewards import Prompt, RewardFunction
from rl_lightning.envs.word_problems import NumericAnswerReward, extract_answer, last_boxed


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


class MathVerifyReward(RewardFunction):
    """1.0 when ``math-verify`` finds the response's final answer equal to the reference, else 0.0.

    The reference is read as ``extract_answer`` reads it (a GSM8K ``... #### 42`` gives ``42``, a ``\\boxed{}`` its
    content) and parsed as LaTeX or plain math; the response is parsed whole (``math-verify`` takes its last
    ``\\boxed{}`` or final expression), so ``\\boxed{\\frac{84}{2}}``, ``42.0`` and ``\\boxed{42} (checked)`` equal 42,
    and symbolic answers (``\\sqrt{2}/2``, sets, intervals) compare as math, not as strings.

    Args:
        fallback: ``True``: when ``math-verify`` is not installed, or parses nothing out of the reference, score with
            ``NumericAnswerReward`` (numbers only) instead; ``False``: refuse then.

    Raises:
        ImportError: ``math-verify`` is missing and ``fallback`` is off (install ``.[math]``).
        ValueError: the prompt has no reference answer.
    """

    def __init__(self, fallback: bool = True) -> None:
        self.fallback = fallback
        self._numeric = NumericAnswerReward()
        if _math_verify() is None and not fallback:
            raise ImportError('MathVerifyReward needs math-verify: pip install -e ".[math]" (or fallback: true)')

    def __call__(self, prompt: Prompt, response: str) -> float:
        if prompt.answer is None:
            raise ValueError(f"MathVerifyReward needs a reference answer; prompt {prompt.text!r} has none")
        mv = _math_verify()
        if mv is None:
            return self._numeric(prompt, response)
        # math-verify's time limits use SIGALRM, which only the main thread may set (an asynchronous producer's
        # thread scores too): off elsewhere
        limit = 5 if threading.current_thread() is threading.main_thread() else None
        reference = extract_answer(str(prompt.answer)).strip()
        gold = mv.parse(reference if last_boxed(reference) is not None else f"${reference}$", parsing_timeout=limit)
        if not gold:
            if self.fallback:
                return self._numeric(prompt, response)
            raise ValueError(f"MathVerifyReward: math-verify parses nothing from the reference {prompt.answer!r}")
        return 1.0 if mv.verify(gold, mv.parse(response, parsing_timeout=limit), timeout_seconds=limit) else 0.0


class BoxedFormatReward(RewardFunction):
    """1.0 when the response puts an answer in a ``\\boxed{...}`` (balanced braces), else 0.0: a format reward."""

    def __call__(self, prompt: Prompt, response: str) -> float:
        return 1.0 if last_boxed(response) is not None else 0.0
