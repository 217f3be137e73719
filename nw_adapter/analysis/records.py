"""The records of a run and everything derived from them: aggregation, table, CSV, dataframe, figure.

A record is one plain dict per (call, step, layer, head, CFG half, adapter, image): the keys of
:data:`~nw_adapter.integration.schema.RECORD_KEYS`, the statistics of
:data:`~nw_adapter.integration.schema.STAT_NAMES` (NaN when undefined) and, from the command line,
a ``reference`` key. :class:`Records` (a list of them) is what
:meth:`~nw_adapter.integration.recorder.NWRecorder.records` returns and what the command line's
report (:mod:`nw_adapter.correlate.report`) formats; this module is the only place where records
are averaged, tabulated, written as CSV or drawn.

Aggregation (:func:`aggregate`): per group of records (e.g. per step, or per (block, step)), for
one CFG half or all, every statistic is averaged over its finite values; ``nonfinite`` counts
what each mean left out (never silent); the per-step columns (timestep, noise level) are the
group's common value.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from nw_adapter.atomic import atomic_write, atomic_write_text
from nw_adapter.integration.schema import (
    H_EFF_REASON_FIELD,
    LEGACY_NAMES,
    NAN_REASONS_FIELD,
    NULL_STATS,
    OPTIONAL_STATS,
    RECORD_KEYS,
    RUN_KEYS,
    STAT_NAMES,
    SUMMARY_STATS,
    block_of,  # noqa: F401 (re-exported)
    control_draws,
    control_mean_fields,
    finite_mean,
)

RHO_THRESHOLD = 0.9
"""The paper's "% of heads with rho > 0.9" threshold (``frac_rho_gt_0_9``)."""

CSV_COLUMNS: tuple[str, ...] = ("reference", *RECORD_KEYS, *RUN_KEYS, *STAT_NAMES, H_EFF_REASON_FIELD)
"""Column order of a records CSV (the columns present; extra record keys follow, sorted)."""

STEP_COLUMNS: tuple[str, ...] = ("timestep", "alpha", "sigma", "h_schedule")
"""Per-step columns of a record (the same for every record of a step)."""

BLOCKS: tuple[str, ...] = ("down", "mid", "up")
"""UNet blocks, in drawing order; other denoisers' layers (SD3, Flux) are block ``"other"``."""


def analysis_half(records: Sequence[dict]) -> str:
    """The CFG half a report is about: ``cond`` if present, else ``all``, else ``uncond``.

    Raises:
        ValueError: no record has one of these halves.
    """
    halves = {r.get("half") for r in records}
    for half in ("cond", "all", "uncond"):
        if half in halves:
            return half
    raise ValueError("records: no record has half in {'cond', 'all', 'uncond'}; nothing to report")


def _stat(record: dict, name: str) -> Any:
    """``record[name]``, or its value under a name of an older schema (e.g. ``rho_norm_null``)."""
    if name in record:
        return record[name]
    legacy = (record.get(old) for old, new in LEGACY_NAMES.items() if new == name)
    return next((v for v in legacy if v is not None), None)


def _common_value(values: list[Any]) -> float:
    """The value every record of a group shares (NaN and inf included); else the finite mean."""
    numbers = [math.nan if v is None else float(v) for v in values]
    first = numbers[0]
    if all(x == first or (math.isnan(x) and math.isnan(first)) for x in numbers):
        return first
    return finite_mean(numbers)[0]


def nan_reasons(records: Iterable[dict]) -> dict[str, dict[str, int]]:
    """``{stat: {reason: count}}``: the records whose statistic is NaN for a recorded reason.

    Today ``h_eff`` (its reason in the record's ``h_eff_reason``, one of
    :data:`~nw_adapter.core.specification.H_EFF_REASONS`: not identified); ``{}`` when none.
    """
    counts: dict[str, int] = {}
    for record in records:
        reason = record.get(H_EFF_REASON_FIELD)
        if reason:
            counts[reason] = counts.get(reason, 0) + 1
    return {"h_eff": counts} if counts else {}


