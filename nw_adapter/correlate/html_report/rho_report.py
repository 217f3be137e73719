"""The report of a rho run (``rho.json`` and its folder, or a recorder's records in a notebook).

Sections: the verdict with every part's interval; rho, its nulls and the control over denoising,
per block and per layer; the bandwidth path; with stored maps, the heat maps per reference with a
step slider and a layer / head / token menu; the references beside their generations; the step
table with the console's legend of every column; the run's options and versions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from nw_adapter.analysis import records as rec
from nw_adapter.correlate.html_report.document import Report, config_rows, escape, table_html
from nw_adapter.correlate.html_report.images import data_uri
from nw_adapter.correlate.html_report.maps_figure import ReferenceMaps, maps_figure, plan_maps, scales
from nw_adapter.correlate.html_report.rho_figures import (
    bandwidth_figure,
    rho_blocks_figure,
    rho_layers_figure,
)
from nw_adapter.correlate.html_report.verdict_html import verdict_html

__all__ = ["AXES_LEGEND", "calibration_line", "gallery_html", "rho_report"]

AXES_LEGEND: dict[str, str] = {
    "step (x axis)": "the denoiser call (0 = the first); PNDM's two calls at one timestep are two steps, "
    "never pooled; the timestep t is on hover",
    "Spearman rho (y axis)": rec.COLUMN_LEGEND["rho"],
    "band": "rho's 95% Student t interval over the independent units (reference images; pipeline calls in "
    "a notebook), with two or more; cut at rho's range [-1, 1] and marked there",
    "schedule bandwidth h": "sigma_t / alpha_t of the step (the bandwidth of an exact NW head at that step)",
    "logit_scale": "RMS of the row-centred attention logits: the branch's effective inverse temperature "
    "(an exact NW head: c / h^2, exponent 2; a fixed temperature: exponent 0)",
    "A, W, A - W": "attention A and NW weights W on one image token at every query position of the latent "
    "grid, and their difference; white is the even share 1/tokens (A, W) or 0 (A - W)",
}
"""The legend of the report's axes and map panels (the columns' words are
:data:`~nw_adapter.analysis.records.COLUMN_LEGEND`, the console's)."""


def calibration_line(calibration: Mapping[str, Any]) -> str:
    """The header line of a calibrated run (``rho.json``'s ``config["calibration"]``)."""
    c = calibration.get("schedule_c", 1.0)
    return (
        f"calibrated: the {calibration.get('kind', 'exact NW head')} at the schedule's h = {c:g} sigma_t / "
        "alpha_t swapped into every recorded layer, a second generation per reference with the same seed "
        "and noise, read by the same instrument (its columns {stat}_exact)"
    )


def gallery_html(items: Sequence[tuple[str, Any, str | Sequence[str]]]) -> str:
    """A row of images with captions: ``(title, PIL image or None, caption)`` each (a missing image is
    left out, its caption kept; a caption given as lines is shown one line each)."""
    figures = []
    for title, image, caption in items:
        body = f'<img alt="{escape(title)}" src="{data_uri(image)}">' if image is not None else ""
        lines = [caption] if isinstance(caption, str) else list(caption)
        text = "<br>".join(escape(line) for line in lines)
        figures.append(f"<figure>{body}<figcaption><b>{escape(title)}</b><br>{text}</figcaption></figure>")
    return f'<div class="gallery">{"".join(figures)}</div>'


def _legend_html(entries: Mapping[str, str]) -> str:
    items = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in entries.items())
    return f'<dl class="legend">{items}</dl>'


def _steps_table(rows: Sequence[dict]) -> str:
    """Every step in the console table's columns and number formats
    (:data:`~nw_adapter.analysis.records.TABLE_COLUMNS`)."""
    columns = rec.shown_columns(rows)
    body = []
    for row in rows:
        cells: list[Any] = []
        for key, _, fmt in columns:
            value = row.get(key)
            present = value is not None and not (isinstance(value, float) and math.isnan(value))
            cells.append(fmt.format(int(value) if "d" in fmt else value).strip() if present else "nan")
        body.append(cells)
    return table_html([h for _, h, _ in columns], body, numeric=[True] * len(columns))


