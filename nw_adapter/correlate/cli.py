"""``python scripts/correlate.py``: rho between IP-Adapter attention and NW weights, per timestep.

A reference image (or many) in; out come a terminal table per reported timestep, a one-line
verdict, and in ``--out``: ``rho.json`` (schema in docs/rho_json_schema.md), ``rho.csv``,
``rho.png`` and per image ``images/<key>/generated.png`` (plus, with ``--store-maps``,
``maps.safetensors`` and ``attention_maps.png``).

Order of work, so that bad input costs nothing and leaves nothing behind: parse and check
the options, validate every reference image, check that ``--out`` is writable, build and
check the processor configuration (all before torch/diffusers are imported), load the
model, then generate. Bad input exits with status 2 and one line on stderr naming the
problem and the fix; nothing is written before generation starts.

Example:
    $ python scripts/correlate.py --image ref.png --model tiny --steps 3
    $ python scripts/correlate.py --image ref.png            # SD 1.5 + h94/IP-Adapter
    $ accelerate launch --multi_gpu --num_processes 2 scripts/correlate.py --image-dir refs/
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from nw_adapter.correlate.images import (
    ImageInputError,
    ReferenceImage,
    collect_image_paths,
    load_reference_image,
    validate_images,
)
from nw_adapter.correlate.loading import (
    DEFAULT_IP_ADAPTER,
    DEFAULT_MODEL,
    DTYPES,
    SCHEDULERS,
    ModelLoadError,
    ModelSpec,
)
from nw_adapter.correlate.report import PAPER_TIMESTEPS

PROG = "correlate.py"
BLOCK_PREFIXES = {"down": "down_blocks", "mid": "mid_block", "up": "up_blocks"}
BANDWIDTH_RULES = ("matched", "fitted", "schedule", "median")


class CLIError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (no usage block) and raise :class:`CLIError`."""

    def error(self, message: str) -> NoReturn:
        raise CLIError(f"{' '.join(message.split())} (see --help)")


def _positive_int(name: str, *, maximum: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a whole number, got '{text}'") from None
        if value < 1 or (maximum is not None and value > maximum):
            bound = f"between 1 and {maximum}" if maximum else ">= 1"
            raise argparse.ArgumentTypeError(f"{name} must be {bound}, got {value}")
        return value

    return parse


def _nonneg_float(name: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got '{text}'") from None
        if not math.isfinite(value) or value < 0:
            raise argparse.ArgumentTypeError(f"{name} must be a finite number >= 0, got '{text}'")
        return value

    return parse


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed must be a whole number, got '{text}'") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"--seed must be between 0 and 2**63 - 1, got {value}")
    return value


def _size(text: str) -> int:
    value = _positive_int("--height/--width", maximum=8192)(text)
    if value % 8:
        raise argparse.ArgumentTypeError(f"--height/--width must be a multiple of 8, got {value}")
    return value


def _bandwidth(text: str) -> str | float:
    if text in BANDWIDTH_RULES:
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--bandwidth must be one of {', '.join(BANDWIDTH_RULES)} or a positive number, got '{text}'"
        ) from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"--bandwidth must be a positive finite number, got '{text}'")
    return value