def aggregate(
    records: Iterable[dict],
    by: Sequence[str] = ("step",),
    *,
    half: str | None = None,
    step_columns: Sequence[str] = ("timestep",),
    optional_stats: bool = False,
) -> list[dict]:
    """Average the statistics of the records per group.

    Args:
        records: record dicts.
        by: record keys to group by, e.g. ``("step",)`` (the report's table),
            ``("block", "step")`` (its figure), ``("call", "step", "half")`` (the summary).
        half: keep this CFG half only (its rows then carry ``half``); None keeps every record.
        step_columns: per-step columns copied from the group (its common value; the finite
            mean if the records disagree).
        optional_stats: also average the statistics of
            :data:`~nw_adapter.integration.schema.OPTIONAL_STATS` present in some record of the
            group (the readings are among the summary statistics) and, where the scale-matched
            control was recorded, its draws' means ``{X}_control`` and ``key_scale``
            (:func:`~nw_adapter.integration.schema.control_mean_fields`) with ``control_draws``.

    Returns:
        One dict per group, sorted by the group keys: the group keys, ``half``, the step columns,
        the mean of every statistic of :data:`~nw_adapter.integration.schema.SUMMARY_STATS` over
        its finite values (NaN when none), ``nonfinite`` (statistic -> number of NaN/inf values
        its mean left out), ``nan_reasons`` (:func:`nan_reasons`), ``frac_rho_gt_0_9`` (share of
        records with rho > 0.9, a NaN rho counted as not) and ``count`` (records averaged).
    """
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        if half is None or record.get("half") == half:
            groups.setdefault(tuple(record[k] for k in by), []).append(record)
    rows = []
    for key in sorted(groups):
        members = groups[key]
        row: dict[str, Any] = dict(zip(by, key, strict=True))
        if half is not None:
            row["half"] = half
        for name in step_columns:
            row[name] = _common_value([r.get(name) for r in members])
        present = [n for n in OPTIONAL_STATS if optional_stats and any(n in r for r in members)]
        names = (*SUMMARY_STATS, *present)
        nonfinite: dict[str, int] = {}
        for name in names:
            row[name], dropped = finite_mean(_stat(r, name) for r in members)
            if dropped:
                nonfinite[name] = dropped
        if optional_stats:
            draws, means = control_mean_fields(members)
            for name, values in means.items():
                row[name], dropped = finite_mean(values)
                if dropped:
                    nonfinite[name] = dropped
            if draws:
                row["control_draws"] = draws
        row["nonfinite"] = nonfinite
        row[NAN_REASONS_FIELD] = nan_reasons(members)
        rhos = [_stat(r, "rho") for r in members]
        row["frac_rho_gt_0_9"] = sum(1 for v in rhos if v is not None and v > RHO_THRESHOLD) / len(members)
        row["count"] = len(members)
        rows.append(row)
    return rows


def csv_text(
    records: Sequence[dict], columns: Sequence[str] | None = None, *, order: Sequence[str] = CSV_COLUMNS
) -> str:
    """CSV text of the records: one row per record, None written as an empty cell.

    Args:
        records: record dicts.
        columns: the header; default: the columns of ``order`` present in some record, then
            every other key (sorted).
        order: the column order (default :data:`CSV_COLUMNS`, the statistics in record order).
    """
    if columns is None:
        present = {k for r in records for k in r}
        columns = [c for c in order if c in present] + sorted(present - set(order))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)
    return buffer.getvalue()


TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("step", "step", "{:>4d}"),
    ("timestep", "timestep", "{:>8.0f}"),
    ("rho", "rho", "{:>6.3f}"),
    ("rho_perm_null", "perm-null", "{:>9.3f}"),
    ("rho_norm_matched_null", "norm-null", "{:>9.3f}"),
    ("rho_spread_null", "spread-null", "{:>11.3f}"),
    ("kl", "KL", "{:>7.4f}"),
    ("nw_gain", "nw-gain", "{:>7.4f}"),
    ("rho_control", "rho-ctrl", "{:>8.3f}"),
    ("nw_gain_control", "gain-ctrl", "{:>9.4f}"),
    ("frac_rho_gt_0_9", "rho>0.9", "{:>7.3f}"),
)
"""(row key, header, format) of each column of the step table: the command line's terminal table
and :meth:`Summary.table` (at most 105 characters wide).

The scale-matched control's columns (:data:`OPTIONAL_COLUMNS`: the means over its draws; its change
of scale ``key_scale`` is in the rows) are shown only when some row has them; every other statistic
(Pearson, n_eff, the q.k spread ratio, the key-norm CV, r2_key, h_eff ...) is in the rows themselves
(``rho.json``'s ``table`` / ``steps``, ``rho.csv``, ``summary[i]``).
"""

OPTIONAL_COLUMNS: frozenset[str] = frozenset({"rho_control", "nw_gain_control"})
"""Table columns printed only when recorded (the untrained-adapter control on)."""

