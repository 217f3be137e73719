"""Tiny random-weight SD 3.5 and Flux pipelines and IP-Adapters, in the public folder layouts.

The flow-matching twins of :mod:`nw_adapter.models.tiny`: small, deterministic stand-ins that are
loaded through the same diffusers calls as the real models, so tests and ``--model tiny-sd3`` /
``--model tiny-flux`` exercise the real loading code offline:

.. code-block:: python

    pipe = StableDiffusion3Pipeline.from_pretrained(save_tiny_sd3(tmp / "sd3"))
    pipe.load_ip_adapter(save_tiny_sd3_ip_adapter(tmp / "ip"), weight_name="ip-adapter.bin",
                         image_encoder_folder=str(tmp / "ip" / SIGLIP_FOLDER))

    pipe = FluxPipeline.from_pretrained(save_tiny_flux(tmp / "flux"))
    pipe.load_ip_adapter(save_tiny_flux_ip_adapter(tmp / "ipf"), weight_name="ip_adapter.safetensors",
                         image_encoder_pretrained_model_name_or_path=str(tmp / "ipf" / CLIP_FOLDER),
                         image_encoder_dtype=torch.float32)

Layouts written:

- ``save_tiny_sd3``: the Stable Diffusion 3.5 layout (``transformer/`` with RMS qk-norm as SD 3.5,
  ``vae/``, ``text_encoder/``, ``text_encoder_2/``, ``tokenizer/``, ``tokenizer_2/``,
  ``text_encoder_3/``, ``tokenizer_3/`` (a one-layer T5 with a character-level tokenizer),
  ``scheduler/``: ``FlowMatchEulerDiscreteScheduler`` with ``shift=3.0``).
- ``save_tiny_sd3_ip_adapter``: ``ip-adapter.bin`` in the key layout of
  ``InstantX/SD3.5-Large-IP-Adapter`` (``image_proj.layers.<i>.0.to_q`` ...,
  ``ip_adapter.<layer>.norm_ip.linear`` ...), which diffusers converts on load, and
  ``siglip/`` (a SigLIP vision model + image processor standing in for
  ``google/siglip-so400m-patch14-384``).
- ``save_tiny_flux``: the Flux-dev layout (``transformer/`` with guidance embedding, ``vae/``,
  ``text_encoder/`` CLIP, ``text_encoder_2/`` T5, ``tokenizer/``, ``tokenizer_2/``, ``scheduler/``:
  ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting).
- ``save_tiny_flux_ip_adapter``: ``ip_adapter.safetensors`` in the key layout of
  ``XLabs-AI/flux-ip-adapter`` (``ip_adapter_proj_model.*``,
  ``double_blocks.<i>.processor.ip_adapter_double_stream_{k,v}_proj.*``) and
  ``clip-vit-large-patch14/`` (a CLIP vision model with projection standing in for
  ``openai/clip-vit-large-patch14``).

Sizes: 32 x 32 pixel images (latents 16 x 16; SD3: 2 x 2 patches, 64 image tokens; Flux: packed
2 x 2, 64 tokens); 2 heads of ``d_k = 8`` (SD3) or ``d_k = 16`` (Flux).
"""

from __future__ import annotations

import hashlib
import os
import string
from pathlib import Path

import torch
from safetensors.torch import save_file

from nw_adapter.models import tiny

__all__ = [
    "CLIP_FOLDER",
    "FLUX_IP_WEIGHT",
    "SD3_IP_WEIGHT",
    "SIGLIP_FOLDER",
    "TINY_FLOW_IMAGE_SIZE",
    "flow_builder_fingerprint",
    "flux_dev_scheduler",
    "save_char_t5_tokenizer",
    "save_tiny_flux",
    "save_tiny_flux_ip_adapter",
    "save_tiny_sd3",
    "save_tiny_sd3_ip_adapter",
    "t5_encoder",
    "tiny_flux_pipeline",
    "tiny_sd3_pipeline",
]

TINY_FLOW_IMAGE_SIZE = 32
"""Height and width, in pixels, that the tiny SD3 / Flux pipelines generate."""

