"""Comparison metrics for attention weights vs NW weights, and unbiased MMD^2 (THEORY.md 4-5).

Conventions: ``a`` (attention weights) and ``b`` (NW weights) are ``[..., n, m]`` probability rows
(n query rows, m keys). Everything is torch, batched over leading dims, computed in float32
(float64 for float64 inputs), and stays on the input device (no host synchronisation).
Correlations of a constant row are NaN and row means ignore NaN rows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nw_adapter.core.kernels import BandwidthLike, compute_dtype, no_autocast, nw_weights

__all__ = [
    "average_ranks",
    "js_divergence",
    "kl_divergence",
    "median_heuristic_sigma",
    "mmd2_unbiased",
    "norm_equalised_null_rho",
    "pearson",
    "pearson_raveled",
    "permutation_null_rho",
    "rowwise_spearman",
    "spearman_rho",
    "top1_agreement",
]


def _pair(
    a: Tensor, b: Tensor, names: tuple[str, str] = ("a", "b"), min_dim: int = 1
) -> tuple[Tensor, Tensor]:
    for name, x in zip(names, (a, b), strict=True):
        if not isinstance(x, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < min_dim:
            raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(x.shape)}")
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(
            f"{names[0]} and {names[1]} must have the same last dim, got {tuple(a.shape)}, {tuple(b.shape)}"
        )
    dtype = compute_dtype(a, b)
    return a.to(dtype), b.to(device=a.device, dtype=dtype)


def average_ranks(x: Tensor) -> Tensor:
    """1-based ranks along the last dim, ties receiving the average of their positions.

    ``rank(x_i) = (#{j: x_j < x_i} + #{j: x_j <= x_i} + 1) / 2`` via sort + searchsorted, O(m log m).

    Args:
        x: ``[..., m]`` real tensor.

    Returns:
        ``[..., m]`` ranks in float32 (float64 for float64 input).
    """
    dtype = compute_dtype(x)
    xs = x.to(dtype).contiguous()
    srt = torch.sort(xs, dim=-1).values
    lo = torch.searchsorted(srt, xs, side="left")
    hi = torch.searchsorted(srt, xs, side="right")
    return (lo + hi + 1).to(dtype) / 2


def pearson(a: Tensor, b: Tensor) -> Tensor:
    """Pearson correlation over the last dim: ``sum(a~ b~) / sqrt(sum a~^2 sum b~^2)``, ``x~ = x - mean x``.

    Args:
        a: ``[..., m]``.
        b: ``[..., m]`` (leading dims broadcast with ``a``).

    Returns:
        ``[...]``; NaN where either row is constant (or has fewer than 2 entries).
    """
    a, b = _pair(a, b)
    with no_autocast(a.device):
        const = (a.amax(-1) == a.amin(-1)) | (b.amax(-1) == b.amin(-1)) if a.shape[-1] else None
        ac = a - a.mean(dim=-1, keepdim=True)
        bc = b - b.mean(dim=-1, keepdim=True)
        num = (ac * bc).sum(-1)
        den = torch.sqrt(ac.square().sum(-1) * bc.square().sum(-1))
        r = num / den
        if const is None:
            return r
        return torch.where(const | (den == 0), torch.full((), math.nan, dtype=r.dtype, device=r.device), r)


def rowwise_spearman(a: Tensor, b: Tensor) -> Tensor:
    """Per-row Spearman correlation (Pearson of average ranks) over the last dim.

    Args:
        a: ``[..., n, m]`` attention weights.
        b: ``[..., n, m]`` NW weights.

    Returns:
        ``[..., n]``; NaN for rows where either input is constant.
    """
    a, b = _pair(a, b)
    return pearson(average_ranks(a), average_ranks(b))


def spearman_rho(a: Tensor, b: Tensor) -> Tensor:
    """The paper's rho: per-row Spearman averaged over the rows (NaN rows ignored).

    Args:
        a: ``[..., n, m]``.
        b: ``[..., n, m]``.

    Returns:
        ``[...]``; NaN if every row is NaN.
    """
    return torch.nanmean(rowwise_spearman(a, b), dim=-1)


def pearson_raveled(a: Tensor, b: Tensor) -> Tensor:
    """Pearson correlation of the flattened ``n * m`` matrices.

    Args:
        a: ``[..., n, m]``.
        b: ``[..., n, m]``.

    Returns:
        ``[...]``; NaN if either matrix is constant.
    """
    a, b = _pair(a, b, min_dim=2)
    a, b = torch.broadcast_tensors(a, b)
    return pearson(a.flatten(-2), b.flatten(-2))


def _kl_terms(p: Tensor, log_p: Tensor, log_q: Tensor) -> Tensor:
    """``sum_i p_i (log p_i - log q_i)`` over the last dim, a term being 0 where ``p_i = 0``."""
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    return torch.where(p > 0, p * (log_p - log_q), zero).sum(-1)


def kl_divergence(
    p: Tensor, q: Tensor, *, log_p: Tensor | None = None, log_q: Tensor | None = None
) -> Tensor:
    """``KL(p || q) = sum_i p_i (log p_i - log q_i)`` over the last dim (natural log, 0 log 0 = 0).

    Args:
        p: ``[..., m]`` probability rows.
        q: ``[..., m]`` probability rows.
        log_p: optional ``[..., m]`` log-probabilities of p (e.g. ``log_softmax`` of the logits
            that gave ``p``), used instead of ``log p``.
        log_q: optional ``[..., m]`` log-probabilities of q (e.g. ``log_softmax`` of NW logits),
            used instead of ``log q``: finite even where ``q`` underflows to 0 at tiny bandwidths.

    Returns:
        ``[...]``; ``inf`` where ``q_i = 0 < p_i`` (with ``log_q``: where ``log_q_i = -inf``).
    """
    p, q = _pair(p, q, ("p", "q"))
    with no_autocast(p.device):
        if log_p is None and log_q is None:
            return (torch.xlogy(p, p) - torch.xlogy(p, q)).sum(-1)
        lp = torch.log(p) if log_p is None else log_p.to(device=p.device, dtype=p.dtype)
        lq = torch.log(q) if log_q is None else log_q.to(device=p.device, dtype=p.dtype)
        return _kl_terms(p, lp, lq)


def js_divergence(
    p: Tensor, q: Tensor, *, log_p: Tensor | None = None, log_q: Tensor | None = None
) -> Tensor:
    """Jensen-Shannon divergence ``KL(p||r)/2 + KL(q||r)/2`` with ``r = (p + q)/2`` (nats, <= log 2).

    With log-probabilities given, ``log r = logaddexp(log p, log q) - log 2`` and every term is
    computed in log space (no ``log`` of an underflowed probability).

    Args:
        p: ``[..., m]``.
        q: ``[..., m]``.
        log_p: optional ``[..., m]`` log-probabilities of p (replaces ``log p``).
        log_q: optional ``[..., m]`` log-probabilities of q (replaces ``log q``).

    Returns:
        ``[...]``.
    """
    p, q = _pair(p, q, ("p", "q"))
    if log_p is None and log_q is None:
        r = 0.5 * (p + q)
        return 0.5 * kl_divergence(p, r) + 0.5 * kl_divergence(q, r)
    with no_autocast(p.device):
        lp = torch.log(p) if log_p is None else log_p.to(device=p.device, dtype=p.dtype)
        lq = torch.log(q) if log_q is None else log_q.to(device=p.device, dtype=p.dtype)
        lr = torch.logaddexp(lp, lq) - math.log(2.0)
        return 0.5 * _kl_terms(p, lp, lr) + 0.5 * _kl_terms(q, lq, lr)


def top1_agreement(a: Tensor, b: Tensor) -> Tensor:
    """1.0 where ``argmax a == argmax b`` along the last dim (first index on ties), else 0.0.

    Args:
        a: ``[..., n, m]``.
        b: ``[..., n, m]``.

    Returns:
        ``[..., n]`` float32.
    """
    a, b = _pair(a, b)
    return (a.argmax(-1) == b.argmax(-1)).to(torch.float32)


def _row_permutation(shape: torch.Size, device: torch.device, generator: torch.Generator | None) -> Tensor:
    noise = torch.rand(shape, device=device, generator=generator)
    return noise.argsort(dim=-1)


def permutation_null_rho(a: Tensor, b: Tensor, *, generator: torch.Generator | None = None) -> Tensor:
    """rho with the keys of ``b`` shuffled independently in every row (expected ~0).

    Args:
        a: ``[..., n, m]``.
        b: ``[..., n, m]``.
        generator: optional torch.Generator on ``b``'s device, for reproducibility.

    Returns:
        ``[...]``.
    """
    a, b = _pair(a, b, min_dim=2)
    a, b = torch.broadcast_tensors(a, b)
    perm = _row_permutation(b.shape, b.device, generator)
    return spearman_rho(a, torch.gather(b, -1, perm))


def norm_equalised_null_rho(
    query: Tensor,
    key: Tensor,
    *,
    scale: float,
    bandwidth: BandwidthLike,
    key_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """rho of attention vs NW weights for queries of the same norms in uniformly random directions.

    ``q'_j = ||q_j|| z_j / ||z_j||`` with ``z_j ~ N(0, I)``; then
    ``rho(softmax(scale q' k^T), NW(q', k, h))``. Per-row Spearman rises with ``||q||`` even for
    random queries, so an observed rho is only evidence when it clears this null.

    Args:
        query: ``[..., n, d]``.
        key: ``[..., m, d]``.
        scale: softmax scale of the attention (e.g. ``1/sqrt(d)``).
        bandwidth: NW bandwidth, float or tensor broadcastable to the leading dims.
        key_mask: optional bool ``[..., m]``.
        generator: optional torch.Generator on ``query``'s device.

    Returns:
        ``[...]``.
    """
    if not isinstance(query, Tensor) or not isinstance(key, Tensor) or query.dim() < 2 or key.dim() < 2:
        raise ValueError("query must be [..., n, d] and key [..., m, d] tensors")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must share the feature dim, got {query.shape[-1]}, {key.shape[-1]}")
    dtype = compute_dtype(query, key)
    q = query.to(dtype)
    k = key.to(device=q.device, dtype=dtype)
    with no_autocast(q.device):
        z = torch.randn(q.shape, device=q.device, generator=generator, dtype=dtype)
        q_null = z * (q.norm(dim=-1, keepdim=True) / z.norm(dim=-1, keepdim=True))
        logits = scale * (q_null @ k.transpose(-1, -2))
        if key_mask is not None:
            logits = logits.masked_fill(~key_mask[..., None, :].to(q.device), -math.inf)
        attn = torch.softmax(logits, dim=-1)
        nw = nw_weights(q_null, k, bandwidth, support_mask=key_mask, validate=False)
        return spearman_rho(attn, nw)


def _pairwise_dist2(x: Tensor, y: Tensor) -> Tensor:
    """``||x_i - y_j||^2``, ``[..., n, m]``, in O(n m) memory.

    Both samples are centred on a common point first (the mean of ``x``), so the expanded form
    ``|x|^2 + |y|^2 - 2 x.y`` loses only ``~eps * spread^2`` (not ``eps * ||offset||^2``); the
    result is clamped at 0.
    """
    c = x.mean(dim=-2, keepdim=True)
    xc, yc = x - c, y - c
    sq_x, sq_y = xc.square().sum(-1), yc.square().sum(-1)
    d2 = sq_x[..., :, None] + sq_y[..., None, :] - 2.0 * (xc @ yc.transpose(-1, -2))
    return d2.clamp_min(0.0)


def _check_samples(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    x, y = _pair(x, y, ("x", "y"), min_dim=2)
    for name, z in (("x", x), ("y", y)):
        if z.shape[-2] < 2:
            raise ValueError(f"{name} needs at least 2 samples for unbiased MMD^2, got {tuple(z.shape)}")
    return x, y


def median_heuristic_sigma(x: Tensor, y: Tensor) -> Tensor:
    """Median pairwise Euclidean distance of the pooled sample ``[x; y]`` (pairs i < j).

    Even counts take the mean of the two middle values.

    Args:
        x: ``[..., n, d]``.
        y: ``[..., m, d]``.

    Returns:
        ``[...]`` sigma.
    """
    x, y = _check_samples(x, y)
    x, y = x.expand(*torch.broadcast_shapes(x.shape[:-2], y.shape[:-2]), *x.shape[-2:]), y
    y = y.expand(*x.shape[:-2], *y.shape[-2:])
    z = torch.cat([x, y], dim=-2)
    with no_autocast(z.device):
        d2 = _pairwise_dist2(z, z)
        iu = torch.triu_indices(z.shape[-2], z.shape[-2], offset=1, device=z.device)
        vals = torch.sort(d2[..., iu[0], iu[1]], dim=-1).values
        k = vals.shape[-1]
        med = 0.5 * (vals[..., (k - 1) // 2] + vals[..., k // 2])
        return med.sqrt()


def mmd2_unbiased(x: Tensor, y: Tensor, *, sigma: float | Tensor | None = None) -> Tensor:
    """Unbiased MMD^2 with the Gaussian kernel ``k(u, v) = exp(-||u - v||^2 / (2 sigma^2))``.

    ``MMD^2_u = sum_{i != j} k(x_i, x_j) / (n(n-1)) + sum_{i != j} k(y_i, y_j) / (m(m-1))
    - 2 sum_{i,j} k(x_i, y_j) / (n m)``; its expectation is 0 when x and y share a distribution
    (it can be negative). Sums accumulate in float64.

    Args:
        x: ``[..., n, d]`` sample, n >= 2.
        y: ``[..., m, d]`` sample, m >= 2.
        sigma: kernel bandwidth: None = :func:`median_heuristic_sigma` of the pooled sample; a
            float or a tensor broadcastable to the leading dims (a fixed kernel shared by methods).

    Returns:
        ``[...]`` MMD^2 (float64 for float64 inputs, else float32).
    """
    x, y = _check_samples(x, y)
    if sigma is None:
        sig: Tensor | float = median_heuristic_sigma(x, y)
    elif isinstance(sigma, Tensor):
        sig = sigma.to(device=x.device, dtype=x.dtype)
    else:
        if not (math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"sigma must be finite and > 0 (or None for the median heuristic), got {sigma}")
        sig = float(sigma)
    n, m = x.shape[-2], y.shape[-2]
    with no_autocast(x.device):
        gamma = 0.5 / (sig[..., None, None] ** 2 if isinstance(sig, Tensor) else sig**2)
        kxx = torch.exp(-gamma * _pairwise_dist2(x, x))
        kyy = torch.exp(-gamma * _pairwise_dist2(y, y))
        kxy = torch.exp(-gamma * _pairwise_dist2(x, y))
        f64 = torch.float64
        sxx = kxx.sum((-1, -2), dtype=f64) - kxx.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=f64)
        syy = kyy.sum((-1, -2), dtype=f64) - kyy.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=f64)
        sxy = kxy.sum((-1, -2), dtype=f64)
        mmd2 = sxx / (n * (n - 1)) + syy / (m * (m - 1)) - 2.0 * sxy / (n * m)
    return mmd2.to(x.dtype)
