"""Intervals and tests over independent units (reference images, references of a swap comparison).

One value per independent unit goes in (never a row, head or layer: those are not independent);
out come the mean with its Student t interval and a one-sided one-sample t test against 0:

* :func:`t_interval`: ``mean +- t_{n-1, (1 + c)/2} * s / sqrt(n)`` (``s`` the sample standard
  deviation, ``c`` the coverage), the classical two-sided interval of a mean;
* :func:`greater_than_zero`: the interval and the p-value of ``H0: mean <= 0`` against
  ``H1: mean > 0`` (``scipy.stats.ttest_1samp(..., alternative="greater")``), the test a verdict
  clause such as "rho beyond its null" is made of;
* :func:`two_level_greater`: the test of a trained value against a control of ``K`` random
  draws (seeds), over ``R`` units x ``K`` draws, whose standard error includes the variance
  between the draws (:func:`two_level_test` on the differences);
* :func:`equivalence_test`: two one-sided tests (TOST) of ``|mean - target| < margin`` over units,
  the test of a prediction in the theory's own units (an exponent of 2, within a stated margin).

Every test also gives the smallest effect it could detect with 80% power at its units (and draws):
``mde``, so a "not met" comes with what the run could have seen. A test whose values have no
spread at all (every unit the same value: an exact head with frozen queries) is decided by its
value, not left without a p-value: p is 0 when the value is beyond the margin, 1 otherwise.

Both assume the units are independent and their values roughly normal (the t test is robust to
moderate skew at a few units; the size of the test is what tests/core/test_intervals.py checks).
Uses numpy and scipy (no torch), so reports can be rebuilt from saved files without torch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

__all__ = [
    "CONFIDENCE",
    "EQUIVALENCE_TEST",
    "POWER",
    "TWO_LEVEL_TEST",
    "EquivalenceTest",
    "TwoLevelTest",
    "UnitTest",
    "equivalence_test",
    "greater_than_zero",
    "t_interval",
    "two_level_greater",
    "two_level_rejects",
    "two_level_test",
]

CONFIDENCE = 0.95
"""Default two-sided coverage of the intervals."""

POWER = 0.8
"""The power at which every test states its smallest detectable effect (``mde``)."""


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
            NaN when ``n < 2``; with every value equal (no spread) 0 when that value is > 0, else 1.
        significant: ``p < alpha``; False where ``p`` is NaN.
        se: the standard error ``s / sqrt(n)`` (NaN when ``n < 2``).
        mde: the smallest true mean the test detects with :data:`POWER` (80%) at these ``n`` units
            and this spread, ``(t_{n-1, 1-alpha} + t_{n-1, POWER}) se`` (0 without spread; NaN when
            ``n < 2``).
    """

    n: int
    mean: float
    low: float
    high: float
    p: float
    significant: bool
    se: float = math.nan
    mde: float = math.nan

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
            "se": clean(self.se),
            "mde": clean(self.mde),
        }


def _one_sample_mde(se: float, n: int, alpha: float, power: float = POWER) -> float:
    """``(t_{n-1, 1-alpha} + t_{n-1, power}) se``: the true mean a one-sided one-sample t test at
    ``alpha`` detects with probability ``power`` (the noncentral t approximated by a shifted t)."""
    from scipy.stats import t as student_t

    if n < 2 or not math.isfinite(se):
        return math.nan
    return float((student_t.isf(alpha, n - 1) + student_t.ppf(power, n - 1)) * se)


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
    if n < 2:
        return UnitTest(n, mean, low, high, math.nan, False)
    se = float(data.std(ddof=1)) / math.sqrt(n)
    if _no_spread(float(np.ptp(data)), mean):  # no spread: decided by the value
        p = 0.0 if mean > 0 else 1.0
        return UnitTest(n, mean, mean, mean, p, p < alpha, 0.0, 0.0)
    with warnings.catch_warnings():  # nearly constant values: scipy warns about precision, p is defined
        warnings.simplefilter("ignore", RuntimeWarning)
        p = float(ttest_1samp(data, 0.0, alternative="greater").pvalue)
    return UnitTest(
        n, mean, low, high, p, bool(math.isfinite(p) and p < alpha), se, _one_sample_mde(se, n, alpha)
    )


