"""The report of a support-set run (``support.json`` and its ``sets/`` folder), in the console's words.

What ``support.json`` holds (:mod:`nw_adapter.correlate.support_report`), drawn:

- **Summary over sets**: the console's three tables per group of sets (m, classes), with its column
  labels and legend; per group, over denoising, the concentration on the leading reference and the
  entropy over references as a share of log m, the attention solid beside the theory's posterior over
  the references' latents dashed, 95% t bands over sets (``support_mass.png``'s figure);
- **x0 against the plug-in field**, where the run read it: per group the learned denoiser's x0
  estimate against the posterior's NW mean, ``||x0 - m_h|| / ||x0 - mean of the references||``, over
  the schedule's h (0: the model is the plug-in field; 1 by construction where the posterior is even);
- **Per set** (a menu): each reference's attention mass over the steps beside the latent posterior
  (THEORY.md 4b: ``w_i(x_t) = softmax_i(-||x_t - a_t s_i||^2 / 2 b_t^2)``, in the space of x_t), the
  entropy shares below (the posterior's n_eff on hover), the winners and the step from which each
  keeps the lead in the title; a table of every set's readings (the console's set lines);
- the references and the generation side by side (the images of the first :data:`SETS_SHOWN` sets).

No NW weights of the head's q/k space appear: at the data-space bandwidth they have no unit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nw_adapter.correlate.html_report.document import Markup, Report, config_rows, escape, number, table_html
from nw_adapter.correlate.html_report.images import read_image
from nw_adapter.correlate.html_report.rho_figures import dotted_line, dropdown, lay_out, whole_steps
from nw_adapter.correlate.html_report.rho_report import gallery_html

__all__ = ["SETS_SHOWN", "groups_figure", "sets_figure", "support_legend", "support_report", "x0_figure"]

SETS_SHOWN = 60
"""Most sets whose images the report embeds (every set's readings are in the figures and tables)."""

ARMS = (("mass", "attention mass", "solid"), ("posterior", "latent posterior (theory)", "dash"))
"""The two per-reference readings of a step: its key in ``support.json``, its name, its line."""

_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def support_legend() -> str:
    """The legend the console prints under the support-set tables (its last line)."""
    from nw_adapter.correlate.support_report import LEGEND

    return LEGEND


def _name(entry: Mapping[str, Any], r: int) -> str:
    file = entry["references"][r].get("file")
    return f"{r}: {Path(str(file)).name}" if file else f"reference {r}"


def _value(value: Any) -> float | None:
    """A JSON number for plotly: None for a missing or non-finite value, 5 decimals."""
    if value is None or not math.isfinite(float(value)):
        return None
    return round(float(value), 5)


def _entropy_share(step: Mapping[str, Any], key: str, m: int) -> float:
    """The entropy over references of ``key``'s arm as a share of log m: the attention's query-row
    entropy is stored in nats, the posterior's as a share."""
    value = step.get("ref_row_entropy" if key == "mass" else "posterior_entropy_share")
    if value is None or m < 2:
        return math.nan
    return float(value) / math.log(m) if key == "mass" else float(value)


def _has_posterior(entry: Mapping[str, Any]) -> bool:
    return any(s.get("posterior") is not None for s in entry.get("steps") or [])


def _winner_lines(entry: Mapping[str, Any]) -> list[str]:
    """The set's winners and the generated latent's nearest reference, in the console's set line's words."""
    if entry.get("winner") is None:
        lines = ["no attention winner (a tie at the last step)"]
    else:
        lines = [f"winner A {entry['winner']} from step {entry.get('decided_step')}"]
    if entry.get("posterior_winner") is not None:
        lines.append(f"posterior {entry['posterior_winner']} from step {entry.get('posterior_decided_step')}")
    if entry.get("final_nearest") is not None:
        lines.append(f"generated latent nearest {entry['final_nearest']}")
    return lines


def _winners(entry: Mapping[str, Any]) -> str:
    """:func:`_winner_lines` as one line."""
    return "; ".join(_winner_lines(entry))


def sets_figure(sets: Sequence[Mapping[str, Any]]):
    """Per set (a menu): each reference's share over the steps, the attention mass (solid) beside the
    latent posterior (dashed), one colour per reference, the even share 1/m dotted (top); the entropy
    over references as a share of log m, the attention's query rows (solid) and the posterior (dashed,
    n_eff on hover; bottom). The title names the set's winners (the console's set line)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.09,
        row_heights=[0.62, 0.38],
        subplot_titles=["share of each reference", "entropy over references / log m"],
    )
    groups: list[list[int]] = []
    for index, entry in enumerate(sets):
        steps, m = entry.get("steps") or [], int(entry["num_refs"])
        members: list[int] = []
        x = [int(s["step"]) for s in steps]
        custom = [[s.get("timestep"), s.get("h_schedule"), s.get("posterior_n_eff")] for s in steps]
        where = "step %{x} (t=%{customdata[0]:.0f}, h=%{customdata[1]:.3g})"
        arms = [arm for arm in ARMS if arm[0] == "mass" or _has_posterior(entry)]
        for key, arm, dash in arms:
            for r in range(m):
                members.append(len(fig.data))
                label = f"{_name(entry, r)}, {arm}"
                values = [_value((s.get(key) or [None] * m)[r]) for s in steps]
                fig.add_trace(
                    go.Scatter(
                        x=x,
                        y=values,
                        customdata=custom,
                        name=label,
                        legendgroup=f"{index}-{r}",
                        visible=index == 0,
                        mode="lines",
                        line={"color": _COLOURS[r % len(_COLOURS)], "dash": dash, "width": 1.8},
                        hovertemplate=f"{escape(label)}<br>{where}<br>share %{{y:.3f}}<extra></extra>",
                    ),
                    row=1,
                    col=1,
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
            ),
            row=1,
            col=1,
        )
        for key, arm, dash in arms:
            members.append(len(fig.data))
            label = f"entropy / log m, {arm}"
            extra = "<br>n_eff %{customdata[2]:.2f} of m" if key == "posterior" else ""
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=[_value(_entropy_share(s, key, m)) for s in steps],
                    customdata=custom,
                    name=label,
                    visible=index == 0,
                    mode="lines",
                    line={"color": "#444", "dash": dash, "width": 1.6},
                    hovertemplate=f"{label}<br>{where}<br>%{{y:.3f}}{extra}<extra></extra>",
                ),
                row=2,
                col=1,
            )
        groups.append(members)
    total = len(fig.data)
    titles = [
        f"{entry['key']} (m={entry['num_refs']}, {entry['classes']}): {_winners(entry)}" for entry in sets
    ]
    buttons = [
        {
            "label": f"{entry['key']} (m={entry['num_refs']})",
            "method": "update",
            "args": [{"visible": [i in set(members) for i in range(total)]}, {"title.text": escape(title)}],
        }
        for entry, members, title in zip(sets, groups, titles, strict=True)
    ]
    lay_out(
        fig,
        escape(titles[0]) if titles else "",
        height=620,
        legend={"y": -0.12, "orientation": "h"},
        bottom=150,
        top=110,
        title_size=13,
        title_y=0.98,
        updatemenus=[dropdown(buttons, 1.17, showactive=None)] if len(sets) > 1 else [],
    )
    last = max((int(s["step"]) for entry in sets for s in entry.get("steps") or []), default=0)
    fig.update_xaxes(**whole_steps(last))
    fig.update_xaxes(title_text="step (denoiser call)", row=2, col=1)
    fig.update_yaxes(range=[-0.02, 1.02])
    return fig


def _bands(fig: Any, x: list, matrix: np.ndarray, *, colour: str, dash: str, name: str, row: int,
           showlegend: bool, hover: str, share: bool = True, markers: bool = False) -> None:  # fmt: skip
    """Mean over sets (rows of ``matrix``) per column, with its 95% t band where two or more sets
    (``share``: clipped to [0, 1], as the console's table clips a share's interval)."""
    import plotly.graph_objects as go

    from nw_adapter.core.intervals import t_interval

    stats = np.array(
        [t_interval(c[np.isfinite(c)]) if np.isfinite(c).sum() else (math.nan,) * 3 for c in matrix.T]
    ).reshape(-1, 3)
    if share:
        stats[:, 1:] = np.clip(stats[:, 1:], 0.0, 1.0)
    if matrix.shape[0] >= 2:
        for column, fill in ((2, None), (1, "tonexty")):
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=[_value(v) for v in stats[:, column]],
                    mode="lines",
                    line={"width": 0},
                    fill=fill,
                    fillcolor=_fill(colour) if fill else None,
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
            y=[_value(v) for v in stats[:, 0]],
            mode="lines+markers" if markers else "lines",
            marker={"size": 4},
            name=name,
            legendgroup=name,
            showlegend=showlegend,
            line={"color": colour, "dash": dash, "width": 1.6},
            hovertemplate=f"{escape(name)}<br>{hover}<br>%{{y:.3f}}<extra></extra>",
        ),
        row=row,
        col=1,
    )


def _groups(sets: Sequence[Mapping[str, Any]]) -> dict[tuple[int, str], list[Mapping[str, Any]]]:
    groups: dict[tuple[int, str], list[Mapping[str, Any]]] = {}
    for entry in sets:
        if entry["num_refs"] >= 2 and entry.get("steps"):
            groups.setdefault((entry["num_refs"], entry["classes"]), []).append(entry)
    return dict(sorted(groups.items()))


def _group_label(m: int, classes: str, members: Sequence[Any]) -> str:
    return f"m={m}, {classes} ({len(members)} set{'s' if len(members) > 1 else ''})"


def groups_figure(sets: Sequence[Mapping[str, Any]]):
    """Per group of sets (m, classes), over denoising (progress: step / last step): the concentration
    on the leading reference, ``(max_r share_r - 1/m) / (1 - 1/m)``, and the entropy over references
    as a share of log m; the attention solid, the latent posterior dashed, 95% t bands over sets (the
    figure of ``support_mass.png``). None without a set of m >= 2."""
    from plotly.subplots import make_subplots

    from nw_adapter.correlate.support_report import concentration

    groups = _groups(sets)
    if not groups:
        return None
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=[
            "concentration (largest share - 1/m) / (1 - 1/m)",
            "entropy over references / log m (attention: its query rows)",
        ],
    )
    for g, ((m, classes), members) in enumerate(groups.items()):
        length = min(len(e["steps"]) for e in members)
        x = (np.arange(length) / max(length - 1, 1)).round(4).tolist()
        colour = _COLOURS[g % len(_COLOURS)]
        for key, arm, dash in ARMS:
            if key == "posterior" and not all(_has_posterior(e) for e in members):
                continue
            name = f"{_group_label(m, classes, members)}: {arm}"
            panels = (
                [[concentration(s.get(key) or [], m) for s in e["steps"][:length]] for e in members],
                [[_entropy_share(s, key, m) for s in e["steps"][:length]] for e in members],
            )
            for row, values in enumerate(panels, start=1):
                _bands(fig, x, np.array(values, dtype=float), colour=colour, dash=dash, name=name, row=row,
                       showlegend=row == 1, hover="progress %{x:.2f}")  # fmt: skip
    title = "per group of sets: mean over sets with 95% t bands (clipped to [0, 1])"
    lay_out(fig, title, height=640, legend={"y": -0.12}, bottom=140)
    fig.update_xaxes(title_text="denoising progress (step / last step)", row=2, col=1)
    fig.update_yaxes(range=[-0.05, 1.05])
    return fig


def x0_figure(sets: Sequence[Mapping[str, Any]]):
    """Per group of sets (m, classes): the learned x0 against the plug-in field's, ``||x0 - m_h|| /
    ||x0 - mean of the references||`` per step, over the schedule's h (log scale, reversed: denoising
    runs left to right), mean over sets with 95% t bands; 0 (the plug-in field) and 1 (the references'
    mean, where the posterior is even) marked. None where no set has the reading."""
    from plotly.subplots import make_subplots

    groups = {
        group: members
        for group, members in _groups(sets).items()
        if all(any(s.get("x0_nw_ratio") is not None for s in e["steps"]) for e in members)
    }
    if not groups:
        return None
    fig = make_subplots(rows=1, cols=1)
    lowest, highest = math.inf, 0.0
    for g, ((m, classes), members) in enumerate(groups.items()):
        length = min(len(e["steps"]) for e in members)
        h = np.array([[_number(s.get("h_schedule")) for s in e["steps"][:length]] for e in members], float)
        x = [
            _value(column[np.isfinite(column)].mean()) if np.isfinite(column).any() else None
            for column in h.T
        ]
        ratio = [[math.nan if s.get("x0_nw_ratio") is None else s["x0_nw_ratio"] for s in e["steps"][:length]]
                 for e in members]  # fmt: skip
        kept = [v for v in x if v is not None and v > 0]
        if kept:
            lowest, highest = min(lowest, min(kept)), max(highest, max(kept))
        _bands(fig, x, np.array(ratio, dtype=float), colour=_COLOURS[g % len(_COLOURS)], dash="solid",
               name=_group_label(m, classes, members), row=1, showlegend=True, hover="h %{x:.3g}",
               share=False, markers=True)  # fmt: skip
    if highest > 0:
        for level, name, colour in (
            (0.0, "0: the plug-in field (the posterior's NW mean)", "#d62728"),
            (1.0, "1: the references' mean (where the posterior is even)", "#777"),
        ):
            fig.add_trace(dotted_line([lowest, highest], [level, level], name, colour, 1.2))
    title = "the learned x0 against the plug-in field's: ||x0 - m_h|| / ||x0 - mean of the references||"
    lay_out(fig, title, legend={"y": -0.22}, bottom=140)
    ticks = [
        t for t in (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0) if lowest / 1.5 <= t <= highest * 1.5
    ]
    fig.update_xaxes(type="log", autorange="reversed", tickvals=ticks, ticktext=[f"{t:g}" for t in ticks],
                     title_text="h = b_t / a_t (noise level; denoising runs left to right)")  # fmt: skip
    fig.update_yaxes(title_text="||x0 - m_h|| / ||x0 - mean||", rangemode="tozero")
    return fig


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


def _fill(colour: str, alpha: float = 0.15) -> str:
    """``#rrggbb`` as a translucent ``rgba(...)`` (a band in its line's colour)."""
    red, green, blue = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({red},{green},{blue},{alpha})"


