"""Helpers shared by the tests that run the tiny pipelines (imported as a plain module)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from nw_adapter.models.tiny import TINY_IMAGE_SIZE

SIZE = TINY_IMAGE_SIZE


def random_image(seed: int = 1, size: int = SIZE) -> Image.Image:
    """A seeded RGB noise image of ``size x size`` pixels (a stand-in reference image)."""
    pixels = np.random.RandomState(seed).rand(size, size, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def generate(pipe, *, prompt: str = "a cat", steps: int = 2, output_type: str = "np", **kwargs):
    """Run ``pipe`` at the tiny size with a fixed generator; returns ``.images``.

    ``ip_adapter_image`` defaults to ``random_image(1)``; other keyword arguments go to the call.
    """
    kwargs.setdefault("ip_adapter_image", random_image(1))
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt,
        num_inference_steps=steps,
        height=SIZE,
        width=SIZE,
        output_type=output_type,
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    ).images
