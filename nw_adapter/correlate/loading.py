"""Build the pipeline the command line observes: real defaults, local folders, or ``tiny``.

All three go through the same standard diffusers calls::

    pipe = DiffusionPipeline.from_pretrained(model, torch_dtype=dtype)
    pipe.load_ip_adapter(ip_adapter, subfolder=subfolder, weight_name=weight_name)

``model`` and ``ip_adapter`` are Hub repository ids (read from the Hugging Face cache, or
downloaded), local folders, or ``"tiny"``: the trained tiny digits model shipped in the package
(:mod:`nw_adapter.models.tiny_digits`), loaded like any local folder. The random-weight tiny SD 3.5
and Flux models (``tiny-sd3``, ``tiny-flux``) are written once into a cache folder
(``$NW_ADAPTER_CACHE``, else ``$XDG_CACHE_HOME/nw_adapter``, else ``~/.cache/nw_adapter``) by
:func:`~nw_adapter.correlate.spec.write_tiny_cache`.

Every failure becomes a :class:`~nw_adapter.correlate.spec.ModelLoadError` with one line saying
what to do. Without network nothing is attempted and retried: whether the Hub can be reached is
decided once, before the first Hub call (:func:`hub_offline_reason`); offline, a Hub id whose files
are not in the Hugging Face cache is that one line at once, and cached ones load with
``local_files_only=True``. A ``--model`` that is neither a folder, a Hub id nor an offline model
(``tiny-sd15``) is refused while the options are parsed, with the closest offline names
(:func:`check_model_name`).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import warnings
from pathlib import Path
from typing import Any

from nw_adapter.correlate import families
from nw_adapter.correlate.spec import (
    DEFAULT_IP_ADAPTER,
    DEFAULT_MODEL,
    DEFAULT_SUBFOLDER,
    DEFAULT_WEIGHT_NAME,
    SDXL_SUBFOLDER,
    SDXL_WEIGHT_NAME,
    TINY,
    TINY_DIGITS_DIR,
    ModelLoadError,
    ModelSpec,
    hub_offline_reason,
    tiny_cache_dir,
    write_tiny_cache,
)
from nw_adapter.integration.families import TINY_MODELS as registry_tiny_models
from nw_adapter.integration.families import tiny_model as registry_tiny_model

__all__ = [
    "DEFAULT_IP_ADAPTER",
    "DEFAULT_MODEL",
    "DEFAULT_SUBFOLDER",
    "DEFAULT_WEIGHT_NAME",
    "DTYPES",
    "SCHEDULERS",
    "SDXL_SUBFOLDER",
    "SDXL_WEIGHT_NAME",
    "TINY",
    "ModelLoadError",
    "ModelSpec",
    "OFFLINE_MODELS",
    "build_pipeline",
    "check_hub_files",
    "check_model_name",
    "hub_offline_reason",
    "resolve_device",
    "resolve_dtype",
    "resolve_spec",
    "tiny_cache_dir",
    "write_tiny_cache",
]

SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddim": ("DDIMScheduler", {}),
    "pndm": ("PNDMScheduler", {}),
    "ddpm": ("DDPMScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler-a": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
    "lms": ("LMSDiscreteScheduler", {}),
    "dpm++": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"}),
    "dpm++-karras": (
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "dpmsolver++", "use_karras_sigmas": True},
    ),
    "dpm": ("DPMSolverSinglestepScheduler", {}),
    "unipc": ("UniPCMultistepScheduler", {}),
}
"""``--scheduler`` names -> (diffusers class, config overrides). ``None`` keeps the model's own."""

DTYPES = ("auto", "float32", "float16", "bfloat16")

OFFLINE_MODELS: dict[str, str] = {model.name: model.label for model in registry_tiny_models}
"""``--model`` names that need no download -> what they are: the registry's embedded models
(:data:`~nw_adapter.integration.families.TINY_MODELS`)."""


def _is_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists()


