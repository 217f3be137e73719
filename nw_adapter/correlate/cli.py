"""``python scripts/correlate.py``: rho between IP-Adapter attention and NW weights, per timestep.

A reference image (or many) in; out come a terminal table per reported timestep, a one-line
verdict, and in ``--out``: ``rho.json`` (schema in docs/rho_json_schema.md), ``rho.csv``,
``rho.png`` and per image ``images/<key>/generated.png`` (plus, with ``--store-maps``,
``maps.safetensors``, the x0 estimates ``x0_step<s>.png`` and ``attention_maps.png``).
``--replot OUT`` redraws all of it from a finished run's files without loading a model.

Order of work, so that bad input costs nothing and leaves nothing behind: parse and check
the options, validate every reference image, check that ``--out`` and the folders that will be
written there are writable, build and check the processor configuration (all before
torch/diffusers are imported), load the model, take the lock on ``--out``, then generate.
Bad input exits with status 2 and one line on stderr naming the problem and the fix; nothing
is written before generation starts. A write failure during the run (full disk, size limit)
exits 2 with one line too; the images finished before it are kept and a rerun resumes.

Verbosity: progress bars only when stderr is a terminal and without ``-q``; notes unless
``-qq``; the libraries' own warnings only with ``-v``.

This module imports neither torch nor diffusers (nor transformers, accelerate, huggingface_hub):
``--help``, ``--example-dir`` and every argument error answer before any of them is loaded
(tests/correlate/test_cli_imports.py; the numbers in benchmarks/cli_startup.py). The usage line and
the error prefix name the command as it was invoked (``nw-correlate``, ``correlate.py``,
``python -m nw_adapter.correlate``; :func:`nw_adapter.commands.invoked_as`).

Example:
    $ python scripts/correlate.py --image ref.png --model tiny --steps 3
    $ python scripts/correlate.py --image ref.png            # SD 1.5 + h94/IP-Adapter
    $ accelerate launch --multi_gpu --num_processes 2 scripts/correlate.py --image-dir refs/
    $ python scripts/correlate.py --replot correlate_out
    $ python scripts/correlate.py --compare-swap --image-dir refs/ --model tiny   # stock vs NW head
    $ nw-correlate --image-dir "$(nw-correlate --example-dir)" --model tiny   # the bundled digits
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nw_adapter.atomic import WriteError
from nw_adapter.commands import OneLineParser, invoked_as, note, progress_line
from nw_adapter.correlate import support_cli, swap_cli
from nw_adapter.correlate.end_to_end_cli import (
    add_end_to_end_arguments,
    end_to_end_error,
    end_to_end_meta,
    run_end_to_end,
)
from nw_adapter.correlate.families import UNET_BLOCKS
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
    OFFLINE_MODELS,
    SCHEDULERS,
    ModelLoadError,
    ModelSpec,
    check_model_name,
)
from nw_adapter.correlate.outputs import (
    OutputError,
    OutputLock,
    check_image_result_file,
    check_output_dir,
    draw_image_maps,
    remove_interrupted_writes,
    remove_report,
    replot,
    skipped_note,
    write_outputs,
)
from nw_adapter.correlate.report import PAPER_TIMESTEPS
from nw_adapter.correlate.spec import EXAMPLE_DIR
from nw_adapter.correlate.support_cli import SupportSetError
from nw_adapter.correlate.swap_cli import CompareSwapError
from nw_adapter.integration.config import BANDWIDTH_RANGE, MAX_CONTROL_DRAWS
from nw_adapter.integration.errors import NWConfigError, NWInstallError

PROG = "correlate.py"
BLOCK_PREFIXES = UNET_BLOCKS
BANDWIDTH_RULES = ("matched", "fitted", "schedule", "median")


class CLIError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


class _Parser(OneLineParser):
    """ArgumentParser whose errors are one line (no usage block) and raise :class:`CLIError`."""

    error_class = CLIError


class _ExampleDir(argparse.Action):
    """``--example-dir``: print the folder of the bundled example references and exit (like ``--version``)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(EXAMPLE_DIR)
        parser.exit()


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


