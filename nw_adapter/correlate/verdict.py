"""The verdict of a ``correlate.py`` run: clauses tested over reference images x control draws.

Layers, heads and query rows of one generation are not independent, so no interval or test is
taken over them. The unit is the reference image (one seed each); the control (the untrained
adapter, its keys rescaled per layer and head to the trained keys' RMS norm: the scale-matched
control, columns ``{stat}_control_{k}`` for draws (seeds) ``k = 0 .. K-1``) is a second random
level, so every part against it is tested over references x draws (docs/verdict.md):

1. per image and recorded step, every statistic is averaged over layers, heads and adapters (the
   CFG half of :func:`~nw_adapter.analysis.records.analysis_half`: ``cond`` under guidance);
   a scale (``h_eff``, ``logit_scale``, ``key_scale_k``) is averaged as a logarithm; a difference
   from control draw ``k`` is averaged over the records where both values are finite (paired);
2. per image, one value per clause part (:data:`CLAUSES`), per draw for the parts against the control:

   * *beyond_nulls*: the mean over steps of ``rho - null``, for each of the three nulls;
   * *training* (shape): the means over steps of ``nw_gain - nw_gain_control_k`` and of
     ``rho - rho_control_k``; reported beside it, not tested, the scale ratio (geometric mean of
     ``key_scale_k`` = key RMS of the trained adapter / the untrained one's, the change of scale);
   * *bandwidth* (path): the exponent ``-d log logit_scale / d log h_schedule`` (OLS over the
     image's steps) minus the control's; the exponent itself is reported (2 for Theorem 3's head,
     whose bandwidth is the schedule's h; 0 for a head of fixed temperature);
   * *rise*: the OLS slope of rho on ``-log h_schedule`` minus the control's (same queries, so
     a rise that comes from the queries alone, e.g. their norms growing, cancels);
3. over images and draws: :func:`nw_adapter.core.intervals.two_level_test` (the beyond-nulls parts,
   which have no draws: :func:`~nw_adapter.core.intervals.greater_than_zero`), one-sided at
   ``alpha`` 0.05 against the part's smallest effect (:data:`MARGINS`).

A clause of several parts holds only when every part is significant: an intersection-union test,
whose size is at most ``alpha`` without any multiplicity correction. A part whose columns were not
recorded (the control off; an older ``rho.json`` with the one-draw, unmatched ``*_untrained``
columns and no ``logit_scale``) is "not measured" with a one-line reason: its clause is None unless
another part already failed, and never counts as evidence.

Conclusion: "evidence of learned kernel smoothing" needs the beyond-nulls, adapter-vs-control
(shape) and bandwidth clauses to hold ("met"); otherwise "no evidence", naming the clauses "not
met" or "not measured" (the printed verdict ends with a legend, :data:`LEGEND`). With one
reference image no clause can be tested: the conclusion is "undecided". Values left out of the
means (NaN or missing, with the record's ``<stat>_reason`` where it has one, e.g. ``h_eff_reason``)
are counted per column and reason (``skipped``) and printed.

Units by content, one sample at a time: the records are checked first (a malformed one is a
:class:`~nw_adapter.analysis.validation.RecordError` naming it); records of different models,
modes or settings (the digest of :mod:`nw_adapter.integration.settings`, naming the settings that
differ), and a unit with records of several runs (:data:`RUN_FIELDS`), are refused; units
(references or calls) with the same content digest (:data:`CONTENT_FIELD`) are one reference
image, and the verdict says how many were merged.

Plain Python with numpy/scipy (no torch): the verdict is rebuilt from a saved ``rho.json``.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nw_adapter.analysis.records import analysis_half
from nw_adapter.analysis.validation import RecordError, _shown, check_record
from nw_adapter.core.intervals import (
    CONFIDENCE,
    TWO_LEVEL_TEST,
    greater_than_zero,
    t_interval,
    two_level_test,
)
from nw_adapter.integration.schema import (
    KEY_SCALE,
    NULL_STATS,
    UNTRAINED_SUFFIX,
    control_column,
    control_draws,
    control_stat,
    finite_mean,
    key_scale_column,
)
from nw_adapter.integration.settings import SETTINGS_FIELD, differing_settings

ALPHA = 0.05
"""Size of each one-sided test (and so of each clause, by the intersection-union argument)."""

UNIT = "reference image"

METHOD = (
    "per reference image: statistics averaged over layers, heads and adapters per step (scales as "
    "logarithms; differences from each control draw over the records where both are finite), then one "
    "value per clause part and control draw; beyond-nulls parts: one-sided one-sample t test of mean > 0 "
    "over images (scipy.stats.ttest_1samp, alternative='greater'); parts against the scale-matched control: "
    f"{TWO_LEVEL_TEST}; a test of mean > the part's margin (smallest effect counted), alpha 0.05; a clause "
    "of several parts holds only when every part is significant (intersection-union test)"
)
"""How the verdict is computed, stored in ``rho.json``."""

THEORY_EXPONENT = 2.0
"""``-d log logit_scale / d log h`` of Theorem 3's exact NW head whose bandwidth is the schedule's h."""

MARGINS: dict[str, float] = {
    "nw_gain_minus_control": 1e-3,
    "rho_minus_control": 1e-3,
    "exponent_minus_control": 1e-2,
    "rise_minus_control": 1e-3,
}
"""The smallest effect each part against the control counts (its test is of ``mean > margin``).

