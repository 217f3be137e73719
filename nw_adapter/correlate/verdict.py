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

Conclusion: "evidence of learned kernel smoothing" needs the first two clauses to hold ("met");
otherwise "no evidence", naming the clauses "not met" or "not measured" (the printed verdict ends
with a legend of these words and of every term, :data:`LEGEND`). With one reference image no
clause can be tested: the conclusion is "undecided" and the per-image values are still reported.

Units by content, one sample at a time: the records are checked first (a malformed one is a
:class:`~nw_adapter.integration.validation.RecordError` naming it); records of different models
or modes, and a unit with records of several runs (:data:`RUN_FIELDS`), are refused; units
(references or calls) with the same content digest (:data:`CONTENT_FIELD`) are one reference
image, and the verdict says how many were merged.

Plain Python with numpy/scipy (no torch): the verdict is rebuilt from a saved ``rho.json``.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nw_adapter.core.intervals import CONFIDENCE, greater_than_zero
from nw_adapter.integration.records import analysis_half
from nw_adapter.integration.schema import NULL_STATS, finite_mean
from nw_adapter.integration.validation import RecordError, _shown, check_record

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
        "beyond-nulls clause (rho above each of its nulls)",
        "beyond-nulls clause",
        tuple(
            Part(f"rho_minus_{null}", f"rho - {NULL_LABELS[null]} null", ("rho", null)) for null in NULL_STATS
        ),
    ),
    Clause(
        "training",
        "adapter-vs-control clause (trained adapter more NW-like than its untrained control)",
        "adapter-vs-control clause",
        (
            Part(
                "nw_gain_minus_untrained", "nw_gain - untrained control's", ("nw_gain", "nw_gain_untrained")
            ),
            Part("rho_minus_untrained", "rho - untrained control's", ("rho", "rho_untrained")),
        ),
    ),
    Clause(
        "bandwidth",
        "bandwidth clause (h_eff follows the schedule's h more than the control's)",
        "bandwidth clause",
        (
            Part(
                "h_slope_minus_untrained",
                "slope of log h_eff on log h, minus the untrained control's",
                ("h_eff", "h_eff_untrained", "h_schedule"),
            ),
        ),
    ),
    Clause(
        "rise",
        "rise clause (rho rises over denoising)",
        "rise clause",
        (Part("rho_rise", "OLS slope of rho on denoising progress", ("rho",)),),
    ),
)
"""The clauses, in printing order."""

EVIDENCE_CLAUSES: tuple[str, ...] = ("beyond_nulls", "training")
"""The clauses "evidence of learned kernel smoothing" needs."""

STATUS_WORDS: dict[bool | None, str] = {True: "met", False: "not met", None: "not measured"}
"""How a clause's ``holds`` (True / False / None) is printed."""

LEGEND: tuple[str, ...] = (
    "met: every part's mean over reference images is > 0 (one-sided t test, p < alpha); not met: some "
    "part's is not; not measured: a part's columns were not recorded, or there is one reference image",
    "untrained control: the same queries against the keys of the adapter's untrained initialisation "
    "(THEORY.md section 4); adapter-vs-control not met means the trained adapter is not more NW-like "
    "than it, not that training failed",
    "nulls of rho: perm = NW scores shuffled across keys; norm-matched = queries of the same norms in "
    "random directions; qk-spread = each row's q.k kept, its pairing with the key norms shuffled",
    "nw_gain = KL(attention || query-blind key prior) - KL(attention || fitted NW); h_eff: the fitted "
    "bandwidth; h: the schedule's sigma / alpha; n: reference images (one content counts once)",
)
"""The legend :func:`format_verdict` prints under the verdict: every term of its lines."""

LEGEND_WIDTH = 100
"""Width the legend is wrapped to (the table above it is at most 105 characters wide)."""

RUN_FIELDS: tuple[str, ...] = ("run", "model", "mode")
"""Record fields naming the run a record belongs to (the recorder writes them): the verdict pools
one model and mode, and a reference of one run only (:func:`check_one_run`). Records without
them (files of older versions) pool as before."""

