"""The verdict of a ``correlate.py`` run: clauses tested over reference images, the independent unit.

Layers, heads and query rows of one generation are not independent, so no interval or test is
taken over them. The unit is the reference image (one seed each):

1. per image and recorded step, every statistic is averaged over layers, heads and adapters (the
   CFG half of :func:`~nw_adapter.integration.records.analysis_half`: ``cond`` under guidance);
   a bandwidth is averaged as a logarithm (a geometric mean: a bandwidth is a scale, and one
   query-blind head with a huge ``h_eff`` would dominate an arithmetic mean);
2. per image, one value per clause part (:data:`CLAUSES`):

   * *rho beyond its nulls*: the mean over steps of ``rho - null``, for each of the three nulls;
   * *adapter training made the branch more NW-like*: the means over steps of
     ``nw_gain - nw_gain_untrained`` and of ``rho - rho_untrained`` (the untrained-adapter control,
     THEORY.md section 4: the same queries against the keys of the training recipe's initialisation);
   * *bandwidth follows the schedule*: the OLS slope of ``log h_eff`` on ``log h_schedule`` over the
     steps where both (and the control's) are finite and positive, minus the same slope of
     ``h_eff_untrained``;
   * *rise over denoising*: the OLS slope of rho on the denoising progress
     ``(step - first) / (last - first)`` of the image's recorded steps (the rise fitted from the
     first to the last step);
3. over images: the mean, its two-sided 95% Student t interval and the one-sided one-sample t
   test of ``mean > 0`` (``scipy.stats.ttest_1samp(..., alternative="greater")``) at ``alpha``
   0.05, :func:`nw_adapter.core.intervals.greater_than_zero`.

A clause of several parts holds only when every part is significant: an intersection-union test,
whose size is at most ``alpha`` without any multiplicity correction (the null of the clause is the
union of the parts' nulls; rejecting it needs every part rejected at ``alpha``). A part whose
columns were not recorded (the untrained-adapter control off, an old ``rho.json``) is "not
measured": its clause is None unless another part already failed, and never counts as evidence.

Conclusion: "evidence of learned kernel smoothing" needs the first two clauses to hold; otherwise
"no evidence", naming the clauses that failed or were not measured. With one reference image no
clause can be tested: the conclusion is "undecided" and the per-image values are still reported.

Plain Python with numpy/scipy (no torch): the verdict is rebuilt from a saved ``rho.json``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nw_adapter.core.intervals import CONFIDENCE, greater_than_zero
from nw_adapter.integration.records import analysis_half
from nw_adapter.integration.schema import NULL_STATS, finite_mean

ALPHA = 0.05
"""Size of each one-sided test (and so of each clause, by the intersection-union argument)."""

UNIT = "reference image"

METHOD = (
    "per reference image: statistics averaged over layers, heads and adapters per step (bandwidths as "
    "logarithms), then one value per clause part; over images: mean, two-sided 95% Student t interval, "
    "one-sided one-sample t test of mean > 0 (scipy.stats.ttest_1samp, alternative='greater'), alpha 0.05; "
    "a clause of several parts holds only when every part is significant (intersection-union test)"
)
"""How the verdict is computed, stored in ``rho.json``."""


@dataclass(frozen=True)
class Part:
    """One tested quantity of a clause: a per-image value whose mean over images should be > 0.

    Attributes:
        key: name of the per-image value.
        label: how the verdict prints it.
        needs: record columns it is computed from (all must have been recorded).
    """

    key: str
    label: str
    needs: tuple[str, ...]


@dataclass(frozen=True)
class Clause:
    """A claim of the verdict: it holds when every one of its parts is significant.

    Attributes:
        key: name in ``rho.json``.
        label: the claim, as the detail lines print it.
        short: its name in the one-line conclusion.
        parts: what is tested.
    """

    key: str
    label: str
    short: str
    parts: tuple[Part, ...]


NULL_LABELS: dict[str, str] = {
    "rho_perm_null": "perm",
    "rho_norm_matched_null": "norm-matched",
    "rho_spread_null": "qk-spread",
}
"""Short names of the nulls."""

CLAUSES: tuple[Clause, ...] = (
    Clause(
        "beyond_nulls",
        "rho beyond its nulls",
        "rho vs nulls",
        tuple(
            Part(f"rho_minus_{null}", f"rho - {NULL_LABELS[null]} null", ("rho", null)) for null in NULL_STATS
        ),
    ),
    Clause(
        "training",
        "adapter training made the branch more NW-like",
        "training",
        (
            Part("nw_gain_minus_untrained", "nw_gain - untrained", ("nw_gain", "nw_gain_untrained")),
            Part("rho_minus_untrained", "rho - untrained", ("rho", "rho_untrained")),
        ),
    ),
    Clause(
        "bandwidth",
        "bandwidth follows the schedule",
        "bandwidth",
        (
            Part(
                "h_slope_minus_untrained",
                "slope of log h_eff on log h, minus untrained",
                ("h_eff", "h_eff_untrained", "h_schedule"),
            ),
        ),
    ),
    Clause(
        "rise",
        "rise over denoising",
        "rise",
        (Part("rho_rise", "OLS slope of rho on denoising progress", ("rho",)),),
    ),
)
"""The clauses, in printing order."""

EVIDENCE_CLAUSES: tuple[str, ...] = ("beyond_nulls", "training")
"""The clauses "evidence of learned kernel smoothing" needs."""

MEAN_COLUMNS: tuple[str, ...] = ("rho", *NULL_STATS, "nw_gain", "nw_gain_untrained", "rho_untrained")
"""Columns averaged per (image, step) as they are."""

LOG_COLUMNS: tuple[str, ...] = ("h_eff", "h_eff_untrained")
"""Columns averaged per (image, step) as logarithms (``log_<name>``; non-positive values left out)."""


def _number(value: Any) -> float:
    """``value`` as a float; None and non-numbers as NaN."""
    try:
        return math.nan if value is None else float(value)
    except (TypeError, ValueError):
        return math.nan


def _log(value: Any) -> float:
    x = _number(value)
    return math.log(x) if math.isfinite(x) and x > 0 else math.nan


def _clean(x: float) -> float | None:
    return x if math.isfinite(x) else None


def image_step_means(records: Iterable[dict], half: str) -> dict[Any, list[dict]]:
    """Per reference image and step, the statistics the verdict uses, averaged over layers/heads/adapters.

    Args:
        records: record dicts with ``reference`` (the CLI adds it); a record without one belongs to
            the image of its pipeline ``call`` (one call per reference image, one seed each, as a
            notebook loop over references records them).
        half: the CFG half kept.

    Returns:
        ``{reference: [row, ...]}`` in step order; each row has ``step``, ``timestep``,
        ``h_schedule``, the finite mean of every :data:`MEAN_COLUMNS` and ``log_<name>`` of every
        :data:`LOG_COLUMNS` (mean of the logarithms of the positive finite values), None where no
        value is finite or the column was not recorded.
    """
    groups: dict[Any, dict[int, list[dict]]] = {}
    for record in records:
        if record.get("half") == half:
            unit = record["reference"] if "reference" in record else f"call {record.get('call')}"
            groups.setdefault(unit, {}).setdefault(int(record["step"]), []).append(record)
    out: dict[Any, list[dict]] = {}
    for reference, steps in groups.items():
        rows = []
        for step in sorted(steps):
            members = steps[step]
            row: dict[str, Any] = {"step": step}
            for name in ("timestep", "h_schedule"):
                row[name] = _clean(finite_mean(_number(r.get(name)) for r in members)[0])
            for name in MEAN_COLUMNS:
                row[name] = _clean(finite_mean(_number(r.get(name)) for r in members)[0])
            for name in LOG_COLUMNS:
                row[f"log_{name}"] = _clean(finite_mean(_log(r.get(name)) for r in members)[0])
            rows.append(row)
        out[reference] = rows
    return out


def _mean_difference(rows: Sequence[dict], a: str, b: str) -> float | None:
    """Mean over the steps where both are finite of ``row[a] - row[b]`` (None: no such step)."""
    diffs = [r[a] - r[b] for r in rows if r.get(a) is not None and r.get(b) is not None]
    return sum(diffs) / len(diffs) if diffs else None


def _ols_slope(x: Sequence[float], y: Sequence[float]) -> float | None:
    """OLS slope of y on x (None with fewer than 2 points or no spread in x)."""
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if xs.size < 2 or float(np.ptp(xs)) == 0.0:
        return None
    xc = xs - xs.mean()
    return float((xc * (ys - ys.mean())).sum() / (xc * xc).sum())


def _bandwidth_slopes(rows: Sequence[dict]) -> tuple[float | None, float | None]:
    """OLS slopes of log h_eff and of log h_eff_untrained on log h_schedule (steps where all three exist)."""
    kept = [
        r for r in rows
        if r.get("h_schedule") is not None and r["h_schedule"] > 0
        and r.get("log_h_eff") is not None and r.get("log_h_eff_untrained") is not None
    ]  # fmt: skip
    x = [math.log(r["h_schedule"]) for r in kept]
    trained = _ols_slope(x, [r["log_h_eff"] for r in kept])
    return trained, _ols_slope(x, [r["log_h_eff_untrained"] for r in kept])


def _rise(rows: Sequence[dict]) -> float | None:
    """OLS slope of rho on the denoising progress (step - first) / (last - first) of the image's steps."""
    kept = [r for r in rows if r.get("rho") is not None]
    if len(kept) < 2:
        return None
    first, last = rows[0]["step"], rows[-1]["step"]
    return _ols_slope([(r["step"] - first) / (last - first) for r in kept], [r["rho"] for r in kept])


