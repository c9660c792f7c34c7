"""megabake.verification.stats against known inputs: median, percentile, seeded bootstrap, paired ratio."""

import math
import random

import pytest

from megabake.verification.stats import Summary, bootstrap_ci, median, paired_ratio, percentile, summarize


def test_median_odd_even_and_unsorted():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4, 1, 3, 2]) == 2.5
    assert median([7]) == 7.0


def test_percentile_matches_linear_interpolation():
    values = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert percentile(values, 0) == 1
    assert percentile(values, 100) == 10
    assert percentile(values, 50) == 5.5
    assert percentile(values, 25) == pytest.approx(3.25)  # numpy.percentile(range(1, 11), 25)
    assert percentile(values, 2.5) == pytest.approx(1.225)


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [float("inf")]])
def test_rejects_empty_and_non_finite(bad):
    with pytest.raises(ValueError):
        median(bad)


def test_bootstrap_of_constant_is_degenerate():
    assert bootstrap_ci([0.5] * 40) == (0.5, 0.5)


def test_bootstrap_is_seeded_and_reproducible():
    rng = random.Random(1)
    data = [rng.gauss(1.0, 0.1) for _ in range(40)]
    assert bootstrap_ci(data, seed=3) == bootstrap_ci(data, seed=3)
    assert bootstrap_ci(data, seed=3) != bootstrap_ci(data, seed=4)


def test_bootstrap_interval_of_median_of_1_to_100():
    # The median of 1..100 is 50.5; a 95% interval of a sample median of n=100 spans order statistics
    # near 50 -/+ 1.96 * sqrt(100) / 2, i.e. about 40..61.
    lo, hi = bootstrap_ci(list(range(1, 101)), seed=0)
    assert 40 <= lo < 50.5 < hi <= 61


def test_bootstrap_coverage_on_normal_samples():
    # Over many seeded normal samples the 95% interval of the median covers the true median most times.
    rng = random.Random(7)
    covered = 0
    trials = 60
    for t in range(trials):
        data = [rng.gauss(2.0, 0.3) for _ in range(40)]
        lo, hi = bootstrap_ci(data, seed=t, resamples=500)
        covered += lo <= 2.0 <= hi
    assert covered / trials >= 0.85


def test_summarize_shape_and_raw_samples():
    data = [1.0, 3.0, 2.0, 5.0, 4.0]
    s = summarize(data)
    assert isinstance(s, Summary)
    d = s.to_dict()
    assert d["median"] == 3.0
    assert d["samples"] == data  # raw, in measurement order
    assert d["ci95"][0] <= 3.0 <= d["ci95"][1]


def test_paired_ratio_exact_when_constant_ratio():
    a = [2.0 * x for x in range(1, 41)]
    b = [float(x) for x in range(1, 41)]
    r = paired_ratio(a, b)
    assert r.median == pytest.approx(2.0)
    assert r.ci95[0] == pytest.approx(2.0) and r.ci95[1] == pytest.approx(2.0)


def test_paired_ratio_cancels_common_drift():
    # A shared drift across rounds widens unpaired intervals but not the paired ratio's.
    drift = [1.0 + 0.5 * math.sin(i) for i in range(40)]
    base = [1.5 * d for d in drift]
    mk = [0.5 * d for d in drift]
    r = paired_ratio(base, mk)
    assert r.median == pytest.approx(3.0)
    assert r.ci95[1] - r.ci95[0] < 1e-9


def test_paired_ratio_checks_lengths_and_sign():
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        paired_ratio([1.0], [0.0])
