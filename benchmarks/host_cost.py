"""Host cost of observe and swap on a CPU proxy of a GPU run (issue 27).

On a GPU the stock SD 1.5 step is launch- and host-bound: what the plugin costs there is the
aten ops it dispatches and the Python it runs, not its arithmetic. This proxy measures exactly
that on the CPU: a UNet with SD 1.5's block structure (the same 16 IP-Adapter layers and the
same op sequence) at tiny widths (:data:`SD15_STRUCTURE`, 8 x 8 latents, CFG batch 2), where the
arithmetic is negligible.

- **Host CPU per call**: one call = a new call, 10 UNet forwards at 10 timesteps, then the
  recorder's export (``to_records``: every deferred statistic included); process CPU time,
  variants interleaved in one process (:func:`~benchmarks.timing.time_interleaved`), ratio of
  medians to stock.
- **Aten ops per forward**: every non-view aten op of one whole call (export included) / 10
  (:class:`~benchmarks.op_count.OpCounter`; deterministic).
- **Python calls per observed layer call**: ``sys.setprofile`` counts every Python function
  call (``"call"`` events) whose code lives in the ``nw_adapter`` package during one whole call
  (export included), divided by the number of IP-layer calls (16 layers x 10 forwards); also
  the calls made inside the layers alone (the captures, before the export).

Usage::

    python benchmarks/host_cost.py                 # 15 interleaved repeats
    python benchmarks/host_cost.py --repeats 5 --variants observe swap
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.models import SD15_UNET_CONFIG, build_unet, unet_inputs  # noqa: E402
from benchmarks.op_count import OpCounter  # noqa: E402
from benchmarks.timing import add_ratios, machine_info, time_interleaved  # noqa: E402

#: SD 1.5's UNet block structure at toy widths: the same 16 IP-Adapter layers, the same ops.
SD15_STRUCTURE: dict[str, Any] = {
    **SD15_UNET_CONFIG,
    "sample_size": 8,
    "block_out_channels": (32, 32, 64, 64),
    "cross_attention_dim": 32,
}
#: NW options of each variant (defaults otherwise: matched bandwidth, nulls and readings on).
VARIANTS: dict[str, dict[str, Any]] = {
    "observe": {"mode": "observe", "cfg": True},
    "observe_per_layer": {"mode": "observe", "cfg": True, "deferred_mb": 0},
    "swap": {"mode": "swap"},
}
FORWARDS = 10
#: Issue 27's targets (ratio to stock): host CPU per call and aten ops per forward.
TARGETS = {"observe": {"cpu": 1.30, "ops": 1.25}, "swap": {"cpu": 1.10, "ops": 1.02}}
PACKAGE_DIR = str(Path(__file__).resolve().parent.parent / "nw_adapter")


class UNetCalls:
    """A UNet, its inputs and timesteps, and one whole call of each variant (:data:`VARIANTS`);
    subclasses build the UNet (:class:`Proxy` here, the GPU models in ``gpu_profile.py``)."""

    unet: Any
    inputs: dict[str, Any]
    timesteps: list[torch.Tensor]
    recorder: Any = None
    #: variant name -> NW processor options (subclasses may add variants)
    variants: dict[str, dict[str, Any]] = VARIANTS

    def install(self, variant: str) -> None:
        """Put the variant's processors in place (stock: the original ones)."""
        from nw_adapter.integration.config import NWProcessorConfig
        from nw_adapter.integration.mixin import apply_nw_processor, remove_nw_processor

        remove_nw_processor(self.unet)
        self.recorder = None
        if variant != "stock":
            self.recorder = apply_nw_processor(self.unet, NWProcessorConfig(**self.variants[variant]))

    def forwards(self) -> None:
        """One forward per timestep, the recorder cleared and a new call begun first."""
        if self.recorder is not None:
            self.recorder.clear()
            self.recorder.new_call()
        with torch.no_grad():
            for t in self.timesteps:
                self.unet(**{**self.inputs, "timestep": t})

    def call(self) -> int:
        """One call: :meth:`forwards`, then the recorder's export (the deferred statistics
        included); returns the number of records (0 for stock)."""
        self.forwards()
        if self.recorder is None:
            return 0
        with torch.no_grad():
            return len(self.recorder.to_records())


