"""Heat maps of the stored attention (A) and NW (W) maps over the x0 estimates, with a step slider.

One figure per reference image: four panels side by side, the x0 estimate of the step (what the
model predicted at that step; the generated image where none was stored), then A, W and A - W of one
image token drawn over it in grey. A menu picks the (layer, head, image token) shown; a slider picks
the step. A and W share one diverging colour scale centred on the even share 1/tokens, A - W one
centred on 0, each the same for every step, layer, head and token of the report (so any two views
compare) and each with its labelled colour bar.

Only plotly's own menus and sliders (no hand-written JavaScript): each (layer, head, token) choice
has its own step slider, and the menu shows that choice's slider and its first step; a slider step
sets the three maps' values and shows that step's image. A choice's data are embedded once.

Size bound (:data:`MAP_VALUES_CAP`): maps are pooled to :data:`~nw_adapter.correlate.html_report.
images.MAP_GRID_CAP` per side, at most :data:`TOKEN_CAP` tokens (the most attended) and
:data:`HEAD_CAP` single heads are offered, and the choices are added in the order (every layer's
mean, per block, per layer, per head), reference after reference, until the report holds
:data:`MAP_VALUES_CAP` values; what was left out is named in the report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nw_adapter.correlate.html_report.images import data_uri, grey, pool_to_cap, thumbnail
from nw_adapter.correlate.html_report.rho_figures import dropdown

__all__ = [
    "HEAD_CAP",
    "MAP_VALUES_CAP",
    "TOKEN_CAP",
    "MapChoice",
    "ReferenceMaps",
    "maps_figure",
    "plan_maps",
]

MAP_VALUES_CAP = 400_000
"""Most map values a report embeds (over every reference, step, choice and map kind): about 3.5 MB of
JSON text at 5 decimals."""

TOKEN_CAP = 16
"""Most image tokens offered per reference (the most attended over the stored steps)."""

HEAD_CAP = 8
"""Most single heads offered (maps stored per head, ``map_head_mean=False``), after the heads' mean."""


@dataclass
class MapChoice:
    """One entry of the menu: which layers and heads are averaged, which token is shown."""

    label: str
    layers: tuple[str, ...] | None  # layer-name prefixes; None: every stored layer
    heads: tuple[int, ...] | None  # head positions; None: every stored head
    token: int


@dataclass
class ReferenceMaps:
    """What one reference's maps figure is drawn from.

    Attributes:
        name: the reference's name (key).
        maps: ``{name: [batch rows, heads, query positions, tokens]}`` (a ``maps.safetensors``).
        timesteps: step -> timestep.
        image_hw: the generated image's ``(height, width)``.
        batch_row: the conditional row (-1 under CFG).
        generated: the generated image (PIL) or None.
        previews: step -> x0 estimate (PIL).
        choices: the menu (:func:`plan_maps`).
    """

    name: str
    maps: Mapping[str, Any]
    timesteps: Mapping[int, float]
    image_hw: tuple[int, int]
    batch_row: int = -1
    generated: Any = None
    previews: Mapping[int, Any] = field(default_factory=dict)
    choices: list[MapChoice] = field(default_factory=list)
    _grids: dict[tuple, np.ndarray] = field(default_factory=dict, repr=False)

    def steps(self) -> list[int]:
        from nw_adapter.analysis.heatmaps import select_maps

        return sorted(
            {k.step for k in select_maps(self.maps, "attn")} & {k.step for k in select_maps(self.maps, "nw")}
        )

    def grid(self, kind: str, step: int, choice: MapChoice) -> np.ndarray:
        """``[tokens, h, w]`` of ``kind`` at ``step`` for ``choice``'s layers and heads, pooled to the cap."""
        from nw_adapter.analysis.heatmaps import token_maps

        key = (kind, step, choice.layers, choice.heads)
        if key not in self._grids:
            maps = token_maps(
                self.maps,
                kind,
                image_hw=self.image_hw,
                steps=[step],
                layers=choice.layers,
                heads=choice.heads,
                batch_row=self.batch_row,
            )
            self._grids[key] = pool_to_cap(np.asarray(maps, dtype=np.float64))
        return self._grids[key]


def _candidates(reference: ReferenceMaps) -> list[list[MapChoice]]:
    """The menu's choices in tiers of priority: every layer's mean, per block, per layer, per head."""
    from nw_adapter.analysis.heatmaps import select_maps, token_maps

    keys = select_maps(reference.maps, "attn")
    layers = sorted({k.layer for k in keys})
    heads = next(iter(keys.values())).shape[1] if keys else 1
    overall = token_maps(reference.maps, "attn", image_hw=reference.image_hw, batch_row=reference.batch_row)
    order = [int(k) for k in np.argsort(-overall.mean(axis=(1, 2)), kind="stable")][:TOKEN_CAP]
    count = overall.shape[0]
    blocks = sorted({layer.split(".")[0] for layer in layers})
    tiers: list[list[MapChoice]] = [
        [
            MapChoice(f"mean of {len(layers)} layers, mean of heads, token {t} of {count}", None, None, t)
            for t in order
        ]
    ]
    if len(blocks) > 1:
        tiers.append(
            [MapChoice(f"{b}, mean of heads, token {t}", (b,), None, t) for b in blocks for t in order]
        )
    if len(layers) > 1:
        tiers.append(
            [
                MapChoice(f"{layer}, mean of heads, token {t}", (layer,), None, t)
                for layer in layers
                for t in order
            ]
        )
    if heads > 1:
        tiers.append(
            [
                MapChoice(f"mean of layers, head {h}, token {t}", None, (h,), t)
                for h in range(min(heads, HEAD_CAP))
                for t in order
            ]
        )
    return tiers


