"""Attention and NW maps as arrays: per image token, aggregated over layers, heads and steps.

The recorder stores, with ``store_maps=True`` (``--store-maps`` on the command line), one pair
of maps per (call, step, layer, adapter, image): the image-branch attention ``A`` and the NW
weights ``W``, each ``[batch rows, heads (1 with head-mean), query positions, image tokens]``,
named ``call{c}/step{s}/{layer}/adapter{a}/image{i}/{attn|nw}``. Column ``k`` of a map, laid
out on the query grid, shows where in the generated image image token ``k`` is attended to.

These helpers turn them into plain numpy arrays on one grid:

- :func:`load_maps` reads ``maps.safetensors`` (or takes :meth:`NWRecorder.maps`' dict);
- :func:`token_maps` gives ``[tokens, grid_h, grid_w]`` for one kind (``attn`` or ``nw``),
  averaged over the selected steps, layers and heads; layers of coarser grids are upsampled
  (nearest, an exact integer factor) to the finest selected grid first;
- :func:`upsample` brings such a map to the generated image's pixels.

Figures: :func:`nw_adapter.correlate.plotting.plot_token_maps` (one panel per token, over the
image, with a colour bar) and :func:`nw_adapter.correlate.plotting.plot_attention_maps`.

Example:
    >>> from nw_adapter.correlate.maps import load_maps, token_maps
    >>> from nw_adapter.correlate.plotting import plot_token_maps
    >>> from PIL import Image
    >>> maps = load_maps("out/images/<key>/maps.safetensors")  # doctest: +SKIP
    >>> image = Image.open("out/images/<key>/generated.png")  # doctest: +SKIP
    >>> attn = token_maps(maps, "attn", image_hw=(image.height, image.width))  # [tokens, gh, gw]
    >>> plot_token_maps(image, attn, "attention.png", title="A, mean over layers, heads, steps")
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

MAP_NAME = re.compile(r"^call(\d+)/step(\d+)/(.+)/adapter(\d+)/image(\d+)/(attn|nw)$")
"""Names of the stored maps (see the module docstring)."""


@dataclass(frozen=True)
class MapKey:
    """Where one stored map comes from."""

    call: int
    step: int
    layer: str
    adapter: int
    image: int
    kind: str  # "attn" or "nw"


def parse_map_name(name: str) -> MapKey | None:
    """The :class:`MapKey` of a stored map's name, or None for other names."""
    match = MAP_NAME.match(name)
    if not match:
        return None
    call, step, layer, adapter, image, kind = match.groups()
    return MapKey(int(call), int(step), layer, int(adapter), int(image), kind)


def load_maps(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a ``maps.safetensors`` file as ``{name: float32 array [B, H, rows, tokens]}``."""
    from safetensors.numpy import load_file

    return {name: np.asarray(array, dtype=np.float32) for name, array in load_file(str(path)).items()}


def _as_array(value: object) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor (NWRecorder.maps())
        value = value.detach().float().cpu().numpy()
    return np.asarray(value, dtype=np.float64)


def query_grid(rows: int, image_hw: tuple[int, int]) -> tuple[int, int]:
    """``(grid_h, grid_w)`` with ``grid_h * grid_w == rows`` and the image's aspect ratio.

    Raises:
        ValueError: No integer grid of that aspect ratio has ``rows`` cells.
    """
    grid_h = max(1, round(math.sqrt(rows * image_hw[0] / image_hw[1])))
    grid_w = rows // grid_h
    if grid_h * grid_w != rows:
        raise ValueError(
            f"maps: {rows} query positions do not form a grid of the image's aspect ratio {image_hw}; "
            "pass image_hw=(height, width) of the generated image"
        )
    return grid_h, grid_w


def upsample(array: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Nearest-neighbour upsampling of ``[..., h, w]`` to ``[..., H, W]`` (H, W multiples of h, w)."""
    h, w = array.shape[-2:]
    fy, fx = shape[0] // h, shape[1] // w
    if fy * h != shape[0] or fx * w != shape[1]:
        raise ValueError(f"upsample: {shape} is not an integer multiple of {(h, w)}")
    return np.repeat(np.repeat(array, fy, axis=-2), fx, axis=-1)


def select_maps(
    maps: Mapping[str, object],
    kind: str = "attn",
    *,
    steps: Collection[int] | None = None,
    layers: Collection[str] | None = None,
    adapter: int = 0,
    image: int = 0,
) -> dict[MapKey, np.ndarray]:
    """The stored maps of one kind, filtered by step and by layer-name prefix, as arrays."""
    if kind not in ("attn", "nw"):
        raise ValueError(f"kind must be 'attn' or 'nw', got {kind!r}")
    chosen = {}
    for name, value in maps.items():
        key = parse_map_name(name)
        if key is None or key.kind != kind or key.adapter != adapter or key.image != image:
            continue
        if steps is not None and key.step not in steps:
            continue
        if layers is not None and not any(key.layer.startswith(prefix) for prefix in layers):
            continue
        chosen[key] = _as_array(value)
    return chosen


def token_maps(
    maps: Mapping[str, object],
    kind: str = "attn",
    *,
    image_hw: tuple[int, int],
    steps: Collection[int] | None = None,
    layers: Collection[str] | None = None,
    heads: Collection[int] | None = None,
    batch_row: int = -1,
    adapter: int = 0,
    image: int = 0,
) -> np.ndarray:
    """Per-token maps ``[tokens, grid_h, grid_w]`` averaged over steps, layers and heads.

    For each selected map ``M`` (``[B, H, rows, tokens]``): the batch row ``batch_row`` (the
    last, i.e. the conditional half under classifier-free guidance), the mean over ``heads``
    (all stored heads by default; head-averaged maps have one), reshaped to its query grid and
    upsampled to the finest selected grid; then the mean over all selected (step, layer) maps.
    ``out[k, y, x]`` is the weight query position ``(y, x)`` gives image token ``k``.

    Args:
        maps: ``load_maps(...)`` or ``NWRecorder.maps()``.
        kind: ``"attn"`` (attention A) or ``"nw"`` (NW weights W).
        image_hw: ``(height, width)`` of the generated image (for the grid's aspect ratio).
        steps: Step indices to average (default: all stored).
        layers: Layer-name prefixes to average (default: all stored).
        heads: Head positions within the stored head axis (default: all).
        batch_row: Batch row (default -1, the conditional row under CFG).
        adapter, image: IP-Adapter and adapter-image index.

    Raises:
        ValueError: Nothing matches the selection.
    """
    chosen = select_maps(maps, kind, steps=steps, layers=layers, adapter=adapter, image=image)
    if not chosen:
        raise ValueError(
            f"token_maps: no stored {kind} maps match steps={steps}, layers={layers}; "
            "check the selection against the stored names (call{c}/step{s}/{layer}/...)"
        )
    grids = {}
    for key, array in chosen.items():
        head_axis = array[batch_row]  # [H, rows, tokens]
        if heads is not None:
            head_axis = head_axis[sorted(heads)]
        mean = head_axis.mean(axis=0)  # [rows, tokens]
        gh, gw = query_grid(mean.shape[0], image_hw)
        grids[key] = mean.T.reshape(mean.shape[1], gh, gw)
    finest = max((g.shape[1:] for g in grids.values()), key=lambda s: s[0] * s[1])
    stacked = np.stack([upsample(g, finest) for g in grids.values()])
    return stacked.mean(axis=0)

