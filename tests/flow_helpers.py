"""Helpers shared by the tests of the tiny SD3 and Flux pipelines (imported as a plain module)."""

from __future__ import annotations

import torch
from tiny_helpers import random_image

from nw_adapter.models.tiny_flow import (
    CLIP_FOLDER,
    FLUX_IP_WEIGHT,
    SD3_IP_WEIGHT,
    SIGLIP_FOLDER,
    TINY_FLOW_IMAGE_SIZE,
)

SIZE = TINY_FLOW_IMAGE_SIZE


def load_sd3(pipeline_class, model_dir, ip_dir):
    """``pipeline_class.from_pretrained(model_dir)`` + the tiny InstantX-layout adapter, as a user would."""
    pipe = pipeline_class.from_pretrained(model_dir)
    pipe.load_ip_adapter(ip_dir, weight_name=SD3_IP_WEIGHT, image_encoder_folder=str(ip_dir / SIGLIP_FOLDER))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_flux(pipeline_class, model_dir, ip_dir, adapters: int = 1):
    """``pipeline_class.from_pretrained(model_dir)`` + ``adapters`` copies of the XLabs-layout adapter."""
    pipe = pipeline_class.from_pretrained(model_dir)
    pipe.load_ip_adapter(
        [str(ip_dir)] * adapters,
        weight_name=[FLUX_IP_WEIGHT] * adapters,
        image_encoder_pretrained_model_name_or_path=str(ip_dir / CLIP_FOLDER),
        image_encoder_dtype=torch.float32,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, *, steps: int = 2, seed: int = 0, **kwargs):
    """Run a tiny SD3 / Flux pipeline at 32 x 32 pixels with a fixed generator; returns a tensor
    ``[B, 3, H, W]`` (``output_type="pt"``) for ``torch.equal`` comparisons."""
    kwargs.setdefault("ip_adapter_image", random_image(1, SIZE))
    if "Flux" in type(pipe).__name__:
        kwargs.setdefault("max_sequence_length", 16)
    return pipe(
        kwargs.pop("prompt", "a cat"),
        num_inference_steps=steps,
        height=SIZE,
        width=SIZE,
        output_type="pt",
        generator=torch.Generator().manual_seed(seed),
        **kwargs,
    ).images
