"""Intervals and tests over independent units (reference images, references of a swap comparison).

One value per independent unit goes in (never a row, head or layer: those are not independent);
out come the mean with its Student t interval and a one-sided one-sample t test against 0:

* :func:`t_interval`: ``mean +- t_{n-1, (1 + c)/2} * s / sqrt(n)`` (``s`` the sample standard
  deviation, ``c`` the coverage), the classical two-sided interval of a mean;
* :func:`greater_than_zero`: the interval and the p-value of ``H0: mean <= 0`` against
  ``H1: mean > 0`` (``scipy.stats.ttest_1samp(..., alternative="greater")``), the test a verdict
  clause such as "rho beyond its null" is made of.

Both assume the units are independent and their values roughly normal (the t test is robust to
moderate skew at a few units; the size of the test is what tests/core/test_intervals.py checks).
Uses numpy and scipy (no torch), so reports can be rebuilt from saved files without torch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["CONFIDENCE", "UnitTest", "greater_than_zero", "t_interval"]

CONFIDENCE = 0.95
"""Default two-sided coverage of the intervals."""


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """Mean and Student t interval of independent values: ``mean +- t_{n-1} * s / sqrt(n)``.

    Args:
        values: ``(n,)`` one value per independent unit.
        confidence: two-sided coverage.

    Returns:
        ``(mean, low, high)``; the interval is ``(nan, nan)`` for ``n < 2`` and ``(mean, mean)`` when
        every value is equal.

    Example:
        >>> mean, low, high = t_interval([0.1, 0.2, 0.3])
        >>> round(mean, 3), round(low, 3), round(high, 3)
        (0.2, -0.048, 0.448)
    """
    from scipy.stats import t as student_t

    data = np.asarray(values, dtype=np.float64)
    mean = float(data.mean())
    if len(data) < 2:
        return mean, math.nan, math.nan
    half = float(student_t.ppf(0.5 + confidence / 2, len(data) - 1) * data.std(ddof=1) / math.sqrt(len(data)))
    return mean, mean - half, mean + half


@dataclass(frozen=True)
class UnitTest:
    """A mean over independent units, its Student t interval and its one-sided t test against 0.

    Attributes:
        n: number of units with a finite value.
        mean: their mean (NaN when ``n == 0``).
        low, high: the two-sided Student t interval of the mean at :data:`CONFIDENCE` (NaN when ``n < 2``).
        p: one-sided p-value of ``mean > 0`` (one-sample t test, ``n - 1`` degrees of freedom);
            NaN when ``n < 2`` or when every value is equal (no spread: the t statistic is undefined).
        significant: ``p < alpha``; False where ``p`` is NaN.
    """

    n: int
    mean: float
    low: float
    high: float
    p: float
    significant: bool

    def to_dict(self) -> dict[str, float | int | bool | None]:
        """JSON-ready fields (NaN as None)."""
        def clean(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "n": self.n,
            "mean": clean(self.mean),
            "low": clean(self.low),
            "high": clean(self.high),
            "p": clean(self.p),
            "significant": self.significant,
        }


def greater_than_zero(
    values: Sequence[float | None], *, alpha: float = 0.05, confidence: float = CONFIDENCE
) -> UnitTest:
    """One-sided one-sample t test of ``mean > 0`` over independent units, with the mean's interval.

    ``t = mean / (s / sqrt(n))`` against Student t with ``n - 1`` degrees of freedom
    (``scipy.stats.ttest_1samp(values, 0, alternative="greater")``); non-finite values and None
    (a unit where the quantity was not measured) are left out, and ``n`` counts what is left.

    Args:
        values: one value per unit (e.g. per reference image).
        alpha: size of the test.
        confidence: coverage of the two-sided interval reported beside it (the test at ``alpha``
            0.05 is the one-sided 95% bound, i.e. the lower end of a 90% two-sided interval).

    Returns:
        :class:`UnitTest`.

    Example:
        >>> result = greater_than_zero([0.2, 0.3, 0.25, 0.28])
        >>> result.n, result.significant, round(result.p, 5)
        (4, True, 0.00065)
    """
    from scipy.stats import ttest_1samp

    data = np.array([math.nan if v is None else float(v) for v in values], dtype=np.float64)
    data = data[np.isfinite(data)]
    n = int(data.size)
    if n == 0:
        return UnitTest(0, math.nan, math.nan, math.nan, math.nan, False)
    mean, low, high = t_interval(data, confidence)
    if n < 2 or float(np.ptp(data)) == 0.0:
        return UnitTest(n, mean, low, high, math.nan, False)
    with warnings.catch_warnings():  # nearly constant values: scipy warns about precision, p is defined
        warnings.simplefilter("ignore", RuntimeWarning)
        p = float(ttest_1samp(data, 0.0, alternative="greater").pvalue)
    return UnitTest(n, mean, low, high, p, bool(math.isfinite(p) and p < alpha))
