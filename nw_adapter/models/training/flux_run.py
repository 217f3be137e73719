"""Train the tiny Flux digits model stage by stage and assemble its shipped folder.

``run_flux_training(out)`` writes::

    out/stages/parts/         the reused frozen parts (VAE, CLIP text and image encoders, from the
                              shipped tiny SD 1.5 digits model) and the random frozen T5
    out/stages/transformer/   stage 1 (float32)
    out/stages/adapter/       stage 2: ip_adapter.safetensors (float32, XLabs keys); with
                              adapter_transformer_lr > 0 also transformer/, the transformer
                              trained with it (float32), which the model folder then holds
    out/stages/log.json       losses and wall-clock time of each stage
    out/tiny_flux_digits/     the model folder, as shipped

with the stage machinery of :mod:`~nw_adapter.models.training.run`: each folder is written once
and atomically with its ``stage.json`` (settings, environment, and the records and file digests
of the stages it was trained on); a rerun reuses a stage only when its record equals the one it
would write and otherwise stops with :class:`~nw_adapter.models.training.run.StageMismatchError`.
The reused parts' record is the shipped SD 1.5 model's ``stage.json`` and the SHA-256 of the
reused folders (:data:`~nw_adapter.models.tiny_flux_digits.REUSED_PARTS`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nw_adapter.models import tiny_digits
from nw_adapter.models import tiny_flux_digits as flux_model
from nw_adapter.models.digits_data import DigitSplit, class_captions, load_digit_splits
from nw_adapter.models.training import run as stage_machinery

__all__ = [
    "FINAL",
    "STAGE2_PROMPTS",
    "FluxTrainingConfig",
    "reused_parts_digest",
    "run_flux_training",
    "settings_of",
]

FINAL = "tiny_flux_digits"
STAGE2_PROMPTS = ("", "a photograph", "a handwritten digit")
"""Class-free prompts of stage 2 (the CLI's default prompt is ``"a photograph"``)."""


@dataclass(frozen=True)
class FluxTrainingConfig:
    """Steps, batch size, learning rates and seed of every stage (the defaults make the shipped weights)."""

    seed: int = 0
    transformer_steps: int = 2500
    transformer_lr: float = 1e-3
    adapter_steps: int = 5000
    adapter_lr: float = 5e-3
    batch_size: int = 32
    threads: int = 1
    max_train_images: int | None = None
    transformer_class_free_drop: bool = True
    """Stage 1: a dropped caption becomes one of :data:`STAGE2_PROMPTS` (drawn uniformly), not only
    ``""``, so the class-free prompts mean "any digit" to the transformer (False: ``""`` only, as the
    first shipped weights were trained)."""
    transformer_double_blocks: int = 2
    """Stage 1: double-stream blocks of the transformer (each gets the adapter's ``to_k_ip`` /
    ``to_v_ip``; :func:`~nw_adapter.models.tiny_flux_digits.build_transformer`)."""
    image_dropout: float = 0.05
    """Stage 2: probability that a support set is replaced by the black image."""
    single_share: float | None = None
    """Stage 2: ``None``: m ~ U{1..4}; else m = 1 with this probability, m ~ U{2..4} otherwise."""
    embed_noise: float = 0.0
    """Stage 2: Gaussian noise on every reference embedding, in units of the training embeddings'
    per-dimension standard deviation (0: none)."""
    shift_augment: int = 0
    """Stage 2: each reference is one of its image's translations by up to this many pixels in x and
    y (drawn per reference and step; :func:`~nw_adapter.models.training.flux.shifted_images`),
    encoded by the frozen image encoder (0: the image itself)."""
    adapter_transformer_lr: float = 1e-3
    """Stage 2: the transformer is trained with the adapter, as a second AdamW group at this peak
    learning rate (the adapter keeps ``adapter_lr``), saved in the adapter stage's ``transformer/``
    and assembled into the model folder in place of stage 1's; 0 keeps the stage-1 transformer
    frozen (the adapter alone is trained, as h94's IP-Adapter training does and as the first shipped
    weights were trained)."""

    @classmethod
    def quick(cls, seed: int = 0) -> FluxTrainingConfig:
        """Two steps per stage on 40 images: checks that the chain runs, not a useful model."""
        return cls(seed=seed, transformer_steps=2, adapter_steps=2, batch_size=4, max_train_images=40)


SETTINGS_OF = {
    "parts": ("seed",),
    "transformer": (
        "seed", "transformer_steps", "transformer_lr", "batch_size", "max_train_images",
        "transformer_class_free_drop",
    ),
    "adapter": (
        "seed", "adapter_steps", "adapter_lr", "batch_size", "max_train_images", "adapter_transformer_lr",
    ),
    FINAL: (),
}  # fmt: skip
"""The config fields each stage's result depends on (besides the stages it is trained on)."""

VARIANT_SETTINGS_OF = {
    "transformer": ("transformer_double_blocks",),
    "adapter": ("image_dropout", "single_share", "embed_noise", "shift_augment"),
}
"""Fields of the variants tried (model card): a stage's record holds one only when it differs from
its default, so a default run writes the shipped ``stage.json`` records unchanged and a variant's
stage is never mistaken for the default's (:func:`settings_of`)."""


def settings_of(config: FluxTrainingConfig) -> dict[str, tuple[str, ...]]:
    """Each stage's recorded config fields: :data:`SETTINGS_OF` plus the :data:`VARIANT_SETTINGS_OF`
    fields whose value in ``config`` differs from the default."""
    default = FluxTrainingConfig()
    return {
        stage: fields
        + tuple(
            name
            for name in VARIANT_SETTINGS_OF.get(stage, ())
            if getattr(config, name) != getattr(default, name)
        )
        for stage, fields in SETTINGS_OF.items()
    }


INPUTS_OF = {
    "parts": ("tiny_digits",),
    "transformer": ("parts",),
    "adapter": ("parts", "transformer"),
    FINAL: ("parts", "transformer", "adapter"),
}
TRAINED = ("parts", "transformer", "adapter")


def reused_parts_digest(folder: Path = tiny_digits.SHIPPED_DIR) -> str:
    """SHA-256 over the relative paths and bytes of the reused folders' files (not the card)."""
    digest = hashlib.sha256()
    for part in flux_model.REUSED_PARTS:
        for path in sorted(p for p in (folder / part).rglob("*") if p.is_file()):
            digest.update(str(path.relative_to(folder)).encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _cleanup(out: Path) -> list[Path]:
    return stage_machinery.remove_interrupted_stages(out, TRAINED, FINAL)


def run_flux_training(
    out: str | Path, config: FluxTrainingConfig = FluxTrainingConfig(), *, progress: bool = True
) -> Path:
    """Train (or resume) every stage and write the model folder ``out/tiny_flux_digits``.

    Args:
        out: Output folder.
        config: Steps, batch size, learning rates, seed and CPU threads.
        progress: Show progress bars.

    Returns:
        The model folder.
    """
    out = Path(out)
    stage_machinery.read_training_log(
        out / "stages" / "log.json"
    )  # a damaged log of an earlier run: one line, now
    with stage_machinery._training_lock(out, _cleanup):
        return _run(out, config, progress=progress)


def _pipeline(parts: Path, transformer, *, image_encoder: bool = True):
    """A ``FluxPipeline`` of the stage folders (with ``image_encoder``: registered, as after
    ``load_ip_adapter``; without it: as the model folder is saved, the encoder beside the adapter)."""
    from diffusers import AutoencoderKL, FluxPipeline
    from transformers import (
        CLIPImageProcessor,
        CLIPTextModel,
        CLIPTokenizer,
        CLIPVisionModelWithProjection,
        T5EncoderModel,
        T5TokenizerFast,
    )

    pipe = FluxPipeline(
        scheduler=flux_model.pipeline_scheduler(),
        vae=AutoencoderKL.from_pretrained(parts / "vae", torch_dtype=torch.float32),
        text_encoder=CLIPTextModel.from_pretrained(parts / "text_encoder").eval(),
        tokenizer=CLIPTokenizer.from_pretrained(parts / "tokenizer"),
        text_encoder_2=T5EncoderModel.from_pretrained(parts / "text_encoder_2").eval(),
        tokenizer_2=T5TokenizerFast.from_pretrained(parts / "tokenizer_2"),
        transformer=transformer,
        image_encoder=(
            CLIPVisionModelWithProjection.from_pretrained(parts / "image_encoder").eval()
            if image_encoder
            else None
        ),
        feature_extractor=CLIPImageProcessor.from_pretrained(parts / "feature_extractor"),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(out: Path, config: FluxTrainingConfig, *, progress: bool) -> Path:
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from PIL import Image
    from safetensors.torch import load_file, save_file

    from nw_adapter.models.training.flux import (
        FluxBatchInputs,
        load_adapter_for_training,
        shifted_images,
        train_flux_adapter,
        train_flux_transformer,
    )

    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)
    stages = out / "stages"
    record = stage_machinery.open_training_log(stages / "log.json", config)

    shipped = tiny_digits.SHIPPED_DIR
    records: dict[str, dict] = {
        "tiny_digits": json.loads((shipped / stage_machinery.STAGE_RECORD).read_text())
    }
    digests: dict[str, str] = {"tiny_digits": reused_parts_digest(shipped)}

    def stage(name: str, build, folder: Path | None = None) -> Path:
        records[name] = stage_machinery._stage_record(
            name, config, records, digests, settings_of=settings_of(config), inputs_of=INPUTS_OF
        )
        folder = stage_machinery._checked_stage(folder or stages / name, records[name], build)
        digests[name] = stage_machinery._folder_digest(folder)
        return folder

    def parts_stage(path: Path) -> None:
        path.mkdir(parents=True)
        shutil.copytree(shipped / "vae", path / "vae")
        vae_config = json.loads((path / "vae" / "config.json").read_text())
        vae_config["shift_factor"] = 0.0  # FluxPipeline decodes z / scaling_factor + shift_factor
        (path / "vae" / "config.json").write_text(json.dumps(vae_config, indent=2, sort_keys=True) + "\n")
        shutil.copytree(shipped / "text_encoder", path / "text_encoder")
        shutil.copytree(shipped / "tokenizer", path / "tokenizer")
        shutil.copytree(shipped / "models" / "image_encoder", path / "image_encoder")
        shutil.copytree(shipped / "feature_extractor", path / "feature_extractor")
        flux_model.build_t5_encoder(config.seed + 70).save_pretrained(path / "text_encoder_2")
        flux_model.save_t5_tokenizer(path / "tokenizer_2")

    parts = stage("parts", parts_stage)

    splits = load_digit_splits()
    train = splits["train"]
    if config.max_train_images is not None:
        train = DigitSplit(
            *(part[: config.max_train_images] for part in (train.images, train.labels, train.indices))
        )
    labels = torch.from_numpy(train.labels)
    encoder_pipe = _pipeline(parts, None)
    with torch.no_grad():
        vae = encoder_pipe.vae
        pixels = torch.from_numpy(train.images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        latents = torch.cat([vae.encode(chunk).latent_dist.mean for chunk in pixels.split(256)])
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        n, channels, height, width = latents.shape
        packed = FluxPipeline._pack_latents(latents, n, channels, height, width)
        ids = FluxBatchInputs(
            img_ids=FluxPipeline._prepare_latent_image_ids(n, height // 2, width // 2, "cpu", torch.float32),
            txt_ids=torch.zeros(flux_model.TEXT_TOKENS, 3),
        )

        def encode(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
            states, pooled, _ = encoder_pipe.encode_prompt(
                prompts, prompt_2=None, device="cpu", max_sequence_length=flux_model.TEXT_TOKENS
            )
            return states, pooled

        captions = [caption for digit in range(10) for caption in class_captions(digit)]
        caption_states, caption_pooled = encode(captions)
        nulls = list(STAGE2_PROMPTS) if config.transformer_class_free_drop else [""]
        null_states, null_pooled = encode(nulls)

    def transformer_stage(path: Path) -> None:
        started = time.perf_counter()
        torch.manual_seed(config.seed + 80)
        transformer = flux_model.build_transformer(config.transformer_double_blocks)
        losses = train_flux_transformer(
            transformer,
            packed,
            labels,
            caption_states.unflatten(0, (10, -1)),
            caption_pooled.unflatten(0, (10, -1)),
            null_states,
            null_pooled,
            ids,
            steps=config.transformer_steps,
            batch_size=config.batch_size,
            lr=config.transformer_lr,
            seed=config.seed + 90,
            progress=progress,
        )
        transformer.save_pretrained(path, safe_serialization=True)
        record("transformer", started, losses)

    transformer_dir = stage("transformer", transformer_stage)

    def adapter_stage(path: Path) -> None:
        started = time.perf_counter()
        transformer = FluxTransformer2DModel.from_pretrained(transformer_dir)
        pipe = _pipeline(parts, transformer)
        parameters = load_adapter_for_training(
            pipe, flux_model.initial_adapter_state_dict(transformer, seed=config.seed + 100)
        )
        with torch.no_grad():
            # every reference's views (one, the image itself, without shift_augment), encoded in chunks
            views = shifted_images(train.images, config.shift_augment)  # (N, V, 32, 32, 3)
            flat = [Image.fromarray(image) for image in views.reshape(-1, *views.shape[2:])]
            chunks = range(0, len(flat), 2048)
            references = torch.cat([pipe.encode_image(flat[i : i + 2048], "cpu", 1) for i in chunks])
            references = references.unflatten(0, views.shape[:2])  # (N, V, 32)
            black = pipe.encode_image(np.zeros((32, 32, 3), dtype=np.uint8), "cpu", 1)[0]
            prompt_states, prompt_pooled = encode(list(STAGE2_PROMPTS))
        losses, sizes = train_flux_adapter(
            pipe.transformer,
            parameters,
            packed,
            references,
            black,
            labels,
            prompt_states,
            prompt_pooled,
            ids,
            steps=config.adapter_steps,
            batch_size=config.batch_size,
            lr=config.adapter_lr,
            seed=config.seed + 110,
            progress=progress,
            image_dropout=config.image_dropout,
            single_share=config.single_share,
            embed_noise=config.embed_noise,
            transformer_lr=config.adapter_transformer_lr,
        )
        path.mkdir(parents=True)
        save_file(
            flux_model.adapter_state_dict_from_transformer(pipe.transformer),
            path / flux_model.ADAPTER_WEIGHT_NAME,
        )
        if config.adapter_transformer_lr > 0:  # the fine-tuned transformer, without the adapter's layers
            # built from stage 1's config file, not from_pretrained: its config would record the run's
            # path (_name_or_path), and the stage's files would then depend on where the run is
            tuned = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(transformer_dir))
            state = pipe.transformer.state_dict()
            tuned.load_state_dict({key: state[key] for key in tuned.state_dict()})
            tuned.save_pretrained(path / "transformer", safe_serialization=True)
        record("adapter", started, losses, support_sizes={m: sizes.count(m) for m in sorted(set(sizes))})

    adapter_dir = stage("adapter", adapter_stage)

    def assemble(path: Path) -> None:
        # float16 for the diffusers models (diffusers loads them as float32 unless told otherwise);
        # the transformers encoders stay float32 (transformers 5 would load float16 as float16).
        # Fresh tokenizers: a used one saves its last padding / truncation state.
        tuned = adapter_dir / "transformer" if config.adapter_transformer_lr > 0 else transformer_dir
        pipe = _pipeline(parts, FluxTransformer2DModel.from_pretrained(tuned), image_encoder=False)
        pipe.transformer.to(torch.float16)
        pipe.vae.to(torch.float16)
        pipe.save_pretrained(path, safe_serialization=True)
        shutil.copytree(parts / "image_encoder", path / flux_model.IMAGE_ENCODER_SUBFOLDER)
        state = load_file(adapter_dir / flux_model.ADAPTER_WEIGHT_NAME)
        save_file(
            {key: value.half().contiguous() for key, value in state.items()},
            path / flux_model.ADAPTER_SUBFOLDER / flux_model.ADAPTER_WEIGHT_NAME,
        )
        for config_file in path.rglob("config.json"):  # the stage folders' paths do not belong in it
            values = json.loads(config_file.read_text())
            if values.pop("_name_or_path", None) is not None:
                config_file.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")

    return stage(FINAL, assemble, out / FINAL)
