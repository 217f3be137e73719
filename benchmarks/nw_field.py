"""The exact NW field: the library path versus a naive ``cdist + softmax + matmul`` reference.

Implementations (all compute ``m(x_j) = sum_i softmax_i(-||x_j - a s_i||^2 / 2b^2) s_i`` for a
query batch ``x`` ``[n, d]`` and a support set ``s`` ``[m, d]``, at the OT-path time t = 0.5,
i.e. ``a = b = 0.5``):

- ``naive``: ``torch.cdist`` -> square -> softmax -> matmul, materialising ``[n, m]`` several times;
- ``nw_mean``: :func:`nw_adapter.core.kernels.nw_mean` (SDPA ``"bias"`` form, default chunking);
- ``nw_mean_chunk2048``: the same with ``chunk_size=2048`` query rows per SDPA call (the
  default chunk is ``2**24 / m`` rows), to show that the peak follows the chunk size;
- ``nw_mean_augmented``: ``nw_mean`` with ``form="augmented"``;
- ``field_direct``: :class:`nw_adapter.core.paths.NWVelocityField` with ``form="direct"`` (the exact
  reference form, which materialises ``[n, m]``);
- ``field_bias``: :class:`~nw_adapter.core.paths.NWVelocityField` with ``form="bias"``, its default
  (chunked SDPA).
- ``smoothed_field``, ``local_cov_field``, ``projected_field``: the training-free fields of
  :mod:`nw_adapter.core.smoothed_fields` (smoothed support, manifold-Parzen local covariance,
  projected NW), built (tau, local covariances, subspace fitted) before timing, so a row is the
  per-call cost of an ODE step. Their means differ from the plug-in's by design: the check
  against ``naive`` is replaced by one against the same field computed in float64
  (``max_abs_diff_vs_float64``, velocity units).

Roofline: a square ``GEMM_SIZE x GEMM_SIZE`` float32 matrix product is timed in the same
interleaved rounds as the implementations (same process, same threads, same machine load); its
rate ``2 GEMM_SIZE^3 / time`` is the machine's attainable FLOP rate for dense math. Each size's
NW mean needs ``nw_flop(n, m, d) = 2 n m d + 2 n m d_v`` FLOP (the two matrix products ``x s^T``
and ``W v``; the ``n m`` exponentials are not counted), so ``floor = nw_flop / GEMM rate`` is the
time the mean cannot beat, and ``time / floor`` says how far each implementation is from it.

Time: medians of interleaved repeats in this process. Peak memory: for each (case,
implementation) a fresh subprocess builds the inputs, then resets the kernel's peak-RSS counter
(``echo 5 > /proc/self/clear_refs`` resets ``VmHWM``), runs the implementation once and reports
``VmHWM - VmRSS(before)``: the extra resident memory the call needed at its peak, inputs
excluded, output included. Each subprocess first runs the implementation once on 8 points so
that lazily loaded kernels and code pages are not counted. Where ``clear_refs`` is unavailable
the subprocess falls back to ``ru_maxrss`` after minus before. PyTorch's CPU allocator does not
cache, so this is the memory the implementation really asked for.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nw_adapter.core.kernels import nw_mean
from nw_adapter.core.paths import NWVelocityField, OTPath
from nw_adapter.core.smoothed_fields import LocalCovarianceField, ProjectedField, SmoothedSupportField

from .timing import add_ratios, time_interleaved, timer_for

IMPLEMENTATIONS: tuple[str, ...] = (
    "naive",
    "nw_mean",
    "nw_mean_chunk2048",
    "nw_mean_augmented",
    "field_direct",
    "field_bias",
    "smoothed_field",
    "local_cov_field",
    "projected_field",
)
#: Implementations whose mean is a different (smoothed) target's: not compared with ``naive``.
SMOOTHED = ("smoothed_field", "local_cov_field", "projected_field")
SMOOTHED_CLASSES = {
    "smoothed_field": SmoothedSupportField,
    "local_cov_field": LocalCovarianceField,
    "projected_field": ProjectedField,
}
#: OT path at t = 0.5: x_t = t x_1 + (1 - t) x_0, so a = t and b = 1 - t.
T = 0.5
#: Side of the square GEMM whose rate sets the roofline.
GEMM_SIZE = 2048
#: Target: ``nw_mean`` within this factor of the roofline floor at every size.
FLOOR_TARGET = 1.25


def nw_flop(n: int, m: int, d: int, d_v: int | None = None) -> int:
    """FLOP of one NW mean: ``2 n m d`` for the logits ``x s^T`` plus ``2 n m d_v`` for ``W v``.

    Example:
        >>> nw_flop(65536, 1024, 64) / 1e9  # the issue's 17.2 GFLOP
        17.179869184
    """
    d_v = d if d_v is None else d_v
    return 2 * n * m * d + 2 * n * m * d_v


def gemm_flop(size: int) -> int:
    """FLOP of one ``size x size`` by ``size x size`` matrix product: ``2 size^3``."""
    return 2 * size**3


def add_roofline(entry: dict[str, Any], n: int, m: int, d: int, *, cpu: bool = True) -> dict[str, Any]:
    """Add the roofline to one case's results (in place) from its ``"gemm"`` timing.

    Args:
        entry: ``{"results": {impl: {"median", ...}}, "gemm": {"median", "size"}}`` (seconds).
        n, m, d: the case (values = support, so ``d_v = d``).
        cpu: also the roofline from process CPU times (off for GPU timings, where the host's CPU
            time measures nothing of the device's work).

    Returns:
        ``entry`` with ``gemm["gflops"]``, ``flop``, ``floor_s`` and, for every implementation,
        ``x_floor = median / floor_s``; where the timings carry process CPU times (``"cpu":
        {"median"}``) the same from CPU times: ``gemm["cpu_gflops"]``, ``cpu_floor_s`` and
        ``x_floor_cpu`` (steadier than the wall clock on a machine shared with other jobs).
    """
    gemm = entry["gemm"]
    entry["flop"] = nw_flop(n, m, d)
    for suffix, get in (("", lambda e: e.get("median")), ("_cpu", lambda e: e.get("cpu", {}).get("median"))):
        if not get(gemm) or (suffix and not cpu):
            continue
        gflops = gemm_flop(gemm["size"]) / get(gemm) / 1e9
        floor = entry["flop"] / (gflops * 1e9)
        gemm["cpu_gflops" if suffix else "gflops"] = gflops
        entry["cpu_floor_s" if suffix else "floor_s"] = floor
        for result in entry["results"].values():
            if get(result) is not None:
                result["x_floor" + suffix] = get(result) / floor
    return entry


def make_inputs(
    n: int, m: int, d: int, seed: int = 0, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``[n, d]`` and support ``[m, d]``, standard normal, float32 (drawn on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g).to(device), torch.randn(m, d, generator=g).to(device)


def naive_nw_mean(x: torch.Tensor, support: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """Reference NW mean: ``softmax(-cdist(x, a s)^2 / 2b^2) @ s`` (materialises ``[n, m]``)."""
    dist2 = torch.cdist(x, a * support).square()
    return torch.softmax(dist2 * (-0.5 / (b * b)), dim=-1) @ support


def implementation(name: str, x: torch.Tensor, support: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Zero-argument callable computing the NW mean (or field) of ``name`` on ``x``, ``support``."""
    a, b = T, 1.0 - T
    if name == "naive":
        return lambda: naive_nw_mean(x, support, a, b)
    if name == "nw_mean":
        return lambda: nw_mean(x, a * support, b, values=support)
    if name == "nw_mean_chunk2048":
        return lambda: nw_mean(x, a * support, b, values=support, chunk_size=2048)
    if name == "nw_mean_augmented":
        return lambda: nw_mean(x, a * support, b, values=support, form="augmented")
    if name in ("field_direct", "field_bias"):
        field = NWVelocityField(support, OTPath(), form=name.split("_")[1])
        return lambda: field(x, T)
    if name in SMOOTHED:
        field = SMOOTHED_CLASSES[name](support, OTPath(), validate=False)
        return lambda: field(x, T)
    raise ValueError(f"unknown implementation {name!r}; use one of {IMPLEMENTATIONS}")


def _status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as fh:
            fh.write("5")
    except OSError:
        return False
    return _status_kb("VmHWM") is not None


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def measure_peak_here(name: str, n: int, m: int, d: int) -> dict[str, Any]:
    """Peak extra resident memory (MiB) of one call of ``name`` in *this* process."""
    warm_x, warm_support = make_inputs(8, min(m, 8), d, seed=1)
    implementation(name, warm_x, warm_support)()  # load kernels / code pages before measuring
    x, support = make_inputs(n, m, d)
    fn = implementation(name, x, support)
    _trim()
    if _reset_peak():
        before = _status_kb("VmRSS") or 0
        out = fn()
        peak = _status_kb("VmHWM") or 0
        method = "VmHWM-VmRSS (clear_refs)"
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = fn()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        method = "ru_maxrss delta"
    del out
    return {"peak_mib": max(0, peak - before) / 1024, "method": method}


def measure_peak(name: str, n: int, m: int, d: int, threads: int) -> dict[str, Any]:
    """Run :func:`measure_peak_here` in a fresh subprocess (``python -m benchmarks.nw_field``)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "benchmarks.nw_field", "--peak", name, str(n), str(m), str(d), str(threads)]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"peak_mib": float("nan"), "method": "failed", "error": done.stderr.strip()[-400:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_nw_field(
    cases: Sequence[tuple[int, int, int]],
    *,
    repeats: int,
    threads: int,
    implementations: Sequence[str] = IMPLEMENTATIONS,
    memory: bool = True,
    log: Callable[[str], None] = print,
    device: torch.device | str = "cpu",
    gemm_size: int = GEMM_SIZE,
) -> list[dict[str, Any]]:
    """Time (interleaved, with the roofline GEMM) and measure peak memory of each implementation.

    Args:
        cases: ``(n, m, d)`` triples.
        repeats: timed repeats per implementation.
        threads: torch threads of the memory subprocesses (the timing uses the current setting).
        implementations: names from :data:`IMPLEMENTATIONS` (the first is the ratio baseline).
        memory: also measure peak memory (CPU only: fresh subprocesses reading ``/proc``).
        log: progress printer.
        device: device of the inputs; CUDA times are CUDA-event times.
        gemm_size: side of the roofline's square GEMM.

    Returns:
        One dict per case: ``{"n", "m", "d", "nm_mib", "flop", "floor_s", "gemm": {"size",
        "median", "gflops", ...}, "results": {impl: {... "x_floor", "peak_mib"}}}``, ``nm_mib``
        being the size of one float32 ``[n, m]`` matrix, and ``max_abs_diff`` of every
        implementation's NW mean against ``naive`` (the fields are converted back to means).
    """
    rows = []
    memory = memory and torch.device(device).type == "cpu"
    g = torch.Generator().manual_seed(7)
    gemm_a, gemm_b = (torch.randn(gemm_size, gemm_size, generator=g).to(device) for _ in range(2))
    for n, m, d in cases:
        log(f"  nw field n={n} m={m} d={d}")
        x, support = make_inputs(n, m, d, device=device)
        fns = {name: implementation(name, x, support) for name in implementations}
        fns["gemm"] = lambda: gemm_a @ gemm_b
        timed = time_interleaved(fns, repeats=repeats, timer=timer_for(device))
        gemm = {"size": gemm_size, **timed.pop("gemm")}
        results = add_ratios(timed, implementations[0])
        reference = naive_nw_mean(x, support, T, 1.0 - T)
        for name in implementations:
            out = fns[name]()
            if name in SMOOTHED:
                ref = SMOOTHED_CLASSES[name](support.double(), OTPath())(x.double(), T)
                results[name]["max_abs_diff_vs_float64"] = float((out.double() - ref).abs().max())
                if memory:
                    results[name].update(measure_peak(name, n, m, d, threads))
                continue
            if name.startswith("field"):
                out = x + (1.0 - T) * out  # OT velocity v = (m - x) / (1 - t)  =>  m = x + (1 - t) v
            results[name]["max_abs_diff_vs_naive"] = float((out - reference).abs().max())
            if memory:
                results[name].update(measure_peak(name, n, m, d, threads))
        entry = {"n": n, "m": m, "d": d, "nm_mib": n * m * 4 / 2**20, "results": results, "gemm": gemm}
        rows.append(add_roofline(entry, n, m, d, cpu=torch.device(device).type == "cpu"))
    return rows


def _main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="internal: peak memory of one NW field implementation")
    parser.add_argument("--peak", nargs=5, metavar=("IMPL", "N", "M", "D", "THREADS"), required=True)
    args = parser.parse_args(argv)
    name, n, m, d, threads = args.peak
    torch.set_num_threads(int(threads))
    print(json.dumps(measure_peak_here(name, int(n), int(m), int(d))))


if __name__ == "__main__":
    _main()
