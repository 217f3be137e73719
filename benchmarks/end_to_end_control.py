"""What the end-to-end untrained-adapter control costs: observe alone against observe + K control passes.

Usage::

    python -m benchmarks.end_to_end_control [--repeats 5] [--steps 50] [--out end_to_end_control.json]

On the shipped trained tiny digits model (``--model tiny``: 32 px, DDIM, CFG, one reference image
of the bundled examples), three variants of one call run interleaved in one process
(:func:`benchmarks.timing.time_interleaved`): ``observe`` (``nw_processor(pipe)`` around one
call, the API defaults), ``e2e_k1`` and ``e2e_k3``
(:func:`~nw_adapter.integration.end_to_end.end_to_end_control` with 1 and 3 draws, scale
matched: the trained call observed, then K control calls observed, the columns merged). Reported:
median wall and CPU seconds with the interquartile range, the ratio to ``observe``, and the load
average before and after.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from benchmarks.timing import add_ratios, ratio_cells, time_interleaved, write_measurement
from nw_adapter.integration.end_to_end import end_to_end_control
from nw_adapter.integration.mixin import nw_processor

VARIANTS = ("observe", "e2e_k1", "e2e_k3")


def measure(*, steps: int, repeats: int) -> dict[str, Any]:
    """Interleaved timings of observe / e2e_k1 / e2e_k3 on the trained tiny digits model."""
    from diffusers import DDIMScheduler

    from nw_adapter.models.loaders import load_tiny_digits, tiny_digit_image

    pipe = load_tiny_digits()
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    image = tiny_digit_image(3)

    def kwargs() -> dict[str, Any]:
        return dict(
            prompt="a digit", ip_adapter_image=image, num_inference_steps=steps, output_type="np",
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip

    def observe() -> None:
        with nw_processor(pipe) as recorder:
            pipe(**kwargs())
        recorder.to_records(key_set=None)

    variants = {
        "observe": observe,
        "e2e_k1": lambda: end_to_end_control(pipe, kwargs(), draws=1),
        "e2e_k3": lambda: end_to_end_control(pipe, kwargs(), draws=3),
    }
    results = time_interleaved(variants, repeats=repeats)
    return add_ratios(results, "observe")  # wall and CPU ratios


def table(results: dict[str, Any], steps: int) -> str:
    lines = [f"trained tiny digits, {steps} DDIM steps, CFG: median s [q1-q3], ratio to observe (wall / CPU)"]
    for name in VARIANTS:
        lines.append(f"  {name:8s} {ratio_cells(results[name])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="end_to_end_control.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = measure(steps=args.steps, repeats=args.repeats)
    record = {"threads": args.threads, "steps": args.steps, "results": results}
    write_measurement(args.out, table(results, args.steps), record, (load_before, os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
