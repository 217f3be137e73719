"""The statistics of one image-branch softmax (attention against NW weights).

Transitional entry point while the integration layer is redesigned (issue 18): the
implementation still lives in :mod:`nw_adapter.integration.processors.side`; callers import
from here so that the move does not touch them again.
"""

from nw_adapter.integration.processors.side import (
    COMPILE_SECONDS,
    NullDraws,
    compiled_statistics,
    draw_nulls,
    full_precision_float32_matmuls,
    layer_statistics,
    softmax_statistics,
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