def rho_report(
    report: Mapping[str, Any],
    *,
    maps: Sequence[ReferenceMaps] = (),
    pictures: Sequence[tuple[str, Any, Any]] = (),
    title: str | None = None,
    source: str | None = None,
) -> Report:
    """The :class:`Report` of a rho run.

    Args:
        report: the ``rho.json`` document (:func:`nw_adapter.correlate.report.build_report`).
        maps: per reference, its stored maps (with ``--store-maps``).
        pictures: per reference ``(name, reference image or None, generated image or None)``.
        title: the page's title (default: the command line's ``rho.png`` title).
        source: where the report was read from (a line under the title).
    """
    from nw_adapter.correlate.report import (
        control_kind_and_draws,
        random_weights_note,
        repeated_timestep_note,
    )

    config = report.get("config") or {}
    records = report["records"]
    half = report["half"]
    kind, draws = control_kind_and_draws(dict(report))
    by_reference = all("reference" in r for r in records)
    noun = "reference" if by_reference else "pipeline call"
    references = len(report.get("images") or []) or len(
        {r.get("reference" if by_reference else "call") for r in records}
    )
    model = (
        (config.get("model") or {}).get("model")
        if isinstance(config.get("model"), Mapping)
        else config.get("model")
    )
    page = Report(
        title=title
        or rec.figure_title(model, config.get("steps"), config.get("bandwidth"), references, noun),
        kind="rho",
    )
    scheduler = config.get("scheduler_class")
    page.lines.append(
        f"{half} half; mode {config.get('mode', 'observe')}"
        + (f"; scheduler {scheduler}" if scheduler else "")
        + (f"; prompt {config['prompt']!r}" if config.get("prompt") is not None else "")
        + (f"; seed {config['seed']}" if config.get("seed") is not None else "")
    )
    page.lines.append(rec.control_line(kind, draws))
    calibration = config.get("calibration")
    if isinstance(calibration, Mapping):
        page.lines.append(calibration_line(calibration))
    note = repeated_timestep_note(dict(report))
    if note:
        page.lines.append(f"note: {note}")
    if source:
        page.lines.append(f"from {source}")
    warning = random_weights_note(dict(report))
    if warning:
        page.warnings.append(warning)

    section = page.section("Verdict", "verdict")
    section.parts.append(verdict_html(report["verdict"]))

    section = page.section("rho over denoising", "rho")
    page.add_figure(
        section,
        rho_blocks_figure(records, half, control=kind),
        "rho-blocks",
        caption="x: step (denoiser call; its timestep on hover); y: Spearman rho of attention vs NW "
        "weights, mean over layers, heads and units; legend entries switch series on and off.",
    )
    page.add_figure(
        section,
        rho_layers_figure(records, half, control=kind),
        "rho-layers",
        caption="The menu picks every layer's rho, or one layer with its nulls and control "
        "(means over heads and units).",
    )

    bandwidth = bandwidth_figure(records, half, control=kind)
    if bandwidth is not None:
        section = page.section("Bandwidth path", "bandwidth")
        page.add_figure(
            section,
            bandwidth,
            "bandwidth-path",
            caption="Per step, the geometric mean over units with its 95% t interval; the exponent is "
            "-d log logit_scale / d log h (2 for an exact NW head, 0 for a fixed temperature)"
            + (
                "; the exact NW head's line is measured in the same pipeline (--calibrate)."
                if isinstance(calibration, Mapping)
                else "."
            ),
        )

    stored = [m for m in maps if m.steps()]
    if stored:
        page.notes += plan_maps(stored)
        spread, diff, uniform = scales(stored)
        section = page.section("Attention maps", "maps")
        section.parts.append(
            '<p class="note">Per reference: the menu picks the layers, heads and image token; the slider '
            "picks the step. One colour scale for every A and W panel (white: the even share 1/tokens), "
            "one for every A - W (white: 0), the same across references, steps and choices; set by the "
            "maps of every layer's mean (a single layer beyond it saturates the colour; hover for the "
            "values).</p>"
        )
        for index, reference in enumerate(stored):
            figure = maps_figure(reference, spread=spread, diff_spread=diff, uniform=uniform)
            section.parts.append(f"<h3>{escape(reference.name)}</h3>")
            if figure is None:
                section.parts.append(
                    '<p class="note">maps not embedded (the report\'s size cap); see its '
                    "maps.safetensors and attention_maps.png</p>"
                )
                continue
            page.add_figure(section, figure, f"maps-{index}")

    if pictures:
        section = page.section("References and generations", "images")
        cards = []
        for name, reference, generated in pictures:
            pair = gallery_html(
                [("reference", reference, "the IP-Adapter image"), ("generated", generated, "")]
            )
            cards.append(f'<div class="card"><h4>{escape(name)}</h4>{pair}</div>')
        section.parts.append(f'<div class="cards">{"".join(cards)}</div>')
        if any(reference is None for _, reference, _ in pictures):
            section.parts.append(
                '<p class="note">a reference without its image: its file is no longer where the run read it '
                "(rho.json's images[].path).</p>"
            )

    section = page.section("Step table and legend", "table")
    steps = report.get("steps") or []
    section.parts.append(
        f'<p class="note">{escape(rec.LEGEND_HEADING)} every step of the {escape(half)} half '
        "(the console prints the steps nearest the paper's timesteps):</p>"
    )
    section.parts.append(_steps_table(steps))
    words = {header: rec.COLUMN_LEGEND[key] for key, header, _ in rec.shown_columns(steps)}
    section.parts.append(_legend_html({**words, **AXES_LEGEND}))

    section = page.section("Run", "run")
    section.parts.append(table_html(["option", "value"], config_rows(config)))
    if report.get("control"):
        section.parts.append(table_html(["control", "value"], config_rows(report["control"])))
    versions = report.get("versions") or {}
    if versions:
        rows = [[k, str(v)] for k, v in versions.items()]
        section.parts.append(
            f"<details><summary>versions</summary>{table_html(['package', 'version'], rows)}</details>"
        )
    nonfinite = sum(sum((row.get("nonfinite") or {}).values()) for row in steps)
    if nonfinite:
        section.parts.append(
            f'<p class="note">{nonfinite} values were left out of the step means as NaN '
            "(rho.json's nonfinite counts them per statistic).</p>"
        )
    return page
