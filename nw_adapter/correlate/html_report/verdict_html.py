"""The verdict as HTML, read generically from the dict :func:`nw_adapter.correlate.verdict.verdict` returns.

Every clause the dict holds is shown with its status and a table of its parts (mean, 95% interval
(the equivalence test's 90%, said in its test column as the console's ``-v`` says it), p, n, margin
and every other field a part carries; a caveat, a sentence, under the table); any further list of
entries of a clause (``reported``, or anchors added in later versions) is a table of its own, and a
part's or entry's nested results (a dict holding ``mean`` / ``low`` / ``high``: e.g. the adapter,
the control and the exact head side by side) are columns side by side. Fields this module does not
know are shown, not dropped. The words are the console's (:data:`~nw_adapter.correlate.verdict.LEGEND`,
:data:`~nw_adapter.correlate.verdict.STATUS_WORDS`).

The anchors come first, under the conclusion: the calibrated table (one row per reading, the
adapter, the exact NW head and the control side by side: the verdict's ``readings``), the two
anchors' exponent and r2_nw, the adapter's position between them (``position``), and the exact
head's own verdict when a calibrated run measured it (``anchors.exact.verdict``: its conclusion and
its two clauses with their parts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nw_adapter.correlate.html_report.document import Markup, escape, number, table_html

__all__ = ["verdict_html"]

_PART_ORDER = (
    "label",
    "test",
    "mean",
    "interval",
    "p",
    "n",
    "draws",
    "margin",
    "significant",
    "measured",
    "theory",
    "reason",
)
_NOTES = ("caveat",)
"""Fields of a sentence or more: written under the table, one line per entry that has one, rather
than as a column that a sentence squeezes to a word a line (and pushes the table past the page)."""
_HIDDEN = {"key", "low", "high", "se", "dropped_references", "dropped_draws", "missing"}
_KNOWN_TOP = {
    "conclusion",
    "evidence",
    "images",
    "unit",
    "method",
    "alpha",
    "confidence",
    "half",
    "draws",
    "duplicates_merged",
    "merged",
    "per_image",
    "clauses",
    "skipped",
    "nonfinite",
    "power",
    "anchors",
    "position",
    "readings",
}


def _signed(value: Any) -> str:
    """A verdict number as the console prints it: signed, 3 decimals (``nan`` when missing)."""
    return "nan" if not isinstance(value, int | float) or isinstance(value, bool) else f"{value:+.3f}"


def _p(value: Any) -> str:
    """A p-value as the console prints it."""
    if not isinstance(value, int | float):
        return "n/a"
    return f"{value:.1e}" if value < 1e-3 else f"{value:.3f}"


def _interval(entry: Mapping[str, Any]) -> str:
    low, high = entry.get("low"), entry.get("high")
    if low is None or high is None:
        return "n/a"
    return f"[{_signed(low)}, {_signed(high)}]"


def _is_result(value: Any) -> bool:
    return isinstance(value, Mapping) and "mean" in value


def _result_cell(value: Mapping[str, Any]) -> str:
    p = f", p {_p(value['p'])}" if value.get("p") is not None else ""
    n = f", n {value['n']}" if value.get("n") is not None else ""
    return f"{_signed(value.get('mean'))} {_interval(value)}{p}{n}"


def _results(entry: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The nested results of an entry, by name: a field holding a result, or each result of a field
    that holds several (``{"adapter": {...}, "control": {...}, "exact_head": {...}}``)."""
    found: dict[str, Mapping[str, Any]] = {}
    for key, value in entry.items():
        if _is_result(value):
            found[key] = value
        elif isinstance(value, Mapping) and value and all(_is_result(v) for v in value.values()):
            found.update({str(name): result for name, result in value.items()})
    return found


