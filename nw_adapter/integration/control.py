"""The untrained-adapter control at run time: hooks that see the raw image embeddings, a per-forward cache.

:class:`UntrainedControl` holds K :class:`~nw_adapter.integration.untrained.UntrainedAdapter`
draws (built once, at install; draw k seeded ``seed + k``) and two forward pre-hooks on the
denoiser:

- on the denoiser itself: forgets the previous forward's embeddings (a forward without image
  embeddings never sees stale ones) and, for a denoiser that repeats the projected image
  embeddings per video frame (AnimateDiff's ``UNetMotionModel``: ``repeat_interleave(num_frames)``
  after its ``encoder_hid_proj``), notes the forward's number of frames;
- on the module that receives the raw image embeddings (``encoder_hid_proj`` for UNet and Flux,
  ``image_proj`` for SD3, :func:`~nw_adapter.integration.untrained.projection_module`): keeps a
  reference to them (and SD3's timestep). Nothing is computed in a hook, so the hooks cannot fail
  a generation.

The processors ask for :meth:`UntrainedControl.projected` inside their safe side computation: each
draw's untrained image projection runs once per denoiser forward (cached; repeated per frame as the
denoiser repeats the trained projection's output), then :meth:`UntrainedControl.keys` applies one
layer's untrained key projection of that draw. The rescaling to the trained keys' RMS norm (the
scale-matched control) is :func:`scale_matched`, applied where the trained keys are known
(:meth:`~nw_adapter.integration.processors.base.NWProcessorBase._record_softmax`). The installer
(:mod:`nw_adapter.integration.mixin`) attaches the hooks at install and detaches them at removal.
"""

from __future__ import annotations

from typing import Any

import torch

from nw_adapter.core.readings import key_rms
from nw_adapter.integration.untrained import (
    ProjectedImages,
    UntrainedAdapter,
    build_untrained_adapter,
    keys_from_states,
    project_images,
    projection_module,
)

__all__ = ["UntrainedControl", "repeats_image_embeds_per_frame", "scale_matched"]


def repeats_image_embeds_per_frame(denoiser: torch.nn.Module) -> bool:
    """Whether ``denoiser`` repeats its projected image embeddings per video frame after the image
    projection (diffusers' ``UNetMotionModel``, AnimateDiff's denoiser, and its subclasses)."""
    try:
        from diffusers import UNetMotionModel
    except ImportError:  # pragma: no cover - diffusers without the motion UNet
        return False
    return isinstance(denoiser, UNetMotionModel)


def scale_matched(trained: torch.Tensor, untrained: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The untrained keys rescaled per (batch row, head) to the trained keys' RMS norm.

    ``c = key_rms(k) / key_rms(k0)`` per ``[B, H]`` and ``k0m = c k0``, so that
    ``key_rms(k0m) = key_rms(k)``: the scale-matched control differs from the trained keys in
    shape only. Where ``key_rms(k0) = 0`` (all-zero untrained keys) the keys stay zero (uniform
    attention) and ``c`` is inf (or NaN with zero trained keys too).

    Args:
        trained: the trained keys ``k`` ``[B, H, M, d]``.
        untrained: one draw's untrained keys ``k0`` ``[B, H, M0, d]`` (float32).

    Returns:
        ``(k0m [B, H, M0, d], c [B, H])``.
    """
    rms, rms0 = key_rms(trained), key_rms(untrained)
    ratio = rms / rms0
    factor = torch.where(rms0 > 0, ratio, torch.ones_like(ratio))
    return untrained * factor[..., None, None].to(untrained.dtype), ratio


class UntrainedControl:
    """The untrained-adapter control of one installation (see the module docstring).

    Args:
        adapters: The untrained initialisations, one per draw
            (:func:`~nw_adapter.integration.untrained.build_untrained_adapter`); a single adapter
            is one draw.

    Example:
        >>> control = UntrainedControl.build(pipe.unet, seed=0, draws=3)  # doctest: +SKIP
        >>> control.attach(pipe.unet)  # doctest: +SKIP
    """

    def __init__(self, adapters: UntrainedAdapter | list[UntrainedAdapter]) -> None:
        self.adapters = [adapters] if isinstance(adapters, UntrainedAdapter) else list(adapters)
        if not self.adapters:
            raise ValueError("the untrained control needs at least one draw")
        self._handles: list[Any] = []
        self._embeds: Any = None
        self._timestep: torch.Tensor | None = None
        self._projected: dict[int, ProjectedImages] = {}
        self._frames = 1
        self._per_frame = False

    @classmethod
    def build(cls, denoiser: torch.nn.Module, *, seed: int = 0, draws: int = 1) -> UntrainedControl:
        """Build ``draws`` untrained initialisations of ``denoiser``'s loaded adapter(s), draw k
        seeded ``seed + k``.

        Raises:
            ValueError: no adapter loaded, an unsupported processor (from the builder), or
                ``draws`` not an int >= 1.
        """
        if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
            raise ValueError(f"draws must be an int >= 1, got {draws!r}")
        return cls([build_untrained_adapter(denoiser, seed=seed + k) for k in range(draws)])

    @property
    def adapter(self) -> UntrainedAdapter:
        """Draw 0's untrained initialisation."""
        return self.adapters[0]

    @property
    def draws(self) -> int:
        """The number of control draws K."""
        return len(self.adapters)

    @property
    def seeds(self) -> list[int]:
        """The draws' seeds, in draw order."""
        return [adapter.seed for adapter in self.adapters]

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
        self._embeds, self._timestep, self._projected = None, None, {}
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
        self._projected = {}

    # ------------------------------------------------------------------ keys
    def projected(self, draw: int = 0) -> ProjectedImages:
        """Draw ``draw``'s untrained projection of this forward's image embeddings (computed once
        per forward and draw).

        Raises:
            RuntimeError: no image embeddings entered the projection in this forward.
        """
        if draw not in self._projected:
            if self._embeds is None:
                raise RuntimeError(
                    "untrained control: no image embeddings entered the denoiser's image projection in "
                    "this forward; is the control attached (apply_nw_processor(untrained_control=True))?"
                )
            projected = project_images(self.adapters[draw], self._embeds, timestep=self._timestep)
            if self._frames > 1:  # as the denoiser repeats the trained projection's output
                states = [s.repeat_interleave(self._frames, dim=0) for s in projected.states]
                projected = ProjectedImages(states, projected.temb)
            self._projected[draw] = projected
        return self._projected[draw]

    def keys(self, layer: str, states: torch.Tensor, *, adapter: int = 0, draw: int = 0) -> torch.Tensor:
        """One layer's untrained keys ``[B, H, M, d]`` of draw ``draw`` from projected tokens
        ``states`` (an entry of that draw's :attr:`ProjectedImages.states`, or a part of it grouped
        as the trained branch groups its own)."""
        untrained = self.adapters[draw]
        return keys_from_states(untrained, layer, states, adapter=adapter, temb=self.projected(draw).temb)
