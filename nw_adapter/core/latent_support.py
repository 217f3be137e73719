"""The theory's posterior over a support set in the space where x_t lives (THEORY.md 1, 2 and 4b).

A support set of m references has latents ``s_i`` in the space of the sampler's state ``x_t``
(flattened to ``D`` numbers each). At the noise level ``x_t = a_t x_0 + b_t eps`` the exact
posterior over the references is

    w_i(x_t) = softmax_i( -||x_t - a_t s_i||^2 / (2 b_t^2) )        (h_t = b_t / a_t),

its NW mean ``m_h(x_t / a_t) = sum_i w_i s_i`` is the exact denoiser's x0, and every model output
(epsilon, v, the flow velocity) is affine in ``x_t`` and that x0 (THEORY.md 2). This module holds
the plain functions on those quantities that the diffusers side (the plug-in NW field pipelines,
the support-set run) evaluates per step:

- :func:`reference_log_posterior`: ``log w_i(x)`` from direct differences (no division by a_t:
  a_t = 0 gives the uniform posterior);
- :func:`posterior_summary`: its entropy share ``H(w) / log m``, ``n_eff = 1 / sum_i w_i^2`` and the
  favoured reference;
- :func:`x0_from_output`: a denoiser's x0 estimate from its output (the inverse of
  :meth:`~nw_adapter.core.paths.VPPath.field` / :meth:`~nw_adapter.core.paths.SigmaFlowPath.field`);
- :func:`relative_distance`: ``||x0 - m_h|| / ||x0 - mean_i s_i||``, how far a model's x0 is from the
  plug-in field's, in units of its distance to the references' mean.

Everything is float64 (the posterior at small h has logits of size 1e3 and more), never under
autocast, pure torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from nw_adapter.core import kernels

__all__ = [
    "OUTPUT_KINDS",
    "PosteriorSummary",
    "posterior_summary",
    "reference_log_posterior",
    "relative_distance",
    "x0_from_output",
]

OUTPUT_KINDS = ("epsilon", "v_prediction", "sample", "flow")
"""What a denoiser returns: VP epsilon, VP v (``a eps - b x0``), x0 itself, or the rectified-flow
velocity in the sigma convention of SD 3 / Flux (``eps - x0``, THEORY.md 2)."""


def _level(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def reference_log_posterior(x: Tensor, support: Tensor, alpha: float, sigma: float) -> Tensor:
    """``log w_i(x) = log softmax_i(-||x - a s_i||^2 / (2 b^2))``.

    Args:
        x: ``[..., D]`` states x_t (latents flattened to D numbers).
        support: ``[m, D]`` the references' latents in the same space and layout.
        alpha: a_t >= 0 (0: pure noise, uniform posterior).
        sigma: b_t > 0.

    Returns:
        ``[..., m]`` float64 log-weights (each row's ``exp`` sums to 1).

    Example:
        >>> s = torch.tensor([[0.0, 0.0], [3.0, 0.0]])
        >>> reference_log_posterior(torch.tensor([2.9, 0.0]), s, 1.0, 0.1).exp().round(decimals=3)
        tensor([0., 1.], dtype=torch.float64)
    """
    a, b = _level("alpha", alpha), _level("sigma", sigma)
    if a < 0 or b <= 0:
        raise ValueError(f"the noise level needs alpha >= 0 and sigma > 0, got alpha={a}, sigma={b}")
    if not isinstance(support, Tensor) or support.dim() != 2 or support.shape[0] < 1:
        raise ValueError("support must be a tensor [m, D] with m >= 1 references")
    if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[-1] != support.shape[-1]:
        shown = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must be a tensor [..., D] with D = {support.shape[-1]}, got {shown}")
    q = x.detach().to(torch.float64)
    s = support.detach().to(device=q.device, dtype=torch.float64)
    with kernels.no_autocast(q.device):
        logits = kernels.nw_logits(q[..., None, :], a * s, b, validate=False)[..., 0, :]
        return torch.log_softmax(logits, dim=-1)


@dataclass(frozen=True)
class PosteriorSummary:
    """The posterior over m references, per row.

    Attributes:
        weights: ``[..., m]`` w_i.
        entropy_share: ``[...]`` ``H(w) / log m`` (1: even, 0: one reference; NaN for m = 1).
        n_eff: ``[...]`` ``1 / sum_i w_i^2`` (m: even, 1: one reference).
        favoured: ``[...]`` int64 index of the largest weight.
    """

    weights: Tensor
    entropy_share: Tensor
    n_eff: Tensor
    favoured: Tensor


def posterior_summary(log_weights: Tensor) -> PosteriorSummary:
    """Entropy share, n_eff and the favoured reference of ``[..., m]`` log-weights."""
    m = log_weights.shape[-1]
    w = log_weights.exp()
    entropy = -(w * log_weights).nan_to_num(0.0).sum(-1)  # 0 log 0 = 0 (log w = -inf)
    share = entropy / math.log(m) if m > 1 else torch.full_like(entropy, math.nan)
    return PosteriorSummary(w, share, kernels.effective_sample_size(w), w.argmax(-1))


def x0_from_output(output: Tensor, x: Tensor, alpha: float, sigma: float, kind: str) -> Tensor:
    """A denoiser's x0 estimate from its output at ``x_t = a x0 + b eps``.

    ``"epsilon"``: ``(x - b eps) / a``; ``"v_prediction"`` (v = a eps - b x0): ``a x - b v``;
    ``"sample"``: the output; ``"flow"`` (SD 3 / Flux, ``x = (1 - s) x0 + s eps``, v = eps - x0, so
    a = 1 - s, b = s): ``x - s v``. Exact inverses of :meth:`~nw_adapter.core.paths.VPPath.field` and
    :meth:`~nw_adapter.core.paths.SigmaFlowPath.field` given x.

    Args:
        output, x: tensors of one shape (any).
        alpha, sigma: the level (a > 0 for epsilon).
        kind: one of :data:`OUTPUT_KINDS`.

    Returns:
        float64, the shape of ``x``.
    """
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"kind must be one of {OUTPUT_KINDS}, got {kind!r}")
    a, b = _level("alpha", alpha), _level("sigma", sigma)
    out, xt = output.detach().to(torch.float64), x.detach().to(torch.float64)
    if kind == "epsilon":
        if a <= 0:
            raise ValueError("an epsilon output has no x0 at alpha = 0")
        return (xt - b * out) / a
    if kind == "v_prediction":
        return a * xt - b * out
    if kind == "sample":
        return out
    return xt - b * out


def relative_distance(x0: Tensor, nw_mean: Tensor, support_mean: Tensor) -> Tensor:
    """``||x0 - m_h|| / ||x0 - mean_i s_i||`` per row of ``[..., D]`` tensors (float64).

    0: the model's x0 is the plug-in field's. Where the posterior is even (large h) the NW mean is
    the references' mean and the ratio is 1 whatever x0 is: read it where ``n_eff < m``. NaN where
    x0 is the references' mean.
    """
    x0 = x0.detach().to(torch.float64)
    near = (x0 - nw_mean.to(x0)).norm(dim=-1)
    far = (x0 - support_mean.to(x0)).norm(dim=-1)
    return torch.where(far > 0, near / far, torch.full_like(near, math.nan))