def per_image_values(reference: Any, rows: Sequence[dict]) -> dict[str, Any]:
    """Every clause part's value for one image (None where its columns were not recorded).

    Also ``h_slope`` and ``h_slope_untrained`` (the two slopes the bandwidth part subtracts) and
    ``steps`` (recorded steps).
    """
    slope, slope_untrained = _bandwidth_slopes(rows)
    values: dict[str, Any] = {"reference": reference, "steps": len(rows)}
    for null in NULL_STATS:
        values[f"rho_minus_{null}"] = _mean_difference(rows, "rho", null)
    values["nw_gain_minus_untrained"] = _mean_difference(rows, "nw_gain", "nw_gain_untrained")
    values["rho_minus_untrained"] = _mean_difference(rows, "rho", "rho_untrained")
    values["h_slope"], values["h_slope_untrained"] = slope, slope_untrained
    has_both = slope is not None and slope_untrained is not None
    values["h_slope_minus_untrained"] = slope - slope_untrained if has_both else None
    values["rho_rise"] = _rise(rows)
    return values


def _recorded(records: Sequence[dict], half: str) -> set[str]:
    """The columns with at least one finite value in this half."""
    present: set[str] = set()
    for record in records:
        if record.get("half") == half:
            present.update(k for k, v in record.items() if k not in present and math.isfinite(_number(v)))
    return present


