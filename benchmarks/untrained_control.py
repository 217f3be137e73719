"""What the scale-matched untrained-adapter control costs: whole pipeline calls with and without it.

Usage::

    python -m benchmarks.untrained_control [--repeats 7] [--steps 4] [--models digits,flux]
        [--out untrained_control.json]

For the shipped trained tiny model (``--model tiny``: SD 1.5 digits, base adapter, CFG) and the
tiny random Flux pipeline (32 px), four variants of one pipeline call run interleaved in one
process (:func:`benchmarks.timing.time_interleaved`): ``stock`` (diffusers' processors),
``observe`` (NW processors, the API defaults: control off), ``observe_control_k1``
(``untrained_control=True, untrained_draws=1``) and ``observe_control_k3`` (three draws, the
command line's default). Each variant's processors are installed untimed right before its run
(the control's one-time build of K draws is timed separately as ``build_s``). Reported: median
wall and CPU seconds with the interquartile range, and the ratios to ``observe`` (what the
control adds to observing) and to ``stock``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from benchmarks.timing import add_ratios, machine_info, time_interleaved
from nw_adapter.atomic import atomic_write_text
from nw_adapter.integration.control import UntrainedControl
from nw_adapter.integration.mixin import apply_nw_processor, remove_nw_processor

SIZE = 32
DRAWS = (1, 3)
"""The control's numbers of draws measured (1, and 3: the command line's default)."""


def _image() -> Image.Image:
    return Image.fromarray((np.random.RandomState(1).rand(SIZE, SIZE, 3) * 255).astype("uint8"))


def _digits(folder: Path):
    from nw_adapter.models.loaders import load_tiny_digits

    return load_tiny_digits(), {"guidance_scale": 7.5}


def _sd15(folder: Path):
    from diffusers import StableDiffusionPipeline

    from nw_adapter.models.tiny import ip_adapter_weight_name, save_tiny_ip_adapter, save_tiny_sd15

    model = save_tiny_sd15(folder / "sd15")
    adapter = folder / "ip"
    save_tiny_ip_adapter(adapter, variant="base", sdxl=False)
    pipe = StableDiffusionPipeline.from_pretrained(model)
    pipe.load_ip_adapter(adapter, subfolder="models", weight_name=ip_adapter_weight_name("base"))
    return pipe, {"guidance_scale": 7.5}


def _flux(folder: Path):
    from diffusers import FluxPipeline

    from nw_adapter.models.tiny_flow import (
        CLIP_FOLDER,
        FLUX_IP_WEIGHT,
        save_tiny_flux,
        save_tiny_flux_ip_adapter,
    )

    model = save_tiny_flux(folder / "flux")
    adapter = save_tiny_flux_ip_adapter(folder / "flux-ip")
    pipe = FluxPipeline.from_pretrained(model)
    pipe.load_ip_adapter(
        str(adapter),
        weight_name=FLUX_IP_WEIGHT,
        image_encoder_pretrained_model_name_or_path=str(adapter / CLIP_FOLDER),
        image_encoder_dtype=torch.float32,
    )
    return pipe, {"max_sequence_length": 16}


def _installer(pipe, draws: int):
    """Install the NW processors with the control of ``draws`` draws (untimed setup of a variant)."""
    return lambda: apply_nw_processor(pipe, untrained_control=True, untrained_draws=draws)


def measure(pipe, call_kwargs: dict[str, Any], *, steps: int, repeats: int) -> dict[str, Any]:
    """Interleaved timings of stock / observe / observe_control_k1 / observe_control_k3 for one pipeline."""
    pipe.set_progress_bar_config(disable=True)
    image = _image()

    def call() -> None:
        pipe(
            "a cat", ip_adapter_image=image, num_inference_steps=steps, height=SIZE, width=SIZE,
            output_type="np", generator=torch.Generator().manual_seed(0), **call_kwargs,
        )  # fmt: skip

    setup = {
        "stock": lambda: remove_nw_processor(pipe),
        "observe": lambda: apply_nw_processor(pipe),
        **{f"observe_control_k{k}": _installer(pipe, k) for k in DRAWS},
    }
    results = time_interleaved({name: call for name in setup}, repeats=repeats, setup=setup)
    remove_nw_processor(pipe)
    add_ratios(results, "stock")
    observe = results["observe"]
    denoiser = getattr(pipe, "unet", None) or pipe.transformer
    results["build_s"] = {}
    for k in DRAWS:
        control = results[f"observe_control_k{k}"]
        control["ratio_to_observe"] = control["median"] / observe["median"]
        control["cpu"]["ratio_to_observe"] = control["cpu"]["median"] / observe["cpu"]["median"]
        start = time.perf_counter()
        UntrainedControl.build(denoiser, seed=0, draws=k)
        results["build_s"][f"k{k}"] = time.perf_counter() - start
    return results


def table(name: str, results: dict[str, Any]) -> str:
    builds = ", ".join(f"{k} {v:.3f} s" for k, v in results["build_s"].items())
    lines = [f"{name}: median s [q1-q3], ratio to stock (wall / CPU); control build {builds}"]
    for variant in ("stock", "observe", *(f"observe_control_k{k}" for k in DRAWS)):
        r = results[variant]
        line = (
            f"  {variant:19s} {r['median']:.3f} [{r['q1']:.3f}-{r['q3']:.3f}]  "
            f"x{r['ratio']:.2f} / x{r['cpu']['ratio']:.2f}"
        )
        if variant.startswith("observe_control"):
            line += f"   vs observe: x{r['ratio_to_observe']:.2f} / x{r['cpu']['ratio_to_observe']:.2f}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="digits,flux", help="comma-separated: digits, sd15, flux")
    parser.add_argument("--out", default="untrained_control.json")
    args = parser.parse_args(argv)
    builders = {
        "digits": ("tiny digits (shipped, trained; base, CFG)", _digits),
        "sd15": ("tiny SD 1.5 (random; base, CFG)", _sd15),
        "flux": ("tiny Flux (random)", _flux),
    }
    chosen = [builders[m] for m in args.models.split(",")]
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    out: dict[str, Any] = {"machine": machine_info(), "threads": args.threads, "steps": args.steps}
    texts = []
    with tempfile.TemporaryDirectory() as folder:
        for name, build in chosen:
            pipe, kwargs = build(Path(folder))
            out[name] = measure(pipe, kwargs, steps=args.steps, repeats=args.repeats)
            texts.append(table(name, out[name]))
    out["loadavg_before"], out["loadavg_after"] = load_before, os.getloadavg()
    texts.append(f"load average (1, 5, 15 min) before {load_before}, after {out['loadavg_after']}")
    text = "\n".join(texts)
    print(text)
    out["table"] = text
    atomic_write_text(args.out, json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
