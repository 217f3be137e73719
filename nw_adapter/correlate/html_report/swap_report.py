"""The report of a ``--compare-swap`` run: its conclusion, the per-rule table with every interval, and
per reference the stock, swap (one per rule) and new-seed images side by side with their numbers.

Read from ``compare_swap.json`` (schema ``nw-adapter/compare-swap``); the images come from the
comparison itself (:class:`~nw_adapter.analysis.consequence.SwapComparison`, kept at the report's
size by the command line): ``compare_swap.json`` holds no images, so a report rebuilt from the file
alone shows the numbers and says that the images were not kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nw_adapter.correlate.html_report.document import Markup, Report, config_rows, escape, number, table_html
from nw_adapter.correlate.html_report.images import read_image
from nw_adapter.correlate.html_report.rho_figures import dotted_line, lay_out
from nw_adapter.correlate.html_report.rho_report import gallery_html

__all__ = ["swap_report"]


def _cell(row: Mapping[str, Any], column: str) -> Markup:
    """``mean`` over ``[low, high]`` (the console's ``mean [low, high]``, in two lines so the table fits)."""
    mean, low, high = row.get(column), row.get(f"{column}_low"), row.get(f"{column}_high")
    if low is None or high is None:
        return Markup(f"{number(mean)}<br>[too few]" if (row.get("n") or 0) < 2 else number(mean))
    return Markup(f"{number(mean)}<br>[{number(low)}, {number(high)}]")


def _count(row: Mapping[str, Any], arm: str) -> str:
    low, high = row.get(f"{arm}_kept_low"), row.get(f"{arm}_kept_high")
    interval = f" [{low:.0%}, {high:.0%}]" if low is not None and high is not None else ""
    return f"{row.get(f'{arm}_kept')}/{row.get('n')}{interval}"


def _figure(document: Mapping[str, Any]):
    """Per rule, each reference's |swap-stock| against its |seed-stock|, with the diagonal (the swap
    moves the image as much as a new seed does): below it, less."""
    import plotly.graph_objects as go

    rows = document["per_reference"]
    names = {image.get("key"): Path(str(image.get("path", ""))).name for image in document.get("images", [])}
    fig = go.Figure()
    top = 0.0
    for rule in document["rules"]:
        mine = [r for r in rows if r["rule"] == rule and r.get("abs_diff") is not None]
        xs = [r["abs_diff_other_seed"] for r in mine]
        ys = [r["abs_diff"] for r in mine]
        top = max([top, *xs, *ys])
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="markers",
                name=f"rule {rule}",
                marker={"size": 8},
                customdata=[names.get(r.get("key"), r.get("key")) for r in mine],
                hovertemplate=f"rule {rule}<br>%{{customdata}}<br>|seed-stock| %{{x:.3f}}"
                "<br>|swap-stock| %{y:.3f}"
                "<extra></extra>",
            )
        )
    top = max(top * 1.05, 1e-3)
    fig.add_trace(dotted_line([0, top], [0, top], "swap moves it as much as a new seed", "#777"))
    return lay_out(
        fig,
        "per reference: the swap's change against a new seed's",
        height=420,
        bottom=110,
        xaxis={"title": "|seed-stock| (0-1)", "range": [0, top]},
        yaxis={"title": "|swap-stock| (0-1)", "range": [0, top]},
    )


