"""A support set in the space where the sampler's state x_t lives (THEORY.md 4b), per pipeline family.

The theory's posterior over m references and its plug-in NW field live in the space of ``x_t``, the
denoiser's input. This module puts reference images there with the pipeline's own VAE and
conventions, and says what the denoiser's output means:

- :func:`latent_space`: the path of a pipeline's family (its row of the family registry: VP for the
  UNets, SD 1.5 / SDXL; rectified flow in the sigma convention for the flow-matching rows, SD 3, and
  Flux with its 2 x 2 packing), the kind of its denoiser's output
  (``scheduler.config.prediction_type`` for VP: ``"epsilon"``, ``"v_prediction"`` or ``"sample"``;
  ``"flow"`` for the transformers) and the timestep unit of the denoiser's call;
- :func:`encode_references`: ``vae.encode(image).latent_dist.mean`` at the generation's size, then
  the decode's inverse: ``* scaling_factor`` (SD 1.5), ``(z - latents_mean) * scaling_factor /
  latents_std`` where the VAE has them (SDXL-style configs), ``(z - shift_factor) *
  scaling_factor`` (SD 3, Flux), and Flux's ``_pack_latents`` (a permutation: distances are kept,
  but x_t and the references must share it);
- :func:`default_size`: the pipeline's default image size (where a call gives none);
- :func:`clipping_refusal`: a scheduler that clips or thresholds its x0 estimate (DDIM / DDPM
  ``clip_sample``, ``thresholding``) moves the plug-in field's x0 off the references: refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nw_adapter.integration.families import family_of_pipeline

__all__ = [
    "LatentSpace",
    "clipping_refusal",
    "default_size",
    "encode_references",
    "flatten_states",
    "latent_space",
    "reference_image",
]


@dataclass(frozen=True)
class LatentSpace:
    """How a pipeline's denoiser sees x_t.

    Attributes:
        family: ``"vp"`` (UNet, x_t = sqrt(abar) x0 + sqrt(1 - abar) eps) or ``"flow"``
            (transformer, x_s = (1 - s) x0 + s eps).
        packed: Flux's 2 x 2 packing of the latents into tokens ``[B, (h/2)(w/2), 4 C]``.
        kind: the denoiser output (:data:`~nw_adapter.core.latent_support.OUTPUT_KINDS`).
        denoiser: the pipeline attribute holding the denoiser (``"unet"`` / ``"transformer"``).
        timestep_scale: factor from the denoiser's timestep to ``scheduler.timesteps`` units (1000
            for Flux, whose pipeline passes ``timestep / 1000``).
    """

    family: str
    packed: bool
    kind: str
    denoiser: str
    timestep_scale: float


def latent_space(pipe: Any) -> LatentSpace:
    """The :class:`LatentSpace` of a diffusers pipeline (SD 1.5 / SDXL, SD 3, Flux layouts).

    Raises:
        ValueError: a pipeline with neither a UNet nor a transformer, or a VP scheduler whose
            prediction type has no x0 (one line naming it).
    """
    attribute = next(
        (name for name in ("unet", "transformer") if getattr(pipe, name, None) is not None), None
    )
    if attribute is None:
        raise ValueError(
            f"{type(pipe).__name__} has neither a unet nor a transformer; the latent support needs an "
            "SD 1.5 / SDXL, SD 3 or Flux pipeline"
        )
    family = family_of_pipeline(pipe)  # the registry's row: flow matching or not, timestep units
    if family.flow:
        packed = hasattr(type(pipe), "_pack_latents")  # the pipeline's own packing of x_t (Flux)
        return LatentSpace("flow", packed, "flow", attribute, family.timestep_scale)
    scheduler = getattr(pipe, "scheduler", None)
    config = getattr(scheduler, "config", {}) or {}
    kind = config.get("prediction_type", "epsilon")
    if kind not in ("epsilon", "v_prediction", "sample"):
        raise ValueError(
            f"the scheduler's prediction_type {kind!r} is none of epsilon, v_prediction, sample; "
            "pass a scheduler configured for one of them"
        )
    return LatentSpace("vp", False, kind, attribute, family.timestep_scale)


def default_size(pipe: Any) -> tuple[int, int]:
    """The pipeline's default ``(height, width)`` in pixels: ``default_sample_size`` (SDXL, SD 3,
    Flux) or the UNet's ``sample_size`` (SD 1.5), times ``vae_scale_factor``."""
    size = getattr(pipe, "default_sample_size", None)
    if size is None:
        size = pipe.unet.config.sample_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    return int(height) * pipe.vae_scale_factor, int(width) * pipe.vae_scale_factor


