"""Cost of the NW processor: one SD 1.5 cross-attention layer and one whole SD 1.5 UNet step.

Variants, timed side by side in one process (see :mod:`benchmarks.timing`):

- ``stock``: diffusers' ``IPAdapterAttnProcessor2_0``;
- ``observe``: the NW processor in observe mode with the default options (matched bandwidth,
  both nulls) -- what ``apply_nw_processor(pipe)`` gives a user;
- ``observe_no_nulls``: observe mode with ``nulls=False`` (shows what the nulls cost);
- ``observe_no_readings``: observe mode with ``readings=False`` (shows what the readings cost:
  ``r2_key`` ... ``h_eff`` and its 12-step bandwidth fit);
- ``observe_compiled``: observe with ``compile=True`` (the side computation as one
  ``torch.compile``d function per layer shape); skipped, with a note, where
  :class:`~nw_adapter.integration.config.NWProcessorConfig` has no ``compile`` option;
- ``swap``: the NW processor in swap mode (statistics off, the default for swap);
- ``observe_control``: observe with ``untrained_control=True`` (the command line's default: the
  untrained-adapter control's statistics too); UNet step only, where ``apply_nw_processor``
  installs it (a single layer built with ``nw_processor_for`` has no control attached).

Every bench takes a ``device`` and a ``dtype``; on a CUDA device the times are CUDA-event times
(:class:`benchmarks.timing.CudaEventTimer`) and the cProfile attribution of the UNet step is
skipped (host CPU time says nothing about device work).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.mixin import apply_nw_processor, remove_nw_processor
from nw_adapter.integration.processors import nw_processor_for
from nw_adapter.integration.recorder import NWRecorder

from .models import (
    SD15_UNET_CONFIG,
    SDXL_IMAGE_EMBED_DIM,
    SDXL_UNET_CONFIG,
    attention_inputs,
    attention_layer,
    build_unet,
    unet_inputs,
)
from .timing import add_ratios, attributed_seconds, time_interleaved, timer_for

#: Functions of the NW processor that hold its extra work: observe statistics, swap head.
ATTRIBUTED: tuple[str, ...] = ("_record", "_swap_branch", "settle")

#: NW processor options of each non-stock variant.
VARIANTS: dict[str, dict[str, Any]] = {
    "observe": {"mode": "observe", "cfg": True},
    "observe_no_nulls": {"mode": "observe", "cfg": True, "nulls": False},
    "observe_no_readings": {"mode": "observe", "cfg": True, "readings": False},
    "observe_compiled": {"mode": "observe", "cfg": True, "compile": True},
    "swap": {"mode": "swap"},
    "observe_control": {"mode": "observe", "cfg": True, "untrained_control": True},
}

#: The variants of the CPU runs (compiling on a 2-core CPU is not what a user runs there).
DEFAULT_VARIANTS: tuple[str, ...] = ("observe", "observe_no_nulls", "observe_no_readings", "swap")

#: Model families of the UNet step: (UNet config, width of the base adapter's image embedding).
UNET_MODELS: dict[str, tuple[dict[str, Any], int]] = {
    "sd15": (SD15_UNET_CONFIG, 1024),
    "sdxl": (SDXL_UNET_CONFIG, SDXL_IMAGE_EMBED_DIM),
}


def missing_option(variant: str) -> str | None:
    """Why ``variant`` cannot run with this checkout's config, or None when it can.

    A variant whose options are not all fields of :class:`NWProcessorConfig` (e.g. ``compile``
    before the compiled side computation lands) is skipped with this note instead of failing.
    """
    fields = {f.name for f in dataclasses.fields(NWProcessorConfig)}
    missing = [key for key in VARIANTS[variant] if key not in fields]
    if not missing:
        return None
    return f"skipped: NWProcessorConfig has no {', '.join(missing)} option in this checkout"


def _runnable(variants: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """(variants that can run, {skipped variant: note})."""
    skipped = {name: note for name in variants if (note := missing_option(name)) is not None}
    return [name for name in variants if name not in skipped], skipped


#: (hidden size, query tokens) of SD 1.5's attn2 layers at 512 x 512 (64 x 64 latents).
SD15_LAYER_SHAPES: tuple[tuple[int, int], ...] = ((320, 4096), (640, 1024), (1280, 256), (1280, 64))


def bench_attention_layer(
    hidden: int,
    queries: int,
    *,
    image_tokens: int,
    repeats: int,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    heads: int = 8,
    cross: int = 768,
    text_tokens: int = 77,
    batch: int = 2,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    warmup: int = 1,
) -> dict[str, Any]:
    """Time one attn2 call (CFG batch) with the stock processor and each NW variant.

    Args:
        hidden: query width (320 / 640 / 1280).
        queries: query tokens (latent pixels at that level).
        image_tokens: IP-Adapter tokens (4 base, 16 plus).
        repeats: timed repeats per variant.
        variants: names from :data:`VARIANTS`.
        heads: attention heads.
        cross: text / image token width.
        text_tokens: text sequence length.
        batch: batch (2 = CFG).
        device: device of the layer and inputs.
        dtype: dtype of the layer and inputs.
        warmup: untimed calls per variant before timing.

    Returns:
        ``{"shape": {...}, "results": {variant: timing stats with "ratio"}, "skipped": {variant:
        note}}``.
    """
    attn, stock = attention_layer(
        hidden, cross=cross, heads=heads, image_tokens=image_tokens, device=device, dtype=dtype
    )
    inputs = attention_inputs(
        hidden,
        queries,
        cross=cross,
        batch=batch,
        text_tokens=text_tokens,
        image_tokens=image_tokens,
        device=device,
        dtype=dtype,
    )
    processors: dict[str, torch.nn.Module] = {"stock": stock}
    recorders: dict[str, NWRecorder] = {}
    runnable, skipped = _runnable(variants)
    for name in runnable:
        config = NWProcessorConfig(**VARIANTS[name])
        recorder = NWRecorder(config)
        recorder.begin_step(cfg=bool(config.cfg))
        recorders[name] = recorder
        processors[name] = nw_processor_for(
            stock, layer_name="attn2.processor", config=config, recorder=recorder
        )

    def install(name: str) -> Callable[[], None]:
        def setup() -> None:
            attn.set_processor(processors[name])
            if name in recorders:
                recorders[name].clear()

        return setup

    def call() -> None:
        with torch.no_grad():
            attn(inputs["hidden_states"], encoder_hidden_states=inputs["encoder_hidden_states"])

    names = list(processors)
    results = time_interleaved(
        {name: call for name in names},
        repeats=repeats,
        warmup=warmup,
        setup={name: install(name) for name in names},
        timer=timer_for(device),
    )
    shape = {
        "hidden": hidden,
        "heads": heads,
        "queries": queries,
        "text_tokens": text_tokens,
        "image_tokens": image_tokens,
        "batch": batch,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
    }
    return {"shape": shape, "results": add_ratios(results, "stock"), "skipped": skipped}


def bench_unet_step(
    *,
    latent_size: int,
    repeats: int,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    config: dict[str, Any] | None = None,
    variant: str = "base",
    unet: torch.nn.Module | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    warmup: int = 1,
) -> dict[str, Any]:
    """Time one UNet forward (CFG batch 2) with stock processors and each NW variant.

    The NW processors are installed with :func:`nw_adapter.integration.mixin.apply_nw_processor` on the UNet
    (which also registers the recorder's step pre-hook: its cost is part of the measurement) and
    removed with :func:`~nw_adapter.integration.mixin.remove_nw_processor` before each stock run.

    Args:
        latent_size: latent height and width (image size / 8).
        repeats: timed repeats per variant.
        variants: names from :data:`VARIANTS` (those the config cannot run are skipped).
        config: UNet config (default SD 1.5), used when ``unet`` is None.
        variant: IP-Adapter variant (``"base"`` or ``"plus"``).
        unet: a prebuilt UNet from :func:`benchmarks.models.build_unet` (built when None).
        device: device of the UNet and inputs (a prebuilt ``unet`` must already be there).
        dtype: dtype of the UNet and inputs.
        warmup: untimed steps per variant before timing.

    Returns:
        ``{"latent_size", "results": {variant: timing stats with "ratio"}, "skipped": {variant:
        note}}``; on the CPU every NW variant also has ``side_computation_s``, the CPU seconds
        spent inside the processor's ``_record`` (observe statistics) and ``_swap_branch`` (swap:
        the gross cost of the NW head, which replaces the stock image branch) during one extra
        step under cProfile, and ``side_over_stock`` = that / the stock step's median CPU time.
    """
    config = SD15_UNET_CONFIG if config is None else config
    if unet is None:
        unet = build_unet(config, variant=variant, device=device, dtype=dtype)
    width = _proj_in_features(unet)  # the adapter's input width (base: embedding; plus: hidden states)
    kwargs = unet_inputs(
        unet,
        latent_size=latent_size,
        variant=variant,
        image_embed_dim=width,
        image_hidden_dim=width,
        device=device,
        dtype=dtype,
    )
    runnable, skipped = _runnable(variants)

    installed: dict[str, Any] = {"recorder": None}

    def install(name: str) -> Callable[[], None]:
        def setup() -> None:
            remove_nw_processor(unet)
            installed["recorder"] = None
            if name != "stock":
                installed["recorder"] = apply_nw_processor(unet, NWProcessorConfig(**VARIANTS[name]))

        return setup

    def step() -> None:
        with torch.no_grad():
            unet(**kwargs)
            recorder = installed["recorder"]
            if recorder is not None:  # the step's deferred statistics, in the step (not amortised
                recorder.settle()  # over a call: benchmarks/host_cost.py measures whole calls)

    names = ["stock", *runnable]
    try:
        results = time_interleaved(
            {name: step for name in names},
            repeats=repeats,
            warmup=warmup,
            setup={name: install(name) for name in names},
            timer=timer_for(device),
        )
        if torch.device(device).type == "cpu":
            # Load-independent view: CPU time inside the NW side computation during one step.
            stock_cpu = results["stock"]["cpu"]["median"]
            for name in runnable:
                install(name)()
                seconds = attributed_seconds(step, ATTRIBUTED)
                side = sum(v for k, v in seconds.items() if k != "total")
                results[name]["side_computation_s"] = side
                results[name]["side_over_stock"] = side / stock_cpu if stock_cpu > 0 else float("nan")
    finally:
        remove_nw_processor(unet)
    return {
        "latent_size": latent_size,
        "batch": 2,
        "adapter": variant,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "results": add_ratios(results, "stock"),
        "skipped": skipped,
    }


def _proj_in_features(unet: torch.nn.Module) -> int:
    """Input width of the first image projection of a UNet with a loaded IP-Adapter."""
    proj = unet.encoder_hid_proj.image_projection_layers[0]
    for module in proj.modules():
        if isinstance(module, torch.nn.Linear):
            return module.in_features
    raise ValueError("the UNet's image projection has no Linear layer")
