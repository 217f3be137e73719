"""Tiny random-weight models, written offline, in the folder layouts of the real ones.

The real defaults (Stable Diffusion 1.5 and the public IP-Adapter repository ``h94/IP-Adapter``)
cannot be downloaded in tests or CI. These builders write small, deterministic stand-ins with the
same folder layout and file names, so that the *same* loading code runs on both:

.. code-block:: python

    pipe = StableDiffusionPipeline.from_pretrained(save_tiny_sd15(tmp / "sd15"))
    pipe.load_ip_adapter(save_tiny_ip_adapter(tmp / "ip"), subfolder="models",
                         weight_name="ip-adapter_sd15.safetensors")

Layouts written:

- ``save_tiny_sd15``: ``model_index.json``, ``unet/``, ``vae/``, ``text_encoder/``, ``tokenizer/``,
  ``scheduler/`` (PNDM with the SD 1.5 schedule), ``feature_extractor/``; no safety checker.
- ``save_tiny_sdxl``: the SDXL layout with ``text_encoder_2/``, ``tokenizer_2/`` and an Euler
  scheduler.
- ``save_tiny_ip_adapter``: ``models/ip-adapter_sd15.safetensors`` (or
  ``ip-adapter-plus_sd15.safetensors``) and ``models/image_encoder/``; with ``sdxl=True``,
  ``sdxl_models/ip-adapter_sdxl.safetensors`` (``ip-adapter-plus_sdxl_vit-h.safetensors``) and
  ``sdxl_models/image_encoder/``. Weights use the original IP-Adapter key names
  (``image_proj.*``, ``ip_adapter.{1,3,5,...}.to_{k,v}_ip.weight``), which diffusers converts on load.

Sizes: images are 32 x 32 pixels (latents 16 x 16); the four cross-attention layers (SD 1.5
layout: down, mid and up blocks each carry IP-Adapter layers) have 2 heads of ``d_k = 16``
(32 channels) or ``d_k = 32`` (64 channels, the mid block).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import string
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = [
    "TINY_IMAGE_SIZE",
    "builder_fingerprint",
    "ip_adapter_weight_name",
    "random_ip_adapter_state_dict",
    "save_tiny_ip_adapter",
    "save_tiny_sd15",
    "save_tiny_sdxl",
    "tiny_sd15_pipeline",
    "write_once",
]

TINY_IMAGE_SIZE = 32
"""Height and width, in pixels, that the tiny pipelines generate by default."""

_BLOCK_OUT_CHANNELS = (32, 64)
_HEADS = 2
_TEXT_HIDDEN = 32
_SDXL_TEXT_HIDDEN = (32, 32)
_IMAGE_ENCODER_HIDDEN = 32
_IMAGE_ENCODER_PROJECTION = 32
_PLUS_TOKENS = 16
_PLUS_HIDDEN = 64  # the Plus resampler's width; diffusers infers heads = width // 64
_PLUS_DEPTH = 4  # diffusers rebuilds the resampler with its default depth of 4
_UNET_BLOCKS = {
    "block_out_channels": _BLOCK_OUT_CHANNELS,
    "layers_per_block": 1,
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
}

_SD15_SCHEDULE = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "steps_offset": 1,
}


def builder_fingerprint() -> str:
    """A short hash of this module's source: cache folders of tiny models are keyed by it.

    Any change to the builders (sizes, initialisation, layout) changes the fingerprint, so a
    cached tiny model is never silently reused after the code that wrote it has changed.
    """
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def ip_adapter_weight_name(variant: str = "base", *, sdxl: bool = False) -> str:
    """File name the public ``h94/IP-Adapter`` repository uses for an adapter.

    Args:
        variant: ``"base"`` (4 image tokens) or ``"plus"`` (16 resampled image tokens).
        sdxl: Whether the adapter is for SDXL.

    Returns:
        The weight file name, e.g. ``"ip-adapter_sd15.safetensors"``.
    """
    _check_variant(variant)
    names = {
        (False, "base"): "ip-adapter_sd15.safetensors",
        (False, "plus"): "ip-adapter-plus_sd15.safetensors",
        (True, "base"): "ip-adapter_sdxl.safetensors",
        (True, "plus"): "ip-adapter-plus_sdxl_vit-h.safetensors",
    }
    return names[sdxl, variant]


def _check_variant(variant: str) -> None:
    if variant not in ("base", "plus"):
        raise ValueError(f"variant must be 'base' or 'plus', got {variant!r}.")


def _tiny_tokenizer(path: Path) -> None:
    """Write a character-level CLIP tokenizer (no merges) that needs no downloaded files."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in string.ascii_lowercase + string.digits + string.punctuation:
        vocab.setdefault(char, len(vocab))
        vocab.setdefault(char + "</w>", len(vocab))
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    tokenizer.save_pretrained(path)


