"""Figures of the command line: ``rho.png`` and the attention-map figure.

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
    """

    step: int
    timestep: float
    token: int
    attn: np.ndarray
    nw: np.ndarray
    layers: tuple[str, ...]


def panels_from_maps(
    maps: Mapping[str, object],
    *,
    timesteps: Mapping[int, float],
    image_hw: tuple[int, int],
    cfg: bool,
    max_tokens: int = 4,
) -> list[MapPanel]:
    """Turn the recorder's stored maps into plot panels, one per (stored step, shown token).

    Per stored step: :func:`nw_adapter.correlate.maps.token_maps` of A and of W over every
    stored layer and head (adapter 0, image 0), the conditional batch row under CFG (the last
    row), and the ``max_tokens`` image tokens with the largest mean attention.

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
    for step in steps:
        attn = token_maps(maps, "attn", image_hw=image_hw, steps=[step], batch_row=row)
        nw = token_maps(maps, "nw", image_hw=image_hw, steps=[step], batch_row=row)
        layers = tuple(sorted({k.layer for k in select_maps(maps, "attn", steps=[step])}))
        order = np.argsort(-attn.mean(axis=(1, 2)), kind="stable")[:max_tokens]
        for token in sorted(int(k) for k in order):
            panels.append(
                MapPanel(
                    step=step,
                    timestep=float(timesteps.get(step, math.nan)),
                    token=token,
                    attn=attn[token],
                    nw=nw[token],
                    layers=layers,
                )
            )
    return panels


def _overlay(ax, image: np.ndarray, data: np.ndarray, vmax: float):
    """Draw ``image`` and ``data`` (any grid, stretched over it) on ``ax``; return the mappable."""
    extent = (0, image.shape[1], image.shape[0], 0)
    ax.imshow(image, extent=extent)
    mappable = ax.imshow(
        data, extent=extent, cmap="inferno", alpha=0.6, vmin=0.0, vmax=vmax, interpolation="nearest"
    )
    ax.set_xticks([])
    ax.set_yticks([])
    return mappable


def plot_attention_maps(
    generated,
    panels: Sequence[MapPanel],
    path: str | os.PathLike,
    *,
    previews: Mapping[int, object] | None = None,
) -> Path:
    """Image-branch attention maps beside NW maps, one row per stored step, with colour bars.

    First column: what the model predicted at that step, the x0 estimate
    x0 = (x_t - sigma_t eps) / alpha_t decoded by the VAE (``previews[step]``), or, where no
    preview is given, the final generated image, labelled as such. Then per image token two
    columns: A[:, token] and W[:, token] (means over layers and heads) laid over the generated
    image, on one colour scale per row, shown by the row's colour bar.

    Args:
        generated: The generated :class:`PIL.Image.Image`.
        panels: Output of :func:`panels_from_maps`.
        path: Output PNG (written atomically).
        previews: Step -> x0-estimate image (PIL), optional.
    """
    from matplotlib.figure import Figure

    if not panels:
        raise ValueError("panels: no stored maps to draw; run with --store-maps on at least one step")
    previews = previews or {}
    steps = sorted({p.step for p in panels})
    tokens = sorted({p.token for p in panels}, key=int)
    per_step = {s: [p for p in panels if p.step == s] for s in steps}
    ncols = 1 + 2 * max(len(v) for v in per_step.values())
    height = 1.75 * len(steps) + 0.7  # inches; the top 0.65 in hold the figure title above row titles
    fig = Figure(figsize=(1.6 * ncols + 0.8, height))
    fig.subplots_adjust(left=0.01, right=0.93, bottom=0.02, top=1 - 0.65 / height, wspace=0.06, hspace=0.22)
    axes = fig.subplots(len(steps), ncols, squeeze=False)
    image = np.asarray(generated.convert("RGB"))
    for row, step in enumerate(steps):
        row_panels = per_step[step]
        first = axes[row][0]
        label = f"step {step}, t={row_panels[0].timestep:.0f}"
        if step in previews:
            first.imshow(np.asarray(previews[step].convert("RGB")))
            first.set_title(f"x0 estimate, {label}", fontsize=6)
        else:
            first.imshow(image)
            first.set_title(f"final image ({label} maps)", fontsize=6)
        first.set_xticks([])
        first.set_yticks([])
        vmax = max(max(float(np.max(p.attn)), float(np.max(p.nw))) for p in row_panels) or 1.0
        mappable = None
        for col, panel in enumerate(row_panels):
            for offset, (label_kind, data) in enumerate((("A", panel.attn), ("NW", panel.nw))):
                ax = axes[row][1 + 2 * col + offset]
                mappable = _overlay(ax, image, data, vmax)
                ax.set_title(f"{label_kind} token {panel.token}", fontsize=7)
        for ax in axes[row][1 + 2 * len(row_panels) :]:
            ax.set_visible(False)
        bar = fig.colorbar(mappable, ax=list(axes[row]), fraction=0.02, pad=0.01)
        bar.ax.tick_params(labelsize=6)
        bar.set_label("weight", fontsize=6)
    layers = panels[0].layers
    fig.suptitle(
        f"image-branch attention (A) vs NW weights over the generated image; mean over {len(layers)} "
        f"layer(s) and the stored heads; tokens {tokens}",
        fontsize=8,
        y=1 - 0.12 / height,
        va="top",
    )
    return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110))


def plot_token_maps(
    generated,
    token_arrays: np.ndarray,
    path: str | os.PathLike | None = None,
    *,
    tokens: Sequence[int] | None = None,
    title: str | None = None,
):
    """One panel per image token: its map laid over the generated image, with a colour bar.

    Args:
        generated: The generated :class:`PIL.Image.Image`.
        token_arrays: ``[tokens, grid_h, grid_w]`` from :func:`nw_adapter.correlate.maps.token_maps`.
        path: Also write the figure there (PNG, atomically).
        tokens: Which tokens to draw (default all).
        title: Figure title.

    Returns:
        The :class:`matplotlib.figure.Figure` (shown inline in notebooks).
    """
    from matplotlib.figure import Figure

    token_arrays = np.asarray(token_arrays)
    if token_arrays.ndim != 3:
        raise ValueError(f"token_arrays must be [tokens, grid_h, grid_w], got shape {token_arrays.shape}")
    chosen = list(range(token_arrays.shape[0])) if tokens is None else list(tokens)
    fig = Figure(figsize=(1.8 * len(chosen) + 0.8, 2.3))
    axes = fig.subplots(1, len(chosen), squeeze=False)[0]
    image = np.asarray(generated.convert("RGB"))
    vmax = float(np.max(token_arrays[chosen])) or 1.0
    mappable = None
    for ax, token in zip(axes, chosen, strict=True):
        mappable = _overlay(ax, image, token_arrays[token], vmax)
        ax.set_title(f"token {token}", fontsize=7)
    bar = fig.colorbar(mappable, ax=list(axes), fraction=0.03, pad=0.02)
    bar.ax.tick_params(labelsize=6)
    if title:
        fig.suptitle(title, fontsize=8)
    if path is not None:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110))
    return fig
