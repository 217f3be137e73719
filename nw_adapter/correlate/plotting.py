"""Figures of the command line: ``rho.png`` and the attention-map figure.

Both use :class:`matplotlib.figure.Figure` directly (the Agg canvas), so importing this module
never changes the global pyplot backend of a user's session.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nw_adapter.atomic import atomic_write

BLOCKS: tuple[str, ...] = ("down", "mid", "up")
_COLORS = {"down": "#1f77b4", "mid": "#2ca02c", "up": "#d62728", "other": "#7f7f7f"}


def _series(rows: Sequence[dict], key: str) -> np.ndarray:
    return np.array([np.nan if r.get(key) is None else float(r[key]) for r in rows], dtype=float)


def plot_rho(block_rows: Sequence[dict], path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Draw rho against timestep, one panel per UNet block, with the band of the three nulls.

    Args:
        block_rows: ``rho.json``'s ``blocks`` rows (keys ``block``, ``timestep``, ``rho``,
            ``rho_perm_null``, ``rho_norm_matched_null``, ``rho_spread_null``), see
            :func:`nw_adapter.correlate.report.aggregate`.
        path: Output PNG (written atomically).
        title: Figure title.

    Returns:
        ``path``. The band spans, per step, from the lowest to the highest of the permutation,
        norm-matched and q.k-spread nulls: a rho inside or below it is not evidence.
    """
    from matplotlib.figure import Figure

    present = [b for b in (*BLOCKS, "other") if any(r.get("block") == b for r in block_rows)]
    if not present:
        raise ValueError("block_rows: no rows with a block; nothing to plot (did the run record any layer?)")
    fig = Figure(figsize=(3.2 * len(present) + 0.6, 3.4))
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.16, top=0.82, wspace=0.1)
    axes = fig.subplots(1, len(present), sharey=True, squeeze=False)[0]
    for ax, block in zip(axes, present, strict=True):
        rows = sorted((r for r in block_rows if r.get("block") == block), key=lambda r: -float(r["timestep"]))
        t = _series(rows, "timestep")
        rho = _series(rows, "rho")
        perm, norm = _series(rows, "rho_perm_null"), _series(rows, "rho_norm_matched_null")
        spread = _series(rows, "rho_spread_null")
        low, high = np.fmin(np.fmin(perm, norm), spread), np.fmax(np.fmax(perm, norm), spread)
        color = _COLORS[block]
        ax.fill_between(t, low, high, color="0.6", alpha=0.35, linewidth=0, label="null band")
        ax.plot(t, rho, marker="o", markersize=3, color=color, label=f"rho ({block})")
        ax.axhline(0.0, color="0.3", linewidth=0.6)
        ax.set_xlim(max(1000.0, float(np.nanmax(t))), min(0.0, float(np.nanmin(t))))
        ax.set_xticks([750, 500, 250])
        ax.set_ylim(-0.2, 1.05)
        ax.set_xlabel("timestep (denoising ->)")
        ax.set_title(f"{block} block")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=7)
    axes[0].set_ylabel("Spearman rho (attention vs NW)")
    if title:
        fig.suptitle(title, fontsize=9)
    return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110))


@dataclass(frozen=True)
class MapPanel:
    """One step's image-branch attention and NW weights for one image token.

    Attributes:
        step: Denoising step index.
        timestep: The step's timestep.
        token: Index of the image token (key).
        attn: Attention weight of every query position on that key, ``[grid_h, grid_w]``.
        nw: NW weight of every query position on that key, ``[grid_h, grid_w]``.
        layer: Attention-processor name the maps come from.
    """

    step: int
    timestep: float
    token: int
    attn: np.ndarray
    nw: np.ndarray
    layer: str


_MAP_NAME = re.compile(r"^call(\d+)/step(\d+)/(.+)/adapter(\d+)/image(\d+)/(attn|nw)$")