def plan_maps(references: Sequence[ReferenceMaps], cap: int = MAP_VALUES_CAP) -> list[str]:
    """Fill each reference's :attr:`ReferenceMaps.choices` tier by tier (within a tier, every
    reference's first choice, then every reference's second, ...) until ``cap`` values; returns the
    notes on what was left out (empty when nothing was)."""
    tiers = {id(r): _candidates(r) for r in references}
    sizes = {}
    for reference in references:
        steps = reference.steps()
        if steps:
            cells = reference.grid("attn", steps[0], tiers[id(reference)][0][0])[0].size
            sizes[id(reference)] = 3 * len(steps) * cells  # A, W and A - W per step
    used, left_out = 0, []
    depth = max((len(t) for t in tiers.values()), default=0)
    for tier in range(depth):  # tier by tier; within a tier choice by choice, reference after reference
        offered = [(r, tiers[id(r)][tier]) for r in references if tier < len(tiers[id(r)]) and id(r) in sizes]
        for index in range(max((len(choices) for _, choices in offered), default=0)):
            for reference, choices in offered:
                if index >= len(choices):
                    continue
                if used + sizes[id(reference)] > cap:
                    left_out.append(reference.name)
                    continue
                reference.choices.append(choices[index])
                used += sizes[id(reference)]
    notes = []
    if left_out:
        names = sorted(set(left_out))
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        notes.append(
            f"maps: some layer / head / token choices of {shown} are not embedded (the report holds at most "
            f"{cap:,} map values); every stored map is in images/<key>/maps.safetensors"
        )
    return notes


def _rounded(grid: np.ndarray) -> list:
    return np.where(np.isfinite(grid), np.round(grid, 5), None).tolist()


