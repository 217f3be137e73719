"""The trained tiny digits model: its architecture, its shipped folder, and its adapter file format.

The model is a Stable Diffusion 1.5 pipeline and an IP-Adapter in the public folder layouts,
sized for 32 x 32 images (see ``weights/tiny_digits/MODEL_CARD.md``)::

    tiny_digits/
        model_index.json  unet/  vae/  text_encoder/  tokenizer/  scheduler/  feature_extractor/
        models/ip-adapter_sd15.safetensors  models/image_encoder/
        examples/digit_<k>.png

and loads with the standard calls::

    pipe = StableDiffusionPipeline.from_pretrained(SHIPPED_DIR, torch_dtype=torch.float32)
    pipe.load_ip_adapter(SHIPPED_DIR, subfolder="models", weight_name="ip-adapter_sd15.safetensors")

This module builds the (untrained) components; :mod:`nw_adapter.models.training` trains them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from nw_adapter.models.digits_data import IMAGE_SIZE

__all__ = [
    "ADAPTER_SUBFOLDER",
    "ADAPTER_WEIGHT_NAME",
    "CROSS_ATTENTION_DIM",
    "IMAGE_EMBED_DIM",
    "SHIPPED_DIR",
    "adapter_state_dict_from_unet",
    "build_image_encoder",
    "build_text_encoder",
    "build_unet",
    "build_vae",
    "example_image_path",
    "feature_extractor",
    "initial_adapter_state_dict",
    "noise_scheduler",
    "pipeline_scheduler",
    "save_tokenizer",
]

SHIPPED_DIR = Path(__file__).resolve().parent / "weights" / "tiny_digits"
"""The shipped, trained model folder (pipeline and adapter in one repository-like folder)."""

ADAPTER_SUBFOLDER = "models"
ADAPTER_WEIGHT_NAME = "ip-adapter_sd15.safetensors"
CROSS_ATTENTION_DIM = 32
IMAGE_EMBED_DIM = 32
_IMAGE_ENCODER_HIDDEN = 64
_IMAGE_TOKENS = 4  # the base IP-Adapter's number of image tokens

_SD15_SCHEDULE = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
}


def example_image_path(digit: int) -> Path:
    """The bundled held-out reference image of ``digit`` (``examples/digit_<digit>.png``)."""
    if digit not in range(10):
        raise ValueError(f"digit must be 0-9, got {digit!r}.")
    return SHIPPED_DIR / "examples" / f"digit_{digit}.png"


def build_vae():
    """A 3-level ``AutoencoderKL``: 32 x 32 x 3 images <-> 4 x 8 x 8 latents (about 0.7 M params)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=IMAGE_SIZE,
    )


def build_unet():
    """A ``UNet2DConditionModel`` on 4 x 8 x 8 latents with SD 1.5's block types (about 1.1 M params).

    Cross-attention (and therefore IP-Adapter) layers sit in two down blocks (one each), the mid
    block and two up blocks (two each): 7 layers; SD 1.5 has 16 in the same places.
    """
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=IMAGE_SIZE // 4,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=CROSS_ATTENTION_DIM,
        attention_head_dim=2,  # diffusers' legacy name: the number of heads, as in SD 1.5's config
        norm_num_groups=16,
    )


def build_text_encoder():
    """A small random ``CLIPTextModel`` (2 layers, width 32) for the character-level tokenizer."""
    from transformers import CLIPTextModel

    from nw_adapter.models.tiny import text_encoder_config

    config = text_encoder_config(CROSS_ATTENTION_DIM)
    return CLIPTextModel(config)


def save_tokenizer(path: str | os.PathLike) -> Path:
    """Write a character-level ``CLIPTokenizer`` (no merges; built offline, no download)."""
    import string

    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in string.ascii_lowercase + string.digits + string.punctuation:
        vocab.setdefault(char, len(vocab))
        vocab.setdefault(char + "</w>", len(vocab))
    CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77).save_pretrained(path)
    return Path(path)


def build_image_encoder():
    """A small ``CLIPVisionModelWithProjection`` on 32 x 32 images (8 x 8 patches), embedding width 32."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    config = CLIPVisionConfig(
        hidden_size=_IMAGE_ENCODER_HIDDEN,
        intermediate_size=2 * _IMAGE_ENCODER_HIDDEN,
        projection_dim=IMAGE_EMBED_DIM,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=8,
    )
    return CLIPVisionModelWithProjection(config)


def feature_extractor():
    """The ``CLIPImageProcessor`` of the image encoder: resize and crop to 32 x 32, CLIP normalisation."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )


def noise_scheduler():
    """The training scheduler: ``DDPMScheduler`` with SD 1.5's schedule, epsilon prediction."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(**_SD15_SCHEDULE, prediction_type="epsilon", clip_sample=False)


def pipeline_scheduler():
    """The shipped sampling scheduler: ``PNDMScheduler`` configured as in SD 1.5's repository."""
    from diffusers import PNDMScheduler

    return PNDMScheduler(**_SD15_SCHEDULE, skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1)


def _cross_attention_names(unet) -> list[str]:
    """Names of the cross-attention processors (``...attn2.processor``), in ``attn_processors`` order."""
    return [name for name in unet.attn_processors if name.endswith("attn2.processor")]


def initial_adapter_state_dict(unet, *, seed: int) -> dict[str, torch.Tensor]:
    """The IP-Adapter's starting weights, in the original (h94) key layout.

    As in IP-Adapter's training script, ``to_k_ip`` / ``to_v_ip`` start as copies of each layer's
    text ``to_k`` / ``to_v``; the image projection ``Linear(32, 4 * 32)`` starts random (PyTorch's
    default ``nn.Linear`` initialisation, seeded) and its LayerNorm at identity.

    Args:
        unet: The stage-1 UNet (no adapter loaded).
        seed: Seed of the projection's initialisation.

    Returns:
        ``{"image_proj.proj.weight": (128, 32), "image_proj.proj.bias": (128,),
        "image_proj.norm.{weight,bias}": (32,), "ip_adapter.{1,3,...}.to_{k,v}_ip.weight": (C, 32)}``.
    """
    generator = torch.Generator().manual_seed(seed)
    out_features = _IMAGE_TOKENS * CROSS_ATTENTION_DIM
    bound = IMAGE_EMBED_DIM**-0.5  # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    state = {
        "image_proj.proj.weight": (torch.rand(out_features, IMAGE_EMBED_DIM, generator=generator) * 2 - 1)
        * bound,
        "image_proj.proj.bias": (torch.rand(out_features, generator=generator) * 2 - 1) * bound,
        "image_proj.norm.weight": torch.ones(CROSS_ATTENTION_DIM),
        "image_proj.norm.bias": torch.zeros(CROSS_ATTENTION_DIM),
    }
    modules = dict(unet.named_modules())
    for index, name in enumerate(_cross_attention_names(unet)):
        attention = modules[name.removesuffix(".processor")]
        key_id = 2 * index + 1  # the original numbering counts self- and cross-attention layers alike
        state[f"ip_adapter.{key_id}.to_k_ip.weight"] = attention.to_k.weight.detach().clone()
        state[f"ip_adapter.{key_id}.to_v_ip.weight"] = attention.to_v.weight.detach().clone()
    return state


def adapter_state_dict_from_unet(unet) -> dict[str, torch.Tensor]:
    """Read a loaded IP-Adapter back out of a UNet, in the original (h94) key layout.

    The inverse of the conversion ``load_ip_adapter`` applies: ``encoder_hid_proj``'s
    ``ImageProjection`` (``image_embeds`` Linear, ``norm``) -> ``image_proj.{proj,norm}``; the
    ``to_k_ip[0]`` / ``to_v_ip[0]`` of the k-th cross-attention processor -> ``ip_adapter.{2k+1}``.

    Args:
        unet: A UNet with exactly one base IP-Adapter loaded.

    Returns:
        The state dict (contiguous float tensors, detached), ready for ``safetensors.save_file``.
    """
    projection = unet.encoder_hid_proj.image_projection_layers[0]
    state = {
        "image_proj.proj.weight": projection.image_embeds.weight,
        "image_proj.proj.bias": projection.image_embeds.bias,
        "image_proj.norm.weight": projection.norm.weight,
        "image_proj.norm.bias": projection.norm.bias,
    }
    processors = unet.attn_processors
    for index, name in enumerate(_cross_attention_names(unet)):
        processor = processors[name]
        state[f"ip_adapter.{2 * index + 1}.to_k_ip.weight"] = processor.to_k_ip[0].weight
        state[f"ip_adapter.{2 * index + 1}.to_v_ip.weight"] = processor.to_v_ip[0].weight
    return {key: value.detach().contiguous().clone() for key, value in state.items()}