def _interval_cell(stat: Mapping[str, Any]) -> Any:
    """A mean and its interval as the console prints them (3 decimals)."""
    if stat.get("mean") is None:
        return "-"
    interval = f"<br>[{stat['low']:.3f}, {stat['high']:.3f}]" if stat.get("low") is not None else ""
    return Markup(f"{stat['mean']:.3f}{interval}")


def _count_cell(stat: Mapping[str, Any]) -> Any:
    if not stat.get("n"):
        return "-"
    p = stat.get("p_above_chance")
    interval = f"<br>[{stat['low']:.0%}, {stat['high']:.0%}]" if stat.get("low") is not None else ""
    return Markup(f"{stat['count']}/{stat['n']}{interval}" + ("" if p is None else f"<br>p {p:.2g}"))


def summary_tables(summary: Sequence[Mapping[str, Any]]) -> str:
    """The console's group tables (last step; decided; counts over sets), its titles and column labels,
    every mean with its 95% t interval and every count with its Clopper-Pearson 95% interval."""
    from nw_adapter.correlate.support_report import COUNT_LABELS, GROUP_COUNTS, TABLES

    parts = []
    groups = [[row["num_refs"], row["classes"], row["sets"]] for row in summary]
    for title, columns in TABLES:
        rows = [
            [*group, *(_interval_cell(row.get(name) or {}) for name, _ in columns)]
            for group, row in zip(groups, summary, strict=True)
        ]
        header = ["m", "classes", "sets", *(label for _, label in columns)]
        parts.append(
            f"<h3>{escape(title)}</h3>"
            + table_html(header, rows, numeric=[True, False, True] + [True] * len(columns))
        )
    rows = [
        [*group, *(_count_cell(row.get(name) or {}) for name in GROUP_COUNTS)]
        for group, row in zip(groups, summary, strict=True)
    ]
    header = ["m", "classes", "sets", *COUNT_LABELS]
    parts.append(
        "<h3>counts over sets</h3>" + table_html(header, rows, numeric=[True, False, True, *[True] * 4])
    )
    return "".join(parts)


