"""The verdict of a ``correlate.py`` run: is the image branch a kernel smoother on the schedule?

Layers, heads and query rows of one generation are not independent, so no interval or test is
taken over them. The unit is the reference image (one seed each); the control (the untrained
adapter, its keys rescaled per layer and head to the trained keys' RMS norm: the scale-matched
control, columns ``{stat}_control_{k}`` for draws (seeds) ``k = 0 .. K-1``) is a second random
level, so every part against it is tested over references x draws (docs/verdict.md).

The verdict places the adapter between two **anchors** on the same readings: the control (the
same algebra, no learning) and the exact NW head (the theory). The exact head is measured when the
run was calibrated (``calibrate=True`` / ``--calibrate``: every reference generated again with the
exact head at the schedule's h swapped in, its statistics merged into the records as
``{stat}_exact`` and its own control as ``{stat}_exact_control_{k}``, ``key_scale_exact_{k}``;
:mod:`nw_adapter.integration.calibration`), else it is the theory's value (exponent 2, r2_nw 1).

1. per image and recorded step, every statistic is averaged over layers, heads and adapters (the
   CFG half of :func:`~nw_adapter.analysis.records.analysis_half`: ``cond`` under guidance);
   a scale (``h_eff``, ``logit_scale``, ``key_scale_k``) is averaged as a logarithm; a difference
   from control draw ``k`` is averaged over the records where both values are finite (paired);
2. per image, one value per clause part (:data:`CLAUSES`), per draw for the parts against the
   control. The **conclusion** needs two claims, each in the theory's own units:

   * *bandwidth* (path): the exponent ``-d log logit_scale / d log h_schedule`` (OLS over the
     image's steps) is **equivalent to the theory's 2** (two one-sided tests, margin 0.5: the band
     [1.5, 2.5]) and, as a separate part, above the control's. The control's path is its logit
     scale with its keys' scale matched **once per run and head**: its per-step matching factor
     ``key_scale_k`` divided back out (a constant factor leaves an exponent unchanged; a factor
     that follows h would hand a path carried by the keys to the control, THEORY.md 4b);
   * *NW form* (shape): ``r2_nw``, the share of the row-centred logits' variance one NW term
     ``beta (q.k_i - ||k_i||^2 / 2)`` explains in the head's own q/k space, is above 0.95: the
     logits carry the key-norm term of the NW smoother (the exact head: 1), which a dot product
     ``q.k_i`` lacks (its deficit is the key prior's share; 0 only when the key norms do not
     vary, where a dot product *is* an NW smoother). This separates a dot-product head times
     1/h^2 (exponent 2) from the exact head;

   reported as their own questions, not conditions: *what training changed* (shape against the
   scale-matched control: ``nw_gain`` and rho minus the control's; the change of scale as the
   ratio of key RMS norms), *beyond-nulls* (rho above its three nulls) and *rise* (rho's slope
   on ``-log h`` minus the control's);
3. over images and draws: :func:`nw_adapter.core.intervals.two_level_test` for the parts against
   the control, :func:`~nw_adapter.core.intervals.equivalence_test` for the exponent against 2,
   :func:`~nw_adapter.core.intervals.greater_than_zero` for the others, one-sided at ``alpha``
   0.05 against the part's margin (:data:`MARGINS`). A part with no spread at all is decided by
   its value.

Every part gives the smallest effect the run could detect (``mde``: 80% power at its references
and draws, the draws' offsets included). A part that is not significant reads "not met" when the
run could have detected the effect it is compared with (the exact head's, or the theory's, or for
the reported questions :data:`CLAIM_EFFECTS`), and "too few references to tell" when it could
not. A clause holds only when every part is significant (an intersection-union test, size at most
alpha); a part whose columns were not recorded is "not measured" with a one-line reason and never
counts as evidence. The conclusion line names each condition's status and which anchor the
adapter is nearer (its position on the path and on the form, 0 at the control, 1 at the exact
head). With one reference image nothing is tested ("undecided"). Values left out of the means
(NaN or missing, with the record's ``<stat>_reason`` where it has one) are counted per column and
reason (``skipped``).

Units by content, one sample at a time: the records are checked first (a malformed record, a value
out of its range such as rho = 5 or an infinite rho, is a
:class:`~nw_adapter.analysis.validation.RecordError` naming it); records of different models,
modes or settings, records with and without a settings digest, and a unit with records of several
runs are refused; units with the same content digest are one reference image.

Plain Python with numpy/scipy (no torch): the verdict is rebuilt from a saved ``rho.json``. Its
result is a plain dict, documented field by field in docs/verdict.md.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nw_adapter.analysis.records import analysis_half
from nw_adapter.analysis.validation import RecordError, _shown, check_record
from nw_adapter.core.intervals import (
    CONFIDENCE,
    EQUIVALENCE_TEST,
    POWER,
    TWO_LEVEL_TEST,
    equivalence_test,
    greater_than_zero,
    t_interval,
    two_level_test,
)
from nw_adapter.integration.schema import (
    EXACT_C_FIELD,
    KEY_SCALE,
    NULL_STATS,
    UNTRAINED_SUFFIX,
    control_column,
    control_draws,
    finite_mean,
    key_scale_column,
)
from nw_adapter.integration.settings import SETTINGS_FIELD, differing_settings

ALPHA = 0.05
"""Size of each one-sided test (and so of each clause, by the intersection-union argument)."""

EQUIVALENCE_LABEL = "equivalence (TOST)"
"""A part's ``test`` when it is two one-sided tests against a band: its decision reads the
``1 - 2 alpha`` interval (:data:`EQUIVALENCE_LEVEL`), not the 95% one the other parts print."""

EQUIVALENCE_LEVEL = f"{1 - 2 * ALPHA:.0%}"
"""The equivalence test's interval, as printed: "90%"."""

UNIT = "reference image"

METHOD = (
    "per reference image: statistics averaged over layers, heads and adapters per step (scales as "
    "logarithms; differences from each control draw over the records where both are finite), then one "
    "value per clause part and control draw; the exponent against the theory's 2: "
    f"{EQUIVALENCE_TEST}; parts against the scale-matched control: {TWO_LEVEL_TEST}; the other parts: "
    "one-sided one-sample t test of mean > margin over images (scipy.stats.ttest_1samp, "
    "alternative='greater'); alpha 0.05; without spread a part is decided by its value; a clause of "
    "several parts holds only when every part is significant (intersection-union test); every part's "
    f"smallest detectable effect at {POWER:.0%} power (mde) beside it"
)
"""How the verdict is computed, stored in ``rho.json``."""

THEORY_EXPONENT = 2.0
"""``-d log logit_scale / d log h`` of Theorem 3's exact NW head whose bandwidth is the schedule's h."""

EXPONENT_MARGIN = 0.5
"""Half-width of the band the exponent must be equivalent within: [1.5, 2.5] (issue 42's
acceptance band). A 1/h temperature (exponent 1) and a fixed one (0) lie outside it; the exact
head measured in the tiny pipelines reads 1.8-2.0."""

THEORY_R2_NW = 1.0
"""``r2_nw`` of the exact NW head in its own q/k space: its logits are one NW term."""

NW_FORM_MARGIN = 0.95
"""``r2_nw`` above this counts as the NW form: at most 5% of the row-centred logit variance is not
the NW term ``beta (q.k_i - ||k_i||^2 / 2)``. A dot-product head's deficit is its key prior's share
(THEORY.md 4: softmax(s q.k) = NW times exp(s ||k||^2 / 2)): the trained tiny adapters read 0.73
(SD 1.5) and 0.66 (Flux), the exact head 1.000."""

MARGINS: dict[str, float] = {
    "exponent_theory": EXPONENT_MARGIN,
    "exponent_minus_control": 1e-2,
    "r2_nw": NW_FORM_MARGIN,
    "nw_gain_minus_control": 1e-3,
    "rho_minus_control": 1e-3,
    "rise_minus_control": 1e-3,
}
"""The margin of each part: the smallest effect counted (a difference must exceed it), the level
``r2_nw`` must exceed, or the equivalence band's half-width of the exponent.

1e-3 nats of ``nw_gain`` and 1e-3 of rho (per image, mean over steps), 0.01 of the exponent
(1/200 of Theorem 3's 2) and 1e-3 of rho per unit of ``log h``: far above what float32 rounding of
an exactly matched control gives (a control whose keys equal the trained keys after the matching
differs by at most 7e-9 in tests/correlate/test_verdict_acceptance.py), far below the effects worth
a claim (:data:`CLAIM_EFFECTS`)."""

CLAIM_EFFECTS: dict[str, float] = {
    "nw_gain_minus_control": 0.03,
    "rho_minus_control": 0.03,
    "rise_minus_control": 0.03,
    **{f"rho_minus_{null}": 0.03 for null in NULL_STATS},
}
"""For the reported questions (no anchor of their own): the effect a run must be able to detect for
its "not met" to read as not met, not "too few references to tell": 0.03 of rho and nats of
nw_gain (per unit of log h for the rise), the smallest of the scale effects issue 26 measured
(0.03 - 0.17 of rho and nw_gain)."""