def _entries_table(entries: Sequence[Mapping[str, Any]]) -> str:
    """A table of a clause's parts (or reported values, anchors ...): the known fields in the
    console's order and number formats, the nested results side by side (one column each), every
    other field after them."""
    from nw_adapter.correlate.verdict import EQUIVALENCE_LABEL, EQUIVALENCE_LEVEL

    entries = [e for e in entries if isinstance(e, Mapping)]
    if not entries:
        return ""
    nested: list[str] = []
    holders: set[str] = set()
    for entry in entries:
        for name in _results(entry):
            if name not in nested:
                nested.append(name)
        holders |= {k for k, v in entry.items() if isinstance(v, Mapping) and _results({k: v})}
    present = {k for e in entries for k in e} - holders - set(_NOTES)
    columns = [c for c in _PART_ORDER if c in present or (c == "interval" and "low" in present)]
    columns += sorted(k for k in present - set(columns) - _HIDDEN if k not in ("low", "high"))
    columns = [c for c in columns if c == "interval" or any(e.get(c) is not None for e in entries)]
    header = [c.replace("_", " ") for c in columns] + [
        f"{k.replace('_', ' ')}: mean [95% interval]" for k in nested
    ]
    rows = []
    for entry in entries:
        row: list[Any] = []
        for column in columns:
            value = entry.get(column)
            if column == "interval":
                row.append(_interval(entry))
            elif column == "test" and value == EQUIVALENCE_LABEL:
                # its decision reads the 90% interval (said in the wrapping text column, not widening
                # the interval's)
                row.append(f"{value}, its interval {EQUIVALENCE_LEVEL}")
            elif column in ("mean", "margin", "theory") and isinstance(value, int | float):
                row.append(_signed(value) if column == "mean" else f"{value:g}")
            elif column == "p":
                row.append(_p(value))
            elif column == "draws":
                row.append(value or "-")
            else:
                row.append(value if not isinstance(value, Mapping | list) else escape(value))
        results = _results(entry)
        row += [_result_cell(results[k]) if k in results else "-" for k in nested]
        rows.append(row)
    numeric = [c in ("mean", "interval", "p", "n", "margin", "theory") for c in columns] + [False] * len(
        nested
    )
    notes = [
        f'<p class="note">{escape(entry.get("label", ""))}: {name}: {escape(entry[name])}</p>'
        for entry in entries
        for name in _NOTES
        if entry.get(name)
    ]
    return table_html(header, rows, numeric=numeric) + "".join(notes)


def _status(clause: Mapping[str, Any], images: int) -> Markup:
    from nw_adapter.correlate.verdict import STATUS_WORDS

    holds = clause.get("holds")
    if holds is True:
        return Markup(f'<span class="status-met">{STATUS_WORDS[True]}</span>')
    if holds is False:
        return Markup(f'<span class="status-not-met">{STATUS_WORDS[False]}</span>')
    reason = clause.get("reason")
    words = "needs several reference images" if images < 2 and not reason else f"{STATUS_WORDS[None]}"
    if reason:
        words += f": {reason}"
    return Markup(f'<span class="status-other">{escape(words)}</span>')


def _plain(value: Any) -> str:
    """Any JSON value as HTML: a mapping as a two-column table, a list of mappings as a table."""
    if isinstance(value, Mapping):
        if all(_is_result(v) for v in value.values()) and value:  # results side by side
            return table_html(list(value), [[_result_cell(v) for v in value.values()]])
        return table_html(["field", "value"], [[str(k), Markup(_plain(v))] for k, v in value.items()])
    if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        return _entries_table(value)
    return number(value) if not isinstance(value, str) else escape(value)


def _clause_html(key: str, clause: Mapping[str, Any], images: int, level: int = 3) -> str:
    """One clause: its label and status, the table of its parts, and every further list or object it
    holds (``reported``: the values reported beside it, not tested)."""
    label = escape(clause.get("label", key))
    parts = [f'<h{level} data-clause="{escape(key)}">{label}: {_status(clause, images)}</h{level}>']
    if isinstance(clause.get("parts"), list):
        parts.append(_entries_table(clause["parts"]))
    for name, value in clause.items():
        if name in ("parts", "label", "short", "holds", "reason"):
            continue
        if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            title = "reported (not tested)" if name == "reported" else name.replace("_", " ")
            parts.append(f'<p class="note">{escape(title)}:</p>{_entries_table(value)}')
        elif isinstance(value, Mapping) and value:
            parts.append(f'<p class="note">{escape(name.replace("_", " "))}:</p>{_plain(value)}')
    return "".join(parts)


_ARMS = (("adapter", "adapter"), ("exact", "exact NW head"), ("control", "control"))
"""The calibrated table's columns: the verdict's ``readings`` field and its header (the console's)."""


def _shown(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, int | float) and not isinstance(value, bool) else "n/a"


