"""Bandwidth rules for comparing a dot-product attention head with NW weights (THEORY.md section 4).

Each rule works per leading index (e.g. per (batch, head) for ``[B, H, n, d]`` queries and
``[B, H, m, d]`` keys): the query rows ``n`` (and keys ``m``) are reduced, the leading dims stay.
Returned bandwidths plug straight into :mod:`nw_adapter.core.kernels` as ``bandwidth[..., None, None]``.
Nothing here synchronises with the device unless ``validate=True`` is passed (shapes are always
checked; values such as NaN only with ``validate``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nw_adapter.core.kernels import _logits, compute_dtype, no_autocast

_NAMES = ("query", "key", "key_mask")

__all__ = [
    "fit_schedule_constant",
    "fitted_bandwidth",
    "matched_bandwidth",
    "median_bandwidth",
    "schedule_bandwidth",
]


def matched_bandwidth(head_dim: int | None = None, *, scale: float | None = None) -> float:
    """Bandwidth whose NW logits have the same ``q.k`` coefficient as the attention's softmax.

    ``softmax(scale * q.k_i) = NW(h) * key prior`` with ``1/h^2 = scale``; for the default
    ``scale = 1/sqrt(d_k)`` this is ``h^2 = sqrt(d_k)``.

    Args:
        head_dim: ``d_k`` (used when ``scale`` is None): ``h = d_k ** 0.25``.
        scale: the attention's softmax scale: ``h = scale ** -0.5``.

    Returns:
        h as a float.
    """
    if (head_dim is None) == (scale is None):
        raise ValueError("give exactly one of head_dim (d_k) or scale (the softmax scale)")
    if scale is not None:
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be finite and > 0, got {scale}")
        return float(scale) ** -0.5
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    return float(head_dim) ** 0.25


def _moments(beta: Tensor, g: Tensor, g0: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row mean and variance of G under ``softmax(beta G)``; ``beta`` is ``[..., 1, 1]``.

    ``g`` holds ``-inf`` at masked keys (weight 0 for beta > 0); ``g0`` is ``g`` with 0 there.
    """
    w = torch.softmax(beta * g, dim=-1)
    mean = (w * g0).sum(-1)
    var = (w * (g0 - mean[..., None]).square()).sum(-1)
    return mean, var


