"""The plug-in NW field over the references' latents as a diffusers denoiser (THEORY.md 2 and 4b).

:class:`NWFieldDenoiser` stands in for a pipeline's UNet (SD 1.5 / SDXL) or transformer (SD 3,
Flux): called like it, it returns the exact field of the empirical target on the references, the
output the pipeline's scheduler expects,

    x0 = m_h(x_t / a_t) = sum_i w_i(x_t) s_i,   w_i = softmax_i(-||x_t - a_t s_i||^2 / 2 b_t^2),

    VP (scheduler.config.prediction_type):  epsilon (x_t - a_t x0) / b_t,  v  a_t eps - b_t x0,  or x0;
    rectified flow, sigma convention (SD 3, Flux; a = 1 - s, b = s):  v = (x_s - x0) / s,

computed by :class:`~nw_adapter.core.paths.NWVelocityField` (:class:`~nw_adapter.core.paths.VPPath` at
the step's level, :class:`~nw_adapter.core.paths.SigmaFlowPath`) in float64, or with ``tau > 0`` the
exact field of the smoothed support ``(1/m) sum_i N(s_i, tau^2 I)``
(:class:`~nw_adapter.core.smoothed_fields.SmoothedSupportField`). The step's level (a_t, b_t) is the
scheduler's own, found as the recorder finds it (:class:`~nw_adapter.integration.steps.StepTracker`:
the scheduler's step index, else the timestep's place in ``scheduler.timesteps``).

Everything but ``forward`` is the wrapped denoiser's (``config``, ``dtype``, ``device``,
``add_embedding``, ``encoder_hid_proj``, ``cache_context`` ...), so diffusers' own ``__call__`` runs
unchanged around it; the wrapped denoiser is never run. The text, the IP-Adapter inputs and the
other conditioning the pipeline passes are not read: the field has none.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from nw_adapter.core.paths import NWVelocityField, SigmaFlowPath, VPPath
from nw_adapter.core.smoothed_fields import SmoothedSupportField
from nw_adapter.integration.latent_probe import LatentSupportProbe
from nw_adapter.integration.latent_support import LatentSpace, clipping_refusal, flatten_states, latent_space
from nw_adapter.integration.steps import StepTracker

__all__ = ["NWFieldDenoiser", "level_field", "plug_in_field"]


def level_field(support: torch.Tensor, space: LatentSpace, alpha: float, sigma: float, tau: float = 0.0):
    """``(field, t)``: the core field over ``support`` ``[m, D]`` and its time argument at the level
    (alpha, sigma) of one step.

    VP: :class:`~nw_adapter.core.paths.VPPath` over the one-entry table ``abar = alpha^2`` (so b =
    sqrt(1 - alpha^2) = sigma), t = 0, with ``space.kind``'s output; flow:
    :class:`~nw_adapter.core.paths.SigmaFlowPath` at t = s = sigma. ``tau > 0``: the smoothed
    support's field on the same path.
    """
    if space.family == "vp":
        path = VPPath(torch.tensor([alpha * alpha], dtype=torch.float64), space.kind)
        t: float = 0
    else:
        path, t = SigmaFlowPath(), float(sigma)
    if tau > 0:
        return SmoothedSupportField(support, path, tau=float(tau), validate=False), t
    return NWVelocityField(support, path, form="direct", validate=False), t


class NWFieldDenoiser(torch.nn.Module):
    """A UNet / transformer stand-in that returns the plug-in NW field (see the module docstring).

    Args:
        denoiser: the pipeline's UNet or transformer (its attributes are this module's; not run).
        pipe: the pipeline (its ``scheduler`` gives the levels; read at every forward).
        support: ``[m, *state]`` the references' latents in the layout of x_t
            (:func:`~nw_adapter.integration.latent_support.encode_references`).
        space: the pipeline's :class:`~nw_adapter.integration.latent_support.LatentSpace`.
        tau: smoothing of the support in latent units (0: the plug-in field).

    The output has the input's dtype and device; ``return_dict`` as diffusers' models (a tuple
    ``(sample,)`` when False).
    """

    def __init__(
        self,
        denoiser: torch.nn.Module,
        pipe: Any,
        support: torch.Tensor,
        space: LatentSpace,
        *,
        tau: float = 0.0,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "wrapped", denoiser)  # not a submodule: never moved, saved or run
        self.space = space
        self.tau = float(tau)
        self.register_buffer("support", flatten_states(support).to(torch.float64), persistent=False)
        self.tracker = StepTracker(pipe)
        self.tracker.attach(self, timestep_scale=space.timestep_scale)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "wrapped"), name)

    def remove(self) -> None:
        """Detach the step tracker's hook (the module is then inert)."""
        self.tracker.detach()

    def forward(
        self,
        sample: torch.Tensor | None = None,
        timestep: Any = None,
        *args: Any,
        hidden_states: torch.Tensor | None = None,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> Any:
        """The field at ``sample`` (UNet) / ``hidden_states`` (transformers) ``[B, *state]``.

        Raises:
            RuntimeError: the step's noise level is unknown (a timestep off the scheduler's table,
                or a call outside the pipeline's sampling loop), or the state's shape is not the
                references' (the generation's size differs from the size they were encoded at).
        """
        x = sample if sample is not None else hidden_states
        state = self.tracker.state
        alpha, sigma = float(state.alpha), float(state.sigma)
        if not (math.isfinite(alpha) and math.isfinite(sigma) and sigma > 0):
            raise RuntimeError(
                f"the NW field needs the scheduler's noise level at timestep {state.timestep}; call it "
                "inside the pipeline's own sampling loop (the timestep must be one of scheduler.timesteps)"
            )
        flat = flatten_states(x)
        if flat.shape[1] != self.support.shape[1]:
            raise RuntimeError(
                f"x_t has shape {tuple(x.shape[1:])} but the references were encoded for "
                f"{self.support.shape[1]} latent numbers; generate at the size the references were encoded at"
            )
        field, t = level_field(self.support, self.space, alpha, sigma, self.tau)
        out = field(flat.to(torch.float64), t).to(dtype=x.dtype).reshape(x.shape)
        if not return_dict:
            return (out,)
        if self.space.denoiser == "unet":
            from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

            return UNet2DConditionOutput(sample=out)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=out)