def _shares(values: Sequence[Any] | None) -> str:
    """Per-reference values as the console's set line prints them (3 decimals; ``-`` for none)."""
    if not values:
        return "-"
    return "[" + ", ".join("nan" if v is None or not math.isfinite(v) else f"{v:.3f}" for v in values) + "]"


def sets_table(sets: Sequence[Mapping[str, Any]]) -> str:
    """Every set's readings, the console's set line as columns."""
    header = [
        "set", "m", "classes", "winner A (from step)", "posterior winner (from step)",
        "generated latent nearest [distances]", "CLIP-I per reference", "CLIP nearest",
        "last step A", "last step posterior", "classes refs -> generated",
    ]  # fmt: skip
    rows = []
    for e in sets:
        last = (e.get("steps") or [{}])[-1]
        shown = [r.get("label") if r.get("label") is not None else r.get("judged") for r in e["references"]]
        distances = ", ".join(f"{d:.2f}" for d in e.get("final_distances") or [])
        rows.append([
            Markup(f'<span class="key">{escape(e["key"])}</span>'), e["num_refs"], e["classes"],
            "-" if e.get("winner") is None else f"{e['winner']} (step {e.get('decided_step')})",
            "-" if e.get("posterior_winner") is None
            else f"{e['posterior_winner']} (step {e.get('posterior_decided_step')})",
            "-" if e.get("final_nearest") is None else f"{e['final_nearest']} [{distances}]",
            _shares([r.get("clip_cosine") for r in e["references"]]), e.get("clip_nearest"),
            _shares(last.get("mass")), _shares(last.get("posterior")),
            "-" if e.get("judged_generated") is None else f"{shown} -> {e['judged_generated']}",
        ])  # fmt: skip
    return table_html(header, rows, numeric=[False, True, False] + [False] * (len(header) - 3))


