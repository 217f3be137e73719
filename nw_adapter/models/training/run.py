"""Run every training stage, write each one atomically, and assemble the shipped model folder.

``run_training(out)`` writes::

    out/stages/vae/  out/stages/image_encoder/  out/stages/text_encoder/     (float32)
    out/stages/unet/  out/stages/adapter/                                 (float32)
    out/stages/log.json                  (losses and wall-clock time of each stage)
    out/tiny_digits/                     (the model folder, float16, as shipped)

Every folder appears complete or not at all (:func:`nw_adapter.models.tiny.write_once`), and
records what made it in ``stage.json`` (the stage's own settings and the records of the stages
it was trained on). An interrupted run resumes: a stage whose folder exists is loaded instead of
retrained, but only when its record equals the one this run would write (informational fields,
:data:`INFORMATIONAL`, left out of the comparison); otherwise :class:`StageMismatchError` names
the stage and the differing settings, and a malformed ``stage.json`` is one line naming the field.
A run killed outright leaves ``write_once``'s staging folders (``stages/.<stage>-<8 characters>/``)
and atomic writes' temporary files; the next run in ``out`` removes them, when no other training
run is using ``out`` (an ``flock`` on ``out/.train_tiny.lock``, shared while a run trains).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import platform
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from nw_adapter.atomic import atomic_write_json, remove_interrupted_writes
from nw_adapter.models.digits_data import DigitSplit, class_captions, load_digit_splits, to_model_range
from nw_adapter.models.tiny_digits import (
    ADAPTER_SUBFOLDER,
    ADAPTER_WEIGHT_NAME,
    adapter_state_dict_from_unet,
    feature_extractor,
    initial_adapter_state_dict,
    pipeline_scheduler,
    save_tokenizer,
)

__all__ = [
    "STAGE2_PROMPTS",
    "StageMismatchError",
    "TrainingConfig",
    "open_training_log",
    "read_training_log",
    "run_training",
]

STAGE2_PROMPTS = ("", "a photograph", "a handwritten digit")
"""Class-free prompts of stage 2 (the CLI's default prompt is ``"a photograph"``)."""


@dataclass(frozen=True)
class TrainingConfig:
    """Steps, batch sizes and seed of every stage (the defaults produce the shipped weights)."""

    seed: int = 0
    vae_steps: int = 300
    encoder_steps: int = 400
    text_encoder_steps: int = 300
    unet_steps: int = 1200
    unet_lr: float = 1e-3
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
            text_encoder_steps=2,
            unet_steps=2,
            adapter_steps=2,
            batch_size=4,
            max_train_images=40,
        )


class StageMismatchError(ValueError):
    """A stage folder on disk cannot be reused: other settings, environment or input files, or no
    readable ``stage.json``."""


_STAGE_SETTINGS = {
    "vae": ("seed", "vae_steps", "batch_size", "max_train_images"),
    "image_encoder": ("seed", "encoder_steps", "batch_size", "max_train_images"),
    "text_encoder": ("seed", "text_encoder_steps"),
    "unet": ("seed", "unet_steps", "unet_lr", "batch_size", "max_train_images"),
    "adapter": ("seed", "adapter_steps", "batch_size", "max_train_images"),
    "tiny_digits": (),
}
"""The config fields each stage's result depends on (besides the stages it is trained on)."""

_STAGE_INPUTS = {
    "vae": (),
    "image_encoder": (),
    "text_encoder": (),
    "unet": ("vae", "text_encoder"),
    "adapter": ("vae", "image_encoder", "text_encoder", "unet"),
    "tiny_digits": ("vae", "image_encoder", "text_encoder", "unet", "adapter"),
}

STAGE_RECORD = "stage.json"

INFORMATIONAL: tuple[str, ...] = ("cpu",)
"""Fields of a record's ``environment`` that describe without deciding reuse: the CPU model (bit
identity of the weights needs the same CPU, but a stage trained elsewhere is still the stage its
settings describe, and the shipped records predate the field)."""


