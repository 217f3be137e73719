"""Run all nw-adapter benchmarks, print tables and write JSON (the one command of issue 6).

Usage::

    python benchmarks/run.py            # full run (~10 min on 2 CPU cores)
    python benchmarks/run.py --quick    # reduced sizes and repeats (~2 min)
    python benchmarks/run.py --out results.json --threads 2 --sections attention unet

Sections: ``attention`` (one SD 1.5 attn2 layer: stock vs observe vs swap), ``unet`` (one whole
SD 1.5 UNet step, random weights, reduced resolution), ``field`` (exact NW field vs a naive
reference: time and peak memory), ``recorder`` (recorder memory, streaming vs stored maps),
``ops`` (dispatched non-view aten ops per attn2 layer and per UNet forward, benchmarks/op_count.py).
Times are medians of interleaved repeats with their interquartile range [q1-q3]; ratios are
against the stock processor (attention, unet) or the naive reference (field), for the wall clock
and for the process CPU time. One torch thread by default: on a machine shared with other jobs,
two OpenMP threads spend much of their time waiting for each other at every small op.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.timing import fmt_ms, machine_info  # noqa: E402

SECTIONS = ("attention", "unet", "field", "recorder", "ops")

#: Sizes of the full and the quick run.
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
        # (latent size, repeats, variants): the UNet step is weight-bound at these sizes
        "unet": [(16, 5, ("observe", "observe_no_nulls", "swap")), (32, 3, ("observe", "swap"))],
        "field": [(4096, 256, 16), (16384, 1024, 64), (65536, 256, 16), (65536, 1024, 64)],
        "field_repeats": 3,
        "field_direct_max": 2**32,  # NWVelocityField(form="direct") is skipped above n*m*d
        "recorder_queries": [64, 256, 1024, 4096],
    },
    "quick": {
        "attention": [((640, 1024), 4), ((1280, 64), 16)],
        "attention_repeats": 2,
        "unet": [(8, 1, ("observe", "swap"))],
        "field": [(4096, 256, 16), (16384, 256, 64)],
        "field_repeats": 2,
        "field_direct_max": 2**28,
        "recorder_queries": [64, 256],
    },
}


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table with right-aligned columns."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cell(entry: dict[str, Any], ratio: bool = True) -> str:
    """``median [q1-q3] xRATIO (cpu xRATIO)``: wall-clock ms, its ratio and the CPU-time ratio."""
    text = f"{fmt_ms(entry['median'])} [{fmt_ms(entry['q1'])}-{fmt_ms(entry['q3'])}]"
    if not ratio or "ratio" not in entry:
        return text
    text += f" x{entry['ratio']:.2f}"
    if "cpu" in entry and "ratio" in entry["cpu"]:
        text += f" (cpu x{entry['cpu']['ratio']:.2f})"
    return text


def run_attention(plan: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """Attention-layer section: results and their table."""
    from benchmarks.attention import VARIANTS, bench_attention_layer

    rows, out = [], []
    for (hidden, queries), tokens in plan["attention"]:
        print(f"  attention hidden={hidden} queries={queries} image_tokens={tokens}", flush=True)
        res = bench_attention_layer(hidden, queries, image_tokens=tokens, repeats=plan["attention_repeats"])
        out.append(res)
        rows.append(
            [str(hidden), str(queries), str(tokens), *(cell(res["results"][v]) for v in ("stock", *VARIANTS))]
        )
    header = ["hidden", "queries", "img", "stock ms", *(f"{v} ms" for v in VARIANTS)]
    return out, table(header, rows)


def run_unet(plan: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """Whole-UNet section (one entry per latent size): results and their table."""
    from benchmarks.attention import bench_unet_step
    from benchmarks.models import build_unet

    start = time.perf_counter()
    unet = build_unet()
    print(f"  SD 1.5 UNet built in {time.perf_counter() - start:.1f} s", flush=True)
    out, rows = [], []
    for latent, repeats, variants in plan["unet"]:
        print(f"  UNet step at latents {latent}x{latent}", flush=True)
        res = bench_unet_step(latent_size=latent, repeats=repeats, unet=unet, variants=variants)
        out.append(res)
        for v in ("stock", *variants):
            r = res["results"][v]
            rows.append(
                [
                    f"{latent}x{latent} ({8 * latent} px)",
                    v,
                    cell(r, ratio=False),
                    f"{r['ratio']:.3f}",
                    fmt_ms(r["cpu"]["median"]),
                    f"{r['cpu']['ratio']:.3f}",
                    f"{r['side_over_stock']:.3f}" if "side_over_stock" in r else "",
                ]
            )
    title = "SD 1.5 UNet step (random weights, base IP-Adapter), CFG batch 2"
    header = ["latents", "variant", "wall ms [q1-q3]", "wall ratio", "cpu ms", "cpu ratio", "NW side / stock"]
    return out, title + "\n" + table(header, rows)


def run_field(plan: dict[str, Any], threads: int) -> tuple[list[dict[str, Any]], str]:
    """NW-field section: results and their table."""
    from benchmarks.nw_field import IMPLEMENTATIONS, bench_nw_field

    out, rows = [], []
    for n, m, d in plan["field"]:
        impls = [i for i in IMPLEMENTATIONS if i != "field_direct" or n * m * d <= plan["field_direct_max"]]
        res = bench_nw_field(
            [(n, m, d)], repeats=plan["field_repeats"], threads=threads, implementations=impls
        )[0]
        res["skipped"] = [i for i in IMPLEMENTATIONS if i not in impls]
        out.append(res)
        for impl in IMPLEMENTATIONS:
            if impl not in res["results"]:
                rows.append([str(n), str(m), str(d), impl, "skipped (too slow)", "", "", "", ""])
                continue
            r = res["results"][impl]
            rows.append(
                [
                    str(n),
                    str(m),
                    str(d),
                    impl,
                    cell(r, ratio=False),
                    f"{r['ratio']:.2f}",
                    f"{r['cpu']['ratio']:.2f}",
                    f"{r.get('peak_mib', float('nan')):.1f}",
                    f"{res['nm_mib']:.0f}",
                ]
            )
    header = [
        "n",
        "m",
        "d",
        "impl",
        "wall ms [q1-q3]",
        "wall vs naive",
        "cpu vs naive",
        "peak MiB",
        "n*m fp32 MiB",
    ]
    return out, table(header, rows)


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
    parser.add_argument("--out", default="benchmark_results.json", help="JSON output path")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: on a shared machine it measures work, not scheduling)",
    )
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument(
        "--unet-latents",
        type=int,
        nargs="+",
        help="override the UNet latent sizes (e.g. 64 for 512 px; observe and swap only)",
    )
    parser.add_argument("--unet-repeats", type=int, default=2, help="repeats with --unet-latents")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    plan_name = "quick" if args.quick else "full"
    plan = dict(PLANS[plan_name])
    if args.unet_latents:
        plan["unet"] = [(latent, args.unet_repeats, ("observe", "swap")) for latent in args.unet_latents]
    info = machine_info()
    print(f"nw-adapter benchmarks ({plan_name}); torch.set_num_threads({torch.get_num_threads()})")
    print(json.dumps(info))
    results: dict[str, Any] = {"plan": plan_name, "machine": info, "sections": {}}
    tables: dict[str, str] = {}
    start = time.perf_counter()
    for section in args.sections:
        print(f"[{section}]", flush=True)
        t0 = time.perf_counter()
        if section == "attention":
            data, text = run_attention(plan)
        elif section == "unet":
            data, text = run_unet(plan)
        elif section == "field":
            data, text = run_field(plan, args.threads)
        elif section == "ops":  # dispatched-op counts (benchmarks/op_count.py)
            from benchmarks.op_count import run as run_ops

            data, text = run_ops(latent_size=8, variants=("observe", "observe_no_nulls", "swap"))
        else:
            data, text = run_recorder(plan)
        results["sections"][section] = data
        tables[section] = text
        print(text + f"\n({time.perf_counter() - t0:.0f} s)\n", flush=True)
    results["total_s"] = time.perf_counter() - start
    results["tables"] = tables
    Path(args.out).write_text(json.dumps(results, indent=1, default=float), encoding="utf-8")
    print(f"total {results['total_s']:.0f} s; wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