SD3_IP_WEIGHT = "ip-adapter.bin"
"""Weight file name of ``InstantX/SD3.5-Large-IP-Adapter``."""

FLUX_IP_WEIGHT = "ip_adapter.safetensors"
"""Weight file name of ``XLabs-AI/flux-ip-adapter``."""

SIGLIP_FOLDER = "siglip"
"""Sub-folder of the tiny SD3 adapter holding its SigLIP image encoder."""

CLIP_FOLDER = "clip-vit-large-patch14"
"""Sub-folder of the tiny Flux adapter holding its CLIP image encoder."""

_BLOCKS = (32, 32)  # VAE channels: 2 blocks, vae_scale_factor 2
_LATENT_CHANNELS = 4
_TEXT_HIDDEN = 32
_ENCODER_HIDDEN = 32  # image encoders' width (SigLIP hidden states, CLIP projection)
_SD3 = {"heads": 2, "head_dim": 8, "layers": 2, "joint_dim": 2 * _TEXT_HIDDEN}
_FLUX = {"heads": 2, "head_dim": 16, "layers": 1, "single_layers": 1, "joint_dim": 32}
_SD3_PROJ_HIDDEN = 64  # diffusers infers the resampler's heads as width // 64
_SD3_PROJ_QUERIES = 4
_SD3_PROJ_DEPTH = 4  # diffusers rebuilds IPAdapterTimeImageProjection with its default depth


