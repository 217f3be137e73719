"""The per-layer against the end-to-end untrained-adapter control on the trained tiny digits model.

Usage::

    python -m benchmarks.end_to_end_readings [--steps 50] [--digits 10] [--out end_to_end_readings.json]

Per bundled reference digit (the command line's defaults: prompt "a photograph", DDIM, CFG 7.5,
seed 0), four observed generations: the trained call with the per-layer control
(``untrained_control=True``, seed 0: the trained queries against the untrained keys, unmatched),
and :func:`~nw_adapter.integration.end_to_end.end_to_end_control` with draw seed 0 unmatched and
scale matched (each: the trained call again, then the control call). The per-layer and the
unmatched end-to-end control use the same untrained keys algebra (same seed, same modules); they
differ only in the queries (trained against untrained upstream branch), which is the limit of
the per-layer control. Per reference: the cond half's mean over steps, layers and heads; then the
mean and a 95% Student t interval over references of the paired differences, and per IP layer the
mean over references of (end-to-end - per-layer) rho (against the scale-matched end-to-end run
where the per-layer control is scale matched itself, issue 26's ``{stat}_control_0`` columns).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from nw_adapter.atomic import atomic_write_text
from nw_adapter.core.intervals import t_interval
from nw_adapter.integration.end_to_end import end_to_end_control
from nw_adapter.integration.mixin import nw_processor

STATS = ("rho", "nw_gain", "kl", "key_norm_cv")
KEY = ("call", "step", "layer", "head", "half", "adapter", "image", "key_set")


def _per_layer(record: dict[str, Any], stat: str) -> float:
    """The per-layer control's value: ``{stat}_untrained`` (raw, one draw), or after issue 26's
    renaming ``{stat}_control_0`` (then scale matched per batch row and head, not raw)."""
    return record[f"{stat}_untrained"] if f"{stat}_untrained" in record else record[f"{stat}_control_0"]


def _mean(records: list[dict[str, Any]], column: str) -> float:
    values = [r[column] for r in records if math.isfinite(r[column])]
    return float(np.mean(values)) if values else math.nan


def measure(*, steps: int, digits: int) -> dict[str, Any]:
    """Per reference, the cond-half means of the trained statistics and the three controls."""
    from diffusers import DDIMScheduler

    from nw_adapter.models.loaders import load_tiny_digits, tiny_digit_image

    pipe = load_tiny_digits()
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    per_reference: list[dict[str, float]] = []
    by_layer: dict[str, list[float]] = defaultdict(list)
    for digit in range(digits):

        def kwargs(digit: int = digit) -> dict[str, Any]:
            return dict(
                prompt="a photograph", ip_adapter_image=tiny_digit_image(digit), num_inference_steps=steps,
                guidance_scale=7.5, output_type="np", generator=torch.Generator().manual_seed(0),
            )  # fmt: skip

        with nw_processor(pipe, untrained_control=True, untrained_seed=0) as recorder:
            pipe(**kwargs())
        per_layer = {tuple(r.get(k) for k in KEY): r for r in recorder.to_records()}
        raw = end_to_end_control(pipe, kwargs(), draws=1, seed=0, scale_match=False).records
        matched = end_to_end_control(pipe, kwargs(), draws=1, seed=0, scale_match=True).records
        cond = [r for r in raw if r["half"] == "cond" and r.get("key_set", "ip") == "ip"]
        cond_matched = [r for r in matched if r["half"] == "cond" and r.get("key_set", "ip") == "ip"]
        row: dict[str, float] = {"digit": digit}
        for stat in STATS:
            row[stat] = _mean(cond, stat)
            row[f"{stat}_per_layer"] = _mean(
                [{stat: _per_layer(per_layer[tuple(r.get(k) for k in KEY)], stat)} for r in cond], stat
            )
            row[f"{stat}_e2e"] = _mean(cond, f"{stat}_control_0")
            row[f"{stat}_e2e_matched"] = _mean(cond_matched, f"{stat}_control_0")
        row["log_key_scale"] = float(np.mean([math.log(r["key_scale_0"]) for r in cond]))
        per_reference.append(row)
        layers: dict[str, list[float]] = defaultdict(list)
        raw_per_layer = any("rho_untrained" in r for r in per_layer.values())
        for r in cond if raw_per_layer else cond_matched:  # the e2e run of the per-layer's matching
            twin = per_layer[tuple(r.get(k) for k in KEY)]
            layers[r["layer"]].append(r["rho_control_0"] - _per_layer(twin, "rho"))
        for layer, gaps in layers.items():
            by_layer[layer].append(float(np.mean(gaps)))
    return {"per_reference": per_reference, "rho_e2e_minus_per_layer_by_layer": dict(by_layer)}


def table(result: dict[str, Any]) -> str:
    rows = result["per_reference"]
    lines = [f"cond half, per reference mean over steps, layers, heads; {len(rows)} references, 95% t"]
    for stat in STATS:
        lines.append(f"{stat}:")
        for label, a, b in (
            ("end-to-end - per-layer (unmatched)", f"{stat}_e2e", f"{stat}_per_layer"),
            ("trained - per-layer (unmatched)", stat, f"{stat}_per_layer"),
            ("trained - end-to-end (unmatched)", stat, f"{stat}_e2e"),
            ("trained - end-to-end (scale matched)", stat, f"{stat}_e2e_matched"),
        ):
            mean, low, high = t_interval([r[a] - r[b] for r in rows])
            lines.append(f"  {label:38s} {mean:+.4f} [{low:+.4f}, {high:+.4f}]")
        means = ", ".join(
            f"{name} {np.mean([r[c] for r in rows]):.4f}"
            for name, c in (("trained", stat), ("per-layer", f"{stat}_per_layer"), ("e2e", f"{stat}_e2e"),
                            ("e2e matched", f"{stat}_e2e_matched"))
        )  # fmt: skip
        lines.append(f"  means: {means}")
    mean, low, high = t_interval([r["log_key_scale"] for r in rows])
    lines.append(
        f"key scale (geometric mean): {math.exp(mean):.3f} [{math.exp(low):.3f}, {math.exp(high):.3f}]"
    )
    lines.append("rho end-to-end - per-layer, by IP layer (mean over references):")
    for layer, gaps in result["rho_e2e_minus_per_layer_by_layer"].items():
        lines.append(f"  {layer.removesuffix('.processor'):60s} {np.mean(gaps):+.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--digits", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="end_to_end_readings.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    result = measure(steps=args.steps, digits=args.digits)
    text = table(result) + f"\nload average before {load_before}, after {os.getloadavg()}"
    print(text)
    atomic_write_text(args.out, json.dumps({**result, "steps": args.steps, "table": text}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