def _seed(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a whole number, got '{text}'") from None
        if not 0 <= value < 2**63:
            raise argparse.ArgumentTypeError(f"{name} must be between 0 and 2**63 - 1, got {value}")
        return value

    return parse


def _size(name: str):
    def parse(text: str) -> int:
        value = _positive_int(name, maximum=8192)(text)
        if value % 8:
            raise argparse.ArgumentTypeError(f"{name} must be a multiple of 8, got {value}")
        return value

    return parse


def _bandwidth(text: str) -> str | float:
    if text in BANDWIDTH_RULES:
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--bandwidth must be one of {', '.join(BANDWIDTH_RULES)} or a positive number, got '{text}'"
        ) from None
    low, high = BANDWIDTH_RANGE
    if not math.isfinite(value) or not low <= value <= high:
        raise argparse.ArgumentTypeError(
            f"--bandwidth must be a number h in the usable range [{low:g}, {high:g}] "
            f"(or a rule name), got '{text}'"
        )
    return value


def _layers(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(
            f"--layers must be comma-separated names without empty entries, got '{text}' "
            "(e.g. up or down,mid or up_blocks.1)"
        )
    return [BLOCK_PREFIXES.get(p, p) for p in parts]


def _family_default(family: str, field: str) -> str:
    from nw_adapter.correlate.families import FAMILIES

    return getattr(FAMILIES[family], field)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command-line parser of ``correlate.py`` (``prog``: the command as invoked, for the usage line)."""
    parser = _Parser(
        prog=prog,
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
    src.add_argument(
        "--example-dir",
        action=_ExampleDir,
        help="print the folder of the bundled held-out digits digit_0.png ... digit_9.png (references for "
        '--model tiny) and exit; e.g. --image-dir "$(%(prog)s --example-dir)"',
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"diffusers pipeline: Hub id, local folder, or 'tiny' (default {DEFAULT_MODEL}); SD 3.5 "
        "(e.g. stabilityai/stable-diffusion-3.5-large) and Flux (e.g. black-forest-labs/FLUX.1-dev) "
        "pipelines are recognised from the pipeline and get their family's adapter; 'tiny-sd3' and "
        "'tiny-flux' are their offline tiny models (random weights)",
    )
    model.add_argument(
        "--ip-adapter",
        default=None,
        help=f"IP-Adapter repository: Hub id, local folder, or 'tiny' (default {DEFAULT_IP_ADAPTER}; "
        f"{_family_default('sd3', 'ip_adapter')} for SD 3.5, {_family_default('flux', 'ip_adapter')} "
        "for Flux; the tiny adapter with --model tiny / tiny-sd3 / tiny-flux)",
    )
    model.add_argument(
        "--subfolder",
        default=None,
        help="adapter subfolder (default models, sdxl_models for SDXL, none for SD 3.5 and Flux)",
    )
    model.add_argument(
        "--weight-name",
        default=None,
        help="weight file (default ip-adapter_sd15.safetensors; ip-adapter_sdxl.safetensors for SDXL; "
        f"{_family_default('sd3', 'weight_name')} for SD 3.5; {_family_default('flux', 'weight_name')} "
        "for Flux)",
    )
    model.add_argument(
        "--image-encoder",
        default=None,
        help=f"image encoder of SD 3.5 / Flux adapters: Hub id or local folder (default "
        f"{_family_default('sd3', 'image_encoder')} for SD 3.5, "
        f"{_family_default('flux', 'image_encoder')} for Flux)",
    )
    model.add_argument(
        "--scheduler", choices=sorted(SCHEDULERS), default=None, help="default: the model's own"
    )
    model.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N")
    model.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: float16 on CUDA, float32 else")
    gen = parser.add_argument_group("generation")
    gen.add_argument(
        "--prompt", default="a photograph", help="text prompt (default 'a photograph'; '' for none)"
    )
    gen.add_argument("--negative-prompt", default=None, help="negative prompt")
    gen.add_argument("--steps", type=_positive_int("--steps", maximum=1000), default=50, help="default 50")
    gen.add_argument(
        "--seed", type=_seed("--seed"), default=0, help="seed of the generation and the nulls (default 0)"
    )
    gen.add_argument(
        "--guidance-scale", type=_nonneg_float("--guidance-scale"), default=7.5, help="default 7.5"
    )
    gen.add_argument(
        "--ip-scale", type=_nonneg_float("--ip-scale"), default=1.0, help="IP-Adapter scale (1.0)"
    )
    gen.add_argument(
        "--true-cfg-scale",
        type=_nonneg_float("--true-cfg-scale"),
        default=1.0,
        help="Flux only: true classifier-free guidance with --negative-prompt when > 1 (two transformer "
        "passes per step, reported as the cond / uncond halves); default 1.0",
    )
    gen.add_argument(
        "--height", type=_size("--height"), default=None, help="pixels, multiple of 8 (default: the model's)"
    )
    gen.add_argument(
        "--width", type=_size("--width"), default=None, help="pixels, multiple of 8 (default: the model's)"
    )
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
        help="comma-separated blocks (down, mid, up for UNets; transformer_blocks for SD 3.5 / Flux) "
        "or attention-processor name prefixes",
    )
    nw.add_argument(
        "--no-untrained-control",
        dest="untrained_control",
        action="store_false",
        help="skip the scale-matched untrained-adapter control (the same queries against the keys of the "
        "IP-Adapter training recipe's initialisation, rescaled to the trained keys' RMS norm; "
        "{X}_control_{k} and key_scale_{k} columns; on by default; docs/controls.md)",
    )
    nw.add_argument(
        "--control-draws",
        type=_positive_int("--control-draws", maximum=MAX_CONTROL_DRAWS),
        default=3,
        metavar="K",
        help="number of untrained-adapter control draws, seeded --untrained-seed + k (default 3)",
    )
    nw.add_argument(
        "--untrained-seed",
        type=_seed("--untrained-seed"),
        default=0,
        help="seed s of the untrained adapters' initialisation: draw k uses s + k (default 0)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--out", default="correlate_out", help="output folder (default ./correlate_out)")
    out.add_argument(
        "--store-maps",
        action="store_true",
        help="keep attention and NW maps at the reported steps; draw attention_maps.png",
    )
    out.add_argument(
        "--all-steps", action="store_true", help="table of every step, not only the paper's five"
    )
    out.add_argument(
        "--replot",
        metavar="OUT",
        default=None,
        help="redraw the table, verdict and figures of a finished run in OUT from its saved files "
        "(rho.json, maps.safetensors, generated.png), without loading a model; no --image needed",
    )
    out.add_argument(
        "-q",
        "--quiet",
        action="count",
        default=0,
        help="-q: no progress bars; -qq: no notes either (errors, the table and the verdict remain). "
        "Progress bars are drawn only when stderr is a terminal",
    )
    out.add_argument(
        "-v", "--verbose", action="store_true", help="also show the libraries' own warnings and notes"
    )
    swap_cli.add_arguments(parser)  # --compare-swap, --swap-rules, --labels
    support_cli.add_arguments(parser)  # --support-set, --support-dir
    add_end_to_end_arguments(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None, *, prog: str = PROG) -> argparse.Namespace:
    """Parse and check the options (the file system only to tell a local ``--model`` folder from a name).

    Raises:
        CLIError: Unknown options, bad values, nothing to do.
        ModelLoadError: a ``--model`` / ``--ip-adapter`` that is no folder, Hub id or offline model.
    """
    args = build_parser(prog).parse_args(argv)
    args.prog = prog
    args.out_given_empty = not args.out.strip()
    args.out = Path(args.out)
    if args.replot is not None:
        if not args.replot.strip():
            raise CLIError("--replot is empty; pass the --out folder of a finished run")
        if args.image or args.image_dir:
            raise CLIError("--replot redraws a finished run and takes no --image/--image-dir; drop them")
        return args
    support_cli.check_options(args)
    if not args.image and not args.image_dir and not (args.support_set or args.support_dir):
        raise CLIError(
            "no reference image given; pass --image FILE or --image-dir FOLDER (or --support-set A,B)"
        )
    if not args.model.strip():
        raise CLIError(f"--model is empty; pass a Hub id, a local folder or {' / '.join(OFFLINE_MODELS)}")
    check_model_name(args.model, "--model")
    if args.ip_adapter is not None:
        if not args.ip_adapter.strip():
            raise CLIError("--ip-adapter is empty; pass a Hub id, a local folder or tiny, or omit it")
        check_model_name(args.ip_adapter, "--ip-adapter")
    refused = end_to_end_error(args, "unet")  # the options that need no model (SD 3.5: after loading)
    if refused:
        raise CLIError(refused)
    if not str(args.out).strip() or args.out_given_empty:
        raise CLIError("--out is empty; pass a folder path (e.g. --out correlate_out)")
    for option, values in (("--image", args.image), ("--image-dir", args.image_dir)):
        if any(not str(v).strip() for v in values):
            raise CLIError(f"{option} is empty; pass a path (use . for the current folder)")
    return args


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
        # the end-to-end control writes the control columns itself (from its own passes)
        "untrained_control": args.untrained_control and not args.end_to_end_control,
        "untrained_seed": args.untrained_seed,
        "untrained_draws": args.control_draws,
    }
    if args.store_maps:
        options.update(map_steps=list(map_steps) if map_steps else None, map_head_mean=True)
    return NWProcessorConfig(**options)


def run_options(args: argparse.Namespace, spec: ModelSpec, device: str, dtype: str) -> dict:
    """The options recorded in ``rho.json`` (and fingerprinted for resuming)."""
    per_layer = args.untrained_control and not args.end_to_end_control
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
        "untrained_control": per_layer,
        "untrained_seed": args.untrained_seed if per_layer else None,
        "untrained_draws": args.control_draws if per_layer else None,
        "end_to_end_control": end_to_end_meta(args),
        "device": device,
        "dtype": dtype,
    }


def show_progress_bars(args: argparse.Namespace) -> bool:
    """Progress bars only without ``-q`` and when stderr is a terminal.

    Captured or piped output (a log file, ``2>&1`` into a file) gets no bars, so their carriage
    returns never share a line with the table printed on stdout.
    """
    isatty = getattr(sys.stderr, "isatty", None)
    return args.quiet == 0 and bool(isatty and isatty())


def _quiet_libraries(verbose: bool, bars: bool) -> None:
    """Keep library warnings (and, without ``bars``, their progress bars) off stderr, before importing them.

    Set only where the user has not chosen: an environment variable already set is kept.
    """
    if not verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_VERBOSITY", "error")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if not bars:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@contextlib.contextmanager
def _library_output(*, verbose: bool, bars: bool):
    """Within the block: libraries' loggers at error level (unless verbose), their bars off (unless bars).

    Restores the previous levels and bar settings afterwards (the CLI also runs in-process in tests
    and notebooks).
    """
    import diffusers
    import transformers

    loggers = (diffusers.utils.logging, transformers.utils.logging)
    levels = [log.get_verbosity() for log in loggers]
    enabled = [log.is_progress_bar_enabled() for log in loggers]
    try:
        for log in loggers:
            if not verbose:
                log.set_verbosity_error()
            if not bars:
                log.disable_progress_bar()
        yield
    finally:
        for log, level, was_enabled in zip(loggers, levels, enabled, strict=True):
            log.set_verbosity(level)
            (log.enable_progress_bar if was_enabled else log.disable_progress_bar)()


def reported_steps(
    pipe: Any, steps: int, *, all_steps: bool = False, height: int | None = None, width: int | None = None
) -> tuple[list[int], dict[int, float]]:
    """Step indices (UNet calls) whose timesteps are closest to the paper's, and every step's timestep.

    Uses a copy of the pipeline's scheduler, so the pipeline itself is untouched (flow-matching
    pipelines: the sigmas and shift they pass, see :func:`nw_adapter.correlate.families.planned_timesteps`).
    """
    from nw_adapter.correlate.families import planned_timesteps
    from nw_adapter.correlate.report import select_steps

    timesteps = planned_timesteps(pipe, steps, height, width)
    rows = [{"step": i, "timestep": t} for i, t in enumerate(timesteps)]
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
    args: argparse.Namespace,
    pipe: Any,
    config: Any,
    infos: dict[str, ReferenceImage],
    out_dir: Path,
    extra_call: dict[str, Any] | None = None,
    run_id: str | None = None,
):
    """``work(key) -> (image_entry, records)`` for :func:`nw_adapter.correlate.sweep.run_sweep`;
    the records' ``run`` is ``run_id`` (one per run: the sweep's fingerprint) when given."""
    import torch

    from nw_adapter.atomic import atomic_write
    from nw_adapter.correlate import families
    from nw_adapter.correlate.previews import X0Previews
    from nw_adapter.correlate.sweep import image_dir
    from nw_adapter.integration.mixin import nw_processor

    def work(key: str) -> tuple[dict, list[dict]]:
        info = infos[key]
        reference, _ = load_reference_image(info.path)
        folder = image_dir(out_dir, key)
        generator = torch.Generator(device="cpu").manual_seed(args.seed)
        call = {
            "prompt": args.prompt,
            "negative_prompt": args.negative_prompt,
            "ip_adapter_image": reference,
            "num_inference_steps": args.steps,
            "guidance_scale": args.guidance_scale,
            "height": args.height,
            "width": args.width,
            "generator": generator,
            **(extra_call or {}),
        }
        run = {"run": run_id} if run_id else {}
        if args.end_to_end_control:  # the trained call and K untrained passes (no maps: refused above)
            output, recorded, _ = run_end_to_end(args, pipe, config, call)
            atomic_write(folder / "generated.png", lambda tmp: output.images[0].save(tmp))
            entry = {**info.to_dict(), "generated": str(folder.relative_to(out_dir) / "generated.png")}
            return entry, [{"reference": key, **record, **run} for record in recorded]
        with contextlib.ExitStack() as stack:
            recorder = stack.enter_context(nw_processor(pipe, config))
            previews = None
            if args.store_maps:  # x0 estimates at the map steps, from a hook that changes nothing
                true_cfg = (extra_call or {}).get("true_cfg_scale", 1.0)
                previews = stack.enter_context(
                    X0Previews(pipe, recorder, config.map_steps, true_cfg_scale=true_cfg)
                )
            # the recorder's skip warning becomes one note below (raw warnings only with -v)
            stack.enter_context(warnings.catch_warnings())
            if not args.verbose:
                warnings.filterwarnings("ignore", message="NWRecorder: the NW side computation failed")
            output = pipe(**call)
        generated = output.images[0]
        skipped = skipped_note(recorder, args.mode, info.path.name)
        if skipped:
            note(args.quiet, skipped)
        failure = recorder.failed_steps_line(see=None)  # steps without statistics: even with -qq
        if failure:
            print(f"error: {info.path.name}: {failure}", file=sys.stderr)
        relative = folder.relative_to(out_dir)
        atomic_write(folder / "generated.png", lambda tmp: generated.save(tmp))
        entry = {**info.to_dict(), "generated": str(relative / "generated.png")}
        if families.write_joint_records(recorder, folder) is not None:  # SD 3.5's joint key set
            entry["joint_records"] = str(relative / "rho_joint.csv")
        records = [{"reference": key, **record, **run} for record in recorder.to_records()]
        if args.store_maps:
            recorder.save_maps(folder / "maps.safetensors")
            for step, image in previews.images().items():
                atomic_write(folder / f"x0_step{step}.png", lambda tmp, image=image: image.save(tmp))
            draw_image_maps(folder, records)
            entry.update(
                maps=str(relative / "maps.safetensors"), attention_maps=str(relative / "attention_maps.png")
            )
        return entry, records

    def work_and_report(key: str) -> tuple[dict, list[dict]]:  # a plain line per reference in a log
        start = time.perf_counter()
        result = work(key)
        seconds = time.perf_counter() - start
        done = f"reference {list(infos).index(key) + 1} of {len(infos)} done in {seconds:.0f} s: {key}"
        progress_line(args.quiet, show_progress_bars(args), done)
        return result

    return work_and_report


def check_layers(layers: Sequence[str] | None, pipe: Any) -> None:
    """Check the ``--layers`` prefixes against the names of the pipeline's IP-Adapter layers.

    Reads the names from the denoiser's ``attn_processors`` (nothing is installed).

    Raises:
        CLIError: a prefix that matches no IP-Adapter layer; the message names the blocks of the
            loaded family (``down, mid, up`` for UNets, ``transformer_blocks`` for SD3 / Flux) and
            a real layer name.
    """
    if layers is None:
        return
    from nw_adapter.correlate.families import layer_blocks
    from nw_adapter.integration.mixin import ip_adapter_layers

    names = ip_adapter_layers(pipe)
    bad = next((p for p in layers if not any(n.startswith(p) for n in names)), None)
    if bad is None:
        return
    short = next((k for k, v in BLOCK_PREFIXES.items() if v == bad), None)
    shown = f"'{short}' ({bad})" if short else f"'{bad}'"
    blocks = layer_blocks(names)
    raise CLIError(
        f"--layers: {shown} matches no IP-Adapter layer of this model; use the block"
        f"{'s' if len(blocks) > 1 else ''} {', '.join(blocks)} or a processor-name prefix such as "
        f"'{names[0]}'"
    )


def _check_true_cfg(args: argparse.Namespace, family: str) -> None:
    """Refuse a Flux ``--true-cfg-scale`` that diffusers would silently ignore.

    ``FluxPipeline`` runs true CFG only when ``true_cfg_scale > 1`` AND a negative prompt is
    given; otherwise it logs a warning (hidden by this tool without ``-v``) and generates without
    it, while ``rho.json`` would record the scale that was asked for. As for ``--true-cfg-scale``
    on other families, an option that cannot take effect is an error, raised before the model
    loads; the fix is one flag.
    """
    from nw_adapter.correlate.families import FLUX

    scale = args.true_cfg_scale
    if family != FLUX or scale == 1.0:
        return
    if scale < 1.0:
        raise CLIError(
            f"--true-cfg-scale {scale:g} has no effect: Flux runs true classifier-free guidance only for "
            "scales > 1; pass a scale > 1 with --negative-prompt, or drop --true-cfg-scale"
        )
    if args.negative_prompt is None:
        raise CLIError(
            f"--true-cfg-scale {scale:g} needs --negative-prompt: Flux runs true classifier-free guidance "
            "only against a negative prompt (without one diffusers ignores the scale); pass "
            "--negative-prompt TEXT ('' for an empty one) or drop --true-cfg-scale"
        )


def run(args: argparse.Namespace, infos: Sequence[ReferenceImage], out_dir: Path) -> int:
    """Load the model, compute every (unfinished) image, and on the main process write the report.

    The model names are resolved first, before torch and diffusers are imported: offline, a Hub
    id that is not in the cache is one line at once (:func:`~nw_adapter.correlate.loading.check_hub_files`).
    """
    from nw_adapter.correlate import families
    from nw_adapter.correlate.loading import check_hub_files, resolve_spec

    spec = resolve_spec(
        ModelSpec(args.model, args.ip_adapter, args.subfolder, args.weight_name, args.image_encoder)
    )
    check_hub_files(spec)  # offline: what cannot be loaded, in one line, now
    _check_true_cfg(args, families.family_of_model(spec.model))  # before the (slow) model load
    with _library_output(verbose=args.verbose, bars=show_progress_bars(args)):
        return _run(args, spec, infos, out_dir)


def _run(args: argparse.Namespace, spec: ModelSpec, infos: Sequence[ReferenceImage], out_dir: Path) -> int:
    """The body of :func:`run`: load, check ``--layers``, sweep under the lock, report."""
    from nw_adapter.correlate import families
    from nw_adapter.correlate.loading import build_pipeline, resolve_dtype
    from nw_adapter.correlate.report import build_report
    from nw_adapter.correlate.sweep import fingerprint, run_sweep

    bars = show_progress_bars(args)
    device, state = _device_and_state(args.device)
    for info in infos:
        for text in info.notes:
            note(args.quiet, f"{info.path.name}: {text}", shown=state.is_main_process)
    dtype = resolve_dtype(args.dtype, device)
    pipe = build_pipeline(spec, device=device, dtype=dtype, scheduler=args.scheduler)
    pipe.set_progress_bar_config(disable=not (bars and state.is_main_process), leave=False)
    pipe.set_ip_adapter_scale(args.ip_scale)
    extra_call = families.call_kwargs(pipe, args.true_cfg_scale)
    map_steps, _ = reported_steps(
        pipe, args.steps, all_steps=args.all_steps, height=args.height, width=args.width
    )
    config = processor_config(args, map_steps)
    check_layers(args.layers, pipe)
    refused = end_to_end_error(args, families.family_of_pipeline(pipe))
    if refused:
        raise CLIError(refused)
    shown = ModelSpec(
        model=args.model,
        ip_adapter=args.ip_adapter or families.shown_adapter(args.model, spec),
        subfolder=spec.subfolder,
        weight_name=spec.weight_name,
        image_encoder=None
        if spec.image_encoder is None
        else args.image_encoder
        or ("tiny" if args.model in {*families.TINY_MODELS, *families.TRAINED_FLOW_MODELS} else None)
        or spec.image_encoder,
    )
    options = run_options(args, shown, device, str(dtype).removeprefix("torch."))
    if extra_call:
        options.update(extra_call)
    options["scheduler_class"] = type(pipe.scheduler).__name__
    by_key = {info.key: info for info in infos}
    # The resolved model (for tiny: the cache folder named by the builder's source hash) is part of
    # the fingerprint, so a result is only reused with the model that produced it.
    identity = {**options, "resolved_model": spec.to_dict()}
    run_id = fingerprint(identity)[:12]  # the records' run: the same for images reused on a resume
    lock = OutputLock(out_dir) if state.num_processes == 1 else contextlib.nullcontext()
    with lock:
        if state.is_main_process:  # before any process writes (they wait for the main one in run_sweep)
            remove_interrupted_writes(out_dir, list(by_key))
        outcome = run_sweep(
            list(by_key),
            _image_worker(args, pipe, config, by_key, out_dir, extra_call, run_id),
            out_dir=out_dir,
            expected_fingerprint=fingerprint(identity),
            state=state,
            progress=bars and state.is_main_process,
            image_hashes={key: info.sha256 for key, info in by_key.items()},
            before_changes=lambda: remove_report(out_dir),
            validate=check_image_result_file,
        )
        for why in outcome.rejected.values():
            note(args.quiet, f"{why}; that image is computed again", shown=state.is_main_process)
        if state.num_processes > 1 and args.quiet < 2:
            print(
                f"note: process {state.process_index}/{state.num_processes} computed "
                f"{len(outcome.computed)} image(s)",
                file=sys.stderr,
            )
        if outcome.reused:
            reused = f"resumed: {len(outcome.reused)} finished image(s) reused from {out_dir}"
            note(args.quiet, reused, shown=state.is_main_process)
        if not state.is_main_process:
            return 0
        records = [record for result in outcome.results for record in result["records"]]
        if not records:  # every step of every image failed (the error lines above say why)
            raise CLIError(
                f"no statistics were recorded for any of the {len(outcome.results)} image(s): the NW side "
                "computation failed in every layer (see the error line(s) above); nothing to report"
            )
        report = build_report(
            records,
            config=options,
            control=options["end_to_end_control"],
            images=[result["image"] for result in outcome.results],
            targets=() if args.all_steps else PAPER_TIMESTEPS,
        )
        print(write_outputs(report, out_dir))
    return 0


def _compare_swap(args: argparse.Namespace) -> int:
    """``--compare-swap``: stock against NW-head generations instead of the rho run
    (:mod:`nw_adapter.correlate.swap_cli`), with this module's image, output and model checks."""
    infos = validate_images(collect_image_paths(args.image, args.image_dir))
    out_dir = check_output_dir(args.out, run="compare-swap")  # outputs.SWAP_RUN
    bars = show_progress_bars(args)
    _quiet_libraries(verbose=args.verbose, bars=bars)
    try:
        with _library_output(verbose=args.verbose, bars=bars):
            return swap_cli.run(args, infos, out_dir, bars=bars, check_true_cfg=_check_true_cfg)
    except KeyboardInterrupt:  # unlike the rho run, nothing of an unfinished comparison is kept
        print(f"{args.prog}: interrupted; an unfinished comparison is not kept, rerun it", file=sys.stderr)
        return 130