@dataclass(frozen=True)
class Part:
    """One tested quantity of a clause: a per-image value (per control draw) and its test.

    Attributes:
        key: name of the per-image value.
        label: how the verdict prints it.
        needs: record columns it is computed from (all must have been recorded).
        control_of: statistics it needs the scale-matched control's draws of (``{stat}_control_{k}``).
        margin: :data:`MARGINS` (0 for the beyond-nulls parts).
        test: ``"greater"`` (mean > margin; over images x draws when ``control_of``) or
            ``"equivalence"`` (``|mean - target| < margin``, TOST over images).
        target: the prediction of an equivalence part.
    """

    key: str
    label: str
    needs: tuple[str, ...]
    control_of: tuple[str, ...] = ()
    margin: float = 0.0
    test: str = "greater"
    target: float | None = None


@dataclass(frozen=True)
class Clause:
    """A claim of the verdict: it holds when every one of its parts is significant.

    Attributes:
        key: name in ``rho.json``.
        label: the claim, as the detail lines print it.
        short: its name in the one-line conclusion.
        parts: what is tested.
        condition: a condition of the conclusion (False: a question reported on its own).
    """

    key: str
    label: str
    short: str
    parts: tuple[Part, ...]
    condition: bool = False


NULL_LABELS: dict[str, str] = {
    "rho_perm_null": "perm",
    "rho_norm_matched_null": "norm-matched",
    "rho_spread_null": "qk-spread",
}
"""Short names of the nulls."""

