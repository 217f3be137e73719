"""Random-weight models at the real Stable Diffusion 1.5 and SDXL shapes, with an IP-Adapter loaded.

Nothing is downloaded: the UNet has the SD 1.5 (or SDXL base) architecture and random weights,
and the IP-Adapter weights are random tensors in the original checkpoint layout (image projection
from :func:`nw_adapter.models.tiny.random_ip_adapter_state_dict`, one ``to_k_ip``/``to_v_ip`` pair
per cross-attention layer of the UNet), converted by diffusers' own loader
(``unet._load_ip_adapter_weights``), so the attention processors and the image projection are
exactly those a user of ``h94/IP-Adapter`` gets. Every builder takes a ``device`` and a ``dtype``:
the UNet is initialised directly on the device (an SDXL UNet has 2.6 B parameters).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from diffusers import UNet2DConditionModel
from diffusers.models.attention_processor import Attention, IPAdapterAttnProcessor2_0

from nw_adapter.models.tiny import random_ip_adapter_state_dict

#: The Stable Diffusion 1.5 UNet configuration (``runwayml/stable-diffusion-v1-5/unet``).
SD15_UNET_CONFIG: dict[str, Any] = {
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": (320, 640, 1280, 1280),
    "layers_per_block": 2,
    "down_block_types": (
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    ),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    "cross_attention_dim": 768,
    "attention_head_dim": 8,  # diffusers' legacy name: SD 1.5 has 8 heads in every attention layer
    "norm_num_groups": 32,
}

#: The Stable Diffusion XL base 1.0 UNet configuration (``stabilityai/stable-diffusion-xl-base-1.0/unet``):
#: 64-wide heads (5 / 10 / 20 heads), 1 / 2 / 10 transformer layers per block, 70 cross-attention layers.
SDXL_UNET_CONFIG: dict[str, Any] = {
    "sample_size": 128,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": (320, 640, 1280),
    "layers_per_block": 2,
    "transformer_layers_per_block": (1, 2, 10),
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    "cross_attention_dim": 2048,
    "attention_head_dim": (5, 10, 20),  # diffusers' legacy name: the number of heads per block
    "norm_num_groups": 32,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,  # 1280 pooled text + 6 x 256 time ids
}

#: Width of the pooled text embedding and number of time ids of SDXL's added conditioning.
SDXL_POOLED_DIM, SDXL_TIME_IDS = 1280, 6
#: Width of the CLIP ViT-bigG image embedding that the base SDXL IP-Adapter projects.
SDXL_IMAGE_EMBED_DIM = 1280

#: A toy UNet with the same block structure (used by the smoke test; seconds to build).
TOY_UNET_CONFIG: dict[str, Any] = {
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": (32, 64),
    "layers_per_block": 1,
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
    "cross_attention_dim": 32,
    "attention_head_dim": 2,
    "norm_num_groups": 32,
}

#: Width of the CLIP ViT-H image embedding that the base SD 1.5 IP-Adapter projects.
IMAGE_EMBED_DIM = 1024
#: Width of the CLIP ViT-H hidden states that the Plus adapter resamples.
IMAGE_HIDDEN_DIM = 1280


def _split_original(state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Original flat keys -> ``{"image_proj": {...}, "ip_adapter": {...}}`` (what diffusers loads)."""
    out: dict[str, dict[str, torch.Tensor]] = {"image_proj": {}, "ip_adapter": {}}
    for key, value in state.items():
        group, _, rest = key.partition(".")
        out[group][rest] = value
    return out


def _ip_layer_weights(unet: UNet2DConditionModel, seed: int) -> dict[str, torch.Tensor]:
    """Random ``ip_adapter.<id>.to_{k,v}_ip.weight`` for every cross-attention layer of ``unet``.

    Ids are 1, 3, 5, ... over the attn2 processors in ``unet.attn_processors`` order, the
    numbering diffusers' converter expects; widths come from the layers themselves, so UNets with
    several transformer layers per block (SDXL) are covered.
    """
    generator = torch.Generator().manual_seed(seed + 1)
    cross = int(unet.config.cross_attention_dim)
    state, key_id = {}, 1
    for name in unet.attn_processors:
        if name.endswith("attn1.processor"):
            continue
        hidden = unet.get_submodule(name.removesuffix(".processor")).to_q.out_features
        for proj in ("to_k_ip", "to_v_ip"):
            state[f"ip_adapter.{key_id}.{proj}.weight"] = torch.randn(hidden, cross, generator=generator) * (
                cross**-0.5
            )
        key_id += 2
    return state


