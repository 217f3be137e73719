"""Figures of the command line: ``rho.png``, ``bandwidth.png`` and the attention-map figure.

Per-token heat maps for notebooks (any selection, overlay on any image) are
:meth:`NWRecorder.heat_maps` / :mod:`nw_adapter.analysis.heatmaps`.

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

from nw_adapter.analysis import records
from nw_adapter.integration.schema import control_draws, control_label


def counted(count: int, noun: str) -> str:
    """``"1 image"``, ``"3 images"``: a count with its noun, as a figure's text prints it."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def rho_figure(
    block_rows: Sequence[dict],
    *,
    title: str | None = None,
    note: str | None = None,
    units: Sequence[dict] | None = None,
    half: str | None = None,
    control: str | None = None,
):
    """rho over the denoising steps, one panel per block, beside its three nulls and the control.

    :func:`nw_adapter.analysis.records.rho_figure` of ``rho.json``'s ``blocks`` rows (see
    :func:`nw_adapter.correlate.report.aggregate`); ``note`` is a line under the title (e.g. why
    two steps share a timestep: they are two points of the x axis, the step). ``units``: the run's
    records (with their ``reference`` key) and ``half`` their CFG half: with two or more reference
    images, rho carries its 95% Student t interval over them. ``control``: the control's kind
    (``rho.json``'s ``control.kind``), named in the legend and in the line under the title.
    """
    return records.rho_figure(
        block_rows, panel_key="block", title=title, note=note, units=units, half=half, control=control
    )


def report_rho_figure(report: dict):
    """:func:`rho_figure` of a ``rho.json`` report with the command line's title and notes: the
    model, steps, bandwidth and references (:func:`nw_adapter.analysis.records.figure_title`, the
    title :meth:`Records.plot <nw_adapter.analysis.records.Records.plot>` gives too), the
    random-weights warning, the note on steps that share a timestep and the control's kind."""
    from nw_adapter.correlate.report import random_weights_note, repeated_timestep_note

    config = report.get("config", {})
    title = records.figure_title(
        (config.get("model") or {}).get("model"),
        config.get("steps"),
        config.get("bandwidth"),
        len(report.get("images", [])) or len({r.get("reference") for r in report.get("records", [])}),
    )
    notes = [n for n in (random_weights_note(report), repeated_timestep_note(report)) if n]
    return rho_figure(
        report["blocks"],
        title=title,
        note="; ".join(notes) or None,
        units=report["records"],
        half=report["half"],
        control=(report.get("control") or {}).get("kind"),
    )


def plot_rho(
    block_rows: Sequence[dict],
    path: str | os.PathLike,
    *,
    title: str | None = None,
    note: str | None = None,
    units: Sequence[dict] | None = None,
    half: str | None = None,
    control: str | None = None,
) -> Path:
    """Write :func:`rho_figure` to ``path`` (PNG, atomically) and return ``path``."""
    fig = rho_figure(block_rows, title=title, note=note, units=units, half=half, control=control)
    return records.save_figure(fig, path)


