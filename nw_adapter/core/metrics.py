"""Comparison metrics for attention weights vs NW weights, and unbiased MMD^2 (THEORY.md 4-5).

Conventions: ``a`` (attention) and ``b`` (NW) are ``[..., n, m]`` rows (n query rows, m keys) of
LOGITS or any monotone transform of them for the rank statistics (rho, its nulls, top-1), and of
logits for the divergences: never float32 probabilities, whose underflowed zeros tie. A ``valid``
bool key mask leaves padding keys out of ranks, shuffles and divergences. Everything is torch,
batched over leading dims, computed in float32 (float64 for float64 inputs), and stays on the
input device (no host synchronisation). Correlations of a constant row are NaN and row means ignore NaN rows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nw_adapter.core.kernels import compute_dtype, no_autocast

__all__ = [
    "average_ranks",
    "centered_ranks",
    "js_from_logits",
    "kl_from_logits",
    "median_heuristic_sigma",
    "mmd2_unbiased",
    "norm_matched_null_rho",
    "pearson",
    "pearson_raveled",
    "permutation_null_rho",
    "qk_spread_null_rho",
    "qk_spread_ratio",
    "rank_sign_sums",
    "rowwise_spearman",
    "spearman_from_centered_ranks",
    "spearman_rho",
    "top1_agreement",
    "valid_permutation",
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


def _check_valid(valid: Tensor | None, like: Tensor) -> Tensor | None:
    """``valid`` as a bool tensor on ``like``'s device, broadcastable to ``like`` (or None)."""
    if valid is None:
        return None
    if not isinstance(valid, Tensor) or valid.dtype != torch.bool:
        raise ValueError("valid must be a bool tensor (True = the key takes part), broadcastable to [..., m]")
    if valid.shape[-1] != like.shape[-1]:
        raise ValueError(f"valid must end in the key dim {like.shape[-1]}, got shape {tuple(valid.shape)}")
    return valid.to(like.device)


def centered_ranks(x: Tensor, valid: Tensor | None = None) -> Tensor:
    """Average ranks minus their mean, along the last dim, over the valid entries only.

    ``r_i - (m' + 1)/2 = 1/2 sum_{j valid} sign(x_i - x_j)`` for a valid entry i (m' valid
    entries; ties get the average of their positions, as ``scipy.stats.rankdata``), 0 at invalid
    entries. Pairwise comparisons on the (small) key axis: O(m^2) memory per row, no sort, exact
    with ties, the same for any monotone transform of ``x`` (rank logits, never probabilities
    that underflow to tied zeros).

    Args:
        x: ``[..., m]`` scores (e.g. logits); finite where valid.
        valid: optional bool ``[..., m]`` (broadcastable), True = the entry takes part.

    Returns:
        ``[..., m]`` centred ranks, float32 (float64 for float64 input).
    """
    dtype = compute_dtype(x)
    x = x.to(dtype)
    return 0.5 * rank_sign_sums(x, _check_valid(valid, x))


SORT_RANKS_ABOVE = 8
"""Key counts above which :func:`rank_sign_sums` ranks by one sort instead of pairwise comparisons.

Pairwise comparisons cost O(m^2) per row (3 ops; cheapest for the base adapter's 4 keys); a sort
with tie runs costs O(m log m) (9 ops; about 3x faster on CPU for the Plus adapter's 16 keys).
"""


def rank_sign_sums(x: Tensor, valid: Tensor | None = None, *, out: Tensor | None = None) -> Tensor:
    """``sum_{j valid} sign(x_i - x_j)``: twice the centred average ranks (:func:`centered_ranks`).

    The factor 2 cancels in every correlation, so the processor uses this form. Up to
    :data:`SORT_RANKS_ABOVE` keys by pairwise comparisons; above, by one sort
    (:func:`_sorted_rank_sign_sums`; ties get the average of their positions, exactly as the
    comparisons).

    Args:
        x: ``[..., m]`` scores, finite where valid.
        valid: optional bool ``[..., m]`` (broadcastable).
        out: optional tensor of ``x``'s shape and dtype to write the result into.

    Returns:
        ``[..., m]``, 0 at invalid entries.
    """
    if x.shape[-1] > SORT_RANKS_ABOVE:
        return _sorted_rank_sign_sums(x, valid, out)
    sign = torch.sign(x[..., :, None] - x[..., None, :])  # [..., m, m]
    if valid is not None:
        sign = torch.where(valid[..., :, None] & valid[..., None, :], sign, 0.0)
    return sign.sum(-1) if out is None else torch.sum(sign, -1, out=out)


