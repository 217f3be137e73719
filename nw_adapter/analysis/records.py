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
    control_label,
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


_SUMMARY_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("call", "call", "{:d}"),
    ("step", "step", "{:d}"),
    ("timestep", "t", "{:.0f}"),
    ("rho", "rho", "{:.3f}"),
    ("rho_perm_null", "perm-null", "{:.3f}"),
    ("rho_norm_matched_null", "norm-null", "{:.3f}"),
    ("rho_spread_null", "spread-null", "{:.3f}"),
    ("rho_control", "rho-ctrl", "{:.3f}"),
    ("kl", "KL", "{:.4f}"),
    ("count", "records", "{:d}"),
)
"""(key, header, format) of the columns :meth:`Summary.table` prints (the main ones)."""

_SUMMARY_LEGEND = (
    "perm-null / norm-null / spread-null: rho of the permutation, norm-matched and q.k-spread nulls; "
    "rho-ctrl: rho of the scale-matched control (the untrained adapter's keys rescaled to the trained "
    "keys' RMS norm; mean over its draws; its key_scale and other readings are in the rows); "
    "KL: KL(A || NW); records: records averaged"
)


class Summary(list):
    """The rows of :meth:`Records.summary`: a plain list of dicts that prints as a table.

    Every row (one per call, step and CFG half) keeps every statistic; printed, it is one line per
    step of one half (:meth:`table`).

    ``empty_reason``: why there are no rows, when it is known (e.g. swap mode without statistics).
    ``error``: one line on the steps whose side computation failed in every layer (their rows are
    missing), printed above the table (``NWRecorder.summary``).
    """

    empty_reason: str | None = None
    error: str | None = None

    def table(self, half: str | None = None) -> str:
        """The rows of one CFG half as an aligned text table: one line per (call,) step, the main
        statistics only, under a line saying what the numbers are and over a legend of the columns;
        the ``error`` line, if any, above it.

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
        calls = {r.get("call") for r in rows}
        columns = [
            c
            for c in _SUMMARY_COLUMNS
            if any(c[0] in r and r[c[0]] is not None for r in rows) and (c[0] != "call" or len(calls) > 1)
        ]
        cells = [[header for _, header, _ in columns]]
        for row in rows:
            line = []
            for key, _, fmt in columns:
                value = row.get(key)
                is_nan = value is None or (isinstance(value, float) and not math.isfinite(value))
                line.append("nan" if is_nan else fmt.format(value))
            cells.append(line)
        widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
        others = [h for h in halves if h != half]
        heading = f"{half} half: mean over layers, heads, adapters and images per step" + (
            f" (other halves: table(half={others[0]!r}))" if others else ""
        )
        body = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
        return "\n".join([heading, *body, _SUMMARY_LEGEND])

    def __repr__(self) -> str:
        return self.table()

    __str__ = __repr__


def _series(rows: Sequence[dict], key: str) -> Any:
    import numpy as np

    return np.array([np.nan if r.get(key) is None else float(r[key]) for r in rows], dtype=float)


_NULL_STYLES: dict[str, tuple[str, str, str]] = {
    "rho_perm_null": ("permutation null (keys shuffled)", "0.45", ":"),
    "rho_norm_matched_null": ("norm-matched null (random query directions)", "#ff7f0e", "--"),
    "rho_spread_null": ("q.k-spread null (key norms shuffled)", "#9467bd", "-."),
}
"""Label, colour and line style of each null of rho in the figures (THEORY.md section 4)."""

CONTROL_RHO = "rho_control"
_CONTROL_STYLE = ("rho, " + control_label(0).split(" (")[0], "0.1", "-")
"""rho of the same queries against the scale-matched control's keys (the draws' mean): drawn when it
was recorded, labelled :func:`~nw_adapter.integration.schema.control_label` with its draws."""


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


def unit_intervals(
    records: Sequence[dict], panel_key: str | None, *, half: str | None, stat: str = "rho"
) -> dict[tuple[Any, float], tuple[float, float, int]]:
    """Student t 95% interval of ``stat`` over the independent units, per (panel, timestep).

    Per unit (:func:`unit_key`), the mean over its layers and heads (:func:`aggregate`); then
    :func:`nw_adapter.core.intervals.t_interval` over the units of each (panel, step).

    Returns:
        ``{(panel, timestep): (low, high, n units)}``; empty with fewer than two units.
    """
    from nw_adapter.core.intervals import t_interval

    key = unit_key(records)
    if key is None:
        return {}
    by = (key, panel_key, "step") if panel_key else (key, "step")
    per_unit: dict[tuple[Any, float], list[float]] = {}
    for row in aggregate(records, by, half=half):
        value = row.get(stat)
        if value is not None and math.isfinite(value):
            panel = row[panel_key] if panel_key else None
            per_unit.setdefault((panel, float(row["timestep"])), []).append(float(value))
    out = {}
    for where, values in per_unit.items():
        if len(values) >= 2:
            _, low, high = t_interval(values)
            out[where] = (max(-1.0, low), min(1.0, high), len(values))  # rho lies in [-1, 1]
    return out


RHO_COLOR = "#1f77b4"
"""The colour of rho in every panel (the legend names it once)."""

RHO_BAND_LABEL = "rho: 95% t interval over {n} {unit}s"


def rho_figure(
    rows: Sequence[dict],
    *,
    panel_key: str | None = "block",
    title: str | None = None,
    note: str | None = None,
    units: Sequence[dict] | None = None,
    half: str | None = None,
):
    """rho against the timestep beside each of its three nulls, one panel per block (or one).

    Each null is its own named line (permutation, norm-matched, q.k-spread): a rho on or under
    any of them is not evidence of NW-like attention beyond what that null gives. When the rows
    hold ``rho_control`` (the scale-matched untrained-adapter control, the mean over its draws),
    it is drawn too: a rho on or under it is what the architecture gives at the trained keys'
    scale without adapter training. With the records of two or more
    independent units (``units``: reference images, or pipeline calls), rho carries its 95%
    Student t interval over the units as a band (:func:`unit_intervals`). Printed at a paper's
    width (7 in for three panels, 3.5 in for one) with 7-9 pt text; the legend is under the
    panels and names every line.

    Args:
        rows: :func:`aggregate` rows (``timestep``, ``rho`` and the nulls of
            :data:`~nw_adapter.integration.schema.NULL_STATS`), with ``panel_key`` among their keys.
        panel_key: the key whose values get a panel each (``"block"``: down, mid, up; the
            layers of SD3 / Flux transformers are one panel, "all IP layers"); None: one panel of
            every row, labelled by its ``half``.
        title: figure title. note: a line under it (e.g. why two steps share a timestep); both
            are wrapped to the figure's width.
        units: the records behind ``rows`` (with ``reference`` or ``call``), for the band.
        half: the CFG half of ``rows`` (the band's records are filtered to it).

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
    width = 7.0 if len(panels) > 1 else 3.5
    heading = "\n".join(t for t in (title, note) if t)
    heading = wrap_title(heading, width - 0.2, 8) if heading else ""
    lines = heading.count("\n") + 1 if heading else 0
    legend_rows = 6 if len(panels) == 1 else 3
    fig = Figure(figsize=(width, 2.5 + 0.14 * (lines + legend_rows)), layout="constrained")
    lowest = min(
        float(np.nanmin(_series(rows, key)))
        for key in ("rho", *NULL_STATS)
        if any(r.get(key) is not None for r in rows)
    )
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (name, panel_rows) in zip(axes, panels, strict=True):
        panel_rows = sorted(panel_rows, key=lambda r: -float(r["timestep"]))
        t = _series(panel_rows, "timestep")
        for stat in NULL_STATS:
            label, color, style = _NULL_STYLES[stat]
            ax.plot(t, _series(panel_rows, stat), color=color, linestyle=style, linewidth=1.0, label=label)
        if any(r.get(CONTROL_RHO) is not None for r in panel_rows):
            _, color, style = _CONTROL_STYLE
            label = "rho, " + control_label(max(int(r.get("control_draws") or 0) for r in rows))
            control = _series(panel_rows, CONTROL_RHO)
            ax.plot(t, control, color=color, linestyle=style, linewidth=1.0, label=label)
        panel = name if panel_key else None
        band = [bands.get((panel, float(x)), (math.nan, math.nan, 0)) for x in t]
        if any(n for *_, n in band):
            n_units = max(n for *_, n in band)
            ax.fill_between(
                t,
                [b[0] for b in band],
                [b[1] for b in band],
                color=RHO_COLOR,
                alpha=0.25,
                linewidth=0,
                label=RHO_BAND_LABEL.format(n=n_units, unit=unit),
            )
        ax.plot(
            t,
            _series(panel_rows, "rho"),
            marker="o",
            markersize=2,
            linewidth=1.4,
            color=RHO_COLOR,
            label="rho (attention vs NW)",
        )
        ax.axhline(0.0, color="0.3", linewidth=0.6)
        ax.set_xlim(max(1000.0, float(np.nanmax(t))), min(0.0, float(np.nanmin(t))))
        ax.set_xticks([1000, 500, 0])
        ax.set_ylim(max(-1.05, min(-0.2, lowest - 0.05)), 1.05)
        ax.set_xlabel("timestep (denoising \u2192)", fontsize=8)
        ax.set_title(_panel_title(name, panel_key), fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("Spearman rho", fontsize=8)
    handles, labels = axes[0].get_legend_handles_labels()
    first = [labels.index("rho (attention vs NW)")] + [
        i for i, s in enumerate(labels) if s.startswith(_CONTROL_STYLE[0]) or s.startswith("rho: 95%")
    ]
    order = first + [i for i, s in enumerate(labels) if "null" in s]
    fig.legend(
        [handles[i] for i in order],
        [labels[i] for i in order],
        loc="outside lower center",
        ncol=1 if len(panels) == 1 else 2,
        fontsize=7,
        frameon=False,
    )
    if heading:
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

    Example:
        >>> records = rec.records()          # NWRecorder.records()
        >>> records.summary()                # a table at the REPL
        >>> records.to_csv("records.csv"); records.plot(path="rho.png")
    """

    empty_reason: str | None = None

    def summary(self) -> Summary:
        """One row per (call, step, half): the means of :func:`aggregate` over layers, heads,
        adapters and images, with the step's timestep and noise level."""
        rows = aggregate(self, ("call", "step", "half"), step_columns=STEP_COLUMNS, optional_stats=True)
        summary = Summary(rows)
        summary.empty_reason = self.empty_reason
        return summary

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
        over them (:func:`rho_figure`). Unlike the command line it has no title: the run's
        model, steps and bandwidth are the caller's to state.

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
        fig = rho_figure(rows, panel_key=panel, units=self, half=half)
        if path is not None:
            save_figure(fig, path)
        return fig


def recorder_records(recorder: Any, key_set: str | None = "ip") -> Records:
    """The records of ``recorder`` (an :class:`~nw_adapter.integration.recorder.NWRecorder`) as
    :class:`Records`: its :meth:`~nw_adapter.integration.recorder.NWRecorder.to_records` of
    ``key_set``; empty ones say why when the recorder was told to record no statistics."""
    records = Records(recorder.to_records(key_set))
    config = recorder.config
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