def _anchors_html(result: Mapping[str, Any], images: int) -> str:
    """The adapter between its anchors: the calibrated table (the adapter, the exact NW head and the
    control side by side, one row per reading), the anchors' exponent and r2_nw, the adapter's
    position between them, and the exact head's own verdict (its conclusion, its two clauses). Empty
    for a verdict of an older version (no ``anchors`` nor ``readings``)."""
    from nw_adapter.correlate.verdict import reading_cell

    anchors = result.get("anchors") if isinstance(result.get("anchors"), Mapping) else {}
    rows = [  # the readings some arm measured
        r
        for r in result.get("readings") or []
        if isinstance(r, Mapping) and any(isinstance(r.get(key), Mapping) for key, _ in _ARMS)
    ]
    if not anchors and not rows:
        return ""
    exact = anchors.get("exact") or {}
    measured = exact.get("source") == "measured"
    title = "the adapter between its anchors: the control (0) and the exact NW head (1)"
    parts = [f'<div class="anchors" id="anchors"><h3>{escape(title)}</h3>']
    if rows:
        shown = [(key, name) for key, name in _ARMS if any(isinstance(r.get(key), Mapping) for r in rows)]
        if "adapter" not in dict(shown):
            shown.insert(0, ("adapter", "adapter"))
        parts.append(
            '<p class="note">'
            + ("calibrated readings" if measured else "readings")
            + " (mean over reference images [95% interval, cut to the reading's range]; the control: each "
            "image's mean over its draws; "
            "logit_scale and h_eff: geometric means):</p>"
        )
        body = [
            [r.get("label", r.get("key"))] + [reading_cell(r.get(key), str(r.get("key"))) for key, _ in shown]
            for r in rows
        ]
        table = table_html(
            ["reading", *(name for _, name in shown)], body, numeric=[False] + [True] * len(shown)
        )
        parts.append(table.replace('<div class="wide"><table>', '<div class="wide"><table id="readings">', 1))
    from nw_adapter.correlate.verdict import anchor_sentences

    sentences = anchor_sentences(result, unmeasured="the theory's values: not measured, run with --calibrate")
    for key, css, element in (("anchors", "note", "anchor-values"), ("position", "note", "position")):
        if key in sentences:
            parts.append(f'<p class="{css}" id="{element}">{escape(sentences[key])}</p>')
    own = exact.get("verdict")
    if "exact" in sentences:
        parts.append(
            f'<p class="verdict-line exact" id="exact-verdict-line">{escape(sentences["exact"])}</p>'
        )
        clauses = [
            _clause_html(key, clause, int(exact.get("images") or images), level=4)
            for key, clause in (own.get("clauses") or {}).items()
            if isinstance(clause, Mapping)
        ]
        parts.append(
            "<details open><summary>the exact head's conditions, part by part (judged as the adapter is)"
            f"</summary>{''.join(clauses)}</details>"
        )
    parts.append("</div>")
    return "".join(parts)


def verdict_html(result: Mapping[str, Any]) -> str:
    """The verdict: its conclusion line, the unit line, per clause its status and tables, the
    skipped values, the per-image values (folded), any other field, the method and the legend."""
    from nw_adapter.correlate.verdict import EQUIVALENCE_LEVEL, LEGEND

    images = int(result.get("images") or 0)
    parts = [f'<p class="verdict-line" id="verdict-line">verdict: {escape(result.get("conclusion", ""))}</p>']
    draws = result.get("draws") or 0
    merged = result.get("duplicates_merged") or 0
    parts.append(
        f'<p class="note">unit: {escape(result.get("unit", "reference image"))}, one seed each, n {images}'
        + (f" ({merged} of the same content merged: counted once)" if merged else "")
        + (f", {draws} control draws" if draws else "")
        + f"; mean [95% interval; the equivalence test's: {EQUIVALENCE_LEVEL}], one-sided, alpha "
        + f"{escape(result.get('alpha', 0.05))}</p>"
    )
    anchors = _anchors_html(result, images)
    parts.append(anchors)
    if anchors:
        parts.append("<h3>the trained adapter, clause by clause</h3>")
    for key, clause in (result.get("clauses") or {}).items():
        if isinstance(clause, Mapping):
            parts.append(_clause_html(key, clause, images))
    skipped = result.get("skipped") or {}
    if skipped:
        rows = [
            [
                column,
                entry.get("count"),
                "; ".join(f"{why}: {n}" for why, n in (entry.get("reasons") or {}).items()),
            ]
            for column, entry in skipped.items()
            if isinstance(entry, Mapping)
        ]
        parts.append('<p class="note">skipped (left out of the means):</p>')
        parts.append(table_html(["column", "values", "reasons"], rows, numeric=[False, True, False]))
    for name in sorted(set(result) - _KNOWN_TOP):  # fields of later versions: shown, not dropped
        parts.append(f"<h3>{escape(name.replace('_', ' '))}</h3>{_plain(result[name])}")
    per_image = result.get("per_image") or []
    if per_image:
        scalars = [k for k in per_image[0] if not isinstance(per_image[0][k], list | Mapping)]
        rows = [[row.get(k) for k in scalars] for row in per_image]
        parts.append(
            f"<details><summary>per reference image: every part's value ({len(per_image)} images)</summary>"
            f"{table_html(scalars, rows, numeric=[k != 'reference' for k in scalars])}</details>"
        )
    if result.get("method"):
        parts.append(f'<p class="note">method: {escape(result["method"])}</p>')
    legend = "".join(f"<li>{escape(entry)}</li>" for entry in LEGEND)
    parts.append(
        f'<details open><summary>legend of the verdict</summary><ul class="legend">{legend}</ul></details>'
    )
    return "".join(parts)