def _vae_normalise(vae: Any, z: torch.Tensor, family: str) -> torch.Tensor:
    """The inverse of the pipeline's latent-to-VAE map before ``vae.decode``."""
    config = vae.config
    scale = float(config.scaling_factor)
    if family == "flow":
        shift = getattr(config, "shift_factor", None) or 0.0
        return (z - float(shift)) * scale
    mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
    if mean is not None and std is not None:
        view = (1, z.shape[1], 1, 1)
        mean_t = torch.tensor(mean, dtype=z.dtype, device=z.device).view(view)
        std_t = torch.tensor(std, dtype=z.dtype, device=z.device).view(view)
        return (z - mean_t) * scale / std_t
    return z * scale


@torch.no_grad()
def encode_references(
    pipe: Any, images: Sequence[Any], *, height: int | None = None, width: int | None = None
) -> torch.Tensor:
    """The references' latents in the space and layout of the denoiser's input x_t.

    Args:
        pipe: an SD 1.5 / SDXL, SD 3 or Flux pipeline (its VAE and image processor are used).
        images: m >= 1 reference images (PIL, or what ``pipe.image_processor.preprocess`` takes, or
            an image file's path, opened with PIL: :func:`reference_image`); a PIL image of another
            mode than RGB (grayscale, palette, with alpha) is converted to RGB first, its alpha
            composited over white as the command line reads image files.
        height, width: the generation's size in pixels (default :func:`default_size`); the images
            are resized to it, as the pipeline's own img2img path does.

    Returns:
        ``[m, *state]`` float64 on the VAE's device: ``[C, h, w]`` (UNet, SD 3), ``[(h/2)(w/2), 4 C]``
        (Flux, packed as ``pipe._pack_latents`` packs x_t).

    Raises:
        ValueError: no image; a reference that is none of these, or a file that is no image.
    """
    images = list(images)
    if not images:
        raise ValueError("no reference image; pass a list of one or more images")
    space = latent_space(pipe)
    default_h, default_w = default_size(pipe)
    height, width = height or default_h, width or default_w
    vae = pipe.vae
    param = next(vae.parameters())
    images = [_rgb(reference_image(image, i), i) for i, image in enumerate(images)]
    pixels = pipe.image_processor.preprocess(images, height=height, width=width)
    pixels = pixels.to(device=param.device, dtype=param.dtype)
    z = vae.encode(pixels).latent_dist.mean.to(torch.float64)
    z = _vae_normalise(vae, z, space.family)
    if space.packed:
        m, c, h, w = z.shape
        z = pipe._pack_latents(z, m, c, h, w)
    return z


def reference_image(image: Any, index: int) -> Any:
    """A reference as the image processor takes it: a PIL image, array or tensor as it is, an image
    file's path opened (PIL); anything else is one ValueError naming the reference and the fix."""
    import os

    import numpy as np
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image | np.ndarray | torch.Tensor):
        return image
    if isinstance(image, str | os.PathLike):
        try:
            with Image.open(image) as handle:
                handle.load()
                return handle.copy()
        except (OSError, UnidentifiedImageError) as exc:
            raise ValueError(f"reference {index}: cannot read the image file '{image}' ({exc}); pass an "
                             "image file's path, or a PIL image") from None  # fmt: skip
    raise ValueError(
        f"reference {index} is {type(image).__name__}; pass a PIL image (or a numpy array, a torch tensor, "
        "an image file's path)"
    )


def _rgb(image: Any, index: int) -> Any:
    """A PIL image as RGB by the command line's rule (:func:`~nw_adapter.integration.rgb.to_rgb`: alpha
    over white, 16-bit grayscale scaled to 8 bits), anything else as it is."""
    from PIL import Image

    from nw_adapter.integration.rgb import to_rgb

    if not isinstance(image, Image.Image):
        return image
    try:
        return to_rgb(image)[0]
    except ValueError as exc:
        raise ValueError(f"reference {index}: {exc}") from None


def flatten_states(x: torch.Tensor) -> torch.Tensor:
    """``[B, *state]`` -> ``[B, D]`` (the space the posterior's distances are taken in)."""
    return x.reshape(x.shape[0], -1)


def clipping_refusal(scheduler: Any) -> str | None:
    """The one-line reason a scheduler cannot run the plug-in field, or None.

    A scheduler with ``clip_sample`` (DDIM, DDPM; on by default when DDIM is built from a PNDM
    config) clips its x0 estimate to ``[-clip_sample_range, clip_sample_range]`` and one with
    ``thresholding`` rescales it: latents are not pixels, so the clipped x0 is no reference and the
    generation ends between references (measured on the tiny SD 1.5 digits: 13.5 from both).
    """
    config = getattr(scheduler, "config", {}) or {}
    name = type(scheduler).__name__
    for option in ("clip_sample", "thresholding"):
        if config.get(option, False):
            return (
                f"{name} has {option}=True, which changes the x0 estimate of the plug-in field (latents "
                f"are not pixels); use {name}.from_config(pipe.scheduler.config, {option}=False)"
            )
    return None
