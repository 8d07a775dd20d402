"""experiments/report.py's compute axes (issue 22): the compute spent before an evaluation, the held-out reward at
a compute budget (linear between evaluations) and the equal-compute table, on hand-made runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from report import Run, at_compute, equal_compute_lines  # noqa: E402


def run(method: str, val: list[tuple[int, float]], tokens: float, seconds: float, steps: int) -> Run:
    return Run(Path(f"runs/{method}"), method, "0", val, [], 0.0, steps,
               [(s, tokens) for s in range(steps)], [(s, seconds) for s in range(steps)])


def test_compute_before_an_evaluation_sums_the_steps_before_it():
    r = run("A", [(0, 0.1), (2, 0.5), (4, 0.9)], tokens=100.0, seconds=0.5, steps=4)
    # the evaluation at step 2 follows updates 0 and 1
    assert [r.compute_at(s, "tokens") for s in (0, 2, 4)] == [0.0, 200.0, 400.0]
    assert r.compute_at(4, "seconds") == 2.0


def test_reward_at_a_budget_is_linear_between_evaluations():
    r = run("A", [(0, 0.1), (2, 0.5), (4, 0.9)], tokens=100.0, seconds=0.5, steps=4)
    assert at_compute(r, 0.0, "tokens") == pytest.approx(0.1)
    assert at_compute(r, 300.0, "tokens") == pytest.approx(0.7)  # half-way from 0.5 (200 tokens) to 0.9 (400)
    assert at_compute(r, 1.5, "seconds") == pytest.approx(0.7)
    with pytest.raises(ValueError, match="outside its evaluations"):
        at_compute(r, 401.0, "tokens")


def test_equal_compute_table_takes_the_budget_every_run_reached():
    cheap = run("Cheap", [(0, 0.2), (10, 0.6)], tokens=10.0, seconds=0.1, steps=10)   # 100 tokens, 1 s in all
    costly = run("Costly", [(0, 0.2), (2, 0.8)], tokens=100.0, seconds=1.0, steps=2)  # 200 tokens, 2 s in all
    lines = equal_compute_lines([cheap, costly], "###")
    text = "\n".join(lines)
    assert "100 tokens and 1.0 s" in text
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| C")}
    # Cheap at its end (0.6); Costly half-way through its first two steps: 0.2 + 0.6 / 2 = 0.5
    assert rows["Cheap"] == "| Cheap | 10 | 0.100 | 0.600 [0.600–0.600] | 0.600 [0.600–0.600] |"
    assert rows["Costly"] == "| Costly | 100 | 1.000 | 0.500 [0.500–0.500] | 0.500 [0.500–0.500] |"