def _missing_reason(columns: Sequence[str]) -> str:
    """Why a part was not measured: the columns it lacks (the untrained-adapter control's, the
    readings', or the nulls': the control or the nulls off, or a file older than them)."""
    return f"no {', '.join(columns)}"


def _test_part(part: Part, images: Sequence[dict], recorded: set[str]) -> dict[str, Any]:
    missing = [c for c in part.needs if c not in recorded]
    entry: dict[str, Any] = {"key": part.key, "label": part.label}
    if missing:
        return {**entry, "measured": False, "reason": _missing_reason(missing), "missing": missing, "n": 0,
                "mean": None, "low": None, "high": None, "p": None, "significant": None}  # fmt: skip
    result = greater_than_zero([v[part.key] for v in images], alpha=ALPHA, confidence=CONFIDENCE).to_dict()
    if result["n"] < 2:
        reason = "needs several reference images" if len(images) < 2 else "fewer than 2 images have a value"
        return {**entry, **result, "measured": False, "reason": reason, "significant": None}
    return {**entry, **result, "measured": True, "reason": None}


def _clause_result(clause: Clause, images: Sequence[dict], recorded: set[str]) -> dict[str, Any]:
    parts = [_test_part(part, images, recorded) for part in clause.parts]
    failed = [p for p in parts if p["measured"] and not p["significant"]]
    unmeasured = [p for p in parts if not p["measured"]]
    if failed:
        holds, reason = False, None
    elif unmeasured:
        missing = list(dict.fromkeys(c for p in unmeasured for c in p.get("missing", ())))
        reasons = [_missing_reason(missing)] if missing else []
        reasons += [p["reason"] for p in unmeasured if not p.get("missing")]
        holds, reason = None, "; ".join(dict.fromkeys(reasons))
    else:
        holds, reason = True, None
    return {"label": clause.label, "short": clause.short, "holds": holds, "reason": reason, "parts": parts}


def _conclusion(clauses: dict[str, dict], images: int) -> tuple[bool | None, str]:
    if images < 2:
        return None, "undecided: 1 reference image; pass several (--image-dir)"
    needed = [clauses[key] for key in EVIDENCE_CLAUSES]
    if all(c["holds"] is True for c in needed):
        shorts = " and ".join(c["short"] for c in needed)
        return True, f"evidence of learned kernel smoothing ({images} images): {shorts} hold"
    status = {False: "failed", None: "not measured"}
    why = ", ".join(f"{c['short']} {status[c['holds']]}" for c in needed if c["holds"] is not True)
    return False, f"no evidence of learned kernel smoothing ({images} images): {why}"


