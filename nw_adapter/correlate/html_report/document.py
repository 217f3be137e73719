"""One self-contained HTML page: sections of text, tables and plotly figures, plotly.js inline once.

A :class:`Report` is built section by section (:meth:`Report.add`) and written as one file that opens
offline in any browser: no server, no network, no file beside it. The interactive figures are
plotly's (its Python package writes each figure as a JSON spec and one ``Plotly.newPlot`` call;
its JavaScript library, plotly.js, is embedded once in the page's head: 4.8 MB for plotly 7.1's
plotly.js 4.1, the bulk of every report). Images are embedded as data URIs. In Jupyter the report
displays inline (:meth:`Report._repr_html_`: the page in an ``<iframe srcdoc>``, so its style and
scripts stay inside it).

plotly is imported only inside functions, so ``import nw_adapter`` and the command line's
``--help`` never load it.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nw_adapter.atomic import atomic_write_text

__all__ = [
    "FIGURE_CONFIG",
    "REPORT_NAME",
    "Report",
    "Section",
    "config_rows",
    "escape",
    "number",
    "table_html",
]

REPORT_NAME = "report.html"
"""The report's file name in every run's ``--out``."""

FIGURE_CONFIG: dict[str, Any] = {
    "displaylogo": False,
    "responsive": True,
    "toImageButtonOptions": {"scale": 2},
}
"""plotly's per-figure options: no plotly logo in the mode bar; figures follow the page's width."""

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0 auto;
       max-width: 1180px; padding: 0 18px 40px; color: #1d1d1f; line-height: 1.45; }
header { border-bottom: 1px solid #ddd; padding: 14px 0 8px; }
h1 { font-size: 1.45em; margin: 0 0 4px; }
h2 { font-size: 1.2em; margin: 28px 0 6px; border-bottom: 1px solid #eee; padding-bottom: 3px; }
h3 { font-size: 1.02em; margin: 18px 0 4px; }
p.sub, p.note { margin: 2px 0; color: #444; }
p.warning { margin: 6px 0; padding: 6px 10px; background: #fff4e5; border-left: 4px solid #f0a030; }
nav { font-size: 0.92em; margin: 8px 0; }
nav a { margin-right: 14px; }
div.wide { overflow-x: auto; }
table { border-collapse: collapse; margin: 6px 0 10px; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f5f5f7; font-weight: 600; }
span.key { white-space: nowrap; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.verdict-line { font-size: 1.08em; font-weight: 600; margin: 8px 0; padding: 8px 12px;
                background: #f0f4fa; border-left: 4px solid #1f77b4; }
.verdict-line.exact { font-size: 1em; background: #f0f8f1; border-left-color: #2ca02c; }
div.anchors { border-left: 3px solid #e3e3e3; padding-left: 12px; margin: 10px 0 18px; }
.status-met { color: #17803d; font-weight: 600; }
.status-not-met { color: #b42318; font-weight: 600; }
.status-other { color: #6b6b6b; font-weight: 600; }
.legend dt { font-weight: 600; font-family: ui-monospace, monospace; }
.legend dd { margin: 0 0 4px 18px; }
.gallery { display: flex; flex-wrap: wrap; gap: 14px; margin: 8px 0 14px; }
.gallery figure { margin: 0; text-align: center; font-size: 0.8em; width: 146px; }
.gallery img { width: 128px; height: auto; image-rendering: pixelated; border: 1px solid #ccc; }
.gallery figcaption { margin-top: 3px; }
.cards { display: flex; flex-wrap: wrap; gap: 10px 18px; }
.card { border: 1px solid #e3e3e3; border-radius: 4px; padding: 4px 8px; }
.card h4 { margin: 2px 0; font-size: 0.9em; }
.card .gallery { margin: 4px 0; gap: 8px; }
.card.support .gallery figure:last-child { width: 196px; }
details { margin: 6px 0; }
summary { cursor: pointer; }
pre { background: #f7f7f7; padding: 8px; overflow-x: auto; font-size: 0.85em; }
"""


def escape(value: Any) -> str:
    """``value`` as HTML text (``&``, ``<``, ``>`` and quotes escaped)."""
    return html.escape(str(value), quote=True)


def number(value: Any, digits: int = 3) -> str:
    """A number as a table cell prints it: ``digits`` decimals (``-`` for None, ``nan`` for NaN)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan"
        if value != 0 and abs(value) < 10 ** (-digits):
            return f"{value:.2e}"
        return f"{value:.{digits}f}"
    return escape(value)


def table_html(
    header: Sequence[str], rows: Sequence[Sequence[Any]], *, numeric: Sequence[bool] | None = None
) -> str:
    """An HTML table: ``header`` cells (HTML-escaped) over ``rows`` of cells (numbers formatted by
    :func:`number`; strings escaped unless they are :class:`Markup`)."""
    numeric = numeric or [False] * len(header)
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = []
        for cell, is_number in zip(row, numeric, strict=False):
            text = (
                cell
                if isinstance(cell, Markup)
                else number(cell)
                if not isinstance(cell, str)
                else escape(cell)
            )
            cells.append(f'<td class="num">{text}</td>' if is_number else f"<td>{text}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return (
        f'<div class="wide"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'
    )


def config_rows(config: Any, prefix: str = "") -> list[list[str]]:
    """A run's options as ``[name, value]`` rows, nested objects flattened to ``parent.child`` names."""
    rows: list[list[str]] = []
    for key, value in (config or {}).items():
        if isinstance(value, dict):
            rows += config_rows(value, f"{prefix}{key}.")
        else:
            rows.append([f"{prefix}{key}", "null" if value is None else str(value)])
    return rows


