"""Side-by-side timing: interleaved repeats, medians, spreads and ratios against a baseline.

Every variant of one measurement runs in the same process, on the same inputs, in a rotating
interleaved order (A B C, B C A, C A B, ...), so slow drifts of the machine (thermal, other
processes) hit all variants alike. Results are medians with the interquartile range and the
min/max of the repeats; ratios are ``median(variant) / median(baseline)``.

Both wall-clock time (``time.perf_counter``) and the process's CPU time (``time.process_time``,
all threads) are recorded. On a machine shared with other jobs the wall clock includes time
spent waiting for a core; the CPU time does not, so its ratio is the steadier of the two there.

On a CUDA device the main time is the device's own: a :class:`CudaEventTimer` records a CUDA
event before and after each call and reads the elapsed time between them; the host
synchronises with the device only outside the timed region (before the start event, so the
queue is empty and kernel-launch gaps are counted, and after the end event, to read it).
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


class WallTimer:
    """Host wall-clock timer (``time.perf_counter``) for CPU work."""

    name = "wall clock (time.perf_counter)"

    def time(self, fn: Callable[[], Any]) -> float:
        """Seconds one call of ``fn`` takes."""
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


class CudaEventTimer:
    """Device timer: CUDA events around each call, synchronisation only outside the timed region.

    Args:
        event_factory: zero-argument callable returning an event with ``record()`` and
            ``elapsed_time(end)`` in milliseconds (default ``torch.cuda.Event(enable_timing=True)``).
        synchronize: zero-argument callable that waits for the device (default
            ``torch.cuda.synchronize``). Both are injectable so that the call order can be tested
            without a GPU.
    """

    name = "CUDA events (device time)"

    def __init__(
        self,
        event_factory: Callable[[], Any] | None = None,
        synchronize: Callable[[], Any] | None = None,
    ) -> None:
        self.event_factory = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self.synchronize = synchronize or torch.cuda.synchronize

    def time(self, fn: Callable[[], Any]) -> float:
        """Seconds of device time between an event before and an event after ``fn()``."""
        start, end = self.event_factory(), self.event_factory()
        self.synchronize()  # empty queue: launch gaps inside fn count, earlier work does not
        start.record()
        fn()
        end.record()
        self.synchronize()  # outside the timed region: only to read the events
        return start.elapsed_time(end) / 1e3


def timer_for(device: torch.device | str) -> WallTimer | CudaEventTimer:
    """The timer of ``device``: CUDA events on a CUDA device, the host wall clock elsewhere."""
    return CudaEventTimer() if torch.device(device).type == "cuda" else WallTimer()


def time_interleaved(
    variants: Mapping[str, Callable[[], Any]],
    *,
    repeats: int,
    warmup: int = 1,
    setup: Mapping[str, Callable[[], Any]] | None = None,
    timer: WallTimer | CudaEventTimer | None = None,
) -> dict[str, dict[str, Any]]:
    """Time every variant ``repeats`` times, interleaved with a rotating order.

    Args:
        variants: name -> zero-argument callable (one timed unit of work).
        repeats: timed runs per variant (>= 1).
        warmup: untimed runs per variant before timing.
        setup: optional name -> callable run (untimed) right before each run of that variant,
            e.g. to install the variant's attention processors.
        timer: :class:`WallTimer` (default) or :class:`CudaEventTimer`.

    Returns:
        name -> ``{"times": [...], "median", "q1", "q3", "min", "max", "cpu": {"times", "median",
        ...}, "first_call_s"}`` (seconds; top level = the timer's time (wall clock, or device time
        with CUDA events), ``"cpu"`` = process CPU time of the host, ``first_call_s`` = host wall
        time of the first warm-up call, which holds one-time costs such as compilation; absent
        when ``warmup=0``).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(variants)
    setup = setup or {}
    timer = timer or WallTimer()
    first_call: dict[str, float] = {}
    for _ in range(warmup):
        for name in names:
            if name in setup:
                setup[name]()
            start = time.perf_counter()
            timer.time(variants[name])
            first_call.setdefault(name, time.perf_counter() - start)
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
                start_cpu = time.process_time()
                times[name].append(timer.time(variants[name]))
                cpu[name].append(time.process_time() - start_cpu)
    finally:
        if gc_was_enabled:
            gc.enable()
    out = {
        name: {"times": t, **quantiles(t), "cpu": {"times": cpu[name], **quantiles(cpu[name])}}
        for name, t in times.items()
    }
    for name, seconds in first_call.items():
        out[name]["first_call_s"] = seconds
    return out


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


def ratio_cells(entry: dict[str, Any]) -> str:
    """One variant's timing as the ratio tables print it: ``wall median [q1-q3]  CPU median [q1-q3]
    x<wall ratio> / x<CPU ratio>`` (an entry of :func:`time_interleaved` after :func:`add_ratios`)."""
    cpu = entry["cpu"]
    return (
        f"wall {entry['median']:.3f} [{entry['q1']:.3f}-{entry['q3']:.3f}]  "
        f"CPU {cpu['median']:.3f} [{cpu['q1']:.3f}-{cpu['q3']:.3f}]  "
        f"x{entry['ratio']:.2f} / x{cpu['ratio']:.2f}"
    )


def write_measurement(
    path: str, text: str, record: dict[str, Any], loads: tuple[tuple[float, ...], tuple[float, ...]]
) -> str:
    """Print ``text`` with the load average before and after the measurement and write ``record`` as
    JSON to ``path`` (atomically) with the machine, the loads and the printed table; returns the text."""
    import json

    from nw_adapter.atomic import atomic_write_text

    before, after = loads
    text += f"\nload average (1, 5, 15 min) before {before}, after {after}"
    print(text)
    out = {"machine": machine_info(), **record}
    out.update(loadavg_before=before, loadavg_after=after, table=text)
    atomic_write_text(path, json.dumps(out, indent=1))
    return text


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """The machine and software versions the numbers were measured with (and the GPU, on CUDA)."""
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
        **(_cuda_info(torch.device(device)) if torch.device(device).type == "cuda" else {}),
    }


def _cuda_info(device: torch.device) -> dict[str, Any]:
    """Name, memory and software of the CUDA device (called only when CUDA is available)."""
    props = torch.cuda.get_device_properties(device)
    return {
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }


def fmt_ms(seconds: float) -> str:
    """Seconds as milliseconds with 4 significant digits."""
    return f"{seconds * 1e3:.4g}"