EQUIVALENCE_TEST = (
    "two one-sided tests (TOST) over reference images: mean - t_{n-1, 1-alpha} se > target - margin and "
    "mean + t_{n-1, 1-alpha} se < target + margin (se = s / sqrt(n)); p the larger of the two one-sided "
    "p-values (scipy.stats.ttest_1samp); without spread, decided by |mean - target| < margin"
)
"""The name and formula of :func:`equivalence_test`, as the verdict's method states it."""


@dataclass(frozen=True)
class EquivalenceTest:
    """``|mean - target| < margin`` over independent units: two one-sided t tests (TOST).

    Attributes:
        n: units with a finite value. mean: their mean. se: ``s / sqrt(n)``.
        target, margin: the prediction and the equivalence margin (the band ``target +- margin``).
        low, high: the ``1 - 2 alpha`` two-sided interval (90% at alpha 0.05), whose inclusion in the
            band is the TOST decision.
        p: the larger of the two one-sided p-values (NaN when ``n < 2``; 0 / 1 without spread).
        significant: ``p < alpha``: equivalent within the margin.
        mde: the narrowest margin the test establishes with :data:`POWER` (80%) for units whose true
            mean is exactly the target, ``(t_{n-1, 1-alpha} + t_{n-1, (1+POWER)/2}) se``; above
            ``margin``: too few units to tell.
    """

    n: int
    mean: float
    se: float
    target: float
    margin: float
    low: float
    high: float
    p: float
    significant: bool
    mde: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (NaN as None)."""

        def clean(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "n": self.n, "mean": clean(self.mean), "se": clean(self.se), "target": self.target,
            "margin": self.margin, "low": clean(self.low), "high": clean(self.high), "p": clean(self.p),
            "significant": self.significant, "mde": clean(self.mde),
        }  # fmt: skip


def equivalence_test(
    values: Sequence[float | None], *, target: float, margin: float, alpha: float = 0.05, power: float = POWER
) -> EquivalenceTest:
    """Two one-sided tests of ``target - margin < mean < target + margin`` over independent units.

    Each side is a one-sample t test (``scipy.stats.ttest_1samp``): ``mean > target - margin`` and
    ``mean < target + margin``; equivalence at ``alpha`` when both reject, i.e. the ``1 - 2 alpha``
    interval lies inside the band (Schuirmann 1987). Non-finite values and None are left out.

    Args:
        values: one value per unit (e.g. a reference image's exponent).
        target: the prediction (e.g. the theory's exponent 2).
        margin: the half-width of the band that counts as equal (> 0).
        alpha: the size of each one-sided test (and of the TOST).
        power: the power of :attr:`EquivalenceTest.mde`.

    Example:
        >>> result = equivalence_test([1.9, 2.05, 1.98, 2.02], target=2.0, margin=0.5)
        >>> result.significant, round(result.mean, 3)
        (True, 1.988)
    """
    from scipy.stats import t as student_t
    from scipy.stats import ttest_1samp

    if not (isinstance(margin, int | float) and math.isfinite(margin) and margin > 0):
        raise ValueError(f"margin must be a finite number > 0, got {margin!r}")
    data = np.array([math.nan if v is None else float(v) for v in values], dtype=np.float64)
    data = data[np.isfinite(data)]
    n = int(data.size)
    nan = math.nan
    if n == 0:
        return EquivalenceTest(0, nan, nan, target, margin, nan, nan, nan, False, nan)
    mean = float(data.mean())
    if n < 2:
        return EquivalenceTest(n, mean, nan, target, margin, nan, nan, nan, False, nan)
    se = float(data.std(ddof=1)) / math.sqrt(n)
    if _no_spread(float(np.ptp(data)), mean):  # no spread: decided by the value
        inside = abs(mean - target) < margin
        return EquivalenceTest(n, mean, 0.0, target, margin, mean, mean, 0.0 if inside else 1.0, inside, 0.0)
    half = float(student_t.isf(alpha, n - 1)) * se
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        p_low = float(ttest_1samp(data, target - margin, alternative="greater").pvalue)
        p_high = float(ttest_1samp(data, target + margin, alternative="less").pvalue)
    p = max(p_low, p_high)
    mde = float((student_t.isf(alpha, n - 1) + student_t.ppf(0.5 + power / 2, n - 1)) * se)
    return EquivalenceTest(n, mean, se, target, margin, mean - half, mean + half, p, p < alpha, mde)


TWO_LEVEL_TEST = (
    "two-level test over reference images x control draws: d_r = trained_r - mean_k control_rk, "
    "SE^2 = a + b with a = s_d^2 / R (s_d: SD of d_r over the R references) and b = s_draws^2 / K + "
    "s_draws^2 (s_draws: SD over the K draws of the per-draw mean differences; s_draws^2 / K for the "
    "control's mean, s_draws^2 for the trained adapter's own draw of the initialisation, which it is "
    "when nothing was learned); one-sided, "
    "mean - margin > sqrt(t_{R-1}^2 a + t_{K-1}^2 b) (Banerjee's conservative critical value, at "
    "1 - alpha quantiles; the 95% interval at 0.975 quantiles); K = 1: one-sample t test over references"
)
"""The name and formula of :func:`two_level_test`, as the verdict's method states it."""

ONE_DRAW_CAVEAT = (
    "one control draw: the variance between draws is not estimated, so an offset of that draw shared "
    "by every reference reads as an effect; record several draws"
)
"""The caveat of a two-level test with ``K = 1``."""


@dataclass(frozen=True)
class TwoLevelTest:
    """A mean difference from a control of several draws, its interval and its one-sided test.

    Attributes:
        n: references kept (a value in every kept draw).
        draws: control draws kept (``K``).
        mean: mean over references and draws of ``trained - control`` (NaN when none).
        low, high: its two-sided interval at the given coverage (NaN when ``n < 2``).
        se: ``sqrt(a + b)`` (see :data:`TWO_LEVEL_TEST`).
        margin: the smallest effect counted: the test is of ``mean > margin``.
        p: one-sided p-value (NaN without a test: ``n < 2``; with no spread at all, 0 when the
            mean is above the margin, else 1).
        significant: ``p < alpha``; False where ``p`` is NaN.
        dropped_references, dropped_draws: units and draws left out for a missing value.
        caveat: why the test is weaker than it looks (one draw), else None.
        mde: the smallest true mean difference the test detects with :data:`POWER` (80%) at these
            references and draws, the draws' offsets included: ``margin + sqrt(t_{R-1, 1-alpha}^2 a
            + t_{K-1, 1-alpha}^2 b) + sqrt(t_{R-1, POWER}^2 a + t_{K-1, POWER}^2 b)`` (NaN when
            ``n < 2``).
    """

    n: int
    draws: int
    mean: float
    low: float
    high: float
    se: float
    margin: float
    p: float
    significant: bool
    dropped_references: int = 0
    dropped_draws: int = 0
    caveat: str | None = None
    mde: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (NaN as None)."""

        def clean(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "n": self.n,
            "draws": self.draws,
            "mean": clean(self.mean),
            "low": clean(self.low),
            "high": clean(self.high),
            "se": clean(self.se),
            "margin": self.margin,
            "p": clean(self.p),
            "significant": self.significant,
            "dropped_references": self.dropped_references,
            "dropped_draws": self.dropped_draws,
            "caveat": self.caveat,
            "mde": clean(self.mde),
        }


def _complete_cases(differences: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Drop the draws without any finite value, then the references missing a kept draw (every
    reference when no draw is kept: no reference has a value)."""
    finite = np.isfinite(differences)
    keep_draws = finite.any(0)
    kept = differences[:, keep_draws]
    keep_refs = np.isfinite(kept).all(1) & bool(keep_draws.any())
    return kept[keep_refs], int((~keep_refs).sum()), int((~keep_draws).sum())


def _critical(alpha: float, a: float, b: float, n: int, draws: int) -> float:
    """Banerjee's critical value ``sqrt(t_{n-1, 1-alpha}^2 a + t_{K-1, 1-alpha}^2 b)``."""
    from scipy.stats import t as student_t

    q_refs = float(student_t.isf(alpha, n - 1))
    q_draws = float(student_t.isf(alpha, draws - 1)) if b > 0 else 0.0  # K = 1: b = 0
    return math.sqrt(q_refs**2 * a + q_draws**2 * b)


def _two_level_mde(alpha: float, a: float, b: float, n: int, draws: int, margin: float) -> float:
    """The mean difference detected with :data:`POWER`: ``margin + critical(alpha) + critical(1 - POWER)``."""
    return margin + _critical(alpha, a, b, n, draws) + _critical(1.0 - POWER, a, b, n, draws)


NO_SPREAD = 1e-12
"""Relative spread below which a test's values count as having none (float rounding of equal values:
an exact head's exponent 2.000 computed per reference differs by ~1e-16)."""


def _no_spread(spread: float, mean: float) -> bool:
    """Whether ``spread`` (a range or a standard error) is float rounding of equal values around ``mean``."""
    return spread <= NO_SPREAD * max(1.0, abs(mean))


_P_FLOOR = 1e-15
"""Smallest p-value :func:`two_level_test` reports (Student t quantiles with 1 degree of freedom
overflow far below it)."""


def _banerjee_p(excess: float, a: float, b: float, n: int, draws: int) -> float:
    """The smallest alpha at which ``excess > critical(alpha)`` (1 - that of ``-excess`` when < 0)."""
    from scipy.optimize import brentq

    if excess == 0:
        return 0.5
    target = abs(excess)
    if target > _critical(_P_FLOOR, a, b, n, draws):
        upper = _P_FLOOR
    else:
        upper = brentq(lambda x: _critical(x, a, b, n, draws) - target, _P_FLOOR, 0.5, xtol=1e-18, rtol=1e-10)
    return upper if excess > 0 else 1.0 - upper


def two_level_rejects(
    differences: np.ndarray, *, margin: float = 0.0, alpha: float = 0.05, trained_is_a_draw: bool = True
) -> np.ndarray:
    """Vectorised decision of :func:`two_level_test` for many data sets at once (simulations).

    Args:
        differences: ``[S, R, K]`` finite values, ``R >= 2``, ``K >= 2`` (S data sets).

    Returns:
        bool ``[S]``: ``mean - margin > sqrt(t_{R-1}^2 a + t_{K-1}^2 b)`` and ``SE > 0``, the rule
        :func:`two_level_test` calls significant.
    """
    from scipy.stats import t as student_t

    data = np.asarray(differences, dtype=np.float64)
    _, n, draws = data.shape
    a = data.mean(2).var(1, ddof=1) / n
    b = (1 / draws + float(trained_is_a_draw)) * data.mean(1).var(1, ddof=1)
    q_refs, q_draws = student_t.isf(alpha, n - 1), student_t.isf(alpha, draws - 1)
    critical = np.sqrt(q_refs**2 * a + q_draws**2 * b)
    return (data.mean((1, 2)) - margin > critical) & (a + b > 0)


def two_level_test(
    differences: Sequence[Sequence[float | None]] | np.ndarray,
    *,
    margin: float = 0.0,
    alpha: float = 0.05,
    confidence: float = CONFIDENCE,
    trained_is_a_draw: bool = True,
) -> TwoLevelTest:
    """One-sided test of ``mean > margin`` over references x control draws (:data:`TWO_LEVEL_TEST`).

    ``differences[r, k]`` is unit ``r``'s trained value minus control draw ``k``'s. With
    ``d_r = mean_k differences[r, k]`` and ``m_k = mean_r differences[r, k]``:
    ``a = var_r(d_r) / R`` and ``b = (1 + 1/K) var_k(m_k)``; ``SE^2 = a + b``. The draws share
    their offset across references, so ``b`` does not shrink with ``R``: more references never
    turn an offset between draws into evidence. ``b`` counts the offset twice: ``var_k / K`` for
    the mean of the K control draws, and ``var_k`` once more for the trained adapter, which, when
    nothing was learned, is one more draw of the initialisation with an offset of its own. The
    critical value ``sqrt(t_{R-1}^2 a + t_{K-1}^2 b)`` (Banerjee 1960) keeps the size at most
    ``alpha`` for every ratio of the two variances, where the Welch-Satterthwaite degrees of
    freedom do not with 2 or 3 draws (tests/core/test_intervals.py simulates both). With ``K = 1``
    it is the one-sample t test of ``d_r - margin`` (``b`` cannot be estimated:
    :data:`ONE_DRAW_CAVEAT`).

    Draws without any finite value are dropped, then references missing a value of a kept draw (with
    no draw kept, every reference: ``n`` 0).

    Args:
        differences: ``[R, K]`` trained minus control, per reference and draw.
        margin: the smallest effect counted (>= 0): values within it of the control never count.
        alpha: size of the test.
        confidence: coverage of the two-sided interval.
        trained_is_a_draw: count the trained adapter's own offset (``var_k`` in ``b``); False
            tests the trained value against the mean of the control's draws only (``b = var_k / K``),
            which keeps the size when only the control's draws have offsets, not when the
            trained adapter's initialisation had one (tests/core/test_intervals.py).

    Returns:
        :class:`TwoLevelTest`.

    Example:
        >>> result = two_level_test([[0.30, 0.28, 0.33], [0.21, 0.20, 0.24], [0.26, 0.22, 0.27]])
        >>> result.n, result.draws, result.significant
        (3, 3, True)
    """
    from scipy.stats import t as student_t

    data = np.asarray(differences, dtype=np.float64).reshape(len(differences), -1)  # None -> NaN
    kept, dropped_refs, dropped_draws = _complete_cases(data)
    n, draws = kept.shape
    nan = math.nan
    untested = TwoLevelTest(
        n, draws, nan, nan, nan, nan, margin, nan, False, dropped_refs, dropped_draws,
        ONE_DRAW_CAVEAT if draws == 1 else None,
    )  # fmt: skip
    if n == 0 or draws == 0:
        return untested
    per_ref = kept.mean(1)
    mean = float(per_ref.mean())
    if n < 2:
        return replace(untested, mean=mean)
    a = float(per_ref.var(ddof=1)) / n
    b = (1 / draws + float(trained_is_a_draw)) * float(kept.mean(0).var(ddof=1)) if draws > 1 else 0.0
    se = math.sqrt(a + b)
    half = _critical((1 - confidence) / 2, a, b, n, draws)
    mde = _two_level_mde(alpha, a, b, n, draws, margin)
    measured = replace(untested, mean=mean, low=mean - half, high=mean + half, se=se, mde=mde)
    if _no_spread(se, mean):  # every reference and draw the same difference: decided by the value
        above = mean > margin
        return replace(measured, se=0.0, low=mean, high=mean, mde=margin, p=0.0 if above else 1.0,
                       significant=above)  # fmt: skip
    if draws == 1:
        p = float(student_t.sf((mean - margin) / se, n - 1))
    else:
        p = _banerjee_p(mean - margin, a, b, n, draws)
    return replace(measured, p=p, significant=bool(math.isfinite(p) and p < alpha))


def two_level_greater(
    trained: Sequence[float | None] | np.ndarray,
    control: Sequence[Sequence[float | None]] | np.ndarray,
    *,
    margin: float = 0.0,
    alpha: float = 0.05,
    confidence: float = CONFIDENCE,
) -> TwoLevelTest:
    """:func:`two_level_test` of ``trained[r] - control[r, k]``: is the trained value above the control's?

    Args:
        trained: ``[R]`` one value per reference (or ``[R, K]``, paired per draw).
        control: ``[R, K]`` the control's value per reference and draw.
        margin, alpha, confidence: as :func:`two_level_test`.

    Example:
        >>> result = two_level_greater([1.0, 1.2, 0.9], [[0.1, 0.2], [0.3, 0.2], [0.0, 0.1]])
        >>> result.draws, round(result.mean, 3)
        (2, 0.883)
    """
    control_values = np.asarray(control, dtype=np.float64)  # None -> NaN
    trained_values = np.asarray(trained, dtype=np.float64)
    if trained_values.ndim == 1:
        trained_values = trained_values[:, None]
    return two_level_test(trained_values - control_values, margin=margin, alpha=alpha, confidence=confidence)
