"""Verdicts on the paper's expected trends, each decided from intervals, never from point values alone.

Each function takes the rows of a regime's table and returns
``{"trend", "appeared", "evidence"}``. A verdict "appeared" only when the data give evidence
for the trend; a table built to have no effect (a flat benefit, an advantage that never turns)
must give "did not appear" (tests/experiments/test_experiments_verdicts.py builds both).

Intervals are the 95% Student t / Fieller intervals over independent units of
:mod:`nw_adapter.experiments.inference` (``*_ci`` fields: ``(low, high)``; unbounded where a ratio's
denominator is not distinguishable from 0). The digits verdicts, whose units are the test classes
(all ten digits through cross-validated class folds), use t-tests over those classes with Holm's
family-wise control.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from nw_adapter.experiments.inference import holm

__all__ = [
    "neff_falls",
    "benefit_vanishes",
    "learned_wins_small_m",
    "plugin_catches_up",
    "plugin_worse",
    "fix_closes_its_gap",
]

SMALL_M = 10
RATIO_THRESHOLD = 2.0
LEVEL = 0.05
CATCH_UP_MARGIN = 0.10
VANISH_MARGIN = 0.10


def _ci(ci) -> str:
    lo, hi = ci
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "[unbounded]" if not (math.isnan(lo) or math.isnan(hi)) else "[n/a]"
    return f"[{100 * lo:+.0f}%, {100 * hi:+.0f}%]"


def neff_falls(rows: list[dict]) -> dict:
    """n_eff (a property of the tasks, not a comparison) falls monotonically and at least 3x over d."""
    ne = [r["neff"] for r in rows]
    falls = len(ne) >= 2 and all(a >= b for a, b in zip(ne, ne[1:], strict=False)) and ne[-1] <= ne[0] / 3
    return {
        "trend": "n_eff falls as d grows (monotone, at least 3x from the smallest to the largest d)",
        "appeared": bool(falls),
        "evidence": ", ".join(f"d={r['d']}: {r['neff']:.2f}" for r in rows) + ".",
    }


def benefit_vanishes(rows: list[dict], margin: float = VANISH_MARGIN) -> dict:
    """Exact-head benefit > 0 at the smallest d and equivalent to 0 at the largest, with intervals.

    Appeared iff the smallest-d interval lies above 0, the largest-d interval lies inside
    ``[-margin, +margin]`` (an equivalence test: the benefit there is shown to be small, not merely
    not shown to be large), and the largest-d interval lies entirely below the smallest-d one.
    Intervals are the Fieller intervals over evaluation tasks (``benefit_ci``); an unbounded one
    (the OFF model's MMD^2 not distinguishable from 0) passes none of the three.

    Args:
        rows: ``d``, ``benefit``, ``benefit_ci`` per d, in increasing d.
        margin: Largest benefit still called "vanished" (0.10 = 10%).
    """
    first, last = rows[0], rows[-1]
    lo0, hi0 = first["benefit_ci"]
    lo1, hi1 = last["benefit_ci"]
    positive = lo0 > 0
    null_at_last = -margin <= lo1 and hi1 <= margin
    below = hi1 < lo0
    appeared = len(rows) >= 2 and positive and null_at_last and below
    reasons = []
    if not positive:
        reasons.append(f"the d={first['d']} interval reaches 0 or below")
    if not null_at_last:
        reasons.append(f"the d={last['d']} interval is not inside +-{100 * margin:.0f}%")
    if not below:
        reasons.append(f"the d={last['d']} interval overlaps the d={first['d']} one")
    return {
        "trend": "exact-head benefit positive at the smallest d and within "
        f"+-{100 * margin:.0f}% of 0 (equivalence, and clearly smaller) at the largest d",
        "appeared": bool(appeared),
        "evidence": ", ".join(f"d={r['d']}: {100 * r['benefit']:+.0f}% {_ci(r['benefit_ci'])}" for r in rows)
        + (f" ({'; '.join(reasons)})" if reasons else "")
        + ".",
    }


def _class_table(rows: list[dict]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(plug-in, learned)`` MMD^2 per (row, test class), ``[len(rows), C]`` each; None without classes."""
    plugin = [r.get("mmd2_plugin_per_class") for r in rows]
    learned = [r.get("mmd2_learned_per_class") for r in rows]
    if not rows or any(x is None for x in plugin + learned):
        return None
    if len({len(x) for x in plugin + learned}) != 1:
        raise ValueError("every row needs the same test classes for the plug-in and the learned model")
    return np.asarray(plugin, dtype=np.float64), np.asarray(learned, dtype=np.float64)


def _t_p_values(x: np.ndarray, null: float, alternative: str) -> np.ndarray:
    """One-sample t-test p-values of each row of ``x`` ``[rows, C]`` against ``null`` (scipy, one call).

    NaN for rows with fewer than 2 classes or no spread (the t statistic is undefined there).
    """
    if x.shape[-1] < 2:
        return np.full(x.shape[0], math.nan)
    p = stats.ttest_1samp(x, null, axis=-1, alternative=alternative).pvalue
    return np.where(np.ptp(x, axis=-1) > 0, p, math.nan)


def _win_p(rows: list[dict]) -> np.ndarray:
    """Per row: one-sided paired t-test over test classes, H1 mean_c (plug-in_c - learned_c) > 0."""
    table = _class_table(rows)
    if table is None:
        return np.full(len(rows), math.nan)
    plugin, learned = table
    return _t_p_values(plugin - learned, 0.0, "greater")  # the paired t-test is this one-sample test


def _catch_up_p(rows: list[dict], margin: float) -> np.ndarray:
    """Per row: one-sided t-test over test classes, H1 mean_c (1 - learned_c / plug-in_c) < margin."""
    table = _class_table(rows)
    if table is None:
        return np.full(len(rows), math.nan)
    plugin, learned = table
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.where(plugin > 0, 1.0 - learned / plugin, math.nan)
    p = _t_p_values(np.nan_to_num(relative, nan=0.0), margin, "less")
    return np.where(np.isfinite(relative).all(-1), p, math.nan)


def _significant_wins(rows: list[dict]) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """The rows with m <= SMALL_M, their win p-values and Holm-adjusted ones (family: those rows)."""
    small = [r for r in rows if r["m"] <= SMALL_M]
    p = _win_p(small)
    return small, p, holm(p)


def _classes(rows: list[dict]) -> int:
    table = _class_table(rows)
    return 0 if table is None else table[0].shape[-1]


def learned_wins_small_m(rows: list[dict], level: float = LEVEL) -> dict:
    """The learned model wins at some m <= 10: a one-sided paired t-test over test classes rejects.

    The independent units are the test classes (tasks of one class share most of their points):
    per m, the class means of the plug-in's and the learned model's MMD^2 (learned averaged over
    training seeds) are compared by a one-sided paired t-test (``H1: mean_c (plug-in_c - learned_c) >
    0``, df = C - 1; normal class differences assumed), and the family-wise error over the sizes
    m <= 10 is held at ``level`` by Holm's procedure. An exact sign-flip test over C classes could
    not go below ``2^-C`` (0.125 for the 3 test classes of digits), so it is not used; a percentile
    bootstrap over 3 classes fired 12% of the time per m without any effect.

    Args:
        rows: ``m``, ``advantage``, ``mmd2_plugin_per_class``, ``mmd2_learned_per_class`` per m,
            in increasing m.
        level: Family-wise error rate.
    """
    small, raw, adjusted = _significant_wins(rows)
    wins = [r["m"] for r, p in zip(small, adjusted, strict=True) if p <= level]
    classes = _classes(rows)
    per_m = ", ".join(
        f"m={r['m']}: {100 * r['advantage']:+.0f}% (p={p:.3g}, Holm {q:.3g})"
        for r, p, q in zip(small, raw, adjusted, strict=True)
    )
    return {
        "trend": f"learned model wins at small m (one-sided paired t-test over test classes, Holm over "
        f"m <= {SMALL_M}, family-wise level {level:g})",
        "appeared": bool(wins),
        "evidence": f"{classes} test classes; {per_m or 'no size m <= ' + str(SMALL_M)}."
        + ("" if classes >= 2 else " Fewer than 2 classes: no test possible."),
    }


def plugin_catches_up(
    rows: list[dict], paper_m: int | None = None, level: float = LEVEL, margin: float = CATCH_UP_MARGIN
) -> dict:
    """The plug-in catches up: after a significant learned win at small m, the learned model's
    relative advantage is significantly below ``margin`` at some larger m.

    Per larger m, a one-sided one-sample t-test over test classes of the relative advantage
    ``1 - learned_c / plug-in_c`` (``H1: mean < margin``: the learned model is better by less than
    ``margin``, a non-inferiority test of the plug-in), Holm over those sizes at ``level``. The
    first win is the smallest m of :func:`learned_wins_small_m`; without one there is nothing to
    catch up with.

    Args:
        rows: as :func:`learned_wins_small_m`.
        paper_m: The paper's catch-up size (for the evidence line).
        level: Family-wise error rate of each family (wins; catch-ups).
        margin: Relative advantage below which the plug-in has caught up (0.10 = within 10%).
    """
    small, _, adjusted = _significant_wins(rows)
    wins = [r["m"] for r, p in zip(small, adjusted, strict=True) if p <= level]
    first_win = min(wins) if wins else math.inf
    later = [r for r in rows if r["m"] > first_win]
    later_p = holm(_catch_up_p(later, margin)) if later else np.zeros(0)
    caught = [r["m"] for r, p in zip(later, later_p, strict=True) if p <= level]
    tests = ", ".join(
        f"m={r['m']}: {100 * r['advantage']:+.0f}% (Holm p={p:.3g})"
        for r, p in zip(later, later_p, strict=True)
    )
    return {
        "trend": f"plug-in catches up as m grows (after a significant learned win, the learned advantage is "
        f"below {100 * margin:.0f}% by a one-sided t-test over test classes, Holm, level {level:g})",
        "appeared": bool(caught),
        "caught_up_m": caught[0] if caught else None,
        "evidence": (
            f"first significant learned win at m={first_win if wins else 'none'}"
            + (f"; {tests}" if tests else "")
            + f"; caught up at {'m=' + str(caught[0]) if caught else 'none of the sizes run'}"
            + (f" (paper: m ~{paper_m})" if paper_m else "")
            + "."
        ),
    }


def plugin_worse(rows: list[dict], threshold: float = RATIO_THRESHOLD) -> dict:
    """Isotropic plug-in at least ``threshold`` times worse at every d: the ratio's interval lies above it.

    Args:
        rows: ``d``, ``ratio`` (plug-in / learned MMD^2), ``ratio_ci`` per d.
    """
    ok = bool(rows) and all(r["ratio_ci"][0] >= threshold for r in rows)
    return {
        "trend": f"isotropic plug-in several times (interval above {threshold:g}x) worse MMD^2 than learned",
        "appeared": ok,
        "evidence": ", ".join(
            f"d={r['d']}: {r['ratio']:.1f}x [{r['ratio_ci'][0]:.1f}, {r['ratio_ci'][1]:.1f}]" for r in rows
        )
        + ".",
    }


def _share(col: dict, cell: dict) -> str:
    return f"{col['regime']} {col['setting']}: {100 * cell['share']:+.0f}% {_ci(cell['share_ci'])}"


def fix_closes_its_gap(row: str, regime: str, columns: list[dict], cells: list[dict | None]) -> dict:
    """A training-free fix closes part of its own regime's gap, and no other regime's.

    Appeared iff (1) its own regime has at least one setting with a gap (the learned OFF model
    significantly better than the plug-in) and at every such setting the share of the gap closed
    has its 95% interval above 0, and (2) at no setting of another regime with a gap does the
    share's interval lie above 0. A field no better than the plug-in (share ~0) does not appear.

    Args:
        row: The field's name.
        regime: The regime whose gap the field is meant to close.
        columns: Matrix columns (``regime``, ``setting``, ``has_gap``).
        cells: The field's cells, one per column (``share``, ``share_ci``) or None.
    """
    pairs = [(c, x) for c, x in zip(columns, cells, strict=True) if x is not None and c["has_gap"]]
    own = [(c, x) for c, x in pairs if c["regime"] == regime]
    other = [(c, x) for c, x in pairs if c["regime"] != regime]
    closes_own = bool(own) and all(x["share_ci"][0] > 0 for _, x in own)
    elsewhere = [(c, x) for c, x in other if x["share_ci"][0] > 0]
    reasons = []
    if not own:
        reasons.append(f"no setting of {regime} has a gap to close")
    elif not closes_own:
        reasons.append(
            "its own-regime interval reaches 0 or below at "
            + ", ".join(f"{c['setting']}" for c, x in own if not x["share_ci"][0] > 0)
        )
    if elsewhere:
        reasons.append("it also closes " + ", ".join(f"{c['regime']} {c['setting']}" for c, _ in elsewhere))
    beats = [
        f"{c['regime']} {c['setting']}"
        for c, x in zip(columns, cells, strict=True)
        if x is not None and x.get("beats_learned")
    ]
    evidence = "own: " + ("; ".join(_share(c, x) for c, x in own) or "none") + ". others: "
    evidence += ("; ".join(_share(c, x) for c, x in other) or "none") + "."
    if beats:
        evidence += (
            f" It beats the learned OFF model (gain over OFF, interval above 0) at {', '.join(beats)}."
        )
    if reasons:
        evidence += f" ({'; '.join(reasons)})."
    return {
        "trend": f"{row} closes part of the plug-in -> learned gap in its own regime ({regime}) "
        "and in no other",
        "appeared": bool(closes_own and not elsewhere),
        "closes_own": bool(closes_own),
        "closes_elsewhere": [f"{c['regime']} {c['setting']}" for c, _ in elsewhere],
        "evidence": evidence,
    }
