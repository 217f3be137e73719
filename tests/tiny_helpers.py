"""Helpers shared by the tests that run the tiny pipelines (imported as a plain module)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from nw_adapter.models.tiny import TINY_IMAGE_SIZE, ip_adapter_weight_name

SIZE = TINY_IMAGE_SIZE


def load_sd15(model_dir, ip_dir, variant: str = "base"):
    """``StableDiffusionPipeline.from_pretrained(model_dir)`` + the tiny IP-Adapter (``"base"`` or
    ``"plus"``) in the public layout, as a user would."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(model_dir)
    pipe.load_ip_adapter(ip_dir, subfolder="models", weight_name=ip_adapter_weight_name(variant))
    pipe.set_progress_bar_config(disable=True)
    return pipe


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


def record_denoiser_timesteps(unet) -> tuple[list[float], object]:
    """Collect the timestep of every UNet forward (the test's own hook, independent of the recorder)."""
    seen: list[float] = []

    def hook(module, args, kwargs):
        t = kwargs["timestep"] if "timestep" in kwargs else args[1]
        seen.append(float(torch.as_tensor(t).reshape(-1)[0]))

    return seen, unet.register_forward_pre_hook(hook, with_kwargs=True)


def check_recorded_levels(records, scheduler, received: list[float]) -> None:
    """Every record: a timestep the UNet received, step = its index in ``scheduler.timesteps``, and
    the scheduler's own level there (``alphas_cumprod[t]`` for DDIM/PNDM/LCM, else ``sigmas[i]``)."""
    assert records, "nothing recorded"
    timesteps = scheduler.timesteps.double().tolist()
    assert {r["timestep"] for r in records} == set(received)
    assert len({r["step"] for r in records}) == len(received)  # one step per UNet forward
    sigma_schedule = getattr(scheduler, "sigmas", None) is not None
    for r in records:
        i, t = r["step"], r["timestep"]
        assert timesteps[i] == t
        if sigma_schedule:
            s = float(scheduler.sigmas[i])
            expected = (1 / math.sqrt(1 + s * s), s / math.sqrt(1 + s * s), s)
        else:
            abar = float(scheduler.alphas_cumprod[int(t)])
            expected = (math.sqrt(abar), math.sqrt(1 - abar), math.sqrt((1 - abar) / abar))
        assert (r["alpha"], r["sigma"], r["h_schedule"]) == pytest.approx(expected, rel=1e-5)