def fitted_bandwidth(
    attn: Tensor,
    query: Tensor,
    key: Tensor,
    *,
    key_mask: Tensor | None = None,
    steps: int = 24,
    beta_range: tuple[float, float] = (1e-6, 1e6),
    validate: bool = False,
) -> tuple[Tensor, Tensor]:
    """Bandwidth ``h = beta*^(-1/2)`` whose NW weights best match the attention weights.

    ``beta* = argmin_beta mean_rows CE(A || softmax(beta G))`` with ``G_i = q.k_i - ||k_i||^2/2``
    (computed as ``-||q - k_i||^2/2``, which differs by a per-row constant that cancels). The
    loss is convex: ``L'(beta) = mean_rows(E_softmax(beta G)[G] - E_A[G])`` is increasing and
    ``L''(beta) = mean_rows Var_softmax(beta G)[G] >= 0``. A fixed number of safeguarded Newton
    steps runs entirely on the device (no ``.item()``): start at the matched ``beta = 1/sqrt(d)``,
    keep a bracket ``[lo, hi]`` in ``log beta`` (initially ``beta_range / sqrt(d)``) updated by the
    sign of ``L'``, and take the Newton step ``beta - L'/L''`` when it lands inside the bracket,
    else bisect it. Newton converges quadratically; even pure bisection resolves ``log beta`` to
    ``log(1e12) / 2^steps`` (``~2e-6`` for 24 steps). If the optimum lies outside the range, the
    nearest end is approached; where the loss is flat (e.g. one-hot attention once the NW
    weights have saturated) any point of the flat region is returned.

    Args:
        attn: ``[..., n, m]`` attention probability rows (masked keys must have weight 0).
        query: ``[..., n, d]``.
        key: ``[..., m, d]``.
        key_mask: optional bool ``[..., m]``, True = valid key.
        steps: Newton/bisection steps (each one softmax over ``[..., n, m]``).
        beta_range: bracket of ``beta * sqrt(d)`` (beta relative to the matched ``1/sqrt(d)``).
        validate: also check values (NaN, empty mask rows); off by default because it syncs.

    Returns:
        ``(h, kl)``, both ``[...]`` float32 (float64 for float64 inputs): the fitted bandwidth and
        the residual ``mean_rows KL(A || NW(h))`` (clamped at 0 against rounding).

    Example:
        >>> q, k = torch.randn(2, 8, 64, 40), torch.randn(2, 8, 4, 40)
        >>> attn = torch.softmax(q @ k.transpose(-1, -2) / 40**0.5, dim=-1)
        >>> h, kl = fitted_bandwidth(attn, q, k)  # [2, 8] each, one per (batch, head)
    """
    if not isinstance(attn, Tensor) or attn.dim() < 2:
        raise ValueError("attn must be a tensor [..., n, m] of attention probability rows")
    if not (0 < beta_range[0] < beta_range[1] and math.isfinite(beta_range[1])):
        raise ValueError(f"beta_range must satisfy 0 < low < high < inf, got {beta_range}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    g = _logits(query, key, 1.0, key_mask, validate, names=_NAMES)  # -||q - k||^2 / 2
    if attn.shape[-2:] != g.shape[-2:]:
        raise ValueError(
            f"attn must have shape [..., n, m] = [..., {g.shape[-2]}, {g.shape[-1]}], got {tuple(attn.shape)}"
        )
    dtype = compute_dtype(g, attn)
    a = attn.to(device=g.device, dtype=dtype)
    g = g.to(dtype)
    with no_autocast(g.device):
        valid = torch.isfinite(g)
        g0 = torch.where(valid, g, torch.zeros((), dtype=dtype, device=g.device))
        lead = torch.broadcast_shapes(a.shape[:-2], g.shape[:-2])
        target = (a * g0).sum(-1)  # E_A[G] per row
        d = query.shape[-1]
        lo = torch.full(lead, math.log(beta_range[0] / math.sqrt(d)), dtype=dtype, device=g.device)
        hi = torch.full(lead, math.log(beta_range[1] / math.sqrt(d)), dtype=dtype, device=g.device)
        log_beta = torch.full(lead, -0.5 * math.log(d), dtype=dtype, device=g.device)  # matched start
        for _ in range(steps):
            beta = log_beta.exp()
            mean_g, var_g = _moments(beta[..., None, None], g, g0)
            grad = (mean_g - target).mean(-1)  # L'(beta)
            hess = var_g.mean(-1)  # L''(beta) >= 0
            lo = torch.where(grad < 0, log_beta, lo)  # loss still decreasing: optimum to the right
            hi = torch.where(grad > 0, log_beta, hi)
            newton = beta - grad / hess
            ok = (hess > 0) & (newton > 0)
            log_newton = torch.where(ok, newton, beta).log()
            ok = ok & (log_newton >= lo) & (log_newton <= hi)
            log_beta = torch.where(ok, log_newton, 0.5 * (lo + hi))
        beta = log_beta.exp()
        z = beta[..., None, None] * g
        log_w = z - torch.logsumexp(z, dim=-1, keepdim=True)
        cross = torch.where(a > 0, a * log_w, torch.zeros((), dtype=dtype, device=a.device))
        kl = (torch.xlogy(a, a) - cross).sum(-1).mean(-1).clamp_min(0.0)
    return beta.rsqrt(), kl


def median_bandwidth(
    query: Tensor, key: Tensor, *, key_mask: Tensor | None = None, validate: bool = False
) -> Tensor:
    """Median heuristic ``h^2 = median_{j, i} ||q_j - k_i||^2 / 2`` over all (query, valid key) pairs.

    The median is the lower median (torch.nanmedian). It over-smooths in high ``d_k``.

    Args:
        query: ``[..., n, d]``.
        key: ``[..., m, d]``.
        key_mask: optional bool ``[..., m]``.
        validate: also check values (NaN, empty mask rows); off by default because it syncs.

    Returns:
        ``[...]`` h.
    """
    g = _logits(query, key, 1.0, key_mask, validate, names=_NAMES)  # -||q - k||^2 / 2
    with no_autocast(g.device):
        dist2_half = torch.where(torch.isfinite(g), -g, torch.full((), math.nan, dtype=g.dtype))
        return dist2_half.flatten(-2).nanmedian(dim=-1).values.sqrt()


def schedule_bandwidth(
    sigma: float | Tensor, alpha: float | Tensor, c: float | Tensor = 1.0
) -> float | Tensor:
    """Schedule-shaped bandwidth ``h = c * sigma_t / alpha_t`` (the NW bandwidth of the path, scaled).

    Args:
        sigma: ``b_t`` (float or tensor).
        alpha: ``a_t`` (float or tensor, > 0).
        c: constant per head (float or tensor broadcastable with sigma/alpha).

    Returns:
        ``c * sigma / alpha``, a float when every input is a float.
    """
    if not isinstance(alpha, Tensor) and not alpha > 0:
        raise ValueError(f"alpha must be > 0 for a finite bandwidth, got {alpha}")
    return c * sigma / alpha


def fit_schedule_constant(h_fitted: Tensor, sigma_over_alpha: Tensor) -> Tensor:
    """One constant c per head such that ``h_fitted[t] ~ c * sigma_t / alpha_t`` across steps.

    Least squares in log space (bandwidths span orders of magnitude):
    ``log c = mean_t (log h_fitted[t] - log(sigma_t / alpha_t))``, NaN/inf steps ignored.

    Args:
        h_fitted: ``[steps, ...]`` fitted bandwidths (e.g. ``[steps, layers, heads]``).
        sigma_over_alpha: ``[steps]`` schedule ratios, > 0.

    Returns:
        ``[...]`` c.
    """
    if not isinstance(h_fitted, Tensor) or not isinstance(sigma_over_alpha, Tensor):
        raise ValueError("h_fitted and sigma_over_alpha must be tensors")
    if sigma_over_alpha.dim() != 1 or h_fitted.dim() < 1 or h_fitted.shape[0] != sigma_over_alpha.shape[0]:
        raise ValueError(
            f"sigma_over_alpha must be [steps] matching h_fitted [steps, ...], got "
            f"{tuple(sigma_over_alpha.shape)} and {tuple(h_fitted.shape)}"
        )
    dtype = compute_dtype(h_fitted, sigma_over_alpha)
    r = sigma_over_alpha.to(device=h_fitted.device, dtype=dtype)
    r = r.reshape(-1, *([1] * (h_fitted.dim() - 1)))
    log_ratio = torch.log(h_fitted.to(dtype)) - torch.log(r)
    log_ratio = torch.where(torch.isfinite(log_ratio), log_ratio, torch.full((), math.nan, dtype=dtype))
    return torch.nanmean(log_ratio, dim=0).exp()