def swap_report(document: Mapping[str, Any], comparison: Any = None, *, source: str | None = None) -> Report:
    """The :class:`Report` of a ``compare_swap.json`` document.

    Args:
        document: the document (:func:`nw_adapter.correlate.swap_files.build_document`).
        comparison: the :class:`~nw_adapter.analysis.consequence.SwapComparison` it was built from,
            with its images (``stock_images``, ``swap_images``, ``seed_images``), or None.
        source: where the document was read from (a line under the title).
    """
    from nw_adapter.analysis.consequence import HEADERS, KEEPS_LEGEND, LEGEND, SUMMARY_COLUMNS
    from nw_adapter.correlate.report import random_weights_note
    from nw_adapter.correlate.swap_files import comparison_of

    config = document.get("config") or {}
    images = document.get("images") or []
    model = (config.get("model") or {}).get("model")
    page = Report(
        title=f"compare-swap: {model}, {len(images)} references, "
        f"rules {', '.join(map(str, document['rules']))}",
        kind="compare-swap",
    )
    page.lines.append(
        f"stock against the exact NW head in every IP-Adapter layer; {config.get('steps')} steps "
        f"({config.get('scheduler_class', 'scheduler')}), guidance {config.get('guidance_scale')}, seed "
        f"{config.get('seed')} (reference i: seed + i; its new-seed control: seed + n + i)"
    )
    if source:
        page.lines.append(f"from {source}")
    warning = random_weights_note({"config": config})
    if warning:
        page.warnings.append(warning)
    restored = comparison_of(dict(document))
    section = page.section("Conclusion", "conclusion")
    section.parts.append(f'<p class="verdict-line" id="verdict-line">{escape(restored.conclusion())}.</p>')
    summary = document.get("summary") or restored.summary()
    judged = bool(summary) and "swap_kept" in summary[0]
    header = ["rule", "n", *(HEADERS[c] for c in SUMMARY_COLUMNS)]
    body = [[str(row["rule"]), row["n"], *(_cell(row, c) for c in SUMMARY_COLUMNS)] for row in summary]
    if judged:
        header += ["stock keeps class", "swap keeps class"]
        for cells, row in zip(body, summary, strict=True):
            cells += [_count(row, "stock"), _count(row, "swap")]
    section.parts.append(table_html(header, body, numeric=[False, True] + [True] * (len(header) - 2)))
    legend = [*LEGEND, KEEPS_LEGEND] if judged else list(LEGEND)
    section.parts.append('<ul class="legend">' + "".join(f"<li>{escape(x)}</li>" for x in legend) + "</ul>")
    section.parts.append(
        '<p class="note">mean [95% interval over references, inside the range the quantity can take; '
        "too few: "
        "under 2 references]; class agreement with Clopper-Pearson 95% intervals.</p>"
    )
    page.add_figure(
        page.section("Swap against a new seed", "figure"),
        _figure(document),
        "swap-figure",
        caption="x: |seed-stock|, the change a new seed makes; y: |swap-stock|, the change the NW head "
        "makes; one point per reference and rule (hover names the reference).",
    )

    section = page.section("Images per reference", "images")
    kept = comparison is not None and bool(getattr(comparison, "stock_images", None))
    if not kept:
        section.parts.append(
            '<p class="note">images not kept: compare_swap.json holds the numbers only (this report was '
            "rebuilt "
            "from the file); rerun the comparison into an empty --out for the images.</p>"
        )
    rows = document["per_reference"]
    for index, image in enumerate(images):
        name = Path(str(image.get("path", image.get("key")))).name
        mine = [r for r in rows if r.get("reference") == index]
        first = mine[0] if mine else {}
        section.parts.append(f"<h3>{escape(name)}</h3>")
        label = f", class {first['label']}" if first.get("label") is not None else ""
        reference = read_image(image["path"]) if image.get("path") else None
        arms: list[tuple[str, Any, Any, Any, Any]] = [  # (arm, image, |x - stock|, CLIP-I, judged)
            (
                "stock",
                comparison.stock_images[index] if kept else None,
                0.0,
                first.get("clip_i_stock"),
                first.get("stock_label"),
            ),
        ]
        for row in mine:
            picture = comparison.swap_images[row["rule"]][index] if kept else None
            arms.append(
                (
                    f"swap, rule {row['rule']}",
                    picture,
                    row.get("abs_diff"),
                    row.get("clip_i_swap"),
                    row.get("swap_label"),
                )
            )
        seeds = getattr(comparison, "seed_images", None) if kept else None
        arms.append(
            ("new seed", seeds[index] if seeds else None, first.get("abs_diff_other_seed"), None, None)
        )
        if kept:
            items = [("reference", reference, f"the IP-Adapter image{label}")]
            for arm, picture, difference, clip, judged in arms:
                caption = f"|x - stock| {number(difference)}" + (
                    f", CLIP-I {number(clip)}" if clip is not None else ""
                )
                items.append((arm, picture, caption + (f", judged {judged}" if judged is not None else "")))
            section.parts.append(gallery_html(items))
        else:
            section.parts.append(gallery_html([("reference", reference, f"the IP-Adapter image{label}")]))
            body = [
                [arm, difference, clip, "-" if judged is None else str(judged)]
                for arm, _, difference, clip, judged in arms
            ]
            section.parts.append(
                table_html(
                    ["generation", "|x - stock| (0-1)", "CLIP-I", "judged class"],
                    body,
                    numeric=[False, True, True, False],
                )
            )
    section = page.section("Run", "run")
    section.parts.append(table_html(["option", "value"], config_rows(config)))
    return page