1e-3 nats of ``nw_gain`` and 1e-3 of rho (per image, mean over steps), 0.01 of the exponent
(1/200 of Theorem 3's 2) and 1e-3 of rho per unit of ``log h``: far above what float32 rounding of
an exactly matched control gives (a control whose keys equal the trained keys after the matching
differs by at most 7e-9 in tests/correlate/test_verdict_acceptance.py), far below the effects worth a claim
(the issue's scale effects were 0.03 - 0.17 of rho and nw_gain)."""


@dataclass(frozen=True)
class Part:
    """One tested quantity of a clause: a per-image value (per control draw) whose mean should be > margin.

    Attributes:
        key: name of the per-image value.
        label: how the verdict prints it.
        needs: trained record columns it is computed from (all must have been recorded).
        control_of: statistics it needs the scale-matched control's draws of (``{stat}_control_{k}``).
        margin: the smallest effect counted (:data:`MARGINS`); 0 for the beyond-nulls parts.
    """

    key: str
    label: str
    needs: tuple[str, ...]
    control_of: tuple[str, ...] = ()
    margin: float = 0.0


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
        "beyond-nulls clause (rho above each of its nulls)",
        "beyond-nulls clause",
        tuple(
            Part(f"rho_minus_{null}", f"rho - {NULL_LABELS[null]} null", ("rho", null)) for null in NULL_STATS
        ),
    ),
    Clause(
        "training",
        "adapter-vs-control clause (shape: more NW-like than the scale-matched control)",
        "adapter-vs-control clause",
        (
            Part(
                "nw_gain_minus_control",
                "nw_gain - scale-matched control",
                ("nw_gain",),
                ("nw_gain",),
                MARGINS["nw_gain_minus_control"],
            ),
            Part(
                "rho_minus_control",
                "rho - scale-matched control",
                ("rho",),
                ("rho",),
                MARGINS["rho_minus_control"],
            ),
        ),
    ),
    Clause(
        "bandwidth",
        "bandwidth clause (logit scale follows the schedule's 1/h^2 more than the control's)",
        "bandwidth clause",
        (
            Part(
                "exponent_minus_control",
                "exponent - control's exponent",
                ("logit_scale", "h_schedule"),
                ("logit_scale",),
                MARGINS["exponent_minus_control"],
            ),
        ),
    ),
    Clause(
        "rise",
        "rise clause (rho rises with -log h more than the control's)",
        "rise clause",
        (
            Part(
                "rise_minus_control",
                "slope of rho on -log h - control's",
                ("rho", "h_schedule"),
                ("rho",),
                MARGINS["rise_minus_control"],
            ),
        ),
    ),
)
"""The clauses, in printing order."""

EVIDENCE_CLAUSES: tuple[str, ...] = ("beyond_nulls", "training", "bandwidth")
"""The clauses "evidence of learned kernel smoothing" needs."""

STATUS_WORDS: dict[bool | None, str] = {True: "met", False: "not met", None: "not measured"}
"""How a clause's ``holds`` (True / False / None) is printed."""

LEGEND: tuple[str, ...] = (
    "met: every part's mean is above its margin (the smallest effect counted; one-sided test, p < alpha); "
    "not met: some part's is not; not measured: a part's columns were not recorded, or there is one "
    "reference image",
    "scale-matched control: the same queries against the untrained adapter's keys, rescaled per layer and "
    "head to the trained keys' RMS norm (same algebra, same scale, no learning), K draws (seeds); "
    "adapter-vs-control not met means the trained adapter is not more NW-like than it in shape, not that "
    "training failed",
    "nulls of rho: perm = NW scores shuffled across keys; norm-matched = queries of the same norms in "
    "random directions; qk-spread = each row's q.k kept, its pairing with the key norms shuffled",
    "nw_gain = KL(attention || query-blind key prior) - KL(attention || fitted NW); logit_scale: RMS of "
    "the row-centred logits (inverse temperature); exponent = -slope of log logit_scale on log h (2 for "
    "an NW head whose bandwidth is h, 0 at a fixed temperature); scale ratio = key RMS trained / "
    "untrained (a change of scale, reported, not tested)",
    "h: the schedule's sigma / alpha; n: reference images (one content counts once) x control draws; "
    "two-level test: the draws' spread enters the interval, so an offset shared by a draw is not evidence",
)
"""The legend :func:`format_verdict` prints under the verdict: every term of its lines."""

LEGEND_WIDTH = 100
"""Width the legend is wrapped to (the table above it is at most 105 characters wide)."""

LINE_WIDTH = 105
"""Width every other verdict line is wrapped to (continuation lines indented 4 more)."""

RUN_FIELDS: tuple[str, ...] = ("run", "model", "mode", SETTINGS_FIELD)
"""Record fields naming the run a record belongs to (the recorder writes them): the verdict pools
one model, mode and settings digest (:mod:`nw_adapter.integration.settings`), and a reference of
one run only (:func:`check_one_run`); runs of the same settings over different references pool.
Records without them (files of older versions) pool as before."""

CONTENT_FIELD = "input_digest"
"""Record field identifying the reference by content (hash of the call's IP-Adapter image
embeddings, :mod:`nw_adapter.integration.steps`): units of the same content are one unit."""

_RECORDS_FIX = "pass the records of NWRecorder.to_records() or of a rho.json's 'records'"

MEAN_COLUMNS: tuple[str, ...] = ("rho", *NULL_STATS, "nw_gain", "nw_gain_untrained", "rho_untrained")
"""Columns averaged per (image, step) as they are (the ``*_untrained`` of older files for the figures)."""

