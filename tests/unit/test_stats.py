"""Paired before/after comparison: McNemar's exact test and a bootstrap interval on F1."""

from __future__ import annotations

import math

import pytest

from rljob.stats import bootstrap_interval, compare_paired, mcnemar_exact


def test_mcnemar_exact_matches_the_binomial_tail() -> None:
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 5) == 1.0
    # 9 gained, 1 lost: p = 2 * P(X <= 1 | n=10, 1/2) = 2 * 11 / 1024
    assert mcnemar_exact(9, 1) == pytest.approx(22 / 1024)
    assert mcnemar_exact(1, 9) == mcnemar_exact(9, 1)
    assert mcnemar_exact(20, 0) == pytest.approx(2 / 2**20)


def test_bootstrap_interval_covers_the_mean_and_shrinks_with_n() -> None:
    small = [1.0, -1.0] * 10
    large = [1.0, -1.0] * 1000
    lo_s, hi_s = bootstrap_interval(small, resamples=2000)
    lo_l, hi_l = bootstrap_interval(large, resamples=2000)
    assert lo_s < 0 < hi_s and lo_l < 0 < hi_l
    assert hi_l - lo_l < (hi_s - lo_s) / 5
    assert bootstrap_interval([0.5] * 7) == (0.5, 0.5)


def test_compare_paired_counts_flips_on_shared_questions_only() -> None:
    before = [{"id": f"q{i}", "em": float(i < 10), "f1": 0.5 * (i < 10)} for i in range(100)]
    after = [{"id": f"q{i}", "em": float(i < 25), "f1": 0.6 * (i < 25)} for i in range(100)]
    after.append({"id": "extra", "em": 1.0, "f1": 1.0})  # not in `before`: ignored
    c = compare_paired(before, after)
    assert c.questions == 100 and c.em_gained == 15 and c.em_lost == 0
    assert c.em_gain == pytest.approx(0.15) and c.em_p_value == pytest.approx(2 / 2**15)
    assert c.f1_gain == pytest.approx((25 * 0.6 - 10 * 0.5) / 100)
    low, high = c.f1_gain_interval
    assert low < c.f1_gain < high and low > 0
    assert "McNemar" in c.line() and math.isfinite(c.em_p_value)
    with pytest.raises(ValueError, match="share no question"):
        compare_paired(before, [{"id": "x", "em": 0, "f1": 0}])
