"""A reward with named parts of one's own (docs/extending_advanced.md, "A reward with named parts")."""

from __future__ import annotations

from rl_lightning.envs import Prompt, RewardFunction


class CorrectAndBrief(RewardFunction):
    """Exact match, with a bonus for brevity that only a correct answer earns: ``correct * (1 + bonus * brief)``.
    Each part is logged on its own (``train/reward/correct``, ``train/reward/brief``)."""

    def __init__(self, bonus: float = 0.5, max_chars: int = 3) -> None:
        self.bonus, self.max_chars = bonus, max_chars

    def parts(self, prompt: Prompt, response: str) -> dict[str, float]:
        return {"correct": float(response.strip() == prompt.answer),
                "brief": float(len(response.strip()) <= self.max_chars)}

    def combine(self, parts: dict[str, float]) -> float:
        return parts["correct"] * (1 + self.bonus * parts["brief"])

    def __call__(self, prompt: Prompt, response: str) -> float:
        return self.combine(self.parts(prompt, response))