def verdict(records: Sequence[dict], *, half: str | None = None) -> dict[str, Any]:
    """The verdict over reference images (see the module docstring).

    Args:
        records: record dicts, each with ``reference`` (the image it belongs to) or, without one,
            its pipeline ``call`` (one call per reference image): e.g. ``recorder.to_records()``.
        half: CFG half (default :func:`~nw_adapter.integration.records.analysis_half`).

    Returns:
        JSON-ready dict: ``unit``, ``method``, ``alpha``, ``confidence``, ``half``, ``images``
        (number of reference images), ``per_image`` (one dict per image: ``reference``, ``steps``
        and every part's value), ``clauses`` (key -> ``label``, ``holds`` True / False / None = not
        measured, ``reason``, ``parts``: each with ``n``, ``mean``, ``low``, ``high``, ``p``,
        ``significant``, ``measured``, ``reason``), ``evidence`` (True / False; None when undecided)
        and ``conclusion`` (the printed line), ``nonfinite`` (column -> non-finite values left out).

    Raises:
        ValueError: no records of that half.
    """
    if not records:
        raise ValueError("records: empty; nothing to judge (did the run record any step?)")
    # SD3 also records its joint softmax (key set "joint"), which has no untrained control: the
    # verdict judges the image branch's own softmax over the IP keys
    records = [r for r in records if r.get("key_set", "ip") == "ip"] or list(records)
    half = half or analysis_half(records)
    by_image = image_step_means(records, half)
    if not by_image:
        raise ValueError(f"records: none of half {half!r}; nothing to judge")
    images = [per_image_values(reference, rows) for reference, rows in by_image.items()]
    recorded = _recorded(records, half)
    clauses = {clause.key: _clause_result(clause, images, recorded) for clause in CLAUSES}
    evidence, conclusion = _conclusion(clauses, len(images))
    used = {c for clause in CLAUSES for part in clause.parts for c in part.needs} & recorded
    kept = [r for r in records if r.get("half") == half]
    counts = {name: sum(1 for r in kept if not math.isfinite(_number(r.get(name)))) for name in sorted(used)}
    return {
        "unit": UNIT,
        "method": METHOD,
        "alpha": ALPHA,
        "confidence": CONFIDENCE,
        "half": half,
        "images": len(images),
        "per_image": images,
        "clauses": clauses,
        "evidence": evidence,
        "conclusion": conclusion,
        "nonfinite": {name: count for name, count in counts.items() if count},
    }


def _signed(x: float | None) -> str:
    return "nan" if x is None else f"{x:+.3f}"


def _p(p: float | None) -> str:
    if p is None:
        return "p n/a"
    return f"p {p:.1e}" if p < 1e-3 else f"p {p:.3f}"


def _part_line(part: dict) -> str:
    if part["n"] == 0 and not part["measured"]:
        return f"{part['label']}: not measured"
    interval = f"[{_signed(part['low'])}, {_signed(part['high'])}]" if part["low"] is not None else "[n/a]"
    return f"{part['label']}: {_signed(part['mean'])} {interval}, {_p(part['p'])}, n {part['n']}"


def _clause_status(clause: dict, images: int) -> str:
    if clause["holds"] is True:
        return "yes"
    if clause["holds"] is False:
        return "no"
    if images < 2 and not any(p.get("missing") for p in clause["parts"]):
        return "needs several reference images"
    return f"not measured: {clause['reason']}"


def format_verdict(result: dict) -> str:
    """The verdict as printed: the conclusion line, then per clause its status and its parts (indented).

    Each part: mean [95% t interval], one-sided p, n images.
    """
    lines = [f"verdict: {result['conclusion']}"]
    images = result["images"]
    for clause in result["clauses"].values():
        lines.append(f"  {clause['label']}: {_clause_status(clause, images)}")
        for part in clause["parts"]:
            if part["measured"] or part["n"]:
                lines.append(f"    {_part_line(part)}")
    lines.append(
        f"  unit: {result['unit']}, one seed each; mean [95% Student t interval], one-sided t test p, "
        f"alpha {result['alpha']}"
    )
    nonfinite = result.get("nonfinite") or {}
    if nonfinite:
        counts = ", ".join(f"{k} {v}" for k, v in nonfinite.items())
        lines.append(f"  non-finite values left out of the means: {counts}")
    return "\n".join(lines)
