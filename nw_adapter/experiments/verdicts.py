"""Verdicts on the paper's expected trends, each decided from intervals, never from point values alone.

Each function takes the rows of a regime's table and returns
``{"trend", "appeared", "evidence"}``. A verdict "appeared" only when the data give evidence
for the trend; a table built to have no effect (a flat benefit, an advantage that never turns)
must give "did not appear" (tests/experiments/test_experiments_verdicts.py builds both).

Intervals are the 95% two-level bootstrap intervals of :mod:`nw_adapter.experiments.inference`
(``*_ci`` fields: ``(low, high)``).
"""

from __future__ import annotations

import math

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


def _ci(ci) -> str:
    lo, hi = ci
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


def benefit_vanishes(rows: list[dict]) -> dict:
    """Exact-head benefit > 0 at the smallest d and ~0 at the largest, with intervals.

    Appeared iff the smallest-d interval lies above 0, the largest-d interval contains 0 (the
    benefit there is compatible with none), and the largest-d interval lies entirely below the
    smallest-d one (clearly smaller, not merely a lower point value).

    Args:
        rows: ``d``, ``benefit``, ``benefit_ci`` per d, in increasing d.
    """
    first, last = rows[0], rows[-1]
    lo0, hi0 = first["benefit_ci"]
    lo1, hi1 = last["benefit_ci"]
    positive = lo0 > 0
    null_at_last = lo1 <= 0 <= hi1
    below = hi1 < lo0
    appeared = len(rows) >= 2 and positive and null_at_last and below
    reasons = []
    if not positive:
        reasons.append(f"the d={first['d']} interval reaches 0 or below")
    if not null_at_last:
        reasons.append(f"the d={last['d']} interval excludes 0")
    if not below:
        reasons.append(f"the d={last['d']} interval overlaps the d={first['d']} one")
    return {
        "trend": "exact-head benefit positive at the smallest d and compatible with 0 (and clearly "
        "smaller) at the largest d",
        "appeared": bool(appeared),
        "evidence": ", ".join(f"d={r['d']}: {100 * r['benefit']:+.0f}% {_ci(r['benefit_ci'])}" for r in rows)
        + (f" ({'; '.join(reasons)})" if reasons else "")
        + ".",
    }


def learned_wins_small_m(rows: list[dict]) -> dict:
    """Learned advantage > 0 with its interval above 0 at some m <= 10.

    Args:
        rows: ``m``, ``advantage``, ``advantage_ci`` per m, in increasing m.
    """
    wins = [r["m"] for r in rows if r["m"] <= SMALL_M and r["advantage_ci"][0] > 0]
    return {
        "trend": f"learned model wins at small m (advantage interval above 0 at some m <= {SMALL_M})",
        "appeared": bool(wins),
        "evidence": ", ".join(
            f"m={r['m']}: {100 * r['advantage']:+.0f}% {_ci(r['advantage_ci'])}" for r in rows
        )
        + ".",
    }


def plugin_catches_up(rows: list[dict], paper_m: int | None = None) -> dict:
    """The plug-in catches up: after a size where the learned model wins (interval above 0), the
    learned advantage is <= 0 at some larger m.

    Args:
        rows: ``m``, ``advantage``, ``advantage_ci`` per m, in increasing m.
        paper_m: The paper's catch-up size (for the evidence line).
    """
    wins = [r["m"] for r in rows if r["advantage_ci"][0] > 0]
    first_win = min(wins) if wins else math.inf
    caught = [r["m"] for r in rows if r["m"] > first_win and r["advantage"] <= 0]
    where = f"m={caught[0]}" if caught else "none of the sizes run"
    return {
        "trend": "plug-in catches up as m grows (learned advantage <= 0 at some m after a significant win)",
        "appeared": bool(caught),
        "evidence": (
            f"first significant learned win at m={first_win if wins else 'none'}; advantage first <= 0 at "
            f"{where}" + (f" (paper: m ~{paper_m})" if paper_m else "") + "."
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
    lo, hi = cell["share_ci"]
    return (
        f"{col['regime']} {col['setting']}: {100 * cell['share']:+.0f}% [{100 * lo:+.0f}%, {100 * hi:+.0f}%]"
    )


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
