"""Group-relative advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest

from rljob.trainer.advantages import group_advantages, is_degenerate


def test_centered_and_scaled_by_unbiased_std() -> None:
    # rewards 1, 0, 0, 1: mean 0.5, deviations +-0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], scale=True, eps=0.0)
    std = math.sqrt(1.0 / 3.0)
    assert adv == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-12)
    assert adv[0] == pytest.approx(0.8660254, rel=1e-6)


def test_unscaled_is_reward_minus_mean() -> None:
    assert group_advantages([3.0, 1.0, 2.0], scale=False) == pytest.approx([1.0, -1.0, 0.0])


def test_eps_keeps_tiny_spreads_finite() -> None:
    adv = group_advantages([1.0, 1.0 + 1e-12], scale=True, eps=1e-6)
    assert all(math.isfinite(a) and abs(a) < 1e-5 for a in adv)


@pytest.mark.parametrize("rewards", [[0.0, 0.0, 0.0], [0.7, 0.7], [1.0]])
def test_all_equal_groups_get_exactly_zero(rewards: list[float]) -> None:
    assert is_degenerate(rewards)
    assert group_advantages(rewards, scale=True) == [0.0] * len(rewards)
    assert group_advantages(rewards, scale=False) == [0.0] * len(rewards)


def test_groups_are_independent_and_may_differ_in_size() -> None:
    out = [group_advantages(g, scale=False) for g in ([1.0, 0.0], [5.0, 5.0, 5.0], [2.0, 4.0, 6.0])]
    assert out == [[0.5, -0.5], [0.0, 0.0, 0.0], [-2.0, 0.0, 2.0]]
    assert not is_degenerate([0.0, 1.0])
