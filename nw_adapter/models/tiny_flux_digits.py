"""The trained tiny Flux digits model: its architecture, its shipped folder and its adapter file.

A Flux pipeline and an XLabs-layout IP-Adapter, sized for 32 x 32 digits (see
``weights/tiny_flux_digits/MODEL_CARD.md``)::

    tiny_flux_digits/
        model_index.json  transformer/  vae/  text_encoder/  tokenizer/  text_encoder_2/
        tokenizer_2/  scheduler/  feature_extractor/
        ip-adapter/ip_adapter.safetensors     (keys of XLabs-AI/flux-ip-adapter)
        ip-adapter/image_encoder/             (CLIPVisionModelWithProjection, as openai/clip-vit-*)

loaded with the standard calls::

    pipe = FluxPipeline.from_pretrained(SHIPPED_DIR)
    pipe.load_ip_adapter(
        SHIPPED_DIR / "ip-adapter", weight_name="ip_adapter.safetensors",
        image_encoder_pretrained_model_name_or_path=str(SHIPPED_DIR / IMAGE_ENCODER_SUBFOLDER),
        image_encoder_dtype=torch.float32)
    image = pipe("a photograph", ip_adapter_image=[[ref_1, ref_2]], height=32, width=32,
                 max_sequence_length=TEXT_TOKENS).images[0]

The VAE, the CLIP text encoder (pooled prompt) and the CLIP image encoder are the trained,
frozen parts of the tiny SD 1.5 digits model (:mod:`~nw_adapter.models.tiny_digits`), reused as
the real family reuses pretrained encoders and autoencoders; the transformer and the adapter are
trained by :mod:`nw_adapter.models.training.flux`. The T5 encoder (``text_encoder_2``) is random
and frozen, trained with prompts padded to :data:`TEXT_TOKENS` tokens: like FLUX.1-schnell
(``max_sequence_length=256``), the model is called with ``max_sequence_length=TEXT_TOKENS``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = [
    "ADAPTER_SUBFOLDER",
    "ADAPTER_WEIGHT_NAME",
    "IMAGE_ENCODER_SUBFOLDER",
    "IMAGE_TOKENS",
    "QUALITY_TRUE_CFG_SCALE",
    "REUSED_PARTS",
    "SHIPPED_DIR",
    "TEXT_TOKENS",
    "adapter_state_dict_from_transformer",
    "build_t5_encoder",
    "build_transformer",
    "held_out_flow_losses",
    "initial_adapter_state_dict",
    "load_pipeline",
    "pipeline_scheduler",
    "save_t5_tokenizer",
    "set_default_size",
]

SHIPPED_DIR = Path(__file__).resolve().parent / "weights" / "tiny_flux_digits"
"""The shipped, trained model folder (pipeline, adapter and image encoder in one folder)."""

ADAPTER_SUBFOLDER = "ip-adapter"
ADAPTER_WEIGHT_NAME = "ip_adapter.safetensors"
"""The weight file name of ``XLabs-AI/flux-ip-adapter``."""
IMAGE_ENCODER_SUBFOLDER = "ip-adapter/image_encoder"

TEXT_TOKENS = 32
"""T5 sequence length the model was trained with: pass ``max_sequence_length=TEXT_TOKENS``."""

QUALITY_TRUE_CFG_SCALE = 5.0
"""The true classifier-free guidance the model's quality is measured at (``true_cfg_scale`` with
``negative_prompt=""``; see the model card: chosen on a 20-reference pilot)."""

IMAGE_TOKENS = 4
"""Image tokens per reference image (the XLabs adapter's ``ImageProjection``: 4 tokens)."""

REUSED_PARTS = ("vae", "text_encoder", "tokenizer", "models/image_encoder")
"""Folders of the shipped tiny SD 1.5 digits model reused, frozen, by this model."""

LATENT_CHANNELS = 4  # the reused VAE's: 32 x 32 x 3 <-> 4 x 8 x 8, packed 2 x 2 into 16 tokens of 16
TEXT_WIDTH = 32  # the reused CLIP text encoder's width (pooled prompt) and the T5's width
IMAGE_EMBED_DIM = 32  # the reused CLIP image encoder's projection width
_HEADS, _HEAD_DIM = 4, 16


def build_transformer(double_blocks: int = 2):
    """A ``FluxTransformer2DModel``: ``double_blocks`` double-stream (default 2, the adapter attaches
    to each) and 2 single-stream blocks, 4 heads of 16.

    No guidance embedding (as FLUX.1-schnell; guidance is classifier-free, ``true_cfg_scale``):
    about 0.46 M parameters with 2 double blocks, on the 16 packed tokens (16 channels) of an
    8 x 8 x 4 latent.
    """
    if double_blocks < 1:
        raise ValueError(f"double_blocks must be >= 1, got {double_blocks}")
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,
        num_layers=double_blocks,
        num_single_layers=2,
        attention_head_dim=_HEAD_DIM,
        num_attention_heads=_HEADS,
        joint_attention_dim=TEXT_WIDTH,
        pooled_projection_dim=TEXT_WIDTH,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )


def build_t5_encoder(seed: int):
    """The random, frozen ``T5EncoderModel`` (1 layer, width 32) of ``text_encoder_2``.

    The random test Flux's T5 (:func:`~nw_adapter.models.tiny_flow.t5_encoder`), drawn after
    ``torch.manual_seed(seed)``.
    """
    from nw_adapter.models.tiny_flow import t5_encoder

    torch.manual_seed(seed)
    return t5_encoder(TEXT_WIDTH).eval()


def save_t5_tokenizer(path: str | os.PathLike) -> Path:
    """Write a character-level T5 (unigram) tokenizer, ``model_max_length = TEXT_TOKENS`` (offline).

    The random test Flux's tokenizer (:func:`~nw_adapter.models.tiny_flow.save_char_t5_tokenizer`).
    """
    from nw_adapter.models.tiny_flow import save_char_t5_tokenizer

    return save_char_t5_tokenizer(path, model_max_length=TEXT_TOKENS)


def pipeline_scheduler():
    """``FlowMatchEulerDiscreteScheduler`` configured as FLUX.1-dev's (dynamic shifting).

    The random test Flux's (:func:`~nw_adapter.models.tiny_flow.flux_dev_scheduler`).
    """
    from nw_adapter.models.tiny_flow import flux_dev_scheduler

    return flux_dev_scheduler()


def _double_blocks(transformer) -> list[str]:
    """Attention-processor names of the double-stream blocks (the ones the adapter attaches to)."""
    return [name for name in transformer.attn_processors if name.startswith("transformer_blocks.")]


def initial_adapter_state_dict(transformer, *, seed: int) -> dict[str, torch.Tensor]:
    """The adapter's starting weights in the XLabs key layout.

    The projection and ``to_k_ip`` start from ``nn.Linear``'s default initialisation (seeded),
    ``to_v_ip`` at zero: the untrained adapter adds nothing, so training starts from the working
    stage-1 model (the role of h94's copy of the text branch's ``to_k`` / ``to_v``, which Flux's
    text keys, computed from another input width, cannot play).

    Returns:
        ``{"ip_adapter_proj_model.proj.{weight,bias}": (4 * 32, 32), (128,),
        "ip_adapter_proj_model.norm.{weight,bias}": (32,) (identity LayerNorm),
        "double_blocks.<i>.processor.ip_adapter_double_stream_{k,v}_proj.{weight,bias}": (64, 32), (64,)}``.
    """
    generator = torch.Generator().manual_seed(seed)

    def uniform(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=generator) * 2 - 1) * fan_in**-0.5

    cross, inner = transformer.config.joint_attention_dim, transformer.inner_dim
    state = {
        "ip_adapter_proj_model.proj.weight": uniform(
            IMAGE_TOKENS * cross, IMAGE_EMBED_DIM, fan_in=IMAGE_EMBED_DIM
        ),
        "ip_adapter_proj_model.proj.bias": uniform(IMAGE_TOKENS * cross, fan_in=IMAGE_EMBED_DIM),
        "ip_adapter_proj_model.norm.weight": torch.ones(cross),
        "ip_adapter_proj_model.norm.bias": torch.zeros(cross),
    }
    for block in range(len(_double_blocks(transformer))):
        prefix = f"double_blocks.{block}.processor.ip_adapter_double_stream"
        state[f"{prefix}_k_proj.weight"] = uniform(inner, cross, fan_in=cross)
        state[f"{prefix}_k_proj.bias"] = uniform(inner, fan_in=cross)
        state[f"{prefix}_v_proj.weight"] = torch.zeros(inner, cross)
        state[f"{prefix}_v_proj.bias"] = torch.zeros(inner)
    return state


def adapter_state_dict_from_transformer(transformer) -> dict[str, torch.Tensor]:
    """Read a loaded adapter back out of a transformer, in the XLabs key layout.

    The inverse of the conversion ``load_ip_adapter`` applies: ``encoder_hid_proj``'s
    ``ImageProjection`` (``image_embeds``, ``norm``) -> ``ip_adapter_proj_model.{proj,norm}``;
    ``to_{k,v}_ip[0]`` of the i-th double block ->
    ``double_blocks.<i>.processor.ip_adapter_double_stream_{k,v}_proj``.

    Args:
        transformer: A ``FluxTransformer2DModel`` with exactly one adapter loaded.
    """
    projection = transformer.encoder_hid_proj.image_projection_layers[0]
    state = {
        "ip_adapter_proj_model.proj.weight": projection.image_embeds.weight,
        "ip_adapter_proj_model.proj.bias": projection.image_embeds.bias,
        "ip_adapter_proj_model.norm.weight": projection.norm.weight,
        "ip_adapter_proj_model.norm.bias": projection.norm.bias,
    }
    processors = transformer.attn_processors
    for block, name in enumerate(_double_blocks(transformer)):
        prefix = f"double_blocks.{block}.processor.ip_adapter_double_stream"
        for kind, layers in (("k", processors[name].to_k_ip), ("v", processors[name].to_v_ip)):
            state[f"{prefix}_{kind}_proj.weight"] = layers[0].weight
            state[f"{prefix}_{kind}_proj.bias"] = layers[0].bias
    return {key: value.detach().float().contiguous().clone() for key, value in state.items()}