def cpu_model() -> str:
    """The CPU as far as it decides floating-point results: its model name, family, model and
    stepping (Linux ``/proc/cpuinfo``; elsewhere :func:`platform.processor`) and the vector
    instruction set torch's CPU kernels dispatch to (``torch.backends.cpu.get_cpu_capability``).

    Example: ``"AMD EPYC (family 25, model 1, stepping 1); torch kernels AVX2"``.
    """
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(" ".join(key.split()), " ".join(value.split()))
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    labels = {"cpu family": "family", "model": "model", "stepping": "stepping"}
    ids = [f"{label} {fields[key]}" for key, label in labels.items() if fields.get(key)]
    if ids:
        name += f" ({', '.join(ids)})"
    try:
        name += f"; torch kernels {torch.backends.cpu.get_cpu_capability()}"
    except (AttributeError, RuntimeError):
        pass
    return name


def _stage_record(
    name: str,
    config,
    records: dict[str, dict],
    digests: dict[str, str] | None = None,
    *,
    settings_of: dict[str, tuple[str, ...]] | None = None,
    inputs_of: dict[str, tuple[str, ...]] | None = None,
) -> dict:
    """What ``stage.json`` of stage ``name`` holds.

    Its own settings (the config fields it depends on, the CPU threads and the torch version,
    which change floating-point rounding, and the CPU model, informational: see
    :data:`INFORMATIONAL`), and for every input stage that stage's record and the SHA-256 of its
    files (:func:`_folder_digest`), so a stage is reused only on the very weights it was trained on.
    ``config`` is a dataclass with a ``threads`` field; ``settings_of`` / ``inputs_of`` name each
    stage's config fields and input stages (default: this module's stages; another training
    chain, such as :mod:`~nw_adapter.models.training.flux_run`, passes its own).
    """
    settings = asdict(config)
    digests = digests or {}
    settings_of = _STAGE_SETTINGS if settings_of is None else settings_of
    inputs_of = _STAGE_INPUTS if inputs_of is None else inputs_of
    return {
        "stage": name,
        "settings": {field: settings[field] for field in settings_of[name]},
        "environment": {"threads": config.threads, "torch": torch.__version__, "cpu": cpu_model()},
        "inputs": {
            stage: {"record": records[stage], "files": digests.get(stage)} for stage in inputs_of[name]
        },
    }


def _folder_digest(folder: Path) -> str:
    """SHA-256 over the relative path and bytes of every file of ``folder`` but its ``stage.json``."""
    digest = hashlib.sha256()
    for path in sorted(path for path in folder.rglob("*") if path.is_file() and path.name != STAGE_RECORD):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _differences(found: dict, expected: dict, prefix: str = "") -> list[str]:
    """``"path: found != expected"`` for every leaf where two nested records differ."""
    out = []
    for key in sorted(set(found) | set(expected)):
        a, b = found.get(key, "missing"), expected.get(key, "missing")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} on disk, {b!r} asked")
    return out


def _comparable(record: dict) -> dict:
    """``record`` without the :data:`INFORMATIONAL` environment fields, at every nesting level."""
    out = {}
    for key, value in record.items():
        if key == "environment" and isinstance(value, dict):
            value = {k: v for k, v in value.items() if k not in INFORMATIONAL}
        elif isinstance(value, dict):
            value = _comparable(value)
        out[key] = value
    return out


def _shown(value: object) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return "null" if value is None else f"{value!r}"[:40]