def panels_from_maps(
    maps: Mapping[str, object],
    *,
    timesteps: Mapping[int, float],
    image_hw: tuple[int, int],
    cfg: bool,
    max_tokens: int = 4,
) -> list[MapPanel]:
    """Turn the recorder's stored maps into plot panels.

    Takes, per stored step, the maps of the layer with the finest query grid (ties: the
    first name in sorted order), the conditional batch row under CFG (the last row), the
    mean over stored heads, and the ``max_tokens`` image tokens with the largest mean
    attention.

    Args:
        maps: :meth:`NWRecorder.maps` output, names
            ``call{c}/step{s}/{layer}/adapter{a}/image{i}/{attn|nw}`` -> ``[B, H, rows, keys]``.
        timesteps: Step index -> timestep.
        image_hw: ``(height, width)`` of the generated image (for the grid's aspect ratio).
        cfg: Whether the batch is ``[uncond; cond]``.
        max_tokens: Image tokens shown per step.

    Returns:
        Panels sorted by step, then token.
    """
    by_step: dict[int, dict[str, dict[str, np.ndarray]]] = {}
    for name, tensor in maps.items():
        match = _MAP_NAME.match(name)
        if not match or match.group(4) != "0" or match.group(5) != "0":
            continue
        array = np.asarray(tensor.float().cpu() if hasattr(tensor, "float") else tensor, dtype=np.float64)
        by_step.setdefault(int(match.group(2)), {}).setdefault(match.group(3), {})[match.group(6)] = array
    panels: list[MapPanel] = []
    for step in sorted(by_step):
        layers = {k: v for k, v in by_step[step].items() if "attn" in v and "nw" in v}
        if not layers:
            continue
        layer = min(sorted(layers), key=lambda name: -layers[name]["attn"].shape[2])
        attn, nw = (layers[layer][kind][-1 if cfg else 0].mean(axis=0) for kind in ("attn", "nw"))
        rows = attn.shape[0]
        grid_h = max(1, round(math.sqrt(rows * image_hw[0] / image_hw[1])))
        grid_w = rows // grid_h
        if grid_h * grid_w != rows:
            grid_h, grid_w = rows, 1
        order = np.argsort(-attn.mean(axis=0), kind="stable")[:max_tokens]
        for token in sorted(int(k) for k in order):
            panels.append(
                MapPanel(
                    step=step,
                    timestep=float(timesteps.get(step, math.nan)),
                    token=token,
                    attn=attn[:, token].reshape(grid_h, grid_w),
                    nw=nw[:, token].reshape(grid_h, grid_w),
                    layer=layer,
                )
            )
    return panels


def plot_attention_maps(generated, panels: Sequence[MapPanel], path: str | os.PathLike) -> Path:
    """Image-branch attention maps beside NW maps, over the generated image.

    One row per step; per image token two columns: the attention weights A[:, token] and the
    NW weights W[:, token] over the query grid, upsampled (nearest) and laid over the image.

    Args:
        generated: The generated :class:`PIL.Image.Image`.
        panels: Output of :func:`panels_from_maps`.
        path: Output PNG (written atomically).
    """
    from matplotlib.figure import Figure

    if not panels:
        raise ValueError("panels: no stored maps to draw; run with --store-maps on at least one step")
    steps = sorted({p.step for p in panels})
    tokens = sorted({p.token for p in panels}, key=int)
    per_step = {s: [p for p in panels if p.step == s] for s in steps}
    ncols = 1 + 2 * max(len(v) for v in per_step.values())
    height = 1.75 * len(steps) + 0.7  # inches; the top 0.65 in hold the figure title above row titles
    fig = Figure(figsize=(1.6 * ncols, height))
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.02, top=1 - 0.65 / height, wspace=0.06, hspace=0.22)
    axes = fig.subplots(len(steps), ncols, squeeze=False)
    image = np.asarray(generated.convert("RGB"))
    extent = (0, image.shape[1], image.shape[0], 0)
    for row, step in enumerate(steps):
        row_panels = per_step[step]
        axes[row][0].imshow(image, extent=extent)
        axes[row][0].set_title(f"step {step}, t={row_panels[0].timestep:.0f}", fontsize=7)
        vmax = max(float(np.max(p.attn)) for p in row_panels) or 1.0
        vmax = max(vmax, max(float(np.max(p.nw)) for p in row_panels))
        for col, panel in enumerate(row_panels):
            for offset, (label, data) in enumerate((("A", panel.attn), ("NW", panel.nw))):
                ax = axes[row][1 + 2 * col + offset]
                ax.imshow(image, extent=extent)
                ax.imshow(
                    data,
                    extent=extent,
                    cmap="inferno",
                    alpha=0.6,
                    vmin=0.0,
                    vmax=vmax,
                    interpolation="nearest",
                )
                ax.set_title(f"{label} token {panel.token}", fontsize=7)
        for ax in axes[row]:
            ax.set_xticks([])
            ax.set_yticks([])
        for ax in axes[row][1 + 2 * len(row_panels) :]:
            ax.set_visible(False)
    fig.suptitle(
        f"image-branch attention (A) vs NW weights, layer {panels[0].layer}, tokens {tokens}",
        fontsize=8,
        y=1 - 0.12 / height,
        va="top",
    )
    return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110))
