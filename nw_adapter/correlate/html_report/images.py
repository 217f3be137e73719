"""Images in the report: small PNG / JPEG data URIs, and maps brought to a bounded grid.

Bounds (so a report's size follows its content, not the model's resolution):

- :data:`IMAGE_CAP`: an image's longer side in the report, in pixels (a 512 x 512 generation is
  embedded at 128 x 128; the tiny model's 32 x 32 as it is);
- :data:`MAP_GRID_CAP`: a heat map's longer side, in query positions (SD 1.5's 64 x 64 latent grid
  is averaged 2 x 2 to 32 x 32).
"""

from __future__ import annotations

import base64
import io
import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["IMAGE_CAP", "MAP_GRID_CAP", "data_uri", "grey", "pool_to_cap", "read_image", "thumbnail"]

IMAGE_CAP = 128
"""Longest side (pixels) of every image embedded in a report."""

MAP_GRID_CAP = 32
"""Longest side (query positions) of every heat map in a report; larger grids are mean-pooled by an
integer factor."""

JPEG_FROM = 64
"""Images larger than this (longer side, after the cap) are embedded as JPEG (quality 85), smaller
ones as PNG (a 32 x 32 digit is smaller as PNG and keeps its pixels exact)."""


def thumbnail(image: Any, cap: int = IMAGE_CAP) -> Any:
    """``image`` (PIL, or an ``(H, W, 3)`` array in [0, 1] or uint8) as an RGB PIL image whose longer
    side is at most ``cap`` pixels (Lanczos; never enlarged)."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        array = np.asarray(image)
        if array.dtype != np.uint8:
            array = (np.clip(array, 0.0, 1.0) * 255.0).round().astype(np.uint8)
        image = Image.fromarray(array)
    image = image.convert("RGB")
    longer = max(image.size)
    if longer > cap:
        scale = cap / longer
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        image = image.resize(size, Image.Resampling.LANCZOS)
    return image


def grey(image: Any) -> Any:
    """The RGB image as grey RGB (what the heat maps are drawn over)."""
    return image.convert("L").convert("RGB")


def data_uri(image: Any, cap: int = IMAGE_CAP) -> str:
    """A ``data:image/png;base64,...`` (or JPEG above :data:`JPEG_FROM` pixels) URI of
    :func:`thumbnail` of ``image``."""
    small = thumbnail(image, cap)
    buffer = io.BytesIO()
    if max(small.size) > JPEG_FROM:
        small.save(buffer, format="JPEG", quality=85)
        kind = "jpeg"
    else:
        small.save(buffer, format="PNG", optimize=True)
        kind = "png"
    return f"data:image/{kind};base64,{base64.b64encode(buffer.getvalue()).decode('ascii')}"


def read_image(path: str | Path) -> Any | None:
    """The image at ``path`` as RGB, or None when it cannot be read (a moved or removed file)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as handle:
            return handle.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError):
        return None


def pool_to_cap(grid: np.ndarray, cap: int = MAP_GRID_CAP) -> np.ndarray:
    """``grid`` ``[..., h, w]`` mean-pooled by the smallest integer factor f with max(h, w) / f <= cap
    (the last rows / columns that do not fill a block are averaged on their own)."""
    h, w = grid.shape[-2:]
    factor = math.ceil(max(h, w) / cap)
    if factor <= 1:
        return grid
    rows, cols = math.ceil(h / factor), math.ceil(w / factor)
    padded = np.full((*grid.shape[:-2], rows * factor, cols * factor), np.nan, dtype=np.float64)
    padded[..., :h, :w] = grid
    blocks = padded.reshape(*grid.shape[:-2], rows, factor, cols, factor)
    return np.nanmean(blocks, axis=(-3, -1))