def text_encoder_config(hidden_size: int, vocab_size: int = 256):
    """Config of the small random CLIP text encoders of every tiny model (2 layers, 4 heads)."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=vocab_size,
        max_position_embeddings=77,
        projection_dim=hidden_size,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )


def _tiny_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=_BLOCK_OUT_CHANNELS,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=TINY_IMAGE_SIZE,
    )


def _feature_extractor():
    from transformers import CLIPImageProcessor

    # The CLIP defaults (224 px, OpenAI normalisation), as in SD 1.5's own feature_extractor.
    return CLIPImageProcessor()


def save_tiny_sd15(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """Write a tiny Stable Diffusion 1.5-layout pipeline folder.

    Args:
        path: Destination folder (created; existing files are overwritten).
        seed: Seed of the random weights; the same seed writes the same weights.

    Returns:
        The folder, ready for ``StableDiffusionPipeline.from_pretrained(path)``.

    Example:
        >>> from diffusers import StableDiffusionPipeline
        >>> pipe = StableDiffusionPipeline.from_pretrained(save_tiny_sd15("/tmp/sd15"))  # doctest: +SKIP
    """
    from diffusers import PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    path = Path(path)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=TINY_IMAGE_SIZE // 2,
        in_channels=4,
        out_channels=4,
        **_UNET_BLOCKS,
        cross_attention_dim=_TEXT_HIDDEN,
        attention_head_dim=_HEADS,  # diffusers' legacy name: the number of heads, as in SD 1.5
        norm_num_groups=32,
    )
    vae = _tiny_vae()
    text_encoder = CLIPTextModel(text_encoder_config(_TEXT_HIDDEN))
    _tiny_tokenizer(path / "tokenizer")
    from transformers import CLIPTokenizer

    pipe = StableDiffusionPipeline(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=CLIPTokenizer.from_pretrained(path / "tokenizer"),
        scheduler=PNDMScheduler(skip_prk_steps=True, **_SD15_SCHEDULE),
        safety_checker=None,
        feature_extractor=_feature_extractor(),
        image_encoder=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(path, safe_serialization=True)
    return path


def save_tiny_sdxl(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """Write a tiny Stable Diffusion XL-layout pipeline folder.

    Args:
        path: Destination folder (created; existing files are overwritten).
        seed: Seed of the random weights.

    Returns:
        The folder, ready for ``StableDiffusionXLPipeline.from_pretrained(path)``.
    """
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    path = Path(path)
    torch.manual_seed(seed)
    hidden_1, hidden_2 = _SDXL_TEXT_HIDDEN
    time_embed_dim = 8
    unet = UNet2DConditionModel(
        sample_size=TINY_IMAGE_SIZE // 2,
        in_channels=4,
        out_channels=4,
        **_UNET_BLOCKS,
        cross_attention_dim=hidden_1 + hidden_2,
        attention_head_dim=_HEADS,  # diffusers' legacy name: the number of heads, as in SD 1.5
        norm_num_groups=32,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_embed_dim,
        projection_class_embeddings_input_dim=hidden_2 + 6 * time_embed_dim,
        use_linear_projection=True,
    )
    vae = _tiny_vae()
    text_encoder = CLIPTextModel(text_encoder_config(hidden_1))
    text_encoder_2 = CLIPTextModelWithProjection(text_encoder_config(hidden_2))
    _tiny_tokenizer(path / "tokenizer")
    tokenizer = CLIPTokenizer.from_pretrained(path / "tokenizer")
    pipe = StableDiffusionXLPipeline(
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        scheduler=EulerDiscreteScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            num_train_timesteps=1000,
            steps_offset=1,
            timestep_spacing="leading",
        ),
        feature_extractor=_feature_extractor(),
        image_encoder=None,
        force_zeros_for_empty_prompt=True,
    )
    pipe.save_pretrained(path, safe_serialization=True)
    return path


def _normal(generator: torch.Generator, *shape: int, std: float | None = None) -> torch.Tensor:
    """Gaussian weights with fan-in scaling (``std = 1 / sqrt(shape[-1])`` unless given)."""
    if std is None:
        std = shape[-1] ** -0.5
    return torch.randn(*shape, generator=generator) * std


def _base_image_proj(
    generator: torch.Generator, cross_attention_dim: int, image_embed_dim: int
) -> dict[str, torch.Tensor]:
    """Original-format ``image_proj`` of the base adapter: Linear(clip_dim, 4 * cross) + LayerNorm."""
    return {
        "proj.weight": _normal(generator, 4 * cross_attention_dim, image_embed_dim),
        # A non-zero bias, as trained adapters have: the zero (unconditional) image embedding then
        # still gives 4 distinct tokens, so the CFG "uncond" half has non-constant attention rows.
        "proj.bias": _normal(generator, 4 * cross_attention_dim, std=1.0),
        "norm.weight": torch.ones(cross_attention_dim),
        "norm.bias": torch.zeros(cross_attention_dim),
    }


def _plus_image_proj(
    generator: torch.Generator, cross_attention_dim: int, image_hidden_dim: int
) -> dict[str, torch.Tensor]:
    """Original-format ``image_proj`` of the Plus adapter: a 4-layer perceiver resampler."""
    width = _PLUS_HIDDEN
    state = {
        "latents": _normal(generator, 1, _PLUS_TOKENS, width, std=width**-0.5),
        "proj_in.weight": _normal(generator, width, image_hidden_dim),
        "proj_in.bias": torch.zeros(width),
        "proj_out.weight": _normal(generator, cross_attention_dim, width),
        "proj_out.bias": _normal(generator, cross_attention_dim, std=1.0),
        "norm_out.weight": torch.ones(cross_attention_dim),
        "norm_out.bias": torch.zeros(cross_attention_dim),
    }
    for layer in range(_PLUS_DEPTH):
        prefix = f"layers.{layer}"
        for norm in ("norm1", "norm2"):
            state[f"{prefix}.0.{norm}.weight"] = torch.ones(width)
            state[f"{prefix}.0.{norm}.bias"] = torch.zeros(width)
        state[f"{prefix}.0.to_q.weight"] = _normal(generator, width, width)
        state[f"{prefix}.0.to_kv.weight"] = _normal(generator, 2 * width, width)
        state[f"{prefix}.0.to_out.weight"] = _normal(generator, width, width)
        state[f"{prefix}.1.0.weight"] = torch.ones(width)
        state[f"{prefix}.1.0.bias"] = torch.zeros(width)
        state[f"{prefix}.1.1.weight"] = _normal(generator, 4 * width, width)
        state[f"{prefix}.1.3.weight"] = _normal(generator, width, 4 * width)
    return state


def _cross_attention_hidden_sizes(unet_config: Mapping[str, Any]) -> list[int]:
    """Hidden size of each cross-attention (attn2) layer, in ``unet.attn_processors`` order.

    The order is down blocks, up blocks, then the mid block, which is how diffusers enumerates the
    processors and therefore how it numbers the original ``ip_adapter.{1,3,5,...}`` keys.
    """
    channels = list(unet_config["block_out_channels"])
    layers = unet_config["layers_per_block"]
    sizes = []
    for block, kind in enumerate(unet_config["down_block_types"]):
        if kind.startswith("CrossAttn"):
            sizes += [channels[block]] * layers
    for block, kind in enumerate(unet_config["up_block_types"]):
        if kind.startswith("CrossAttn"):
            sizes += [channels[::-1][block]] * (layers + 1)
    sizes.append(channels[-1])
    return sizes


def random_ip_adapter_state_dict(
    unet_config: Mapping[str, Any],
    *,
    variant: str = "base",
    image_embed_dim: int = 1024,
    image_hidden_dim: int = 1280,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Random IP-Adapter weights, in the original key layout, for any SD-style UNet config.

    Useful beyond the tiny model: benchmarks build the real SD 1.5 UNet with random weights and
    load these with the same conversion diffusers applies to the public checkpoints.

    Args:
        unet_config: The UNet's config (``unet.config`` works): ``block_out_channels``,
            ``layers_per_block``, ``down_block_types``, ``up_block_types``, ``cross_attention_dim``.
            One transformer layer per attention block is assumed (as in SD 1.5).
        variant: ``"base"`` or ``"plus"``.
        image_embed_dim: Width of the image encoder's projected embedding (base adapter input;
            1024 for SD 1.5's ViT-H encoder).
        image_hidden_dim: Width of the image encoder's hidden states (Plus adapter input; 1280).
        seed: Seed of the random weights.

    Returns:
        ``{"image_proj.<name>": tensor, "ip_adapter.<id>.to_k_ip.weight": tensor, ...}`` with
        ``id = 1, 3, 5, ...`` over the cross-attention layers in ``unet.attn_processors`` order.
    """
    _check_variant(variant)
    cross_attention_dim = int(unet_config["cross_attention_dim"])
    generator = torch.Generator().manual_seed(seed)
    if variant == "base":
        image_proj = _base_image_proj(generator, cross_attention_dim, image_embed_dim)
    else:
        image_proj = _plus_image_proj(generator, cross_attention_dim, image_hidden_dim)
    state = {f"image_proj.{key}": value for key, value in image_proj.items()}
    for index, hidden_size in enumerate(_cross_attention_hidden_sizes(unet_config)):
        key_id = 2 * index + 1  # the original numbering counts attn1 and attn2 layers alike
        state[f"ip_adapter.{key_id}.to_k_ip.weight"] = _normal(generator, hidden_size, cross_attention_dim)
        state[f"ip_adapter.{key_id}.to_v_ip.weight"] = _normal(generator, hidden_size, cross_attention_dim)
    return state


