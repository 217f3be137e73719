"""The core specification pooled the way the recorder pools: over each CFG half.

The statistics themselves are written once, in :mod:`nw_adapter.core.specification` (one plain
function per name of its table); this module only evaluates that table on one softmax of the
image branch and pools it per CFG half, so the fast path (:mod:`.fast`) is tested equal to the
specification on the same null draws and fit rows (tests/integration/test_stats_reference.py).
"""

from __future__ import annotations

import math

import torch

from nw_adapter.core.specification import SPECIFICATION, STAT_NAMES, NullDraws, Softmax, h_eff_reason_code

__all__ = ["SPECIFICATION", "Softmax", "pool_halves", "pool_reason_codes", "reference_statistics"]


def pool_halves(values: torch.Tensor, halves: int, per_query_row: bool) -> torch.Tensor:
    """Pool ``[B, H]`` (or ``[B, H, rows]``) values over the batch rows of each CFG half.

    Per batch row: the mean over the half's batch rows. Per query row: the mean over every
    query row of the half's batch rows, NaN (constant) rows left out. Returns ``[halves, H]``.
    """
    b, nh = values.shape[:2]
    grouped = values.reshape(halves, b // halves, nh, -1)
    if per_query_row:
        return grouped.transpose(1, 2).flatten(2).nanmean(-1)
    return grouped[..., 0].mean(1)


def pool_reason_codes(codes: torch.Tensor, halves: int) -> torch.Tensor:
    """``[B, H]`` reason codes -> ``[halves, H]``: the smallest non-zero code of the half's batch
    rows (its first reason in check order), 0 when every row is identified."""
    b, nh = codes.shape
    grouped = codes.reshape(halves, b // halves, nh).to(torch.float64)
    first = torch.where(grouped > 0, grouped, math.inf).amin(1)
    return torch.where(torch.isinf(first), 0.0, first)


def reference_statistics(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    h: torch.Tensor | float,
    draws: NullDraws | None = None,
    valid: torch.Tensor | None = None,
    halves: int = 1,
    readings: bool = True,
    fit_rows: int | None = 256,
    codes: bool = False,
    key_norm_weight: float = 0.0,
) -> torch.Tensor:
    """Every statistic of one softmax, pooled per CFG half: ``[S, halves, H]`` in STAT_NAMES order.

    Args:
        q: queries ``[B, H, N, d]`` (float64 for a float64 reference).
        k: image keys ``[B, H, M, d]``.
        scale: s, the softmax scale (a float, or ``[B, H]``).
        h: the NW bandwidth: a float, a 0-d or a ``[B, H]`` tensor.
        draws: the nulls' random numbers; None = the nulls are NaN.
        valid: optional bool ``[B, M]`` mask of the keys that take part.
        halves: 2 when the batch is [uncond; cond].
        readings: compute the readings (:data:`~nw_adapter.core.specification.READING_STATS`);
            False = NaN.
        fit_rows: evenly spaced query rows of the readings' bandwidth fit (None = all).
        codes: append the h_eff reason code row (the rows of
            :data:`~nw_adapter.core.specification.STAT_ROWS`; 0 with the readings off).
        key_norm_weight: c of the attention's scores ``q.k - c ||k||^2 / 2`` (1: a swapped head).

    Returns:
        ``[S, halves, H]`` (S + 1 rows with ``codes``) in the dtype of ``q``.
    """
    b, nh = q.shape[:2]
    k = k.to(q.dtype)
    h = torch.as_tensor(h, dtype=q.dtype, device=q.device).expand(b, nh)
    if isinstance(scale, torch.Tensor):
        scale = scale.to(q.dtype).expand(b, nh)
    mask = None if valid is None else valid[:, None, :]
    x = Softmax(q, k, scale, h, mask, draws, fit_rows, key_norm_weight)
    rows = []
    for statistic in SPECIFICATION.values():
        if (draws is None and statistic.needs_draws) or (not readings and statistic.reading):
            rows.append(torch.full((halves, nh), math.nan, dtype=q.dtype, device=q.device))
        else:
            rows.append(pool_halves(statistic.function(x), halves, statistic.per_query_row))
    assert len(rows) == len(STAT_NAMES)
    if codes:
        code = h_eff_reason_code(x) if readings else torch.zeros(b, nh, dtype=torch.long)
        rows.append(pool_reason_codes(code, halves).to(q.dtype))
    return torch.stack(rows)
