"""The statistics of one image-branch softmax (attention against NW weights).

Transitional entry point while the integration layer is redesigned (issue 18): the
implementation still lives in :mod:`nw_adapter.integration.processors.side`; callers import
from here, with the signature the redesigned folder keeps, so that the move does not touch
them again.
"""

from __future__ import annotations

import torch

from nw_adapter.integration.processors.side import (
    COMPILE_SECONDS,
    NullDraws,
    compiled_statistics,
    draw_nulls,
    full_precision_float32_matmuls,
    layer_statistics,
)

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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Statistics of A = softmax(q k^T * s) against the NW weights W at bandwidth ``h``.

    Args:
        q: queries ``[B, H, N, d]``; k: image keys ``[B, H, M, d]`` of one softmax.
        scale: s, the stock softmax scale. h: the NW bandwidth, a float or ``[B, H]`` tensor.
        draws: the nulls' random numbers (:func:`draw_nulls`), None = nulls recorded as NaN.
        valid: optional bool ``[B, M]`` mask of the keys that take part.
        halves: 2 when the batch is [uncond; cond]. compile: one torch.compile'd graph per shape.

    Returns:
        ``(stats [S, halves, H], A [B, H, N, M], W [B, H, N, M])``, stats in STAT_NAMES order.
    """
    function = compiled_statistics() if compile else layer_statistics
    if compile and not isinstance(h, torch.Tensor):
        h = torch.tensor(float(h), dtype=torch.float32, device=q.device)
    with full_precision_float32_matmuls():
        stats, weights = function(q, k, h, scale, valid, draws, halves)
    return stats, weights[0], weights[1]
