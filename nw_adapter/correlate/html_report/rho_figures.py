"""The interactive figures of a rho run: rho over denoising per block and per layer, the bandwidth path.

Each is a :class:`plotly.graph_objects.Figure` built from the records (the same aggregation as the
console table and ``rho.png``: :func:`nw_adapter.analysis.records.aggregate`, the band of
:func:`~nw_adapter.analysis.records.unit_intervals`, the line names of
:data:`~nw_adapter.analysis.records.NULL_STYLES`): values on hover, every series switched on and off
by a click on its legend entry (in every panel at once), the x axis the step (the denoiser call;
the timestep on hover), so PNDM's two calls at one timestep stay two points.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from nw_adapter.analysis import records as rec

__all__ = [
    "TEMPLATE",
    "bandwidth_figure",
    "dotted_line",
    "dropdown",
    "lay_out",
    "rho_blocks_figure",
    "rho_layers_figure",
    "whole_steps",
]

_DASH = {"-": "solid", ":": "dot", "--": "dash", "-.": "dashdot"}

TEMPLATE: dict[str, Any] = {
    "layout": {
        "font": {"family": "system-ui, sans-serif", "size": 12},
        "paper_bgcolor": "white",
        "plot_bgcolor": "white",
        "hovermode": "closest",
        "xaxis": {
            "showgrid": True,
            "gridcolor": "#e6e6e6",
            "linecolor": "#444",
            "mirror": True,
            "ticks": "outside",
        },
        "yaxis": {
            "showgrid": True,
            "gridcolor": "#e6e6e6",
            "linecolor": "#444",
            "mirror": True,
            "ticks": "outside",
        },
        "legend": {"orientation": "h", "yanchor": "top", "y": -0.18, "x": 0},
        "margin": {"l": 60, "r": 20, "t": 50, "b": 40},
    }
}
"""A small plotly template (plotly's default one adds ~10 kB of JSON to every figure)."""


def lay_out(
    fig: Any,
    title: str,
    *,
    height: int = 460,
    legend: dict[str, Any] | None = None,
    bottom: int = 120,
    top: int | None = None,
    title_size: int = 14,
    title_y: float | None = None,
    **layout: Any,
) -> Any:
    """The report's layout of a figure: :data:`TEMPLATE`, its title (``title_size`` px, at
    ``title_y``), the height, the legend's place (default below the plot) and the bottom (and top)
    margin; ``layout``: the figure's own further settings (axes, menus)."""
    heading: dict[str, Any] = {"text": title, "font": {"size": title_size}}
    if title_y is not None:
        heading["y"] = title_y
    margin = {"b": bottom} if top is None else {"b": bottom, "t": top}
    fig.update_layout(
        template=TEMPLATE, height=height, legend=legend or {"y": -0.2}, margin=margin, title=heading, **layout
    )
    return fig


def dropdown(buttons: list[dict[str, Any]], y: float, *, showactive: bool | None = True) -> dict[str, Any]:
    """A figure's menu (plotly's ``updatemenus`` entry): ``buttons`` in a drop-down at the top left,
    its top at ``y`` (in the plot's height)."""
    menu: dict[str, Any] = {"buttons": buttons, "direction": "down", "x": 0, "xanchor": "left", "y": y}
    menu["yanchor"] = "top"
    if showactive is not None:
        menu["showactive"] = showactive
    return menu


def dotted_line(x: Sequence[float], y: Sequence[float], name: str, color: str, width: float | None = None):
    """A reference line (a guide, a level, a diagonal): dotted, in the legend, without hover."""
    import plotly.graph_objects as go

    line: dict[str, Any] = {"color": color, "dash": "dot"}
    if width is not None:
        line["width"] = width
    return go.Scatter(x=list(x), y=list(y), mode="lines", name=name, line=line, hoverinfo="skip")


def colour(name: str) -> str:
    """A matplotlib colour (``"0.45"`` grey levels included) as CSS."""
    from matplotlib.colors import to_hex

    return to_hex(name)


def _series(rows: Sequence[dict], key: str) -> list[float | None]:
    out = []
    for row in rows:
        value = row.get(key)
        out.append(None if value is None or not math.isfinite(float(value)) else round(float(value), 5))
    return out


def _step_axis(rows: Sequence[dict]) -> tuple[list[int], list[float | None]]:
    return [int(r["step"]) for r in rows], _series(rows, "timestep")


def whole_steps(last: int) -> dict[str, Any]:
    """A step axis's ticks on whole steps, about 10 of them up to step ``last`` (plotly would put ticks
    at half steps on a short run)."""
    return {"dtick": max(1, math.ceil(last / 10))}


def _last_step(rows: Sequence[dict]) -> int:
    return max((int(r["step"]) for r in rows), default=0)


def _hover(name: str) -> str:
    return f"{name}<br>step %{{x}} (t=%{{customdata:.0f}})<br>%{{y:.3f}}<extra></extra>"


def _line_traces(rows: Sequence[dict], control: str | None, draws: int) -> list[tuple[str, dict[str, Any]]]:
    """``(series name, trace options)`` of rho, the control and the three nulls over ``rows`` (one panel)."""
    x, t = _step_axis(rows)
    traces = []
    for stat in rec.NULL_STATS:
        label, color, style = rec.NULL_STYLES[stat]
        line = {"color": colour(color), "dash": _DASH[style], "width": 1.4}
        options = {"x": x, "y": _series(rows, stat), "customdata": t, "line": line, "mode": "lines"}
        traces.append((label, {**options, "legendrank": 1010 + len(traces)}))
    if any(r.get(rec.CONTROL_RHO) is not None for r in rows):
        name = "rho, " + rec.control_name(control, draws)
        line = {"color": colour(rec.CONTROL_COLOR), "width": 1.4}
        options = {"x": x, "y": _series(rows, rec.CONTROL_RHO), "customdata": t, "line": line}
        traces.append((name, {**options, "legendrank": 1002}))
    line = {"color": rec.RHO_COLOR, "width": 2.2}
    traces.append(
        (
            rec.RHO_LABEL,
            {
                "x": x,
                "y": _series(rows, "rho"),
                "customdata": t,
                "line": line,
                "mode": "lines+markers",
                "marker": {"size": 4},
                "legendrank": 1000,
            },
        )
    )
    return traces


def rho_blocks_figure(records: Sequence[dict], half: str, *, control: str | None = None):
    """rho, its three nulls and the control over the steps, one panel per block (or one of all IP
    layers), means over layers, heads and units; the 95% t band over the units (two or more)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = rec.aggregate(records, ("block", "step"), half=half, optional_stats=True)
    names = [b for b in (*rec.BLOCKS, "other") if any(r.get("block") == b for r in rows)]
    titles = ["all IP layers" if n == "other" else f"{n} block" for n in names]
    fig = make_subplots(
        rows=1, cols=len(names), shared_yaxes=True, subplot_titles=titles, horizontal_spacing=0.03
    )
    bands = rec.unit_intervals(records, "block", half=half)
    unit = rec.unit_key(records)
    draws = max((int(r.get("control_draws") or 0) for r in rows), default=0)
    shown: set[str] = set()
    for col, name in enumerate(names, start=1):
        panel = sorted((r for r in rows if r.get("block") == name), key=lambda r: int(r["step"]))
        x, t = _step_axis(panel)
        band = [bands.get((name, s)) for s in x]
        if any(b is not None for b in band):
            n = max(b[2] for b in band if b is not None)
            label = rec.RHO_BAND_LABEL.format(n=n, unit=unit)
            high = [None if b is None else round(b[1], 5) for b in band]
            low = [None if b is None else round(b[0], 5) for b in band]
            common = {
                "legendgroup": label,
                "hoverinfo": "skip",
                "mode": "lines",
                "line": {"width": 0},
                "legendrank": 1001,
            }
            fig.add_trace(go.Scatter(x=x, y=high, showlegend=False, name=label, **common), row=1, col=col)
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=low,
                    fill="tonexty",
                    fillcolor="rgba(31,119,180,0.22)",
                    name=label,
                    showlegend=label not in shown,
                    **common,
                ),
                row=1,
                col=col,
            )
            shown.add(label)
            cuts = [(s, b[0], "triangle-down") for s, b in zip(x, band, strict=True) if b and b[3]]
            cuts += [(s, b[1], "triangle-up") for s, b in zip(x, band, strict=True) if b and b[4]]
            if cuts:
                fig.add_trace(
                    go.Scatter(
                        x=[c[0] for c in cuts],
                        y=[c[1] for c in cuts],
                        mode="markers",
                        name=rec.CUT_LABEL,
                        legendgroup=rec.CUT_LABEL,
                        showlegend=rec.CUT_LABEL not in shown,
                        marker={"symbol": [c[2] for c in cuts], "size": 7, "color": rec.RHO_COLOR},
                        legendrank=1003,
                        hovertemplate=f"{rec.CUT_LABEL}<br>step %{{x}}<extra></extra>",
                    ),
                    row=1,
                    col=col,
                )
                shown.add(rec.CUT_LABEL)
        for label, options in _line_traces(panel, control, draws):
            fig.add_trace(
                go.Scatter(
                    name=label,
                    legendgroup=label,
                    showlegend=label not in shown,
                    hovertemplate=_hover(label),
                    **options,
                ),
                row=1,
                col=col,
            )
            shown.add(label)
    title = "rho over denoising, per block (click a legend entry to hide or show it)"
    lay_out(fig, title, height=430, legend={"y": -0.22}, bottom=110)
    fig.update_xaxes(title_text="step (denoiser call)", row=1, col=(len(names) + 1) // 2)
    fig.update_xaxes(**whole_steps(_last_step(rows)))
    fig.update_yaxes(title_text="Spearman rho", row=1, col=1)
    return fig


def _short(layer: str) -> str:
    """A layer's name as the report shows it (without diffusers' ``.processor`` suffix)."""
    return layer.removesuffix(".processor")


def _layer_order(layer: str) -> tuple[int, str]:
    block = rec.block_of(layer)
    order = {b: i for i, b in enumerate((*rec.BLOCKS, "other"))}
    return order.get(block, len(order)), layer


def rho_layers_figure(records: Sequence[dict], half: str, *, control: str | None = None):
    """rho per layer over the steps (means over heads and units): a menu picks every layer's rho
    together, or one layer with its nulls and control."""
    import plotly.graph_objects as go

    rows = rec.aggregate(records, ("layer", "step"), half=half, optional_stats=True)
    layers = sorted({r["layer"] for r in rows}, key=_layer_order)
    draws = max((int(r.get("control_draws") or 0) for r in rows), default=0)
    fig = go.Figure()
    groups: list[list[int]] = []
    every = []
    for layer in layers:
        panel = sorted((r for r in rows if r["layer"] == layer), key=lambda r: int(r["step"]))
        x, t = _step_axis(panel)
        every.append(len(fig.data))
        fig.add_trace(
            go.Scatter(
                x=x,
                y=_series(panel, "rho"),
                customdata=t,
                name=_short(layer),
                mode="lines",
                hovertemplate=_hover(f"rho, {_short(layer)}"),
            )
        )
    groups.append(every)
    for layer in layers:
        panel = sorted((r for r in rows if r["layer"] == layer), key=lambda r: int(r["step"]))
        members = []
        for label, options in _line_traces(panel, control, draws):
            members.append(len(fig.data))
            fig.add_trace(
                go.Scatter(
                    name=label, hovertemplate=_hover(f"{label}, {_short(layer)}"), visible=False, **options
                )
            )
        groups.append(members)
    total = len(fig.data)
    buttons = []
    for index, (members, label) in enumerate(
        zip(groups, ["every layer's rho", *map(_short, layers)], strict=True)
    ):
        visible = [i in set(members) for i in range(total)]
        title = "rho of every IP layer" if index == 0 else f"layer {label}: rho, its nulls and the control"
        buttons.append(
            {"label": label, "method": "update", "args": [{"visible": visible}, {"title.text": title}]}
        )
    lay_out(
        fig,
        "rho of every IP layer",
        top=90,
        title_y=0.97,
        updatemenus=[dropdown(buttons, 1.13)],
        xaxis_title="step (denoiser call)",
        xaxis=whole_steps(_last_step(rows)),
        yaxis_title="Spearman rho",
    )
    return fig


def bandwidth_figure(records: Sequence[dict], half: str, *, control: str | None = None):
    """The bandwidth path: ``logit_scale`` (the RMS of the row-centred logits, the branch's inverse
    temperature) against the schedule's h per step, log-log; the lines of ``bandwidth.png``
    (:func:`nw_adapter.correlate.bandwidth_path.bandwidth_lines`): per step the geometric mean over
    units with its 95% t interval, for the adapter, the control (the mean over its draws, its scale
    matched once per run as the verdict reads it) and, in a calibrated run, the exact NW head measured
    in the same pipeline; and the line of exponent 2 (an exact NW head, ``logit_scale = c / h^2``).
    The exponent in each legend entry is ``-d log logit_scale / d log h`` (theory 2), the verdict's.

    Returns:
        The figure, or None when no step has a positive ``logit_scale`` and h.
    """
    import plotly.graph_objects as go

    from nw_adapter.correlate.bandwidth_path import ARMS, bandwidth_lines, guide
    from nw_adapter.integration.schema import control_draws

    lines = bandwidth_lines(records, half)
    if not lines or lines[0].arm != "adapter":
        return None
    draws = control_draws({name for r in records for name in r})
    symbols = {"adapter": "circle", "control": "square", "exact": "triangle-up"}
    names = {"adapter": "adapter", "control": rec.control_name(control, draws), "exact": ARMS["exact"][0]}
    fig = go.Figure()
    seen: list[float] = []
    for line in lines:
        label, color = names[line.arm], ARMS[line.arm][1]
        ys, lows, highs = line.mean, line.low, line.high
        seen += ys + [v for v in (*lows, *highs) if math.isfinite(v)]
        exponent = "" if line.exponent is None else f", exponent {line.exponent:+.3f}"
        error = None
        if line.units >= 2:
            error = {
                "type": "data",
                "symmetric": False,
                "array": [round(hi - y, 6) for hi, y in zip(highs, ys, strict=True)],
                "arrayminus": [round(y - lo, 6) for lo, y in zip(lows, ys, strict=True)],
                "thickness": 1,
                "width": 2,
            }
        fig.add_trace(
            go.Scatter(
                x=[round(h, 6) for h in line.h],
                y=[round(y, 6) for y in ys],
                customdata=line.steps,
                error_y=error,
                mode="lines+markers",
                name=f"{label}: {line.units} units{exponent}",
                marker={"color": color, "symbol": symbols[line.arm], "size": 6},
                line={"color": color, "width": 1.4},
                hovertemplate=f"{label}<br>step %{{customdata}}<br>h %{{x:.4g}}"
                "<br>logit_scale %{y:.4g}<extra></extra>",
            )
        )
    xs, ys = guide(lines[0])
    name = "exponent 2: an exact NW head (c / h^2)"
    fig.add_trace(dotted_line([round(x, 6) for x in xs], [round(y, 6) for y in ys], name, "#555"))
    return lay_out(
        fig,
        "bandwidth path: logit_scale against the schedule's h (log-log)",
        xaxis={"type": "log", "title": "schedule bandwidth h = sigma_t / alpha_t"},
        yaxis={"type": "log", "title": "logit_scale (RMS of row-centred logits)", "range": _log_range(seen)},
    )


def _log_range(values: Sequence[float]) -> list[float]:
    """A log axis' range (decades) around the data, padded 0.3 decades each way and at least one decade
    wide: the exponent-2 line runs through it, not the other way round."""
    logs = np.log10([v for v in values if v > 0 and math.isfinite(v)])
    low, high = float(logs.min()) - 0.3, float(logs.max()) + 0.3
    if high - low < 1.0:
        middle = (low + high) / 2
        low, high = middle - 0.5, middle + 0.5
    return [low, high]