def _is_hub_id(name: str | None) -> bool:
    """Whether ``name`` would be looked up on the Hub (not a local folder, not a tiny model)."""
    return bool(name) and name not in OFFLINE_MODELS and not _is_local(name)


def check_model_name(name: str, option: str = "--model") -> None:
    """Refuse a ``--model`` / ``--ip-adapter`` that is no folder, no ``owner/name`` and no offline model.

    Hub pipelines and adapters are ``owner/name``; a bare name that is not a local folder is a
    misspelt offline model (``tiny-sd15``) or a typo, so the message names the closest offline
    names (:func:`difflib.get_close_matches`) and all of them.

    Raises:
        ModelLoadError: the one line, naming ``option``.
    """
    offline = OFFLINE_MODELS if option == "--model" else {TINY: "the SD 1.5 digits adapter"}
    if name in offline or "/" in name or "\\" in name or _is_local(name):
        return
    close = difflib.get_close_matches(name, list(offline), n=2, cutoff=0.5)
    guess = f"did you mean {' or '.join(close)}? " if close else ""
    listed = ", ".join(f"{known} ({what})" for known, what in offline.items())
    raise ModelLoadError(
        f"{option} '{name}': not a local folder, a Hub id (owner/name) or an offline model; {guess}"
        f"offline: {listed}"
    )


def _cached(repo_id: str, filename: str) -> bool:
    """Whether ``filename`` of the Hub repository is in the Hugging Face cache (no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, filename), str)
    except ValueError:  # not a valid repository id
        return False


def check_hub_files(spec: ModelSpec) -> None:
    """Offline: every Hub id of the resolved ``spec`` must be in the cache; else the one-line hint now.

    Called on the resolved spec before anything is loaded (the command line: before torch is
    imported; :func:`build_pipeline` again). Online, or with local folders and tiny models only,
    it does nothing.

    Checks the file each loader reads first (``model_index.json``, the adapter's weight file, the
    image encoder's ``config.json``); a pipeline cached only in part is found by the load itself,
    which then runs with ``local_files_only=True`` and ends in the same hint.
    """
    needed = [
        (spec.model, "model_index.json", "--model"),
        (spec.ip_adapter, f"{spec.subfolder}/{spec.weight_name}" if spec.subfolder else spec.weight_name,
         "--ip-adapter"),
        (spec.image_encoder, "config.json", "--image-encoder"),
    ]  # fmt: skip
    needed = [(name, file, option) for name, file, option in needed if _is_hub_id(name)]
    if not needed or hub_offline_reason() is None:
        return
    for name, filename, option in needed:
        if not _cached(name, filename):
            raise ModelLoadError(_offline_hint(name, option, spec if option == "--ip-adapter" else None))


def _model_class_name(model: str) -> str | None:
    index = Path(model).expanduser() / "model_index.json"
    if index.is_file():
        try:
            return json.loads(index.read_text()).get("_class_name")
        except (OSError, ValueError):
            return None
    return None


def resolve_spec(spec: ModelSpec) -> ModelSpec:
    """Replace ``tiny`` by the shipped trained model's folder and fill the adapter defaults.

    Nothing is fetched: the family of a Hub id is read from its cached ``model_index.json``
    (downloaded only when online). Offline, :func:`check_hub_files` says which Hub ids cannot be
    loaded.

    Raises:
        ModelLoadError: A local model folder that is not a diffusers pipeline, or a local
            adapter folder without the weight file.
    """
    flow_spec = families.resolve_flow_spec(spec, tiny_cache_dir())  # SD3 / Flux: their defaults
    if flow_spec is not None:
        return flow_spec
    model, adapter = spec.model, spec.ip_adapter
    if model == TINY or adapter == TINY:
        tiny_model = tiny_adapter = TINY_DIGITS_DIR  # the trained model shipped in the package
        model = str(tiny_model) if model == TINY else model
        adapter = str(tiny_adapter) if adapter in (TINY, None) else adapter
    adapter = adapter or DEFAULT_IP_ADAPTER
    if _is_local(model):
        folder = Path(model).expanduser()
        if not (folder / "model_index.json").is_file():
            raise ModelLoadError(
                f"--model '{model}': not a diffusers pipeline folder (no model_index.json); pass a folder "
                f"saved with save_pretrained, a Hub id such as {DEFAULT_MODEL}, or --model tiny"
            )
    is_xl = "XL" in (_model_class_name(model) or "")
    subfolder = spec.subfolder
    if subfolder is None:
        subfolder = SDXL_SUBFOLDER if is_xl else DEFAULT_SUBFOLDER
    weight_name = spec.weight_name or (SDXL_WEIGHT_NAME if is_xl else DEFAULT_WEIGHT_NAME)
    if _is_local(adapter):
        weights = Path(adapter).expanduser() / subfolder / weight_name
        if not weights.is_file():
            raise ModelLoadError(
                f"--ip-adapter '{adapter}': no IP-Adapter weights at '{weights}'; pass the folder that "
                f"holds {subfolder}/{weight_name} (layout of {DEFAULT_IP_ADAPTER}), or set "
                "--subfolder/--weight-name"
            )
    return ModelSpec(model=model, ip_adapter=adapter, subfolder=subfolder, weight_name=weight_name)


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` if available, else ``mps``, else ``cpu``; others are checked.

    Raises:
        ModelLoadError: A device that torch does not have here.
    """
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ModelLoadError(
            f"--device '{device}': not a torch device; use auto, cpu, cuda or cuda:N"
        ) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {device}: CUDA is not available here; use --device cpu (or auto)")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ModelLoadError(
            f"--device {device}: only {torch.cuda.device_count()} CUDA device(s); use cuda:0 .. "
            f"cuda:{torch.cuda.device_count() - 1}"
        )
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(f"--device {device}: MPS is not available here; use --device cpu (or auto)")
    return device


