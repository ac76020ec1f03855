"""Paired before/after comparison: McNemar's exact test and a bootstrap interval on F1."""

from __future__ import annotations

import math

import pytest

from rljob.stats import bootstrap_interval, compare_paired, compare_replicated, mcnemar_exact, sign_flip_p_value


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


def test_sign_flip_p_value_agrees_with_mcnemar_on_one_run() -> None:
    diffs = [1.0] * 9 + [-1.0] + [0.0] * 90  # 9 gained, 1 lost
    assert sign_flip_p_value(diffs) == pytest.approx(mcnemar_exact(9, 1), abs=0.005)
    assert sign_flip_p_value([0.0] * 10) == 1.0
    assert sign_flip_p_value([1.0, -1.0] * 20) > 0.9


def test_compare_replicated_averages_seeds_per_question() -> None:
    ids = [f"q{i}" for i in range(200)]

    def run(correct_before: int, correct_after: int) -> tuple[list[dict], list[dict]]:
        before = [
            {"id": q, "em": float(i < correct_before), "f1": float(i < correct_before)} for i, q in enumerate(ids)
        ]
        after = [{"id": q, "em": float(i < correct_after), "f1": float(i < correct_after)} for i, q in enumerate(ids)]
        return before, after

    pooled = compare_replicated([run(10, 30), run(10, 14), run(12, 20)])  # +20, +4, +8 of 200
    assert pooled.replicates == 3 and pooled.questions == 200
    assert pooled.em_gains == pytest.approx((0.10, 0.02, 0.04))
    assert pooled.em_gain == pytest.approx(0.16 / 3)
    assert pooled.em_gain_spread == pytest.approx(0.0416, abs=1e-3)
    low, high = pooled.em_gain_interval
    assert 0 < low < pooled.em_gain < high and pooled.em_p_value < 0.001
    assert "3 replicates x 200 questions" in pooled.line()
    flat = compare_replicated([run(10, 10), run(10, 10)])
    assert flat.em_gain == 0 and flat.em_p_value == 1.0 and flat.em_gain_interval == (0.0, 0.0)
    with pytest.raises(ValueError, match="share no question"):
        compare_replicated([run(1, 2), ([{"id": "x", "em": 0, "f1": 0}], [{"id": "x", "em": 0, "f1": 0}])])
