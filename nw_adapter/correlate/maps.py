"""Attention and NW maps as arrays: per image token, aggregated over layers, heads and steps.

The recorder stores, with ``store_maps=True`` (``--store-maps`` on the command line), one pair
of maps per (call, step, layer, adapter, image): the image-branch attention ``A`` and the NW
weights ``W``, each ``[batch rows, heads (1 with head-mean), query positions, image tokens]``,
named ``call{c}/step{s}/{layer}/adapter{a}/image{i}/{attn|nw}``. Column ``k`` of a map, laid
out on the query grid, shows where in the generated image image token ``k`` is attended to.

The array helpers live in :mod:`nw_adapter.analysis.heatmaps` (with the notebook API
:func:`~nw_adapter.analysis.heatmaps.heat_maps`); this module adds reading the file:

- :func:`load_maps` reads ``maps.safetensors`` (or takes :meth:`NWRecorder.maps`' dict);
- :func:`token_maps` gives ``[tokens, grid_h, grid_w]`` for one kind (``attn`` or ``nw``),
  averaged over the selected steps, layers and heads; layers of coarser grids are upsampled
  (nearest, an exact integer factor) to the finest selected grid first;
- :func:`upsample` brings such a map to the generated image's pixels.

Figures: :meth:`TokenHeatMaps.plot_overlay <nw_adapter.analysis.heatmaps.TokenHeatMaps.plot_overlay>`
(one panel per token over an image) and :func:`nw_adapter.correlate.plotting.plot_attention_maps`.

Example:
    >>> from nw_adapter.correlate.maps import load_maps
    >>> from nw_adapter.analysis.heatmaps import heat_maps
    >>> from PIL import Image
    >>> maps = load_maps("out/images/<key>/maps.safetensors")  # doctest: +SKIP
    >>> image = Image.open("out/images/<key>/generated.png")  # doctest: +SKIP
    >>> attn = heat_maps(maps, "attn", image_hw=(image.height, image.width))  # doctest: +SKIP
    >>> attn.plot_overlay(image).savefig("attention.png")  # doctest: +SKIP
"""

from __future__ import annotations

import os

import numpy as np

from nw_adapter.analysis.heatmaps import (
    MAP_NAME,
    MapKey,
    parse_map_name,
    query_grid,
    select_maps,
    token_maps,
    upsample,
)

__all__ = [
    "MAP_NAME",
    "MapKey",
    "load_maps",
    "parse_map_name",
    "query_grid",
    "select_maps",
    "token_maps",
    "upsample",
]


def load_maps(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a ``maps.safetensors`` file as ``{name: float32 array [B, H, rows, tokens]}``."""
    from safetensors.numpy import load_file

    return {name: np.asarray(array, dtype=np.float32) for name, array in load_file(str(path)).items()}