def resolve_dtype(dtype: str, device: str):
    """``auto`` -> float16 on CUDA, float32 elsewhere; otherwise the named torch dtype."""
    import torch

    if dtype == "auto":
        return torch.float16 if device.startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"--dtype '{dtype}': unknown; use one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


SD15_FILES: tuple[str, ...] = (
    "model_index.json",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "tokenizer/merges.txt",
    "tokenizer/special_tokens_map.json",
    "tokenizer/tokenizer_config.json",
    "tokenizer/vocab.json",
    "unet/config.json",
    "unet/diffusion_pytorch_model.safetensors",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
    "safety_checker/config.json",
    "safety_checker/model.safetensors",
    "feature_extractor/preprocessor_config.json",
)
"""The files of :data:`DEFAULT_MODEL` that ``DiffusionPipeline.from_pretrained`` reads (fp32 weights)."""


GATED_MODELS: frozenset[str] = frozenset(
    {
        "stabilityai/stable-diffusion-3.5-large",
        "stabilityai/stable-diffusion-3.5-large-turbo",
        "stabilityai/stable-diffusion-3.5-medium",
        "black-forest-labs/FLUX.1-dev",
    }
)
"""Hub repositories that need their licence accepted on the Hub and a login (``hf auth login``)."""

DIFFUSERS_FOLDER_PATTERNS: tuple[str, ...] = (
    "--include 'model_index.json'",
    "--include '*/*.json'",
    "--include '*/*.txt'",
    "--include '*/*.model'",
    "--include '*/*.safetensors'",
    "--exclude '*fp16*'",
    "--exclude '*non_ema*'",
    "--exclude 'text_encoders/*'",
)
"""``hf download`` filters that fetch a pipeline's diffusers-format component folders only: not
the single-file checkpoint at the repository's root nor the non-diffusers ``text_encoders/``
of SD 3.5 (tens of GB between them), nor fp16 / non-EMA variants."""

IMAGE_ENCODER_FILES: tuple[str, ...] = ("config.json", "model.safetensors", "preprocessor_config.json")
"""The files of an image-encoder repository that the SD 3.5 / Flux adapters' loaders read."""


