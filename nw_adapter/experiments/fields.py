"""Velocity fields used by the experiments, all built on the core library.

- :func:`exact_nw_velocity`: the frozen exact NW velocity of the OT path (the "exact head" of
  variant ON), u(x, t) = (m_h(x / t) - (1 - sigma_min) x) / b_t with per-query times
  (THEORY.md section 2), via :class:`nw_adapter.core.paths.NWVelocityField`.
- :func:`plugin_field`: the plug-in NW field of a support set, a callable ``(x, t)`` for
  :func:`nw_adapter.core.sampling.sample_ode`.
- :func:`model_field`: a learned :class:`~nw_adapter.experiments.model.ICFMModel` conditioned on a
  support set, as the same kind of callable (no gradients).
- :data:`TRAINING_FREE` / :func:`training_free_builders`: the training-free fields of
  :mod:`nw_adapter.core.smoothed_fields` (one per lesson of THEORY.md section 5, plus the amortised
  smoothing), each as a field builder for :func:`~nw_adapter.experiments.evaluation.evaluate_methods`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from nw_adapter.core.paths import NWVelocityField, OTPath
from nw_adapter.core.smoothed_fields import LocalCovarianceField, ProjectedField, SmoothedSupportField

__all__ = ["exact_nw_velocity", "plugin_field", "model_field", "TRAINING_FREE", "training_free_builders"]

#: The training-free fields and the regime whose gap each is meant to close (THEORY.md section 5).
TRAINING_FREE = {
    "smoothed": "digits",  # smoothed support, leave-one-out tau: against support scarcity
    "local_cov": "shells",  # manifold Parzen windows: against geometry mismatch
    "projected": "dims",  # NW in the leading principal subspace: against nearest-neighbour collapse
    "amortised": "digits",  # smoothed support, tau fitted once on training tasks: amortisation
}


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


def _no_padding(support_mask: Tensor | None) -> None:
    if support_mask is not None and not bool(support_mask.all()):
        raise ValueError("the training-free fields take equal-size supports; pass support_mask=None")


def training_free_builders(
    amortised_tau: float, *, sigma_min: float = 0.01
) -> dict[str, Callable[[Tensor, Tensor | None], Callable[[Tensor, Tensor], Tensor]]]:
    """Field builders ``(support [B, m, d], mask) -> field`` for every name of :data:`TRAINING_FREE`.

    Args:
        amortised_tau: tau of the amortised smoothed support, fitted on training tasks beforehand
            (:func:`nw_adapter.core.smoothed_fields.fit_shared_tau`); nothing is fitted on the new task.
        sigma_min: sigma_min of the OT path.
    """
    path = OTPath(sigma_min)

    def smoothed(support: Tensor, mask: Tensor | None):
        _no_padding(mask)
        return SmoothedSupportField(support, path, validate=False)

    def local_cov(support: Tensor, mask: Tensor | None):
        _no_padding(mask)
        return LocalCovarianceField(support, path, validate=False)

    def projected(support: Tensor, mask: Tensor | None):
        _no_padding(mask)
        return ProjectedField(support, path, validate=False)

    def amortised(support: Tensor, mask: Tensor | None):
        _no_padding(mask)
        return SmoothedSupportField(support, path, tau=amortised_tau, validate=False)

    return {"smoothed": smoothed, "local_cov": local_cov, "projected": projected, "amortised": amortised}