def _legend_html(entries: Mapping[str, str]) -> str:
    items = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in entries.items())
    return f'<dl class="legend">{items}</dl>'


def _cards(
    sets: Sequence[Mapping[str, Any]], out_dir: Path | None, pictures: Mapping[str, tuple[Sequence[Any], Any]]
) -> str:
    """Per set: its references (CLIP-I, class, latent distance to the generation) beside its generation
    (the winners, the nearest references, the judged class); ``pictures``: per set key, its references
    and generation in memory (a run from Python), else read from the files."""
    cards = []
    for entry in sets:
        shown_references, shown_generated = pictures.get(entry["key"], ((), None))
        items = []
        distances = entry.get("final_distances") or []
        for r, reference in enumerate(entry["references"]):
            label = reference.get("label") if reference.get("label") is not None else reference.get("judged")
            caption = [f"CLIP-I {number(reference.get('clip_cosine'))}"]
            if r < len(distances):
                caption.append(f"latent distance {distances[r]:.2f}")
            if label is not None:
                caption.append(f"class {label}")
            file = reference.get("file")
            picture = (
                shown_references[r] if r < len(shown_references) else (read_image(file) if file else None)
            )
            title = f"reference {r}: {Path(str(file)).name}" if file else f"reference {r}"
            items.append((title, picture, caption))
        generated = shown_generated
        if out_dir is not None and entry.get("generated"):
            generated = read_image(out_dir / entry["generated"])
        caption = ["one reference: no winner"] if entry["num_refs"] < 2 else _winner_lines(entry)
        if entry["num_refs"] < 2 and entry.get("final_nearest") is not None:
            caption.append(f"latent distance {distances[0]:.2f}")
        caption.append(f"CLIP-nearest {entry.get('clip_nearest')}")
        if entry.get("judged_generated") is not None:
            caption.append(f"judged class {entry['judged_generated']}")
        items.append(("generated", generated, caption))
        title = f"{escape(entry['key'])} (m={entry['num_refs']}, {escape(entry['classes'])})"
        cards.append(f'<div class="card support"><h4>{title}</h4>{gallery_html(items)}</div>')
    return f'<div class="cards">{"".join(cards)}</div>'