def maps_figure(reference: ReferenceMaps, *, spread: float, diff_spread: float, uniform: float):
    """The figure of one reference (see the module docstring); None when it has no choice.

    Args:
        spread: half-width of the A / W colour scale around ``uniform`` (the report's largest deviation).
        diff_spread: half-width of the A - W scale around 0.
        uniform: 1 / tokens, the even share (the white of the A / W scale).
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    steps = reference.steps()
    if not reference.choices or not steps:
        return None
    first = reference.grid("attn", steps[0], reference.choices[0])
    gh, gw = first.shape[1:]
    titles = ["x0 estimate", "A: attention on the token", "W: NW weights on the token", "A - W"]
    fig = make_subplots(rows=1, cols=4, subplot_titles=titles, horizontal_spacing=0.035)
    data: dict[int, list[list[list]]] = {}  # choice -> per step [A, W, D]
    for c, choice in enumerate(reference.choices):
        per_step = []
        for step in steps:
            attn = reference.grid("attn", step, choice)[choice.token]
            nw = reference.grid("nw", step, choice)[choice.token]
            per_step.append([_rounded(attn), _rounded(nw), _rounded(attn - nw)])
        data[c] = per_step
    hover = "{}<br>column %{{x}}, row %{{y}}<br>%{{z:.4f}}<extra></extra>"
    for col, (name, axis) in enumerate(
        (("A", "coloraxis"), ("W", "coloraxis"), ("A - W", "coloraxis2")), start=2
    ):
        fig.add_trace(
            go.Heatmap(
                z=data[0][0][col - 2],
                coloraxis=axis,
                opacity=0.7,
                name=name,
                hovertemplate=hover.format(name),
            ),
            row=1,
            col=col,
        )
    images, visible = [], []
    for j, step in enumerate(steps):
        beneath = reference.previews.get(step, reference.generated)
        source = None if beneath is None else data_uri(beneath)
        shade = None if beneath is None else data_uri(grey(thumbnail(beneath)))
        for col in range(1, 5):
            uri = source if col == 1 else shade
            if uri is None:
                continue
            suffix = "" if col == 1 else str(col)
            images.append(
                {
                    "source": uri,
                    "xref": f"x{suffix}",
                    "yref": f"y{suffix}",
                    "x": -0.5,
                    "y": -0.5,
                    "sizex": gw,
                    "sizey": gh,
                    "xanchor": "left",
                    "yanchor": "top",
                    "sizing": "stretch",
                    "layer": "below",
                    "visible": j == 0,
                }
            )
            visible.append(j)

    def image_state(j: int) -> dict[str, bool]:
        return {f"images[{i}].visible": owner == j for i, owner in enumerate(visible)}

    def title(j: int) -> str:
        step = steps[j]
        t = reference.timesteps.get(step, math.nan)
        source = "x0 estimate" if step in reference.previews else "generated image (no x0 estimate stored)"
        return f"{source}, step {step} (t={t:.0f})" if math.isfinite(t) else f"{source}, step {step}"

    sliders, buttons = [], []
    for c, choice in enumerate(reference.choices):
        slider_steps = []
        for j, step in enumerate(steps):
            layout = {**image_state(j), "annotations[0].text": title(j)}
            slider_steps.append(
                {"label": str(step), "method": "update", "args": [{"z": data[c][j]}, layout, [0, 1, 2]]}
            )
        sliders.append(
            {
                "steps": slider_steps,
                "active": 0,
                "visible": c == 0,
                "x": 0.0,
                "len": 1.0,
                "y": -0.08,
                "currentvalue": {"prefix": "step "},
                "pad": {"t": 30},
            }
        )
        layout = {f"sliders[{k}].visible": k == c for k in range(len(reference.choices))}
        layout.update({f"sliders[{c}].active": 0, **image_state(0), "annotations[0].text": title(0)})
        buttons.append(
            {"label": choice.label, "method": "update", "args": [{"z": data[c][0]}, layout, [0, 1, 2]]}
        )
    bar = {"thickness": 12, "len": 0.9, "y": 0.5, "title": {"side": "right"}}
    fig.update_layout(
        template="none",
        height=420,
        margin={"l": 20, "r": 20, "t": 110, "b": 90},
        images=images,
        sliders=sliders,
        updatemenus=[dropdown(buttons, 1.32)],
        coloraxis={
            **weight_scale(uniform, spread),
            "colorbar": {
                **bar,
                "x": 1.0,
                "title": {"text": f"A, W (white: 1/{round(1 / uniform)})", "side": "right"},
            },
        },
        coloraxis2={
            "colorscale": [[x, c] for x, c in zip((0.0, 0.25, 0.5, 0.75, 1.0), DIVERGING, strict=True)],
            "cmin": -diff_spread,
            "cmax": diff_spread,
            "colorbar": {**bar, "x": 1.08, "title": {"text": "A - W (white: 0)", "side": "right"}},
        },
    )
    fig.layout.annotations[0].text = title(0)
    for col in range(1, 5):
        fig.update_xaxes(
            range=[-0.5, gw - 0.5],
            showticklabels=False,
            ticks="",
            showgrid=False,
            zeroline=False,
            row=1,
            col=col,
        )
        fig.update_yaxes(
            range=[gh - 0.5, -0.5],
            showticklabels=False,
            ticks="",
            showgrid=False,
            zeroline=False,
            scaleanchor=f"x{'' if col == 1 else col}",
            row=1,
            col=col,
        )
    return fig


DIVERGING = ("#2166ac", "#92c5de", "#f7f7f7", "#f4a582", "#b2182b")
"""Blue (less) through white to red (more): the colours of every heat map (matplotlib's RdBu_r ends)."""


def weight_scale(uniform: float, spread: float) -> dict[str, Any]:
    """The A / W colour axis: white at the even share ``uniform``, red above, blue below, reaching
    ``uniform +- spread`` but never below 0 or above 1 (a weight's range): where it is cut, white
    stays at ``uniform`` and that side of the scale is shorter."""
    low, high = max(0.0, uniform - spread), min(1.0, uniform + spread)
    middle = (uniform - low) / (high - low) if high > low else 0.5
    stops = [0.0, middle / 2, middle, (1 + middle) / 2, 1.0]
    return {
        "colorscale": [[round(x, 6), c] for x, c in zip(stops, DIVERGING, strict=True)],
        "cmin": low,
        "cmax": high,
    }


def scales(references: Sequence[ReferenceMaps]) -> tuple[float, float, float]:
    """``(spread, diff_spread, uniform)``: one colour scale per map kind for the whole report, set by
    the maps of every layer's and head's mean (every token, step and reference: the default view, and
    what ``attention_maps.png`` draws); a single layer or head beyond it saturates the scale's end
    (its values are on hover). ``spread`` is the largest deviation of A or W from the even share
    ``uniform`` = 1 / tokens, ``diff_spread`` the largest |A - W|."""
    spread = diff = 0.0
    uniform = math.nan
    for reference in references:
        for choice in reference.choices:
            if choice.layers is not None or choice.heads is not None:
                continue
            for step in reference.steps():
                attn = reference.grid("attn", step, choice)
                nw = reference.grid("nw", step, choice)
                uniform = 1.0 / attn.shape[0]
                spread = max(
                    spread, float(np.nanmax(np.abs(attn - uniform))), float(np.nanmax(np.abs(nw - uniform)))
                )
                diff = max(diff, float(np.nanmax(np.abs(attn - nw))))
    return spread or 1e-12, diff or 1e-12, uniform
