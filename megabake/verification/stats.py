"""Statistics for timings: median, percentile, seeded bootstrap intervals, paired ratios.

Contract: pure Python, no torch, deterministic. ``summarize(samples, seed=...)`` returns a
:class:`Summary` (median, 95% percentile-bootstrap interval of the median, the raw samples) whose
``to_dict()`` is the report's ``{"median", "ci95", "samples"}`` object. ``paired_ratio(a, b)`` is the
ratio of medians ``median(a) / median(b)`` of paired samples (sample i of a and of b were measured in the
same round) with an interval from resampling whole rounds, so round-to-round drift cancels.
Every bootstrap draws from its own ``random.Random(seed)``: same inputs and seed, same interval.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

DEFAULT_RESAMPLES = 2000
DEFAULT_LEVEL = 0.95


@dataclass(frozen=True)
class Summary:
    """Median of samples with its bootstrap interval; ``samples`` are kept raw, in measurement order."""

    median: float
    ci95: tuple[float, float]
    samples: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"median": self.median, "ci95": [self.ci95[0], self.ci95[1]], "samples": list(self.samples)}


@dataclass(frozen=True)
class Ratio:
    """A ratio of medians with its paired bootstrap interval."""

    median: float
    ci95: tuple[float, float]

    def to_dict(self) -> dict:
        return {"median": self.median, "ci95": [self.ci95[0], self.ci95[1]]}


def _check(samples: Sequence[float]) -> list[float]:
    values = [float(x) for x in samples]
    if not values:
        raise ValueError("no samples: need at least one value")
    if any(not math.isfinite(x) for x in values):
        raise ValueError(f"non-finite sample in {values[:8]}...")
    return values


def median(samples: Sequence[float]) -> float:
    """The middle value; the mean of the two middle values for an even count."""
    values = sorted(_check(samples))
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2.0


def percentile(samples: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) by linear interpolation between order statistics (numpy's default)."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} outside [0, 100]")
    values = sorted(_check(samples))
    rank = (len(values) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (rank - lo)


def _interval(estimates: list[float], level: float) -> tuple[float, float]:
    tail = (1.0 - level) / 2.0 * 100.0
    return percentile(estimates, tail), percentile(estimates, 100.0 - tail)


def bootstrap_ci(
    samples: Sequence[float],
    *,
    statistic: Callable[[Sequence[float]], float] = median,
    level: float = DEFAULT_LEVEL,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile-bootstrap interval of ``statistic`` (resampling with replacement, seeded)."""
    values = _check(samples)
    rng = random.Random(seed)
    n = len(values)
    estimates = [statistic([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples)]
    return _interval(estimates, level)


def summarize(samples: Sequence[float], *, seed: int = 0, resamples: int = DEFAULT_RESAMPLES) -> Summary:
    """Median + 95% bootstrap interval of the median + the raw samples."""
    values = _check(samples)
    return Summary(median(values), bootstrap_ci(values, seed=seed, resamples=resamples), values)


def paired_ratio(
    numerator: Sequence[float],
    denominator: Sequence[float],
    *,
    level: float = DEFAULT_LEVEL,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Ratio:
    """median(numerator) / median(denominator), interval from resampling paired rounds together."""
    a, b = _check(numerator), _check(denominator)
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    if min(b) <= 0.0:
        raise ValueError("denominator samples must be positive")
    rng = random.Random(seed)
    n = len(a)
    estimates = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        estimates.append(median([a[i] for i in idx]) / median([b[i] for i in idx]))
    return Ratio(median(a) / median(b), _interval(estimates, level))
