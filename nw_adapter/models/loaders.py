"""Load the embedded models from Python, offline, under documented names.

Three pipelines with an IP-Adapter already loaded, through the same diffusers calls as the real
models (``from_pretrained`` on a local folder, ``load_ip_adapter`` with the public file layout):

- :func:`load_tiny_digits`: the *trained* tiny Stable Diffusion 1.5 + IP-Adapter shipped in the
  package (32 x 32 handwritten digits; its model card says what it does and how well). Its
  readings mean something: it was trained.
- :func:`load_tiny_flux_digits`: the *trained* tiny Flux + XLabs-layout IP-Adapter shipped in the
  package (rectified flow, 32 x 32 digits, adapter trained on support sets of 1-4 references);
  call it with :data:`TINY_FLUX_DIGITS_CALL` (size and T5 length it was trained at).
- :func:`load_tiny_sd3` and :func:`load_tiny_flux`: tiny SD 3.5 / Flux pipelines and adapters
  with RANDOM weights, written once to a cache folder. They exercise the code paths; their
  statistics mean nothing about any real model.

:func:`tiny_digit_image` gives a bundled held-out reference digit to condition on.

Example:
    >>> from nw_adapter.models.loaders import load_tiny_digits, tiny_digit_image
    >>> pipe = load_tiny_digits()
    >>> image = pipe("a photograph", ip_adapter_image=tiny_digit_image(3), num_inference_steps=10).images[0]
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from nw_adapter.library_output import library_output
from nw_adapter.models import tiny_digits, tiny_flow, tiny_flux_digits

TINY_DIGITS_WEIGHT_NAME = "ip-adapter_sd15.safetensors"
"""The adapter file of the shipped model (layout of ``h94/IP-Adapter``: ``models/<file>``)."""


def quiet_loading(verbose: bool = False) -> contextlib.AbstractContextManager[None]:
    """Within the block, loading prints what the command line prints: nothing but errors.

    diffusers' and transformers' loggers at error level (the torchvision fallback note of the
    image processors, diffusers' float32 cast note), their progress bars ("Loading pipeline
    components", "Loading weights") off and the libraries' deprecation warnings hidden; the previous
    levels and bar settings are restored afterwards. ``verbose=True`` changes nothing (the loaders'
    ``verbose=`` argument: the libraries' own output, as ``-v`` gives on the command line). The
    command line's mechanism: :func:`nw_adapter.library_output.library_output`.
    """
    return library_output(verbose=verbose, bars=verbose)


def cache_dir() -> Path:
    """Folder the random-weight tiny models are written to: ``$NW_ADAPTER_CACHE``, else
    ``$XDG_CACHE_HOME/nw_adapter``, else ``~/.cache/nw_adapter`` (the CLI uses the same)."""
    if os.environ.get("NW_ADAPTER_CACHE"):
        return Path(os.environ["NW_ADAPTER_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nw_adapter"


def flow_cache_folder(seed: int = 0) -> Path:
    """The cache folder of the tiny SD 3.5 / Flux models of ``seed`` (shared with the CLI's
    ``--model tiny-sd3`` / ``tiny-flux``; named by the builders' fingerprint, so a change of the
    builders writes a new folder instead of reusing an old one)."""
    return cache_dir() / f"tiny-flow-{tiny_flow.flow_builder_fingerprint()}-seed{seed}"


def load_tiny_digits(*, pipeline_class: Any = None, device: str = "cpu", verbose: bool = False) -> Any:
    """The trained tiny digits model, with its IP-Adapter loaded (no network, no cache written).

    Args:
        pipeline_class: a Stable Diffusion pipeline class (default ``StableDiffusionPipeline``;
            for example :class:`~nw_adapter.pipelines.StableDiffusionNWPipeline`).
        device: where to put it.
        verbose: show the libraries' own notes and progress bars while loading (default: quiet,
            as the command line, :func:`quiet_loading`).

    Returns:
        The pipeline, float32, progress bar disabled; 32 x 32 images by default.
    """
    folder = tiny_digits.SHIPPED_DIR
    with quiet_loading(verbose):
        if pipeline_class is None:
            from diffusers import StableDiffusionPipeline

            pipeline_class = StableDiffusionPipeline
        pipe = pipeline_class.from_pretrained(folder)
        pipe.load_ip_adapter(folder, subfolder="models", weight_name=TINY_DIGITS_WEIGHT_NAME)
        pipe.set_progress_bar_config(disable=True)
        return pipe if device == "cpu" else pipe.to(device)


TINY_FLUX_DIGITS_CALL: dict[str, int] = {
    "height": 32,
    "width": 32,
    "max_sequence_length": tiny_flux_digits.TEXT_TOKENS,
}
"""Keyword arguments every call of the tiny Flux digits pipeline needs: ``FluxPipeline`` defaults
to 512 x 512 pixels and 512 T5 tokens; the model was trained at 32 x 32 and 32 tokens (as
FLUX.1-schnell is called with ``max_sequence_length=256``)."""


def load_tiny_flux_digits(*, pipeline_class: Any = None, device: str = "cpu", verbose: bool = False) -> Any:
    """The trained tiny Flux digits model, with its IP-Adapter loaded (no network, no cache written).

    ``from_pretrained`` on the shipped folder, then ``load_ip_adapter`` with the XLabs file layout
    and the CLIP image encoder beside it. A support set is one adapter's list of images::

        pipe = load_tiny_flux_digits()
        image = pipe("a photograph", ip_adapter_image=[[tiny_digit_image(3), tiny_digit_image(3)]],
                     **TINY_FLUX_DIGITS_CALL).images[0]

    Args:
        pipeline_class: a Flux pipeline class (default ``FluxPipeline``; for example
            :class:`~nw_adapter.pipelines.FluxNWPipeline`).
        device: where to put it.
        verbose: show the libraries' own notes and progress bars while loading (default: quiet).

    Returns:
        The pipeline, float32, progress bar disabled.
    """
    with quiet_loading(verbose):
        pipe = tiny_flux_digits.load_pipeline(pipeline_class=pipeline_class)
        return pipe if device == "cpu" else pipe.to(device)


def load_tiny_sd3(
    *,
    seed: int = 0,
    folder: str | os.PathLike | None = None,
    pipeline_class: Any = None,
    verbose: bool = False,
) -> Any:
    """A random-weight tiny SD 3.5 pipeline with its IP-Adapter (InstantX layout) loaded.

    Args:
        seed: seed of the random weights.
        folder: where to write the models once (default :func:`flow_cache_folder`).
        pipeline_class: default ``StableDiffusion3Pipeline``.
        verbose: show the libraries' own notes and progress bars while loading (default: quiet).
    """
    target = flow_cache_folder(seed) if folder is None else Path(folder)
    with quiet_loading(verbose):
        return tiny_flow.tiny_sd3_pipeline(target, seed=seed, pipeline_class=pipeline_class)


def load_tiny_flux(
    *,
    seed: int = 0,
    folder: str | os.PathLike | None = None,
    adapters: int = 1,
    pipeline_class: Any = None,
    verbose: bool = False,
) -> Any:
    """A random-weight tiny Flux pipeline with ``adapters`` IP-Adapters (XLabs layout) loaded.

    Args:
        seed: seed of the random weights.
        folder: where to write the models once (default :func:`flow_cache_folder`).
        adapters: how many adapters to load (several adapters, one image each).
        pipeline_class: default ``FluxPipeline``.
        verbose: show the libraries' own notes and progress bars while loading (default: quiet).
    """
    target = flow_cache_folder(seed) if folder is None else Path(folder)
    with quiet_loading(verbose):
        return tiny_flow.tiny_flux_pipeline(
            target, seed=seed, adapters=adapters, pipeline_class=pipeline_class
        )


def tiny_digit_image(digit: int) -> Any:
    """The bundled held-out reference image of ``digit`` (0-9) as an RGB ``PIL.Image``."""
    from PIL import Image

    with Image.open(tiny_digits.example_image_path(digit)) as image:
        return image.convert("RGB")