def _sorted_rank_sign_sums(x: Tensor, valid: Tensor | None, out: Tensor | None = None) -> Tensor:
    """:func:`rank_sign_sums` by one sort: each entry gets the mean of ``2 p - (m - 1)`` over the
    sorted positions p of its run of equal values.

    ``2 p - (m - 1)`` is the sign sum of the entry at sorted position p when it has no tie; a run
    of ties shares the mean over its positions, ``f + l - (m - 1)``, exactly as the pairwise
    comparisons. Runs are numbered by a cumulative sum of "differs from its left neighbour"
    (the first entry compared with the last one: equal only in a constant row, one run); one
    ``scatter_add`` sums positions and sizes per run. Invalid entries are sorted last (+inf);
    the valid ones are then recentred on their m' entries and invalid ones get 0.
    """
    m = x.shape[-1]
    if valid is not None:
        x = x.masked_fill(~valid, math.inf)
    values, order = x.sort(dim=-1)
    run = torch.ne(values, values.roll(1, -1)).cumsum(-1)  # [..., m] run index in 0..m
    sums = torch.zeros((*x.shape[:-1], 2, m + 1), device=x.device, dtype=x.dtype)
    sums.scatter_add_(-1, run[..., None, :].expand(*run.shape[:-1], 2, m), _position_signs(m, x))
    mean = sums[..., 0, :] / sums[..., 1, :]  # per run: mean of 2 p - (m - 1)
    out = torch.empty_like(x) if out is None else out
    out.scatter_(-1, order, mean.gather(-1, run))
    if valid is None:
        return out
    count = valid.expand(x.shape).sum(-1, keepdim=True)
    return out.add_(m - count).masked_fill_(~valid, 0.0)


_POSITION_SIGNS: dict[tuple, Tensor] = {}


def _position_signs(m: int, like: Tensor) -> Tensor:
    """``[2, m]``: ``2 p - (m - 1)`` for the sorted positions p, and ones (cached per m, device, dtype)."""
    key = (m, like.device, like.dtype)
    if key not in _POSITION_SIGNS:
        position = torch.arange(m, device=like.device, dtype=like.dtype)
        _POSITION_SIGNS[key] = torch.stack([2 * position - (m - 1), torch.ones_like(position)])
    return _POSITION_SIGNS[key].expand(*like.shape[:-1], 2, m)


def average_ranks(x: Tensor, valid: Tensor | None = None) -> Tensor:
    """1-based average ranks along the last dim among the valid entries (NaN at invalid ones).

    ``rank(x_i) = (#{j: x_j < x_i} + #{j: x_j <= x_i} + 1) / 2`` over valid j, as
    ``scipy.stats.rankdata`` of the valid entries.

    Args:
        x: ``[..., m]`` real tensor.
        valid: optional bool ``[..., m]`` (broadcastable).

    Returns:
        ``[..., m]`` ranks in float32 (float64 for float64 input).
    """
    dtype = compute_dtype(x)
    valid = _check_valid(valid, x)
    centred = centered_ranks(x, valid)
    if valid is None:
        return centred + (x.shape[-1] + 1) / 2
    count = valid.expand(centred.shape).sum(-1, keepdim=True).to(dtype)
    return torch.where(valid, centred + (count + 1) / 2, math.nan)


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


def spearman_from_centered_ranks(ra: Tensor, rb: Tensor) -> Tensor:
    """Spearman correlation ``sum r_a r_b / sqrt(sum r_a^2 sum r_b^2)`` from centred ranks.

    Args:
        ra: ``[..., m]`` centred ranks (:func:`centered_ranks`; invalid entries 0).
        rb: ``[..., m]`` centred ranks.

    Returns:
        ``[...]``; NaN (0/0) where either row is constant.
    """
    return (ra * rb).sum(-1) / torch.sqrt(ra.square().sum(-1) * rb.square().sum(-1))


