"""Intervals and tests over INDEPENDENT units for the experiment reports.

Which units are independent differs by regime:

- synthetic regimes (mixtures, shells): every evaluation task is a fresh draw from the family,
  so tasks are independent given the trained models; training seeds are independent runs;
- real features: tasks of one class are random subsets of the same ~170 points (they share most
  of them), so only CLASSES (and training seeds) are independent; a test over tasks would be
  pseudo-replicated (its p-value shrinks with the number of tasks drawn, not with the evidence).

:func:`bootstrap_means` resamples at those levels (clusters of tasks, and seeds) and
:func:`gain_interval` turns the resampled means into a percentile interval of the relative gain
(mean_base - mean_new) / mean_base; :func:`holm` adjusts a family of p-values.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["bootstrap_means", "gain_interval", "ratio_interval", "cluster_means", "holm"]

RESAMPLES = 4000
LEVEL = 0.95


def _as_seed_rows(x) -> np.ndarray:
    """``[tasks]`` or ``[seeds, tasks]`` -> float64 ``[seeds, tasks]``."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 1:
        x = x[None]
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"expected [tasks] or [seeds, tasks] values, got shape {x.shape}.")
    return x


def _labels(num_tasks: int, clusters) -> np.ndarray:
    if clusters is None:
        return np.arange(num_tasks)
    clusters = np.asarray(clusters)
    if clusters.shape != (num_tasks,):
        raise ValueError(f"clusters must give one label per task ({num_tasks}), got shape {clusters.shape}.")
    return np.unique(clusters, return_inverse=True)[1]


def _seed_weights(num_seeds: int, picks: np.ndarray | None, resamples: int) -> np.ndarray:
    """How often each seed is drawn in each resample, ``[R, S]`` (all ones for a single row)."""
    if num_seeds == 1 or picks is None:
        return np.ones((resamples, num_seeds))
    return (picks[..., None] == np.arange(num_seeds)).sum(1).astype(np.float64)


def bootstrap_means(
    base, new, *, clusters=None, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Two-level bootstrap of the grand means of two paired methods.

    Each resample draws the clusters of tasks with replacement (each task is its own cluster
    when ``clusters`` is None) and, independently, the training seeds with replacement (the
    same seed indices for both methods when both have several seeds: seed i of one method is
    paired with seed i of the other). Every method is evaluated on the same tasks, so the task
    draw is shared.

    Args:
        base: ``[tasks]`` (deterministic method, e.g. the plug-in) or ``[seeds, tasks]``.
        new: Same layout, same number of tasks.
        clusters: Optional label per task (e.g. its class); clusters are the resampled units.
        resamples: Bootstrap resamples R.
        seed: Seed of the resampling.

    Returns:
        ``(mean_base [R], mean_new [R])``.
    """
    base, new = _as_seed_rows(base), _as_seed_rows(new)
    if base.shape[1] != new.shape[1]:
        raise ValueError(f"base and new must share their tasks, got {base.shape} and {new.shape}.")
    labels = _labels(base.shape[1], clusters)
    num_clusters = int(labels.max()) + 1
    onehot = np.eye(num_clusters)[labels]  # [T, C]
    count = onehot.sum(0)  # tasks per cluster [C]
    rng = np.random.default_rng(seed)
    picks = rng.integers(num_clusters, size=(resamples, num_clusters))
    w_cluster = (picks[..., None] == np.arange(num_clusters)).sum(1).astype(np.float64)  # [R, C]
    shared = base.shape[0] == new.shape[0] and base.shape[0] > 1
    num_seeds = max(base.shape[0], new.shape[0])
    seed_picks = rng.integers(num_seeds, size=(resamples, num_seeds)) if num_seeds > 1 else None
    out = []
    for x in (base, new):
        picks_x = seed_picks if (shared or x.shape[0] == num_seeds) else None
        w_seed = _seed_weights(x.shape[0], picks_x, resamples)  # [R, S]
        sums = x @ onehot  # [S, C]
        total = np.einsum("rs,sc,rc->r", w_seed, sums, w_cluster)
        out.append(total / (w_seed.sum(1) * (w_cluster @ count)))
    return out[0], out[1]


def _percentile(values: np.ndarray, level: float) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return math.nan, math.nan
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def gain_interval(base, new, *, clusters=None, level: float = LEVEL, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the relative gain (mean_base - mean_new) / mean_base.

    Args: as :func:`bootstrap_means`; ``level`` is the coverage (0.95).

    Returns:
        ``(low, high)``.
    """
    mb, mn = bootstrap_means(base, new, clusters=clusters, seed=seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = np.where(mb > 0, (mb - mn) / mb, np.nan)
    return _percentile(gain, level)


def ratio_interval(base, new, *, clusters=None, level: float = LEVEL, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of mean_base / mean_new (e.g. plug-in MMD^2 / learned MMD^2)."""
    mb, mn = bootstrap_means(base, new, clusters=clusters, seed=seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(mn > 0, mb / mn, np.nan)
    return _percentile(ratio, level)


def cluster_means(values, clusters) -> np.ndarray:
    """Mean of ``values [..., tasks]`` within each cluster, ``[..., clusters]`` (clusters in sorted order)."""
    values = np.asarray(values, dtype=np.float64)
    labels = _labels(values.shape[-1], clusters)
    onehot = np.eye(int(labels.max()) + 1)[labels]
    return (values @ onehot) / onehot.sum(0)


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
