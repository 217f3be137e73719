"""Model families of the command line: which adapter, image encoder and call a pipeline needs.

What a family is, and every fact about it, is a row of :data:`nw_adapter.integration.families.FAMILIES`
(the one table of the families; this module reads it and decides nothing on its own). ``--model``
names a pipeline; its family is read from the pipeline itself (``model_index.json``'s
``_class_name``, matched against the rows' ``pipelines`` prefixes), and a family with its own public
IP-Adapter (the row's ``ip_adapter``, ``weight_name``, ``image_encoder``: SD 3 / 3.5 and Flux) brings
it as the default; the other pipelines (UNets) keep :mod:`~nw_adapter.correlate.spec`'s SD 1.5 /
SDXL defaults. The embedded models are the registry's
:data:`~nw_adapter.integration.families.TINY_MODELS`: the random-weight ones are written once into
the tiny-model cache from their builders and loaded like any local folder.

Every failure is a :class:`~nw_adapter.correlate.spec.ModelLoadError` with one line saying
what to do.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nw_adapter.correlate.spec import (
    DEFAULT_IP_ADAPTER,
    TINY,
    ModelLoadError,
    ModelSpec,
    hub_offline_reason,
    write_tiny_cache,
)
from nw_adapter.integration import families as registry
from nw_adapter.integration.families import Family

FAMILIES: dict[str, Family] = {family.name: family for family in registry.FAMILIES if family.ip_adapter}
"""The families with their own default adapter (SD 3, Flux), by name."""

UNET_BLOCKS: dict[str, str] = {"down": "down_blocks", "mid": "mid_block", "up": "up_blocks"}
"""``--layers`` short names of UNet blocks -> the attention-processor name prefix."""

__all__ = [
    "FAMILIES",
    "UNET_BLOCKS",
    "call_kwargs",
    "check_scheduler",
    "check_weight_file",
    "ensure_tiny_flow_models",
    "family_of_class_name",
    "family_of_model",
    "known_family_of_model",
    "family_of_pipeline",
    "layer_blocks",
    "load_ip_adapter",
    "planned_timesteps",
    "resolve_flow_spec",
    "shown_adapter",
    "shown_spec",
    "write_joint_records",
]


def family_of_class_name(class_name: str | None) -> str:
    """``"sd3"``, ``"flux"`` or ``"unet"`` from a pipeline class name
    (:func:`~nw_adapter.integration.families.family_of_pipeline_class`)."""
    return registry.family_of_pipeline_class(class_name).name


def family_of_pipeline(pipe: Any) -> str:
    """The family of a loaded pipeline, from its denoiser's class
    (:func:`~nw_adapter.integration.families.family_of_pipeline`)."""
    return registry.family_of_pipeline(pipe).name


def _class_name_of(model: str) -> str | None:
    """``_class_name`` of ``model_index.json``: a local folder's, else the Hub's (cached or fetched)."""
    folder = Path(model).expanduser()
    index = folder / "model_index.json"
    if not index.is_file() and not folder.exists() and model.count("/") == 1:
        try:
            from huggingface_hub import hf_hub_download, try_to_load_from_cache

            cached = try_to_load_from_cache(model, "model_index.json")  # no network when cached
            if not isinstance(cached, str) and hub_offline_reason() is not None:
                return None  # offline: loading.check_hub_files names what is missing, without retries
            index = Path(cached if isinstance(cached, str) else hf_hub_download(model, "model_index.json"))
        except Exception:  # offline or unknown id: loading the pipeline reports it properly
            return None
    try:
        return json.loads(index.read_text()).get("_class_name")
    except (OSError, ValueError):
        return None


def family_of_model(model: str) -> str:
    """The family of ``--model`` (a tiny name, local folder or Hub id), before loading it."""
    tiny = registry.tiny_model(model)
    if tiny is not None:
        return tiny.family
    return family_of_class_name(_class_name_of(model))


def known_family_of_model(model: str) -> Family | None:
    """The row of ``--model``'s family where it can be read (an embedded model, or a pipeline whose
    ``model_index.json`` is local or cached; offline, nothing is fetched), else None."""
    tiny = registry.tiny_model(model)
    if tiny is not None:
        return registry.family_named(tiny.family)
    class_name = _class_name_of(model)
    return None if class_name is None else registry.family_of_pipeline_class(class_name)


def ensure_tiny_flow_models(family: Family, cache: Path, *, seed: int = 0) -> tuple[Path, Path, Path]:
    """Write the random-weight tiny pipeline and adapter of ``family`` once (the builders its
    :class:`~nw_adapter.integration.families.TinyModel` row names); return (model, adapter, image
    encoder)."""
    from nw_adapter.models import tiny_flow
    from nw_adapter.models.tiny import write_once

    tiny = registry.tiny_model(registry.tiny_models(family=family.name, trained=False)[0])
    module = importlib.import_module(tiny.module)
    save_model, save_adapter, encoder_folder = (getattr(module, name) for name in tiny.builders)
    root = cache / f"tiny-flow-{tiny_flow.flow_builder_fingerprint()}-seed{seed}"
    model = write_once(root / family.name, lambda p: save_model(p, seed=seed))
    adapter = write_once(root / f"{family.name}-ip-adapter", lambda p: save_adapter(p, seed=seed))
    return model, adapter, adapter / encoder_folder


def _shipped_flow_spec(tiny: registry.TinyModel) -> tuple[Path, Path, Path]:
    """(model, adapter, image encoder) folders of a shipped flow-matching model."""
    module = importlib.import_module(tiny.module)
    shipped = Path(module.SHIPPED_DIR)
    return shipped, shipped / module.ADAPTER_SUBFOLDER, shipped / module.IMAGE_ENCODER_SUBFOLDER


def resolve_flow_spec(spec: Any, cache: Path) -> Any | None:
    """The resolved spec of an SD3 / Flux ``--model`` (None for UNet pipelines).

    Fills the family's adapter, weight file and image encoder where not given, writes the tiny
    models for ``tiny-sd3`` / ``tiny-flux``, and checks local adapter folders.

    Args:
        spec: a :class:`~nw_adapter.correlate.spec.ModelSpec`.
        cache: the tiny-model cache folder.

    Raises:
        ModelLoadError: a local adapter folder without the weight file, or ``--ip-adapter tiny``.
    """
    name = family_of_model(spec.model)
    if name not in FAMILIES:
        return None
    family = FAMILIES[name]
    model, adapter, encoder = spec.model, spec.ip_adapter, spec.image_encoder
    tiny = registry.tiny_model(model)
    if tiny is not None and not tiny.shipped:
        model_dir, adapter_dir, encoder_dir = write_tiny_cache(
            tiny.name, cache, lambda: ensure_tiny_flow_models(family, cache)
        )
    elif tiny is not None:
        model_dir, adapter_dir, encoder_dir = _shipped_flow_spec(tiny)
    if tiny is not None:
        model = str(model_dir)
        if adapter is None:
            adapter, encoder = str(adapter_dir), encoder or str(encoder_dir)
    if adapter == "tiny":
        raise ModelLoadError(
            f"--ip-adapter tiny is the SD 1.5 tiny adapter; with --model {spec.model} ({family.label}) "
            f"omit --ip-adapter (default {family.ip_adapter}) or pass an adapter for that family"
        )
    adapter = adapter or family.ip_adapter
    weight_name = spec.weight_name or family.weight_name
    subfolder = spec.subfolder or ""
    local = Path(adapter).expanduser()
    weights = local / subfolder / weight_name
    if local.exists() and not weights.is_file():
        raise ModelLoadError(
            f"--ip-adapter '{adapter}': no IP-Adapter weights at '{weights}'; pass the folder that "
            f"holds {weight_name} (layout of {family.ip_adapter}), or set --subfolder/--weight-name"
        )
    return ModelSpec(
        model=model,
        ip_adapter=adapter,
        subfolder=subfolder,
        weight_name=weight_name,
        image_encoder=encoder or family.image_encoder,
    )


def load_ip_adapter(pipe: Any, spec: Any, dtype: Any, **hub: Any) -> None:
    """``pipe.load_ip_adapter`` with the arguments of the pipeline's family.

    The family's :attr:`~nw_adapter.integration.families.Family.encoder_argument` says where the
    image encoder comes from: SD 3 / 3.5 (``SD3IPAdapterMixin``) reads the SigLIP encoder from
    ``image_encoder_folder``; Flux (``FluxIPAdapterMixin``) the CLIP encoder from
    ``image_encoder_pretrained_model_name_or_path``, in the pipeline's dtype; UNet pipelines the
    encoder inside the adapter repository. ``hub``: Hub options passed on as they are
    (``local_files_only=True`` offline).

    Raises:
        ModelLoadError: a local ``.safetensors`` weight file that is empty, truncated or not a
            safetensors file (naming the file), before diffusers reads it, or any other safetensors
            file of the adapter or its encoder that cannot be read. The message is the reason only:
            :func:`~nw_adapter.correlate.loading.build_pipeline` puts the option in front.
    """
    from safetensors import SafetensorError

    check_weight_file(spec)
    family = registry.family_of_pipeline(pipe)
    if family.encoder_argument == "image_encoder_folder":
        arguments = {
            "subfolder": spec.subfolder or None,
            "image_encoder_folder": _as_path_like(spec.image_encoder),
        }
    elif family.encoder_argument == "image_encoder_pretrained_model_name_or_path":
        arguments = {
            "subfolder": spec.subfolder or "",
            "image_encoder_pretrained_model_name_or_path": spec.image_encoder,
            "image_encoder_dtype": dtype,
        }
    else:
        arguments = {"subfolder": spec.subfolder}
    try:
        pipe.load_ip_adapter(spec.ip_adapter, weight_name=spec.weight_name, **arguments, **hub)
    except SafetensorError as exc:  # a damaged file of the Hub cache or of the image encoder
        raise ModelLoadError(
            f"a safetensors file of the adapter or its image encoder is damaged ({_one_line(exc)}); "
            "download it again"
        ) from None


def check_weight_file(spec: Any) -> None:
    """Refuse a local IP-Adapter ``.safetensors`` file that safetensors cannot open (empty,
    truncated, another format), in one line naming the file and the fix.

    Only local files are read (the header, not the tensors); Hub files are diffusers' to fetch.

    Raises:
        ModelLoadError: the file cannot be opened as safetensors.
    """
    weight_name = str(spec.weight_name or "")
    if not weight_name.endswith(".safetensors") or not spec.ip_adapter:
        return
    path = Path(spec.ip_adapter).expanduser() / (spec.subfolder or "") / weight_name
    if not path.is_file():
        return
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as weights:
            weights.keys()
    except (SafetensorError, OSError, ValueError) as exc:
        size = path.stat().st_size
        what = "empty" if size == 0 else f"not a complete safetensors file ({size} bytes: {_one_line(exc)})"
        raise ModelLoadError(f"{path} is {what}; download or copy the adapter again") from None


def _one_line(exc: BaseException) -> str:
    """The exception's text on one line, at most 120 characters."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 120 else text[:117] + "..."


