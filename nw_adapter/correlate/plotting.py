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

from nw_adapter.atomic import atomic_write
from nw_adapter.integration import records


def rho_figure(block_rows: Sequence[dict], *, title: str | None = None, note: str | None = None):
    """rho against the timestep, one panel per block, with the band of the three nulls.

    :func:`nw_adapter.integration.records.rho_figure` of ``rho.json``'s ``blocks`` rows (see
    :func:`nw_adapter.correlate.report.aggregate`); ``note`` is a line under the title (e.g. why
    two steps share a timestep: they are drawn at the same x).
    """
    return records.rho_figure(block_rows, panel_key="block", title=title, note=note)


def plot_rho(
    block_rows: Sequence[dict], path: str | os.PathLike, *, title: str | None = None, note: str | None = None
) -> Path:
    """Write :func:`rho_figure` to ``path`` (PNG, atomically) and return ``path``."""
    return records.save_figure(rho_figure(block_rows, title=title, note=note), path)


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


def plot_attention_maps(
    generated,
    panels: Sequence[MapPanel],
    path: str | os.PathLike,
    *,
    previews: Mapping[int, object] | None = None,
    alpha: float = 0.65,
) -> Path:
    """Per stored step and shown image token: A, NW and A - NW over what the model predicted.

    One row per stored step. First column: the x0 estimate of that step,
    x0 = (x_t - sigma_t eps) / alpha_t decoded by the VAE (``previews[step]``), or the final
    image where no preview is given (labelled so). Then per image token three maps (means over
    layers and heads), drawn over that image in grey:

    - A[:, token] and W[:, token] on one diverging scale centred on the uniform level 1/tokens
      (white: the token gets an even share of the query's weight; red: more; blue: less),
      symmetric and as wide as the larger deviation of the two, so A and W compare directly;
    - A - W on a diverging scale centred on 0 (red: attention above NW).

    Args:
        generated: The generated :class:`PIL.Image.Image`.
        panels: Output of :func:`panels_from_maps`.
        path: Output PNG (written atomically).
        previews: Step -> x0-estimate image (PIL), optional.
        alpha: Opacity of the maps over the image.
    """
    from matplotlib.figure import Figure

    from nw_adapter.integration.heatmaps import draw_overlay, grey_image, resize_map

    if not panels:
        raise ValueError("panels: no stored maps to draw; run with --store-maps on at least one step")
    previews = previews or {}
    steps = sorted({p.step for p in panels})
    per_step = {s: [p for p in panels if p.step == s] for s in steps}
    shown = max(len(v) for v in per_step.values())
    ncols = 1 + 3 * shown
    fig = Figure(figsize=(1.45 * ncols + 0.6, 1.55 * len(steps) + 0.6), layout="constrained")
    axes = fig.subplots(len(steps), ncols, squeeze=False)
    for row, step in enumerate(steps):
        row_panels = per_step[step]
        label = f"step {step}, t={row_panels[0].timestep:.0f}"
        beneath = previews.get(step, generated)
        grey = grey_image(beneath)
        first = axes[row][0]
        first.imshow(np.asarray(beneath.convert("RGB")))
        caption = f"x0 estimate\n{label}" if step in previews else f"final image\n({label} maps)"
        first.set_title(caption, fontsize=8)
        first.set_xticks([])
        first.set_yticks([])
        for col, panel in enumerate(row_panels):
            uniform = panel.uniform
            spread = float(max(np.abs(panel.attn - uniform).max(), np.abs(panel.nw - uniform).max())) or 1e-12
            diff = panel.attn - panel.nw
            diff_spread = float(np.abs(diff).max()) or 1e-12
            cells = axes[row][1 + 3 * col : 4 + 3 * col]
            kinds = (
                ("A", panel.attn, uniform, spread),
                ("NW", panel.nw, uniform, spread),
                ("A - NW", diff, 0.0, diff_spread),
            )
            for ax, (name, data, centre, width) in zip(cells, kinds, strict=True):
                mappable = draw_overlay(
                    ax, grey, resize_map(data, grey.shape), centre=centre, spread=width, alpha=alpha
                )
                ax.set_title(f"{name}, token {panel.token}", fontsize=8)
                if name != "A":
                    bar = fig.colorbar(mappable, ax=ax, fraction=0.06, pad=0.02)
                    bar.set_ticks([centre - width, centre, centre + width])
                    middle = "0" if centre == 0 else f"1/{round(1 / uniform)}"
                    bar.set_ticklabels([f"{centre - width:.2g}", middle, f"{centre + width:.2g}"])
                    bar.ax.tick_params(labelsize=7)
        for ax in axes[row][1 + 3 * len(row_panels) :]:
            ax.set_visible(False)
    layers = panels[0].layers
    fig.suptitle(
        f"image-branch attention A vs NW weights per image token (white = uniform share); mean over "
        f"{len(layers)} layer(s) and the stored heads",
        fontsize=9,
    )
    return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120))