def set_default_size(pipe) -> None:
    """Make the pipeline's default image size the VAE's ``sample_size`` (32 x 32 here).

    ``FluxPipeline`` defaults to ``default_sample_size * vae_scale_factor`` pixels with
    ``default_sample_size = 128`` fixed in its constructor (FLUX.1's 1024 = its VAE's ``sample_size``);
    this sets the instance attribute from the VAE's config instead.
    """
    pipe.default_sample_size = pipe.vae.config.sample_size // pipe.vae_scale_factor


def load_pipeline(folder: str | os.PathLike = SHIPPED_DIR, *, pipeline_class=None, adapter: bool = True):
    """``pipeline_class.from_pretrained(folder)`` and, with ``adapter``, its ``load_ip_adapter``.

    Args:
        folder: A model folder in the layout above (default: the shipped one).
        pipeline_class: A Flux pipeline class (default ``FluxPipeline``).
        adapter: Whether to load the IP-Adapter and its image encoder.

    Returns:
        The pipeline, float32 on the CPU, progress bar disabled, default size 32 x 32
        (:func:`set_default_size`).
    """
    if pipeline_class is None:
        from diffusers import FluxPipeline

        pipeline_class = FluxPipeline
    folder = Path(folder)
    pipe = pipeline_class.from_pretrained(folder, torch_dtype=torch.float32)
    if adapter:
        pipe.load_ip_adapter(
            str(folder / ADAPTER_SUBFOLDER),
            weight_name=ADAPTER_WEIGHT_NAME,
            image_encoder_pretrained_model_name_or_path=str(folder / IMAGE_ENCODER_SUBFOLDER),
            image_encoder_dtype=torch.float32,
        )
    set_default_size(pipe)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def held_out_flow_losses(pipe, split, references, *, count: int = 200, seed: int = 0) -> dict[str, float]:
    """The rectified-flow loss on held-out digits with a right, a wrong and the black reference.

    The first ``count`` digits of ``split`` are encoded and packed as in training, noised once
    (seeded ``eps`` and ``s = sigmoid(n)``), and the transformer predicts ``eps - z0`` under the
    prompt ``"a photograph"`` three times from the same ``z_s``: with the first reference of the
    digit's class, with the first reference of class ``(y + 1) mod 10``, and with the black image
    (``FluxPipeline``'s negative image). An adapter that carries the class has
    ``right < black < wrong``; one that adds nothing has all three equal. Paired (same noise).

    Args:
        pipe: A Flux pipeline of this model with its adapter loaded (IP scale 1).
        split: Held-out digits (e.g. the ``judge`` split).
        references: The references (e.g. the ``reference`` split; 1 image per condition).
        count: How many digits of ``split``.
        seed: Seed of the noise and ``s``.

    Returns:
        ``{"right": L, "black": L, "wrong": L}``: mean squared errors.
    """
    import numpy as np
    from diffusers import FluxPipeline
    from PIL import Image

    images = torch.from_numpy(split.images[:count]).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    labels = [int(label) for label in split.labels[:count]]
    vae = pipe.vae
    latents = (vae.encode(images).latent_dist.mean - vae.config.shift_factor) * vae.config.scaling_factor
    n, channels, height, width = latents.shape
    packed = FluxPipeline._pack_latents(latents, n, channels, height, width)
    img_ids = FluxPipeline._prepare_latent_image_ids(n, height // 2, width // 2, "cpu", torch.float32)
    states, pooled, txt_ids = pipe.encode_prompt(
        ["a photograph"] * n, prompt_2=None, device="cpu", max_sequence_length=TEXT_TOKENS
    )
    embeds = pipe.encode_image([Image.fromarray(image) for image in references.images], "cpu", 1)
    black = pipe.encode_image(np.zeros((32, 32, 3), dtype=np.uint8), "cpu", 1).expand(n, -1)
    first = {digit: int(np.flatnonzero(references.labels == digit)[0]) for digit in range(10)}
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(packed.shape, generator=generator)
    sigmas = torch.sigmoid(torch.randn(n, generator=generator))
    noisy = (1.0 - sigmas[:, None, None]) * packed + sigmas[:, None, None] * noise

    def loss(image_embeds: torch.Tensor) -> float:
        prediction = pipe.transformer(
            hidden_states=noisy,
            timestep=sigmas,
            pooled_projections=pooled,
            encoder_hidden_states=states,
            txt_ids=txt_ids,
            img_ids=img_ids,
            joint_attention_kwargs={"ip_adapter_image_embeds": [image_embeds[:, None, :]]},
        ).sample
        return float(torch.nn.functional.mse_loss(prediction, noise - packed))

    return {
        "right": loss(embeds[[first[label] for label in labels]]),
        "black": loss(black),
        "wrong": loss(embeds[[first[(label + 1) % 10] for label in labels]]),
    }