def rowwise_spearman(a: Tensor, b: Tensor, valid: Tensor | None = None) -> Tensor:
    """Per-row Spearman correlation (Pearson of average ranks) over the valid keys of the last dim.

    Rank-based, so any monotone scores give the same value: pass logits (log-weights), never
    float32 probabilities (their underflowed zeros tie and make rho depend on the bandwidth).

    Args:
        a: ``[..., n, m]`` scores of the attention (e.g. ``q.k``).
        b: ``[..., n, m]`` scores of the NW weights (e.g. ``q.k - ||k||^2 / 2``).
        valid: optional bool ``[..., m]`` / ``[..., n, m]`` mask of the keys that take part
            (padding keys are left out of the ranks).

    Returns:
        ``[..., n]``; NaN for rows where either input is constant over its valid keys.
    """
    a, b = _pair(a, b)
    return spearman_from_centered_ranks(centered_ranks(a, valid), centered_ranks(b, valid))


def spearman_rho(a: Tensor, b: Tensor, valid: Tensor | None = None) -> Tensor:
    """The paper's rho: per-row Spearman averaged over the rows (NaN rows ignored).

    Args:
        a: ``[..., n, m]`` scores (logits or any monotone transform of them).
        b: ``[..., n, m]`` scores.
        valid: optional bool key mask (see :func:`rowwise_spearman`).

    Returns:
        ``[...]``; NaN if every row is NaN.
    """
    return torch.nanmean(rowwise_spearman(a, b, valid), dim=-1)


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


_MASKED_LOGIT = -1e20
"""Finite stand-in for the logit of a masked key: weight exactly 0, differences stay finite."""


def _log_probs(logits: Tensor) -> Tensor:
    """``log_softmax`` along the last dim, extended to infinite logits.

    A ``-inf`` logit is a key of probability 0 (the ``masked_fill`` convention). A ``+inf`` logit
    is the limit of a logit growing without bound: a row with ``+inf`` entries puts all its mass
    on them, shared equally (``log p = -log #{+inf}`` there, ``-inf`` elsewhere). A row of only
    ``-inf`` (no key) and a NaN logit give NaN.
    """
    pos_inf = torch.isposinf(logits)
    any_pos_inf = pos_inf.any(-1, keepdim=True)
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    limit = torch.where(pos_inf, zero, torch.full((), -math.inf, dtype=logits.dtype, device=logits.device))
    return torch.log_softmax(torch.where(any_pos_inf, limit, logits), dim=-1)


def _log_softmax_pair(logit_p: Tensor, logit_q: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor]:
    logit_p, logit_q = _pair(logit_p, logit_q, ("logit_p", "logit_q"))
    valid = _check_valid(valid, logit_p)
    if valid is not None:
        logit_p = logit_p.masked_fill(~valid, _MASKED_LOGIT)
        logit_q = logit_q.masked_fill(~valid, _MASKED_LOGIT)
    return _log_probs(logit_p), _log_probs(logit_q)


def _weighted_log_ratio(log_p: Tensor, log_q: Tensor) -> Tensor:
    """``p (log p - log q)`` with ``0 log(0 / q) = 0`` (also for ``q = 0``) and ``+inf`` for p > 0, q = 0."""
    p = log_p.exp()  # NaN (a row without keys) stays NaN
    return torch.where(p == 0, torch.zeros((), dtype=p.dtype, device=p.device), p * (log_p - log_q))


def kl_from_logits(logit_p: Tensor, logit_q: Tensor, valid: Tensor | None = None) -> Tensor:
    """``KL(p || q) = sum_i p_i (log p_i - log q_i)`` with ``log p = log_softmax(logit_p)``.

    Both log-probabilities come from their logits, so the divergence is finite for finite
    logits, even where ``q`` underflows to 0 in float32 (tiny bandwidths). Infinite logits are
    limits (:func:`_log_probs`): a ``-inf`` logit is a key of probability 0, whose term
    ``0 log(0 / q_i)`` is 0 (even where ``q_i = 0`` too); a row with ``+inf`` logits puts all its
    mass on those keys, shared equally. A key with ``p_i > 0`` and ``q_i = 0`` makes the
    divergence ``+inf``. A row without any key (all ``-inf``) or with a NaN logit gives NaN.

    Args:
        logit_p: ``[..., m]`` logits of p (e.g. ``s q.k``).
        logit_q: ``[..., m]`` logits of q (e.g. ``(q.k - ||k||^2 / 2) / h^2``).
        valid: optional bool ``[..., m]`` mask; invalid keys get weight 0 in both.

    Returns:
        ``[...]`` in nats.

    Example:
        >>> kl_from_logits(torch.tensor([0.0, -math.inf]), torch.tensor([0.0, 0.0]))  # log 2
        tensor(0.6931)
    """
    with no_autocast(logit_p.device):
        lp, lq = _log_softmax_pair(logit_p, logit_q, valid)
        return _weighted_log_ratio(lp, lq).sum(-1)


