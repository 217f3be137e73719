"""Intervals and tests over INDEPENDENT units for the experiment reports.

Which units are independent differs by regime:

- synthetic regimes (mixtures, shells): every evaluation task is a fresh draw from the family,
  so tasks are independent given the trained models (values are first averaged over the
  training seeds, which share the tasks);
- real features: tasks of one class are random subsets of the same ~170 points (they share most
  of them), so only CLASSES are independent (tasks are first averaged within their class); with
  cross-validated class folds every class of the data set is a test class once (ten for digits).

Every interval here is a Student t construction over those units, never a bootstrap (a percentile
bootstrap over 3 classes covered 75% at nominal 95%):

- :func:`mean_interval`: the mean of per-unit values (a difference of MMD^2), ``mean +- t s / sqrt(n)``;
- :func:`fieller_interval`: the ratio of two paired means ``R = mean(a) / mean(b)`` by Fieller's
  theorem: the set of R for which the t test of ``mean(a - R b) = 0`` does not reject, i.e. the
  roots of ``(a_bar - R b_bar)^2 = q (v_aa - 2 R v_ab + R^2 v_bb)`` with ``q = t_{n-1}^2`` and
  ``v`` the (co)variances of the means. It carries the denominator's own uncertainty: when the
  denominator mean is not distinguishable from 0 (``b_bar^2 <= q v_bb``) the set is unbounded and
  the interval is ``(-inf, +inf)``: a ratio with a small denominator is then reported as the
  difference it is made of, never as a number;
- :func:`gain_interval` (``1 - mean(new) / mean(base)``), :func:`ratio_interval`
  (``mean(base) / mean(new)``) and :func:`share_interval` (``(P - X) / (P - L)``) are Fieller
  intervals of those ratios.

:func:`resampled_coverage` measures an interval's coverage at a given number of units by drawing
units from a population (the run's own units, or a simulated one); the tests check >= 93% at 95%.
:func:`holm` adjusts a family of p-values.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = [
    "LEVEL",
    "unit_values",
    "mean_interval",
    "fieller_interval",
    "gain_interval",
    "ratio_interval",
    "share_interval",
    "resampled_coverage",
    "cluster_means",
    "holm",
]

LEVEL = 0.95
UNBOUNDED = (-math.inf, math.inf)


def _labels(num_tasks: int, clusters) -> np.ndarray:
    if clusters is None:
        return np.arange(num_tasks)
    clusters = np.asarray(clusters)
    if clusters.shape != (num_tasks,):
        raise ValueError(f"clusters must give one label per task ({num_tasks}), got shape {clusters.shape}.")
    return np.unique(clusters, return_inverse=True)[1]


def cluster_means(values, clusters) -> np.ndarray:
    """Mean of ``values [..., tasks]`` within each cluster, ``[..., clusters]`` (clusters in sorted order)."""
    values = np.asarray(values, dtype=np.float64)
    labels = _labels(values.shape[-1], clusters)
    onehot = np.eye(int(labels.max()) + 1)[labels]
    return (values @ onehot) / onehot.sum(0)


def unit_values(x, clusters=None) -> np.ndarray:
    """One value per independent unit: ``[tasks]`` or ``[seeds, tasks]`` averaged over seeds, then
    over the tasks of each cluster (class) when ``clusters`` is given; ``[units]`` float64."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 2:
        x = x.mean(0)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"expected [tasks] or [seeds, tasks] values, got shape {np.shape(x)}.")
    return x if clusters is None else cluster_means(x, clusters)


def _t_quantile(n: int, level: float) -> float:
    from scipy.stats import t as student_t

    return float(student_t.ppf(0.5 + level / 2, n - 1))


