"""Companion pipelines that generate with the plug-in NW field over reference images (THEORY.md 4b).

Each class is a stock diffusers pipeline whose denoiser, for the length of a call, is
:class:`~nw_adapter.integration.nw_field.NWFieldDenoiser`: the exact field of the empirical target on
the references' latents (their VAE encoding in the space of x_t), run by diffusers' own ``__call__``
and the pipeline's own scheduler. As h_t -> 0 every generation ends on one reference's latent (a
copy, up to the scheduler's last noise level); which one follows the posterior over the references.

Build one from any loaded pipeline of its family and call it like that pipeline::

    field = StableDiffusionNWFieldPipeline.from_pipe(pipe, references=[image_3, image_7])
    images = field(num_inference_steps=30, generator=torch.Generator().manual_seed(0)).images

The prompt is optional (the field has no text conditioning; an empty prompt is passed when none is
given); IP-Adapter images are refused (the references are the support). ``tau > 0`` runs the field
of the smoothed support ``(1/m) sum_i N(s_i, tau^2 I)`` instead (a bandwidth floor in latent units).
The real denoiser stays the pipeline's component: ``StableDiffusionPipeline.from_pipe(field)`` gives
the stock pipeline back. Schedulers that clip or threshold their x0 estimate are refused
(:func:`~nw_adapter.integration.latent_support.clipping_refusal`). On a stock pipeline the same swap
is :func:`~nw_adapter.integration.nw_field.plug_in_field` (a context manager).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers import (
    FluxPipeline,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
)

from nw_adapter.integration.latent_support import default_size, encode_references
from nw_adapter.integration.nw_field import plug_in_field

__all__ = [
    "FluxNWFieldPipeline",
    "NWFieldMixin",
    "StableDiffusion3NWFieldPipeline",
    "StableDiffusionNWFieldPipeline",
    "StableDiffusionXLNWFieldPipeline",
]

_REFUSED_CALL = (
    "ip_adapter_image",
    "ip_adapter_image_embeds",
    "negative_ip_adapter_image",
    "negative_ip_adapter_image_embeds",
)


class NWFieldMixin:
    """The plug-in NW field in place of a pipeline's denoiser (see the module docstring)."""

    _nw_references: list[Any] | None = None
    _nw_tau: float = 0.0
    _nw_latents: dict[tuple[int, int], torch.Tensor] | None = None
    posterior_steps: list[dict[str, Any]] | None = None
    """After a call: the posterior over the references per step and CFG half along the generation's
    own path (:attr:`~nw_adapter.integration.latent_probe.LatentSupportProbe.rows`; its
    ``x0_nw_ratio`` is 0 up to rounding, the field being the plug-in). With several images in one
    call each reading is the mean over them (images that land on different references give a mixed
    ``posterior``): call once per image to read each one's."""

    @classmethod
    def from_pipe(
        cls, pipeline: Any, *, references: Sequence[Any] | None = None, tau: float = 0.0, **kwargs: Any
    ) -> Any:
        """diffusers' ``from_pipe`` (same components, no copy) plus :meth:`set_references`; quiet
        as the loaders are (:func:`~nw_adapter.models.loaders.quiet_loading`).

        Args:
            pipeline: a loaded pipeline of this family.
            references: the m >= 1 reference images (PIL) the field generates from.
            tau: smoothing of the support in latent units (0: the plug-in field).
            **kwargs: diffusers' ``from_pipe`` arguments (components to replace, ...).
        """
        from nw_adapter.library_output import library_output

        with library_output(bars=True):  # diffusers' float32 cast note, as the loaders hide it
            new = super().from_pipe(pipeline, **kwargs)
        if references is not None:
            new.set_references(references, tau=tau)
        elif tau:
            raise ValueError("tau smooths the references; pass references= with it")
        return new

    def set_references(self, references: Sequence[Any], *, tau: float = 0.0) -> None:
        """Use ``references`` (m >= 1 images: PIL, arrays, tensors or image files' paths) as the field's
        support; ``tau`` >= 0 its smoothing. A reference of another kind, or a file that is no image,
        is one ValueError naming it (:func:`~nw_adapter.integration.latent_support.reference_image`)."""
        if isinstance(references, str | bytes) or not isinstance(references, Sequence) or not references:
            raise ValueError(
                "references must be a non-empty list of images, e.g. references=[image_a, image_b]"
            )
        if isinstance(tau, bool) or not isinstance(tau, int | float) or not (math.isfinite(tau) and tau >= 0):
            raise ValueError(f"tau must be a finite number >= 0 (0: the plug-in field), got {tau!r}")
        from nw_adapter.integration.latent_support import reference_image

        self._nw_references = [reference_image(image, i) for i, image in enumerate(references)]
        self._nw_tau = float(tau)
        self._nw_latents = {}

    @property
    def references(self) -> list[Any]:
        """The reference images (empty before :meth:`set_references`)."""
        return list(self._nw_references or [])

    @property
    def tau(self) -> float:
        """The support's smoothing in latent units (0: the plug-in field)."""
        return self._nw_tau

    def reference_latents(self, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """The references' latents ``[m, *state]`` (float64) at a generation size (default the
        pipeline's), encoded once per size
        (:func:`~nw_adapter.integration.latent_support.encode_references`)."""
        if not self._nw_references:
            raise ValueError(
                f"{type(self).__name__} has no references; build it with from_pipe(pipe, references=[...]) "
                "or call set_references([...])"
            )
        size = (height or default_size(self)[0], width or default_size(self)[1])
        if self._nw_latents is None:
            self._nw_latents = {}
        if size not in self._nw_latents:
            self._nw_latents[size] = encode_references(
                self, self._nw_references, height=size[0], width=size[1]
            )
        return self._nw_latents[size]

    def _nw_field_call(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run diffusers' ``call`` with the field as the denoiser, the real one restored after."""
        given = [name for name in _REFUSED_CALL if kwargs.get(name) is not None]
        if given:
            raise ValueError(
                f"{given[0]} is not read by the NW field; the references are its support (drop it)"
            )
        if not args and kwargs.get("prompt") is None and kwargs.get("prompt_embeds") is None:
            kwargs["prompt"] = ""  # the field has no text conditioning
        support = self.reference_latents(kwargs.get("height"), kwargs.get("width"))
        with plug_in_field(self, support, tau=self._nw_tau) as probe:
            output = call(*args, **kwargs)
        self.posterior_steps = probe.rows
        return output


class StableDiffusionNWFieldPipeline(NWFieldMixin, StableDiffusionPipeline):
    """:class:`~diffusers.StableDiffusionPipeline` generating with the plug-in NW field.

    Example:
        >>> field = StableDiffusionNWFieldPipeline.from_pipe(pipe, references=[a, b])  # doctest: +SKIP
        >>> field(num_inference_steps=30, output_type="latent").images  # doctest: +SKIP
    """

    @functools.wraps(StableDiffusionPipeline.__call__)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._nw_field_call(super().__call__, *args, **kwargs)


class StableDiffusionXLNWFieldPipeline(NWFieldMixin, StableDiffusionXLPipeline):
    """:class:`~diffusers.StableDiffusionXLPipeline` generating with the plug-in NW field."""

    @functools.wraps(StableDiffusionXLPipeline.__call__)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._nw_field_call(super().__call__, *args, **kwargs)


class StableDiffusion3NWFieldPipeline(NWFieldMixin, StableDiffusion3Pipeline):
    """:class:`~diffusers.StableDiffusion3Pipeline` generating with the plug-in NW field."""

    @functools.wraps(StableDiffusion3Pipeline.__call__)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._nw_field_call(super().__call__, *args, **kwargs)


class FluxNWFieldPipeline(NWFieldMixin, FluxPipeline):
    """:class:`~diffusers.FluxPipeline` generating with the plug-in NW field (packed latents)."""

    @functools.wraps(FluxPipeline.__call__)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._nw_field_call(super().__call__, *args, **kwargs)