def tiny_stand_in(name: str) -> str:
    """The embedded model to run offline instead of the Hub pipeline ``name``: one of its family's
    (the trained one where there is one), else ``tiny``.

    The family is read from the pipeline's cached ``model_index.json`` when there is one
    (:func:`~nw_adapter.correlate.families.family_of_model`), else guessed from the id by the
    registry (:func:`~nw_adapter.integration.families.family_of_hub_id`: the rows' ``hub_names``).
    """
    from nw_adapter.integration import families as registry

    family = families.known_family_of_model(name) or registry.family_of_hub_id(name)
    if family is None:
        return TINY
    ranked = (
        *registry.tiny_models(family=family.name, trained=True),
        *registry.tiny_models(family=family.name),
    )
    return ranked[0] if ranked else TINY


def download_command(name: str, option: str, spec: ModelSpec | None = None) -> str:
    """The ``hf download`` command(s) that fetch only the files the job needs.

    The adapter: its weight file, and its image encoder (``<subfolder>/image_encoder`` in the
    h94 layout; the separate encoder repository of the SD 3.5 / Flux adapters). The default
    model: :data:`SD15_FILES`. Another pipeline: its diffusers-format folders only
    (:data:`DIFFUSERS_FOLDER_PATTERNS`).
    """
    if option == "--ip-adapter" and spec is not None:
        if spec.subfolder:
            files = (
                f"{spec.subfolder}/{spec.weight_name}",
                f"{spec.subfolder}/image_encoder/config.json",
                f"{spec.subfolder}/image_encoder/model.safetensors",
            )
            return f"hf download {name} {' '.join(files)}"
        command = f"hf download {name} {spec.weight_name}"
        encoder = getattr(spec, "image_encoder", None)
        if encoder and not _is_local(encoder) and encoder != "tiny":
            command += f" && hf download {encoder} {' '.join(IMAGE_ENCODER_FILES)}"
        return command
    if option == "--image-encoder":
        return f"hf download {name} {' '.join(IMAGE_ENCODER_FILES)}"
    if name == DEFAULT_MODEL:
        return f"hf download {name} {' '.join(SD15_FILES)}"
    return f"hf download {name} {' '.join(DIFFUSERS_FOLDER_PATTERNS)}"


def _offline_hint(name: str, option: str, spec: ModelSpec | None = None) -> str:
    login = " (gated: accept its licence on the Hub, then hf auth login)" if name in GATED_MODELS else ""
    tiny = tiny_stand_in(spec.model if spec is not None else name)
    embedded = registry_tiny_model(tiny)
    stand_in = f"--model {tiny} ({embedded.label}{'' if embedded.trained else ': it tests the code only'})"
    return (
        f"{option} '{name}': not in the Hugging Face cache and the Hub cannot be reached (offline); "
        f"download the needed files once with network{login} ({download_command(name, option, spec)}), "
        f"pass a local folder with {option} PATH, or run offline with {stand_in}"
    )


def set_scheduler(pipe, name: str | None) -> None:
    """Replace the pipeline's scheduler by ``SCHEDULERS[name]`` built from the current config."""
    if name is None:
        return
    import diffusers

    class_name, overrides = SCHEDULERS[name]
    scheduler_class = getattr(diffusers, class_name)
    try:
        pipe.scheduler = scheduler_class.from_config(pipe.scheduler.config, **overrides)
    except ImportError as exc:
        raise ModelLoadError(f"--scheduler {name}: needs a missing package ({_one_line(exc)})") from None


WEIGHT_SUFFIXES: tuple[str, ...] = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
"""Endings of the weight files (or shard indexes) a component folder of a pipeline loads from."""