LOG_COLUMNS: tuple[str, ...] = ("h_eff", "h_eff_untrained", "logit_scale")
"""Columns averaged per (image, step) as logarithms (``log_<name>``; non-positive values left out)."""

CONTROL_MEAN_OF: tuple[str, ...] = ("rho", "nw_gain")
"""Statistics whose control draws are averaged as they are, and paired with the trained value
(``d_<stat>_<k>``: mean over the records where both are finite of trained - draw k)."""

CONTROL_LOG_OF: tuple[str, ...] = ("logit_scale", "h_eff")
"""Statistics whose control draws are averaged as logarithms (``log_<stat>_control_<k>``), the first
paired (``d_log_logit_scale_<k>``)."""

NO_REASON = "NaN or missing (no reason recorded)"
"""The reason of a skipped value whose record names none (no ``<stat>_reason`` field)."""


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


Reader = Callable[[dict], float]


def _step_readers(draws: int) -> dict[str, Reader]:
    """Name of each per-step mean -> how to read it from one record (NaN: left out of the mean)."""

    def value(name: str) -> Reader:
        return lambda r: _number(r.get(name))

    def log(name: str) -> Reader:
        return lambda r: _log(r.get(name))

    def paired(reader: Reader, other: Reader) -> Reader:
        return lambda r: reader(r) - other(r)

    readers: dict[str, Reader] = {name: value(name) for name in MEAN_COLUMNS}
    readers.update({f"log_{name}": log(name) for name in LOG_COLUMNS})
    for k in range(draws):
        for stat in CONTROL_MEAN_OF:
            readers[control_column(stat, k)] = value(control_column(stat, k))
            readers[f"d_{stat}_{k}"] = paired(value(stat), value(control_column(stat, k)))
        for stat in CONTROL_LOG_OF:
            readers[f"log_{control_column(stat, k)}"] = log(control_column(stat, k))
        readers[f"d_log_logit_scale_{k}"] = paired(log("logit_scale"), log(control_column("logit_scale", k)))
        readers[f"log_{key_scale_column(k)}"] = log(key_scale_column(k))
    return readers


def image_step_means(records: Iterable[dict], half: str, draws: int | None = None) -> dict[Any, list[dict]]:
    """Per reference image and step, the statistics the verdict uses, averaged over layers/heads/adapters.

    Args:
        records: record dicts with ``reference`` (the CLI adds it); a record without one belongs to
            the image of its pipeline ``call`` (one call per reference image, one seed each, as a
            notebook loop over references records them).
        half: the CFG half kept.
        draws: control draws to average (default: those the records carry, :func:`control_draws`).

    Returns:
        ``{reference: [row, ...]}`` in step order; each row has ``step``, ``timestep``,
        ``h_schedule``, the finite mean of every :data:`MEAN_COLUMNS`, ``log_<name>`` of every
        :data:`LOG_COLUMNS` (mean of the logarithms of the positive finite values), and per draw
        ``k`` the control's columns and the paired differences ``d_rho_k``, ``d_nw_gain_k``,
        ``d_log_logit_scale_k`` (:func:`_step_readers`); None where no value is finite.
    """
    records = list(records)
    if draws is None:
        draws = control_draws({key for r in records for key in r})
    readers = _step_readers(draws)
    groups: dict[Any, dict[int, list[dict]]] = {}
    for record in records:
        if record.get("half") == half:
            groups.setdefault(_unit_name(record), {}).setdefault(int(record["step"]), []).append(record)
    out: dict[Any, list[dict]] = {}
    for reference, steps in groups.items():
        rows = []
        for step in sorted(steps):
            members = steps[step]
            row: dict[str, Any] = {"step": step}
            for name in ("timestep", "h_schedule"):
                row[name] = _clean(finite_mean(_number(r.get(name)) for r in members)[0])
            for name, read in readers.items():
                row[name] = _clean(finite_mean(read(r) for r in members)[0])
            rows.append(row)
        out[reference] = rows
    return out


def _unit_name(record: dict) -> str:
    """The reference a record belongs to: its ``reference``, else its pipeline ``call``."""
    return record["reference"] if "reference" in record else f"call {record.get('call')}"


def merge_by_content(records: Sequence[dict]) -> tuple[list[dict], dict[str, list[str]]]:
    """Records whose units (reference or call) share a content digest, relabelled as one unit.

    A reference given twice (two calls of one image, or two names of one file) is one unit, not
    two: every record of a unit whose :data:`CONTENT_FIELD` was seen first under another unit is
    relabelled with that unit's ``reference``. Records without the field keep their unit.

    Returns:
        ``(records, merged)``: the (relabelled) records and ``{kept unit: [merged units]}``.
    """
    first_unit: dict[str, str] = {}
    rename: dict[str, str] = {}
    for record in records:
        digest, unit = record.get(CONTENT_FIELD), _unit_name(record)
        if digest is None or unit in rename:
            continue
        kept = first_unit.setdefault(digest, unit)
        if kept != unit:
            rename[unit] = kept
    if not rename:
        return list(records), {}
    merged: dict[str, list[str]] = {}
    for unit, kept in rename.items():
        merged.setdefault(kept, []).append(unit)
    relabelled = [
        {**r, "reference": rename[_unit_name(r)]} if _unit_name(r) in rename else r for r in records
    ]
    return relabelled, merged


def _mean_difference(rows: Sequence[dict], a: str, b: str) -> float | None:
    """Mean over the steps where both are finite of ``row[a] - row[b]`` (None: no such step)."""
    diffs = [r[a] - r[b] for r in rows if r.get(a) is not None and r.get(b) is not None]
    return sum(diffs) / len(diffs) if diffs else None


