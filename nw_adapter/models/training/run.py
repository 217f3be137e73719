"""Run every training stage, write each one atomically, and assemble the shipped model folder.

``run_training(out)`` writes::

    out/stages/vae/  out/stages/image_encoder/  out/stages/unet/  out/stages/adapter/   (float32)
    out/stages/log.json                                   (losses and wall-clock time of each stage)
    out/tiny_digits/                                      (the model folder, float16, as shipped)

Every folder appears complete or not at all (:func:`nw_adapter.models.tiny.write_once`), and a
stage whose folder exists is loaded instead of retrained, so an interrupted run resumes.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from nw_adapter.atomic import atomic_write_json
from nw_adapter.models.digits_data import DigitSplit, class_captions, load_digit_splits, to_model_range
from nw_adapter.models.tiny import write_once
from nw_adapter.models.tiny_digits import (
    ADAPTER_SUBFOLDER,
    ADAPTER_WEIGHT_NAME,
    adapter_state_dict_from_unet,
    build_text_encoder,
    feature_extractor,
    initial_adapter_state_dict,
    pipeline_scheduler,
    save_tokenizer,
)

__all__ = ["STAGE2_PROMPTS", "TrainingConfig", "run_training"]

STAGE2_PROMPTS = ("", "a photograph", "a handwritten digit")
"""Class-free prompts of stage 2 (the CLI's default prompt is ``"a photograph"``)."""


@dataclass(frozen=True)
class TrainingConfig:
    """Steps, batch sizes and seed of every stage (the defaults produce the shipped weights)."""

    seed: int = 0
    vae_steps: int = 300
    encoder_steps: int = 400
    unet_steps: int = 1200
    unet_lr: float = 1e-3
    train_text_encoder: bool = False  # stage 1 also trains the (randomly initialised) text encoder
    adapter_steps: int = 600
    batch_size: int = 32
    threads: int = 1  # one thread: on a shared machine, more threads spin against each other
    max_train_images: int | None = None  # None: the whole training split

    @classmethod
    def quick(cls, seed: int = 0) -> TrainingConfig:
        """A few steps per stage: checks that the whole chain runs (CI), not a useful model."""
        return cls(
            seed=seed,
            vae_steps=2,
            encoder_steps=2,
            unet_steps=2,
            adapter_steps=2,
            batch_size=4,
            max_train_images=40,
        )


def _pil_images(images):
    from PIL import Image

    return [Image.fromarray(image) for image in images]


def _token_ids(tokenizer, prompts: list[str]) -> torch.Tensor:
    """``(len(prompts), 77)``: the token ids ``StableDiffusionPipeline.encode_prompt`` builds."""
    return tokenizer(
        prompts,
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids


def _text_states(tokenizer, text_encoder, prompts: list[str]) -> torch.Tensor:
    """``(len(prompts), 77, 32)``: the states ``StableDiffusionPipeline.encode_prompt`` conditions on."""
    with torch.no_grad():
        return text_encoder(_token_ids(tokenizer, prompts))[0]


def _save_fp32(model, path: Path) -> None:
    model.save_pretrained(path, safe_serialization=True)


def run_training(
    out: str | Path, config: TrainingConfig = TrainingConfig(), *, progress: bool = True
) -> Path:
    """Train (or resume) every stage and write the final model folder ``out/tiny_digits``.

    Args:
        out: Output folder.
        config: Steps, batch size, seed and CPU threads.
        progress: Show progress bars.

    Returns:
        The model folder ``out/tiny_digits``.
    """
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from safetensors.torch import load_file, save_file
    from transformers import CLIPTextModel, CLIPTokenizer, CLIPVisionModelWithProjection

    from nw_adapter.models.training.autoencoder import train_vae
    from nw_adapter.models.training.diffusion import load_adapter_for_training, train_adapter, train_unet
    from nw_adapter.models.training.image_encoder import classifier_accuracy, train_image_encoder

    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)
    out = Path(out)
    stages = out / "stages"
    log_path = stages / "log.json"
    log = json.loads(log_path.read_text()) if log_path.is_file() else {}
    log.update(config=asdict(config), torch=torch.__version__, python=platform.python_version())

    def record(name: str, started: float, losses: list[float], **extra) -> None:
        log[name] = {
            "seconds": round(time.perf_counter() - started, 1),
            "steps": len(losses),
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "mean_last_50": sum(losses[-50:]) / max(len(losses[-50:]), 1),
            **extra,
        }
        atomic_write_json(log_path, log)

    splits = load_digit_splits()
    train = splits["train"]
    if config.max_train_images is not None:
        train = DigitSplit(
            *(part[: config.max_train_images] for part in (train.images, train.labels, train.indices))
        )
    labels = torch.from_numpy(train.labels)
    images = to_model_range(train.images)
    processor = feature_extractor()
    pixel_values = processor(_pil_images(train.images), return_tensors="pt").pixel_values

    def vae_stage(path: Path) -> None:
        started = time.perf_counter()
        vae, losses = train_vae(
            images,
            steps=config.vae_steps,
            batch_size=config.batch_size,
            seed=config.seed + 10,
            progress=progress,
        )
        _save_fp32(vae, path)
        record("vae", started, losses, scaling_factor=vae.config.scaling_factor)

    def encoder_stage(path: Path) -> None:
        started = time.perf_counter()
        encoder, head, losses = train_image_encoder(
            pixel_values,
            labels,
            steps=config.encoder_steps,
            batch_size=2 * config.batch_size,
            seed=config.seed + 20,
            progress=progress,
        )
        judge = splits["judge"]
        held_out = processor(_pil_images(judge.images), return_tensors="pt").pixel_values
        accuracy = classifier_accuracy(encoder, head, held_out, torch.from_numpy(judge.labels))
        _save_fp32(encoder, path)
        record("image_encoder", started, losses, held_out_accuracy=accuracy)

    vae = AutoencoderKL.from_pretrained(write_once(stages / "vae", vae_stage))
    encoder = CLIPVisionModelWithProjection.from_pretrained(
        write_once(stages / "image_encoder", encoder_stage)
    )
    vae.requires_grad_(False)
    encoder.requires_grad_(False)
    with torch.no_grad():
        latents = torch.cat([vae.encode(chunk).latent_dist.mean for chunk in images.split(256)])
        latents = latents * vae.config.scaling_factor
        image_embeds = encoder(pixel_values=pixel_values).image_embeds

    def unet_stage(path: Path) -> None:
        started = time.perf_counter()
        save_tokenizer(path / "tokenizer")
        tokenizer = CLIPTokenizer.from_pretrained(path / "tokenizer")
        torch.manual_seed(config.seed + 30)
        text_encoder = build_text_encoder().eval()
        captions = [list(class_captions(digit)) for digit in range(10)]
        caption_embeds = _text_states(tokenizer, text_encoder, sum(captions, [])).unflatten(0, (10, -1))
        empty = _text_states(tokenizer, text_encoder, [""])
        caption_ids = _token_ids(tokenizer, sum(captions, [])).unflatten(0, (10, -1))
        unet, losses = train_unet(
            latents,
            labels,
            caption_embeds,
            empty,
            steps=config.unet_steps,
            lr=config.unet_lr,
            text_encoder=text_encoder if config.train_text_encoder else None,
            caption_ids=caption_ids,
            empty_ids=_token_ids(tokenizer, [""]),
            batch_size=config.batch_size,
            seed=config.seed + 40,
            progress=progress,
        )
        _save_fp32(unet, path / "unet")
        _save_fp32(text_encoder, path / "text_encoder")
        record("unet", started, losses)

    unet_dir = write_once(stages / "unet", unet_stage)
    tokenizer = CLIPTokenizer.from_pretrained(unet_dir / "tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(unet_dir / "text_encoder").eval()

    def pipeline(*, with_image_encoder: bool = True) -> StableDiffusionPipeline:
        # SD 1.5's folder has no image encoder: the shipped one lives in models/image_encoder.
        return StableDiffusionPipeline(
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            unet=UNet2DConditionModel.from_pretrained(unet_dir / "unet"),
            scheduler=pipeline_scheduler(),
            safety_checker=None,
            feature_extractor=processor,
            image_encoder=encoder if with_image_encoder else None,
            requires_safety_checker=False,
        )

    def adapter_stage(path: Path) -> None:
        started = time.perf_counter()
        pipe = pipeline()
        parameters = load_adapter_for_training(
            pipe, initial_adapter_state_dict(pipe.unet, seed=config.seed + 50)
        )
        prompts = _text_states(tokenizer, text_encoder, list(STAGE2_PROMPTS))
        losses = train_adapter(
            pipe.unet,
            parameters,
            latents,
            image_embeds,
            labels,
            prompts,
            steps=config.adapter_steps,
            batch_size=config.batch_size,
            seed=config.seed + 60,
            progress=progress,
        )
        path.mkdir(parents=True)
        save_file(adapter_state_dict_from_unet(pipe.unet), path / ADAPTER_WEIGHT_NAME)
        record("adapter", started, losses)

    adapter_dir = write_once(stages / "adapter", adapter_stage)

    def assemble(path: Path) -> None:
        # float16 files for the diffusers models (diffusers loads them as float32 unless told
        # otherwise); the small transformers encoders stay float32, because transformers loads a
        # float16 checkpoint as float16 by default and the pipeline would then mix dtypes.
        pipe = pipeline(with_image_encoder=False)
        pipe.unet.to(torch.float16)
        pipe.vae.to(torch.float16)
        pipe.save_pretrained(path, safe_serialization=True)
        pipe.vae.to(torch.float32)
        encoder.save_pretrained(path / ADAPTER_SUBFOLDER / "image_encoder", safe_serialization=True)
        state = load_file(adapter_dir / ADAPTER_WEIGHT_NAME)
        save_file(
            {key: value.half().contiguous() for key, value in state.items()},
            path / ADAPTER_SUBFOLDER / ADAPTER_WEIGHT_NAME,
        )
        reference = splits["reference"]
        (path / "examples").mkdir()
        for digit in range(10):
            first = int(torch.nonzero(torch.from_numpy(reference.labels) == digit)[0])
            _pil_images(reference.images[first : first + 1])[0].save(path / "examples" / f"digit_{digit}.png")

    return write_once(out / "tiny_digits", assemble)