def _record_problem(record: object, where: str = "") -> str | None:
    """Why ``record`` is not a well-formed stage record (a phrase naming the field), or None.

    A record is ``{"stage": text, "settings": {name: number, text, true/false or null},
    "environment": {name: ...same...}, "inputs": {stage: {"record": a record, "files": text or
    null}}}``, nested records checked the same way.
    """
    if not isinstance(record, dict):
        return f"'{where or 'the record'}' is {_shown(record)}, not an object"
    prefix = f"{where}." if where else ""
    for name in ("stage", "settings", "environment", "inputs"):
        if name not in record:
            return f"field '{prefix}{name}' is missing"
    if not isinstance(record["stage"], str):
        return f"field '{prefix}stage' must be text, got {_shown(record['stage'])}"
    for name in ("settings", "environment"):
        values = record[name]
        if not isinstance(values, dict):
            return f"field '{prefix}{name}' must be an object, got {_shown(values)}"
        for key, value in values.items():
            if not isinstance(value, str | int | float | bool | type(None)):
                key = key if key.isprintable() and len(key) <= 40 else repr(key)[:40]
                return f"field '{prefix}{name}.{key}' must be a number, text or null, got {_shown(value)}"
    if not isinstance(record["inputs"], dict):
        return f"field '{prefix}inputs' must be an object, got {_shown(record['inputs'])}"
    for stage, entry in record["inputs"].items():
        here = f"{prefix}inputs.{stage if stage.isprintable() and len(stage) <= 40 else repr(stage)[:40]}"
        if not isinstance(entry, dict) or set(entry) != {"record", "files"}:
            return f"field '{here}' must be an object of 'record' and 'files', got {_shown(entry)}"
        if not isinstance(entry["files"], str | type(None)):
            return f"field '{here}.files' must be a SHA-256 (text) or null, got {_shown(entry['files'])}"
        problem = _record_problem(entry["record"], f"{here}.record")
        if problem:
            return problem
    return None


def _read_record(path: Path) -> dict | str:
    """The record in ``path``, or why there is none (a phrase for the error message)."""
    if not path.is_file():
        return f"it has no {STAGE_RECORD}, so it was not made by this version of train_tiny.py"
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"its {STAGE_RECORD} is unreadable ({type(exc).__name__})"
    problem = _record_problem(found)
    return found if problem is None else f"its {STAGE_RECORD} is malformed: {problem}"


def _checked_stage(folder: Path, record: dict, build) -> Path:
    """Build ``folder`` once (atomically, with its record inside) or reuse it if its record matches.

    The record is checked after :func:`~nw_adapter.models.tiny.write_once` in every case, so a
    folder that a concurrent run wrote first is checked too.

    Raises:
        StageMismatchError: ``folder`` exists but was made with other settings, in another
            environment, from other input files, or has no readable record.
    """
    from nw_adapter.models.tiny import write_once

    def build_with_record(path: Path) -> None:
        build(path)
        atomic_write_json(path / STAGE_RECORD, record)

    write_once(folder, build_with_record)
    found = _read_record(folder / STAGE_RECORD)
    if isinstance(found, str):
        reason = found
    elif _comparable(found) != _comparable(record):
        reason = "it was trained otherwise: " + "; ".join(
            _differences(_comparable(found), _comparable(record))[:3]
        )
    else:
        return folder
    raise StageMismatchError(f"cannot reuse {folder}: {reason}; pass a new --out or delete that folder")


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


LOCK_NAME = ".train_tiny.lock"


def _staging_name(stages: tuple[str, ...]) -> re.Pattern:
    """Names of ``write_once``'s staging folders (``tempfile.mkdtemp(prefix=".<stage>-")``) of ``stages``."""
    return re.compile(rf"^\.({'|'.join(map(re.escape, stages))})-[a-z0-9_]{{8}}$")


def remove_interrupted_stages(
    out: Path, stages: tuple[str, ...] | None = None, final: str = "tiny_digits"
) -> list[Path]:
    """Remove what killed runs left in ``out``: staging folders of the stages, temporary log files.

    Only folders named ``.<stage>-<8 characters>`` where ``write_once`` makes them (in ``stages/``
    for the five stages, in ``out`` for the assembled ``tiny_digits``) and
    ``stages/.log.<8 characters>.tmp.json``; call it only when no other run trains in ``out``
    (see :func:`_training_lock`). A ``stages`` inside ``out`` that is a symbolic link is not
    entered: its target is not a folder the run made, so nothing in it is removed (``out`` itself
    may be a link: the user named it). ``stages`` and ``final`` name another chain's stage folders
    and assembled folder (default: this module's five stages and ``tiny_digits``).

    Returns:
        The removed paths.
    """
    removed: list[Path] = []
    trained = stages or tuple(name for name in _STAGE_SETTINGS if name != "tiny_digits")
    for folder, pattern in ((out, _staging_name((final,))), (out / "stages", _staging_name(trained))):
        if (folder != out and folder.is_symlink()) or not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if pattern.match(path.name) and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    if not (out / "stages").is_symlink():
        removed += remove_interrupted_writes(out / "stages", lambda name: name == "log.json")
    return removed