COLUMN_LEGEND: dict[str, str] = {
    "step": "denoiser call (0 = the first)",
    "timestep": "the scheduler's timestep t at that call",
    "rho": "Spearman rho of attention vs NW (Gaussian-kernel) weights per query row, from logits",
    "rho_perm_null": "rho with the keys permuted: chance level",
    "rho_norm_matched_null": "rho of random query directions with the same norms",
    "rho_spread_null": "rho with each row's q.k kept and the key norms shuffled: what q.k spread alone gives",
    "kl": "KL divergence of the attention A from the NW weights: sum of A log(A / NW) over the tokens",
    "nw_gain": "KL to the query-averaged attention minus KL to the best NW fit (> 0: NW predicts better)",
    "rho_control": "rho of the scale-matched control (untrained keys at the trained keys' RMS; draws' mean)",
    "nw_gain_control": "nw-gain of the scale-matched control (mean over its draws)",
    "frac_rho_gt_0_9": "fraction of (layer, head) records with rho > 0.9",
}
"""What each column of :data:`TABLE_COLUMNS` shows (row key -> words), printed under the table
(:func:`format_legend`); docs/cli.md and the HTML report have the same words."""

LEGEND_HEADING = "legend (means over layers, heads and reference images):"


def shown_columns(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]] = TABLE_COLUMNS) -> list:
    """``columns`` less the optional ones (:data:`OPTIONAL_COLUMNS`) no row has a value for."""
    return [
        column for column in columns
        if column[0] not in OPTIONAL_COLUMNS or any(_present(row.get(column[0])) for row in rows)
    ]  # fmt: skip


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]] | None = None) -> str:
    """The step table of aggregated rows (:data:`TABLE_COLUMNS`, the optional ones where recorded).

    Missing (None or NaN) values print as ``nan``. Every number is the row's value rounded to the
    shown precision, so the table can be checked against ``rho.json``'s ``table``.
    """
    columns = shown_columns(rows) if columns is None else list(columns)
    widths = [len(fmt.format(0 if "d" in fmt else 0.0)) for _, _, fmt in columns]
    widths = [max(w, len(h)) for w, (_, h, _) in zip(widths, columns, strict=True)]
    lines = ["  ".join(h.rjust(w) for w, (_, h, _) in zip(widths, columns, strict=True))]
    for row in rows:
        cells = []
        for w, (key, _, fmt) in zip(widths, columns, strict=True):
            value = row.get(key)
            text = "nan" if not _present(value) else fmt.format(int(value) if "d" in fmt else value).strip()
            cells.append(text.rjust(w))
        lines.append("  ".join(cells))
    return "\n".join(lines)


def format_legend(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]] | None = None) -> str:
    """The legend of the columns :func:`format_table` shows for ``rows``: one line per column.

    :data:`LEGEND_HEADING`, then ``  <header>  <words>``, the headers as the table prints them,
    aligned; at most 105 characters a line, as the table.
    """
    columns = shown_columns(rows) if columns is None else list(columns)
    width = max(len(header) for _, header, _ in columns)
    words = {**COLUMN_LEGEND, "call": "pipeline call (one per generation)"}
    lines = [f"  {header:<{width}}  {words[key]}" for key, header, _ in columns]
    return "\n".join([LEGEND_HEADING, *lines])


def repeated_timesteps(step_rows: Sequence[dict]) -> dict[float, list[int]]:
    """Timesteps shared by several steps (PNDM's warm-up evaluates one timestep twice).

    Args:
        step_rows: Rows with ``step`` and ``timestep`` (e.g. ``rho.json``'s ``steps``), of one call.

    Returns:
        ``{timestep: [step, ...]}`` for every timestep that more than one step has.
    """
    by_timestep: dict[float, set[int]] = {}
    for row in step_rows:
        if row.get("timestep") is not None and math.isfinite(float(row["timestep"])):
            by_timestep.setdefault(float(row["timestep"]), set()).add(int(row["step"]))
    return {t: sorted(steps) for t, steps in by_timestep.items() if len(steps) > 1}


def repeated_timestep_note(
    step_rows: Sequence[dict], *, scheduler: str | None = None, requested: int | None = None
) -> str | None:
    """One sentence explaining repeated timesteps (documented choice: steps are denoiser calls).

    A "step" is one call of the denoiser (the entries of ``scheduler.timesteps``). PNDM (SD 1.5's
    default scheduler) calls it twice at its second timestep, so N steps give N + 1 calls and two
    of them share a timestep; both are kept, labelled and drawn apart, never pooled.

    Args:
        step_rows: rows with ``step`` and ``timestep`` of one call.
        scheduler: the scheduler's class name (default "the scheduler").
        requested: the number of steps asked for (``--steps``), if known.
    """
    repeats = repeated_timesteps(step_rows)
    if not repeats:
        return None
    calls = len({int(row["step"]) for row in step_rows})
    parts = [f"steps {' and '.join(map(str, steps))} share t={t:.0f}" for t, steps in sorted(repeats.items())]
    count = f"{calls} denoiser calls for {requested} steps" if requested else f"{calls} denoiser calls"
    shared = "; ".join(parts)
    return f"{scheduler or 'the scheduler'} calls the denoiser twice at one timestep ({shared}): {count}"