def bandwidth_figure(records: Sequence[dict], half: str, *, title: str | None = None):
    """Fitted bandwidth h_eff against the schedule's h per step, log-log, with the line of slope 1.

    Per step, the geometric mean over reference images of each image's geometric-mean ``h_eff``
    over layers, heads and adapters (:func:`nw_adapter.correlate.verdict.image_step_means`), for the
    trained adapter and, when recorded, the untrained-adapter control; thin lines are the single
    images. The dotted line ``h_eff = c h`` (slope 1, ``c`` the geometric mean ratio of the trained
    points) is what a bandwidth that follows the schedule would give: the verdict's clause
    "bandwidth follows the schedule" tests the slope of each image's line against the control's.

    Returns:
        A :class:`matplotlib.figure.Figure`, or None when no step has both a positive ``h_eff``
        and a positive schedule ``h`` (readings not recorded).
    """
    from matplotlib.figure import Figure

    from nw_adapter.correlate.verdict import image_step_means

    by_image = image_step_means(records, half)
    arms = (
        ("log_h_eff", "trained adapter", "#1f77b4"),
        ("log_h_eff_untrained", "untrained adapter", "#ff7f0e"),
    )

    def points(rows: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
        kept = [r for r in rows if r.get(key) is not None and (r.get("h_schedule") or 0) > 0]
        return np.log([r["h_schedule"] for r in kept]), np.array([r[key] for r in kept])

    if not any(points(rows, "log_h_eff")[0].size for rows in by_image.values()):
        return None
    fig = Figure(figsize=(4.8, 4.0), layout="constrained")
    ax = fig.subplots()
    trained_ratio: list[float] = []
    for key, label, color in arms:
        per_step: dict[float, list[float]] = {}
        for rows in by_image.values():
            x, y = points(rows, key)
            if x.size:
                ax.plot(np.exp(x), np.exp(y), color=color, linewidth=0.6, alpha=0.35)
                for xi, yi in zip(x, y, strict=True):
                    per_step.setdefault(float(xi), []).append(float(yi))
                if key == "log_h_eff":
                    trained_ratio += list(y - x)
        if per_step:
            xs = np.array(sorted(per_step))
            ys = np.array([np.mean(per_step[x]) for x in xs])
            ax.plot(np.exp(xs), np.exp(ys), marker="o", markersize=3, color=color, linewidth=1.8,
                    label=f"{label} (mean of {len(by_image)} image(s))")
    h_all = [r["h_schedule"] for rows in by_image.values() for r in rows if (r.get("h_schedule") or 0) > 0]
    grid = np.geomspace(min(h_all), max(h_all), 50)
    ax.plot(grid, grid * math.exp(float(np.mean(trained_ratio))), color="0.3", linestyle=":", linewidth=1.2,
            label="slope 1: h_eff = c h")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("schedule bandwidth h = sigma_t / alpha_t", fontsize=9)
    ax.set_ylabel("fitted bandwidth h_eff (geometric mean)", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def plot_bandwidth(records: Sequence[dict], half: str, path: str | os.PathLike, *, title: str | None = None):
    """Write :func:`bandwidth_figure` to ``path`` (PNG, atomically); None (nothing written) without h_eff."""
    from nw_adapter.integration.records import save_figure

    fig = bandwidth_figure(records, half, title=title)
    return None if fig is None else save_figure(fig, path)
