"""The fast path under :func:`torch.compile`: one graph per shape, timed, launches counted.

Compiled once per process (``dynamic=False``: dynamo specialises one graph per shape on first
use). On CUDA the graph runs under CUDA graphs (``mode="reduce-overhead"``): one replay instead
of one launch per kernel, the host cost that matters on a GPU; each call marks a new step
(:func:`torch.compiler.cudagraph_mark_step_begin`) and its outputs are cloned, since a replay
overwrites the graph's output buffers and the deferred statistics keep their results. If
compilation is unavailable (no C++/Triton toolchain, unsupported platform), one warning line
says so and the eager function is used; the results are the same within float32 tolerance
either way.
"""

from __future__ import annotations

import logging
import re
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from nw_adapter.integration.stats.fast import layer_statistics

_LOG = logging.getLogger(__name__)

COMPILE_SECONDS: dict[str, float] = {}
"""Seconds spent in the first call of each compiled layer shape (compilation + one run)."""

_COMPILED: dict[str, Any] = {}


def compiled_statistics() -> Callable[..., Any]:
    """:func:`~.fast.layer_statistics` under :func:`torch.compile` (one graph per layer shape).

    The compile time of each new shape is logged (logger ``nw_adapter.integration.stats.compiled``)
    and summed in :data:`COMPILE_SECONDS`; ``compiled_statistics().launches[shape key]`` holds the
    kernels one call of that shape's graph launches.
    """
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = CompiledStatistics()
    return _COMPILED["fn"]


def shape_key(q, k, valid, draws, halves, readings=True, fit_rows=256) -> tuple:  # noqa: ANN001 - as layer_statistics
    """The key of one compiled graph: the shapes and options dynamo specialises on."""
    shapes = (tuple(q.shape), tuple(k.shape), q.dtype, q.device)
    return (*shapes, valid is None, draws is None, halves, readings, fit_rows)


class CompiledStatistics:
    """Callable wrapper: torch.compile'd :func:`~.fast.layer_statistics` with timing and an eager fallback.

    Attributes:
        function: the compiled function (None after a fallback to eager).
        launches: ``{shape key: kernels one call launches}`` (fused kernels plus extern calls such
            as ``bmm`` and ``sort``), read from the generated code.
    """

    def __init__(self) -> None:
        self.function: Callable[..., Any] | None = torch.compile(layer_statistics, dynamic=False)
        self.graphed: Callable[..., Any] | None = None  # CUDA: made on the first CUDA call
        self.seen: set[tuple] = set()
        self.launches: dict[tuple, int] = {}

    def function_for(self, device: torch.device) -> Callable[..., Any] | None:
        """The compiled function for inputs on ``device``: under CUDA graphs on CUDA (None after
        a fallback to eager)."""
        if self.function is None or device.type != "cuda":
            return self.function
        if self.graphed is None:
            self.graphed = torch.compile(layer_statistics, dynamic=False, mode="reduce-overhead")
        return self.graphed

    def __call__(
        self, q, k, h, scale, valid, draws, halves, readings=True, fit_rows=256, key_norm_weight=0.0
    ):  # noqa: ANN001, ANN204, E501
        args = (
            q,
            k,
            h,
            scale,
            valid,
            draws,
            halves,
            readings,
            fit_rows,
            key_norm_weight,
        )  # as layer_statistics
        function = self.function_for(q.device)
        if function is None:
            return layer_statistics(*args)
        key = shape_key(q, k, valid, draws, halves, readings, fit_rows)
        first = key not in self.seen
        graphed = function is self.graphed
        start = time.perf_counter()
        try:
            if graphed:
                torch.compiler.cudagraph_mark_step_begin()
            if first:
                out, self.launches[key] = _run_and_count_launches(function, *args)
            else:
                out = function(*args)
            if graphed:  # the next replay overwrites the graph's output buffers
                out = tuple(tensor.clone() for tensor in out)
        except Exception as err:  # noqa: BLE001 - a backend failure falls back to eager
            out = layer_statistics(*args)  # a genuine error raises here
            message = str(err).splitlines()[0][:120] if str(err) else ""
            warnings.warn(
                f"NWProcessorConfig(compile=True): torch.compile is unavailable here ({type(err).__name__}: "
                f"{message}); the side computation runs eagerly (same statistics, more operations)",
                stacklevel=3,
            )
            self.function = self.graphed = None
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