def _step_mean(rows: Sequence[dict], name: str) -> float | None:
    """Mean over the steps where ``row[name]`` is finite (None: no such step)."""
    values = [r[name] for r in rows if r.get(name) is not None]
    return sum(values) / len(values) if values else None


def _ols_slope(x: Sequence[float], y: Sequence[float]) -> float | None:
    """OLS slope of y on x (None with fewer than 2 points or no spread in x)."""
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if xs.size < 2 or float(np.ptp(xs)) == 0.0:
        return None
    xc = xs - xs.mean()
    return float((xc * (ys - ys.mean())).sum() / (xc * xc).sum())


def slope_on_log_h(rows: Sequence[dict], name: str, sign: float) -> float | None:
    """``sign`` x the OLS slope of ``row[name]`` on ``log h_schedule`` over the steps where both are finite.

    ``sign = -1`` with ``log_logit_scale`` gives the exponent ``-d log logit_scale / d log h``; with
    rho the slope on ``-log h`` (a rise over denoising, where h falls).
    """
    kept = [r for r in rows if r.get(name) is not None and (r.get("h_schedule") or 0) > 0]
    slope = _ols_slope([math.log(r["h_schedule"]) for r in kept], [r[name] for r in kept])
    return None if slope is None else sign * slope


def _draw_values(rows: Sequence[dict], draws: int, value: Callable[[Sequence[dict], int], float | None]):
    """``[value(rows, k) for k in draws]`` (None where not computable)."""
    return [value(rows, k) for k in range(draws)]