def save_tiny_ip_adapter(
    path: str | os.PathLike,
    *,
    variant: str = "base",
    sdxl: bool = False,
    seed: int = 0,
) -> Path:
    """Write a tiny IP-Adapter in the layout of the public ``h94/IP-Adapter`` repository.

    Several variants can be written into the same folder (they share the image encoder, whose
    weights depend on ``seed`` only).

    Args:
        path: Repository folder (created).
        variant: ``"base"`` (4 image tokens from the CLIP image embedding) or ``"plus"``
            (16 tokens resampled from the encoder's penultimate hidden states).
        sdxl: Write the SDXL adapter (``sdxl_models/``) matching :func:`save_tiny_sdxl`.
        seed: Seed of the random weights.

    Returns:
        ``path``; load with ``pipe.load_ip_adapter(path, subfolder="models",
        weight_name=ip_adapter_weight_name(variant))`` (``subfolder="sdxl_models"`` for SDXL).
    """
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    _check_variant(variant)
    path = Path(path)
    subfolder = path / ("sdxl_models" if sdxl else "models")
    subfolder.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(seed)
    encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=_IMAGE_ENCODER_HIDDEN,
            intermediate_size=2 * _IMAGE_ENCODER_HIDDEN,
            projection_dim=_IMAGE_ENCODER_PROJECTION,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=224,
            patch_size=32,
        )
    )
    encoder.save_pretrained(subfolder / "image_encoder", safe_serialization=True)

    unet_config = {**_UNET_BLOCKS, "cross_attention_dim": sum(_SDXL_TEXT_HIDDEN) if sdxl else _TEXT_HIDDEN}
    state = random_ip_adapter_state_dict(
        unet_config,
        variant=variant,
        image_embed_dim=_IMAGE_ENCODER_PROJECTION,
        image_hidden_dim=_IMAGE_ENCODER_HIDDEN,
        seed=seed + (1 if variant == "base" else 2),
    )
    weight_file = subfolder / ip_adapter_weight_name(variant, sdxl=sdxl)
    save_file({key: value.contiguous() for key, value in state.items()}, weight_file)
    (path / "README.md").write_text(
        "Tiny random-weight IP-Adapter written by nw_adapter.models.tiny for offline tests; "
        "layout of h94/IP-Adapter.\n"
    )
    (path / "nw_adapter_tiny.json").write_text(json.dumps({"seed": seed, "sdxl": sdxl}) + "\n")
    return path