def damaged_safetensors(path: Path) -> str | None:
    """``'<path>' is empty`` or ``... is not a complete safetensors file`` when safetensors cannot open
    the local file ``path`` (its header only is read; no torch), else None."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as weights:
            weights.keys()
    except (SafetensorError, OSError, ValueError) as exc:
        size = path.stat().st_size if path.is_file() else 0
        what = (
            "is empty"
            if size == 0
            else f"is not a complete safetensors file ({size} bytes: {_one_line(exc)})"
        )
        return f"'{path}' {what}"
    return None


def check_adapter_files(spec: ModelSpec, *, image_encoder_given: bool) -> None:
    """Refuse a local IP-Adapter weight file or a local image encoder's weights that safetensors
    cannot open, before the pipeline loads (one line naming the option and the file).

    Raises:
        ModelLoadError: ``--ip-adapter`` (or ``--image-encoder``, when given; else the adapter's)
            ``'folder': 'file' is empty / not a complete safetensors file ...; the fix``.
    """
    weight_name = str(spec.weight_name or "")
    if spec.ip_adapter and weight_name.endswith(".safetensors") and _is_local(spec.ip_adapter):
        path = Path(spec.ip_adapter).expanduser() / (spec.subfolder or "") / weight_name
        damaged = damaged_safetensors(path) if path.is_file() else None
        if damaged is not None:
            raise ModelLoadError(
                f"--ip-adapter '{spec.ip_adapter}': {damaged}; download or copy the adapter again"
            )
    encoder = spec.image_encoder
    if encoder and encoder != TINY and _is_local(encoder) and Path(encoder).expanduser().is_dir():
        for path in sorted(Path(encoder).expanduser().glob("*.safetensors")):
            damaged = damaged_safetensors(path)
            if damaged is not None:
                option = "--image-encoder" if image_encoder_given else "--ip-adapter's image encoder"
                raise ModelLoadError(
                    f"{option} '{encoder}': {damaged}; download or copy the image encoder again"
                )


def check_pipeline_folder(model: str) -> None:
    """Refuse a local pipeline folder one of whose model components has no weight file, or a weight
    file that safetensors cannot open, or whose ``model_index.json`` is not JSON.

    A component is a model where its folder holds a ``config.json`` (schedulers, tokenizers and
    feature extractors keep other files); it needs a file ending in one of :data:`WEIGHT_SUFFIXES`.
    Checked before diffusers is imported, so the message names the file diffusers would load first
    (``diffusion_pytorch_model.safetensors``, transformers' ``model.safetensors``) instead of the
    last one it tried.

    Raises:
        ModelLoadError: the one line naming the folder and the file it lacks.
    """
    folder = Path(model).expanduser()
    index = folder / "model_index.json"
    if not _is_local(model) or not index.is_file():
        return
    try:
        components = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"--model '{model}': its model_index.json is not valid JSON ({_one_line(exc)}); copy the "
            "pipeline folder again (saved with save_pretrained)"
        ) from None
    for name, entry in components.items() if isinstance(components, dict) else ():
        part = folder / name
        if name.startswith("_") or not isinstance(entry, list) or not (part / "config.json").is_file():
            continue
        if any(path.name.endswith(WEIGHT_SUFFIXES) for path in part.iterdir()):
            damaged = next(filter(None, map(damaged_safetensors, sorted(part.glob("*.safetensors")))), None)
            if damaged is not None:
                raise ModelLoadError(f"--model '{model}': {damaged}; copy or download the pipeline again")
            continue
        library = entry[0] if entry else None
        expected = "diffusion_pytorch_model.safetensors" if library == "diffusers" else "model.safetensors"
        raise ModelLoadError(
            f"--model '{model}': '{part}' has no weights ({expected}); pass a complete pipeline folder "
            "(saved with save_pretrained) or a Hub id"
        )


def _quiet_loading(verbose: bool) -> contextlib.AbstractContextManager[None]:
    """diffusers' and transformers' loggers at critical level while loading (unless ``verbose``):
    a loading error becomes this module's one line, and is not printed before it too (their bars as
    the caller set them; :func:`nw_adapter.library_output.library_output`)."""
    from nw_adapter.library_output import CRITICAL, library_output

    return library_output(verbose=verbose, bars=True, level=CRITICAL)


def build_pipeline(
    spec: ModelSpec, *, device: str = "cpu", dtype=None, scheduler: str | None = None, verbose: bool = False
):
    """Load the pipeline and the IP-Adapter the standard diffusers way.

    Args:
        spec: Resolved :class:`ModelSpec` (see :func:`resolve_spec`).
        device: Torch device string (already resolved).
        dtype: Torch dtype (``None``: float32).
        scheduler: Key of :data:`SCHEDULERS`, or ``None`` to keep the model's scheduler.
        verbose: Let the libraries' own error lines through while loading.

    Returns:
        A diffusers pipeline on ``device`` with the adapter loaded.

    Raises:
        ModelLoadError: Anything that stops loading, with the fix in the message.
    """
    check_hub_files(spec)
    check_pipeline_folder(spec.model)
    with _quiet_loading(verbose):
        pipe = _load(spec, dtype, scheduler)
    return pipe.to(device)


def _load(spec: ModelSpec, dtype, scheduler: str | None):
    import torch
    from diffusers import DiffusionPipeline

    dtype = dtype or torch.float32
    local = _is_local(spec.model)
    uses_hub = any(_is_hub_id(name) for name in (spec.model, spec.ip_adapter, spec.image_encoder))
    # offline: the cache only, so that huggingface_hub does not retry a connection for a minute
    offline = {"local_files_only": True} if uses_hub and hub_offline_reason() is not None else {}
    try:
        with warnings.catch_warnings():
            # diffusers >= 0.36 renamed torch_dtype to dtype; torch_dtype works in the whole range.
            warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
            pipe = DiffusionPipeline.from_pretrained(spec.model, torch_dtype=dtype, **offline)
    except (OSError, ValueError) as exc:
        if not local and _looks_offline(exc):
            raise ModelLoadError(_offline_hint(spec.model, "--model")) from None
        raise ModelLoadError(
            f"--model '{spec.model}': cannot load ({_one_line(exc)}); check the id or folder"
        ) from None
    if not hasattr(pipe, "load_ip_adapter"):
        raise ModelLoadError(
            f"--model '{spec.model}': {type(pipe).__name__} does not support IP-Adapters; use a "
            "Stable Diffusion 1.5, SDXL, SD 3.5 or Flux pipeline"
        )
    try:
        families.load_ip_adapter(pipe, spec, dtype, **offline)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        if not _is_local(spec.ip_adapter) and _looks_offline(exc):
            raise ModelLoadError(_offline_hint(spec.ip_adapter, "--ip-adapter", spec)) from None
        raise ModelLoadError(
            f"--ip-adapter '{spec.ip_adapter}' ({spec.subfolder}/{spec.weight_name}): cannot load "
            f"({_one_line(exc)}); check --ip-adapter, --subfolder and --weight-name match --model"
        ) from None
    families.check_scheduler(pipe, scheduler)
    set_scheduler(pipe, scheduler)
    from nw_adapter.models import tiny_flux_digits

    if _is_local(spec.model) and Path(spec.model).expanduser().resolve() == tiny_flux_digits.SHIPPED_DIR:
        tiny_flux_digits.set_default_size(pipe)  # 32 x 32, not FluxPipeline's 512 x 512
    return pipe


def _exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception it was raised from or during (``__cause__``/``__context__``)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _looks_offline(exc: BaseException) -> bool:
    """Whether a loading error means "not cached and no network" (vs. a bad id or file).

    diffusers reports a file it could not fetch as "does not appear to have a file named ...";
    the reason sits further down the exception chain: huggingface_hub's
    ``LocalEntryNotFoundError`` (no network and not cached) or a connection error. Offline mode
    (``HF_HUB_OFFLINE``) counts too.
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    markers = ("not fully cached", "offline", "cannot reach", "couldn't connect", "local_files_only")
    for link in _exception_chain(exc):
        if isinstance(link, (LocalEntryNotFoundError, ConnectionError, TimeoutError)):
            return True
        if "connect" in type(link).__name__.lower() or "timeout" in type(link).__name__.lower():
            return True
        text = str(link).lower()
        if any(marker in text for marker in markers) or "connection" in text:
            return True
    return bool(constants.HF_HUB_OFFLINE)