CONTROL_NAMES: dict[str | None, str] = {
    "per-layer": "scale-matched control",
    "end-to-end": "end-to-end control",
    None: "control",
}
"""How figures and tables name the draws' mean of each kind of control (``rho.json``'s
``control.kind``; None: a kind the records do not tell)."""

CONTROL_DESCRIPTIONS: dict[str | None, str] = {
    "per-layer": "scale-matched untrained keys in every layer, the same queries",
    "end-to-end": "end-to-end, a second generation with the untrained adapter in every layer",
    None: "untrained-adapter draws (kind not recorded)",
}
"""What each kind of control is, in the one line every figure and table carries."""


def control_name(kind: str | None, draws: int) -> str:
    """``"scale-matched control (3 draws)"``, ``"end-to-end control (1 draw)"``: the draws' mean of
    the control of ``kind`` (``"per-layer"``, ``"end-to-end"``, None when not told)."""
    name = CONTROL_NAMES.get(kind, CONTROL_NAMES[None])
    return f"{name} ({draws} draw{'' if draws == 1 else 's'})"


def control_line(kind: str | None, draws: int) -> str:
    """The line that says which control ran: ``"control: none recorded"`` without one, else
    ``"control: <what it is>, K draws"``."""
    if not draws:
        return "control: none recorded (the control's columns are absent)"
    description = CONTROL_DESCRIPTIONS.get(kind, CONTROL_DESCRIPTIONS[None])
    return f"control: {description}, {draws} draw{'' if draws == 1 else 's'}"


def records_control(records: Sequence[dict]) -> int:
    """The number of control draws K whose columns the records hold (0: no control)."""
    return control_draws({name for r in records for name in r})


def figure_title(
    model: str | None, steps: int | None, bandwidth: Any, units: int, noun: str = "reference"
) -> str:
    """The title of ``rho.png`` and of :meth:`Records.plot`: ``"tiny, 25 steps, bandwidth matched,
    3 references"`` (a part that is not known is left out)."""
    parts = [str(model)] if model else []
    if steps:
        parts.append(f"{steps} steps")
    if bandwidth is not None:
        parts.append(f"bandwidth {bandwidth}")
    parts.append(f"{units} {noun}{'' if units == 1 else 's'}")
    return ", ".join(parts)


class Summary(list):
    """The rows of :meth:`Records.summary`: a plain list of dicts that prints as a table.

    Every row (one per call, step and CFG half) keeps every statistic; printed, it is one line per
    step of one half (:meth:`table`): the command line's columns, notes and legend.

    ``empty_reason``: why there are no rows, when it is known (e.g. swap mode without statistics).
    ``error``: one line on the steps whose side computation failed in every layer (their rows are
    missing), printed above the table (``NWRecorder.summary``).
    ``context``: what the records say of their run (:attr:`Records.context`: the scheduler, the
    control's kind), for the notes.
    """

    empty_reason: str | None = None
    error: str | None = None
    context: dict[str, Any] | None = None

    def table(self, half: str | None = None) -> str:
        """The rows of one CFG half as the command line's table: a line saying what the numbers are
        (with the notes the command line prints: which control ran, steps that share a timestep),
        one line per (call,) step in the columns of :data:`TABLE_COLUMNS`, and the legend of the
        columns shown (:func:`format_legend`); the ``error`` line, if any, above it.

        Args:
            half: the CFG half (default ``cond`` if present, else ``all``, else ``uncond``); every
                column of every half stays in the rows themselves (``summary[i]``).
        """
        table = self._rows_table(half)
        return f"error: {self.error}\n{table}" if self.error else table

    def _rows_table(self, half: str | None) -> str:
        if not self:
            return f"(no records: {self.empty_reason})" if self.empty_reason else "(no records)"
        half = half or analysis_half(self)
        rows = [r for r in self if r.get("half") == half]
        halves = sorted({r.get("half") for r in self})
        if not rows:
            return f"(no rows of half {half!r}; halves: {', '.join(map(str, halves))})"
        calls = sorted({r.get("call") for r in rows})
        columns = shown_columns(rows)
        if len(calls) > 1:
            columns = [("call", "call", "{:>4d}"), *columns]
        others = [h for h in halves if h != half]
        context = self.context or {}
        draws = max(int(r.get("control_draws") or 0) for r in rows)
        notes = [control_line(context.get("control"), draws)]
        repeated = repeated_timestep_note(
            [r for r in rows if r.get("call") == calls[0]], scheduler=context.get("scheduler")
        )
        if repeated:
            notes.append(f"note: {repeated}")
        heading = f"{half} half: mean over layers, heads, adapters and images per step" + (
            f" (other halves: table(half={others[0]!r}))" if others else ""
        )
        return "\n".join([heading, *notes, format_table(rows, columns), format_legend(rows, columns)])

    def __repr__(self) -> str:
        return self.table()

    __str__ = __repr__