def mean_interval(values, level: float = LEVEL) -> tuple[float, float]:
    """Student t interval of the mean of independent values ``[n]`` (NaN for n < 2)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size < 2:
        return math.nan, math.nan
    half = _t_quantile(v.size, level) * float(v.std(ddof=1)) / math.sqrt(v.size)
    return float(v.mean()) - half, float(v.mean()) + half


def fieller_interval(a, b, level: float = LEVEL) -> tuple[float, float]:
    """Fieller interval of ``mean(a) / mean(b)`` for paired per-unit values ``a, b [n]``.

    Solves ``(A) R^2 + (B) R + C = 0`` with ``A = b_bar^2 - q v_bb``, ``B = -2 (a_bar b_bar - q v_ab)``,
    ``C = a_bar^2 - q v_aa`` (``v`` = sample (co)variance / n, ``q = t_{n-1, (1+level)/2}^2``).

    Returns:
        ``(low, high)``; ``(-inf, inf)`` when ``A <= 0`` (the denominator's mean is not
        distinguishable from 0 at this level); ``(nan, nan)`` for fewer than 2 units.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired per-unit values must be two [n] arrays, got {a.shape} and {b.shape}.")
    n = a.size
    if n < 2:
        return math.nan, math.nan
    q = _t_quantile(n, level) ** 2
    cov = np.cov(np.vstack([a, b]), ddof=1) / n
    am, bm = float(a.mean()), float(b.mean())
    qa, qb, qc = bm * bm - q * cov[1, 1], -2.0 * (am * bm - q * cov[0, 1]), am * am - q * cov[0, 0]
    if qa <= 0:
        return UNBOUNDED
    disc = max(qb * qb - 4.0 * qa * qc, 0.0)
    root = math.sqrt(disc)
    return (-qb - root) / (2 * qa), (-qb + root) / (2 * qa)


def gain_interval(base, new, *, clusters=None, level: float = LEVEL) -> tuple[float, float]:
    """Interval of the relative gain ``1 - mean(new) / mean(base)`` over the independent units.

    Args:
        base: ``[tasks]`` or ``[seeds, tasks]`` (e.g. the plug-in's MMD^2).
        new: Same tasks.
        clusters: Optional class label per task (the units on features).
    """
    lo, hi = fieller_interval(unit_values(new, clusters), unit_values(base, clusters), level)
    return 1.0 - hi, 1.0 - lo


def ratio_interval(base, new, *, clusters=None, level: float = LEVEL) -> tuple[float, float]:
    """Interval of ``mean(base) / mean(new)`` (e.g. plug-in MMD^2 / learned MMD^2) over the units."""
    return fieller_interval(unit_values(base, clusters), unit_values(new, clusters), level)


def share_interval(plugin, method, learned, *, clusters=None, level: float = LEVEL) -> tuple[float, float]:
    """Interval of the gap share ``(P - X) / (P - L)`` over the units (Fieller on the paired
    differences ``P - X`` and ``P - L``; unbounded when the gap itself is not clearly non-zero)."""
    p, x, lrn = (unit_values(v, clusters) for v in (plugin, method, learned))
    return fieller_interval(p - x, p - lrn, level)


def resampled_coverage(
    population: np.ndarray,
    truth: Callable[[np.ndarray], float],
    interval: Callable[[np.ndarray], tuple[float, float]],
    n: int,
    *,
    reps: int = 2000,
    seed: int = 0,
) -> float:
    """Share of ``reps`` samples of ``n`` units whose interval covers the population's value.

    Args:
        population: ``[N, k]`` one row of ``k`` paired values per unit of the population.
        truth: The population's value of the quantity, from the whole ``population``.
        interval: ``rows [n, k] -> (low, high)``.
        n: Units per sample (the run's own count).
        reps: Samples drawn (with replacement, from a generator seeded by ``seed``).
    """
    rng = np.random.default_rng(seed)
    target = truth(population)
    hits = 0
    for _ in range(reps):
        lo, hi = interval(population[rng.integers(population.shape[0], size=n)])
        hits += bool(lo <= target <= hi)
    return hits / reps


def holm(pvalues) -> np.ndarray:
    """Holm-Bonferroni adjusted p-values (family-wise error control; NaN entries stay NaN).

    p_(i) adjusted = max_{j <= i} min(1, (n - j + 1) p_(j)) over the n finite p-values sorted
    ascending.
    """
    p = np.asarray(pvalues, dtype=np.float64)
    out = np.full(p.shape, math.nan)
    finite = np.flatnonzero(np.isfinite(p))
    n = finite.size
    if n == 0:
        return out
    order = finite[np.argsort(p[finite])]
    adjusted = np.minimum(1.0, np.maximum.accumulate((n - np.arange(n)) * p[order]))
    out[order] = adjusted
    return out