def _layers(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(
            f"--layers must be comma-separated names without empty entries, got '{text}' "
            "(e.g. up or down,mid or up_blocks.1)"
        )
    return [BLOCK_PREFIXES.get(p, p) for p in parts]


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of ``correlate.py``."""
    parser = _Parser(
        prog=PROG,
        description=(
            "Generate with IP-Adapter and report, per denoising timestep, how closely the image branch's "
            "cross-attention follows Nadaraya-Watson (Gaussian-kernel) weights: Spearman rho with its three "
            "nulls, Pearson, KL and effective sample sizes, averaged over layers and heads."
        ),
        epilog=(
            "Quick offline run: --model tiny --steps 3. Several processes: accelerate launch --multi_gpu "
            "--num_processes N correlate.py ... (on CPU-only machines too; see the README)."
        ),
    )
    src = parser.add_argument_group("reference images")
    src.add_argument(
        "--image", action="append", default=[], metavar="FILE", help="reference image (repeatable)"
    )
    src.add_argument(
        "--image-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="folder of reference images, non-recursive (repeatable)",
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"diffusers pipeline: Hub id, local folder, or 'tiny' (default {DEFAULT_MODEL})",
    )
    model.add_argument(
        "--ip-adapter",
        default=None,
        help=f"IP-Adapter repository: Hub id, local folder, or 'tiny' (default {DEFAULT_IP_ADAPTER}; "
        "the tiny adapter with --model tiny)",
    )
    model.add_argument(
        "--subfolder", default=None, help="adapter subfolder (default models, sdxl_models for SDXL)"
    )
    model.add_argument(
        "--weight-name",
        default=None,
        help="weight file (default ip-adapter_sd15.safetensors; ip-adapter_sdxl.safetensors for SDXL)",
    )
    model.add_argument(
        "--scheduler", choices=sorted(SCHEDULERS), default=None, help="default: the model's own"
    )
    model.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N")
    model.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: float16 on CUDA, float32 else")
    gen = parser.add_argument_group("generation")
    gen.add_argument("--prompt", default="a photograph", help="text prompt (default 'a photograph')")
    gen.add_argument("--negative-prompt", default=None, help="negative prompt")
    gen.add_argument("--steps", type=_positive_int("--steps", maximum=1000), default=50, help="default 50")
    gen.add_argument("--seed", type=_seed, default=0, help="seed of the generation and the nulls (default 0)")
    gen.add_argument(
        "--guidance-scale", type=_nonneg_float("--guidance-scale"), default=7.5, help="default 7.5"
    )
    gen.add_argument(
        "--ip-scale", type=_nonneg_float("--ip-scale"), default=1.0, help="IP-Adapter scale (1.0)"
    )
    gen.add_argument(
        "--height", type=_size, default=None, help="pixels, multiple of 8 (default: the model's)"
    )
    gen.add_argument("--width", type=_size, default=None, help="pixels, multiple of 8 (default: the model's)")
    nw = parser.add_argument_group("NW comparison")
    nw.add_argument(
        "--mode",
        choices=("observe", "swap"),
        default="observe",
        help="observe (output unchanged) or swap the image branch for the exact NW head",
    )
    nw.add_argument(
        "--bandwidth",
        type=_bandwidth,
        default="matched",
        help="matched | fitted | schedule | median | a positive number h (default matched)",
    )
    nw.add_argument(
        "--layers",
        type=_layers,
        default=None,
        help="comma-separated blocks (down, mid, up) or attention-processor name prefixes",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--out", type=Path, default=Path("correlate_out"), help="output folder (default ./correlate_out)"
    )
    out.add_argument(
        "--store-maps",
        action="store_true",
        help="keep attention and NW maps at the reported steps; draw attention_maps.png",
    )
    out.add_argument(
        "--all-steps", action="store_true", help="table of every step, not only the paper's five"
    )
    out.add_argument("--quiet", action="store_true", help="no progress bars or notes")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the options (no file system access beyond reading nothing).

    Raises:
        CLIError: Unknown options, bad values, nothing to do.
    """
    args = build_parser().parse_args(argv)
    if not args.image and not args.image_dir:
        raise CLIError("no reference image given; pass --image FILE or --image-dir FOLDER")
    for name in ("prompt", "model"):
        if not getattr(args, name).strip():
            raise CLIError(f"--{name} is empty; pass a non-empty value")
    return args


def check_output_dir(out: Path) -> Path:
    """Check, without leaving anything behind, that ``out`` can be created and written.

    Raises:
        CLIError: ``out`` is a file, sits under a file, or is not writable.
    """
    out = out.expanduser()
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out '{out}': exists and is not a folder; pass a folder path")
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise CLIError(
            f"--out '{out}': '{probe}' is a file, so the folder cannot be created; pass another path"
        )
    try:
        handle, name = tempfile.mkstemp(prefix=".nw-adapter-write-check-", dir=probe)
        os.close(handle)
        os.unlink(name)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise CLIError(
            f"--out '{out}': cannot write in '{probe}' ({reason}); pass a writable folder"
        ) from None
    return out


def processor_config(args: argparse.Namespace, map_steps: Sequence[int] | None = None):
    """The :class:`~nw_adapter.integration.config.NWProcessorConfig` of the options.

    Statistics are recorded in swap mode too (the comparison is the point of this script);
    maps, with ``--store-maps``, are kept head-averaged at ``map_steps``.
    """
    from nw_adapter.integration.config import NWProcessorConfig

    options: dict[str, Any] = {
        "mode": args.mode,
        "bandwidth": args.bandwidth,
        "layers": args.layers,
        "statistics": True,
        "seed": args.seed,
        "store_maps": args.store_maps,
    }
    if args.store_maps:
        options.update(map_steps=list(map_steps) if map_steps else None, map_head_mean=True)
    return NWProcessorConfig(**options)


def run_options(args: argparse.Namespace, spec: ModelSpec, device: str, dtype: str) -> dict:
    """The options recorded in ``rho.json`` (and fingerprinted for resuming)."""
    return {
        "model": spec.to_dict(),
        "prompt": args.prompt,
        "negative_prompt": args.negative_prompt,
        "steps": args.steps,
        "seed": args.seed,
        "guidance_scale": args.guidance_scale,
        "ip_scale": args.ip_scale,
        "height": args.height,
        "width": args.width,
        "scheduler": args.scheduler,
        "mode": args.mode,
        "bandwidth": args.bandwidth,
        "layers": args.layers,
        "store_maps": args.store_maps,
        "device": device,
        "dtype": dtype,
    }


def _note(args: argparse.Namespace, state: Any, text: str) -> None:
    if not args.quiet and state.is_main_process:
        print(f"note: {text}", file=sys.stderr)


def _quiet_libraries(verbose: bool) -> None:
    """Keep library warnings off stderr, so errors stay one line (before importing them)."""
    if not verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_VERBOSITY", "error")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def reported_steps(pipe: Any, steps: int, *, all_steps: bool = False) -> tuple[list[int], dict[int, float]]:
    """Step indices (UNet calls) whose timesteps are closest to the paper's, and every step's timestep.

    Uses a copy of the pipeline's scheduler, so the pipeline itself is untouched.
    """
    from nw_adapter.correlate.report import select_steps

    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(steps)
    rows = [{"step": i, "timestep": float(t)} for i, t in enumerate(scheduler.timesteps.tolist())]
    chosen = select_steps(rows, () if all_steps else PAPER_TIMESTEPS)
    return [r["step"] for r in chosen], {r["step"]: r["timestep"] for r in rows}


def _device_and_state(requested: str) -> tuple[str, Any]:
    """Resolve ``--device`` and join the other processes when launched distributed.

    Under a multi-process launch, ``auto`` and a bare accelerator name (``cuda``) become the
    process's own device (``cuda:<local rank>``) from ``PartialState``; an explicit index is kept.
    """
    from nw_adapter.correlate.loading import resolve_device
    from nw_adapter.correlate.sweep import is_distributed_launch, process_state

    device = resolve_device(requested)
    state = process_state(cpu=device == "cpu")
    if is_distributed_launch() and device != "cpu" and ":" not in requested:
        device = str(state.device)
    return device, state


def _image_worker(
    args: argparse.Namespace, pipe: Any, config: Any, infos: dict[str, ReferenceImage], out_dir: Path
):
    """``work(key) -> (image_entry, records)`` for :func:`nw_adapter.correlate.sweep.run_sweep`."""
    import torch

    from nw_adapter.atomic import atomic_write
    from nw_adapter.correlate.plotting import panels_from_maps, plot_attention_maps
    from nw_adapter.correlate.sweep import image_dir
    from nw_adapter.integration.mixin import nw_processor

    def work(key: str) -> tuple[dict, list[dict]]:
        info = infos[key]
        reference, _ = load_reference_image(info.path)
        folder = image_dir(out_dir, key)
        generator = torch.Generator(device="cpu").manual_seed(args.seed)
        with nw_processor(pipe, config) as recorder:
            output = pipe(
                prompt=args.prompt,
                negative_prompt=args.negative_prompt,
                ip_adapter_image=reference,
                num_inference_steps=args.steps,
                guidance_scale=args.guidance_scale,
                height=args.height,
                width=args.width,
                generator=generator,
            )
        generated = output.images[0]
        relative = folder.relative_to(out_dir)
        atomic_write(folder / "generated.png", lambda tmp: generated.save(tmp))
        entry = {**info.to_dict(), "generated": str(relative / "generated.png")}
        records = [{"reference": key, **record} for record in recorder.to_records()]
        if args.store_maps:
            recorder.save_maps(folder / "maps.safetensors")
            panels = panels_from_maps(
                recorder.maps(),
                timesteps={r["step"]: r["timestep"] for r in records},
                image_hw=(generated.height, generated.width),
                cfg=bool(getattr(pipe, "do_classifier_free_guidance", False)),
            )
            plot_attention_maps(generated, panels, folder / "attention_maps.png")
            entry.update(
                maps=str(relative / "maps.safetensors"), attention_maps=str(relative / "attention_maps.png")
            )
        return entry, records

    return work


def run(args: argparse.Namespace, infos: Sequence[ReferenceImage], out_dir: Path) -> int:
    """Load the model, compute every (unfinished) image, and on the main process write the report."""
    from nw_adapter.correlate.loading import build_pipeline, resolve_dtype, resolve_spec
    from nw_adapter.correlate.plotting import plot_rho
    from nw_adapter.correlate.report import build_report, format_report, write_report_files
    from nw_adapter.correlate.sweep import fingerprint, run_sweep
    from nw_adapter.integration.mixin import apply_nw_processor, remove_nw_processor

    if args.quiet:
        import diffusers
        import transformers

        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
    device, state = _device_and_state(args.device)
    for info in infos:
        for text in info.notes:
            _note(args, state, f"{info.path.name}: {text}")
    spec = resolve_spec(ModelSpec(args.model, args.ip_adapter, args.subfolder, args.weight_name))
    dtype = resolve_dtype(args.dtype, device)
    pipe = build_pipeline(spec, device=device, dtype=dtype, scheduler=args.scheduler)
    pipe.set_progress_bar_config(disable=args.quiet or not state.is_main_process, leave=False)
    pipe.set_ip_adapter_scale(args.ip_scale)
    map_steps, _ = reported_steps(pipe, args.steps, all_steps=args.all_steps)
    config = processor_config(args, map_steps)
    apply_nw_processor(pipe, config)  # checks --layers against this model's IP-Adapter layers
    remove_nw_processor(pipe)
    shown = ModelSpec(
        model=args.model,
        ip_adapter=args.ip_adapter or ("tiny" if args.model == "tiny" else DEFAULT_IP_ADAPTER),
        subfolder=spec.subfolder,
        weight_name=spec.weight_name,
    )
    options = run_options(args, shown, device, str(dtype).removeprefix("torch."))
    options["scheduler_class"] = type(pipe.scheduler).__name__
    by_key = {info.key: info for info in infos}
    outcome = run_sweep(
        list(by_key),
        _image_worker(args, pipe, config, by_key, out_dir),
        out_dir=out_dir,
        expected_fingerprint=fingerprint(options),
        state=state,
        progress=not args.quiet and state.is_main_process,
    )
    if state.num_processes > 1 and not args.quiet:
        print(
            f"note: process {state.process_index}/{state.num_processes} computed "
            f"{len(outcome.computed)} image(s)",
            file=sys.stderr,
        )
    if outcome.reused:
        _note(args, state, f"resumed: {len(outcome.reused)} finished image(s) reused from {out_dir}")
    if not state.is_main_process:
        return 0
    records = [record for result in outcome.results for record in result["records"]]
    report = build_report(
        records,
        config=options,
        images=[result["image"] for result in outcome.results],
        targets=() if args.all_steps else PAPER_TIMESTEPS,
    )
    write_report_files(report, out_dir)
    plot_rho(
        report["blocks"],
        out_dir / "rho.png",
        title=f"{args.model}, {args.steps} steps, bandwidth {args.bandwidth}, {len(infos)} reference(s)",
    )
    print(format_report(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 ok, 2 bad input, 130 interrupted)."""
    try:
        args = parse_args(argv)
        infos = validate_images(collect_image_paths(args.image, args.image_dir))
        out_dir = check_output_dir(args.out)
        processor_config(args)  # option errors now, before any model is loaded
        _quiet_libraries(verbose=False)
        return run(args, infos, out_dir)
    except (CLIError, ImageInputError, ModelLoadError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        if "NWProcessorConfig" in str(exc) or "IP-Adapter" in str(exc):
            print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        print(
            f"{PROG}: interrupted; finished images are kept, rerun the same command to resume",
            file=sys.stderr,
        )
        return 130
