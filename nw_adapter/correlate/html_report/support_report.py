"""The report of a support-set run (``support.json`` and its ``sets/`` folder).

Per set: each reference's attention mass over denoising beside the theory's prediction (the NW
weights at the schedule's h) and beside any other per-reference column the file holds (a later
version's posterior, for example: every list of m values per step is drawn), a menu over the sets;
the references and the generation side by side with their CLIP-I and classes; per group of sets the
summary table (the console's, with its legend) and the concentration and row entropy over denoising
with 95% t bands over sets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nw_adapter.correlate.html_report.document import Markup, Report, config_rows, escape, number, table_html
from nw_adapter.correlate.html_report.images import read_image
from nw_adapter.correlate.html_report.rho_figures import TEMPLATE
from nw_adapter.correlate.html_report.rho_report import gallery_html

__all__ = ["SETS_SHOWN", "support_report"]

SETS_SHOWN = 60
"""Most sets whose images the report embeds (every set's masses are in the figure and tables)."""

SERIES_NAMES = {"mass": "attention", "mass_nw": "NW at the schedule's h (theory)"}
"""How the per-reference columns of a step are named (others by their key)."""

_DASHES = ("solid", "dash", "dot", "dashdot", "longdash")
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def per_reference_columns(steps: Sequence[Mapping[str, Any]], m: int) -> list[str]:
    """The keys of a set's step entries that hold one value per reference (``mass``, ``mass_nw``
    first, then any other, sorted)."""
    keys = {k for s in steps for k, v in s.items() if isinstance(v, list) and len(v) == m}
    return [k for k in ("mass", "mass_nw") if k in keys] + sorted(keys - {"mass", "mass_nw"})


def _name(entry: Mapping[str, Any], r: int) -> str:
    return f"{r}: {Path(str(entry['references'][r].get('file', r))).name}"


def masses_figure(sets: Sequence[Mapping[str, Any]]):
    """Each reference's mass per step: attention (solid), NW at the schedule's h (dashed), any other
    per-reference column (dotted ...); one colour per reference; a menu picks the set."""
    import plotly.graph_objects as go

    fig = go.Figure()
    groups: list[list[int]] = []
    for index, entry in enumerate(sets):
        steps, m = entry.get("steps") or [], int(entry["num_refs"])
        members = []
        x = [int(s["step"]) for s in steps]
        custom = [[s.get("timestep"), s.get("h_schedule")] for s in steps]
        for c, key in enumerate(per_reference_columns(steps, m)):
            for r in range(m):
                members.append(len(fig.data))
                label = f"{_name(entry, r)}, {SERIES_NAMES.get(key, key)}"
                values = [
                    None if s[key][r] is None or not math.isfinite(s[key][r]) else round(s[key][r], 5)
                    for s in steps
                ]
                fig.add_trace(
                    go.Scatter(
                        x=x,
                        y=values,
                        customdata=custom,
                        name=label,
                        visible=index == 0,
                        mode="lines",
                        line={
                            "color": _COLOURS[r % len(_COLOURS)],
                            "dash": _DASHES[c % len(_DASHES)],
                            "width": 1.6,
                        },
                        hovertemplate=f"{escape(label)}<br>step %{{x}} "
                        "(t=%{customdata[0]:.0f}, h=%{customdata[1]:.3g})"
                        "<br>mass %{y:.3f}<extra></extra>",
                    )
                )
        members.append(len(fig.data))
        fig.add_trace(
            go.Scatter(
                x=[min(x, default=0), max(x, default=0)],
                y=[1 / m, 1 / m],
                mode="lines",
                name=f"1/m = {1 / m:.3g} (an even share)",
                visible=index == 0,
                line={"color": "#999", "dash": "dot", "width": 1},
                hoverinfo="skip",
            )
        )
        groups.append(members)
    total = len(fig.data)
    buttons = [
        {
            "label": f"{entry['key']} (m={entry['num_refs']})",
            "method": "update",
            "args": [{"visible": [i in set(members) for i in range(total)]}],
        }
        for entry, members in zip(sets, groups, strict=True)
    ]
    fig.update_layout(
        template=TEMPLATE,
        height=460,
        legend={"y": -0.2},
        margin={"b": 140, "t": 90},
        title={"text": "mass on each reference over denoising", "font": {"size": 14}, "y": 0.97},
        xaxis_title="step (denoiser call)",
        yaxis={"title": "mass on the reference", "range": [-0.02, 1.02]},
        updatemenus=[
            {"buttons": buttons, "direction": "down", "x": 0, "xanchor": "left", "y": 1.15, "yanchor": "top"}
        ]
        if len(sets) > 1
        else [],
    )
    return fig


def groups_figure(sets: Sequence[Mapping[str, Any]]):
    """Per group of sets (m, classes): the concentration (max_r mass_r - 1/m) / (1 - 1/m) and the row
    entropy over references as a share of log m, over denoising (progress: step / last step), the
    attention solid, NW dashed, with 95% t bands over sets; None without a set of m >= 2."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from nw_adapter.core.intervals import t_interval
    from nw_adapter.correlate.support_report import concentration

    groups: dict[tuple[int, str], list[Mapping[str, Any]]] = {}
    for entry in sets:
        if entry["num_refs"] >= 2 and entry.get("steps"):
            groups.setdefault((entry["num_refs"], entry["classes"]), []).append(entry)
    if not groups:
        return None
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=["concentration (max mass - 1/m) / (1 - 1/m)", "row entropy / log m"],
    )
    for g, ((m, classes), members) in enumerate(sorted(groups.items())):
        length = min(len(e["steps"]) for e in members)
        x = (np.arange(length) / max(length - 1, 1)).round(4).tolist()
        colour = _COLOURS[g % len(_COLOURS)]
        label = f"m={m}, {classes} ({len(members)} set{'s' if len(members) > 1 else ''})"
        for key, dash, arm in (("mass", "solid", "attention"), ("mass_nw", "dash", "NW")):
            entropy = "ref_row_entropy" if key == "mass" else "ref_row_entropy_nw"
            panels = (
                [[concentration(s[key], m) for s in e["steps"][:length]] for e in members],
                [
                    [
                        (s.get(entropy) if s.get(entropy) is not None else math.nan) / math.log(m)
                        for s in e["steps"][:length]
                    ]
                    for e in members
                ],
            )
            for row, values in enumerate(panels, start=1):
                matrix = np.array(values, dtype=float)
                stats = np.array(
                    [
                        t_interval(c[np.isfinite(c)]) if np.isfinite(c).sum() else (math.nan,) * 3
                        for c in matrix.T
                    ]
                )
                name = f"{label}: {arm}"
                if matrix.shape[0] >= 2:
                    fig.add_trace(
                        go.Scatter(
                            x=x,
                            y=np.round(stats[:, 2], 5).tolist(),
                            mode="lines",
                            line={"width": 0},
                            legendgroup=name,
                            showlegend=False,
                            hoverinfo="skip",
                        ),
                        row=row,
                        col=1,
                    )
                    fig.add_trace(
                        go.Scatter(
                            x=x,
                            y=np.round(stats[:, 1], 5).tolist(),
                            mode="lines",
                            line={"width": 0},
                            fill="tonexty",
                            fillcolor=_fill(colour),
                            legendgroup=name,
                            showlegend=False,
                            hoverinfo="skip",
                        ),
                        row=row,
                        col=1,
                    )
                fig.add_trace(
                    go.Scatter(
                        x=x,
                        y=np.round(stats[:, 0], 5).tolist(),
                        mode="lines",
                        name=name,
                        legendgroup=name,
                        showlegend=row == 1,
                        line={"color": colour, "dash": dash, "width": 1.6},
                        hovertemplate=f"{name}<br>progress %{{x:.2f}}<br>%{{y:.3f}}<extra></extra>",
                    ),
                    row=row,
                    col=1,
                )
    fig.update_layout(
        template=TEMPLATE,
        height=620,
        legend={"y": -0.12},
        margin={"b": 130},
        title={"text": "per group of sets, mean over sets with 95% t bands", "font": {"size": 14}},
    )
    fig.update_xaxes(title_text="denoising progress (step / last step)", row=2, col=1)
    fig.update_yaxes(range=[-0.05, 1.05])
    return fig


def _fill(colour: str, alpha: float = 0.15) -> str:
    """``#rrggbb`` as a translucent ``rgba(...)`` (a band in its line's colour)."""
    red, green, blue = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({red},{green},{blue},{alpha})"


def _summary_table(summary: Sequence[Mapping[str, Any]]) -> str:
    from nw_adapter.correlate.support_report import GROUP_COUNTS, GROUP_FIELDS

    header = [
        "m",
        "classes",
        "sets",
        *(f.replace("_", " ") for f in GROUP_FIELDS),
        *(c.replace("_", " ") for c in GROUP_COUNTS),
    ]
    rows = []
    for row in summary:
        cells: list[Any] = [row["num_refs"], row["classes"], row["sets"]]
        for name in GROUP_FIELDS:
            stat = row.get(name) or {}
            interval = (
                f"<br>[{number(stat['low'])}, {number(stat['high'])}]" if stat.get("low") is not None else ""
            )
            cells.append(Markup(f"{number(stat.get('mean'))}{interval}"))
        for name in GROUP_COUNTS:
            stat = row.get(name) or {}
            if not stat.get("n"):
                cells.append("-")
                continue
            p = stat.get("p_above_chance")
            interval = f"<br>[{stat['low']:.0%}, {stat['high']:.0%}]" if stat.get("low") is not None else ""
            cells.append(
                Markup(f"{stat['count']}/{stat['n']}{interval}" + ("" if p is None else f"<br>p {p:.2g}"))
            )
        rows.append(cells)
    return table_html(header, rows, numeric=[True, False, True] + [True] * (len(header) - 3))


def support_legend() -> str:
    """The legend the console prints under the support-set table (the last line of its report)."""
    from nw_adapter.correlate.support_report import format_document

    return format_document({"sets": [], "summary": []}).splitlines()[-1]


def support_report(
    document: Mapping[str, Any], out_dir: Path | None = None, *, source: str | None = None
) -> Report:
    """The :class:`Report` of a ``support.json`` document; ``out_dir``: its folder (the generated
    images ``sets/<key>/generated.png``; the references are read from their own paths, where they
    still are)."""
    from nw_adapter.correlate.report import random_weights_note

    config = document.get("config") or {}
    sets = document.get("sets") or []
    model = (config.get("model") or {}).get("model")
    page = Report(
        title=f"support sets: {model}, {len(sets)} set{'s' if len(sets) != 1 else ''}", kind="support-sets"
    )
    page.lines.append(
        f"{config.get('steps')} steps ({config.get('scheduler_class', 'scheduler')}), guidance "
        f"{config.get('guidance_scale')}, seed {config.get('seed')}; NW columns at "
        f"{config.get('bandwidth_of_nw_columns', 'the schedule h')}"
    )
    if source:
        page.lines.append(f"from {source}")
    warning = random_weights_note({"config": config})
    if warning:
        page.warnings.append(warning)
    section = page.section("Summary over sets", "summary")
    section.parts.append(_summary_table(document.get("summary") or []))
    section.parts.append(f'<p class="note">{escape(support_legend())}</p>')
    figure = groups_figure(sets)
    if figure is not None:
        page.add_figure(section, figure, "support-groups")
    section = page.section("Mass per reference", "masses")
    drawn = [entry for entry in sets if entry.get("steps") and entry["num_refs"] >= 2]
    if len(drawn) < len(sets):
        section.parts.append(
            f'<p class="note">{len(sets) - len(drawn)} set(s) of one reference: no masses to share '
            "(the menu holds the others).</p>"
        )
    if drawn:
        page.add_figure(
            section,
            masses_figure(drawn),
            "support-masses",
            caption="x: step (denoiser call; timestep and h on hover); y: the attention mass on each "
            "reference (solid) and the NW weights' at the schedule's h, the theory's prediction (dashed); "
            "the menu picks the set.",
        )
    section = page.section("References and generations", "images")
    cards = []
    for entry in sets[:SETS_SHOWN]:
        items = []
        for r, reference in enumerate(entry["references"]):
            label = reference.get("label") if reference.get("label") is not None else reference.get("judged")
            caption = f"CLIP-I {number(reference.get('clip_cosine'))}" + (
                f", class {label}" if label is not None else ""
            )
            picture = read_image(reference["file"]) if reference.get("file") else None
            items.append((f"reference {_name(entry, r)}", picture, caption))
        generated = None
        if out_dir is not None and entry.get("generated"):
            generated = read_image(out_dir / entry["generated"])
        if entry.get("winner") is None:
            caption = "one reference: no winner" if entry["num_refs"] < 2 else "no winner (a tie at the end)"
        else:
            caption = (
                f"attention's winner {entry['winner']} from step {entry.get('decided_step')}, "
                f"NW's {entry.get('winner_nw')}"
            )
        caption += f"; CLIP-nearest {entry.get('clip_nearest')}"
        if entry.get("judged_generated") is not None:
            caption += f", judged {entry['judged_generated']}"
        items.append(("generated", generated, caption))
        title = f"{escape(entry['key'])} (m={entry['num_refs']}, {escape(entry['classes'])})"
        cards.append(f'<div class="card"><h4>{title}</h4>{gallery_html(items)}</div>')
    section.parts.append(f'<div class="cards">{"".join(cards)}</div>')
    if len(sets) > SETS_SHOWN:
        section.parts.append(
            f'<p class="note">the images of the first {SETS_SHOWN} of {len(sets)} sets are shown '
            "(every set's generation is in sets/&lt;key&gt;/generated.png).</p>"
        )
    section = page.section("Run", "run")
    section.parts.append(table_html(["option", "value"], config_rows(config)))
    return page