def _series(rows: Sequence[dict], key: str) -> Any:
    import numpy as np

    return np.array([np.nan if r.get(key) is None else float(r[key]) for r in rows], dtype=float)


NULL_STYLES: dict[str, tuple[str, str, str]] = {
    "rho_perm_null": ("permutation null (keys shuffled)", "0.45", ":"),
    "rho_norm_matched_null": ("norm-matched null (random query directions)", "#ff7f0e", "--"),
    "rho_spread_null": ("q.k-spread null (key norms shuffled)", "#9467bd", "-."),
}
"""Label, colour and line style of each null of rho in the figures (THEORY.md section 4)."""

CONTROL_RHO = "rho_control"
CONTROL_COLOR = "0.1"
"""rho of the same queries against the control's keys (the draws' mean): drawn when it was recorded,
labelled ``"rho, "`` + :func:`control_name` of the control's kind and draws."""

RHO_LABEL = "rho (attention vs NW)"


def _panel_title(name: str, panel_key: str | None) -> str:
    if panel_key is None:
        return f"{name} half"
    return "all IP layers" if name == "other" else f"{name} block"


def wrap_title(text: str, width_inches: float, fontsize: float) -> str:
    """``text`` with each line wrapped to fit ``width_inches`` at ``fontsize`` points.

    A conservative estimate of DejaVu Sans' mean character width (0.6 em), so a title never runs
    past the figure's edges (matplotlib's own ``wrap=True`` is not seen by ``get_window_extent``).
    """
    import textwrap

    chars = max(20, int(width_inches * 72 / (0.6 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))


def unit_key(records: Sequence[dict]) -> str | None:
    """The key naming the independent unit of the records: ``reference`` (the command line's
    reference images), else ``call`` (one pipeline call per reference in a notebook); None when
    the records hold fewer than two units (no interval can be drawn)."""
    for key in ("reference", "call"):
        if records and all(key in r for r in records) and len({r[key] for r in records}) >= 2:
            return key
    return None


RHO_RANGE = (-1.0, 1.0)
"""The values rho can take: an interval beyond them is cut there (and the figures mark the cut)."""


def unit_intervals(
    records: Sequence[dict], panel_key: str | None, *, half: str | None, stat: str = "rho"
) -> dict[tuple[Any, int], tuple[float, float, int, bool, bool]]:
    """Student t 95% interval of ``stat`` over the independent units, per (panel, step).

    Per unit (:func:`unit_key`), the mean over its layers and heads (:func:`aggregate`); then
    :func:`nw_adapter.core.intervals.t_interval` over the units of each (panel, step). Keyed by
    the step (the denoiser call), never by the timestep: PNDM's two calls at one timestep are two
    points of the band, not one point of twice the units.

    Returns:
        ``{(panel, step): (low, high, n units, cut low, cut high)}``, the interval cut to
        :data:`RHO_RANGE` (for rho) and whether it was; empty with fewer than two units.
    """
    from nw_adapter.core.intervals import t_interval

    key = unit_key(records)
    if key is None:
        return {}
    by = (key, panel_key, "step") if panel_key else (key, "step")
    per_unit: dict[tuple[Any, int], list[float]] = {}
    for row in aggregate(records, by, half=half):
        value = row.get(stat)
        if value is not None and math.isfinite(value):
            panel = row[panel_key] if panel_key else None
            per_unit.setdefault((panel, int(row["step"])), []).append(float(value))
    bottom, top = RHO_RANGE if stat == "rho" else (-math.inf, math.inf)
    out = {}
    for where, values in per_unit.items():
        if len(values) >= 2:
            _, low, high = t_interval(values)
            out[where] = (max(bottom, low), min(top, high), len(values), low < bottom, high > top)
    return out


RHO_COLOR = "#1f77b4"
"""The colour of rho in every panel (the legend names it once)."""

RHO_BAND_LABEL = "rho: 95% t interval over {n} {unit}s"
CUT_LABEL = "interval cut at rho's range [-1, 1]"


def step_ticks(
    steps: Sequence[int], timesteps: Sequence[float], most: int = 5
) -> tuple[list[int], list[str]]:
    """At most ``most`` evenly spaced steps (the first and the last among them) and their labels
    ``"<step>\\nt=<timestep>"``: the x axis of a figure over denoiser calls names both."""
    import numpy as np

    order = sorted(set(zip(steps, timesteps, strict=True)))
    if not order:
        return [], []
    picks = sorted({int(i) for i in np.linspace(0, len(order) - 1, min(most, len(order))).round()})
    chosen = [order[i] for i in picks]
    return [s for s, _ in chosen], [f"{s}\nt={t:.0f}" if math.isfinite(t) else f"{s}" for s, t in chosen]


def rho_figure(
    rows: Sequence[dict],
    *,
    panel_key: str | None = "block",
    title: str | None = None,
    note: str | None = None,
    units: Sequence[dict] | None = None,
    half: str | None = None,
    control: str | None = None,
):
    """rho over the denoising steps beside each of its three nulls, one panel per block (or one).

    Each null is its own named line (permutation, norm-matched, q.k-spread): a rho on or under
    any of them is not evidence of NW-like attention beyond what that null gives. When the rows
    hold ``rho_control`` (the control, the mean over its draws), it is drawn too, named by its kind:
    a rho on or under it is what the architecture gives without adapter training. With the records
    of two or more independent units (``units``: reference images, or pipeline calls), rho carries
    its 95% Student t interval over the units as a band (:func:`unit_intervals`); where that interval
    reaches past rho's range [-1, 1] it is cut there and marked (a triangle at the cut), and the
    axes always hold the whole band.

    The x axis is the step, the denoiser call (each tick also names its timestep): PNDM calls the
    denoiser twice at one timestep, and those two calls are two points, never pooled. Under the
    title: ``note`` and the line saying which control ran (:func:`control_line`). Printed at a
    paper's width (7 in for three panels, 3.5 in for one) with 7-9 pt text; the legend is under
    the panels and names every line.

    Args:
        rows: :func:`aggregate` rows (``step``, ``timestep``, ``rho`` and the nulls of
            :data:`~nw_adapter.integration.schema.NULL_STATS`), with ``panel_key`` among their keys.
        panel_key: the key whose values get a panel each (``"block"``: down, mid, up; the
            layers of SD3 / Flux transformers are one panel, "all IP layers"); None: one panel of
            every row, labelled by its ``half``.
        title: figure title. note: a line under it (e.g. why two steps share a timestep); both
            are wrapped to the figure's width.
        units: the records behind ``rows`` (with ``reference`` or ``call``), for the band.
        half: the CFG half of ``rows`` (the band's records are filtered to it).
        control: the control's kind (``rho.json``'s ``control.kind``: ``"per-layer"``,
            ``"end-to-end"``; None when not told).

    Returns:
        A :class:`matplotlib.figure.Figure` (the Agg canvas: the pyplot backend is untouched).

    Raises:
        ValueError: no rows to draw.
    """
    import numpy as np
    from matplotlib.figure import Figure

    if panel_key is None:
        panels = [(rows[0].get("half", "all") if rows else "all", list(rows))]
    else:
        names = [b for b in (*BLOCKS, "other") if any(r.get(panel_key) == b for r in rows)]
        panels = [(name, [r for r in rows if r.get(panel_key) == name]) for name in names]
    if not panels or not panels[0][1]:
        raise ValueError("rows: nothing to plot (did the run record any layer and step?)")
    bands = unit_intervals(units or [], panel_key, half=half)
    unit = unit_key(units or [])
    draws = max(int(r.get("control_draws") or 0) for r in rows)
    width = 7.0 if len(panels) > 1 else 3.5
    heading = "\n".join(t for t in (title, note, control_line(control, draws)) if t)
    heading = wrap_title(heading, width - 0.2, 8)
    lines = heading.count("\n") + 1
    legend_rows = 7 if len(panels) == 1 else 4
    fig = Figure(figsize=(width, 2.7 + 0.14 * (lines + legend_rows)), layout="constrained")
    lowest = min(
        [float(np.nanmin(_series(rows, key))) for key in ("rho", *NULL_STATS, CONTROL_RHO)
         if any(r.get(key) is not None for r in rows)]
        + [band[0] for band in bands.values()]
    )  # fmt: skip
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (name, panel_rows) in zip(axes, panels, strict=True):
        panel_rows = sorted(panel_rows, key=lambda r: int(r["step"]))
        x = _series(panel_rows, "step")
        for stat in NULL_STATS:
            label, color, style = NULL_STYLES[stat]
            ax.plot(x, _series(panel_rows, stat), color=color, linestyle=style, linewidth=1.0, label=label)
        if any(r.get(CONTROL_RHO) is not None for r in panel_rows):
            label = "rho, " + control_name(control, draws)
            ax.plot(x, _series(panel_rows, CONTROL_RHO), color=CONTROL_COLOR, linewidth=1.0, label=label)
        panel = name if panel_key else None
        band = [bands.get((panel, int(s)), (math.nan, math.nan, 0, False, False)) for s in x]
        if any(b[2] for b in band):
            ax.fill_between(
                x,
                [b[0] for b in band],
                [b[1] for b in band],
                color=RHO_COLOR,
                alpha=0.25,
                linewidth=0,
                label=RHO_BAND_LABEL.format(n=max(b[2] for b in band), unit=unit),
            )
            for index, marker in ((3, "v"), (4, "^")):  # the interval cut at rho's range: a mark
                cut = [(s, b[index - 3]) for s, b in zip(x, band, strict=True) if b[index]]
                if cut:
                    ax.plot(
                        [c[0] for c in cut],
                        [c[1] for c in cut],
                        linestyle="none",
                        marker=marker,
                        markersize=3.5,
                        color=RHO_COLOR,
                        label=CUT_LABEL,
                    )
        ax.plot(
            x,
            _series(panel_rows, "rho"),
            marker="o",
            markersize=2,
            linewidth=1.4,
            color=RHO_COLOR,
            label=RHO_LABEL,
        )
        ax.axhline(0.0, color="0.3", linewidth=0.6)
        ticks, labels = step_ticks([int(s) for s in x], list(_series(panel_rows, "timestep")))
        ax.set_xticks(ticks, labels)
        ax.set_xlim(float(np.nanmin(x)) - 0.5, float(np.nanmax(x)) + 0.5)
        ax.set_ylim(max(-1.08, min(-0.2, lowest - 0.05)), 1.08)
        ax.set_title(_panel_title(name, panel_key), fontsize=9)
        ax.tick_params(labelsize=6.5)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("Spearman rho", fontsize=8)
    axes[len(axes) // 2].set_xlabel("step (denoiser call) and its timestep t; denoising \u2192", fontsize=7)
    seen: dict[str, Any] = {}
    for ax in axes:  # every label once, whichever panel drew it
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    first = [RHO_LABEL, *(s for s in seen if s.startswith(("rho, ", "rho: 95%"))), CUT_LABEL]
    order = [s for s in first if s in seen] + [s for s in seen if "null" in s]
    fig.legend([seen[s] for s in order], order, loc="outside lower center", ncol=1 if len(panels) == 1 else 2,
               fontsize=7, frameon=False)  # fmt: skip
    fig.suptitle(heading, fontsize=8)
    return fig


FIGURE_DPI = 300
"""Resolution of every PNG the package writes: print quality at the figure's width in inches."""


def save_figure(fig: Any, path: str | os.PathLike) -> Path:
    """Write a figure as PNG atomically (:data:`FIGURE_DPI`) and return the path."""
    return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=FIGURE_DPI))


