"""The untrained-adapter control on the inputs diffusers accepts beyond the image pipelines (issue 30).

- AnimateDiff: the motion UNet repeats the projected image embeddings per frame after its
  ``encoder_hid_proj`` (where the control captures them); the control repeats its own projection
  the same way, so every IP layer records, with the keys of the per-frame repeated embeddings.
- ``image_embeds`` as one tensor (``added_cond_kwargs["image_embeds"]``), which diffusers'
  ``MultiIPAdapterImageProjection`` reads as ``[e.unsqueeze(1)]``: recorded as the list form is.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from diffusers import AnimateDiffPipeline, DDIMScheduler, MotionAdapter, StableDiffusionPipeline
from tiny_helpers import load_sd15, random_image

from nw_adapter.integration.mixin import apply_nw_processor, remove_nw_processor
from nw_adapter.integration.untrained import untrained_keys
from nw_adapter.models.tiny import TINY_IMAGE_SIZE, ip_adapter_weight_name

torch.set_num_threads(1)

FRAMES = 3


@pytest.fixture(scope="module")
def animatediff(tiny_sd15_dir, tiny_ip_adapter_dir):
    """A tiny AnimateDiff pipeline: the tiny SD 1.5 parts and a tiny MotionAdapter of the same blocks."""
    sd = StableDiffusionPipeline.from_pretrained(tiny_sd15_dir)
    torch.manual_seed(0)
    motion = MotionAdapter(
        block_out_channels=tuple(sd.unet.config.block_out_channels),
        motion_layers_per_block=1,
        motion_num_attention_heads=2,
        motion_norm_num_groups=32,
        motion_max_seq_length=8,
    )
    pipe = AnimateDiffPipeline(
        vae=sd.vae,
        text_encoder=sd.text_encoder,
        tokenizer=sd.tokenizer,
        unet=sd.unet,
        motion_adapter=motion,
        scheduler=DDIMScheduler(beta_schedule="linear", clip_sample=False),
        feature_extractor=sd.feature_extractor,
    )
    pipe.load_ip_adapter(tiny_ip_adapter_dir, subfolder="models", weight_name=ip_adapter_weight_name("base"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module", params=["base", "plus"])
def sd15(request, tiny_sd15_dir, tiny_ip_adapter_dir):
    return load_sd15(tiny_sd15_dir, tiny_ip_adapter_dir, request.param)


def _video(pipe) -> np.ndarray:
    return pipe(
        "a cat",
        num_frames=FRAMES,
        num_inference_steps=2,
        height=TINY_IMAGE_SIZE,
        width=TINY_IMAGE_SIZE,
        output_type="np",
        ip_adapter_image=random_image(1),
        generator=torch.Generator().manual_seed(0),
    ).frames


def _control(denoiser):
    return next(p.untrained_control for p in denoiser.attn_processors.values()
                if getattr(p, "untrained_control", None) is not None)  # fmt: skip


def _recorder_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "NWRecorder" in str(w.message)]


def test_animatediff_control_records_every_layer_with_per_frame_keys(animatediff) -> None:
    pipe = animatediff
    stock = _video(pipe)
    recorder = apply_nw_processor(pipe, untrained_control=True)
    control = _control(pipe.unet)
    handed: list = []
    keys = control.keys

    def spy(layer, states, *, adapter=0, draw=0):
        out = keys(layer, states, adapter=adapter, draw=draw)
        if draw == 0:
            handed.append((layer, out.clone()))
        return out

    control.keys = spy
    seen: dict = {}

    def first_embeds(module, args, kwargs):
        seen.setdefault("embeds", [e.clone() for e in kwargs["added_cond_kwargs"]["image_embeds"]])

    handle = pipe.unet.register_forward_pre_hook(first_embeds, with_kwargs=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = _video(pipe)
    finally:
        handle.remove()
        remove_nw_processor(pipe)
    assert np.array_equal(out, stock)  # observe with the control: bit-identical to stock
    assert _recorder_warnings(caught) == []
    assert recorder.skipped()["count"] == 0
    layers = set(control.adapter.key_projections)
    records = recorder.to_records()
    assert {r["layer"] for r in records} == layers
    assert all(math.isfinite(r[f"rho_control_{k}"]) for r in records for k in range(control.draws))
    for layer, got in handed[: len(layers)]:  # the first forward: the embeddings' keys, per frame
        expected = untrained_keys(control.adapter, layer, seen["embeds"]).repeat_interleave(FRAMES, dim=0)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _unet_inputs(pipe) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A CFG batch of latents, text states and the list-form image embeddings of ``pipe``."""
    g = torch.Generator().manual_seed(0)
    size = pipe.unet.config.sample_size
    latents = torch.randn(2, pipe.unet.config.in_channels, size, size, generator=g)
    text = torch.randn(2, 8, pipe.unet.config.cross_attention_dim, generator=g)
    embeds = pipe.prepare_ip_adapter_image_embeds(
        ip_adapter_image=random_image(1),
        ip_adapter_image_embeds=None,
        device=torch.device("cpu"),
        num_images_per_prompt=1,
        do_classifier_free_guidance=True,
    )
    return latents, text, embeds


def _untrained_records(pipe, image_embeds) -> tuple[list[dict], int]:
    latents, text, _ = _unet_inputs(pipe)
    recorder = apply_nw_processor(pipe, untrained_control=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # diffusers' deprecation of the tensor form
            pipe.unet(latents, 500, text, added_cond_kwargs={"image_embeds": image_embeds})
    finally:
        remove_nw_processor(pipe)
    return recorder.to_records(), recorder.skipped()["count"]


def test_image_embeds_as_one_tensor_are_read_as_diffusers_reads_them(sd15) -> None:
    _, _, embeds = _unet_inputs(sd15)
    assert embeds[0].shape[1] == 1  # [B, 1 image, (tokens,) D]
    listed, listed_skips = _untrained_records(sd15, embeds)
    tensor, tensor_skips = _untrained_records(sd15, embeds[0][:, 0])
    assert listed_skips == 0 and tensor_skips == 0
    assert listed and len(tensor) == len(listed)
    for a, b in zip(listed, tensor, strict=True):
        assert (a["layer"], a["head"], a["half"]) == (b["layer"], b["head"], b["half"])
        assert a["rho_control_0"] == b["rho_control_0"] and a["kl_control_2"] == b["kl_control_2"]
