"""The statistics of one image-branch softmax: attention A against the NW weights W.

Layout of this folder (read in this order):

- the specification of every statistic, one plain function each, with the table of names and the
  nulls' random numbers (:class:`NullDraws`, :func:`draw_nulls`, drawn once and passed to both),
  lives in :mod:`nw_adapter.core.specification`; :mod:`.reference` pools it per CFG half and
  :mod:`.nulls` re-exports the draws;
- :mod:`.fast`: the optimised path (:func:`layer_statistics`), its column layout derived from
  one table of producers and tested equal to the reference (tests/integration/test_stats_reference.py);
- :mod:`.readings`: the fast readings pass (key prior against NW smoother, the bandwidth fit and
  its standard error), called by :mod:`.fast`;
- :mod:`.layout` (named columns, producer kinds), :mod:`.workspace` (eager / compiled writer),
  :mod:`.compiled` (the ``torch.compile`` wrapper), :mod:`.precision`.

Imports: torch and :mod:`nw_adapter.core` (the specification and its names table); nothing of
diffusers, the recorder or the processors.
"""

from __future__ import annotations

import torch

from nw_adapter.integration.stats.compiled import COMPILE_SECONDS, compiled_statistics
from nw_adapter.integration.stats.fast import layer_statistics
from nw_adapter.integration.stats.nulls import NullDraws, draw_nulls
from nw_adapter.integration.stats.precision import full_precision_float32_matmuls
from nw_adapter.integration.stats.workspace import EagerWriter, f32

__all__ = [
    "COMPILE_SECONDS",
    "NullDraws",
    "compiled_statistics",
    "draw_nulls",
    "full_precision_float32_matmuls",
    "layer_statistics",
    "softmax_statistics",
]


def softmax_statistics(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    h: torch.Tensor | float,
    draws: NullDraws | None = None,
    valid: torch.Tensor | None = None,
    halves: int = 1,
    compile: bool = False,
    readings: bool = True,
    fit_rows: int | None = 256,
    key_norm_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Statistics of A = softmax(s (q.k_i - c ||k_i||^2 / 2)) against the NW weights W at bandwidth ``h``.

    Args:
        q: queries ``[B, H, N, d]``; k: image keys ``[B, H, M, d]`` of one softmax.
        scale: s, the softmax scale (a float, or ``[B, H]``). h: the NW bandwidth, a float or
            ``[B, H]`` tensor.
        draws: the nulls' random numbers (:func:`draw_nulls`), None = nulls recorded as NaN.
        valid: optional bool ``[B, M]`` mask of the keys that take part.
        halves: 2 when the batch is [uncond; cond]. compile: one torch.compile'd graph per shape.
        readings: compute the readings (READING_STATS; False = NaN). fit_rows: the evenly
            spaced query rows their bandwidth fit uses (None = all).
        key_norm_weight: c; 0 for dot-product attention (the stock branch), 1 for the exact NW
            head at ``h^2 = 1/s`` (a swapped branch: A is then its own weights).

    Returns:
        ``(stats [S + 1, halves, H], A [B, H, N, M], W [B, H, N, M])``, stats in the order of
        :data:`~nw_adapter.core.specification.STAT_ROWS` (the statistics, then h_eff's reason code);
        A and W belong to this call (no later call overwrites them).

    Example:
        >>> q, k = torch.randn(2, 8, 64, 40), torch.randn(2, 8, 4, 40)
        >>> draws = draw_nulls(q, 4, 16, torch.Generator().manual_seed(0))
        >>> stats, A, W = softmax_statistics(q, k, scale=40**-0.5, h=40**0.25, draws=draws, halves=2)
        >>> stats.shape, A.shape
        (torch.Size([25, 2, 8]), torch.Size([2, 8, 64, 4]))
    """
    function = compiled_statistics() if compile else layer_statistics
    if compile and not isinstance(h, torch.Tensor):
        value = float(h)  # a 0-d tensor: one graph for every value of h (made once per value)
        h = EagerWriter().constant(("h", value, q.device), lambda: f32(value, q.device))
    with full_precision_float32_matmuls():
        stats, weights = function(q, k, h, scale, valid, draws, halves, readings, fit_rows, key_norm_weight)
    return stats, weights[0], weights[1]
