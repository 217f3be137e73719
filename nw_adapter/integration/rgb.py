"""Reference pictures as 8-bit RGB: one rule for the command line's image files
(:mod:`nw_adapter.correlate.images`) and the images a pipeline's references are encoded from
(:func:`nw_adapter.integration.latent_support.encode_references`)."""

from __future__ import annotations

import numpy as np
from PIL import Image

__all__ = ["to_rgb"]


def to_rgb(img: Image.Image) -> tuple[Image.Image, list[str]]:
    """A decoded Pillow image as 8-bit RGB, and the notes of what was done: 16-bit grayscale scaled by
    1/257, palettes and CMYK converted, an alpha channel composited over white.

    Raises:
        ValueError: a mode without a defined 8-bit scale (float, 32-bit integers beyond 16 bits) or
            one Pillow cannot convert; one line with the fix.
    """
    notes: list[str] = []
    mode = img.mode
    if mode == "RGB":
        return img, notes
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        values = np.asarray(img, dtype=np.float64)
        low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
        if mode == "I" and (low < 0 or high > 65535):
            raise ValueError(
                f"32-bit integer image with values from {low:.0f} to {high:.0f} has no defined 8-bit "
                "scale (neither 8- nor 16-bit data); save it as an 8-bit RGB PNG"
            )
        if mode == "I" and high <= 255:
            gray = values.astype(np.uint8)
            notes.append("32-bit integer grayscale with 8-bit values (0-255) converted to RGB")
        else:
            gray = np.clip(np.rint(values / 257.0), 0, 255).astype(np.uint8)
            kind = "16-bit grayscale" if mode != "I" else "32-bit integer grayscale with 16-bit values"
            notes.append(f"{kind} reduced to 8 bits (value / 257) and converted to RGB")
        return Image.fromarray(gray, mode="L").convert("RGB"), notes
    if mode == "F":
        raise ValueError(
            "floating-point image (mode F) has no defined 8-bit scale; save it as an 8-bit RGB PNG"
        )
    if mode == "P":
        if "transparency" in img.info:
            img = img.convert("RGBA")
            mode = "RGBA"
            notes.append("palette image with transparency converted to RGBA")
        else:
            notes.append("palette image converted to RGB")
            return img.convert("RGB"), notes
    if mode == "PA":
        img = img.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "LA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        notes.append(f"{mode} alpha channel composited over a white background")
        return Image.alpha_composite(background, rgba).convert("RGB"), notes
    if mode == "CMYK":
        notes.append("CMYK converted to RGB (Pillow's conversion, no ICC colour management)")
        return img.convert("RGB"), notes
    if mode in ("L", "1"):
        notes.append(f"{'grayscale' if mode == 'L' else 'bilevel'} image converted to RGB")
        return img.convert("RGB"), notes
    try:
        converted = img.convert("RGB")
    except (ValueError, OSError) as exc:
        raise ValueError(
            f"pixel mode {mode} cannot be converted to RGB ({' '.join(str(exc).split())}); save it as an "
            "8-bit RGB PNG"
        ) from None
    notes.append(f"{mode} image converted to RGB")
    return converted, notes