def _support_sets(args: argparse.Namespace) -> int:
    """``--support-set`` / ``--support-dir``: generations on support sets instead of the rho run
    (:mod:`nw_adapter.correlate.support_cli`), with this module's output and model checks."""
    bars = show_progress_bars(args)
    _quiet_libraries(verbose=args.verbose, bars=bars)
    with _library_output(verbose=args.verbose, bars=bars):
        return support_cli.run(args, bars=bars, check_true_cfg=_check_true_cfg)


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Run the command line; return the exit status (0 ok, 2 bad input, 130 interrupted).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        prog: the command's name in the usage line and the messages (default: as invoked,
            :func:`nw_adapter.commands.invoked_as`, for the real command line; ``correlate.py`` for
            an ``argv`` passed in).
    """
    if prog is None:
        prog = invoked_as(PROG) if argv is None else PROG
    try:
        args = parse_args(argv, prog=prog)
        swap_cli.check_options(args, swap_cli.given_options(build_parser(prog), argv))
        if args.support_set or args.support_dir:
            return _support_sets(args)
        if args.compare_swap:
            return _compare_swap(args)
        if args.replot is not None:
            print(replot(Path(args.replot), all_steps=args.all_steps))
            return 0
        infos = validate_images(collect_image_paths(args.image, args.image_dir))
        out_dir = check_output_dir(args.out, [info.key for info in infos])
        processor_config(args)  # option errors now, before any model is loaded
        _quiet_libraries(verbose=args.verbose, bars=show_progress_bars(args))
        return run(args, infos, out_dir)
    except (CLIError, OutputError, ImageInputError, ModelLoadError, CompareSwapError, SupportSetError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except (NWConfigError, NWInstallError) as exc:
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except WriteError as exc:
        print(
            f"{prog}: error: {' '.join(str(exc).split())}; free space or fix the permissions of --out and "
            "rerun the same command (finished images are kept)",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(
            f"{prog}: interrupted; finished images are kept, rerun the same command to resume",
            file=sys.stderr,
        )
        return 130
