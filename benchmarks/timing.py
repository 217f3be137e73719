"""Side-by-side timing: interleaved repeats, medians, spreads and ratios against a baseline.

Every variant of one measurement runs in the same process, on the same inputs, in a rotating
interleaved order (A B C, B C A, C A B, ...), so slow drifts of the machine (thermal, other
processes) hit all variants alike. Results are medians with the interquartile range and the
min/max of the repeats; ratios are ``median(variant) / median(baseline)``.

Both wall-clock time (``time.perf_counter``) and the process's CPU time (``time.process_time``,
all threads) are recorded. On a machine shared with other jobs the wall clock includes time
spent waiting for a core; the CPU time does not, so its ratio is the steadier of the two there.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


def quantiles(values: list[float]) -> dict[str, float]:
    """Median, first and third quartile, min and max of ``values`` (seconds)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        q1 = q3 = ordered[0]
    else:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return {
        "median": statistics.median(ordered),
        "q1": q1,
        "q3": q3,
        "min": ordered[0],
        "max": ordered[-1],
    }


def time_interleaved(
    variants: Mapping[str, Callable[[], Any]],
    *,
    repeats: int,
    warmup: int = 1,
    setup: Mapping[str, Callable[[], Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Time every variant ``repeats`` times, interleaved with a rotating order.

    Args:
        variants: name -> zero-argument callable (one timed unit of work).
        repeats: timed runs per variant (>= 1).
        warmup: untimed runs per variant before timing.
        setup: optional name -> callable run (untimed) right before each run of that variant,
            e.g. to install the variant's attention processors.

    Returns:
        name -> ``{"times": [...], "median", "q1", "q3", "min", "max", "cpu": {"times", "median",
        ...}}`` (seconds; top level = wall clock, ``"cpu"`` = process CPU time).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(variants)
    setup = setup or {}
    for _ in range(warmup):
        for name in names:
            if name in setup:
                setup[name]()
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as timeit: no collector pauses inside the timed calls
    try:
        for r in range(repeats):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                if name in setup:
                    setup[name]()
                start, start_cpu = time.perf_counter(), time.process_time()
                variants[name]()
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {
        name: {"times": t, **quantiles(t), "cpu": {"times": cpu[name], **quantiles(cpu[name])}}
        for name, t in times.items()
    }


def attributed_seconds(fn: Callable[[], Any], functions: Sequence[str]) -> dict[str, float]:
    """Cumulative CPU seconds spent inside the named Python functions during one call of ``fn``.

    Runs ``fn`` once under :mod:`cProfile` (process CPU-time clock) and sums the cumulative time
    of every profiled function whose name is in ``functions`` (e.g. the NW processor's
    ``_record``). Immune to the machine's load, unlike differences of two noisy medians; slightly
    pessimistic because profiling adds a little per Python call.

    Returns:
        ``{"total": seconds of the whole call, name: cumulative seconds, ...}``.
    """
    import cProfile
    import pstats

    profiler = cProfile.Profile(time.process_time)
    start = time.process_time()
    profiler.runcall(fn)
    out = {"total": time.process_time() - start}
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    for (_, _, name), (_, _, _, cumulative, _) in stats.items():
        if name in functions:
            out[name] = out.get(name, 0.0) + cumulative
    return out


def add_ratios(results: dict[str, dict[str, Any]], baseline: str) -> dict[str, dict[str, Any]]:
    """Add ``ratio`` = median / baseline median to every entry of ``results`` (in place).

    Entries with a ``"cpu"`` sub-dict get a ``ratio`` there too (CPU-time medians).
    """
    for level in (lambda e: e, lambda e: e.get("cpu")):
        base = level(results[baseline])
        if base is None:
            continue
        for entry in results.values():
            target = level(entry)
            target["ratio"] = target["median"] / base["median"] if base["median"] > 0 else float("nan")
    return results


def machine_info() -> dict[str, Any]:
    """The machine and software versions the numbers were measured with."""
    import diffusers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "python": platform.python_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average_at_start": list(load),
    }


def fmt_ms(seconds: float) -> str:
    """Seconds as milliseconds with 4 significant digits."""
    return f"{seconds * 1e3:.4g}"