CLAUSES: tuple[Clause, ...] = (
    Clause(
        "bandwidth",
        "bandwidth clause (logit scale ~ 1/h^2: exponent 2, and above the control's)",
        "bandwidth clause",
        (
            Part(
                "exponent_theory",
                "exponent vs the theory's 2 (equivalence, band 2 +- 0.5)",
                ("logit_scale", "h_schedule"),
                margin=MARGINS["exponent_theory"],
                test="equivalence",
                target=THEORY_EXPONENT,
            ),
            Part(
                "exponent_minus_control",
                "exponent - control's exponent",
                ("logit_scale", "h_schedule"),
                ("logit_scale",),
                MARGINS["exponent_minus_control"],
            ),
        ),
        condition=True,
    ),
    Clause(
        "nw_form",
        "NW-form clause (r2_nw > 0.95: the NW key-norm term, which a dot product lacks)",
        "NW-form clause",
        (
            Part(
                "r2_nw", "r2_nw (NW term's share of the logit variance)", ("r2_nw",), margin=MARGINS["r2_nw"]
            ),
        ),
        condition=True,
    ),
    Clause(
        "training",
        "adapter-vs-control clause (what training changed in shape, scale matched)",
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
        "beyond_nulls",
        "beyond-nulls clause (rho above each of its nulls)",
        "beyond-nulls clause",
        tuple(
            Part(f"rho_minus_{null}", f"rho - {NULL_LABELS[null]} null", ("rho", null)) for null in NULL_STATS
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
"""The clauses, in printing order: the conclusion's conditions first."""

EVIDENCE_CLAUSES: tuple[str, ...] = tuple(c.key for c in CLAUSES if c.condition)
"""The clauses "evidence of kernel smoothing on the schedule" needs: ``bandwidth`` and ``nw_form``."""

STATUS_WORDS: dict[bool | None, str] = {True: "met", False: "not met", None: "not measured"}
"""How a clause's ``holds`` (True / False / None) is printed (``too few references to tell`` and
``needs several reference images`` are the ``status`` of a clause that holds False / None for
those reasons)."""

TOO_FEW = "too few references to tell"
"""The status of a part that is not significant and whose smallest detectable effect exceeds the
effect it is compared with."""

CONCLUSION_YES = "evidence of kernel smoothing on the schedule"
CONCLUSION_NO = "no evidence of kernel smoothing on the schedule"

LEGEND: tuple[str, ...] = (
    "met: every part is significant (one-sided test, p < alpha; without spread, by its value); not met: "
    "some part is not although the run could have detected the effect it is compared with; too few "
    "references to tell: some part is not and its smallest detectable effect (mde, 80% power) exceeds "
    "that effect; not measured: a part's columns were not recorded, or there is one reference image",
    "conclusion: the bandwidth and NW-form clauses; the adapter-vs-control, beyond-nulls and rise clauses "
    "are reported questions. Anchors: the control (0) and the exact NW head (1, measured with --calibrate, "
    "else the theory); position = (adapter - control) / (exact head - control) on the path (exponent) "
    "and on the form (r2_nw)",
    "scale-matched control: the same queries against the untrained adapter's keys, rescaled per layer and "
    "head to the trained keys' RMS norm (same algebra, same scale, no learning), K draws (seeds); its "
    "path with that scale matched once per run (the per-step factor divided out); adapter-vs-control not "
    "met means the trained adapter is not more NW-like than it in shape, not that training failed",
    "nulls of rho: perm = NW scores shuffled across keys; norm-matched = queries of the same norms in "
    "random directions; qk-spread = each row's q.k kept, its pairing with the key norms shuffled",
    "exponent = -slope of log logit_scale on log h (2 for an NW head whose bandwidth is h, 0 at a fixed "
    "temperature); logit_scale: RMS of the row-centred logits (inverse temperature); r2_nw = share of the "
    "row-centred logit variance one NW term beta (q.k - ||k||^2 / 2) explains (1 for the exact head); "
    "nw_gain = KL(attention || query-blind key prior) - KL(attention || fitted NW); scale ratio = key RMS "
    "trained / untrained (a change of scale, reported, not tested)",
    "h: the schedule's sigma / alpha; n: reference images (one content counts once) x control draws; "
    "two-level test: the draws' spread enters the interval and the margin, so an offset shared by a draw "
    "is not evidence",
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
Records without them (files of older versions) pool as before, but never with records that have
a settings digest."""

CONTENT_FIELD = "input_digest"
"""Record field identifying the reference by content (hash of the call's IP-Adapter image
embeddings, :mod:`nw_adapter.integration.steps`): units of the same content are one unit."""

EXACT_SUFFIX = "_exact"
"""Suffix of the exact NW head's columns merged into the adapter's records by a calibrated run:
``{stat}_exact``, its own control ``{stat}_exact_control_{k}`` and ``key_scale_exact_{k}``."""

_RECORDS_FIX = "pass the records of NWRecorder.to_records() or of a rho.json's 'records'"

MEAN_COLUMNS: tuple[str, ...] = (
    "rho",
    *NULL_STATS,
    "nw_gain",
    "r2_nw",
    "kl",
    "nw_gain_untrained",
    "rho_untrained",
)
"""Columns averaged per (image, step) as they are (the ``*_untrained`` of older files for the figures)."""

LOG_COLUMNS: tuple[str, ...] = ("h_eff", "h_eff_untrained", "logit_scale")
"""Columns averaged per (image, step) as logarithms (``log_<name>``; non-positive values left out)."""

CONTROL_MEAN_OF: tuple[str, ...] = ("rho", "nw_gain", "r2_nw", "kl")
"""Statistics whose control draws are averaged as they are (``{stat}_control_<k>``), the first two
paired with the trained value (``d_<stat>_<k>``: mean over the records where both are finite of
trained - draw k)."""

CONTROL_LOG_OF: tuple[str, ...] = ("logit_scale", "h_eff")
"""Statistics whose control draws are averaged as logarithms (``log_<stat>_control_<k>``)."""

PAIRED_OF: tuple[str, ...] = ("rho", "nw_gain")
"""Statistics paired with each control draw per record (``d_<stat>_<k>``)."""

NO_REASON = "NaN or missing (no reason recorded)"
"""The reason of a skipped value whose record names none (no ``<stat>_reason`` field)."""


@dataclass(frozen=True)
class Arm:
    """Which head's columns a computation reads: the adapter's (``suffix=""``) or the exact NW
    head's of a calibrated run (``suffix="_exact"``)."""

    suffix: str = ""

    def column(self, stat: str) -> str:
        """The head's own column of ``stat``."""
        return stat + self.suffix

    def control(self, stat: str, draw: int) -> str:
        """The column of ``stat`` under control draw ``draw`` on this head's queries."""
        return control_column(stat, draw) if not self.suffix else f"{stat}{self.suffix}_control_{draw}"

    def key_scale(self, draw: int) -> str:
        """The change-of-scale column of draw ``draw``."""
        return key_scale_column(draw) if not self.suffix else f"{KEY_SCALE}{self.suffix}_{draw}"

    def draws(self, columns: Iterable[str]) -> int:
        """The control draws K whose columns this head's records carry."""
        if not self.suffix:
            return control_draws(columns)
        pattern = re.compile(rf"^[a-z0-9_]+?{self.suffix}_control_(\d+)$")
        found = [int(m[1]) for m in map(pattern.match, columns) if m]
        return max(found) + 1 if found else 0


ADAPTER, EXACT = Arm(""), Arm(EXACT_SUFFIX)


def _number(value: Any) -> float:
    """``value`` as a float; None and non-numbers as NaN."""
    try:
        return math.nan if value is None else float(value)
    except (TypeError, ValueError):
        return math.nan


def _log(value: Any) -> float:
    x = _number(value)
    return math.log(x) if math.isfinite(x) and x > 0 else math.nan


def _clean(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


Reader = Callable[[dict], float]


def _step_readers(draws: int, arm: Arm = ADAPTER) -> dict[str, Reader]:
    """Name of each per-step mean -> how to read it from one record (NaN: left out of the mean).

    The names are the head's own (``rho``, ``log_logit_scale``, ``rho_control_<k>`` ...) whichever
    arm is read, so the per-image values are computed by one code for both. The control's path
    ``log_control_path_<k>`` is ``log logit_scale_control_k - log key_scale_k``: its logit scale
    with the per-step scale matching divided out (scale matched once per run), and
    ``d_log_logit_scale_<k>`` the trained log logit scale minus it, per record."""

    def value(name: str) -> Reader:
        return lambda r: _number(r.get(name))

    def log(name: str) -> Reader:
        return lambda r: _log(r.get(name))

    def paired(reader: Reader, other: Reader) -> Reader:
        return lambda r: reader(r) - other(r)

    def control_path(k: int) -> Reader:
        scale, matched = arm.key_scale(k), arm.control("logit_scale", k)

        def read(r: dict) -> float:
            ratio = _log(r.get(scale)) if scale in r else 0.0  # no ratio recorded: the control as it is
            return _log(r.get(matched)) - ratio

        return read

    own = arm.column
    names = (
        MEAN_COLUMNS if not arm.suffix else tuple(c for c in MEAN_COLUMNS if not c.endswith(UNTRAINED_SUFFIX))
    )
    readers: dict[str, Reader] = {name: value(own(name)) for name in names}
    logs = (
        LOG_COLUMNS if not arm.suffix else tuple(c for c in LOG_COLUMNS if not c.endswith(UNTRAINED_SUFFIX))
    )
    readers.update({f"log_{name}": log(own(name)) for name in logs})
    for k in range(draws):
        for stat in CONTROL_MEAN_OF:
            readers[control_column(stat, k)] = value(arm.control(stat, k))
        for stat in PAIRED_OF:
            readers[f"d_{stat}_{k}"] = paired(value(own(stat)), value(arm.control(stat, k)))
        for stat in CONTROL_LOG_OF:
            readers[f"log_{control_column(stat, k)}"] = log(arm.control(stat, k))
        readers[f"log_control_path_{k}"] = control_path(k)
        readers[f"d_log_logit_scale_{k}"] = paired(log(own("logit_scale")), control_path(k))
        readers[f"log_{key_scale_column(k)}"] = log(arm.key_scale(k))
    return readers


def image_step_means(
    records: Iterable[dict], half: str, draws: int | None = None, arm: Arm = ADAPTER
) -> dict[Any, list[dict]]:
    """Per reference image and step, the statistics the verdict uses, averaged over layers/heads/adapters.

    Args:
        records: record dicts with ``reference`` (the CLI adds it); a record without one belongs to
            the image of its pipeline ``call`` (one call per reference image, one seed each, as a
            notebook loop over references records them).
        half: the CFG half kept.
        draws: control draws to average (default: those the records carry for ``arm``).
        arm: whose columns: the adapter's (default) or the exact head's of a calibrated run
            (:data:`EXACT`), named as the adapter's in the rows.

    Returns:
        ``{reference: [row, ...]}`` in step order; each row has ``step``, ``timestep``,
        ``h_schedule``, the finite mean of every :data:`MEAN_COLUMNS`, ``log_<name>`` of every
        :data:`LOG_COLUMNS` (mean of the logarithms of the positive finite values), and per draw
        ``k`` the control's columns, its path ``log_control_path_k`` and the paired differences
        ``d_rho_k``, ``d_nw_gain_k``, ``d_log_logit_scale_k`` (:func:`_step_readers`); None where
        no value is finite.
    """
    records = list(records)
    if draws is None:
        draws = arm.draws({key for r in records for key in r})
    readers = _step_readers(draws, arm)
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
    mean (None unless every draw has one). The exponent against the theory (``exponent_theory``)
    is the image's exponent itself. Also kept (reported, not tested): ``exponent`` (the trained
    ``-d log logit_scale / d log h``), ``exponent_control_draws`` (the control's, its scale matched
    once per run), ``r2_nw_control_draws``, ``rho_slope`` (slope of rho on ``-log h``),
    ``log_scale_ratio_draws`` (mean over steps of ``log key_scale_k``), the step means of the
    readings of the table (:data:`READINGS`), ``steps`` and ``h_steps`` (the distinct finite
    positive schedule h among them: a slope on log h needs two).
    """
    levels = {round(math.log(h), 12) for r in rows if (h := r.get("h_schedule")) is not None and h > 0}
    values: dict[str, Any] = {
        "reference": reference,
        "steps": len(rows),
        "h_steps": len(levels),
        "draws": draws,
    }
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
    values["exponent_theory"] = values["exponent"]
    values["exponent_control_draws"] = _draw_values(
        rows, draws, lambda r, k: slope_on_log_h(r, f"log_control_path_{k}", -1.0)
    )
    values["r2_nw"] = _step_mean(rows, "r2_nw")
    values["r2_nw_control_draws"] = _draw_values(
        rows, draws, lambda r, k: _step_mean(r, f"r2_nw_control_{k}")
    )
    values["rho_slope"] = slope_on_log_h(rows, "rho", -1.0)
    values["log_scale_ratio_draws"] = _draw_values(
        rows, draws, lambda r, k: _step_mean(r, f"log_{key_scale_column(k)}")
    )
    for key, (own, control) in _READING_COLUMNS.items():
        values[f"reading_{key}"] = _step_mean(rows, own) if own else None
        values[f"reading_{key}_control_draws"] = (
            _draw_values(rows, draws, lambda r, k, c=control: _step_mean(r, c.format(k=k))) if control else []
        )
    return values


READINGS: tuple[tuple[str, str], ...] = (
    ("exponent", "exponent -dlog(logit_scale)/dlog(h) (theory 2)"),
    ("r2_nw", "r2_nw: NW term's share of the logit variance (theory 1)"),
    ("nw_gain", "nw_gain: KL(A || key prior) - KL(A || fitted NW)"),
    ("rho", "rho: Spearman of attention vs NW weights"),
    ("rho_minus_spread_null", "rho - qk-spread null"),
    ("kl", "KL(A || NW weights at the run's bandwidth)"),
    ("logit_scale", "logit_scale: the inverse temperature (geometric means)"),
    ("h_eff", "h_eff: the fitted bandwidth (geometric means)"),
)
"""The rows of the calibrated table (:func:`readings_table`): one reading each, for the adapter, the
exact head and the control side by side."""

_READING_COLUMNS: dict[str, tuple[str | None, str | None]] = {
    "r2_nw": ("r2_nw", "r2_nw_control_{k}"),
    "nw_gain": ("nw_gain", "nw_gain_control_{k}"),
    "rho": ("rho", "rho_control_{k}"),
    "kl": ("kl", "kl_control_{k}"),
    "logit_scale": ("log_logit_scale", "log_control_path_{k}"),
    "h_eff": ("log_h_eff", "log_h_eff_control_{k}"),
}
"""Per table reading stepped over as a mean: the head's step-mean column and the control's (the
scales as logarithms: their rows are geometric means, :data:`LOG_READINGS`)."""

LOG_READINGS = frozenset({"logit_scale", "h_eff"})
"""The readings averaged as logarithms (the table shows the exponential of the mean)."""


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


def _unmeasured(
    part: Part, recorded: set[str], draws: int, arm: Arm = ADAPTER
) -> tuple[list[str], str | None]:
    """``(missing columns, reason)`` of a part that cannot be measured; ``([], None)`` when it can."""
    missing = [arm.column(c) if c != "h_schedule" else c for c in part.needs]
    missing = [c for c in missing if c not in recorded]
    if part.control_of and draws == 0:
        if not arm.suffix and any(column.endswith(UNTRAINED_SUFFIX) for column in recorded):
            return missing, LEGACY_REASON
        missing += [arm.control(stat, 0).removesuffix("0") + "<k>" for stat in part.control_of]
    else:
        missing += [c for c in (arm.control(s, 0) for s in part.control_of) if c not in recorded]
    return missing, (_missing_reason(missing) if missing else None)


_EMPTY_TEST: dict[str, Any] = {
    "n": 0, "draws": 0, "mean": None, "low": None, "high": None, "se": None, "p": None,
    "significant": None, "caveat": None, "mde": None,
}  # fmt: skip


SINGLE_H_REASON = "not identified: no slope on log h, every reference's steps share one schedule h"
"""Why a part that is a slope on log h (the exponent, the rise) is not measured on such a run."""

NO_VALUE_REASON = "not identified for any reference: too few finite values (see skipped)"
"""Why a part whose columns hold finite values has no value for any reference (e.g. a slope whose
values are finite at one step only)."""


def _identified(part: Part, images: Sequence[dict]) -> bool:
    """Whether some reference has a finite value of ``part`` (of some draw, for a part against the
    control)."""

    def finite(value: Any) -> bool:
        return value is not None and math.isfinite(value)

    if part.control_of:
        return any(finite(v) for image in images for v in image[f"{part.key}_draws"])
    return any(finite(image[part.key]) for image in images)


def _unidentified_reason(part: Part, images: Sequence[dict]) -> str:
    """Why no reference has a value of ``part``: a slope on log h without two noise levels, else NaN."""
    if "h_schedule" in part.needs and all(image.get("h_steps", 2) < 2 for image in images):
        return SINGLE_H_REASON
    return NO_VALUE_REASON


def _test_part(
    part: Part, images: Sequence[dict], recorded: set[str], draws: int, arm: Arm = ADAPTER
) -> dict[str, Any]:
    """One part's test over images (and draws), without its status (see :func:`_with_status`).

    Not measured (``measured`` False, a one-line ``reason``): its columns were not recorded, no
    reference has a value (:data:`SINGLE_H_REASON`, :data:`NO_VALUE_REASON`), or fewer than two do."""
    missing, reason = _unmeasured(part, recorded, draws, arm)
    entry: dict[str, Any] = {"key": part.key, "label": part.label, "margin": part.margin}
    if part.target is not None:
        entry["target"] = part.target
    if reason is not None:
        return {**entry, **_EMPTY_TEST, "test": None, "measured": False, "reason": reason, "missing": missing}
    if not _identified(part, images):
        reason = _unidentified_reason(part, images)
        return {**entry, **_EMPTY_TEST, "test": None, "measured": False, "reason": reason, "missing": []}
    if part.control_of:
        matrix = [[math.nan if v is None else v for v in image[f"{part.key}_draws"]] for image in images]
        result = two_level_test(matrix, margin=part.margin, alpha=ALPHA, confidence=CONFIDENCE).to_dict()
        entry["test"] = "two-level" if draws > 1 else "one-sample t (one draw)"
    elif part.test == "equivalence":
        assert part.target is not None
        tested = equivalence_test(
            [v[part.key] for v in images], target=part.target, margin=part.margin, alpha=ALPHA
        ).to_dict()
        result = {**{k: tested[k] for k in ("n", "mean", "low", "high", "se", "p", "significant", "mde")},
                  "draws": 0, "caveat": None}  # fmt: skip
        entry["test"] = EQUIVALENCE_LABEL
    else:
        shifted = [None if v[part.key] is None else v[part.key] - part.margin for v in images]
        tested = greater_than_zero(shifted, alpha=ALPHA, confidence=CONFIDENCE).to_dict()
        back = {
            k: None if tested[k] is None else tested[k] + part.margin for k in ("mean", "low", "high", "mde")
        }
        result = {**tested, **back, "draws": 0, "caveat": None}
        entry["test"] = "one-sample t"
    if result["n"] < 2:
        reason = "needs several reference images" if len(images) < 2 else "fewer than 2 images have a value"
        return {**entry, **result, "measured": False, "reason": reason, "significant": None}
    return {**entry, **result, "measured": True, "reason": None}


def _with_status(entry: dict[str, Any], reference: float | None) -> dict[str, Any]:
    """``entry`` with ``status`` and ``compared_with`` (the effect a "not met" is judged against).

    Not significant: "too few references to tell" when the smallest detectable effect exceeds
    ``reference`` and the 95% interval still reaches it (for an equivalence part: when the narrowest
    margin the run could establish exceeds its margin and the interval still reaches the band), else
    "not met": the run could have detected the effect, or its interval excludes it."""
    out = {**entry, "compared_with": _clean(reference)}
    if not entry["measured"]:
        out["status"] = (
            entry["reason"] if entry["reason"] == "needs several reference images" else "not measured"
        )
        return out
    if entry["significant"]:
        out["status"] = "met"
        return out
    mde, low, high = entry.get("mde"), entry.get("low"), entry.get("high")
    if entry["test"] == EQUIVALENCE_LABEL:  # the interval still reaches the band, too wide to fit in it
        target, margin = entry["target"], entry["margin"]
        reaches = low is None or high is None or (low <= target + margin and high >= target - margin)
        too_few = reaches and (mde is None or mde > margin)
    else:  # the interval still reaches the anchor's effect, which the run could not have detected
        reaches = high is None or reference is None or high >= reference
        too_few = reference is not None and reaches and (mde is None or mde > reference)
    out["status"] = TOO_FEW if too_few else "not met"
    return out


def _interval(
    values: Sequence[float | None], transform: Callable[[float], float] | None = None
) -> dict[str, Any]:
    """Mean and 95% Student t interval over images (None where not computable), optionally transformed."""
    kept = [v for v in values if v is not None and math.isfinite(v)]
    if not kept:
        return {"n": 0, "mean": None, "low": None, "high": None}
    mean, low, high = t_interval(kept)
    if transform is not None:
        mean, low, high = (transform(x) if math.isfinite(x) else x for x in (mean, low, high))
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


def _reported(clause: Clause, images: Sequence[dict], recorded: set[str], draws: int, arm: Arm) -> list[dict]:
    """The quantities reported beside a clause, not tested (each with its interval)."""
    if clause.key == "training" and draws and arm.key_scale(0) in recorded:
        ratio = _two_level_interval([v["log_scale_ratio_draws"] for v in images], math.exp)
        return [{"key": "scale_ratio", "label": "scale ratio (key RMS trained / untrained)",
                 **ratio}]  # fmt: skip
    if clause.key == "bandwidth" and arm.column("logit_scale") in recorded and "h_schedule" in recorded:
        out = [{"key": "exponent", "label": "exponent -dlog(logit_scale)/dlog(h)", "theory": THEORY_EXPONENT,
                **_interval([v["exponent"] for v in images])}]  # fmt: skip
        if draws and arm.control("logit_scale", 0) in recorded:
            control = _two_level_interval([v["exponent_control_draws"] for v in images])
            out.append({"key": "exponent_control", "label": "the control's exponent (scale matched once)",
                        **control})  # fmt: skip
        return out
    if clause.key == "nw_form" and draws and arm.control("r2_nw", 0) in recorded:
        control = _two_level_interval([v["r2_nw_control_draws"] for v in images])
        return [{"key": "r2_nw_control", "label": "the control's r2_nw", **control}]
    if clause.key == "rise" and arm.column("rho") in recorded and "h_schedule" in recorded:
        slope = _interval([v["rho_slope"] for v in images])
        return [{"key": "rho_slope", "label": "slope of rho on -log h", **slope}]
    return []


def _clause_result(
    clause: Clause,
    images: Sequence[dict],
    recorded: set[str],
    draws: int,
    references: Mapping[str, float | None],
    arm: Arm = ADAPTER,
) -> dict[str, Any]:
    parts = [
        _with_status(_test_part(part, images, recorded, draws, arm), references.get(part.key))
        for part in clause.parts
    ]
    failed = [p for p in parts if p["measured"] and not p["significant"]]
    unmeasured = [p for p in parts if not p["measured"]]
    if failed:
        holds, reason = False, None
        status = "not met" if any(p["status"] == "not met" for p in failed) else TOO_FEW
    elif unmeasured:
        missing = list(dict.fromkeys(c for p in unmeasured for c in p.get("missing", ())))
        reasons = [_missing_reason(missing)] if missing else []
        reasons += [p["reason"] for p in unmeasured if not p.get("missing") or p["reason"] == LEGACY_REASON]
        holds, reason = None, "; ".join(dict.fromkeys(reasons))
        status = (
            "needs several reference images" if reason == "needs several reference images" else "not measured"
        )
    else:
        holds, reason, status = True, None, "met"
    return {
        "label": clause.label,
        "short": clause.short,
        "condition": clause.condition,
        "holds": holds,
        "status": status,
        "reason": reason,
        "parts": parts,
        "reported": _reported(clause, images, recorded, draws, arm),
    }


def _mean_over(images: Sequence[dict], key: str) -> float | None:
    """The mean over images of a per-image value (None: no image has one)."""
    kept = [v[key] for v in images if v.get(key) is not None]
    return float(np.mean(kept)) if kept else None


def _draws_mean(images: Sequence[dict], key: str) -> float | None:
    """The mean over images of each image's mean over its draws of ``<key>`` (a list per image)."""
    per_image = [_mean_of(v[key]) for v in images if v.get(key)]
    kept = [x for x in per_image if x is not None]
    return float(np.mean(kept)) if kept else None


def _anchors(adapter: Sequence[dict], exact: Sequence[dict] | None) -> dict[str, Any]:
    """The two anchors' exponent and r2_nw: the control (the adapter's draws) and the exact head
    (measured by a calibrated run, else the theory's 2 and 1)."""
    control = {"exponent": _draws_mean(adapter, "exponent_control_draws"),
               "r2_nw": _draws_mean(adapter, "r2_nw_control_draws")}  # fmt: skip
    if exact:
        measured = {"source": "measured", "exponent": _mean_over(exact, "exponent"),
                    "r2_nw": _mean_over(exact, "r2_nw"), "images": len(exact)}  # fmt: skip
    else:
        measured = {"source": "theory", "exponent": THEORY_EXPONENT, "r2_nw": THEORY_R2_NW, "images": 0}
    return {"control": control, "exact": measured}


ANCHOR_RESOLUTION = 0.01
"""Anchors closer than this on an axis do not define a position on it (None): 0.01 is the smallest
exponent difference counted (:data:`MARGINS`) and 1% of r2_nw's range. SD 3.5's RMS-normalised keys
give its control r2_nw 1.000000002, the exact head's 1: the tiny SD 3.5 adapter's r2_nw 0.71 read
"form +174203791" of the way to the exact head, and "nearer the exact head" (main at 7b2f1f0)."""


def _position(value: float | None, low: float | None, high: float | None) -> float | None:
    """Where ``value`` lies from ``low`` (0) to ``high`` (1); None when undefined or the anchors are
    closer than :data:`ANCHOR_RESOLUTION`."""
    if value is None or low is None or high is None or abs(high - low) < ANCHOR_RESOLUTION:
        return None
    return (value - low) / (high - low)


def _placement(adapter: Sequence[dict], anchors: Mapping[str, Any]) -> dict[str, Any]:
    """The adapter's position between the control (0) and the exact head (1) on the path (exponent)
    and on the form (r2_nw), and the anchor it is nearer (by the mean of the defined positions)."""
    control, exact = anchors["control"], anchors["exact"]
    path = _position(_mean_over(adapter, "exponent"), control["exponent"], exact["exponent"])
    form = _position(_mean_over(adapter, "r2_nw"), control["r2_nw"], exact["r2_nw"])
    defined = [p for p in (path, form) if p is not None]
    nearer = None if not defined else ("exact head" if float(np.mean(defined)) >= 0.5 else "control")
    return {"path": path, "form": form, "nearer": nearer}


def readings_table(adapter: Sequence[dict], exact: Sequence[dict] | None, draws: int) -> list[dict[str, Any]]:
    """One row per reading of :data:`READINGS`: the adapter, the exact head (calibrated runs; None
    otherwise) and the control, each the mean over reference images with its 95% Student t
    interval (the control: of each image's mean over its draws; the logarithmic readings back
    transformed to geometric means)."""

    def arm_values(images: Sequence[dict], key: str, control: bool) -> dict[str, Any] | None:
        transform = math.exp if key in LOG_READINGS else None
        if key == "exponent":
            values = [_mean_of(v["exponent_control_draws"]) if control else v["exponent"] for v in images]
        elif key == "rho_minus_spread_null":
            if control:
                return None
            values = [v["rho_minus_rho_spread_null"] for v in images]
        elif control:
            values = [_mean_of(v[f"reading_{key}_control_draws"]) if draws else None for v in images]
        else:
            values = [v[f"reading_{key}"] for v in images]
        out = _interval(values, transform)
        return out if out["n"] else None

    rows = []
    for key, label in READINGS:
        rows.append({
            "key": key,
            "label": label,
            "adapter": arm_values(adapter, key, False),
            "exact": arm_values(exact, key, False) if exact else None,
            "control": arm_values(adapter, key, True) if draws else None,
        })  # fmt: skip
    return rows


def _conclusion(
    clauses: dict[str, dict], images: int, placement: Mapping[str, Any], source: str
) -> tuple[bool | None, str]:
    if images < 2:
        return None, "undecided: 1 reference image; pass several (--image-dir)"
    needed = [clauses[key] for key in EVIDENCE_CLAUSES]
    where = _nearer_text(placement, source)
    if all(c["holds"] is True for c in needed):
        shorts = " and ".join(c["short"] for c in needed)
        return True, f"{CONCLUSION_YES} ({images} reference images): {shorts} met{where}"
    why = ", ".join(f"{c['short']} {c['status']}" for c in needed)
    return False, f"{CONCLUSION_NO} ({images} reference images): {why}{where}"


def _nearer_text(placement: Mapping[str, Any], source: str) -> str:
    """``"; nearer the control (path +0.02, form +0.10 of the way to the exact head, measured)"``."""
    if placement.get("nearer") is None:
        return ""
    shown = [f"{name} {placement[name]:+.2f}" for name in ("path", "form") if placement.get(name) is not None]
    anchor = "the exact head" if placement["nearer"] == "exact head" else "the control"
    return f"; nearer {anchor} ({', '.join(shown)} of the way from the control to the exact head, {source})"


def _read_columns(draws: int, arms: Sequence[Arm] = (ADAPTER,)) -> tuple[str, ...]:
    """The record columns the per-step means read (whose left-out values are counted)."""
    out: list[str] = []
    for arm in arms:
        own = [
            arm.column(c)
            for c in (*MEAN_COLUMNS, *LOG_COLUMNS)
            if not (arm.suffix and c.endswith(UNTRAINED_SUFFIX))
        ]
        controls = [arm.control(s, k) for k in range(draws) for s in (*CONTROL_MEAN_OF, *CONTROL_LOG_OF)]
        out += [*own, *controls, *(arm.key_scale(k) for k in range(draws))]
    return tuple(dict.fromkeys(out))


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
        positive = base_stat(column) in (*LOG_COLUMNS, KEY_SCALE, *CONTROL_LOG_OF)
        for record in kept:
            x = _number(record.get(column))
            if math.isfinite(x) and (x > 0 or not positive):
                continue
            why = record.get(f"{column}_reason")
            if not (isinstance(why, str) and why) and EXACT_SUFFIX in column:  # the exact pass had no twin
                why = record.get("exact_reason")
            why = why if isinstance(why, str) and why else NO_REASON
            reasons[why] = reasons.get(why, 0) + 1
        if reasons:
            out[column] = {"count": sum(reasons.values()), "reasons": reasons}
    return out


_COLUMN_PARTS = re.compile(r"^(?P<stat>[a-z0-9_]+?)(?P<exact>_exact)?(?:_control_(?P<draw>\d+))?$")
_KEY_SCALE_COLUMN = re.compile(rf"^{KEY_SCALE}(?:{EXACT_SUFFIX})?_\d+$")


def base_stat(column: str) -> str:
    """The statistic a column holds, whichever head and control draw: ``rho`` of ``rho``,
    ``rho_control_2``, ``rho_exact`` and ``rho_exact_control_0``; ``key_scale`` of ``key_scale_1``
    and ``key_scale_exact_1``; the column itself otherwise."""
    if _KEY_SCALE_COLUMN.match(column):
        return KEY_SCALE
    match = _COLUMN_PARTS.match(column)
    return match["stat"] if match else column


VALUE_RANGES: dict[str, tuple[float, float, bool, str]] = {
    **{name: (-1.0, 1.0, True, "a Spearman correlation") for name in ("rho", *NULL_STATS)},
    "r2_nw": (0.0, 1.0, True, "a share of variance"),
    "nw_gain": (-math.inf, math.inf, True, "a difference of divergences"),
    "logit_scale": (0.0, math.inf, True, "an RMS of logits"),
    "h_eff": (0.0, math.inf, False, "a bandwidth"),
    KEY_SCALE: (0.0, math.inf, False, "a ratio of key norms"),
    "pearson": (-1.0, 1.0, True, "a Pearson correlation"),
    "top1": (0.0, 1.0, True, "a share of query rows"),
    "r2_key": (0.0, 1.0, True, "a share of variance"),
    "js": (0.0, math.log(2.0), True, "a Jensen-Shannon divergence, at most log 2"),
    **{name: (0.0, math.inf, True, "a KL divergence") for name in ("kl", "kl_nw_fit", "kl_key_prior")},
    **{name: (1.0, math.inf, True, "an effective number of keys") for name in ("neff_attn", "neff_nw")},
    **{name: (0.0, math.inf, True, "a norm or a spread") for name in ("q_norm", "key_rms", "key_norm_cv")},
    "qk_spread_ratio": (0.0, math.inf, True, "a ratio of spreads"),
    "h_eff_se": (0.0, math.inf, True, "a standard error"),
    "fit_rows": (0.0, math.inf, True, "a count of query rows"),
    "h_schedule": (0.0, math.inf, True, "the schedule's sigma_t / alpha_t, inf at pure noise"),
}
"""The statistics the verdict reads, with their range ``(low, high, low included, what it is)``:
a value outside it (rho = 5), or an infinite one, is refused (NaN and None are "not measured")."""

_INFINITE_ALLOWED = frozenset({"h_schedule", "kl", "kl_nw_fit", "kl_key_prior"})
"""Fields whose range includes +inf itself: h at flow matching's first step (pure noise), and a
KL divergence where one distribution has mass the other has not (it counts as not finite in the
means, as before)."""

_RANGE_TOLERANCE = 1e-4
"""Float rounding allowed beyond a bound: a float32 rho or r2_nw of 1 + 1e-5 (sums over thousands of
query rows) is rounding, a rho of 5 is not."""


def check_value_ranges(records: Sequence[Mapping[str, Any]]) -> None:
    """Refuse a value the verdict reads that lies outside its range (:data:`VALUE_RANGES`).

    A rho of 5 read as a real rho (main at f073761 printed ``rho - perm null: +1.937 [-4.457,
    +8.332]``) and an infinite rho silently dropped a unit; both are errors of the input, not
    data.

    Raises:
        RecordError: one line naming the record, the field, its value, its range and the fix.
    """
    for index, record in enumerate(records):
        for name, value in record.items():
            stat = base_stat(name)
            if stat not in VALUE_RANGES or value is None or isinstance(value, bool):
                continue
            x = _number(value)
            if math.isnan(x):
                continue
            low, high, closed, what = VALUE_RANGES[stat]
            infinite = x == math.inf and stat in _INFINITE_ALLOWED
            inside = infinite or (math.isfinite(x) and low - _RANGE_TOLERANCE <= x <= high + _RANGE_TOLERANCE)
            inside = inside and (closed or x > low)
            if not inside:
                bracket = (
                    f"{'[' if closed else '('}{low:g}, {high:g}]"
                    if math.isfinite(high) or stat in _INFINITE_ALLOWED
                    else (f"{'[' if closed else '('}{low:g}, inf)" if math.isfinite(low) else "finite")
                )
                shown = ("-inf" if x < 0 else "inf") if math.isinf(x) else f"{x:g}"
                raise RecordError(
                    f"verdict: records[{index}]: field '{name}' is {shown}, outside {bracket} ({what}); "
                    f"{_RECORDS_FIX}"
                )


def check_verdict_records(records: Any) -> list[dict]:
    """The records as a list, each checked field by field (the kinds of a rho.json record).

    Every field is checked, not only those the verdict groups by: a statistic that is not a number
    (``"rho": "0.5"``) would otherwise read as missing and its clause as "not measured".

    Raises:
        RecordError: (a ``ValueError``) not a list of record objects, or a record whose
            ``step``, ``half``, ``reference``, ``call``, ``key_set``, run field or statistic has the
            wrong kind, or a value out of its range (:func:`check_value_ranges`); one line naming
            the record, the field and the fix.
    """
    if isinstance(records, str | bytes | Mapping) or not isinstance(records, Iterable):
        raise RecordError(f"records: is {_shown(records)}, not a list of record objects; {_RECORDS_FIX}")
    records = list(records)
    for index, record in enumerate(records):
        where = f"records[{index}]"
        if not isinstance(record, Mapping):
            raise RecordError(f"{where}: is {_shown(record)}, not a record object; {_RECORDS_FIX}")
        check_record(record, where, source="verdict", fix=_RECORDS_FIX, required=("step",))
    check_value_ranges(records)
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
    without these fields (older files) pass, but not mixed with records that have a settings digest.
    Calibrated records (the exact head's ``_exact`` columns) pool only with calibrated records of
    the same exact-head bandwidth constant (:func:`_check_one_calibration`).

    Raises:
        RecordError: one line naming the models, modes, settings, calibrations or runs found and how
            to keep one.
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
    without = sum(r.get(SETTINGS_FIELD) is None for r in records)
    if digests and without:
        raise RecordError(
            f"verdict: {without} record(s) have no '{SETTINGS_FIELD}' and {len(records) - without} have one: "
            "records of an older version (or of another tool) and of this one are not one sample, their "
            "settings cannot be compared; judge them apart, e.g. "
            f"verdict([r for r in records if r.get({SETTINGS_FIELD!r}) is not None])"
        )
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
    _check_one_calibration(records)
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


def _calibrated(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` carries the exact head's columns (a calibrated run's record)."""
    return EXACT.column("r2_nw") in record or EXACT.column("logit_scale") in record


def _check_one_calibration(records: Sequence[dict]) -> None:
    """Refuse calibrated records pooled with uncalibrated ones, or with records of another exact-head
    bandwidth constant C (:data:`~nw_adapter.integration.schema.EXACT_C_FIELD`; records without it,
    of older files, are not compared): the exact head would be measured on some reference images
    only, and counted over all of them, or its readings (``logit_scale``, ``h_eff``, ``kl``) would
    average two bandwidths.

    Raises:
        RecordError: one line naming the counts or the constants, and the filter that keeps one.
    """
    calibrated = sum(_calibrated(r) for r in records)
    if 0 < calibrated < len(records):
        raise RecordError(
            f"verdict: {calibrated} record(s) carry the exact head's columns ('{{stat}}{EXACT_SUFFIX}') and "
            f"{len(records) - calibrated} do not: records of a calibrated run and of an uncalibrated one are "
            "not one sample (the exact head would be measured on some reference images only); judge them "
            f"apart, e.g. verdict([r for r in records if {EXACT.column('r2_nw')!r} in r])"
        )
    constants = _values(records, EXACT_C_FIELD)
    if len(constants) > 1:
        raise RecordError(
            f"verdict: records of {len(constants)} exact-head bandwidths h = C sigma_t / alpha_t "
            f"(C = {', '.join(repr(c) for c in constants[:3])}) are not one sample: the exact head's "
            "readings would average two bandwidths; judge one at a time, e.g. "
            f"verdict([r for r in records if r.get({EXACT_C_FIELD!r}) == {constants[0]!r}])"
        )


def _reference_effects(
    anchors: Mapping[str, Any], exact_images: Sequence[dict] | None
) -> dict[str, float | None]:
    """Per part, the effect its "not met" is judged against: the exact head's (measured, else the
    theory's) exponent minus the control's, its r2_nw, and :data:`CLAIM_EFFECTS` for the reported
    questions."""
    control, exact = anchors["control"], anchors["exact"]
    path = None
    if exact["exponent"] is not None and control["exponent"] is not None:
        path = exact["exponent"] - control["exponent"]
    return {**CLAIM_EFFECTS, "exponent_minus_control": path, "r2_nw": exact["r2_nw"]}


def _exact_verdict(records: Sequence[dict], half: str, recorded: set[str]) -> tuple[list[dict], dict] | None:
    """The exact head's own per-image values and its two conditions (calibrated runs), judged as the
    adapter is against the theory (and its own control, on its own queries)."""
    if EXACT.column("logit_scale") not in recorded and EXACT.column("r2_nw") not in recorded:
        return None
    draws = EXACT.draws(recorded)
    by_image = image_step_means(records, half, draws, EXACT)
    images = [per_image_values(reference, rows, draws) for reference, rows in by_image.items()]
    theory = {"control": {"exponent": _draws_mean(images, "exponent_control_draws"), "r2_nw": None},
              "exact": {"exponent": THEORY_EXPONENT, "r2_nw": THEORY_R2_NW}}  # fmt: skip
    effects = _reference_effects(theory, None)
    clauses = {
        c.key: _clause_result(c, images, recorded, draws, effects, EXACT) for c in CLAUSES if c.condition
    }
    evidence, conclusion = _conclusion(clauses, len(images), {}, "theory")
    return images, {"evidence": evidence, "conclusion": conclusion, "draws": draws, "clauses": clauses}


def verdict(records: Sequence[dict], *, half: str | None = None, merged_files: int = 0) -> dict[str, Any]:
    """The verdict over reference images x control draws (see the module docstring, docs/verdict.md).

    Args:
        records: record dicts, each with ``reference`` (the image it belongs to) or, without one,
            its pipeline ``call`` (one call per reference image): e.g. ``recorder.to_records()``,
            or :func:`nw_adapter.comparison_records` of :func:`nw_adapter.compare_attention` results;
            with ``{stat}_exact`` columns (a calibrated run) the exact head is measured.
        half: CFG half (default :func:`~nw_adapter.analysis.records.analysis_half`).
        merged_files: reference files already merged into others of the same content before
            the run (:func:`nw_adapter.correlate.images.validate_images`), counted in
            ``duplicates_merged``.

    Units of the same content (records' :data:`CONTENT_FIELD`) are one reference image
    (:func:`merge_by_content`).

    Returns:
        A plain JSON-ready dict (every field documented in docs/verdict.md): ``unit``, ``method``,
        ``alpha``, ``confidence``, ``power``, ``half``, ``images``, ``draws``, ``duplicates_merged``,
        ``merged``, ``per_image`` (:func:`per_image_values` per image), ``clauses`` (key ->
        ``label``, ``short``, ``condition``, ``holds`` True / False / None, ``status``, ``reason``,
        ``parts`` and ``reported``; each part with ``key``, ``label``, ``test``, ``margin``
        (``target`` for an equivalence part), ``n``, ``draws``, ``mean``, ``low``, ``high``,
        ``se``, ``p``, ``significant``, ``mde``, ``compared_with``, ``status``, ``measured``,
        ``reason``, ``caveat``), ``anchors`` (``control`` and ``exact``: their exponent and r2_nw,
        the exact head's ``source`` "measured" or "theory" and, when measured, its own ``verdict``),
        ``position`` (``path``, ``form``, ``nearer``), ``readings`` (:func:`readings_table`),
        ``evidence`` (True / False; None when undecided), ``conclusion`` (the printed line),
        ``skipped`` (:func:`skipped_values`) and ``nonfinite`` (column -> its count).

    Raises:
        ValueError: no records of that half; ``merged_files`` not a whole number >= 0.
        RecordError: (a ``ValueError``) a malformed record, a value out of its range, records of
            several models, modes or settings (or with and without a settings digest), or a unit
            of several runs (:func:`check_one_run`); one line naming them and the fix.
    """
    if isinstance(merged_files, bool) or not isinstance(merged_files, int) or merged_files < 0:
        raise ValueError(
            f"merged_files must be a whole number >= 0 (files merged before the run), got {merged_files!r}"
        )
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
    exact = _exact_verdict(records, half, recorded)
    exact_images = exact[0] if exact else None
    anchors = _anchors(images, exact_images)
    if exact is not None:
        anchors["exact"]["verdict"] = exact[1]
    effects = _reference_effects(anchors, exact_images)
    clauses = {clause.key: _clause_result(clause, images, recorded, draws, effects) for clause in CLAUSES}
    placement = _placement(images, anchors)
    evidence, conclusion = _conclusion(clauses, len(images), placement, anchors["exact"]["source"])
    arms = (ADAPTER, EXACT) if exact is not None else (ADAPTER,)
    skipped = skipped_values(records, half, _read_columns(draws, arms))
    return {
        "unit": UNIT,
        "method": METHOD,
        "alpha": ALPHA,
        "confidence": CONFIDENCE,
        "power": POWER,
        "half": half,
        "images": len(images),
        "draws": draws,
        "duplicates_merged": merged_files + sum(len(units) for units in merged.values()),
        "merged": merged,
        "per_image": images,
        "clauses": clauses,
        "anchors": anchors,
        "position": placement,
        "readings": readings_table(images, exact_images, draws),
        "evidence": evidence,
        "conclusion": conclusion,
        "skipped": skipped,
        "nonfinite": {name: entry["count"] for name, entry in skipped.items()},
    }


def _signed(x: float | None) -> str:
    return "nan" if x is None else f"{x:+.3f}"


def _p(p: float | None, se: float | None = None) -> str:
    if p is None:
        return "p n/a"
    if se == 0:
        return f"p {p:g} (no spread: by its value)"
    return f"p {p:.1e}" if p < 1e-3 else f"p {p:.3f}"


def _count(part: dict) -> str:
    draws = part.get("draws") or 0
    return f"n {part['n']} x {draws} draws" if draws > 1 else f"n {part['n']}"


def _part_line(part: dict) -> str:
    if part["n"] == 0 and not part["measured"]:
        return f"{part['label']}: not measured"
    interval = f"[{_signed(part['low'])}, {_signed(part['high'])}]" if part["low"] is not None else "[n/a]"
    if part.get("test") == EQUIVALENCE_LABEL:
        low, high = part["target"] - part["margin"], part["target"] + part["margin"]
        margin = f", band [{low:g}, {high:g}] ({EQUIVALENCE_LEVEL} interval)"
    else:
        margin = f", margin {part['margin']:g}" if part.get("margin") else ""
    p = _p(part["p"], part.get("se"))
    line = f"{part['label']}: {_signed(part['mean'])} {interval}, {p}, {_count(part)}{margin}"
    status = part.get("status")
    if part.get("measured") and status in ("not met", TOO_FEW):
        mde = part.get("mde")
        if part.get("test") == EQUIVALENCE_LABEL:
            detect = (
                "narrowest margin it could establish" if mde is not None else "no margin it could establish"
            )
        else:
            detect = "smallest detectable" if mde is not None else "no detectable effect"
        shown = "" if mde is None else f" {mde:+.3f}"
        versus = part.get("compared_with")
        against = (
            "" if versus is None or part.get("test") == EQUIVALENCE_LABEL else f" (against {versus:+.3f})"
        )
        line += f": {status}; {detect}{shown} at {POWER:.0%} power{against}"
    elif part.get("measured") and status == "met":
        line += ": met"
    return line


def _reported_line(entry: dict) -> str:
    low, high = entry.get("low"), entry.get("high")
    interval = f"[{low:.3f}, {high:.3f}]" if low is not None and high is not None else "[n/a]"
    mean = "nan" if entry.get("mean") is None else f"{entry['mean']:.3f}"
    theory = f" (theory: {entry['theory']:g})" if entry.get("theory") is not None else ""
    return f"reported (not tested): {entry['label']}: {mean} {interval}, {_count(entry)}{theory}"


def _clause_status(clause: dict, images: int) -> str:
    status = clause.get("status")
    if clause["holds"] is not None:
        return status or STATUS_WORDS[clause["holds"]]
    if images < 2 and not any(p.get("missing") or p.get("reason") == LEGACY_REASON for p in clause["parts"]):
        return "needs several reference images"
    return f"not measured: {clause['reason']}"


def anchor_sentences(result: Mapping[str, Any], *, unmeasured: str = "the theory's values") -> dict[str, str]:
    """The anchors in words, as the console and the report print them: ``"anchors"`` (the control's and
    the exact head's exponent and r2_nw), ``"position"`` (the adapter between them) and ``"exact"`` (the
    exact head's own conclusion), each where the result has it (a result of an older version: none).

    Args:
        result: :func:`verdict`'s result.
        unmeasured: How the exact head's values are named when they are the theory's (not measured).
    """
    anchors = result.get("anchors")
    if not isinstance(anchors, Mapping):
        return {}
    position = result.get("position") if isinstance(result.get("position"), Mapping) else {}
    control, exact = anchors.get("control") or {}, anchors.get("exact") or {}

    def shown(x: Any, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    source = "measured with --calibrate" if exact.get("source") == "measured" else unmeasured
    sentences = {
        "anchors": f"anchors: control: exponent {shown(control.get('exponent'), '+.3f')}, r2_nw "
        f"{shown(control.get('r2_nw'), '.3f')}; exact NW head ({source}): exponent "
        f"{shown(exact.get('exponent'), '+.3f')}, r2_nw {shown(exact.get('r2_nw'), '.3f')}"
    }
    if position.get("nearer"):
        sentences["position"] = (
            "the adapter between them (0 = control, 1 = exact head): path "
            f"{shown(position.get('path'), '+.2f')}, form {shown(position.get('form'), '+.2f')}: nearer the "
            f"{position['nearer']}"
        )
    own = exact.get("verdict")
    if isinstance(own, Mapping) and own.get("conclusion"):
        sentences["exact"] = f"calibration, the exact head in this pipeline: {own['conclusion']}"
    return sentences


def _anchor_lines(result: dict) -> list[str]:
    """The anchors and the adapter's place between them (results of older versions: none), then the
    exact head's measured parts."""
    sentences = anchor_sentences(result)
    lines = list(sentences.values())
    own = ((result.get("anchors") or {}).get("exact") or {}).get("verdict")
    if "exact" in sentences and isinstance(own, Mapping):
        for key in EVIDENCE_CLAUSES:
            clause = (own.get("clauses") or {}).get(key)
            if isinstance(clause, Mapping):
                for part in clause.get("parts") or []:
                    if part.get("measured") or part.get("n"):
                        lines.append(f"  exact head: {_part_line(part)}")
    return lines


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
    for name in ("anchors", "position"):
        if result.get(name) is not None and not isinstance(result[name], Mapping):
            raise RecordError(
                f"verdict: field '{name}' is {_shown(result[name])}, not an object; {_RESULT_FIX}"
            )
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


def format_verdict(result: dict, *, detail: bool = True) -> str:
    """The verdict as text.

    ``detail=True`` (the default, what ``correlate.py -v`` prints): the conclusion line, then per
    clause its status, its parts and what it reports (indented), the anchors and the adapter's place
    between them, the unit line, the skipped values and the legend (:data:`LEGEND`). Each part: mean
    [95% interval], one-sided p, n images (x draws), margin (an equivalence part: its band, with the
    90% interval its decision reads), and when not met its smallest detectable effect at 80% power
    against the effect it is compared with.

    ``detail=False`` (what ``correlate.py`` prints without ``-v``): the conclusion line, one line per
    clause (:func:`_brief_clause`: its status and, unless met, the parts that decide it with their
    smallest detectable effect), the anchors beside the adapter, the exact head's own conclusion in a
    calibrated run, and the number of values left out of the means. With one reference image only
    the conclusion line ("undecided").

    Raises:
        RecordError: (a ``ValueError``) ``result`` is not a verdict (:func:`check_verdict_result`).
    """
    check_verdict_result(result)
    if not detail:
        return "\n".join(_brief_lines(result))
    lines = [f"verdict: {result['conclusion']}"]
    images = result["images"]
    for key, clause in result["clauses"].items():
        asked = "" if clause.get("condition", key in EVIDENCE_CLAUSES) else " [reported question]"
        lines += _fit(f"{clause['label']}: {_clause_status(clause, images)}{asked}", "  ")
        for part in clause["parts"]:
            if part["measured"] or part["n"]:
                lines += _fit(_part_line(part), "    ")
                if part.get("caveat"):
                    lines += _fit(f"caveat: {part['caveat']}", "      ")
        for entry in clause.get("reported") or []:
            if entry["n"]:
                lines += _fit(_reported_line(entry), "    ")
    for line in _anchor_lines(result):
        lines += _fit(line, "  ")
    lines += _fit(_unit_line(result).strip(), "  ")
    lines.extend(_skipped_lines(result))
    lines.append("  legend:")
    for entry in LEGEND:
        lines.extend(_wrapped(entry))
    return "\n".join(lines)


PART_NAMES: dict[str, str] = {
    "exponent_theory": "exponent",
    "exponent_minus_control": "exponent - control's",
    "r2_nw": "r2_nw",
    "nw_gain_minus_control": "nw_gain - control",
    "rho_minus_control": "rho - control",
    **{f"rho_minus_{null}": f"rho - {NULL_LABELS[null]} null" for null in NULL_STATS},
    "rise_minus_control": "rise of rho - control's",
}
"""Each part's name in the brief verdict (:func:`format_verdict` with ``detail=False``); the detailed
verdict prints its ``label``."""


_NO_BREAK = "\u00a0"
"""Joins the words of the brief verdict that a wrapped line keeps together (textwrap breaks at ASCII
whitespace only); replaced by spaces once the line is wrapped."""


def _unbroken(text: str) -> str:
    return text.replace(" ", _NO_BREAK)


def _brief_part(part: Mapping[str, Any], clause_status: str) -> str:
    """``"exponent - control's -0.060 (smallest detectable +0.038, sought +1.976)"``: a part of the brief
    verdict (sought: the effect a "not met" is judged against, ``compared_with``; an equivalence part:
    its band and the narrowest margin the run could establish); its own status follows when it differs
    from its clause's."""
    name = PART_NAMES.get(part.get("key", ""), part["label"])
    status = part.get("status")
    if not part.get("measured"):
        return f"{name} {part.get('reason') or 'not measured'}"
    text = _unbroken(f"{name} {_signed(part['mean'])}")
    mde = part.get("mde")
    if status != "met" and part.get("test") == EQUIVALENCE_LABEL:
        low, high = part["target"] - part["margin"], part["target"] + part["margin"]
        could = "no margin it could establish" if mde is None else f"narrowest margin {mde:.3f}"
        text += f" (band [{low:g}, {high:g}], {could})"
    elif status != "met":
        could = "no detectable effect" if mde is None else _unbroken(f"smallest detectable {mde:+.3f}")
        versus = part.get("compared_with")
        text += f" ({could}" + ("" if versus is None else _unbroken(f", sought {versus:+.3f}")) + ")"
    if status and status != clause_status:
        text += f": {status}"
    return text


def _brief_clause(clause: Mapping[str, Any], key: str, images: int) -> str:
    """One line of the brief verdict per clause: its name, ``[reported]`` for a question that is no
    condition of the conclusion, its status; a met clause with its parts' means, any other with the
    parts that are not met (each with its smallest detectable effect and the effect sought)."""
    status = _clause_status(clause, images)
    asked = "" if clause.get("condition", key in EVIDENCE_CLAUSES) else " [reported]"
    head = f"{clause.get('short') or clause['label']}{asked}: {status}"
    if clause["holds"] is None:
        return head
    parts = [p for p in clause["parts"] if p.get("measured") or p.get("n")]
    if clause["holds"] is not True:
        parts = [p for p in parts if p.get("status") != "met"]
    shown = "; ".join(_brief_part(p, clause.get("status") or status) for p in parts)
    return f"{head}: {shown}" if shown else head


def _brief_anchor_lines(result: Mapping[str, Any]) -> list[str]:
    """The adapter beside its two anchors (exponent / r2_nw) and, when calibrated, the exact head's
    own outcome."""
    anchors = result.get("anchors")
    if not isinstance(anchors, Mapping):
        return []
    control, exact = anchors.get("control") or {}, anchors.get("exact") or {}
    readings = {row.get("key"): row.get("adapter") or {} for row in result.get("readings") or []}

    def pair(exponent: Any, r2_nw: Any) -> str:
        shown = [
            "n/a" if exponent is None else f"{exponent:+.3f}",
            "n/a" if r2_nw is None else f"{r2_nw:.3f}",
        ]
        return _unbroken(" / ".join(shown))

    source = "measured" if exact.get("source") == "measured" else "the theory's"
    adapter = pair(readings.get("exponent", {}).get("mean"), readings.get("r2_nw", {}).get("mean"))
    lines = [
        f"anchors (exponent / r2_nw): control {pair(control.get('exponent'), control.get('r2_nw'))}, "
        f"adapter {adapter}, exact NW head {pair(exact.get('exponent'), exact.get('r2_nw'))} ({source})"
    ]
    own = exact.get("verdict")
    if isinstance(own, Mapping) and own.get("conclusion"):
        outcome = {True: "evidence", False: "no evidence"}.get(own.get("evidence"), "undecided")
        why = str(own["conclusion"]).partition("): ")[2] or own["conclusion"]
        lines.append(f"calibration: the exact NW head in this pipeline: {outcome} ({why})")
    return lines


def skipped_count(result: Mapping[str, Any]) -> int:
    """How many values the verdict left out of its means (``skipped``; an older version's ``nonfinite``)."""
    skipped = result.get("skipped")
    if isinstance(skipped, Mapping):
        return sum(int(entry["count"]) for entry in skipped.values())
    return sum(int(count) for count in (result.get("nonfinite") or {}).values())


def _brief_lines(result: Mapping[str, Any]) -> list[str]:
    lines = [f"verdict: {result['conclusion']}"]
    images = result["images"]
    if images < 2:  # undecided: every clause needs several reference images
        return lines
    for key, clause in result["clauses"].items():
        lines += [line.replace(_NO_BREAK, " ") for line in _fit(_brief_clause(clause, key, images), "  ")]
    for line in _brief_anchor_lines(result):
        lines += [wrapped.replace(_NO_BREAK, " ") for wrapped in _fit(line, "  ")]
    return lines


def format_readings(result: dict) -> str | None:
    """The calibrated table: one row per reading (:data:`READINGS`), the adapter, the exact head and
    the control side by side, each the mean over reference images [95% interval]; None when the
    verdict has no readings (an older version's) or no exact head (an uncalibrated run)."""
    rows = result.get("readings") or []
    if not rows or not any(row.get("exact") for row in rows):
        return None

    header = ("reading", "adapter", "exact NW head", "control")
    body = [
        (row["key"], *(reading_cell(row[arm], row["key"]) for arm in ("adapter", "exact", "control")))
        for row in rows
    ]
    widths = [max(len(r[i]) for r in (header, *body)) for i in range(4)]
    lines = [
        "  ".join(
            text.ljust(w) if i == 0 else text.rjust(w)
            for i, (text, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in (header, *body)
    ]
    legend = [
        f"  {row['label'] if row['label'].startswith(row['key']) else row['key'] + ': ' + row['label']}"
        for row in rows
    ]
    title = "calibrated readings (mean over reference images [95% interval, cut to the reading's range]):"
    return "\n".join([title, *lines, *legend])


READING_RANGES: dict[str, tuple[float, float]] = {
    **{key: VALUE_RANGES[key][:2] for key, _ in READINGS if key in VALUE_RANGES},
    "rho_minus_spread_null": (-2.0, 2.0),
}
"""The values a row of the calibrated table can take (the records' :data:`VALUE_RANGES`, and a
difference of two correlations): a t interval's end beyond them is shown at the bound."""


def reading_cell(value: Mapping[str, Any] | None, key: str) -> str:
    """One cell of the calibrated table, ``mean [low, high]`` to 3 decimals, the interval cut to the
    reading's range (:data:`READING_RANGES`: the control's r2_nw reads [0.594, 1.000], not 1.047)
    and no negative zero (a KL of -0.0000001 is 0.000); "-" where the arm has no value."""
    if not isinstance(value, Mapping) or not isinstance(value.get("mean"), int | float):
        return "-"
    bottom, top = READING_RANGES.get(key, (-math.inf, math.inf))

    def shown(x: float) -> str:
        return f"{min(max(x, bottom), top) + 0.0:.3f}".replace("-0.000", "0.000")

    low, high = value.get("low"), value.get("high")
    finite = isinstance(low, int | float) and isinstance(high, int | float)
    return shown(value["mean"]) + (f" [{shown(low)}, {shown(high)}]" if finite else "")