def _as_path_like(encoder: str | None) -> str | None:
    """diffusers' SD3 loader reads an ``image_encoder_folder`` without ``/`` as a subfolder of the
    adapter repository and one with ``/`` as a path or Hub id: keep folders and ids as they are."""
    if encoder is None:
        return None
    path = Path(encoder).expanduser()
    return str(path.resolve()) if path.exists() else encoder


def check_scheduler(pipe: Any, name: str | None) -> None:
    """Refuse ``--scheduler`` on flow-matching pipelines (their sigma schedule is part of the model).

    Raises:
        ModelLoadError: ``name`` given for an SD3 / Flux pipeline.
    """
    family = registry.family_of_pipeline(pipe)
    if name is not None and family.flow:
        raise ModelLoadError(
            f"--scheduler {name}: {family.label} is a flow-matching model and keeps its "
            f"{type(pipe.scheduler).__name__}; omit --scheduler"
        )


def call_kwargs(pipe: Any, true_cfg_scale: float) -> dict[str, Any]:
    """Extra keyword arguments of the pipeline call: Flux's ``true_cfg_scale``, and its
    ``max_sequence_length`` when the T5 tokenizer's ``model_max_length`` is below the pipeline's
    default 512 (a model trained on shorter prompts, such as ``tiny-flux-digits``).

    Raises:
        ModelLoadError: ``true_cfg_scale != 1`` for a pipeline that is not Flux.
    """
    if registry.family_of_pipeline(pipe).true_cfg:
        extra: dict[str, Any] = {"true_cfg_scale": true_cfg_scale}
        length = getattr(getattr(pipe, "tokenizer_2", None), "model_max_length", None)
        if isinstance(length, int) and 0 < length < 512:
            extra["max_sequence_length"] = length
        return extra
    if true_cfg_scale != 1.0:
        having = " and ".join(row.label for row in registry.families_where(lambda row: row.true_cfg))
        raise ModelLoadError(
            f"--true-cfg-scale {true_cfg_scale}: only {having} pipelines have true CFG; use --guidance-scale"
        )
    return {}


