"""The side computation shared by every NW processor family (UNet today; SD3 and Flux next).

Given the queries and the image keys of ONE softmax of an IP-Adapter image branch, exactly as
the stock processor forms them, this module computes the attention weights
A = softmax(q k^T * s), the Nadaraya-Watson weights W = softmax(-||q - k||^2 / 2h^2) at the
configured bandwidth h, and reduces their comparison over query rows to one statistics tensor
``[S, halves, H]`` (S = ``len(STAT_NAMES)``, CFG halves, H heads). Everything is computed from
one stacked tensor of logits with one rank pass (:func:`layer_statistics`), optionally as one
``torch.compile``'d graph per layer shape (``compile=True``). The family modules only find q,
k and an optional valid-key mask in their layer (hooks, head split, masks, adapters) and hand
the result to the recorder.

Imports: torch, the math layer (:mod:`nw_adapter.core`) and the integration's config/recorder
state; nothing of diffusers, so one implementation serves every model family.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from nw_adapter.core import metrics
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.schema import STAT_NAMES

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class NullDraws:
    """The random numbers of the nulls of one softmax, drawn in eager mode from the seeded generator.

    Attributes:
        rows: ``[n0]`` int64 query rows the nulls are estimated on.
        noise: ``[B, H, n0, M]`` i.i.d. normal values: one key permutation per row (their argsort).
        directions: ``[B, H, n0, d]`` standard normal values: the norm-matched queries' directions.
    """

    rows: torch.Tensor
    noise: torch.Tensor
    directions: torch.Tensor


def draw_nulls(
    q: torch.Tensor, num_keys: int, null_rows: int | None, generator: torch.Generator
) -> NullDraws:
    """Draw the nulls' random numbers for queries ``q`` ``[B, H, N, d]`` and ``num_keys`` keys.

    ``null_rows`` rows out of N are drawn without replacement (all N, in random order, when
    None or >= N), then one normal tensor ``[B, H, n0, M + d]`` gives the permutation noise
    (the argsort of i.i.d. continuous values is a uniform permutation) and the directions:
    2 random-number ops per softmax, outside any compiled region.
    """
    b, nh, n, d = q.shape
    n0 = n if null_rows is None else min(n, null_rows)
    rows = torch.randperm(n, generator=generator, device=q.device)[:n0]
    gauss = torch.randn((b, nh, n0, num_keys + d), generator=generator, device=q.device)
    return NullDraws(rows, gauss[..., :num_keys], gauss[..., num_keys:])


def layer_statistics(
    q: torch.Tensor,
    k: torch.Tensor,
    h: torch.Tensor | float,
    scale: float,
    valid: torch.Tensor | None = None,
    draws: NullDraws | None = None,
    halves: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All statistics of one softmax of the image branch, from one stacked tensor of logits.

    Three passes, each over one tensor (THEORY.md section 4 for the statistics):

    1. **Pairs** ``P [B, H, R, 2, M]`` of (attention, NW) scores, one row per compared pair of
       key rankings: ``(q.k_i, q.k_i - ||k_i||^2 / 2)`` (the NW weights' ranks at any h) for
       the N observed query rows and the n0 norm-matched queries ``q' = ||q|| z / ||z||`` (one
       matrix product of the stacked queries ``[q; q']`` with the keys, one ``addcmul``), then,
       for the n0 null rows r, the q.k-spread null ``(q.k_i, q.k_i - ||k_pi(i)||^2 / 2)`` and
       the permutation null ``(q.k_pi(i), q.k_i - ||k_i||^2 / 2)`` written into the same
       buffer (R = N + 3 n0).
    2. **Ranks** of every row at once (:func:`~nw_adapter.core.metrics.rank_sign_sums`), their
       per-row 2 x 2 Gram matrix ``G`` (one batched product), per row
       ``(rho_r, c_r) = (G_01 / sqrt(G_00 G_11), 1)`` (``(0, 0)`` for a constant row, left
       out), and one product with a cached pooling matrix that sums both over the rows of each
       segment (observed, each null) and the batch rows of each CFG half:
       ``rho = sum rho_r / sum c_r``.
    3. **Divergences** of the observed rows: log-weights ``l = x - logsumexp(x)`` of the
       scaled logits ``x = [s q.k, (q.k - ||k||^2 / 2) / h^2]``, weights ``(a, b) = exp(l)``,
       the centred weights ``c = w - 1/M`` and ``d = l - logaddexp(l_A, l_W)`` stacked as
       ``Z [B, H, N, 6, M]`` (rows a, b, c_A, c_B, d_A, d_W); one batched product
       ``Z[:4] Z^T`` gives per row every inner product the statistics need: KL(A || W) =
       a.d_A - a.d_W, 2 JS - 2 log 2 = a.d_A + b.d_W, n_eff = 1 / a.a, the Pearson moments
       c_A.c_B, c_A.c_A, c_B.c_B. One matrix product with a cached ``[N * 29, 12]`` matrix
       averages them over the rows and combines them. Pearson (over all rows and keys of a
       (batch row, head)), the key-norm CV and the q.k spread ratio follow per (batch row,
       head); one ``addcmul`` applies the constant gains and offsets (JS = js_sum / 2 + log 2,
       the bandwidth, NaN nulls). (4 x 6 x M stays under CPU ``bmm``'s 400-element per-matrix
       limit of its fast kernel up to M = 16, the Plus adapter's keys.)

    Intermediate tensors are written with ``out=`` into per-thread workspace buffers (one set
    per layer shape, :func:`_workspace`) instead of being concatenated, so one call of the
    SD 1.5 layer dispatches 46 aten operations (48 with the 2 draws of
    :func:`draw_nulls`, ``benchmarks/op_count.py``). No random
    numbers and no host reads: :func:`torch.compile` can fuse it per layer shape.

    Args:
        q: queries ``[B, H, N, d]`` (any float dtype; copied to float32).
        k: image keys ``[B, H, M, d]``.
        h: NW bandwidth, a float or a ``[B, H]`` (or 0-d) tensor.
        scale: the stock softmax scale s.
        valid: optional bool ``[B, M]`` mask of the keys that take part (padding keys: False).
        draws: the nulls' random numbers (:func:`draw_nulls`); None = nulls recorded as NaN.
        halves: 2 when the batch is [uncond; cond]: rho and its nulls are pooled over the query
            rows of each half's batch rows (constant rows left out), the other statistics
            averaged over them.

    Returns:
        ``(stats [S, halves, H], weights [2, B, H, N, M])``: the statistics in the order of
        :data:`~nw_adapter.integration.schema.STAT_NAMES`, and A, W. The weights are views of
        a workspace buffer, valid until the next call with the same shapes on this thread
        (the processors hand them to :func:`store_maps` at once, which copies what it keeps).
    """
    b, nh, n, d = q.shape
    m = k.shape[-2]
    n0 = 0 if draws is None else draws.rows.shape[0]
    segments = 1 if draws is None else 4
    rows_total = n + 3 * n0
    device = q.device
    valid5 = None if valid is None else valid[:, None, None, None, :]  # [B, 1, 1, 1, M]

    # keys: ||k||, ||k||^2 and their spreads
    k = k.to(torch.float32, memory_format=torch.contiguous_format)
    powers = _cached(("norm powers", device), lambda: _f32([[[[1.0]]], [[[2.0]]]], device))
    norms = torch.pow(torch.linalg.vector_norm(k, dim=-1), powers)  # [2, B, H, M]
    norm_std, norm_mean = _masked_std_mean(norms, valid)  # [2, B, H] each: (||k||, ||k||^2)
    sq = norms[1]  # [B, H, M]

    # 1. pairs [B, H, R, 2, M]: observed and norm-matched rows from one product, then the nulls
    feats = _workspace("row features", (b, nh, n, _ROW_FEATURES), device)
    queries = _workspace("queries", (b, nh, n + n0, d), device)
    queries[:, :, :n].copy_(q)
    q_norm = _write(feats[..., _F_QNORM], torch.linalg.vector_norm, queries[:, :, :n], dim=-1)
    if draws is not None:
        ratio = q_norm.index_select(-1, draws.rows) / torch.linalg.vector_norm(draws.directions, dim=-1)
        _write(queries[:, :, n:], torch.mul, draws.directions, ratio[..., None])
    logits = queries @ k.transpose(-1, -2)  # [B, H, N + n0, M]
    pairs = _workspace("pairs", (b, nh, rows_total, 2, m), device)
    shift = _cached(("pair shift", device), lambda: _f32([[0.0], [-0.5]], device))
    _write(pairs[:, :, : n + n0], torch.addcmul, logits[..., None, :], shift, sq[..., None, None, :])
    if draws is not None:
        # per null row r: slots (q.k_r, q.k_r - ||k_pi||^2/2 | q.k_r o pi, q.k_r - ||k||^2/2)
        tail = pairs[:, :, n + n0 :].view(b, nh, n0, 4, m)
        _write(tail[..., 0::3, :], torch.index_select, pairs[:, :, :n], 2, draws.rows)
        perm = metrics.valid_permutation(draws.noise, None if valid is None else valid[:, None, None, :])
        _write(tail[..., 2, :], torch.gather, tail[..., 0, :], -1, perm)
        shuffled = torch.gather(sq[..., None, :].expand(b, nh, n0, m), -1, perm)
        _write(tail[..., 1, :], torch.sub, tail[..., 0, :], shuffled, alpha=0.5)

    # 2. ranks, per-row Spearman, pooled per segment and CFG half
    ranks = _workspace("ranks", (b, nh, rows_total, 2, m), device)
    ranks = metrics.rank_sign_sums(pairs, valid5, out=None if torch.compiler.is_compiling() else ranks)
    gram = _workspace("rank gram", (b, nh, rows_total, 5), device)  # G_00, G_01, G_10, G_11, G_00 G_11
    _write_products(gram[..., :4].unflatten(-1, (2, 2)), ranks, ranks)
    _write(gram[..., 4], torch.prod, gram[..., 0:4:3], -1)  # integers: 0 = a constant row
    num_den = gram[..., 1:5:3]  # [B, H, R, 2]: (G_01, G_00 G_11)
    powers = _cached(("rho powers", device), lambda: _f32([0.5, 1.0], device))
    per_row = _workspace("rho rows", (nh, b, rows_total, 2), device)  # head-major: one pooling product
    _write(per_row.permute(1, 0, 2, 3), torch.div, num_den, num_den[..., 1:].clamp_min(0.5).pow(powers))
    pool = _pool_matrix(b, halves, n, n0, device)  # [B * R, halves * segments]
    rho_sums = pool.T @ per_row.view(nh, b * rows_total, 2)  # [H, halves * segments, 2]: (sum rho_r, rows)

    # 3. divergences, n_eff, top-1, Pearson of the observed rows
    observed = pairs[:, :, :n]  # [B, H, N, 2, M]
    if valid5 is not None:
        observed = observed.masked_fill(~valid5, _MASKED_LOGIT)
    z = _workspace("weights", (b, nh, n, 6, m), device)  # rows a, b, a - 1/M, b - 1/M, l_A - lae, l_W - lae
    log_w = _write(z[..., 4:, :], torch.mul, observed, _logit_coefficients(scale, h, device))
    log_w.sub_(torch.logsumexp(log_w, -1, keepdim=True))
    w = _write(z[..., 0:2, :], torch.exp, log_w)
    log_w.sub_(torch.logaddexp(log_w[..., 0:1, :], log_w[..., 1:, :]))  # log(a / (a + b)), log(b / (a + b))
    if valid is None:
        _write(z[..., 2:4, :], torch.sub, w, 1.0 / m)
    else:
        weight = valid5.to(torch.float32)
        _write(z[..., 2:4, :], torch.sub, w, weight / weight.sum(-1, keepdim=True)).mul_(weight)
    top1 = observed.argmax(-1)  # [B, H, N, 2]
    _write(feats[..., _F_TOP1], torch.eq, top1[..., 0], top1[..., 1])
    z3 = z.view(b * nh * n, 6, m)
    products = feats.view(b * nh * n, _ROW_FEATURES)[:, : 4 * 6].view(-1, 4, 6)
    _write_products(products, z3[:, :4], z3)
    _write(feats[..., _F_NEFF], torch.reciprocal, feats[..., 0:8:7])  # 1 / a.a, 1 / b.b
    if valid is None:
        _write(feats[..., _F_QKSTD], torch.std, pairs[:, :, :n, 0], -1, correction=0)
    else:
        feats[..., _F_QKSTD].copy_(metrics.masked_std(pairs[:, :, :n, 0], valid[:, None, None, :]))
    tensor_h = isinstance(h, torch.Tensor)
    # a float h: the h column is never written and stays 0 (its gain is 0, its offset h); its own
    # workspace, so that a tensor h (even NaN) of an earlier call of this shape cannot leak into it
    name = "head statistics, tensor h" if tensor_h else "head statistics"
    head = _workspace(name, (b, nh, _HEAD_COLUMNS), device, zero=True)
    _write_products(
        head.view(b * nh, 1, -1)[..., _V_KL:], feats.view(b * nh, 1, -1), _row_mean_matrix(n, device).T
    )
    moments = head[..., _V_PCA] * head[..., _V_PCB]
    _write(head[..., _V_PEARSON], torch.mul, head[..., _V_PCC], torch.rsqrt(moments))  # Pearson of A and W
    _write(head[..., _V_CV], torch.div, norm_std[0], norm_mean[0])
    _write(head[..., _V_RATIO], torch.div, head[..., _V_QKSTD], norm_std[1])
    if tensor_h:
        head[..., _V_H].copy_(h.expand(b, nh))
    if b != halves:
        head = head.view(halves, b // halves, nh, -1).mean(1)
    gain, offset = _affine(None if tensor_h else float(h), draws is not None, device)
    out = torch.addcmul(offset, head.view(halves, nh, -1), gain)  # [halves, H, columns]
    rho_sums = rho_sums.view(nh, halves, segments, 2).transpose(0, 1)
    _write(out[..., 1 : 1 + segments], torch.div, rho_sums[..., 0], rho_sums[..., 1])
    return out[..., : len(STAT_NAMES)].permute(2, 0, 1), w.movedim(-2, 0)


_MASKED_LOGIT = -1e20
"""Finite logit of a padding key: weight exactly 0, log-weight differences stay finite."""

# Columns of the per-row features ``[B, H, N, 29]`` (pass 3): the 4 x 6 inner products of the rows
# (a, b, c_A, c_B) of Z with all its rows (a, b, c_A, c_B, d_A, d_W), then:
_F_NEFF = slice(24, 26)  # 1 / a.a, 1 / b.b
_F_TOP1 = 26  # argmax_i a_i == argmax_i b_i
_F_QNORM = 27  # ||q||
_F_QKSTD = 28  # std_i q.k_i
_ROW_FEATURES = 29

# Columns of the per-(batch row, head) statistics ``[B, H, 18]``: STAT_NAMES, then the row means
# that the nonlinear statistics need (std q.k, the three Pearson moments).
_V_H, _V_PEARSON, _V_KL, _V_CV, _V_RATIO = 0, 5, 6, 12, 13
_V_QKSTD, _V_PCC, _V_PCA, _V_PCB = 14, 15, 16, 17
_HEAD_COLUMNS = 18

_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _cached(key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A constant tensor made once per key (no host-to-device copy after the first layer call)."""
    if torch.compiler.is_compiling():
        return make()
    if key not in _CONSTANTS:
        if len(_CONSTANTS) > 256:
            _CONSTANTS.clear()
        _CONSTANTS[key] = make()
    return _CONSTANTS[key]


_WORKSPACE = threading.local()


def _f32(values: Any, device: torch.device | None) -> torch.Tensor:
    """A float32 constant (never the default dtype, which a user may have changed)."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def _workspace(name: str, shape: tuple[int, ...], device: torch.device, zero: bool = False) -> torch.Tensor:
    """A float32 scratch tensor of ``shape``, reused by every call with that shape on this thread.

    The side computation writes its intermediate tensors into slices of these (``out=``) rather
    than concatenating them: one operation fewer per stacked tensor, and no allocation per layer.
    ``zero``: filled with zeros when made (columns that are never written stay 0). Under
    :func:`torch.compile` a fresh tensor (the compiler plans its own buffers).
    """
    if torch.compiler.is_compiling():
        return (torch.zeros if zero else torch.empty)(shape, dtype=torch.float32, device=device)
    buffers = _WORKSPACE.__dict__.setdefault("buffers", {})
    key = (name, shape, device)
    if key not in buffers:
        if len(buffers) > 64:
            buffers.clear()
        buffers[key] = (torch.zeros if zero else torch.empty)(shape, dtype=torch.float32, device=device)
    return buffers[key]


def _write(out: torch.Tensor, op: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    """``op(*args, **kwargs, out=out)``: the result written into ``out`` (a slice of a workspace).

    Under :func:`torch.compile` ``out.copy_(op(...))`` instead: dynamo does not trace ``out=``
    into views, and inductor fuses the copy into the producing kernel.
    """
    if torch.compiler.is_compiling():
        return out.copy_(op(*args, **kwargs))
    return op(*args, **kwargs, out=out)


def _write_products(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``out = x y^T`` for ``x [..., P, K]``, ``y [..., Q, K]`` (``out [..., P, Q]``), small P and Q.

    Eager: one (batched) matrix product. Under :func:`torch.compile`: the broadcast product
    summed over K, ``sum_k x[..., p, k] y[..., q, k]``, which inductor fuses with the kernels
    around it; a matrix product is an extern kernel it cannot fuse, one more launch per call.
    """
    if torch.compiler.is_compiling():
        return out.copy_((x[..., :, None, :] * y[..., None, :, :]).sum(-1))
    return torch.matmul(x, y.transpose(-1, -2), out=out)


def _pool_matrix(batch: int, halves: int, n: int, n0: int, device: torch.device) -> torch.Tensor:
    """``[B * R, halves * segments]`` 0/1 matrix: row r of batch row b -> (CFG half of b, segment of r).

    Segments in STAT_NAMES order: 0 observed (rows < N), 1 permutation null, 2 norm-matched null
    (rows N .. N + n0), 3 q.k-spread null; the last 2 n0 rows alternate spread, permutation.
    """

    def make() -> torch.Tensor:
        segments = 1 if n0 == 0 else 4
        r = torch.arange(n + 3 * n0, device=device)
        tail = r - (n + n0)
        seg = torch.where(r < n, 0, torch.where(r < n + n0, 2, torch.where(tail % 2 == 0, 3, 1)))
        half = torch.arange(batch, device=device) // (batch // halves)
        column = (half[:, None] * segments + seg[None, :]).reshape(-1)
        return (column[:, None] == torch.arange(halves * segments, device=device)).float()

    return _cached(("pool", batch, halves, n, n0, device), make)


def _row_mean_matrix(n: int, device: torch.device) -> torch.Tensor:
    """``[N * 29, 12]``: the per-row features of N rows -> their means combined into columns 6..17
    of the per-head statistics (KL, js_sum, n_eff A and W, top-1, ||q||, two zero columns for the
    CV and the spread ratio, std q.k, c_A.c_B, c_A.c_A, c_B.c_B)."""

    def make() -> torch.Tensor:
        def p(i: int, j: int) -> int:  # column of the inner product of Z rows i and j
            return 6 * i + j

        w = torch.zeros(_ROW_FEATURES, _HEAD_COLUMNS - _V_KL, dtype=torch.float32)
        for col, terms in enumerate(
            [
                {p(0, 4): 1, p(0, 5): -1},  # KL(A || W) = a.l_A - a.l_W = a.d_A - a.d_W
                {p(0, 4): 1, p(1, 5): 1},  # js_sum = a.d_A + b.d_W
                {_F_NEFF.start: 1},  # n_eff of A
                {_F_NEFF.start + 1: 1},  # n_eff of W
                {_F_TOP1: 1},
                {_F_QNORM: 1},
                {},
                {},
                {_F_QKSTD: 1},
                {p(2, 3): 1},
                {p(2, 2): 1},
                {p(3, 3): 1},
            ]
        ):
            for row, value in terms.items():
                w[row, col] = value
        return (w / n).repeat(n, 1).to(device)

    return _cached(("row mean", n, device), make)


def _affine(h: float | None, nulls: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gain, offset)`` ``[18]`` of the final ``addcmul``: the bandwidth (a float h is an offset,
    a tensor h a column), NaN nulls when not drawn, JS = js_sum / 2 + log 2, ratio = std q.k /
    (std ||k||^2 / 2); rho and its nulls (written afterwards) and the helper columns get gain 0."""

    def make() -> torch.Tensor:
        gain, offset = _f32([1.0] * _HEAD_COLUMNS, None), _f32([0.0] * _HEAD_COLUMNS, None)
        gain[_V_H] = 1.0 if h is None else 0.0
        offset[_V_H] = 0.0 if h is None else h
        gain[1:5] = 0.0
        if not nulls:
            offset[2:5] = math.nan
        gain[_V_KL + 1], offset[_V_KL + 1] = 0.5, math.log(2.0)
        gain[_V_RATIO] = 2.0
        gain[_V_QKSTD:] = 0.0
        return torch.stack([gain, offset]).to(device)

    return _cached(("affine", h, nulls, device), make).unbind(0)


def _logit_coefficients(scale: float, h: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """Multipliers ``[2, 1]`` (``[B, H, 1, 2, 1]`` for a ``[B, H]`` h) of the pairs: s and 1/h^2."""
    if isinstance(h, torch.Tensor):
        inv_h2 = h.float().reciprocal().square()  # [] or [B, H]
        coef = torch.stack([torch.full_like(inv_h2, scale), inv_h2], -1)
        return coef.view(2, 1) if inv_h2.dim() == 0 else coef.view(*inv_h2.shape, 1, 2, 1)
    return _cached(
        ("coef", scale, float(h), device), lambda: _f32([[scale], [float(h) ** -2]], device)
    )


def _masked_std_mean(x: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Population std and mean over the last dim of ``x`` ``[..., B, H, M]`` (valid keys ``[B, M]`` only)."""
    if valid is None:
        return torch.std_mean(x, dim=-1, correction=0)
    weight = valid[:, None, :].to(x.dtype)
    mean = (x * weight).sum(-1) / weight.sum(-1)
    return metrics.masked_std(x, valid[:, None, :]), mean


def softmax_statistics(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    bandwidth: Callable[[torch.Tensor | None], torch.Tensor | float],
    config: NWProcessorConfig,
    generator: torch.Generator | None,
    valid: torch.Tensor | None = None,
    halves: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Statistics of A = softmax(q k^T * s) against the NW weights W, per (batch row, head).

    Resolves h, draws the nulls' random numbers (eager) and runs :func:`layer_statistics`,
    compiled per layer shape when ``config.compile`` is set (see :func:`compiled_statistics`).

    Args:
        q: queries ``[B, H, N, d]``.
        k: image keys ``[B, H, M, d]`` of one softmax.
        scale: s, the stock softmax scale.
        bandwidth: ``A or None -> h`` (a float or ``[B, H]``), see :func:`resolve_bandwidth`
            (called with None: the data-dependent rules form A themselves).
        config: ``nulls``, ``null_rows`` and ``compile`` are read.
        generator: the seeded generator of the nulls (``None`` when ``config.nulls`` is off).
        valid: optional bool ``[B, M]`` mask of the keys that take part.
        halves: 2 when the batch is [uncond; cond] (statistics averaged within each half).

    Returns:
        ``(stats [S, halves, H], A [B, H, N, M], W [B, H, N, M])`` with the rows of ``stats``
        in the order of :data:`~nw_adapter.integration.schema.STAT_NAMES`.
    """
    h = bandwidth(None)
    draws = None
    if config.nulls and generator is not None:
        draws = draw_nulls(q, k.shape[-2], config.null_rows, generator)
    function = compiled_statistics() if config.compile else layer_statistics
    if function is not layer_statistics and not isinstance(h, torch.Tensor):
        value = float(h)  # a 0-d tensor: one graph for every value of h (made once per value)
        h = _cached(("h", value, q.device), lambda: _f32(value, q.device))
    with full_precision_float32_matmuls():
        stats, weights = function(q, k, h, scale, valid, draws, halves)
    return stats, weights[0], weights[1]


@contextlib.contextmanager
def full_precision_float32_matmuls() -> Iterator[None]:
    """Float32 matrix products in full float32 precision inside the block, whatever the user set.

    With ``torch.backends.cuda.matmul.allow_tf32`` or ``set_float32_matmul_precision("high")``
    (common for fp16/TF32 inference) a float32 product rounds its inputs to 10-bit mantissas;
    the statistics' inner products (KL = a.d_A - a.d_W, the JS sum, the rank Gram) then cancel
    to errors of about 1e-3. The previous setting is restored on exit, exceptions included.
    """
    previous = torch.get_float32_matmul_precision()
    if previous == "highest":
        yield
        return
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


_COMPILED: dict[str, Any] = {}


def compiled_statistics() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """:func:`layer_statistics` under :func:`torch.compile` (one graph per layer shape), or eager.

    Compiled once per process (``dynamic=False``: dynamo specialises one graph per layer shape on
    first use). If compilation is unavailable (no C++/Triton toolchain, unsupported platform), one
    warning line says so and the eager function is used; the results are the same within float32
    tolerance either way. The compile time of each new shape is logged (logger
    ``nw_adapter.integration.processors.side``) and summed in :data:`COMPILE_SECONDS`.
    """
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = _CompiledStatistics()
    return _COMPILED["fn"]


COMPILE_SECONDS: dict[str, float] = {}
"""Seconds spent in the first call of each compiled layer shape (compilation + one run)."""


class _CompiledStatistics:
    """Callable wrapper: torch.compile'd :func:`layer_statistics` with timing and an eager fallback.

    ``launches[shape key]`` holds the kernels one call of that shape's graph launches (fused
    kernels plus extern calls such as ``bmm`` and ``sort``), read from the generated code.
    """

    def __init__(self) -> None:
        self.function: Callable[..., Any] | None = torch.compile(layer_statistics, dynamic=False)
        self.seen: set[tuple] = set()
        self.launches: dict[tuple, int] = {}

    def __call__(self, q, k, h, scale, valid, draws, halves):  # noqa: ANN001, ANN204 - as layer_statistics
        if self.function is None:
            return layer_statistics(q, k, h, scale, valid, draws, halves)
        key = (tuple(q.shape), tuple(k.shape), q.dtype, q.device, valid is None, draws is None, halves)
        first = key not in self.seen
        start = time.perf_counter()
        try:
            if first:
                out, launches = _run_and_count_launches(self.function, q, k, h, scale, valid, draws, halves)
                self.launches[key] = launches
            else:
                out = self.function(q, k, h, scale, valid, draws, halves)
        except Exception as err:  # noqa: BLE001 - a backend failure falls back to eager
            out = layer_statistics(q, k, h, scale, valid, draws, halves)  # a genuine error raises here
            message = str(err).splitlines()[0][:120] if str(err) else ""
            warnings.warn(
                f"NWProcessorConfig(compile=True): torch.compile is unavailable here ({type(err).__name__}: "
                f"{message}); the side computation runs eagerly (same statistics, more operations)",
                stacklevel=3,
            )
            self.function = None
            return out
        if first:
            self.seen.add(key)
            seconds = time.perf_counter() - start
            COMPILE_SECONDS[str(key[:2])] = seconds
            _LOG.info("compiled the NW side computation for q %s, k %s in %.1f s", key[0], key[1], seconds)
        return out


_LAUNCH = re.compile(
    r"^\s+(?:\w+ = )?(cpp_fused_\w+\(|triton_\w+\.run\(|extern_kernels\.\w+\(|aten\.|torch\.ops\.)"
)
"""A line of inductor's wrapper ``call`` that launches a kernel (fused, extern or aten fallback)."""


def _run_and_count_launches(function: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """Run a compiled function for the first time and count the kernel launches in its generated code."""
    try:
        from torch._inductor.utils import run_and_get_code
    except ImportError:  # pragma: no cover - older torch: no count
        return function(*args), -1
    out, codes = run_and_get_code(function, *args)
    launches = 0
    for code in codes:
        body = code.split("def call(", 1)[-1].split("\ndef ", 1)[0]
        launches += sum(1 for line in body.splitlines() if _LAUNCH.match(line))
    return out, launches