class Markup(str):
    """A string that is already HTML (a table cell that holds markup is not escaped again)."""


@dataclass
class Section:
    """One part of the page: a heading (with an anchor for the table of contents) and its HTML."""

    title: str
    anchor: str
    parts: list[str] = field(default_factory=list)


@dataclass
class Report:
    """A self-contained interactive report: sections of HTML and plotly figures.

    Attributes:
        title: the page's title and first heading.
        lines: lines under the title (the run: model, steps, references, control).
        warnings: lines shown highlighted under them (e.g. a random-weight model's warning).
        kind: what the report is of: ``"rho"``, ``"compare-swap"``, ``"support-sets"``.
        sections: the sections, in page order.
        notes: what was left out to bound the size, and why (shown under the title).
        figures: the number of plotly figures added.
        attributes: ``data-*`` attributes of the page's ``<html>`` element (e.g. the digest of the
            document a report was made from).

    Example:
        >>> page = nw_adapter.report("out_tiny")   # doctest: +SKIP
        >>> page                                    # inline in Jupyter  # doctest: +SKIP
        >>> page.save("out_tiny/report.html")       # doctest: +SKIP
    """

    title: str
    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    kind: str = "rho"
    sections: list[Section] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    figures: int = 0
    attributes: dict[str, str] = field(default_factory=dict)
    _figure_ids: set[str] = field(default_factory=set, repr=False)

    def section(self, title: str, anchor: str) -> Section:
        """Start a section (appended to the page) and return it."""
        section = Section(title, anchor)
        self.sections.append(section)
        return section

    def add_figure(self, section: Section, figure: Any, div_id: str, *, caption: str | None = None) -> None:
        """Append a plotly figure to ``section`` (its JSON spec and one ``Plotly.newPlot`` call;
        plotly.js itself is in the page's head once)."""
        import plotly.io as pio

        taken = {s.anchor for s in self.sections} | self._figure_ids
        if div_id in taken:
            raise ValueError(
                f"report: the id {div_id!r} is taken (a section's or another figure's); pass another"
            )
        self._figure_ids.add(div_id)
        section.parts.append(
            pio.to_html(figure, include_plotlyjs=False, full_html=False, div_id=div_id, config=FIGURE_CONFIG)
        )
        if caption:
            section.parts.append(f'<p class="note">{escape(caption)}</p>')
        self.figures += 1

    def to_html(self) -> str:
        """The whole page: one HTML document, plotly.js inline, no external resource."""
        from plotly.offline import get_plotlyjs

        extra = "".join(f' {escape(k)}="{escape(v)}"' for k, v in self.attributes.items())
        toc = " ".join(f'<a href="#{escape(s.anchor)}">{escape(s.title)}</a>' for s in self.sections)
        head = [f"<h1>{escape(self.title)}</h1>"]
        head += [f'<p class="sub">{escape(line)}</p>' for line in self.lines]
        head += [f'<p class="warning">{escape(line)}</p>' for line in self.warnings]
        head += [f'<p class="note">{escape(line)}</p>' for line in self.notes]
        body = [f'<header data-report-kind="{escape(self.kind)}">{"".join(head)}<nav>{toc}</nav></header>']
        for s in self.sections:
            body.append(
                f'<section id="{escape(s.anchor)}"><h2>{escape(s.title)}</h2>{"".join(s.parts)}</section>'
            )
        return (
            f'<!DOCTYPE html>\n<html lang="en"{extra}>\n<head>\n<meta charset="utf-8">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{escape(self.title)}</title>\n<style>{STYLE}</style>\n"
            f'<script type="text/javascript">{get_plotlyjs()}</script>\n</head>\n<body>\n'
            + "\n".join(body)
            + "\n</body>\n</html>\n"
        )

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_html` to ``path`` atomically (a temporary file, then a rename) and return it."""
        return atomic_write_text(path, self.to_html())

    def _repr_html_(self) -> str:
        """Jupyter's inline display: the page in an ``<iframe srcdoc>`` (its own style and scripts)."""
        return (
            f'<iframe srcdoc="{html.escape(self.to_html(), quote=True)}" '
            'style="width: 100%; height: 900px; border: 1px solid #ddd;" sandbox="allow-scripts"></iframe>'
        )

    def __repr__(self) -> str:
        names = ", ".join(s.title for s in self.sections)
        return f"Report({self.title!r}, kind={self.kind!r}, sections=[{names}], figures={self.figures})"