@contextlib.contextmanager
def _training_lock(out: Path, cleanup=None) -> Iterator[None]:
    """Hold a shared lock on ``out`` while training; clean up killed runs' leftovers first when no
    other run holds it (exclusive lock taken without waiting, then shared). Without ``fcntl``
    (Windows) nothing is locked and nothing is removed."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    with open(out / LOCK_NAME, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another run trains in out: its staging folders are alive
            fcntl.flock(handle, fcntl.LOCK_SH)
        else:
            (cleanup or remove_interrupted_stages)(out)
            fcntl.flock(handle, fcntl.LOCK_SH)
        yield


def run_training(
    out: str | Path, config: TrainingConfig = TrainingConfig(), *, progress: bool = True
) -> Path:
    """Train (or resume) every stage and write the final model folder ``out/tiny_digits``.

    Leftovers of a killed run in ``out`` are removed first (:func:`remove_interrupted_stages`).

    Args:
        out: Output folder.
        config: Steps, batch size, seed and CPU threads.
        progress: Show progress bars.

    Returns:
        The model folder ``out/tiny_digits``.
    """
    read_training_log(Path(out) / "stages" / "log.json")  # a damaged log of an earlier run: one line, now
    with _training_lock(Path(out)):
        return _run_training(Path(out), config, progress=progress)


def read_training_log(log_path: Path) -> dict:
    """The entries of an earlier run's ``stages/log.json`` (empty when there is none).

    Raises:
        StageMismatchError: a log that is not a JSON object (empty, truncated, edited): its entries
            would be lost; one line naming the file and the fix.
    """
    if not log_path.is_file():
        return {}
    try:
        log = json.loads(log_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        problem = "is empty" if log_path.stat().st_size == 0 else f"is not valid JSON ({type(exc).__name__})"
    else:
        if isinstance(log, dict):
            return log
        problem = f"holds a JSON {type(log).__name__}, not the log's object"
    raise StageMismatchError(
        f"cannot continue the training log {log_path}: it {problem}; pass a new --out, or move that file "
        "away to start a new log"
    )


def open_training_log(log_path: Path, config) -> Callable[..., None]:
    """Start (or continue) a run's ``stages/log.json`` and return the function that records a stage.

    The log holds the run's ``config`` (a dataclass), the torch and Python versions, and one entry
    per stage: seconds since ``started`` (``time.perf_counter``), the number of steps, the first,
    last and mean-of-the-last-50 losses, and the caller's extra fields. Entries of a resumed run's
    earlier stages are kept; every record rewrites the file atomically.

    Args:
        log_path: ``out/stages/log.json``.
        config: The run's configuration dataclass.

    Returns:
        ``record(name, started, losses, **extra)``.
    """
    log = read_training_log(log_path)
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

    return record


def _run_training(out: Path, config: TrainingConfig, *, progress: bool) -> Path:
    """The body of :func:`run_training` (under its lock)."""
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from safetensors.torch import load_file, save_file
    from transformers import CLIPTextModel, CLIPTokenizer, CLIPVisionModelWithProjection

    from nw_adapter.models.training.autoencoder import train_vae
    from nw_adapter.models.training.diffusion import load_adapter_for_training, train_adapter, train_unet
    from nw_adapter.models.training.image_encoder import classifier_accuracy, train_image_encoder
    from nw_adapter.models.training.text_encoder import NO_DIGIT, caption_accuracy, train_text_encoder

    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)
    out = Path(out)
    stages = out / "stages"
    record = open_training_log(stages / "log.json", config)

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

    records: dict[str, dict] = {}
    digests: dict[str, str] = {}

    def stage(name: str, build, folder: Path | None = None) -> Path:
        records[name] = _stage_record(name, config, records, digests)
        folder = _checked_stage(folder or stages / name, records[name], build)
        digests[name] = _folder_digest(folder)
        return folder

    vae = AutoencoderKL.from_pretrained(stage("vae", vae_stage))
    encoder = CLIPVisionModelWithProjection.from_pretrained(stage("image_encoder", encoder_stage))
    vae.requires_grad_(False)
    encoder.requires_grad_(False)
    with torch.no_grad():
        latents = torch.cat([vae.encode(chunk).latent_dist.mean for chunk in images.split(256)])
        latents = latents * vae.config.scaling_factor
        image_embeds = encoder(pixel_values=pixel_values).image_embeds

    captions = [list(class_captions(digit)) for digit in range(10)]

    def text_encoder_stage(path: Path) -> None:
        started = time.perf_counter()
        save_tokenizer(path / "tokenizer")
        tokenizer = CLIPTokenizer.from_pretrained(path / "tokenizer")
        prompts = sum(captions, []) + list(STAGE2_PROMPTS)
        prompt_labels = torch.tensor(
            [digit for digit in range(10) for _ in captions[digit]] + [NO_DIGIT] * len(STAGE2_PROMPTS)
        )
        token_ids = _token_ids(tokenizer, prompts)
        text_encoder, head, losses = train_text_encoder(
            token_ids,
            prompt_labels,
            end_of_text_id=tokenizer.eos_token_id,
            steps=config.text_encoder_steps,
            seed=config.seed + 30,
            progress=progress,
        )
        accuracy = caption_accuracy(
            text_encoder, head, token_ids, prompt_labels, end_of_text_id=tokenizer.eos_token_id
        )
        _save_fp32(text_encoder, path / "text_encoder")
        record("text_encoder", started, losses, caption_accuracy=accuracy)

    text_dir = stage("text_encoder", text_encoder_stage)
    tokenizer = CLIPTokenizer.from_pretrained(text_dir / "tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(text_dir / "text_encoder").eval()
    text_encoder.requires_grad_(False)

    def unet_stage(path: Path) -> None:
        started = time.perf_counter()
        caption_embeds = _text_states(tokenizer, text_encoder, sum(captions, [])).unflatten(0, (10, -1))
        unet, losses = train_unet(
            latents,
            labels,
            caption_embeds,
            _text_states(tokenizer, text_encoder, [""]),
            steps=config.unet_steps,
            lr=config.unet_lr,
            batch_size=config.batch_size,
            seed=config.seed + 40,
            progress=progress,
        )
        _save_fp32(unet, path)
        record("unet", started, losses)

    unet_dir = stage("unet", unet_stage)

    def pipeline(*, with_image_encoder: bool = True) -> StableDiffusionPipeline:
        # SD 1.5's folder has no image encoder: the shipped one lives in models/image_encoder.
        return StableDiffusionPipeline(
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            unet=UNet2DConditionModel.from_pretrained(unet_dir),
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

    adapter_dir = stage("adapter", adapter_stage)

    def assemble(path: Path) -> None:
        # float16 files for the diffusers models (diffusers loads them as float32 unless told
        # otherwise); the small transformers encoders stay float32, because transformers loads a
        # float16 checkpoint as float16 by default and the pipeline would then mix dtypes.
        pipe = pipeline(with_image_encoder=False)
        # an unused tokenizer: a used one saves its last padding/truncation state, which would
        # make the file depend on whether the earlier stages ran or were reused
        pipe.register_modules(tokenizer=CLIPTokenizer.from_pretrained(text_dir / "tokenizer"))
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
        for config_file in path.rglob("config.json"):  # the stage folders' paths do not belong in it
            values = json.loads(config_file.read_text())
            if values.pop("_name_or_path", None) is not None:
                config_file.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")

    return stage("tiny_digits", assemble, out / "tiny_digits")