CONTENT_FIELD = "input_digest"
"""Record field identifying the reference by content (hash of the call's IP-Adapter image
embeddings, :mod:`nw_adapter.integration.steps`): units of the same content are one unit."""

_CHECKED_FIELDS: tuple[str, ...] = (
    "reference",
    "call",
    "step",
    "half",
    "key_set",
    *RUN_FIELDS,
    CONTENT_FIELD,
)
"""The record fields the verdict groups by; checked before use (:func:`check_verdict_records`)."""

_RECORDS_FIX = "pass the records of NWRecorder.to_records() or of a rho.json's 'records'"

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
            groups.setdefault(_unit_name(record), {}).setdefault(int(record["step"]), []).append(record)
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
        return True, f"evidence of learned kernel smoothing ({images} reference images): {shorts} met"
    why = ", ".join(f"{c['short']} {STATUS_WORDS[c['holds']]}" for c in needed if c["holds"] is not True)
    return False, f"no evidence of learned kernel smoothing ({images} reference images): {why}"


def check_verdict_records(records: Any) -> list[dict]:
    """The records as a list, each checked in the fields the verdict groups by.

    Raises:
        RecordError: (a ``ValueError``) not a list of record objects, or a record whose
            ``step``, ``half``, ``reference``, ``call``, ``key_set`` or run field has the wrong
            kind; one line naming the record, the field and the fix.
    """
    if isinstance(records, str | bytes | Mapping) or not isinstance(records, Iterable):
        raise RecordError(f"records: is {_shown(records)}, not a list of record objects; {_RECORDS_FIX}")
    records = list(records)
    for index, record in enumerate(records):
        where = f"records[{index}]"
        if not isinstance(record, Mapping):
            raise RecordError(f"{where}: is {_shown(record)}, not a record object; {_RECORDS_FIX}")
        fields = {k: record[k] for k in _CHECKED_FIELDS if k in record}
        check_record(fields, where, source="verdict", fix=_RECORDS_FIX, required=("step",))
    return records


def _values(records: Sequence[dict], name: str) -> list[Any]:
    """The distinct non-null values of field ``name``, in order of appearance."""
    return list(dict.fromkeys(r[name] for r in records if r.get(name) is not None))