class Records(list):
    """The records of a run (a list of dicts) with their summary, CSV, dataframe and figure.

    Attributes:
        empty_reason: why nothing was recorded, when the recorder knows (swap mode records no
            statistics unless asked); the summary and the figure say it.
        context: what the records do not say of their run, where the recorder knows it
            (:func:`recorder_records`): ``bandwidth`` (the rule), ``scheduler`` (its class name),
            ``control`` (the control's kind, ``"per-layer"``), for the figure's title and the
            summary's notes; empty for plain records.

    Example:
        >>> records = rec.records()          # NWRecorder.records()
        >>> records.summary()                # a table at the REPL
        >>> records.to_csv("records.csv"); records.plot(path="rho.png")
    """

    empty_reason: str | None = None
    context: dict[str, Any] = {}  # replaced per instance (recorder_records), never mutated

    def summary(self) -> Summary:
        """One row per (call, step, half): the means of :func:`aggregate` over layers, heads,
        adapters and images, with the step's timestep and noise level; printed as the command
        line's table (:meth:`Summary.table`)."""
        rows = aggregate(self, ("call", "step", "half"), step_columns=STEP_COLUMNS, optional_stats=True)
        summary = Summary(rows)
        summary.empty_reason = self.empty_reason
        summary.context = dict(self.context)
        return summary

    def title(self) -> str:
        """The title of :meth:`plot`, in the command line's words (:func:`figure_title`): the model
        (the records' ``model``), the steps (the distinct timesteps of the first call: PNDM's
        repeated one counts once, as ``--steps`` does), the bandwidth rule (:attr:`context`) and the
        number of independent units (reference images, else pipeline calls)."""
        models = sorted({str(r["model"]) for r in self if r.get("model")})
        first = min((r.get("call", 0) for r in self), default=0)
        timesteps = {r.get("timestep") for r in self if r.get("call", 0) == first}
        unit = "reference" if all("reference" in r for r in self) else "call"
        units = len({r.get(unit, 0) for r in self})
        noun = "reference" if unit == "reference" else "pipeline call"
        return figure_title(", ".join(models) or None, len(timesteps) or None, self.context.get("bandwidth"),
                            units, noun)  # fmt: skip

    def csv_text(self) -> str:
        """The records as CSV text (:func:`csv_text`; an empty run: the header of every field)."""
        return csv_text(self, None if self else (*RECORD_KEYS, *STAT_NAMES))

    def to_csv(self, path: str | os.PathLike) -> Path:
        """Write :meth:`csv_text` to ``path`` atomically."""
        return atomic_write_text(path, self.csv_text())

    def to_dataframe(self):
        """The records as a tidy :class:`pandas.DataFrame` (one row per record, columns = keys).

        Raises:
            ImportError: pandas is not installed (use :meth:`to_csv`, which needs nothing).
        """
        try:
            import pandas
        except ImportError:
            raise ImportError(
                "to_dataframe needs pandas: pip install 'nw-adapter[dataframe]' (or pandas); "
                "without it use rec.to_csv(path)"
            ) from None
        columns = list(self[0]) if self else [*RECORD_KEYS, *STAT_NAMES]
        return pandas.DataFrame.from_records(self, columns=columns)

    def plot(self, *, half: str | None = None, path: str | os.PathLike | None = None):
        """The command line's ``rho.png`` (the README's headline figure) of these records.

        rho against the timestep beside each of its nulls (and the scale-matched control, the mean
        over its draws, when recorded), one panel per UNet block (SD3 / Flux: one panel of all IP layers), the
        means over layers and heads; with two or more reference images (the ``reference`` key
        of the command line's records) or pipeline calls, a band of rho's 95% Student t interval
        over them (:func:`rho_figure`); the command line's title (:meth:`title`), its note on steps
        that share a timestep and its line on which control ran.

        Args:
            half: CFG half to draw (default ``cond`` if recorded, else ``all``, else ``uncond``).
            path: also save the figure there (PNG, atomically).

        Raises:
            ValueError: nothing recorded.
        """
        if not self:
            reason = self.empty_reason or "run the pipeline first, or load a file"
            raise ValueError(f"plot: nothing recorded ({reason})")
        half = half or analysis_half(self)
        panel = "block" if all(r.get("block") is not None for r in self) else None  # else one panel
        rows = aggregate(self, (panel, "step") if panel else ("step",), half=half, optional_stats=True)
        if not rows:
            halves = sorted({r["half"] for r in self})
            raise ValueError(f"plot: no records of half {half!r}; pick one of {halves}")
        first = min(r.get("call", 0) for r in self)
        note = repeated_timestep_note(
            [r for r in aggregate(self, ("call", "step"), half=half) if r["call"] == first],
            scheduler=self.context.get("scheduler"),
        ) if all("call" in r for r in self) else None  # fmt: skip
        fig = rho_figure(rows, panel_key=panel, units=self, half=half, title=self.title(), note=note,
                         control=self.context.get("control"))  # fmt: skip
        if path is not None:
            save_figure(fig, path)
        return fig