@contextlib.contextmanager
def _quiet_transformers_saves() -> Iterator[None]:
    """transformers' progress bars off while a tiny model is written (its ``save_pretrained`` draws
    "Writing model shards" on stderr, above a command line's one-line messages); restored after."""
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()


def write_once(target: Path, builder: Callable[[Path], Any]) -> Path:
    """Run ``builder(tmp)`` in a sibling temporary folder and rename it to ``target`` (once); the
    builder runs with transformers' progress bars off (they would print on stderr).

    An existing ``target`` is returned as it is. The rename makes the folder appear complete or
    not at all, so concurrent processes (e.g. ``accelerate launch``) never load a half-written model.

    Args:
        target: Folder to create.
        builder: Writes the whole folder at the path it is given (e.g. :func:`save_tiny_sd15`).

    Returns:
        ``target``.
    """
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with _quiet_transformers_saves():
            builder(staging / "out")
        try:
            os.replace(staging / "out", target)
        except OSError:
            if not target.exists():  # a concurrent builder won the race otherwise
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def tiny_sd15_pipeline(
    folder: str | os.PathLike,
    *,
    variant: str = "base",
    seed: int = 0,
    pipeline_class=None,
):
    """Write (if missing) and load a tiny SD 1.5 pipeline with an IP-Adapter loaded.

    Args:
        folder: Cache folder; ``folder/sd15-seed<seed>`` and ``folder/ip-adapter-<variant>-seed<seed>``
            are written once (see :func:`write_once`).
        variant: IP-Adapter variant, ``"base"`` or ``"plus"``.
        seed: Seed of the random weights (part of the folder names, so one cache folder holds
            each seed's weights and never returns another seed's).
        pipeline_class: Pipeline class to load with (default ``StableDiffusionPipeline``); a
            companion class such as ``StableDiffusionNWPipeline`` works the same way.

    Returns:
        The loaded pipeline, on CPU in float32, with its progress bar disabled.
    """
    from diffusers import StableDiffusionPipeline

    folder = Path(folder)
    model_dir = write_once(folder / f"sd15-seed{seed}", lambda p: save_tiny_sd15(p, seed=seed))
    adapter_dir = write_once(
        folder / f"ip-adapter-{variant}-seed{seed}",
        lambda p: save_tiny_ip_adapter(p, variant=variant, seed=seed),
    )
    weight_name = ip_adapter_weight_name(variant)
    pipe = (pipeline_class or StableDiffusionPipeline).from_pretrained(model_dir)
    pipe.load_ip_adapter(adapter_dir, subfolder="models", weight_name=weight_name)
    pipe.set_progress_bar_config(disable=True)
    return pipe
