"""Velocity fields used by the experiments, all built on the core library.

- :func:`exact_nw_velocity`: the frozen exact NW velocity of the OT path (the "exact head" of
  variant ON), u(x, t) = (m_h(x / t) - (1 - sigma_min) x) / b_t with per-query times
  (THEORY.md section 2), via :class:`nw_adapter.core.paths.NWVelocityField`.
- :func:`plugin_field`: the plug-in NW field of a support set, a callable ``(x, t)`` for
  :func:`nw_adapter.core.sampling.sample_ode`.
- :func:`model_field`: a learned :class:`~nw_adapter.experiments.model.ICFMModel` conditioned on a
  support set, as the same kind of callable (no gradients).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from nw_adapter.core.paths import NWVelocityField, OTPath

__all__ = ["exact_nw_velocity", "plugin_field", "model_field"]


def exact_nw_velocity(
    x: Tensor,
    t: Tensor | float,
    support: Tensor,
    support_mask: Tensor | None = None,
    *,
    sigma_min: float = 0.01,
) -> Tensor:
    """Exact NW velocity of the OT path for the empirical target on ``support``.

    Args:
        x: Query points ``[B, n, d]``.
        t: Time, a number, a 0-dim tensor, or per-query times ``[B, n]``.
        support: ``[B, m, d]``.
        support_mask: Bool ``[B, m]`` (True = valid) or None.
        sigma_min: sigma_min of the OT path.

    Returns:
        ``u = (sum_i w_i s_i - (1 - sigma_min) x) / (1 - (1 - sigma_min) t)``, ``[B, n, d]`` float32.
    """
    field = NWVelocityField(support, OTPath(sigma_min), support_mask=support_mask, validate=False)
    return field(x, t).to(x.dtype)


def plugin_field(
    support: Tensor, support_mask: Tensor | None = None, *, sigma_min: float = 0.01
) -> Callable[[Tensor, Tensor], Tensor]:
    """The plug-in NW velocity field of ``support [B, m, d]`` as ``(x [B, n, d], t) -> [B, n, d]``."""
    return NWVelocityField(support, OTPath(sigma_min), support_mask=support_mask, validate=False)


def model_field(
    model: torch.nn.Module, support: Tensor, support_mask: Tensor | None = None
) -> Callable[[Tensor, Tensor], Tensor]:
    """A learned model conditioned on ``support [B, m, d]`` as ``(x [B, n, d], t) -> [B, n, d]``."""

    def field(x: Tensor, t: Tensor) -> Tensor:
        with torch.no_grad():
            return model(x, t, support, support_mask)

    return field