def recorder_records(recorder: Any, key_set: str | None = "ip") -> Records:
    """The records of ``recorder`` (an :class:`~nw_adapter.integration.recorder.NWRecorder`) as
    :class:`Records`: its :meth:`~nw_adapter.integration.recorder.NWRecorder.to_records` of
    ``key_set``; empty ones say why when the recorder was told to record no statistics."""
    records = Records(recorder.to_records(key_set))
    config = recorder.config
    scheduler = getattr(getattr(recorder, "pipe", None), "scheduler", None)
    records.context = {
        "bandwidth": config.bandwidth,
        "scheduler": None if scheduler is None else type(scheduler).__name__,
        "control": "per-layer" if config.untrained_control else None,
    }
    saved = (getattr(recorder, "source", None) or {}).get("context")
    if recorder.loaded_records and saved:  # a recorder of a file: the file's run
        records.context = dict(saved)
    if not records and not recorder.loaded_records and not config.record_statistics:
        records.empty_reason = (
            f"{config.mode} mode records no statistics unless asked; pass statistics=True to "
            "set_ip_adapter_nw_processor / apply_nw_processor"
        )
    return records


def recorder_summary(recorder: Any, records: list[dict[str, Any]] | None = None) -> Summary:
    """:meth:`Records.summary` of ``records``, else of ``recorder``'s own records, whose ``error``
    is then its ``failed_steps_line()`` (steps whose side computation failed in every layer)."""
    if records is not None:
        return Records(records).summary()
    summary = recorder_records(recorder).summary()
    summary.error = recorder.failed_steps_line()
    return summary
