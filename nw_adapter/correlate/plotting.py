"""Figures of the command line: ``rho.png``, ``bandwidth.png`` and the attention-map figure.

Per-token heat maps for notebooks (any selection, overlay on any image) are
:meth:`NWRecorder.heat_maps` / :mod:`nw_adapter.integration.heatmaps`.

Both use :class:`matplotlib.figure.Figure` directly (the Agg canvas), so importing this module
never changes the global pyplot backend of a user's session.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nw_adapter.integration import records
from nw_adapter.integration.schema import control_column, control_draws, control_label


def rho_figure(
    block_rows: Sequence[dict],
    *,
    title: str | None = None,
    note: str | None = None,
    units: Sequence[dict] | None = None,
    half: str | None = None,
):
    """rho against the timestep, one panel per block, beside its three nulls.

    :func:`nw_adapter.integration.records.rho_figure` of ``rho.json``'s ``blocks`` rows (see
    :func:`nw_adapter.correlate.report.aggregate`); ``note`` is a line under the title (e.g. why
    two steps share a timestep: they are drawn at the same x). ``units``: the run's records (with
    their ``reference`` key) and ``half`` their CFG half: with two or more reference images, rho
    carries its 95% Student t interval over them.
    """
    return records.rho_figure(block_rows, panel_key="block", title=title, note=note, units=units, half=half)


def plot_rho(
    block_rows: Sequence[dict],
    path: str | os.PathLike,
    *,
    title: str | None = None,
    note: str | None = None,
    units: Sequence[dict] | None = None,
    half: str | None = None,
) -> Path:
    """Write :func:`rho_figure` to ``path`` (PNG, atomically) and return ``path``."""
    return records.save_figure(rho_figure(block_rows, title=title, note=note, units=units, half=half), path)


@dataclass(frozen=True)
class MapPanel:
    """One step's image-branch attention and NW weights for one image token.

    Attributes:
        step: Denoising step index.
        timestep: The step's timestep.
        token: Index of the image token (key).
        attn: Attention weight of every query position on that key, ``[grid_h, grid_w]``, mean
            over the stored layers (each upsampled to the finest grid) and heads.
        nw: NW weight of every query position on that key, ``[grid_h, grid_w]``, same means.
        layers: Attention-processor names the maps are averaged over.
        uniform: 1 / the number of image tokens: the weight of an even share.
    """

    step: int
    timestep: float
    token: int
    attn: np.ndarray
    nw: np.ndarray
    layers: tuple[str, ...]
    uniform: float = math.nan


def panels_from_maps(
    maps: Mapping[str, object],
    *,
    timesteps: Mapping[int, float],
    image_hw: tuple[int, int],
    cfg: bool,
    max_tokens: int = 2,
) -> list[MapPanel]:
    """Turn the recorder's stored maps into plot panels, one per (stored step, shown token).

    Per stored step: :func:`nw_adapter.correlate.maps.token_maps` of A and of W over every
    stored layer and head (adapter 0, image 0), the conditional batch row under CFG (the last
    row), for the same ``max_tokens`` image tokens in every step: those with the largest mean
    attention over all stored steps (so the rows compare).

    Args:
        maps: :meth:`NWRecorder.maps` or :func:`nw_adapter.correlate.maps.load_maps` output.
        timesteps: Step index -> timestep.
        image_hw: ``(height, width)`` of the generated image (for the grid's aspect ratio).
        cfg: Whether the batch is ``[uncond; cond]``.
        max_tokens: Image tokens shown per step.

    Returns:
        Panels sorted by step, then token.
    """
    from nw_adapter.correlate.maps import select_maps, token_maps

    row = -1 if cfg else 0
    steps = sorted({k.step for k in select_maps(maps, "attn")} & {k.step for k in select_maps(maps, "nw")})
    panels: list[MapPanel] = []
    if not steps:
        return panels
    overall = token_maps(maps, "attn", image_hw=image_hw, steps=steps, batch_row=row)
    shown = sorted(int(k) for k in np.argsort(-overall.mean(axis=(1, 2)), kind="stable")[:max_tokens])
    for step in steps:
        attn = token_maps(maps, "attn", image_hw=image_hw, steps=[step], batch_row=row)
        nw = token_maps(maps, "nw", image_hw=image_hw, steps=[step], batch_row=row)
        layers = tuple(sorted({k.layer for k in select_maps(maps, "attn", steps=[step])}))
        for token in shown:
            panels.append(
                MapPanel(
                    step=step,
                    timestep=float(timesteps.get(step, math.nan)),
                    token=token,
                    attn=attn[token],
                    nw=nw[token],
                    layers=layers,
                    uniform=1.0 / attn.shape[0],
                )
            )
    return panels


def attention_maps_figure(
    generated,
    panels: Sequence[MapPanel],
    *,
    previews: Mapping[int, object] | None = None,
    alpha: float = 0.65,
    reference: str | None = None,
):
    """Per stored step and shown image token: A, NW and A - NW over what the model predicted.

    One row per stored step. First column: the x0 estimate of that step,
    x0 = (x_t - sigma_t eps) / alpha_t decoded by the VAE (``previews[step]``), or the final
    image where no preview is given (labelled so). Then the maps of the shown image tokens
    (means over layers and heads) drawn over that image in grey, grouped by kind (A of every
    token, then NW, then A - NW):

    - A[:, token] and W[:, token] on one diverging scale shared by every token and step, centred
      on the uniform level 1/tokens (white: the token gets an even share of the query's weight;
      red: more; blue: less) and as wide as the largest deviation of any of them, so every A and
      W panel compares with every other;
    - A - NW on one diverging scale centred on 0 shared by every panel (red: attention above NW).

    The two colour bars under the panels are labelled; the title names the reference image.
    7 in wide (a paper's full width).

    Args:
        generated: The generated :class:`PIL.Image.Image`.
        panels: Output of :func:`panels_from_maps`.
        previews: Step -> x0-estimate image (PIL), optional.
        alpha: Opacity of the maps over the image.
        reference: The reference image's name, for the title.

    Returns:
        A :class:`matplotlib.figure.Figure`.

    Raises:
        ValueError: no panels.
    """
    from matplotlib.figure import Figure

    from nw_adapter.integration.heatmaps import draw_overlay, grey_image, resize_map
    from nw_adapter.integration.records import wrap_title

    if not panels:
        raise ValueError("panels: no stored maps to draw; run with --store-maps on at least one step")
    previews = previews or {}
    steps = sorted({p.step for p in panels})
    per_step = {s: [p for p in panels if p.step == s] for s in steps}
    shown = max(len(v) for v in per_step.values())
    ncols = 1 + 3 * shown
    width = 7.0
    cell = (width - 0.5) / ncols
    uniform = panels[0].uniform
    spread = max(float(np.abs(m - uniform).max()) for p in panels for m in (p.attn, p.nw)) or 1e-12
    diff_spread = max(float(np.abs(p.attn - p.nw).max()) for p in panels) or 1e-12
    title = (
        f"reference {reference}: " if reference else ""
    ) + f"image-branch attention A and NW weights W per image token, mean over {len(panels[0].layers)} " \
        "layer(s) and the stored heads; one colour scale for every A and W panel, one for every A - NW"
    title = wrap_title(title, width - 0.2, 8)
    height = cell * len(steps) + 0.45 + 0.13 * title.count("\n") + 0.75
    fig = Figure(figsize=(width, height), layout="constrained")
    grid = fig.add_gridspec(len(steps) + 1, ncols, height_ratios=[1.0] * len(steps) + [0.07])
    axes = np.array([[fig.add_subplot(grid[r, c]) for c in range(ncols)] for r in range(len(steps))])
    weight_shown = diff_shown = None
    for row, step in enumerate(steps):
        row_panels = per_step[step]
        beneath = previews.get(step, generated)
        grey = grey_image(beneath)
        first = axes[row][0]
        first.imshow(np.asarray(beneath.convert("RGB")))
        first.set_xticks([])
        first.set_yticks([])
        source = "x0 est." if step in previews else "final img."
        first.set_ylabel(f"step {step}\nt={row_panels[0].timestep:.0f}\n{source}", fontsize=7)
        for col, panel in enumerate(row_panels):
            cells = [axes[row][1 + col + shown * group] for group in range(3)]  # A | NW | A - NW columns
            kinds = (
                ("A", panel.attn, uniform, spread),
                ("NW", panel.nw, uniform, spread),
                ("A - NW", panel.attn - panel.nw, 0.0, diff_spread),
            )
            for ax, (name, data, centre, half_width) in zip(cells, kinds, strict=True):
                mappable = draw_overlay(
                    ax, grey, resize_map(data, grey.shape), centre=centre, spread=half_width, alpha=alpha
                )
                if name == "A - NW":
                    diff_shown = mappable
                else:
                    weight_shown = mappable
                if row == 0:
                    ax.set_title(f"{name}\ntoken {panel.token}", fontsize=7)
        for col in range(len(row_panels), shown):
            for group in range(3):
                axes[row][1 + col + shown * group].set_visible(False)
    tokens = round(1 / uniform)
    middle_col = 1 + 2 * shown
    for mappable, where, centre, half_width, label in (
        (weight_shown, grid[-1, 1:middle_col], uniform, spread,
         f"A, NW: weight on the token\n(white = 1/{tokens}, an even share)"),
        (diff_shown, grid[-1, middle_col:], 0.0, diff_spread, "A - NW\n(white = 0, red: A above NW)"),
    ):
        bar = fig.colorbar(mappable, cax=fig.add_subplot(where), orientation="horizontal")
        bar.set_ticks([centre - half_width, centre, centre + half_width])
        middle = "0" if centre == 0 else f"1/{tokens}"
        bar.set_ticklabels([f"{centre - half_width:.2g}", middle, f"{centre + half_width:.2g}"])
        bar.ax.tick_params(labelsize=7)
        bar.set_label(label, fontsize=7)
    fig.suptitle(title, fontsize=8)
    return fig


def plot_attention_maps(
    generated,
    panels: Sequence[MapPanel],
    path: str | os.PathLike,
    *,
    previews: Mapping[int, object] | None = None,
    alpha: float = 0.65,
    reference: str | None = None,
) -> Path:
    """Write :func:`attention_maps_figure` to ``path`` (PNG, atomically) and return ``path``."""
    fig = attention_maps_figure(generated, panels, previews=previews, alpha=alpha, reference=reference)
    return records.save_figure(fig, path)


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


CONTROL_ARM = "log_h_eff_control"
"""The bandwidth figure's key of the scale-matched control's mean log h_eff per image and step."""


def control_step_log_h_eff(records: Sequence[dict], half: str) -> dict[str, dict[int, float]]:
    """Per reference image and step, the mean over layers, heads and adapters of the scale-matched
    control's log h_eff: per record, the mean over draws k of ``log h_eff_control_k`` (positive
    finite values only); a record without ``reference`` belongs to its pipeline ``call``.

    Returns:
        ``{reference: {step: mean log h_eff}}``, only where some value is finite.
    """
    sums: dict[str, dict[int, list[float]]] = {}
    for record in records:
        if record.get("half") != half:
            continue
        logs = [
            math.log(v)
            for k in range(control_draws(record))
            if _positive(v := record.get(control_column("h_eff", k)))
        ]
        if logs:
            unit = record["reference"] if "reference" in record else f"call {record.get('call')}"
            sums.setdefault(unit, {}).setdefault(int(record["step"]), []).append(sum(logs) / len(logs))
    return {unit: {step: float(np.mean(v)) for step, v in steps.items()} for unit, steps in sums.items()}


def bandwidth_figure(records: Sequence[dict], half: str, *, title: str | None = None):
    """Fitted bandwidth h_eff against the schedule's h per step, log-log, with the line of slope 1.

    Per step, the geometric mean over reference images of each image's geometric-mean ``h_eff``
    over layers, heads and adapters (:func:`nw_adapter.correlate.verdict.image_step_means`), for the
    trained adapter and, when recorded, the scale-matched control (per record the geometric mean
    of ``h_eff_control_k`` over its draws, :func:`control_step_log_h_eff`); with two or more images a
    band of the 95% Student t interval of the mean log h_eff over them (the unit: the reference
    image). The dotted line ``h_eff = c h`` (slope 1, ``c`` the geometric mean ratio of the trained
    points) is what a head-space bandwidth proportional to the schedule's would give. ``h_eff`` is a
    head-space fit and does not identify a kernel smoother's bandwidth (Theorem 3's exact head reads
    an ``h_eff`` that falls as h rises; docs/THEORY.md, "What the readings can and cannot
    establish"); the verdict's bandwidth clause reads the path from ``logit_scale`` instead.
    3.5 in wide (a paper's column).

    Returns:
        A :class:`matplotlib.figure.Figure`, or None when no step has both a positive ``h_eff``
        and a positive schedule ``h`` (readings not recorded).
    """
    from matplotlib.figure import Figure

    from nw_adapter.core.intervals import t_interval
    from nw_adapter.correlate.verdict import image_step_means
    from nw_adapter.integration.records import wrap_title

    by_image = image_step_means(records, half)
    control = control_step_log_h_eff(records, half)
    for reference, rows in by_image.items():  # the control's arm beside the trained one, per step
        for row in rows:
            row[CONTROL_ARM] = control.get(reference, {}).get(int(row["step"]))
    draws = control_draws({name for r in records for name in r})
    arms = (
        ("log_h_eff", "trained adapter", "#1f77b4"),
        (CONTROL_ARM, control_label(draws), "#ff7f0e"),
    )

    def points(rows: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
        kept = [r for r in rows if r.get(key) is not None and (r.get("h_schedule") or 0) > 0]
        return np.log([r["h_schedule"] for r in kept]), np.array([r[key] for r in kept])

    if not any(points(rows, "log_h_eff")[0].size for rows in by_image.values()):
        return None
    fig = Figure(figsize=(3.5, 3.6), layout="constrained")
    ax = fig.subplots()
    trained_ratio: list[float] = []
    for key, label, color in arms:
        per_step: dict[float, list[float]] = {}
        for rows in by_image.values():
            x, y = points(rows, key)
            for xi, yi in zip(x, y, strict=True):
                per_step.setdefault(float(xi), []).append(float(yi))
            if key == "log_h_eff":
                trained_ratio += list(y - x)
        if not per_step:
            continue
        xs = np.array(sorted(per_step))
        stats = np.array([t_interval(per_step[x]) for x in xs])  # [steps, (mean, low, high)]
        n = max(len(v) for v in per_step.values())
        ax.plot(np.exp(xs), np.exp(stats[:, 0]), marker="o", markersize=2, color=color, linewidth=1.2,
                label=f"{label} (mean of {n} image(s))")
        if n >= 2:
            ax.fill_between(np.exp(xs), np.exp(stats[:, 1]), np.exp(stats[:, 2]), color=color, alpha=0.25,
                            linewidth=0, label=f"{label}: 95% t interval over images")
    h_all = [r["h_schedule"] for rows in by_image.values() for r in rows if (r.get("h_schedule") or 0) > 0]
    grid = np.geomspace(min(h_all), max(h_all), 50)
    ax.plot(grid, grid * math.exp(float(np.mean(trained_ratio))), color="0.3", linestyle=":", linewidth=1.0,
            label="slope 1: h_eff = c h")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("schedule bandwidth h = sigma_t / alpha_t", fontsize=8)
    ax.set_ylabel("fitted bandwidth h_eff", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.legend(loc="outside lower center", fontsize=7, frameon=False, ncol=1)
    if title:
        fig.suptitle(wrap_title(title, 3.3, 8), fontsize=8)
    return fig


def plot_bandwidth(records: Sequence[dict], half: str, path: str | os.PathLike, *, title: str | None = None):
    """Write :func:`bandwidth_figure` to ``path`` (PNG, atomically); None (nothing written) without h_eff."""
    from nw_adapter.integration.records import save_figure

    fig = bandwidth_figure(records, half, title=title)
    return None if fig is None else save_figure(fig, path)
