"""The untrained-adapter control at run time: hooks that see the raw image embeddings, a per-forward cache.

:class:`UntrainedControl` holds the :class:`~nw_adapter.integration.untrained.UntrainedAdapter`
(built once, at install) and two forward pre-hooks on the denoiser:

- on the denoiser itself: forgets the previous forward's embeddings (a forward without image
  embeddings never sees stale ones) and, for a denoiser that repeats the projected image
  embeddings per video frame (AnimateDiff's ``UNetMotionModel``: ``repeat_interleave(num_frames)``
  after its ``encoder_hid_proj``), notes the forward's number of frames;
- on the module that receives the raw image embeddings (``encoder_hid_proj`` for UNet and Flux,
  ``image_proj`` for SD3, :func:`~nw_adapter.integration.untrained.projection_module`): keeps a
  reference to them (and SD3's timestep). Nothing is computed in a hook, so the hooks cannot fail
  a generation.

The processors ask for :meth:`UntrainedControl.projected` inside their safe side computation: the
untrained image projection runs once per denoiser forward (cached; repeated per frame as the
denoiser repeats the trained projection's output), then :meth:`UntrainedControl.keys` applies one
layer's untrained key projection. The installer
(:mod:`nw_adapter.integration.mixin`) attaches the hooks at install and detaches them at removal.
"""

from __future__ import annotations

from typing import Any

import torch

from nw_adapter.integration.untrained import (
    ProjectedImages,
    UntrainedAdapter,
    build_untrained_adapter,
    keys_from_states,
    project_images,
    projection_module,
)

__all__ = ["UntrainedControl", "repeats_image_embeds_per_frame"]


def repeats_image_embeds_per_frame(denoiser: torch.nn.Module) -> bool:
    """Whether ``denoiser`` repeats its projected image embeddings per video frame after the image
    projection (diffusers' ``UNetMotionModel``, AnimateDiff's denoiser, and its subclasses)."""
    try:
        from diffusers import UNetMotionModel
    except ImportError:  # pragma: no cover - diffusers without the motion UNet
        return False
    return isinstance(denoiser, UNetMotionModel)


class UntrainedControl:
    """The untrained-adapter control of one installation (see the module docstring).

    Args:
        adapter: The untrained initialisation
            (:func:`~nw_adapter.integration.untrained.build_untrained_adapter`).

    Example:
        >>> control = UntrainedControl.build(pipe.unet, seed=0)  # doctest: +SKIP
        >>> control.attach(pipe.unet)  # doctest: +SKIP
    """

    def __init__(self, adapter: UntrainedAdapter) -> None:
        self.adapter = adapter
        self._handles: list[Any] = []
        self._embeds: Any = None
        self._timestep: torch.Tensor | None = None
        self._projected: ProjectedImages | None = None
        self._frames = 1
        self._per_frame = False

    @classmethod
    def build(cls, denoiser: torch.nn.Module, *, seed: int = 0) -> UntrainedControl:
        """Build the untrained initialisation of ``denoiser``'s loaded adapter(s), seeded.

        Raises:
            ValueError: no adapter loaded or an unsupported processor (from the builder).
        """
        return cls(build_untrained_adapter(denoiser, seed=seed))

    # ------------------------------------------------------------------ hooks
    @property
    def attached(self) -> bool:
        """Whether the hooks are registered."""
        return bool(self._handles)

    def attach(self, denoiser: torch.nn.Module) -> None:
        """Register the two forward pre-hooks on ``denoiser`` (idempotent: earlier ones are removed)."""
        self.detach()
        projection = projection_module(denoiser)
        self._per_frame = repeats_image_embeds_per_frame(denoiser)
        self._handles = [
            denoiser.register_forward_pre_hook(self._start, with_kwargs=True),
            projection.register_forward_pre_hook(self._capture, with_kwargs=True),
        ]

    def detach(self) -> None:
        """Remove the hooks and forget the captured embeddings."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._forget()

    def _forget(self, *unused: Any) -> None:
        self._embeds, self._timestep, self._projected = None, None, None
        self._frames = 1

    def _start(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """A new denoiser forward: forget the last one's embeddings; note its frames (per-frame
        denoisers: ``sample`` is ``[B, C, F, H, W]``)."""
        self._forget()
        if self._per_frame:
            sample = args[0] if args else kwargs.get("sample")
            if isinstance(sample, torch.Tensor) and sample.dim() == 5:
                self._frames = int(sample.shape[2])

    def _capture(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Keep the raw image embeddings (and SD3's timestep) entering the image projection."""
        self._embeds = args[0] if args else kwargs.get("image_embeds", kwargs.get("x"))
        self._timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        self._projected = None

    # ------------------------------------------------------------------ keys
    def projected(self) -> ProjectedImages:
        """The untrained projection of this forward's image embeddings (computed once per forward).

        Raises:
            RuntimeError: no image embeddings entered the projection in this forward.
        """
        if self._projected is None:
            if self._embeds is None:
                raise RuntimeError(
                    "untrained control: no image embeddings entered the denoiser's image projection in "
                    "this forward; is the control attached (apply_nw_processor(untrained_control=True))?"
                )
            projected = project_images(self.adapter, self._embeds, timestep=self._timestep)
            if self._frames > 1:  # as the denoiser repeats the trained projection's output
                states = [s.repeat_interleave(self._frames, dim=0) for s in projected.states]
                projected = ProjectedImages(states, projected.temb)
            self._projected = projected
        return self._projected

    def keys(self, layer: str, states: torch.Tensor, *, adapter: int = 0) -> torch.Tensor:
        """One layer's untrained keys ``[B, H, M, d]`` from projected tokens ``states`` (an entry of
        :attr:`ProjectedImages.states`, or a part of it grouped as the trained branch groups its own)."""
        return keys_from_states(self.adapter, layer, states, adapter=adapter, temb=self.projected().temb)