def support_report(
    document: Mapping[str, Any],
    out_dir: Path | None = None,
    *,
    source: str | None = None,
    pictures: Mapping[str, tuple[Sequence[Any], Any]] | None = None,
) -> Report:
    """The :class:`Report` of a ``support.json`` document; ``out_dir``: its folder (the generated
    images ``sets/<key>/generated.png``; the references are read from their own paths, where they
    still are); ``pictures``: per set key, its references and generation as images (PIL) where they
    are in memory (:func:`~nw_adapter.analysis.support_sets.observe_support_set`'s runs)."""
    from nw_adapter.correlate.report import random_weights_note
    from nw_adapter.correlate.support_report import HEADER, READINGS

    config = document.get("config") or {}
    sets = document.get("sets") or []
    model = (config.get("model") or {}).get("model")
    page = Report(
        title=f"support sets: {model}, {len(sets)} set{'s' if len(sets) != 1 else ''}", kind="support-sets"
    )
    ran = [
        f"{config['steps']} steps" if config.get("steps") is not None else None,
        f"({config['scheduler_class']})" if config.get("scheduler_class") else None,
        f"guidance {config['guidance_scale']}" if config.get("guidance_scale") is not None else None,
        f"seed {config['seed']}" if config.get("seed") is not None else None,
    ]
    page.lines.append(", ".join(part for part in ran if part).replace(", (", " ("))
    page.lines.append(HEADER)
    if config.get("posterior_space"):
        page.lines.append(f"posterior space: {config['posterior_space']}")
    if source:
        page.lines.append(f"from {source}")
    warning = random_weights_note({"config": config})
    if warning:
        page.warnings.append(warning)
    section = page.section("Summary over sets", "summary")
    section.parts.append(summary_tables(document.get("summary") or []))
    section.parts.append(f'<p class="note">{escape(support_legend())}</p>')
    figure = groups_figure(sets)
    if figure is not None:
        page.add_figure(
            section,
            figure,
            "support-groups",
            caption="attention mass solid, the latent posterior dashed; legend entries switch series on "
            "and off.",
        )
    drawn = [entry for entry in sets if entry.get("steps") and entry["num_refs"] >= 2]
    figure = x0_figure(drawn)
    if figure is not None:
        section = page.section("x0 against the plug-in field", "x0")
        page.add_figure(
            section,
            figure,
            "support-x0",
            caption=f"x0 / NW mean: {READINGS['x0 / NW mean']}; per step (a point per denoiser call: "
            "two calls at one timestep, as PNDM's, are two points at one h), mean over the group's sets "
            "with its 95% t band (the conditional half).",
        )
    section = page.section("Per set", "masses")
    if len(drawn) < len(sets):
        section.parts.append(
            f'<p class="note">{len(sets) - len(drawn)} set(s) of one reference: no shares to draw '
            "(the menu holds the others).</p>"
        )
    if drawn:
        page.add_figure(
            section,
            sets_figure(drawn),
            "support-masses",
            caption="x: step (denoiser call; timestep and h on hover). Top: each reference's attention mass "
            "(solid) beside the latent posterior w_i(x_t) (dashed). Bottom: their entropy over references "
            "as a share of log m (the posterior's n_eff on hover). The menu picks the set; the title "
            "names its winners.",
        )
    section.parts.append(sets_table(sets))
    section.parts.append(_legend_html(READINGS))
    section = page.section("References and generations", "images")
    section.parts.append(_cards(sets[:SETS_SHOWN], out_dir, pictures or {}))
    if len(sets) > SETS_SHOWN:
        section.parts.append(
            f'<p class="note">the images of the first {SETS_SHOWN} of {len(sets)} sets are shown '
            "(every set's generation is in sets/&lt;key&gt;/generated.png).</p>"
        )
    section = page.section("Run", "run")
    section.parts.append(table_html(["option", "value"], config_rows(config)))
    return page