def js_from_logits(logit_p: Tensor, logit_q: Tensor, valid: Tensor | None = None) -> Tensor:
    """Jensen-Shannon divergence ``KL(p||r)/2 + KL(q||r)/2``, ``r = (p + q)/2``, from logits.

    ``log r = logaddexp(log p, log q) - log 2``; every term in log space (<= log 2 nats).
    Infinite logits as in :func:`kl_from_logits` (a zero-probability key adds nothing; disjoint
    supports give exactly ``log 2``).

    Args:
        logit_p: ``[..., m]``.
        logit_q: ``[..., m]``.
        valid: optional bool ``[..., m]`` key mask.

    Returns:
        ``[...]``.
    """
    with no_autocast(logit_p.device):
        lp, lq = _log_softmax_pair(logit_p, logit_q, valid)
        lr = torch.logaddexp(lp, lq) - math.log(2.0)
        return 0.5 * (_weighted_log_ratio(lp, lr) + _weighted_log_ratio(lq, lr)).sum(-1)


def top1_agreement(a: Tensor, b: Tensor, valid: Tensor | None = None) -> Tensor:
    """1.0 where ``argmax a == argmax b`` along the last dim (first index on ties), else 0.0.

    Args:
        a: ``[..., n, m]`` scores (logits).
        b: ``[..., n, m]`` scores.
        valid: optional bool key mask; invalid keys never win.

    Returns:
        ``[..., n]`` float32.
    """
    a, b = _pair(a, b)
    valid = _check_valid(valid, a)
    if valid is not None:
        a, b = a.masked_fill(~valid, -math.inf), b.masked_fill(~valid, -math.inf)
    return (a.argmax(-1) == b.argmax(-1)).to(torch.float32)


def valid_permutation(noise: Tensor, valid: Tensor | None = None) -> Tensor:
    """Index ``[..., m]`` of a uniformly random permutation per row that maps valid keys to valid keys.

    ``perm = argsort(noise)``; with a mask, the valid positions (in ascending order) receive the
    valid positions in the random order of ``noise`` (invalid ones receive invalid ones), so
    ``gather(x, -1, perm)`` shuffles the valid entries among themselves.

    Args:
        noise: ``[..., m]`` i.i.d. finite continuous values (uniform or normal).
        valid: optional bool ``[..., m]`` (broadcastable).

    Returns:
        ``[..., m]`` int64 index.
    """
    if valid is None:
        return noise.argsort(dim=-1)
    m = noise.shape[-1]
    order = noise.masked_fill(~valid, math.inf).argsort(dim=-1)  # random valid positions first
    position = torch.arange(m, device=noise.device)
    slots = torch.where(valid, position, position + m).argsort(dim=-1)  # valid positions, ascending
    return torch.scatter(order, -1, slots.expand_as(order), order)


def permutation_null_rho(
    a: Tensor, b: Tensor, valid: Tensor | None = None, *, generator: torch.Generator | None = None
) -> Tensor:
    """rho with the valid keys of ``b`` shuffled independently in every row (expected ~0).

    Args:
        a: ``[..., n, m]`` scores.
        b: ``[..., n, m]`` scores.
        valid: optional bool key mask (shuffles stay among valid keys; invalid ones are unranked).
        generator: optional torch.Generator on ``b``'s device, for reproducibility.

    Returns:
        ``[...]``.
    """
    a, b = _pair(a, b, min_dim=2)
    a, b = torch.broadcast_tensors(a, b)
    valid = _check_valid(valid, a)
    perm = valid_permutation(torch.rand(b.shape, device=b.device, generator=generator), valid)
    return spearman_rho(a, torch.gather(b, -1, perm), valid)