def _mean_of(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if len(kept) == len(values) and kept else None


def per_image_values(reference: Any, rows: Sequence[dict], draws: int = 0) -> dict[str, Any]:
    """Every clause part's value for one image (None where its columns were not recorded).

    A part against the control has one value per draw (``<key>_draws``) and, as ``<key>``, their
    mean (None unless every draw has one). Also reported, not tested: ``exponent`` (the trained
    ``-d log logit_scale / d log h``), ``exponent_control_draws``, ``rho_slope`` (slope of rho on
    ``-log h``), ``log_scale_ratio_draws`` (mean over steps of ``log key_scale_k``) and ``steps``.
    """
    values: dict[str, Any] = {"reference": reference, "steps": len(rows), "draws": draws}
    for null in NULL_STATS:
        values[f"rho_minus_{null}"] = _mean_difference(rows, "rho", null)
    per_draw = {
        "nw_gain_minus_control": lambda r, k: _step_mean(r, f"d_nw_gain_{k}"),
        "rho_minus_control": lambda r, k: _step_mean(r, f"d_rho_{k}"),
        "exponent_minus_control": lambda r, k: slope_on_log_h(r, f"d_log_logit_scale_{k}", -1.0),
        "rise_minus_control": lambda r, k: slope_on_log_h(r, f"d_rho_{k}", -1.0),
    }
    for key, value in per_draw.items():
        values[f"{key}_draws"] = _draw_values(rows, draws, value)
        values[key] = _mean_of(values[f"{key}_draws"])
    values["exponent"] = slope_on_log_h(rows, "log_logit_scale", -1.0)
    values["exponent_control_draws"] = _draw_values(
        rows, draws, lambda r, k: slope_on_log_h(r, f"log_{control_column('logit_scale', k)}", -1.0)
    )
    values["rho_slope"] = slope_on_log_h(rows, "rho", -1.0)
    values["log_scale_ratio_draws"] = _draw_values(
        rows, draws, lambda r, k: _step_mean(r, f"log_{key_scale_column(k)}")
    )
    return values


def _present(records: Sequence[dict], half: str) -> set[str]:
    """The fields of this half's records (any value, NaN and None included)."""
    return {key for record in records if record.get("half") == half for key in record}


def _recorded(records: Sequence[dict], half: str) -> set[str]:
    """The columns with at least one finite value in this half."""
    present: set[str] = set()
    for record in records:
        if record.get("half") == half:
            present.update(k for k, v in record.items() if k not in present and math.isfinite(_number(v)))
    return present


def _missing_reason(columns: Sequence[str]) -> str:
    """Why a part was not measured: the columns it lacks."""
    return f"no {', '.join(columns)}"


LEGACY_REASON = (
    "only the one raw untrained draw of older versions (*_untrained), not the scale-matched draws "
    "<stat>_control_<k>"
)
"""Why a part against the control is not measured on a file of the one-draw, unmatched control."""


def _unmeasured(part: Part, recorded: set[str], draws: int) -> tuple[list[str], str | None]:
    """``(missing columns, reason)`` of a part that cannot be measured; ``([], None)`` when it can."""
    missing = [c for c in part.needs if c not in recorded]
    if part.control_of and draws == 0:
        if any(column.endswith(UNTRAINED_SUFFIX) for column in recorded):
            return missing, LEGACY_REASON
        missing += [control_column(stat, 0).removesuffix("0") + "<k>" for stat in part.control_of]
    else:
        missing += [c for c in (control_column(s, 0) for s in part.control_of) if c not in recorded]
    return missing, (_missing_reason(missing) if missing else None)


_EMPTY_TEST: dict[str, Any] = {
    "n": 0, "draws": 0, "mean": None, "low": None, "high": None, "se": None, "p": None,
    "significant": None, "caveat": None,
}  # fmt: skip


def _test_part(part: Part, images: Sequence[dict], recorded: set[str], draws: int) -> dict[str, Any]:
    missing, reason = _unmeasured(part, recorded, draws)
    entry: dict[str, Any] = {"key": part.key, "label": part.label, "margin": part.margin}
    if reason is not None:
        return {**entry, **_EMPTY_TEST, "test": None, "measured": False, "reason": reason, "missing": missing}
    if part.control_of:
        matrix = [[math.nan if v is None else v for v in image[f"{part.key}_draws"]] for image in images]
        result = two_level_test(matrix, margin=part.margin, alpha=ALPHA, confidence=CONFIDENCE).to_dict()
        entry["test"] = "two-level" if draws > 1 else "one-sample t (one draw)"
    else:
        tested = greater_than_zero([v[part.key] for v in images], alpha=ALPHA, confidence=CONFIDENCE)
        result = {**tested.to_dict(), "draws": 0, "se": None, "caveat": None}
        entry["test"] = "one-sample t"
    if result["n"] < 2:
        reason = "needs several reference images" if len(images) < 2 else "fewer than 2 images have a value"
        return {**entry, **result, "measured": False, "reason": reason, "significant": None}
    return {**entry, **result, "measured": True, "reason": None}


def _interval(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean and 95% Student t interval over images (None where not computable)."""
    kept = [v for v in values if v is not None and math.isfinite(v)]
    if not kept:
        return {"n": 0, "mean": None, "low": None, "high": None}
    mean, low, high = t_interval(kept)
    return {"n": len(kept), "mean": _clean(mean), "low": _clean(low), "high": _clean(high)}


def _two_level_interval(matrix: Sequence[Sequence[float | None]], transform=None) -> dict[str, Any]:
    """The two-level interval of the mean of ``matrix`` ``[R, K]`` (no test), optionally transformed."""
    result = two_level_test(
        [[math.nan if v is None else v for v in row] for row in matrix], confidence=CONFIDENCE
    )
    out: dict[str, Any] = {"n": result.n, "draws": result.draws}
    for name in ("mean", "low", "high"):
        x = getattr(result, name)
        out[name] = _clean(transform(x) if transform is not None and math.isfinite(x) else x)
    return out


def _reported(clause: Clause, images: Sequence[dict], recorded: set[str], draws: int) -> list[dict[str, Any]]:
    """The quantities reported beside a clause, not tested (each with its interval)."""
    if clause.key == "training" and draws and key_scale_column(0) in recorded:
        ratio = _two_level_interval([v["log_scale_ratio_draws"] for v in images], math.exp)
        return [{"key": "scale_ratio", "label": "scale ratio (key RMS trained / untrained)",
                 **ratio}]  # fmt: skip
    if clause.key == "bandwidth" and "logit_scale" in recorded and "h_schedule" in recorded:
        out = [{"key": "exponent", "label": "exponent -dlog(logit_scale)/dlog(h)", "theory": THEORY_EXPONENT,
                **_interval([v["exponent"] for v in images])}]  # fmt: skip
        if draws and control_column("logit_scale", 0) in recorded:
            control = _two_level_interval([v["exponent_control_draws"] for v in images])
            out.append({"key": "exponent_control", "label": "the control's exponent", **control})
        return out
    if clause.key == "rise" and "rho" in recorded and "h_schedule" in recorded:
        slope = _interval([v["rho_slope"] for v in images])
        return [{"key": "rho_slope", "label": "slope of rho on -log h", **slope}]
    return []


def _clause_result(clause: Clause, images: Sequence[dict], recorded: set[str], draws: int) -> dict[str, Any]:
    parts = [_test_part(part, images, recorded, draws) for part in clause.parts]
    failed = [p for p in parts if p["measured"] and not p["significant"]]
    unmeasured = [p for p in parts if not p["measured"]]
    if failed:
        holds, reason = False, None
    elif unmeasured:
        missing = list(dict.fromkeys(c for p in unmeasured for c in p.get("missing", ())))
        reasons = [_missing_reason(missing)] if missing else []
        reasons += [p["reason"] for p in unmeasured if not p.get("missing") or p["reason"] == LEGACY_REASON]
        holds, reason = None, "; ".join(dict.fromkeys(reasons))
    else:
        holds, reason = True, None
    return {
        "label": clause.label,
        "short": clause.short,
        "holds": holds,
        "reason": reason,
        "parts": parts,
        "reported": _reported(clause, images, recorded, draws),
    }


def _conclusion(clauses: dict[str, dict], images: int) -> tuple[bool | None, str]:
    if images < 2:
        return None, "undecided: 1 reference image; pass several (--image-dir)"
    needed = [clauses[key] for key in EVIDENCE_CLAUSES]
    if all(c["holds"] is True for c in needed):
        shorts = ", ".join(c["short"] for c in needed[:-1]) + f" and {needed[-1]['short']}"
        return True, f"evidence of learned kernel smoothing ({images} reference images): {shorts} met"
    why = ", ".join(f"{c['short']} {STATUS_WORDS[c['holds']]}" for c in needed if c["holds"] is not True)
    return False, f"no evidence of learned kernel smoothing ({images} reference images): {why}"


def _read_columns(draws: int) -> tuple[str, ...]:
    """The record columns the per-step means read (whose left-out values are counted)."""
    controls = [control_column(s, k) for k in range(draws) for s in (*CONTROL_MEAN_OF, *CONTROL_LOG_OF)]
    return (*MEAN_COLUMNS, *LOG_COLUMNS, *controls, *(key_scale_column(k) for k in range(draws)))


def skipped_values(records: Sequence[dict], half: str, columns: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per column present in this half, the values left out of the means, counted per reason.

    A value is left out when it is NaN, infinite, None or missing from a record of the half (a
    scale also when it is <= 0); its reason is the record's ``<column>_reason`` text when it has
    one (``h_eff_reason``: why the bandwidth is not identified), else :data:`NO_REASON`.

    Returns:
        ``{column: {"count": n, "reasons": {reason: n}}}`` for the columns with a left-out value.
    """
    kept = [r for r in records if r.get("half") == half]
    present = _present(kept, half)
    out: dict[str, dict[str, Any]] = {}
    for column in columns:
        if column not in present:
            continue
        reasons: dict[str, int] = {}
        positive = column in LOG_COLUMNS or control_stat(column) in (KEY_SCALE, *CONTROL_LOG_OF)
        for record in kept:
            x = _number(record.get(column))
            if math.isfinite(x) and (x > 0 or not positive):
                continue
            why = record.get(f"{column}_reason")
            why = why if isinstance(why, str) and why else NO_REASON
            reasons[why] = reasons.get(why, 0) + 1
        if reasons:
            out[column] = {"count": sum(reasons.values()), "reasons": reasons}
    return out


def check_verdict_records(records: Any) -> list[dict]:
    """The records as a list, each checked field by field (the kinds of a rho.json record).

    Every field is checked, not only those the verdict groups by: a statistic that is not a number
    (``"rho": "0.5"``) would otherwise read as missing and its clause as "not measured".

    Raises:
        RecordError: (a ``ValueError``) not a list of record objects, or a record whose
            ``step``, ``half``, ``reference``, ``call``, ``key_set``, run field or statistic has the
            wrong kind; one line naming the record, the field and the fix.
    """
    if isinstance(records, str | bytes | Mapping) or not isinstance(records, Iterable):
        raise RecordError(f"records: is {_shown(records)}, not a list of record objects; {_RECORDS_FIX}")
    records = list(records)
    for index, record in enumerate(records):
        where = f"records[{index}]"
        if not isinstance(record, Mapping):
            raise RecordError(f"{where}: is {_shown(record)}, not a record object; {_RECORDS_FIX}")
        check_record(record, where, source="verdict", fix=_RECORDS_FIX, required=("step",))
    return records


def _values(records: Sequence[dict], name: str) -> list[Any]:
    """The distinct non-null values of field ``name``, in order of appearance."""
    return list(dict.fromkeys(r[name] for r in records if r.get(name) is not None))


def check_one_run(records: Sequence[dict]) -> None:
    """Refuse records that are not one sample of reference images (:data:`RUN_FIELDS`).

    Records of different models, modes or settings (the digest of
    :mod:`nw_adapter.integration.settings`: steps, scheduler, bandwidth rule, guidance, IP-Adapter
    scale, control draws, statistics options ...) are never pooled: their readings mean different
    things. Records of different runs with the same settings are pooled only as different
    reference images: one unit (a ``reference``, or a pipeline ``call`` without one, e.g. the call
    0 of two recorders) in two runs would average two runs' generations as one image. Records
    without these fields (older files) pass.

    Raises:
        RecordError: one line naming the models, modes, settings or runs found and how to keep one.
    """
    for name in ("model", "mode"):
        found = _values(records, name)
        if len(found) > 1:
            shown = ", ".join(repr(v) for v in found[:3]) + (", ..." if len(found) > 3 else "")
            raise RecordError(
                f"verdict: records of {len(found)} different {name}s ({shown}) are not one sample; judge "
                f"one at a time, e.g. verdict([r for r in records if r.get({name!r}) == {found[0]!r}])"
            )
    digests = _values(records, SETTINGS_FIELD)
    if len(digests) > 1:
        differ = differing_settings(digests)
        runs = _values([r for r in records if r.get(SETTINGS_FIELD) != digests[0]], "run")
        first = _values([r for r in records if r.get(SETTINGS_FIELD) == digests[0]], "run")
        among = f" (runs {first[0]!r} and {runs[0]!r})" if first and runs else ""
        raise RecordError(
            f"verdict: records of {len(digests)} different settings{among} are not one sample: "
            f"{', '.join(differ)} {'differs' if len(differ) == 1 else 'differ'}; judge one setting at a "
            f"time, e.g. verdict([r for r in records if r.get({SETTINGS_FIELD!r}) == {digests[0]!r}])"
        )
    runs_of: dict[str, list[Any]] = {}
    for record in records:
        run = record.get("run")
        if run is not None:
            runs = runs_of.setdefault(_unit_name(record), [])
            if run not in runs:
                runs.append(run)
    shared = next(((unit, runs) for unit, runs in runs_of.items() if len(runs) > 1), None)
    if shared is not None:
        unit, runs = shared
        raise RecordError(
            f"verdict: {unit!r} has records of {len(runs)} different runs "
            f"({', '.join(repr(r) for r in runs[:3])}), which would be pooled as one reference image; "
            f"judge one run at a time, e.g. verdict([r for r in records if r.get('run') == {runs[0]!r}]), "
            "or give each run's records their own 'reference'"
        )


def verdict(records: Sequence[dict], *, half: str | None = None, merged_files: int = 0) -> dict[str, Any]:
    """The verdict over reference images x control draws (see the module docstring, docs/verdict.md).

    Args:
        records: record dicts, each with ``reference`` (the image it belongs to) or, without one,
            its pipeline ``call`` (one call per reference image): e.g. ``recorder.to_records()``,
            or :func:`nw_adapter.comparison_records` of :func:`nw_adapter.compare_attention` results.
        half: CFG half (default :func:`~nw_adapter.analysis.records.analysis_half`).
        merged_files: reference files already merged into others of the same content before
            the run (:func:`nw_adapter.correlate.images.validate_images`), counted in
            ``duplicates_merged``.

    Units of the same content (records' :data:`CONTENT_FIELD`) are one reference image
    (:func:`merge_by_content`).

    Returns:
        JSON-ready dict: ``unit``, ``method``, ``alpha``, ``confidence``, ``half``, ``images``
        (number of distinct reference images), ``draws`` (control draws K), ``duplicates_merged``,
        ``merged`` (kept unit -> the units merged into it), ``per_image`` (one dict per image:
        :func:`per_image_values`), ``clauses`` (key -> ``label``, ``short``, ``holds`` True /
        False / None = not measured, ``reason``, ``parts``: each with ``key``, ``label``,
        ``test``, ``margin``, ``n``, ``draws``, ``mean``, ``low``, ``high``, ``se``, ``p``,
        ``significant``, ``measured``, ``reason``, ``caveat``; ``reported``: quantities given
        with their interval, not tested), ``evidence`` (True / False; None when undecided),
        ``conclusion`` (the printed line), ``skipped`` (:func:`skipped_values`) and
        ``nonfinite`` (column -> its count of skipped values).

    Raises:
        ValueError: no records of that half.
        RecordError: (a ``ValueError``) a malformed record, records of several models, modes or
            settings, or a unit of several runs (:func:`check_one_run`); one line naming them and
            the fix.
    """
    records = check_verdict_records(records)
    if not records:
        raise ValueError("records: empty; nothing to judge (did the run record any step?)")
    check_one_run(records)
    # SD3 also records its joint softmax (key set "joint"), which has no control: the verdict
    # judges the image branch's own softmax over the IP keys
    records = [r for r in records if r.get("key_set", "ip") == "ip"] or list(records)
    half = half or analysis_half(records)
    records, merged = merge_by_content(records)
    recorded = _recorded(records, half)
    draws = control_draws(recorded)
    by_image = image_step_means(records, half, draws)
    if not by_image:
        raise ValueError(f"records: none of half {half!r}; nothing to judge")
    images = [per_image_values(reference, rows, draws) for reference, rows in by_image.items()]
    clauses = {clause.key: _clause_result(clause, images, recorded, draws) for clause in CLAUSES}
    evidence, conclusion = _conclusion(clauses, len(images))
    skipped = skipped_values(records, half, _read_columns(draws))
    return {
        "unit": UNIT,
        "method": METHOD,
        "alpha": ALPHA,
        "confidence": CONFIDENCE,
        "half": half,
        "images": len(images),
        "draws": draws,
        "duplicates_merged": merged_files + sum(len(units) for units in merged.values()),
        "merged": merged,
        "per_image": images,
        "clauses": clauses,
        "evidence": evidence,
        "conclusion": conclusion,
        "skipped": skipped,
        "nonfinite": {name: entry["count"] for name, entry in skipped.items()},
    }


def _signed(x: float | None) -> str:
    return "nan" if x is None else f"{x:+.3f}"


def _p(p: float | None) -> str:
    if p is None:
        return "p n/a"
    return f"p {p:.1e}" if p < 1e-3 else f"p {p:.3f}"


def _count(part: dict) -> str:
    draws = part.get("draws") or 0
    return f"n {part['n']} x {draws} draws" if draws > 1 else f"n {part['n']}"


def _part_line(part: dict) -> str:
    if part["n"] == 0 and not part["measured"]:
        return f"{part['label']}: not measured"
    interval = f"[{_signed(part['low'])}, {_signed(part['high'])}]" if part["low"] is not None else "[n/a]"
    margin = f", margin {part['margin']:g}" if part.get("margin") else ""
    return f"{part['label']}: {_signed(part['mean'])} {interval}, {_p(part['p'])}, {_count(part)}{margin}"


def _reported_line(entry: dict) -> str:
    low, high = entry.get("low"), entry.get("high")
    interval = f"[{low:.3f}, {high:.3f}]" if low is not None and high is not None else "[n/a]"
    mean = "nan" if entry.get("mean") is None else f"{entry['mean']:.3f}"
    theory = f" (theory: {entry['theory']:g})" if entry.get("theory") is not None else ""
    return f"reported (not tested): {entry['label']}: {mean} {interval}, {_count(entry)}{theory}"


def _clause_status(clause: dict, images: int) -> str:
    if clause["holds"] is not None:
        return STATUS_WORDS[clause["holds"]]
    if images < 2 and not any(p.get("missing") or p.get("reason") == LEGACY_REASON for p in clause["parts"]):
        return "needs several reference images"
    return f"not measured: {clause['reason']}"


_RESULT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "conclusion": str,
    "images": int,
    "unit": str,
    "alpha": (int, float),
    "clauses": Mapping,
}
_CLAUSE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "label": str,
    "holds": (bool, type(None)),
    "reason": (str, type(None)),
    "parts": list,
}
_PART_FIELDS: dict[str, type | tuple[type, ...]] = {
    "label": str,
    "measured": (bool, type(None)),
    "n": int,
    **{name: (int, float, type(None)) for name in ("mean", "low", "high", "p")},
}
_RESULT_FIX = "pass the dict verdict() returns (or a rho.json's 'verdict')"