def check_one_run(records: Sequence[dict]) -> None:
    """Refuse records that are not one sample of reference images (:data:`RUN_FIELDS`).

    Records of different models or modes are never pooled. Records of different runs are pooled
    only as different reference images: one unit (a ``reference``, or a pipeline ``call`` without
    one, e.g. the call 0 of two recorders) in two runs would average two runs' generations as one
    image. Records without these fields (older files) pass.

    Raises:
        RecordError: one line naming the models, modes or runs found and how to keep one.
    """
    for name in ("model", "mode"):
        found = _values(records, name)
        if len(found) > 1:
            shown = ", ".join(repr(v) for v in found[:3]) + (", ..." if len(found) > 3 else "")
            raise RecordError(
                f"verdict: records of {len(found)} different {name}s ({shown}) are not one sample; judge "
                f"one at a time, e.g. verdict([r for r in records if r.get({name!r}) == {found[0]!r}])"
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
    """The verdict over reference images (see the module docstring).

    Args:
        records: record dicts, each with ``reference`` (the image it belongs to) or, without one,
            its pipeline ``call`` (one call per reference image): e.g. ``recorder.to_records()``.
        half: CFG half (default :func:`~nw_adapter.integration.records.analysis_half`).

        merged_files: reference files already merged into others of the same content before
            the run (:func:`nw_adapter.correlate.images.validate_images`), counted in
            ``duplicates_merged``.

    Units of the same content (records' :data:`CONTENT_FIELD`) are one reference image
    (:func:`merge_by_content`).

    Returns:
        JSON-ready dict: ``unit``, ``method``, ``alpha``, ``confidence``, ``half``, ``images``
        (number of distinct reference images), ``duplicates_merged`` (units and files of a content
        seen before, counted once), ``merged`` (kept unit -> the units merged into it),
        ``per_image`` (one dict per image: ``reference``, ``steps`` and every part's value),
        ``clauses`` (key -> ``label``, ``holds`` True / False / None = not measured, ``reason``,
        ``parts``: each with ``n``, ``mean``, ``low``, ``high``, ``p``,
        ``significant``, ``measured``, ``reason``), ``evidence`` (True / False; None when undecided)
        and ``conclusion`` (the printed line), ``nonfinite`` (column -> non-finite values left out).

    Raises:
        ValueError: no records of that half.
        RecordError: (a ``ValueError``) a malformed record, records of several models or modes,
            or a unit of several runs (:func:`check_one_run`); one line naming them and the fix.
    """
    records = check_verdict_records(records)
    if not records:
        raise ValueError("records: empty; nothing to judge (did the run record any step?)")
    check_one_run(records)
    # SD3 also records its joint softmax (key set "joint"), which has no untrained control: the
    # verdict judges the image branch's own softmax over the IP keys
    records = [r for r in records if r.get("key_set", "ip") == "ip"] or list(records)
    half = half or analysis_half(records)
    records, merged = merge_by_content(records)
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
        "duplicates_merged": merged_files + sum(len(units) for units in merged.values()),
        "merged": merged,
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
    if clause["holds"] is not None:
        return STATUS_WORDS[clause["holds"]]
    if images < 2 and not any(p.get("missing") for p in clause["parts"]):
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


def check_verdict_result(result: Any) -> None:
    """Check what :func:`format_verdict` prints: the fields :func:`verdict` returns that it reads.

    Raises:
        RecordError: (a ``ValueError``) the first missing or wrong field, in one line.
    """
    _check_fields(result, _RESULT_FIELDS, "verdict")
    if not isinstance(result.get("nonfinite") or {}, Mapping):
        found = _shown(result["nonfinite"])
        raise RecordError(f"verdict: field 'nonfinite' is {found}, not an object of counts; {_RESULT_FIX}")
    for key, clause in result["clauses"].items():
        _check_fields(clause, _CLAUSE_FIELDS, f"verdict.clauses.{key}")
        for index, part in enumerate(clause["parts"]):
            _check_fields(part, _PART_FIELDS, f"verdict.clauses.{key}.parts[{index}]")


def _unit_line(result: dict) -> str:
    merged = result.get("duplicates_merged") or 0
    same = f" ({merged} of the same content merged: counted once)" if merged else ""
    return (
        f"  unit: {result['unit']}, one seed each, n {result['images']}{same}; "
        f"mean [95% Student t interval], one-sided t test p, alpha {result['alpha']}"
    )


def format_verdict(result: dict) -> str:
    """The verdict as printed: the conclusion line, then per clause its status and its parts
    (indented), the unit line and the legend of the terms (:data:`LEGEND`).

    Each part: mean [95% t interval], one-sided p, n images.

    Raises:
        RecordError: (a ``ValueError``) ``result`` is not a verdict (:func:`check_verdict_result`).
    """
    check_verdict_result(result)
    lines = [f"verdict: {result['conclusion']}"]
    images = result["images"]
    for clause in result["clauses"].values():
        lines.append(f"  {clause['label']}: {_clause_status(clause, images)}")
        for part in clause["parts"]:
            if part["measured"] or part["n"]:
                lines.append(f"    {_part_line(part)}")
    lines.append(_unit_line(result))
    nonfinite = result.get("nonfinite") or {}
    if nonfinite:
        counts = ", ".join(f"{k} {v}" for k, v in nonfinite.items())
        lines.append(f"  non-finite values left out of the means: {counts}")
    lines.append("  legend:")
    for entry in LEGEND:
        lines.extend(
            textwrap.wrap(
                entry, LEGEND_WIDTH, initial_indent="    ", subsequent_indent="      ", break_on_hyphens=False
            )
        )
    return "\n".join(lines)