def _query_key(query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
    if not isinstance(query, Tensor) or not isinstance(key, Tensor) or query.dim() < 2 or key.dim() < 2:
        raise ValueError("query must be [..., n, d] and key [..., m, d] tensors")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must share the feature dim, got {query.shape[-1]}, {key.shape[-1]}")
    dtype = compute_dtype(query, key)
    return query.to(dtype), key.to(device=query.device, dtype=dtype)


def norm_matched_null_rho(
    query: Tensor, key: Tensor, valid: Tensor | None = None, *, generator: torch.Generator | None = None
) -> Tensor:
    """rho for queries of the same norms in uniformly random directions (the norm-matched null).

    ``q'_n = ||q_n|| z_n / ||z_n||``, ``z_n ~ N(0, I)``; then rho between the attention scores
    ``q'.k_i`` and the NW scores ``q'.k_i - ||k_i||^2 / 2`` (ranks do not depend on the softmax
    scale or on h). It controls ``||q||`` (rho rises with it even for random queries), not the
    spread of ``q.k`` across keys: random queries inside the span of the keys clear it.

    Args:
        query: ``[..., n, d]``.
        key: ``[..., m, d]``.
        valid: optional bool ``[..., m]`` key mask.
        generator: optional torch.Generator on ``query``'s device.

    Returns:
        ``[...]``.
    """
    q, k = _query_key(query, key)
    with no_autocast(q.device):
        z = torch.randn(q.shape, device=q.device, generator=generator, dtype=q.dtype)
        q_null = z * (q.norm(dim=-1, keepdim=True) / z.norm(dim=-1, keepdim=True))
        qk = q_null @ k.transpose(-1, -2)
        return spearman_rho(qk, qk - 0.5 * k.square().sum(-1)[..., None, :], valid)


def qk_spread_null_rho(
    query: Tensor, key: Tensor, valid: Tensor | None = None, *, generator: torch.Generator | None = None
) -> Tensor:
    """rho with each row's ``q.k`` values kept but their pairing with the key norms shuffled.

    A's scores are ``q.k_i``, W's are ``q.k_i - ||k_i||^2 / 2``: rho depends only on how much
    ``q.k`` varies across the keys against how much ``||k||^2 / 2`` does, and on how the two are
    paired. This null keeps both spreads and breaks the pairing: rho between ``q.k_i`` and
    ``q.k_i - ||k_pi(i)||^2 / 2`` with ``pi`` a random permutation of the valid keys per row
    (equivalently, the ``q.k`` values permuted across keys with ``||k||`` kept).

    Args:
        query: ``[..., n, d]``.
        key: ``[..., m, d]``.
        valid: optional bool ``[..., m]`` key mask.
        generator: optional torch.Generator on ``query``'s device.

    Returns:
        ``[...]``.
    """
    q, k = _query_key(query, key)
    with no_autocast(q.device):
        qk = q @ k.transpose(-1, -2)
        valid = _check_valid(valid, qk)
        perm = valid_permutation(torch.rand(qk.shape, device=q.device, generator=generator), valid)
        half_sq = 0.5 * k.square().sum(-1)[..., None, :].expand_as(qk)
        return spearman_rho(qk, qk - torch.gather(half_sq, -1, perm), valid)


def qk_spread_ratio(query: Tensor, key: Tensor, valid: Tensor | None = None) -> Tensor:
    """``mean_n std_i(q_n.k_i) / std_i(||k_i||^2 / 2)``: what rho is a function of.

    Population standard deviations (divide by the number of valid keys) over the valid keys.
    A large ratio means the key norms barely change the ranking and rho is near 1 for any
    query; ``inf`` when all key norms are equal (attention and NW weights then coincide).

    Args:
        query: ``[..., n, d]``.
        key: ``[..., m, d]``.
        valid: optional bool ``[..., m]`` key mask.

    Returns:
        ``[...]``.
    """
    q, k = _query_key(query, key)
    qk = q @ k.transpose(-1, -2)
    half_sq = 0.5 * k.square().sum(-1)
    valid = _check_valid(valid, qk)
    return (masked_std(qk, valid).mean(-1) / masked_std(half_sq, valid)).to(q.dtype)


def masked_std(x: Tensor, valid: Tensor | None = None) -> Tensor:
    """Population standard deviation over the last dim, over the valid entries only.

    Args:
        x: ``[..., m]``.
        valid: optional bool ``[..., m]`` (broadcastable).

    Returns:
        ``[...]``.
    """
    if valid is None:
        return x.std(dim=-1, correction=0)
    w = valid.to(x.dtype).expand(x.shape)
    count = w.sum(-1, keepdim=True)
    mean = (x * w).sum(-1, keepdim=True) / count
    return (((x - mean) * w).square().sum(-1, keepdim=True) / count).sqrt().squeeze(-1)


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
