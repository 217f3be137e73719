"""What calibration costs: one observed call against the same call with ``calibrate=True``.

Usage::

    python -m benchmarks.calibration_cost [--repeats 5] [--steps 25] [--out calibration_cost.json]

On the two shipped trained tiny models (``--model tiny``: SD 1.5 digits, PNDM, CFG; ``--model
tiny-flux-digits``: Flux digits, flow-matching Euler), one reference image of the bundled
examples, the per-layer control on (3 draws, as the command line runs it), two variants of one
call run interleaved in one process (:func:`benchmarks.timing.time_interleaved`): ``observe``
(:func:`nw_adapter.observe_call` without calibration) and ``calibrate`` (the same call with
``calibrate=True``: the adapter's pass, then the exact head's swap pass with statistics, the
columns merged). Reported: median wall and CPU seconds with the interquartile range, the ratio
to ``observe``, and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from benchmarks.timing import add_ratios, ratio_cells, time_interleaved, write_measurement
from nw_adapter.integration.calibration import observe_call
from nw_adapter.integration.config import NWProcessorConfig

VARIANTS = ("observe", "calibrate")
MODELS = ("tiny", "tiny-flux-digits")


def measure(model: str, *, steps: int, repeats: int) -> dict[str, Any]:
    """Interleaved timings of observe / calibrate on one trained tiny model (``MODELS``)."""
    from nw_adapter.models.loaders import load_tiny_digits, load_tiny_flux_digits, tiny_digit_image

    pipe = load_tiny_digits() if model == "tiny" else load_tiny_flux_digits()
    pipe.set_progress_bar_config(disable=True)
    image = tiny_digit_image(3)
    config = NWProcessorConfig(untrained_control=True)

    def kwargs() -> dict[str, Any]:
        return dict(
            prompt="a photograph", ip_adapter_image=image, num_inference_steps=steps, output_type="np",
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip

    variants = {
        "observe": lambda: observe_call(pipe, kwargs(), config=config),
        "calibrate": lambda: observe_call(pipe, kwargs(), config=config, calibrate=True),
    }
    results = time_interleaved(variants, repeats=repeats)
    return add_ratios(results, "observe")  # wall and CPU ratios


def table(results: dict[str, dict[str, Any]], steps: int) -> str:
    lines = [
        f"one reference, {steps} steps, control 3 draws: median s [q1-q3], ratio to observe (wall / CPU)"
    ]
    for model, by_variant in results.items():
        for name in VARIANTS:
            lines.append(f"  {model:16s} {name:9s} {ratio_cells(by_variant[name])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="calibration_cost.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = {model: measure(model, steps=args.steps, repeats=args.repeats) for model in MODELS}
    record = {"threads": args.threads, "steps": args.steps, "results": results}
    write_measurement(args.out, table(results, args.steps), record, (load_before, os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