def planned_timesteps(pipe: Any, steps: int, height: int | None, width: int | None) -> list[float]:
    """The ``scheduler.timesteps`` the pipeline will denoise with, from a copy of its scheduler.

    Flux pipelines pass ``sigmas = linspace(1, 1/steps, steps)`` and, with dynamic shifting, the
    shift ``mu`` of the image's token count (diffusers' ``calculate_shift``); other pipelines call
    ``set_timesteps(steps)`` (SD3 with dynamic shifting also gets its ``mu``).
    """
    import numpy as np

    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    config = scheduler.config
    family = registry.family_of_pipeline(pipe)
    kwargs: dict[str, Any] = {}
    if family.flow and config.get("use_dynamic_shifting", False):
        kwargs["mu"] = _shift_mu(pipe, height, width)
    if family.sigmas and not config.get("use_flow_sigmas", False):
        kwargs["sigmas"] = np.linspace(1.0, 1 / steps, steps)
        scheduler.set_timesteps(sigmas=kwargs.pop("sigmas"), **kwargs)
    else:
        scheduler.set_timesteps(steps, **kwargs)
    return [float(t) for t in scheduler.timesteps.tolist()]


def _shift_mu(pipe: Any, height: int | None, width: int | None) -> float:
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    factor = pipe.vae_scale_factor * 2  # latent pixels per token side: VAE x 2 x 2 packing / patch
    default = pipe.default_sample_size * pipe.vae_scale_factor
    seq_len = ((height or default) // factor) * ((width or default) // factor)
    config = pipe.scheduler.config
    return calculate_shift(
        seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )


def shown_adapter(model: str, spec: Any) -> str:
    """The adapter named in ``rho.json`` when ``--ip-adapter`` was not given (paths of the tiny
    models' cache folders are replaced by ``"tiny"``)."""
    if registry.tiny_model(model) is not None:
        return TINY
    family = family_of_model(spec.model)
    return FAMILIES[family].ip_adapter if family in FAMILIES else DEFAULT_IP_ADAPTER


def shown_spec(model: str, ip_adapter: str | None, image_encoder: str | None, spec: ModelSpec) -> ModelSpec:
    """The model spec an output file records: the options as given, the resolved adapter files.

    Args:
        model: ``--model`` as given.
        ip_adapter: ``--ip-adapter`` as given (None: the family's default, see :func:`shown_adapter`).
        image_encoder: ``--image-encoder`` as given.
        spec: The resolved spec (:func:`nw_adapter.correlate.loading.resolve_spec`).

    Returns:
        A :class:`ModelSpec` without the embedded models' install or cache paths: the adapter and
        image encoder of every embedded model (:data:`~nw_adapter.integration.families.TINY_MODELS`,
        the shipped ``tiny-flux-digits`` too) are named ``tiny``, as the rho run records them.
    """
    encoder = None
    if spec.image_encoder is not None:
        embedded = registry.tiny_model(model) is not None
        encoder = image_encoder or (TINY if embedded else spec.image_encoder)
    return ModelSpec(
        model=model,
        ip_adapter=ip_adapter or shown_adapter(model, spec),
        subfolder=spec.subfolder,
        weight_name=spec.weight_name,
        image_encoder=encoder,
    )


def write_joint_records(records: Sequence[dict], folder: Path) -> Path | None:
    """SD 3.5: write the joint-key-set records (image + IP keys) as ``rho_joint.csv`` in ``folder``.

    ``rho.json`` reports the comparison over the IP keys (every family's); this file keeps SD 3.5's
    second comparison, over its one image-branch softmax's whole key set (with a calibrated run's
    ``_exact`` columns where the records carry them). ``records``: a pass's records of every key set.
    Written atomically; None (nothing written) for the other families.
    """
    from nw_adapter.analysis.records import Records

    joint = Records(r for r in records if r.get("key_set") == "joint")
    if not joint:
        return None
    return joint.to_csv(folder / "rho_joint.csv")


def layer_blocks(layer_names: list[str]) -> list[str]:
    """The block names ``--layers`` accepts for a denoiser with these IP-Adapter layer names.

    UNets: the short names ``down``, ``mid``, ``up`` of the blocks that hold IP-Adapter layers;
    transformers (SD3, Flux): the first component of the processor names (``transformer_blocks``).
    """
    short = [name for name, prefix in UNET_BLOCKS.items() if any(n.startswith(prefix) for n in layer_names)]
    if short:
        return short
    return list(dict.fromkeys(n.split(".", 1)[0] for n in layer_names))