def build_unet(
    config: Mapping[str, Any] = SD15_UNET_CONFIG,
    *,
    variant: str = "base",
    image_embed_dim: int = IMAGE_EMBED_DIM,
    image_hidden_dim: int = IMAGE_HIDDEN_DIM,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> UNet2DConditionModel:
    """A random-weight UNet of ``config`` with a random IP-Adapter loaded, in eval mode.

    Args:
        config: UNet2DConditionModel keyword arguments (default: SD 1.5; ``SDXL_UNET_CONFIG``).
        variant: ``"base"`` (4 image tokens) or ``"plus"`` (16 image tokens).
        image_embed_dim: input width of the base adapter's projection.
        image_hidden_dim: input width of the Plus adapter's resampler.
        seed: seed of the UNet and the adapter weights.
        device: where the UNet is initialised and kept.
        dtype: parameter dtype (e.g. ``torch.float16`` on a GPU).

    Returns:
        The UNet; its cross-attention layers use ``IPAdapterAttnProcessor2_0``.
    """
    torch.manual_seed(seed)
    with torch.device(device):
        unet = UNet2DConditionModel(**config)
    state = random_ip_adapter_state_dict(
        unet.config,
        variant=variant,
        image_embed_dim=image_embed_dim,
        image_hidden_dim=image_hidden_dim,
        seed=seed,
    )
    state = {k: v for k, v in state.items() if not k.startswith("ip_adapter.")}
    state |= _ip_layer_weights(unet, seed)
    unet._load_ip_adapter_weights([_split_original(state)], low_cpu_mem_usage=False)
    if unet.dtype != dtype:
        unet = unet.to(dtype=dtype)
    return unet.eval().requires_grad_(False)


def unet_inputs(
    unet: UNet2DConditionModel,
    *,
    latent_size: int,
    batch: int = 2,
    text_tokens: int = 77,
    variant: str = "base",
    image_embed_dim: int = IMAGE_EMBED_DIM,
    image_hidden_dim: int = IMAGE_HIDDEN_DIM,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Keyword arguments of one UNet step with classifier-free guidance (batch = [uncond; cond]).

    Args:
        unet: the UNet from :func:`build_unet`.
        latent_size: height and width of the latents (image size / 8).
        batch: UNet batch (2 = one image with CFG).
        text_tokens: text sequence length (77 for CLIP).
        variant: adapter variant the UNet was built with (sets the image-embedding shape).
        image_embed_dim: width of the base adapter's image embedding.
        image_hidden_dim: width of the Plus adapter's image hidden states.
        seed: seed of the random inputs (drawn on the CPU, then moved: the same on every device).
        device: device of the inputs (default: the UNet's).
        dtype: floating dtype of the inputs (default: the UNet's).

    Returns:
        ``{"sample", "timestep", "encoder_hidden_states", "added_cond_kwargs"}``; the image
        embedding is ``[batch, 1 image, embed_dim]`` (base) or ``[batch, 1, 257, hidden_dim]`` (plus);
        an SDXL UNet (``addition_embed_type="text_time"``) also gets ``text_embeds`` ``[batch, 1280]``
        and ``time_ids`` ``[batch, 6]``.
    """
    device = unet.device if device is None else torch.device(device)
    dtype = unet.dtype if dtype is None else dtype
    g = torch.Generator().manual_seed(seed)
    cross = unet.config.cross_attention_dim
    sample = torch.randn(batch, unet.config.in_channels, latent_size, latent_size, generator=g)
    text = torch.randn(batch, text_tokens, cross, generator=g)
    if variant == "base":
        image = torch.randn(batch, 1, image_embed_dim, generator=g)
    else:
        image = torch.randn(batch, 1, 257, image_hidden_dim, generator=g)
    added: dict[str, Any] = {"image_embeds": [image.to(device, dtype)]}
    if unet.config.addition_embed_type == "text_time":
        added["text_embeds"] = torch.randn(batch, SDXL_POOLED_DIM, generator=g).to(device, dtype)
        size = float(8 * latent_size)
        added["time_ids"] = torch.tensor([[size, size, 0.0, 0.0, size, size]] * batch).to(device, dtype)
    return {
        "sample": sample.to(device, dtype),
        "timestep": torch.tensor(501, device=device),
        "encoder_hidden_states": text.to(device, dtype),
        "added_cond_kwargs": added,
    }


def attention_layer(
    hidden: int,
    *,
    cross: int = 768,
    heads: int = 8,
    image_tokens: int = 4,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Attention, IPAdapterAttnProcessor2_0]:
    """One SD 1.5 cross-attention layer (attn2) and its stock IP-Adapter processor, random weights.

    Args:
        hidden: query width (320, 640 or 1280 in SD 1.5).
        cross: text / image token width (768).
        heads: number of heads (8).
        image_tokens: image tokens per image (4 base, 16 plus).
        seed: weight seed.
        device: device of the weights.
        dtype: dtype of the weights.

    Returns:
        ``(attn, processor)``; ``attn`` already uses ``processor``.
    """
    torch.manual_seed(seed)
    attn = Attention(hidden, cross_attention_dim=cross, heads=heads, dim_head=hidden // heads).eval()
    proc = IPAdapterAttnProcessor2_0(hidden, cross, scale=1.0, num_tokens=(image_tokens,)).eval()
    attn.set_processor(proc)
    attn.requires_grad_(False).to(device=device, dtype=dtype)
    proc.requires_grad_(False).to(device=device, dtype=dtype)
    return attn, proc


def attention_inputs(
    hidden: int,
    queries: int,
    *,
    cross: int = 768,
    batch: int = 2,
    text_tokens: int = 77,
    image_tokens: int = 4,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Inputs of one attn2 call: hidden ``[batch, queries, hidden]``, (text, [image tokens]).

    The image tokens are ``[batch, 1 image, image_tokens, cross]``, the layout produced by
    diffusers' ``MultiIPAdapterImageProjection``. Drawn on the CPU, then moved to ``device`` and
    cast to ``dtype``.
    """
    g = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(batch, queries, hidden, generator=g)
    text = torch.randn(batch, text_tokens, cross, generator=g)
    image = torch.randn(batch, 1, image_tokens, cross, generator=g)
    return {
        "hidden_states": hidden_states.to(device, dtype),
        "encoder_hidden_states": (text.to(device, dtype), [image.to(device, dtype)]),
    }
