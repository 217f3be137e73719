"""Run all nw-adapter benchmarks, print tables and write JSON (the one command of issue 6).

Usage::

    python benchmarks/run.py            # full CPU run (~10 min on 2 CPU cores)
    python benchmarks/run.py --quick    # reduced sizes and repeats (~2 min)
    python benchmarks/run.py --out results.json --threads 2 --sections attention unet
    python benchmarks/run.py --device cuda --dtype float16   # the GPU set (benchmarks/gpu_run.sh)

Sections: ``attention`` (one SD 1.5 attn2 layer: stock vs observe vs swap), ``unet`` (one whole
UNet step, random weights: SD 1.5 at reduced resolution on the CPU; SD 1.5 at 512 px and SDXL at
1024 px on a GPU), ``field`` (exact NW field vs a naive reference and the GEMM roofline: time and
peak memory), ``recorder`` (recorder memory, streaming vs stored maps), ``ops`` (dispatched
non-view aten ops per attn2 layer and per UNet forward, benchmarks/op_count.py).
Times are medians of interleaved repeats with their interquartile range [q1-q3]; ratios are
against the stock processor (attention, unet) or the naive reference (field), for the wall clock
(CUDA-event device time on a GPU) and for the process CPU time. One torch thread by default: on a
machine shared with other jobs, two OpenMP threads spend much of their time waiting for each
other at every small op. ``--dtype`` sets the model sections' dtype; the NW field stays float32.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.timing import fmt_ms, machine_info  # noqa: E402
from nw_adapter.atomic import atomic_write_text  # noqa: E402

SECTIONS = ("attention", "unet", "field", "recorder", "ops")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

#: Variants of the GPU runs (the compiled observe is skipped where the config has no ``compile``).
GPU_VARIANTS = ("observe", "observe_compiled", "swap")

#: Sizes of each run. ``unet`` entries are (model, latent size, repeats, variants).
PLANS: dict[str, dict[str, Any]] = {
    "full": {
        "attention": [
            ((320, 4096), 4),
            ((640, 1024), 4),
            ((1280, 256), 4),
            ((1280, 64), 4),
            ((320, 4096), 16),
            ((1280, 256), 16),
        ],
        "attention_repeats": 5,
        # the UNet step is weight-bound at these sizes
        "unet": [
            ("sd15", 16, 5, ("observe", "observe_no_nulls", "observe_control", "swap")),
            ("sd15", 32, 3, ("observe", "swap")),
        ],
        "field": [(4096, 256, 16), (16384, 1024, 64), (65536, 256, 16), (65536, 1024, 64)],
        "field_repeats": 3,
        "field_direct_max": 2**32,  # NWVelocityField(form="direct") is skipped above n*m*d
        "recorder_queries": [64, 256, 1024, 4096],
    },
    "quick": {
        "attention": [((640, 1024), 4), ((1280, 64), 16)],
        "attention_repeats": 2,
        "unet": [("sd15", 8, 1, ("observe", "swap"))],
        "field": [(4096, 256, 16), (16384, 256, 64)],
        "field_repeats": 2,
        "field_direct_max": 2**28,
        "recorder_queries": [64, 256],
    },
    # One H200: estimated 2-5 min in all (model building and compilation included; not measured
    # yet), see gpu_run.sh. The quick sections come first, then the UNet steps, saved after each
    # model; compiled observe runs only there (each layer shape compiles once), so that a slow
    # compilation cannot cost the other sections.
    "gpu": {
        "sections": ("attention", "field", "unet"),
        "attention": [
            ((320, 4096), 4),
            ((640, 1024), 4),
            ((1280, 256), 4),
            ((1280, 64), 4),
            ((320, 4096), 16),
            ((1280, 256), 16),
        ],
        "attention_repeats": 50,
        "attention_variants": ("observe", "observe_no_nulls", "swap"),
        "unet": [("sd15", 64, 30, GPU_VARIANTS), ("sdxl", 128, 15, GPU_VARIANTS)],
        "warmup": 3,
        "field": [(16384, 1024, 64), (65536, 1024, 64), (262144, 1024, 64), (262144, 256, 16)],
        "field_repeats": 10,
        "field_direct_max": 2**32,
        "recorder_queries": [64, 4096],
    },
    "gpu_quick": {
        "sections": ("attention", "field", "unet"),
        "attention": [((320, 4096), 4), ((1280, 64), 16)],
        "attention_repeats": 10,
        "attention_variants": ("observe", "swap"),
        "unet": [("sd15", 64, 5, GPU_VARIANTS)],
        "warmup": 2,
        "field": [(65536, 1024, 64)],
        "field_repeats": 5,
        "field_direct_max": 2**28,
        "recorder_queries": [64],
    },
}


def fail(message: str) -> NoReturn:
    """Bad command line: one line on stderr, exit code 2, no traceback."""
    print(f"run.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def resolve_device(name: str) -> torch.device:
    """``--device`` as a torch device; exits 2 with one line when it is unknown or unavailable."""
    try:
        device = torch.device(name)
    except RuntimeError:
        fail(f"--device {name!r} is not a torch device; use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(
            f"--device {name}: CUDA is not available here (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda}); run on a machine with an NVIDIA GPU or use --device cpu"
        )
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        fail(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    if device.type not in ("cpu", "cuda"):
        fail(f"--device {name}: only cpu and cuda are supported")
    return device


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table with right-aligned columns."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cell(entry: dict[str, Any]) -> str:
    """``median [q1-q3]`` in ms."""
    return f"{fmt_ms(entry['median'])} [{fmt_ms(entry['q1'])}-{fmt_ms(entry['q3'])}]"


def ratio_cells(entry: dict[str, Any]) -> list[str]:
    """``[time ratio, CPU-time ratio]`` of one variant (3 decimals)."""
    return [f"{entry['ratio']:.3f}", f"{entry['cpu']['ratio']:.3f}"]


def variant_rows(
    prefix: list[str], res: dict[str, Any], variants: Sequence[str], width: int
) -> list[list[str]]:
    """One row per variant (stock first): ``prefix + [variant, ms, ratio, cpu ratio, ...]``.

    A skipped variant gets ``skipped (below)`` in place of the numbers (its note goes under the
    table, see :func:`skip_notes`); rows are padded to ``width``.
    """
    rows = []
    for v in ("stock", *variants):
        if v in res.get("skipped", {}):
            row = [*prefix, v, "skipped (below)"]
        else:
            r = res["results"][v]
            row = [*prefix, v, cell(r), *ratio_cells(r)]
        rows.append(row + [""] * (width - len(row)))
        prefix = [""] * len(prefix)
    return rows


def skip_notes(entries: Sequence[dict[str, Any]]) -> str:
    """The distinct ``variant: note`` lines of every skipped variant (empty string if none)."""
    notes = {f"{v}: {note}" for entry in entries for v, note in entry.get("skipped", {}).items()}
    return "".join(f"\n{line}" for line in sorted(notes))


def run_attention(plan: dict[str, Any], device: torch.device, dtype: torch.dtype) -> tuple[list, str]:
    """Attention-layer section: results and their table (one row per variant)."""
    from benchmarks.attention import DEFAULT_VARIANTS, bench_attention_layer

    variants = plan.get("attention_variants", DEFAULT_VARIANTS)
    out, rows = [], []
    for (hidden, queries), tokens in plan["attention"]:
        print(f"  attention hidden={hidden} queries={queries} image_tokens={tokens}", flush=True)
        res = bench_attention_layer(
            hidden,
            queries,
            image_tokens=tokens,
            repeats=plan["attention_repeats"],
            variants=variants,
            device=device,
            dtype=dtype,
            warmup=plan.get("warmup", 1),
        )
        out.append(res)
        rows += variant_rows([str(hidden), str(queries), str(tokens)], res, variants, 7)
    title = f"One SD 1.5 attn2 layer, CFG batch 2 ({device.type}, {str(dtype).removeprefix('torch.')})"
    header = ["hidden", "queries", "img", "variant", "ms [q1-q3]", "ratio", "cpu ratio"]
    return out, title + "\n" + table(header, rows) + skip_notes(out)


def run_unet(
    plan: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    checkpoint: Callable[[list, str], None] | None = None,
) -> tuple[list, str]:
    """Whole-UNet section (one entry per model and latent size): results and their table.

    ``checkpoint(results so far, table so far)`` is called after every entry, so that a run cut
    short (time cap) keeps the models it finished.
    """
    from benchmarks.attention import UNET_MODELS, bench_unet_step
    from benchmarks.models import build_unet

    out, rows = [], []
    built: dict[str, torch.nn.Module] = {}
    for model, latent, repeats, variants in plan["unet"]:
        if model not in built:
            built.clear()  # one model in memory at a time (an SDXL UNet is 2.6 B parameters)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            start = time.perf_counter()
            config, embed_dim = UNET_MODELS[model]
            built[model] = build_unet(config, image_embed_dim=embed_dim, device=device, dtype=dtype)
            print(f"  {model} UNet built in {time.perf_counter() - start:.1f} s", flush=True)
        print(f"  {model} UNet step at latents {latent}x{latent}", flush=True)
        res = bench_unet_step(
            latent_size=latent,
            repeats=repeats,
            unet=built[model],
            variants=variants,
            device=device,
            dtype=dtype,
            warmup=plan.get("warmup", 1),
        )
        res["model"] = model
        out.append(res)
        for row in variant_rows([model, f"{latent}x{latent} ({8 * latent} px)"], res, variants, 8):
            r = res["results"].get(row[2], {})
            if len(row[3]) and "skipped" not in row[3]:
                row[6] = f"{r['side_over_stock']:.3f}" if "side_over_stock" in r else ""
                row[7] = f"{r['first_call_s']:.1f}" if "first_call_s" in r else ""
            rows.append(row)
        if checkpoint is not None:
            checkpoint(
                out, _unet_table(rows, out, device, dtype) + "\n(partial: the section is still running)"
            )
    return out, _unet_table(rows, out, device, dtype)


def _unet_table(rows: list[list[str]], out: list, device: torch.device, dtype: torch.dtype) -> str:
    timer = "CUDA events" if device.type == "cuda" else "wall clock"
    title = (
        f"UNet step (random weights, base IP-Adapter), CFG batch 2 ({device.type}, "
        f"{str(dtype).removeprefix('torch.')}, {timer})"
    )
    header = ["model", "latents", "variant", "ms [q1-q3]", "ratio", "cpu ratio", "side/stock", "1st call s"]
    return title + "\n" + table(header, rows) + skip_notes(out)


def run_field(plan: dict[str, Any], threads: int, device: torch.device) -> tuple[list, str]:
    """NW-field section with the GEMM roofline: results, their table and the target line."""
    from benchmarks.nw_field import FLOOR_TARGET, IMPLEMENTATIONS, bench_nw_field

    out, rows = [], []
    for n, m, d in plan["field"]:
        impls = [i for i in IMPLEMENTATIONS if i != "field_direct" or n * m * d <= plan["field_direct_max"]]
        res = bench_nw_field(
            [(n, m, d)], repeats=plan["field_repeats"], threads=threads, implementations=impls, device=device
        )[0]
        res["skipped"] = [i for i in IMPLEMENTATIONS if i not in impls]
        out.append(res)
        gemm = res["gemm"]
        case = [str(n), str(m), str(d), f"{res['flop'] / 1e9:.3g}", fmt_ms(res["floor_s"])]
        rows.append([*case, f"GEMM {gemm['size']}: {gemm['gflops']:.0f} GF/s", cell(gemm), "", "", ""])
        blank = [""] * len(case)
        for impl in IMPLEMENTATIONS:
            if impl not in res["results"]:
                rows.append([*blank, impl, "skipped (too slow)", "", "", ""])
                continue
            r = res["results"][impl]
            peak = f"{r['peak_mib']:.1f}" if "peak_mib" in r else "n/a"
            x_floor = f"{r['x_floor']:.2f}" + (f" ({r['x_floor_cpu']:.2f})" if "x_floor_cpu" in r else "")
            rows.append([*blank, impl, cell(r), f"{r['ratio']:.2f}", x_floor, peak])
    header = [
        "n",
        "m",
        "d",
        "GFLOP",
        "floor ms",
        "impl",
        "ms [q1-q3]",
        "x naive",
        "x floor (cpu)",
        "peak MiB",
    ]
    return out, table(header, rows) + "\n" + floor_verdict(out, FLOOR_TARGET)


def floor_verdict(cases: Sequence[dict[str, Any]], target: float) -> str:
    """One line: the target (``nw_mean`` within ``target`` x the roofline floor) and what was
    measured at each size above it, worded as a measurement, not a failure.

    Judged on CPU-time ratios where the cases have them (CPU runs: steadier under load), else on
    the wall-clock (device) ratios.
    """
    key = "x_floor_cpu" if all("x_floor_cpu" in c["results"].get("nw_mean", {}) for c in cases) else "x_floor"
    missed = [
        f"n={c['n']} m={c['m']} d={c['d']} (x{c['results']['nw_mean'][key]:.2f})"
        for c in cases
        if "nw_mean" in c["results"] and c["results"]["nw_mean"][key] > target
    ]
    basis = "CPU time" if key == "x_floor_cpu" else "time"
    if not missed:
        return f"target: nw_mean <= {target}x the roofline floor ({basis}); measured: within it at every size"
    return f"target: nw_mean <= {target}x the roofline floor ({basis}); measured above it at " + ", ".join(
        missed
    )


def run_recorder(plan: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """Recorder-memory section: results and their table."""
    from benchmarks.recorder_memory import MODES, bench_recorder_memory

    out = bench_recorder_memory(plan["recorder_queries"])
    rows = [[str(r["queries"]), str(r["records"]), *(str(r["bytes"][m]) for m in MODES)] for r in out]
    return out, table(["queries", "records", *(f"{m} bytes" for m in MODES)], rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse arguments, run the selected sections, print tables, write JSON; returns the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="reduced sizes and repeats (~2 min)")
    parser.add_argument(
        "--out", default="benchmark_results.json", help="JSON output path (rewritten per section)"
    )
    parser.add_argument("--tables", help="also write the printed tables to this text file")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: on a shared machine it measures work, not scheduling)",
    )
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, help="default: all (GPU: attention field unet)"
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu (default), cuda or cuda:N; cuda selects the GPU plan"
    )
    parser.add_argument(
        "--dtype", default="float32", help="dtype of the models: float32, float16 or bfloat16"
    )
    parser.add_argument(
        "--unet-latents",
        type=int,
        nargs="+",
        help="override the UNet latent sizes (SD 1.5; e.g. 64 for 512 px; observe and swap only)",
    )
    parser.add_argument("--unet-repeats", type=int, default=2, help="repeats with --unet-latents")
    args = parser.parse_args(argv)
    if args.threads < 1:
        fail(f"--threads must be >= 1, got {args.threads}")
    if args.dtype not in DTYPES:
        fail(f"--dtype {args.dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    device, dtype = resolve_device(args.device), DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    plan_name = (
        ("gpu_quick" if args.quick else "gpu")
        if device.type == "cuda"
        else ("quick" if args.quick else "full")
    )
    plan = dict(PLANS[plan_name])
    if args.unet_latents:
        plan["unet"] = [
            ("sd15", latent, args.unet_repeats, ("observe", "swap")) for latent in args.unet_latents
        ]
    sections = args.sections or list(plan.get("sections", SECTIONS))
    info = machine_info(device)
    threads = torch.get_num_threads()
    print(f"nw-adapter benchmarks ({plan_name}; {device}, {args.dtype}); torch.set_num_threads({threads})")
    print(json.dumps(info))
    results: dict[str, Any] = {"plan": plan_name, "device": str(device), "dtype": args.dtype, "machine": info}
    results["sections"] = {}
    tables: dict[str, str] = {}
    start = time.perf_counter()
    for section in sections:
        print(f"[{section}]", flush=True)
        t0 = time.perf_counter()
        if section == "attention":
            data, text = run_attention(plan, device, dtype)
        elif section == "unet":

            def checkpoint(data: list, text: str) -> None:
                results["sections"]["unet"], tables["unet"] = data, text
                _write(args, results, tables)

            data, text = run_unet(plan, device, dtype, checkpoint)
        elif section == "field":
            data, text = run_field(plan, args.threads, device)
        elif section == "ops":  # dispatched-op counts (benchmarks/op_count.py)
            from benchmarks.op_count import run as run_ops

            variants = ("observe", "observe_no_nulls", "observe_no_readings", "swap")
            data, text = run_ops(latent_size=8, variants=variants)
        else:
            data, text = run_recorder(plan)
        results["sections"][section] = data
        tables[section] = text + f"\n({time.perf_counter() - t0:.0f} s)"
        print(tables[section] + "\n", flush=True)
        results["total_s"] = time.perf_counter() - start
        results["tables"] = tables
        _write(args, results, tables)  # after every section: a cut-short run keeps what it measured
    print(f"total {results['total_s']:.0f} s; wrote {args.out}")
    return results


def _write(args: argparse.Namespace, results: dict[str, Any], tables: dict[str, str]) -> None:
    atomic_write_text(args.out, json.dumps(results, indent=1, default=float) + "\n")
    if args.tables:
        text = "\n\n".join(f"[{name}]\n{body}" for name, body in tables.items())
        atomic_write_text(args.tables, f"{json.dumps(results['machine'])}\n\n{text}\n")


if __name__ == "__main__":
    main()