def _check_fields(value: Any, fields: dict[str, Any], where: str) -> None:
    if not isinstance(value, Mapping):
        raise RecordError(f"{where}: is {_shown(value)}, not an object; {_RESULT_FIX}")
    for name, kind in fields.items():
        if name not in value:
            raise RecordError(f"{where}: field '{name}' is missing; {_RESULT_FIX}")
        if not isinstance(value[name], kind) or (kind is int and isinstance(value[name], bool)):
            found = _shown(value[name])
            raise RecordError(f"{where}: field '{name}' is {found}, of the wrong kind; {_RESULT_FIX}")


def _check_skipped(skipped: Any) -> None:
    if not isinstance(skipped, Mapping):
        raise RecordError(f"verdict: field 'skipped' is {_shown(skipped)}, not an object; {_RESULT_FIX}")
    for column, entry in skipped.items():
        ok = isinstance(entry, Mapping) and isinstance(entry.get("count"), int)
        if not ok or not isinstance(entry.get("reasons"), Mapping):
            raise RecordError(
                f"verdict.skipped.{column}: is {_shown(entry)}, not {{count, reasons}}; {_RESULT_FIX}"
            )


def check_verdict_result(result: Any) -> None:
    """Check what :func:`format_verdict` prints: the fields :func:`verdict` returns that it reads.

    Raises:
        RecordError: (a ``ValueError``) the first missing or wrong field, in one line.
    """
    _check_fields(result, _RESULT_FIELDS, "verdict")
    if not isinstance(result.get("nonfinite") or {}, Mapping):
        found = _shown(result["nonfinite"])
        raise RecordError(f"verdict: field 'nonfinite' is {found}, not an object of counts; {_RESULT_FIX}")
    if "skipped" in result:
        _check_skipped(result["skipped"])
    if not isinstance(result.get("draws") or 0, int):
        raise RecordError(f"verdict: field 'draws' is {_shown(result['draws'])}, not a count; {_RESULT_FIX}")
    for key, clause in result["clauses"].items():
        _check_fields(clause, _CLAUSE_FIELDS, f"verdict.clauses.{key}")
        if not isinstance(clause.get("reported") or [], list):
            found = _shown(clause["reported"])
            where = f"verdict.clauses.{key}"
            raise RecordError(f"{where}: field 'reported' is {found}, not a list; {_RESULT_FIX}")
        for index, part in enumerate(clause["parts"]):
            _check_fields(part, _PART_FIELDS, f"verdict.clauses.{key}.parts[{index}]")
        for index, entry in enumerate(clause.get("reported") or []):
            where = f"verdict.clauses.{key}.reported[{index}]"
            _check_fields(entry, {k: v for k, v in _PART_FIELDS.items() if k not in ("measured", "p")}, where)


