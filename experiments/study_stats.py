"""The statistics of a study's report (experiments/study.py): intervals over seeds and paired tests.

Pure functions over plain lists of floats, so a test can check them on hand-computed numbers.

* ``mean_ci``: the mean over seeds and its two-sided 95 % Student-t interval (``n - 1`` degrees of freedom).
* ``paired_seeds``: a method against the study's baseline, paired by seed (the same seed draws the same prompt
  stream for both): the mean difference, its t interval and the two-sided paired t-test's p-value. This is the
  test a verdict rests on: it includes the training randomness between seeds.
* ``paired_items``: the same two methods paired by held-out item (each item's mean outcome over the last
  evaluations and the seeds): the mean difference and the two-sided p-value of a paired t-test over items. It
  measures only the evaluation noise, so it is shown beside the seed test, never as the verdict.
* ``verdict``: "better" / "worse" where the seed-paired 95 % interval excludes 0, else "within noise".
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from scipy import stats

LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    def fmt(self, digits: int = 3) -> str:
        if self.n < 2 or math.isnan(self.low):
            return f"{self.mean:.{digits}f} (n={self.n})"
        return f"{self.mean:.{digits}f} ± {(self.high - self.low) / 2:.{digits}f}"


@dataclass(frozen=True)
class Paired:
    diff: Interval  # the mean difference (method - baseline) and its interval
    p: float  # two-sided p-value of the paired t-test (NaN with fewer than 2 pairs or no spread)


def mean_ci(values: list[float], level: float = LEVEL) -> Interval:
    """Mean and two-sided ``level`` Student-t interval; NaN bounds with fewer than 2 values, a zero-width interval
    when every value is equal."""
    n = len(values)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = sum(values) / n
    if n < 2:
        return Interval(mean, math.nan, math.nan, n)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    if sd <= 8 * sys.float_info.epsilon * max(1.0, *map(abs, values)):  # equal up to rounding: zero width
        sd = 0.0
    half = stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def _paired(a: list[float], b: list[float], level: float) -> Paired:
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    diffs = [x - y for x, y in zip(a, b)]
    interval = mean_ci(diffs, level)
    if len(diffs) < 2:
        return Paired(interval, math.nan)
    scale = max(abs(v) for v in [*a, *b, 1.0])
    if max(diffs) - min(diffs) <= 8 * sys.float_info.epsilon * scale:  # no spread beyond the rounding of a - b
        return Paired(interval, 1.0 if abs(interval.mean) <= 8 * sys.float_info.epsilon * scale else 0.0)
    return Paired(interval, float(stats.ttest_rel(a, b).pvalue))


def paired_seeds(method: dict[int, float], baseline: dict[int, float], level: float = LEVEL) -> Paired:
    """``method`` against ``baseline`` over the seeds both have (seed -> the run's headline value)."""
    seeds = sorted(set(method) & set(baseline))
    return _paired([method[s] for s in seeds], [baseline[s] for s in seeds], level)


def paired_items(method: list[float], baseline: list[float], level: float = LEVEL) -> Paired:
    """``method`` against ``baseline`` over held-out items (each item's mean outcome), NaN items dropped."""
    pairs = [(x, y) for x, y in zip(method, baseline) if not (math.isnan(x) or math.isnan(y))]
    return _paired([x for x, _ in pairs], [y for _, y in pairs], level)


def verdict(paired: Paired) -> str:
    """"better" / "worse" where the paired interval of the difference excludes 0, else "within noise"."""
    d = paired.diff
    if d.n < 2 or math.isnan(d.low):
        return "too few seeds"
    if d.low > 0:
        return "better"
    if d.high < 0:
        return "worse"
    return "within noise"