@contextlib.contextmanager
def plug_in_field(pipe: Any, support: torch.Tensor, *, tau: float = 0.0) -> Iterator[LatentSupportProbe]:
    """Within the block, ``pipe``'s denoiser is the plug-in NW field over ``support``.

    The pipeline attribute (``unet`` / ``transformer``) is set on the instance only (its config and
    components keep the real denoiser) and restored on exit, also after an exception or an interrupt.
    The yielded :class:`~nw_adapter.integration.latent_probe.LatentSupportProbe` reads the posterior of
    every step of the block's calls along their own path (its ``rows``).

    Args:
        pipe: an SD 1.5 / SDXL, SD 3 or Flux pipeline.
        support: ``[m, *state]`` the references' latents
            (:func:`~nw_adapter.integration.latent_support.encode_references`).
        tau: smoothing of the support in latent units (0: the plug-in field).

    Raises:
        ValueError: a scheduler that clips or thresholds its x0 estimate
            (:func:`~nw_adapter.integration.latent_support.clipping_refusal`).
    """
    refusal = clipping_refusal(pipe.scheduler)
    if refusal:
        raise ValueError(refusal)
    space = latent_space(pipe)
    real = getattr(pipe, space.denoiser)
    field = NWFieldDenoiser(real, pipe, support.to(real.device), space, tau=tau)
    probe = LatentSupportProbe(pipe, support, space).attach(field)
    object.__setattr__(
        pipe, space.denoiser, field
    )  # the instance only: config and components keep the real one
    try:
        yield probe
    finally:
        object.__setattr__(pipe, space.denoiser, real)
        probe.detach()
        field.remove()
