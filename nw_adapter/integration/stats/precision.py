"""Full-precision float32 matrix products for the statistics, whatever the user set."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def full_precision_float32_matmuls() -> Iterator[None]:
    """Float32 matrix products in full float32 precision inside the block, whatever the user set.

    With ``torch.backends.cuda.matmul.allow_tf32`` or ``set_float32_matmul_precision("high")``
    (common for fp16/TF32 inference) a float32 product rounds its inputs to 10-bit mantissas;
    the statistics' inner products (KL = a.l_A - a.l_W, the JS sum, the rank Gram) then cancel
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
