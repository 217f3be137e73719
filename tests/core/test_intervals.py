"""Intervals and one-sided tests over independent units: scipy's values, missing units, the test's size."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from nw_adapter.core.intervals import greater_than_zero, t_interval


def test_t_interval_is_scipys_student_t_interval() -> None:
    values = [0.3, -0.1, 0.45, 0.2, 0.05]
    mean, low, high = t_interval(values)
    expected = stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
    assert mean == pytest.approx(np.mean(values)) and (low, high) == pytest.approx(expected)
    assert t_interval([0.3, 0.3, 0.3]) == pytest.approx((0.3, 0.3, 0.3))
    assert all(math.isnan(x) for x in t_interval([0.3])[1:])


def test_greater_than_zero_is_scipys_one_sided_test_and_leaves_missing_units_out() -> None:
    values = [0.3, -0.1, 0.45, 0.2, 0.05]
    result = greater_than_zero([*values, None, math.nan, math.inf])
    assert result.n == 5
    assert result.p == pytest.approx(stats.ttest_1samp(values, 0.0, alternative="greater").pvalue)
    assert (result.low, result.high) == pytest.approx(t_interval(values)[1:])
    assert result.significant is (result.p < 0.05)
    assert greater_than_zero([-0.3, -0.2, -0.25]).significant is False  # a clear negative mean never passes


@pytest.mark.parametrize("values", [[], [0.4], [0.2, 0.2, 0.2]], ids=["none", "one", "constant"])
def test_no_test_without_spread_over_at_least_two_units(values) -> None:
    result = greater_than_zero(values)
    assert math.isnan(result.p) and result.significant is False
    assert result.to_dict()["p"] is None and result.n == len(values)


def test_the_size_of_the_test_is_alpha_under_no_effect() -> None:
    """3000 data sets of 6 units with mean 0: it rejects in about 5% (binomial sd 0.4%)."""
    rng = np.random.default_rng(0)
    rejections = sum(greater_than_zero(rng.normal(size=6)).significant for _ in range(3000))
    assert 0.04 * 3000 <= rejections <= 0.06 * 3000, rejections
    powered = sum(greater_than_zero(rng.normal(1.5, 1.0, size=6)).significant for _ in range(300))
    assert powered > 0.8 * 300  # and it has power against an effect of 1.5 sd