def _unit_line(result: dict) -> str:
    merged = result.get("duplicates_merged") or 0
    same = f" ({merged} of the same content merged: counted once)" if merged else ""
    draws = result.get("draws") or 0
    control = f", {draws} control draws" if draws else ""
    return (
        f"  unit: {result['unit']}, one seed each, n {result['images']}{same}{control}; "
        f"mean [95% interval], one-sided, alpha {result['alpha']}"
    )


def _fit(text: str, indent: str) -> list[str]:
    """``text`` at ``indent``, wrapped to :data:`LINE_WIDTH` (continuation lines 4 deeper)."""
    return textwrap.wrap(
        text, LINE_WIDTH, initial_indent=indent, subsequent_indent=indent + "    ", break_on_hyphens=False
    )


def _wrapped(text: str) -> list[str]:
    return textwrap.wrap(
        text, LEGEND_WIDTH, initial_indent="    ", subsequent_indent="      ", break_on_hyphens=False
    )


def _skipped_lines(result: dict) -> list[str]:
    skipped = result.get("skipped")
    if skipped is None:  # a verdict of an older version: its plain counts
        nonfinite = result.get("nonfinite") or {}
        skipped = {k: {"count": v, "reasons": {}} for k, v in nonfinite.items()}
    if not skipped:
        return []
    entries = []
    for column, entry in skipped.items():
        reasons = "; ".join(f"{why}: {n}" for why, n in entry["reasons"].items())
        entries.append(f"{column} {entry['count']}" + (f" ({reasons})" if reasons else ""))
    return ["  skipped (left out of the means):", *(line for e in entries for line in _wrapped(e))]


def format_verdict(result: dict) -> str:
    """The verdict as printed: the conclusion line, then per clause its status, its parts and
    what it reports (indented), the unit line, the skipped values and the legend (:data:`LEGEND`).

    Each part: mean [95% interval], one-sided p, n images (x draws), margin.

    Raises:
        RecordError: (a ``ValueError``) ``result`` is not a verdict (:func:`check_verdict_result`).
    """
    check_verdict_result(result)
    lines = [f"verdict: {result['conclusion']}"]
    images = result["images"]
    for clause in result["clauses"].values():
        lines += _fit(f"{clause['label']}: {_clause_status(clause, images)}", "  ")
        for part in clause["parts"]:
            if part["measured"] or part["n"]:
                lines += _fit(_part_line(part), "    ")
                if part.get("caveat"):
                    lines += _fit(f"caveat: {part['caveat']}", "      ")
        for entry in clause.get("reported") or []:
            if entry["n"]:
                lines += _fit(_reported_line(entry), "    ")
    lines += _fit(_unit_line(result).strip(), "  ")
    lines.extend(_skipped_lines(result))
    lines.append("  legend:")
    for entry in LEGEND:
        lines.extend(_wrapped(entry))
    return "\n".join(lines)
