"""One short GPU run that answers what remains of issue 27: whole calls, timed and profiled.

For SD 1.5 at 512 px and SDXL at 1024 px (random weights, real architectures, base IP-Adapter,
CFG batch 2, fp16): one call = 10 UNet forwards at 10 timesteps, then the recorder's deferred
statistics and export (``to_records``), for stock, observe (the defaults) and swap.

- **Time per step**: CUDA events around each whole call (the host synchronises only before the
  start event and after the end event), variants interleaved (:func:`~benchmarks.timing.time_interleaved`),
  median / 10 forwards, ratio to stock.
- **Profile**: one call of each variant under :mod:`torch.profiler` (CPU and CUDA activity):
  the top kernels by device time and the kernel launches per step (``cudaLaunchKernel`` and
  its variants / 10), written as text beside the JSON.

On a CPU (``--device cpu``, for tests) the same code runs with the CPU timer and CPU activity.

Usage::

    python benchmarks/gpu_profile.py --out-dir benchmarks/gpu_results      # CUDA, fp16
    python benchmarks/gpu_profile.py --device cpu --dtype float32 --models toy --forwards 2
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.host_cost import VARIANTS as HOST_COST_VARIANTS  # noqa: E402
from benchmarks.host_cost import UNetCalls  # noqa: E402
from benchmarks.models import (  # noqa: E402
    SD15_UNET_CONFIG,
    SDXL_IMAGE_EMBED_DIM,
    SDXL_UNET_CONFIG,
    TOY_UNET_CONFIG,
    build_unet,
    unet_inputs,
)
from benchmarks.timing import add_ratios, machine_info, time_interleaved, timer_for  # noqa: E402

#: model name -> (UNet config, latent size, image embedding width).
MODELS: dict[str, tuple[dict[str, Any], int, int]] = {
    "sd15_512": (SD15_UNET_CONFIG, 64, 1024),
    "sdxl_1024": (SDXL_UNET_CONFIG, 128, SDXL_IMAGE_EMBED_DIM),
    "toy": (TOY_UNET_CONFIG, 8, 1024),
}
#: the variants run on the GPU (their processor options are host_cost's, installed by UNetCalls).
VARIANTS: dict[str, dict[str, Any]] = {name: HOST_COST_VARIANTS[name] for name in ("observe", "swap")}
#: observe with the deferred statistics compiled (CUDA graphs on CUDA), run for ``--compiled-models``.
COMPILED = {"observe_compiled": {**HOST_COST_VARIANTS["observe"], "compile": True}}
LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


class Calls(UNetCalls):
    """A UNet, its inputs and one whole call (forwards + the recorder's export) per variant."""

    variants = {**HOST_COST_VARIANTS, **COMPILED}

    def __init__(self, model: str, device: torch.device, dtype: torch.dtype, forwards: int) -> None:
        config, latent, width = MODELS[model]
        self.unet = build_unet(config, image_embed_dim=width, device=device, dtype=dtype)
        self.inputs = unet_inputs(self.unet, latent_size=latent, image_embed_dim=width, device=device)
        steps = torch.linspace(999, 1, forwards).round().long().tolist()
        self.timesteps = [torch.tensor(t, device=device) for t in steps]


def profile_call(calls: Calls, device: torch.device) -> dict[str, Any]:
    """One call under torch.profiler: the top-kernel table and the launches per forward."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        calls.call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    averages = prof.key_averages()
    sort = "cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    launches = sum(e.count for e in averages if e.key in LAUNCH_EVENTS)
    aten = sum(e.count for e in averages if e.key.startswith("aten::"))
    return {
        "launches_per_forward": launches / len(calls.timesteps),
        "aten_events_per_forward": aten / len(calls.timesteps),
        "table": averages.table(sort_by=sort, row_limit=15),
    }


def run(
    models: Sequence[str],
    device: torch.device,
    dtype: torch.dtype,
    forwards: int,
    repeats: int,
    compiled_models: Sequence[str] = (),
    on_model: Any = None,
) -> dict[str, Any]:
    """Timed and profiled calls of every model and variant (see the module docstring); the models
    in ``compiled_models`` also run ``observe_compiled`` (its first call compiles: reported as
    ``first_call_s``, outside the timed repeats). ``on_model(result)`` runs after each model (the
    CLI writes the files then, so a run stopped by a time cap keeps the models that finished)."""
    out: dict[str, Any] = {"machine": machine_info(device), "forwards": forwards, "models": {}}
    for model in models:
        calls = Calls(model, device, dtype, forwards)
        names = ["stock", *VARIANTS, *(COMPILED if model in compiled_models else ())]
        timed = time_interleaved(
            {name: calls.call for name in names},
            repeats=repeats,
            setup={name: (lambda n=name, c=calls: c.install(n)) for name in names},
            timer=timer_for(device),
        )
        add_ratios(timed, "stock")
        profiles = {}
        for name in names:
            calls.install(name)
            calls.call()
            profiles[name] = profile_call(calls, device)
        calls.install("stock")
        out["models"][model] = {
            name: {
                "step_ms": 1e3 * timed[name]["median"] / forwards,
                "ratio": timed[name]["ratio"],
                "host_cpu_ratio": timed[name]["cpu"]["ratio"],
                "first_call_s": timed[name].get("first_call_s"),
                **profiles[name],
            }
            for name in names
        }
        del calls
        if on_model is not None:
            on_model(out)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def summary(result: dict[str, Any]) -> str:
    """The per-step table, then each variant's top kernels."""
    lines = ["| model | variant | step | ratio | host CPU ratio | launches per step | aten per step |"]
    lines.append("|---|---|---|---|---|---|---|")
    for model, variants in result["models"].items():
        for name, r in variants.items():
            lines.append(
                f"| {model} | {name} | {r['step_ms']:.2f} ms | {r['ratio']:.3f}x | "
                f"{r['host_cpu_ratio']:.3f}x | {r['launches_per_forward']:.0f} | "
                f"{r['aten_events_per_forward']:.0f} |"
            )
    for model, variants in result["models"].items():
        for name, r in variants.items():
            lines += ["", f"## {model} / {name}: top kernels of one call", r["table"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print the summary and write ``profile.json`` / ``profile.txt`` into ``--out-dir``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--models", nargs="+", default=["sd15_512", "sdxl_1024"], choices=list(MODELS))
    parser.add_argument("--forwards", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/gpu_results"))
    parser.add_argument(
        "--compiled-models", nargs="*", default=[], choices=list(MODELS),
        help="models that also run observe with compile=True (CUDA graphs on CUDA)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_profile: --device cuda but CUDA is not available; pass --device cpu", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    from nw_adapter.atomic import atomic_write_text

    args.out_dir.mkdir(parents=True, exist_ok=True)

    def write(result: dict[str, Any]) -> None:
        atomic_write_text(args.out_dir / "profile.txt", summary(result) + "\n")
        atomic_write_text(args.out_dir / "profile.json", json.dumps(result, indent=1, default=str))

    dtype = getattr(torch, args.dtype)
    options = {"compiled_models": args.compiled_models, "on_model": write}
    result = run(args.models, device, dtype, args.forwards, args.repeats, **options)
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