def flow_builder_fingerprint() -> str:
    """A short hash of this module's and :mod:`~nw_adapter.models.tiny`'s source (cache keys)."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(tiny.builder_fingerprint().encode())
    return digest.hexdigest()[:12]


def _vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(_BLOCKS),
        up_block_types=("UpDecoderBlock2D",) * len(_BLOCKS),
        block_out_channels=_BLOCKS,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=32,
        sample_size=TINY_FLOW_IMAGE_SIZE,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _clip_text(with_projection: bool):
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from nw_adapter.models.tiny import text_encoder_config

    config = text_encoder_config(_TEXT_HIDDEN)
    return CLIPTextModelWithProjection(config) if with_projection else CLIPTextModel(config)


def _clip_tokenizer(path: Path):
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in string.ascii_lowercase + string.digits + string.punctuation:
        vocab.setdefault(char, len(vocab))
        vocab.setdefault(char + "</w>", len(vocab))
    CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77).save_pretrained(path)
    return CLIPTokenizer.from_pretrained(path)


def save_char_t5_tokenizer(path: str | os.PathLike, *, model_max_length: int | None = None) -> Path:
    """Write a character-level T5 (unigram) tokenizer built in memory: no sentencepiece file needed.

    Its vocabulary: ``<pad>`` (0), ``</s>`` (1), ``<unk>``, the word boundary, then lowercase letters,
    digits and punctuation, one token each. ``model_max_length``: the saved maximum length
    (``None``: the tokenizer's default).

    Returns:
        ``path``, the folder written.
    """
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    vocab += [(c, -1.0) for c in string.ascii_lowercase + string.digits + string.punctuation]
    options = {} if model_max_length is None else {"model_max_length": model_max_length}
    T5TokenizerFast(vocab=vocab, extra_ids=0, **options).save_pretrained(path)
    return Path(path)


def _t5_tokenizer(path: Path):
    """:func:`save_char_t5_tokenizer` at ``path``, loaded back."""
    from transformers import T5TokenizerFast

    return T5TokenizerFast.from_pretrained(save_char_t5_tokenizer(path))


def t5_encoder(width: int):
    """A random ``T5EncoderModel``: 1 layer of width ``width``, 4 heads of 8, feed-forward ``2 width``,
    vocabulary 128 (:func:`save_char_t5_tokenizer`'s ids). Drawn from torch's global generator."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=128,
            d_model=width,
            d_kv=8,
            d_ff=2 * width,
            num_layers=1,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


def save_tiny_sd3(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """Write a tiny Stable Diffusion 3.5-layout pipeline folder.

    Args:
        path: Destination folder (created).
        seed: Seed of the random weights; the same seed writes the same weights.

    Returns:
        The folder, ready for ``StableDiffusion3Pipeline.from_pretrained(path)``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    path = Path(path)
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=TINY_FLOW_IMAGE_SIZE // 2,
        patch_size=2,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_layers=_SD3["layers"],
        attention_head_dim=_SD3["head_dim"],
        num_attention_heads=_SD3["heads"],
        joint_attention_dim=_SD3["joint_dim"],
        caption_projection_dim=_SD3["heads"] * _SD3["head_dim"],
        pooled_projection_dim=2 * _TEXT_HIDDEN,
        pos_embed_max_size=16,
        qk_norm="rms_norm",
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=_vae(),
        text_encoder=_clip_text(True),
        tokenizer=_clip_tokenizer(path / "tokenizer"),
        text_encoder_2=_clip_text(True),
        tokenizer_2=_clip_tokenizer(path / "tokenizer_2"),
        text_encoder_3=t5_encoder(_SD3["joint_dim"]),
        tokenizer_3=_t5_tokenizer(path / "tokenizer_3"),
    )
    pipe.save_pretrained(path, safe_serialization=True)
    return path


def flux_dev_scheduler():
    """``FlowMatchEulerDiscreteScheduler`` configured as FLUX.1-dev's (``shift=3.0``, dynamic shifting
    between ``base_shift=0.5`` at 256 image tokens and ``max_shift=1.15`` at 4096)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def save_tiny_flux(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """Write a tiny Flux-dev-layout pipeline folder (guidance embedding, dynamic shifting).

    Args:
        path: Destination folder (created).
        seed: Seed of the random weights.

    Returns:
        The folder, ready for ``FluxPipeline.from_pretrained(path)``.
    """
    from diffusers import FluxPipeline, FluxTransformer2DModel

    path = Path(path)
    torch.manual_seed(seed)
    head_dim = _FLUX["head_dim"]
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * _LATENT_CHANNELS,
        num_layers=_FLUX["layers"],
        num_single_layers=_FLUX["single_layers"],
        attention_head_dim=head_dim,
        num_attention_heads=_FLUX["heads"],
        joint_attention_dim=_FLUX["joint_dim"],
        pooled_projection_dim=_TEXT_HIDDEN,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    scheduler = flux_dev_scheduler()
    pipe = FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=_vae(),
        text_encoder=_clip_text(False),
        tokenizer=_clip_tokenizer(path / "tokenizer"),
        text_encoder_2=t5_encoder(_FLUX["joint_dim"]),
        tokenizer_2=_t5_tokenizer(path / "tokenizer_2"),
    )
    pipe.save_pretrained(path, safe_serialization=True)
    return path


def _normal(generator: torch.Generator, *shape: int, std: float | None = None) -> torch.Tensor:
    """Gaussian weights with fan-in scaling (``std = 1 / sqrt(shape[-1])`` unless given)."""
    return torch.randn(*shape, generator=generator) * (shape[-1] ** -0.5 if std is None else std)


def _randomised(module: torch.nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``module``'s state dict with every tensor redrawn: weights fan-in Gaussian, 1-D tensors
    (biases, norm gains) around their usual values so that norms and biases are not trivial."""
    state = {}
    for key, value in module.state_dict().items():
        if value.ndim >= 2:
            state[key] = _normal(generator, *value.shape)
        elif key.endswith("bias"):
            state[key] = _normal(generator, *value.shape, std=0.5)
        else:  # gains of LayerNorm / RMSNorm: 1 + noise, so key norms vary through the gain
            state[key] = 1.0 + _normal(generator, *value.shape, std=0.3)
    return state


# diffusers' SD3 image-projection names -> the InstantX original names (the inverse of
# SD3Transformer2DLoadersMixin._convert_ip_adapter_image_proj_to_diffusers).
_INSTANTX_NAMES = (
    ("ln0", "0.norm1"),
    ("ln1", "0.norm2"),
    ("attn.to_q", "0.to_q"),
    ("attn.to_kv", "0.to_kv"),
    ("attn.to_out.0", "0.to_out"),
    ("adaln_norm", "1.0"),
    ("ff.net.0.proj", "1.1"),
    ("ff.net.2", "1.3"),
    ("adaln_proj", "2.1"),
)


def _instantx_key(key: str) -> str:
    if not key.startswith("layers."):
        return key
    _, idx, rest = key.split(".", 2)
    for new, old in _INSTANTX_NAMES:
        if rest.startswith(new + "."):
            return f"layers.{idx}.{old}{rest[len(new) :]}"
    raise KeyError(f"no InstantX name for image-projection key {key!r}")


def save_tiny_sd3_ip_adapter(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """Write a tiny SD 3.5 IP-Adapter in the layout of ``InstantX/SD3.5-Large-IP-Adapter``.

    Args:
        path: Repository folder (created).
        seed: Seed of the random weights.

    Returns:
        ``path``; load with ``pipe.load_ip_adapter(path, weight_name=SD3_IP_WEIGHT,
        image_encoder_folder=str(path / SIGLIP_FOLDER))``.
    """
    from diffusers.models.attention_processor import SD3IPAdapterJointAttnProcessor2_0
    from diffusers.models.embeddings import IPAdapterTimeImageProjection
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    encoder = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=_ENCODER_HIDDEN,
            intermediate_size=2 * _ENCODER_HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=TINY_FLOW_IMAGE_SIZE,
            patch_size=8,
        )
    )
    encoder.save_pretrained(path / SIGLIP_FOLDER, safe_serialization=True)
    size = TINY_FLOW_IMAGE_SIZE
    SiglipImageProcessor(size={"height": size, "width": size}).save_pretrained(path / SIGLIP_FOLDER)

    generator = torch.Generator().manual_seed(seed + 11)
    hidden = _SD3["heads"] * _SD3["head_dim"]
    proj = IPAdapterTimeImageProjection(
        embed_dim=_ENCODER_HIDDEN,
        output_dim=hidden,
        hidden_dim=_SD3_PROJ_HIDDEN,
        depth=_SD3_PROJ_DEPTH,
        heads=_SD3_PROJ_HIDDEN // 64,
        num_queries=_SD3_PROJ_QUERIES,
        timestep_in_dim=32,
    )
    image_proj = {_instantx_key(k): v for k, v in _randomised(proj, generator).items()}
    layer = SD3IPAdapterJointAttnProcessor2_0(
        hidden_size=hidden,
        ip_hidden_states_dim=hidden,
        head_dim=_SD3["head_dim"],
        timesteps_emb_dim=_SD3_PROJ_HIDDEN,
    )
    ip_adapter = {}
    for index in range(_SD3["layers"]):  # one processor per transformer block's attention
        for key, value in _randomised(layer, generator).items():
            ip_adapter[f"{index}.{key}"] = value
    torch.save({"image_proj": image_proj, "ip_adapter": ip_adapter}, path / SD3_IP_WEIGHT)
    (path / "README.md").write_text(
        "Tiny random-weight SD 3.5 IP-Adapter written by nw_adapter.models.tiny_flow for offline "
        "tests; layout of InstantX/SD3.5-Large-IP-Adapter (image encoder: siglip/).\n"
    )
    return path


def save_tiny_flux_ip_adapter(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """Write a tiny Flux IP-Adapter in the layout of ``XLabs-AI/flux-ip-adapter``.

    Args:
        path: Repository folder (created).
        seed: Seed of the random weights.

    Returns:
        ``path``; load with ``pipe.load_ip_adapter(path, weight_name=FLUX_IP_WEIGHT,
        image_encoder_pretrained_model_name_or_path=str(path / CLIP_FOLDER))``.
    """
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=_ENCODER_HIDDEN,
            intermediate_size=2 * _ENCODER_HIDDEN,
            projection_dim=_ENCODER_HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=TINY_FLOW_IMAGE_SIZE,
            patch_size=8,
        )
    )
    encoder.save_pretrained(path / CLIP_FOLDER, safe_serialization=True)

    generator = torch.Generator().manual_seed(seed + 13)
    cross, inner = _FLUX["joint_dim"], _FLUX["heads"] * _FLUX["head_dim"]
    state = {
        "ip_adapter_proj_model.proj.weight": _normal(generator, 4 * cross, _ENCODER_HIDDEN),
        "ip_adapter_proj_model.proj.bias": _normal(generator, 4 * cross, std=1.0),
        "ip_adapter_proj_model.norm.weight": 1.0 + _normal(generator, cross, std=0.3),
        "ip_adapter_proj_model.norm.bias": _normal(generator, cross, std=0.3),
    }
    for block in range(_FLUX["layers"]):
        prefix = f"double_blocks.{block}.processor.ip_adapter_double_stream"
        for kind in ("k", "v"):
            state[f"{prefix}_{kind}_proj.weight"] = _normal(generator, inner, cross)
            state[f"{prefix}_{kind}_proj.bias"] = _normal(generator, inner, std=0.5)
    save_file({k: v.contiguous() for k, v in state.items()}, path / FLUX_IP_WEIGHT)
    (path / "README.md").write_text(
        "Tiny random-weight Flux IP-Adapter written by nw_adapter.models.tiny_flow for offline "
        "tests; layout of XLabs-AI/flux-ip-adapter (image encoder: clip-vit-large-patch14/).\n"
    )
    return path


def tiny_sd3_pipeline(folder: str | os.PathLike, *, seed: int = 0, pipeline_class=None):
    """Write (if missing) and load a tiny SD 3.5 pipeline with its IP-Adapter loaded.

    Args:
        folder: Cache folder; ``folder/sd3`` and ``folder/sd3-ip-adapter`` are written once
            (:func:`~nw_adapter.models.tiny.write_once`).
        seed: Seed of the random weights.
        pipeline_class: Pipeline class (default ``StableDiffusion3Pipeline``).

    Returns:
        The loaded pipeline, on CPU in float32, progress bar disabled.
    """
    from diffusers import StableDiffusion3Pipeline

    folder = Path(folder)
    model_dir = tiny.write_once(folder / "sd3", lambda p: save_tiny_sd3(p, seed=seed))
    ip_dir = tiny.write_once(folder / "sd3-ip-adapter", lambda p: save_tiny_sd3_ip_adapter(p, seed=seed))
    pipe = (pipeline_class or StableDiffusion3Pipeline).from_pretrained(model_dir)
    pipe.load_ip_adapter(ip_dir, weight_name=SD3_IP_WEIGHT, image_encoder_folder=str(ip_dir / SIGLIP_FOLDER))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_flux_pipeline(folder: str | os.PathLike, *, seed: int = 0, adapters: int = 1, pipeline_class=None):
    """Write (if missing) and load a tiny Flux pipeline with ``adapters`` IP-Adapters loaded.

    Args:
        folder: Cache folder; ``folder/flux`` and ``folder/flux-ip-adapter`` are written once.
        seed: Seed of the random weights.
        adapters: How many copies of the adapter to load (several adapters, one image each).
        pipeline_class: Pipeline class (default ``FluxPipeline``).

    Returns:
        The loaded pipeline, on CPU in float32, progress bar disabled.
    """
    from diffusers import FluxPipeline

    folder = Path(folder)
    model_dir = tiny.write_once(folder / "flux", lambda p: save_tiny_flux(p, seed=seed))
    ip_dir = tiny.write_once(folder / "flux-ip-adapter", lambda p: save_tiny_flux_ip_adapter(p, seed=seed))
    pipe = (pipeline_class or FluxPipeline).from_pretrained(model_dir)
    pipe.load_ip_adapter(
        [str(ip_dir)] * adapters,
        weight_name=[FLUX_IP_WEIGHT] * adapters,
        image_encoder_pretrained_model_name_or_path=str(ip_dir / CLIP_FOLDER),
        image_encoder_dtype=torch.float32,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