def plot_report_rho(report: dict, path: str | os.PathLike) -> Path:
    """Write :func:`report_rho_figure` to ``path`` (PNG, atomically): the command line's ``rho.png``."""
    return records.save_figure(report_rho_figure(report), path)


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

    from nw_adapter.analysis.heatmaps import draw_overlay, grey_image, resize_map
    from nw_adapter.analysis.records import wrap_title

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
    tokens = round(1 / uniform)
    title = (
        (f"reference {reference}: " if reference else "")
        + f"image-branch attention A and NW weights W of {_shown_tokens(shown, tokens)}, mean over "
        f"{counted(len(panels[0].layers), 'layer')} and the stored heads; one colour scale for every A and "
        "W panel, one for every A - NW"
    )
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
    middle_col = 1 + 2 * shown
    for mappable, where, centre, half_width, label in (
        (
            weight_shown,
            grid[-1, 1:middle_col],
            uniform,
            spread,
            f"A, NW: weight on the token\n(white = 1/{tokens}, an even share)",
        ),
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


def _shown_tokens(shown: int, tokens: int) -> str:
    """``"the 2 most-attended of 4 image tokens"``, or ``"all 4 image tokens"``."""
    if shown >= tokens:
        return f"all {counted(tokens, 'image token')}" if tokens > 1 else "the 1 image token"
    return f"the {shown} most-attended of {counted(tokens, 'image token')} (over the run)"


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


def bandwidth_figure(records: Sequence[dict], half: str, *, title: str | None = None):
    """The bandwidth path: ``logit_scale`` against the schedule's h per step, log-log, in the verdict's
    convention: the exponent ``-d log logit_scale / d log h`` (theory 2).

    ``logit_scale`` is the RMS of the row-centred attention logits, the branch's effective inverse
    temperature (:func:`nw_adapter.core.readings.logit_scale`); an exact NW head over fixed queries
    has ``logit_scale = c / h^2`` (exponent 2: slope -2 on these axes) whatever its support, a head
    of fixed temperature exponent 0 (a flat line), and a constant gain on q or k only moves a line
    up or down. Lines, per step the geometric mean over reference images of each image's geometric
    mean over layers, heads and adapters (:func:`nw_adapter.correlate.verdict.image_step_means`, the
    verdict's own per-step means), with the 95% Student t interval over images as error bars: the
    trained adapter; the scale-matched control (per step the geometric mean over its draws, its
    scale matched once per run as the verdict reads it: ``log_control_path_k``); and, for a
    calibrated run, the exact NW head *measured* in the same pipeline (its ``_exact`` columns). The
    legend gives each line's exponent as the verdict computes it (the mean over images of the
    per-image OLS exponents, :func:`~nw_adapter.correlate.verdict.slope_on_log_h`; the control's
    over images and draws). The dotted guide through the trained points' centre has exponent 2. The
    lines are :func:`nw_adapter.correlate.bandwidth_path.bandwidth_lines` (the report's figure draws
    the same). 3.5 in wide (a paper's column).

    Returns:
        A :class:`matplotlib.figure.Figure`, or None when no step has a positive ``logit_scale`` and
        a positive schedule ``h`` (an older file, or steps at pure noise only).
    """
    from matplotlib.figure import Figure

    from nw_adapter.analysis.records import wrap_title
    from nw_adapter.correlate.bandwidth_path import ARMS, bandwidth_lines, guide

    lines = bandwidth_lines(records, half)
    if not lines or lines[0].arm != "adapter":
        return None
    draws = control_draws({name for r in records for name in r})
    markers = {"adapter": "o", "control": "s", "exact": "^"}
    fig = Figure(figsize=(3.5, 3.9), layout="constrained")
    ax = fig.subplots()
    for line in lines:
        name, color = ARMS[line.arm]
        label = control_label(draws) if line.arm == "control" else name
        exponent = "" if line.exponent is None else f", exponent {line.exponent:+.2f}"
        y = np.array(line.mean)
        errors = None
        if line.units >= 2:
            errors = np.vstack([y - np.array(line.low), np.array(line.high) - y])
        ax.errorbar(
            line.h,
            y,
            yerr=errors,
            color=color,
            marker=markers[line.arm],
            markersize=2.5,
            linewidth=1.0,
            elinewidth=0.7,
            capsize=1.5,
            label=f"{label}: {counted(line.units, 'image')}{exponent}",
        )
    ax.plot(
        *guide(lines[0]),
        color="0.3",
        linestyle=":",
        linewidth=1.0,
        label="exponent 2 (the theory): logit_scale = c / h^2",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    label_log_axis(ax, "x")
    label_log_axis(ax, "y")
    ax.set_xlabel("schedule bandwidth h = sigma_t / alpha_t", fontsize=8)
    ax.set_ylabel("logit_scale (RMS of row-centred logits)", fontsize=8)
    ax.tick_params(which="both", labelsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.legend(loc="outside lower center", fontsize=6.5, frameon=False, ncol=1)
    if title:
        fig.suptitle(wrap_title(title, 3.3, 8), fontsize=8)
    return fig


def label_log_axis(ax, which: str) -> None:
    """Tick labels of ``ax``'s log ``which`` axis ("x" or "y") that never overlap: the decades as
    plain numbers, and between them the 2s and 5s where the drawn range spans less than two decades
    (also the 3s below half a decade), else none (matplotlib's default labels the minor ticks of a
    range under a few decades in scientific notation, which collides on a narrow figure)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    low, high = sorted(abs(v) for v in (ax.get_xlim() if which == "x" else ax.get_ylim()))
    decades = math.log10(high / low) if low > 0 else math.inf
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    subs = (2.0, 3.0, 5.0) if decades < 0.5 else (2.0, 5.0)
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_locator(LogLocator(base=10.0))
    axis.set_major_formatter(plain)
    axis.set_minor_locator(LogLocator(base=10.0, subs=subs if decades < 2.0 else "auto"))
    axis.set_minor_formatter(plain if decades < 2.0 else NullFormatter())


def plot_bandwidth(records: Sequence[dict], half: str, path: str | os.PathLike, *, title: str | None = None):
    """Write :func:`bandwidth_figure` to ``path`` (PNG, atomically); None (nothing written) without
    ``logit_scale``."""
    from nw_adapter.analysis.records import save_figure

    fig = bandwidth_figure(records, half, title=title)
    return None if fig is None else save_figure(fig, path)