class Proxy(UNetCalls):
    """The proxy UNet (SD 1.5's block structure at tiny widths), 10 forwards at 10 timesteps."""

    def __init__(self, latent_size: int = 8) -> None:
        self.unet = build_unet(SD15_STRUCTURE, image_embed_dim=32, image_hidden_dim=32)
        self.inputs = unet_inputs(self.unet, latent_size=latent_size, image_embed_dim=32)
        self.timesteps = [torch.tensor(t) for t in torch.linspace(999, 1, FORWARDS).round().long().tolist()]
        self.ip_layers = sum(1 for name in self.unet.attn_processors if "attn2" in name)


def count_python_calls(fn: Callable[[], Any], directory: str = PACKAGE_DIR) -> int:
    """Python function calls into ``directory`` during ``fn()`` (``sys.setprofile`` "call" events)."""
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event == "call" and frame.f_code.co_filename.startswith(directory):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def measure(variants: Sequence[str] = tuple(VARIANTS), repeats: int = 15) -> dict[str, Any]:
    """Ops, Python calls and interleaved CPU times of stock and ``variants`` (see the module docstring)."""
    torch.set_num_threads(1)
    proxy = Proxy()
    names = ["stock", *variants]
    ops: dict[str, float] = {}
    calls: dict[str, dict[str, float]] = {}
    for name in names:
        proxy.install(name)
        proxy.call()  # warm-up
        with OpCounter() as counter:
            proxy.call()
        ops[name] = counter.total / FORWARDS
        layer_calls = proxy.ip_layers * FORWARDS
        whole = count_python_calls(proxy.call)
        inside = count_python_calls(proxy.forwards)
        calls[name] = {"per_layer_call": whole / layer_calls, "in_layers": inside / layer_calls}
    timed = time_interleaved(
        {name: proxy.call for name in names},
        repeats=repeats,
        setup={name: (lambda n=name: proxy.install(n)) for name in names},
    )
    proxy.install("stock")
    add_ratios(timed, "stock")
    cpu = {}
    for n in names:  # also the median of the per-round ratios: steadier when the load drifts
        pairs = zip(timed[n]["cpu"]["times"], timed["stock"]["cpu"]["times"], strict=True)
        rounds = [t / s for t, s in pairs]
        cpu[n] = {
            "median_ms": 1e3 * timed[n]["cpu"]["median"],
            "ratio": timed[n]["cpu"]["ratio"],
            "round_ratio": statistics.median(rounds),
        }
    return {
        "machine": machine_info(),
        "forwards_per_call": FORWARDS,
        "ip_layers": proxy.ip_layers,
        "ops_per_forward": ops,
        "ops_ratio": {n: ops[n] / ops["stock"] for n in names},
        "python_calls": calls,
        "cpu": cpu,
        "timed": timed,
    }


def table(result: dict[str, Any]) -> str:
    """The issue's table: host CPU per call, aten ops per forward, Python calls per observed layer call."""
    lines = [
        "| variant | host CPU per call | ratio of medians | median of round ratios | aten ops per forward "
        "| ratio | nw_adapter Python calls per layer call (in the layers) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, cpu in result["cpu"].items():
        calls, ops = result["python_calls"][name], result["ops_per_forward"][name]
        lines.append(
            f"| {name} | {cpu['median_ms']:.0f} ms | {cpu['ratio']:.2f}x | {cpu['round_ratio']:.2f}x | "
            f"{ops:.0f} | {result['ops_ratio'][name]:.3f}x | "
            f"{calls['per_layer_call']:.0f} ({calls['in_layers']:.0f}) |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table (and write the JSON with ``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = measure(args.variants, args.repeats)
    print(table(result))
    if args.out is not None:
        from nw_adapter.atomic import atomic_write_text

        atomic_write_text(args.out, json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
