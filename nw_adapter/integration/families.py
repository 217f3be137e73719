"""The model families, one row each: which family a pipeline, denoiser or processor is, decided here.

Every part of the package that needs to know "is this SD 1.5 / SDXL, SD 3 or Flux?" reads this
table: the processors' installer (:mod:`~nw_adapter.integration.processors`: which NW processor
replaces a stock one), the step hook's timestep units (:mod:`~nw_adapter.integration.mixin`), the
untrained control (:mod:`~nw_adapter.integration.untrained`, :mod:`~nw_adapter.integration.end_to_end`),
the command line (:mod:`nw_adapter.correlate.families`: defaults, loading, the pipeline call, the
embedded tiny models) and the reports (which models have random weights, which are judged).

The module is data plus lookups over it. It imports no processor, no torch and no diffusers
(the command line reads it before torch is imported); classes are matched by name along the
method resolution order, so a subclass of a family's denoiser or processor is of that family, and
a row names its NW processor classes by module and class name (resolved by the installer).

Adding a model family is one row of :data:`FAMILIES` plus its processor module beside
``integration/processors/unet.py`` (``docs/architecture.md``, "A new model family"); an embedded
tiny model of it is one row of :data:`TINY_MODELS` plus its builder in :mod:`nw_adapter.models`.

Example:
    >>> family_of_pipeline_class("StableDiffusion3Pipeline").name
    'sd3'
    >>> tiny_model("tiny-flux-digits").family, tiny_model("tiny-flux-digits").trained
    ('flux', True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

UNET = "unet"
SD3 = "sd3"
FLUX = "flux"

BATCH = "batch"
"""CFG layout: one denoiser pass per step whose batch is ``[uncond; cond]`` (its two halves)."""
PASSES = "passes"
"""CFG layout: one denoiser pass per CFG half (Flux's true CFG: the positive pass, then the negative)."""

PER_ADAPTER = "per_adapter"
"""Adapter layout: the denoiser's ``encoder_hid_proj`` (``MultiIPAdapterImageProjection``) projects
the image embeddings; each layer's ``to_k_ip`` / ``to_v_ip`` is a ``ModuleList``, one per adapter."""
TIMESTEP_RESAMPLER = "timestep_resampler"
"""Adapter layout of SD 3.5's InstantX adapter: ``image_proj(embeds, timestep)``, a resampler
conditioned on the timestep; each layer one ``to_k_ip`` Linear, ``norm_ip`` (AdaLayerNorm driven by
the timestep embedding) and the key RMSNorm ``norm_ip_k``."""


@dataclass(frozen=True)
class Family:
    """One model family: what recognises it and what differs in how it is called and recorded.

    Attributes:
        name: Short name, written in records and files (``"unet"``, ``"sd3"``, ``"flux"``).
        label: For messages.
        pipelines: Prefixes of the pipeline class names of the family (``model_index.json``'s
            ``_class_name``); the fallback family (:data:`FALLBACK`) has none.
        denoisers: Class names one of which is in the method resolution order of every denoiser
            (``pipe.unet`` / ``pipe.transformer``) of the family: diffusers' IP-Adapter loader mixin
            of the family (``UNet2DConditionLoadersMixin`` covers SD 1.5 / XL's
            ``UNet2DConditionModel``, AnimateDiff's ``UNetMotionModel`` ...).
        processors: diffusers' IP-Adapter processor class name -> the NW processor class that
            replaces it, in ``processor_module``.
        processor_module: The module of the family's NW processors.
        adapter_layout: :data:`PER_ADAPTER` or :data:`TIMESTEP_RESAMPLER` (how the untrained control
            rebuilds the image keys).
        cfg: :data:`BATCH` or :data:`PASSES` (which rows of a pass are which CFG half).
        timestep_scale: Factor from the timestep the denoiser receives to ``scheduler.timesteps``
            units (Flux pipelines pass ``timestep / 1000``).
        flow: A flow-matching family: its pipelines keep their own scheduler (``--scheduler`` is
            refused) and may shift the schedule by the image size.
        sigmas: The pipeline passes ``sigmas = linspace(1, 1 / steps, steps)`` to the scheduler.
        true_cfg: The pipeline call takes ``true_cfg_scale``.
        guidance_rescale: The pipeline call takes ``guidance_rescale`` (diffusers' rescaled CFG).
        encoder_argument: How ``pipe.load_ip_adapter`` takes the image encoder: None (inside the
            adapter repository), ``"image_encoder_folder"`` (SD 3) or
            ``"image_encoder_pretrained_model_name_or_path"`` (Flux, with ``image_encoder_dtype``).
        ip_adapter: Default IP-Adapter (Hub id); None: the command line's SD 1.5 / SDXL defaults.
        weight_name: Its weight file.
        image_encoder: Its image encoder (Hub id), when separate from the adapter.
        example_pipeline: A Hub id of a pipeline of the family (for ``--help``).
        hub_names: Lower-case fragments of the Hub ids of the family's pipelines. Read only where the
            pipeline's class cannot be (offline, its ``model_index.json`` not cached): which embedded
            model to suggest instead (:func:`family_of_hub_id`).
        end_to_end: Why the end-to-end control cannot run on the family (None: it can); a reason
            that follows "cannot run on <label>: ".
        support_sets: Why support sets cannot run on the family (None: they can); the same.
    """

    name: str
    label: str
    pipelines: tuple[str, ...]
    denoisers: tuple[str, ...]
    processors: dict[str, str]
    processor_module: str
    adapter_layout: str = PER_ADAPTER
    cfg: str = BATCH
    timestep_scale: float = 1.0
    flow: bool = False
    sigmas: bool = False
    true_cfg: bool = False
    guidance_rescale: bool = False
    encoder_argument: str | None = None
    ip_adapter: str | None = None
    weight_name: str | None = None
    image_encoder: str | None = None
    example_pipeline: str | None = None
    hub_names: tuple[str, ...] = ()
    end_to_end: str | None = None
    support_sets: str | None = None


@dataclass(frozen=True)
class TinyModel:
    """An embedded model the command line names (``--model NAME``), loaded offline.

    Attributes:
        name: The ``--model`` name.
        family: Its family's :attr:`Family.name`.
        trained: Trained on digits (32 x 32; the digit judge labels its generations); False: random
            weights, a stand-in that exercises the code and says nothing about any model.
        module: The module of :mod:`nw_adapter.models` that provides it. A shipped model (its
            weights in the package) names ``SHIPPED_DIR``, ``ADAPTER_SUBFOLDER`` and (flow
            families) ``IMAGE_ENCODER_SUBFOLDER`` there.
        builders: A model written once into the tiny-model cache from seeded builders: the names in
            ``module`` of the pipeline builder, the adapter builder and the image encoder's folder
            inside the adapter's; empty for a shipped model.
        layout: Its pipeline's layout where more precise than the family's label (``"SD 1.5"``).
    """

    name: str
    family: str
    trained: bool
    module: str
    builders: tuple[str, str, str] | tuple[()] = ()
    layout: str | None = None

    @property
    def shipped(self) -> bool:
        """Whether its weights are shipped in the package (else built into the cache)."""
        return not self.builders

    @property
    def label(self) -> str:
        """What it is, for messages (``"Flux, trained on digits"``)."""
        what = "trained on digits" if self.trained else "random weights"
        return f"{self.layout or family_named(self.family).label}, {what}"


FAMILIES: tuple[Family, ...] = (
    Family(
        name=UNET,
        label="Stable Diffusion 1.5 / XL",
        pipelines=(),
        denoisers=("UNet2DConditionLoadersMixin",),
        processors={
            "IPAdapterAttnProcessor2_0": "NWIPAdapterAttnProcessor2_0",
            "IPAdapterAttnProcessor": "NWIPAdapterAttnProcessor",
        },
        processor_module="nw_adapter.integration.processors.unet",
        guidance_rescale=True,
    ),
    Family(
        name=SD3,
        label="Stable Diffusion 3 / 3.5",
        pipelines=("StableDiffusion3",),
        denoisers=("SD3Transformer2DLoadersMixin",),
        processors={"SD3IPAdapterJointAttnProcessor2_0": "NWSD3IPAdapterJointAttnProcessor2_0"},
        processor_module="nw_adapter.integration.processors.sd3",
        adapter_layout=TIMESTEP_RESAMPLER,
        flow=True,
        encoder_argument="image_encoder_folder",
        ip_adapter="InstantX/SD3.5-Large-IP-Adapter",
        weight_name="ip-adapter.bin",
        image_encoder="google/siglip-so400m-patch14-384",
        example_pipeline="stabilityai/stable-diffusion-3.5-large",
        hub_names=("stable-diffusion-3", "sd3"),
        end_to_end=(
            "its image keys pass a per-head RMSNorm and change with the timestep, so no weight scale "
            "matches them"
        ),
        support_sets=(
            "a support set is one adapter's list of images, which its pipeline does not take (diffusers' "
            "SD 3.5 pipeline fails on a list per adapter)"
        ),
    ),
    Family(
        name=FLUX,
        label="Flux",
        pipelines=("Flux",),
        denoisers=("FluxTransformer2DLoadersMixin",),
        processors={"FluxIPAdapterAttnProcessor": "NWFluxIPAdapterAttnProcessor"},
        processor_module="nw_adapter.integration.processors.flux",
        cfg=PASSES,
        timestep_scale=1000.0,
        flow=True,
        sigmas=True,
        true_cfg=True,
        encoder_argument="image_encoder_pretrained_model_name_or_path",
        ip_adapter="XLabs-AI/flux-ip-adapter",
        weight_name="ip_adapter.safetensors",
        image_encoder="openai/clip-vit-large-patch14",
        example_pipeline="black-forest-labs/FLUX.1-dev",
        hub_names=("flux",),
    ),
)
"""Every model family, one row each (order: how they are listed in messages)."""

FALLBACK = UNET
"""The family of a pipeline class that no row's :attr:`Family.pipelines` names (diffusers' UNet
pipelines are many: StableDiffusion, StableDiffusionXL, their img2img / inpaint variants ...)."""

_TINY_FLOW = "nw_adapter.models.tiny_flow"

TINY_MODELS: tuple[TinyModel, ...] = (
    TinyModel("tiny", UNET, trained=True, module="nw_adapter.models.tiny_digits", layout="SD 1.5"),
    TinyModel(
        "tiny-sd3", SD3, trained=False, module=_TINY_FLOW,
        builders=("save_tiny_sd3", "save_tiny_sd3_ip_adapter", "SIGLIP_FOLDER"),
    ),
    TinyModel(
        "tiny-flux", FLUX, trained=False, module=_TINY_FLOW,
        builders=("save_tiny_flux", "save_tiny_flux_ip_adapter", "CLIP_FOLDER"),
    ),
    TinyModel("tiny-flux-digits", FLUX, trained=True, module="nw_adapter.models.tiny_flux_digits"),
)  # fmt: skip
"""The embedded models of ``--model``, in the order messages list them."""

_BY_NAME: dict[str, Family] = {family.name: family for family in FAMILIES}
_BY_DENOISER: dict[str, Family] = {name: family for family in FAMILIES for name in family.denoisers}
_BY_PROCESSOR: dict[str, Family] = {name: family for family in FAMILIES for name in family.processors}
_TINY: dict[str, TinyModel] = {model.name: model for model in TINY_MODELS}


def family_named(name: str) -> Family:
    """The row of family ``name``.

    Raises:
        KeyError: an unknown name (the message lists the known ones).
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(_BY_NAME)}") from None


def _class_names(obj: Any) -> Iterable[str]:
    """The class names along ``obj``'s method resolution order, most specific first."""
    return (cls.__name__ for cls in type(obj).__mro__)


def family_of_pipeline_class(class_name: str | None) -> Family:
    """The family of a pipeline class name (``model_index.json``'s ``_class_name``); the
    :data:`FALLBACK` family when no row's prefixes match (or the name is unknown)."""
    name = class_name or ""
    for family in FAMILIES:
        if any(name.startswith(prefix) for prefix in family.pipelines):
            return family
    return _BY_NAME[FALLBACK]


def family_of_hub_id(repo_id: str) -> Family | None:
    """The family whose :attr:`Family.hub_names` a Hub id contains (case-insensitive), or None.

    A guess from the name, for where nothing else can be read (offline, the pipeline's
    ``model_index.json`` not cached); :func:`family_of_pipeline_class` decides wherever the class is known.
    """
    lowered = repo_id.lower()
    for family in FAMILIES:
        if any(fragment in lowered for fragment in family.hub_names):
            return family
    return None


def families_where(test: Callable[[Family], Any]) -> tuple[Family, ...]:
    """The rows for which ``test(row)`` is true, in table order (``families_where(lambda f: f.flow)``)."""
    return tuple(family for family in FAMILIES if test(family))


def family_of_denoiser(denoiser: Any) -> Family | None:
    """The family of a denoiser module (its class or a base class named in a row), or None."""
    for name in _class_names(denoiser):
        if name in _BY_DENOISER:
            return _BY_DENOISER[name]
    return None


def denoiser_of(pipe: Any) -> Any:
    """``pipe.unet``, else ``pipe.transformer``, else None (``pipe`` may be a denoiser itself)."""
    for name in ("unet", "transformer"):
        module = getattr(pipe, name, None)
        if module is not None:
            return module
    return None


def family_of_pipeline(pipe: Any) -> Family:
    """The family of a loaded pipeline (or a bare denoiser): its denoiser's class first, else the
    pipeline's class name (:func:`family_of_pipeline_class`)."""
    denoiser = denoiser_of(pipe)
    found = family_of_denoiser(pipe if denoiser is None else denoiser)
    return found if found is not None else family_of_pipeline_class(type(pipe).__name__)


def family_of_processor(processor: Any) -> Family | None:
    """The family of an IP-Adapter attention processor of diffusers (stock, or an NW processor,
    which subclasses the stock one); None for any other processor."""
    for name in _class_names(processor):
        if name in _BY_PROCESSOR:
            return _BY_PROCESSOR[name]
    return None


def nw_processor_class_name(processor: Any) -> tuple[str, str] | None:
    """``(module, class name)`` of the NW processor that replaces the stock ``processor``, or None
    when it is no IP-Adapter processor of a family."""
    for name in _class_names(processor):
        family = _BY_PROCESSOR.get(name)
        if family is not None:
            return family.processor_module, family.processors[name]
    return None


def tiny_model(name: str) -> TinyModel | None:
    """The embedded model ``--model name`` names, or None."""
    return _TINY.get(name)


def tiny_models(*, family: str | None = None, trained: bool | None = None) -> tuple[str, ...]:
    """Names of the embedded models, optionally of one family and trained (or random) only."""
    return tuple(
        model.name
        for model in TINY_MODELS
        if (family is None or model.family == family) and (trained is None or model.trained == trained)
    )
