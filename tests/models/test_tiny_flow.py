"""The tiny SD 3.5 and Flux models load through the real diffusers loading code and generate."""

from __future__ import annotations

import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline
from diffusers.models.attention_processor import SD3IPAdapterJointAttnProcessor2_0
from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor
from flow_helpers import generate, load_flux, load_sd3
from safetensors.torch import load_file
from transformers import CLIPVisionModelWithProjection, SiglipVisionModel

from nw_adapter.models.tiny_flow import FLUX_IP_WEIGHT, SD3_IP_WEIGHT


def test_sd3_adapter_file_has_instantx_key_names(tiny_sd3_ip_adapter_dir):
    state = torch.load(tiny_sd3_ip_adapter_dir / SD3_IP_WEIGHT, weights_only=True)
    assert set(state) == {"image_proj", "ip_adapter"}
    assert "layers.0.0.to_q.weight" in state["image_proj"]  # InstantX's name, converted by diffusers
    assert "layers.0.attn.to_q.weight" not in state["image_proj"]
    assert {k.split(".")[0] for k in state["ip_adapter"]} == {"0", "1"}
    assert "0.norm_ip_k.weight" in state["ip_adapter"]


def test_flux_adapter_file_has_xlabs_key_names(tiny_flux_ip_adapter_dir):
    keys = set(load_file(tiny_flux_ip_adapter_dir / FLUX_IP_WEIGHT))
    assert "ip_adapter_proj_model.proj.weight" in keys
    assert "double_blocks.0.processor.ip_adapter_double_stream_k_proj.weight" in keys


def test_sd3_loads_with_siglip_and_image_branch_matters(tiny_sd3_dir, tiny_sd3_ip_adapter_dir):
    pipe = load_sd3(StableDiffusion3Pipeline, tiny_sd3_dir, tiny_sd3_ip_adapter_dir)
    assert isinstance(pipe.image_encoder, SiglipVisionModel)
    processors = pipe.transformer.attn_processors
    ip = [n for n, p in processors.items() if isinstance(p, SD3IPAdapterJointAttnProcessor2_0)]
    # one per block; the image projection's own resampler layers keep plain processors
    assert ip == ["transformer_blocks.0.attn.processor", "transformer_blocks.1.attn.processor"]
    pipe.set_ip_adapter_scale(0.8)
    with_image = generate(pipe)
    assert with_image.shape == (1, 3, 32, 32) and torch.isfinite(with_image).all()
    pipe.set_ip_adapter_scale(0.0)
    assert not torch.equal(with_image, generate(pipe))


def test_flux_loads_with_clip_and_image_branch_matters(tiny_flux_dir, tiny_flux_ip_adapter_dir):
    pipe = load_flux(FluxPipeline, tiny_flux_dir, tiny_flux_ip_adapter_dir)
    assert isinstance(pipe.image_encoder, CLIPVisionModelWithProjection)
    processors = pipe.transformer.attn_processors
    ip = [n for n, p in processors.items() if isinstance(p, FluxIPAdapterAttnProcessor)]
    assert ip == ["transformer_blocks.0.attn.processor"]  # single-stream blocks carry no adapter
    with_image = generate(pipe)
    assert with_image.shape == (1, 3, 32, 32) and torch.isfinite(with_image).all()
    pipe.set_ip_adapter_scale(0.0)
    assert not torch.equal(with_image, generate(pipe))
