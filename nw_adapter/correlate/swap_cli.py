"""``correlate.py --compare-swap``: the swap consequence from the command line.

A mode of its own, not an addition to the rho run: for the reference images given, it runs
:func:`nw_adapter.analysis.consequence.compare_swap` with the run's model and generation options
(stock against the exact NW head in every IP-Adapter layer, one bandwidth rule at a time, same
seeds), prints the table and writes, atomically, into ``--out``:

- ``compare_swap.json``: schema ``nw-adapter/compare-swap``: the options (``config``), package
  versions, the references (file, SHA-256, class label if known), one row per (reference, rule)
  with the values :func:`compare_swap` returned, the per-rule summary (means with 95% intervals
  over references inside the quantities' ranges, kept-class counts with Clopper-Pearson 95%
  intervals, the conclusion), the options' fingerprint and the SHA-256 of its own content
  (``digest``);
- ``compare_swap.csv``: the per-reference rows, written from the JSON document (both files:
  :mod:`~nw_adapter.correlate.swap_files`).

It generates no rho statistics: someone asking whether the NW head can stand in for the image
branch wants generations, not a second observe run (and the observe run's options, ``--mode``,
``--bandwidth``, ``--layers``, ``--store-maps``, ``--all-steps``, ``--replot``, are errors here).

Class agreement needs a judge and the references' classes. The only judge is the digits SVM of
the trained tiny models (:func:`nw_adapter.models.digits_quality.digit_judge`, 32 x 32 images), so
it is measured with the digits models only (``--model tiny`` and ``tiny-flux-digits``,
:data:`~nw_adapter.correlate.spec.DIGIT_MODELS`); the classes are those of the bundled held-out digits
(recognised by their SHA-256, not by file name) or given with ``--labels`` (one per reference, in
the order the references are listed). Without known classes there is no agreement column, and
the output says why.

One reference runs too, but its table has no intervals (``too few``: an interval needs two or more
references) and its conclusion says that nothing follows. Resuming is all or nothing: the
comparison pairs reference ``i`` with seeds ``seed + i`` and ``seed + n + i``, so its rows only
mean something as one run; a finished ``compare_swap.json`` is reused (nothing is generated) only
when it is an intact document of this tool (its content digest intact), with the same fingerprint
(options, model, rules, labels) and the same references (key and SHA-256, in order); anything
else is recomputed from the start, with a note saying why.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nw_adapter.commands import note
from nw_adapter.correlate.images import ReferenceImage
from nw_adapter.integration.config import BANDWIDTH_RANGE
from nw_adapter.integration.config import BANDWIDTH_RULES as DEFAULT_RULES  # consequence's, without torch

__all__ = [
    "CompareSwapError",
    "add_arguments",
    "check_options",
    "given_options",
    "run",
]

JUDGE = "nw_adapter.models.digits_quality.digit_judge (RBF SVM fitted on the held-out judge split)"
DIGIT_SIZE = 32

_RHO_RUN_OPTIONS = {
    "bandwidth": "--bandwidth sets the rho run's bandwidth; with --compare-swap pass rules with --swap-rules",
    "layers": "--compare-swap swaps every IP-Adapter layer; drop --layers",
    "store_maps": "--store-maps belongs to the rho run; drop it with --compare-swap",
    "all_steps": "--all-steps belongs to the rho run; drop it with --compare-swap",
    "replot": "--replot redraws a rho run; drop it (rerunning the --compare-swap command reuses its finished "
    "compare_swap.json)",
}
_SWAP_OPTIONS = {"swap_rules": "--swap-rules", "labels": "--labels"}


class CompareSwapError(ValueError):
    """Bad input to ``--compare-swap``: printed as one line, exit status 2."""


_ASCII_INTEGER = re.compile(r"[0-9]+", re.ASCII)
_ASCII_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)
"""What ``--labels`` / ``--swap-rules`` read as numbers: ASCII decimals only (Python's ``int`` and
``float`` also take other scripts' digits and underscores, ``"\uff11"`` or ``"1_0"``)."""


def _rules(text: str) -> tuple[str | float, ...]:
    """Parse ``--swap-rules``: comma-separated rule names or bandwidths h in :data:`BANDWIDTH_RANGE`."""
    low, high = BANDWIDTH_RANGE
    rules: list[str | float] = []
    for part in (p.strip() for p in text.split(",")):
        if part in DEFAULT_RULES:
            rules.append(part)
            continue
        if not _ASCII_NUMBER.fullmatch(part):
            raise argparse.ArgumentTypeError(
                f"--swap-rules: '{part}' is not a rule; use {', '.join(DEFAULT_RULES)} or a number h in "
                f"[{low:g}, {high:g}], comma-separated"
            )
        value = float(part)
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"--swap-rules: bandwidth '{part}' is outside the usable range [{low:g}, {high:g}]"
            )
        rules.append(value)
    if len(set(rules)) != len(rules):
        raise argparse.ArgumentTypeError(f"--swap-rules: '{text}' repeats a rule; name each rule once")
    return tuple(rules)


def _labels(text: str) -> list[int]:
    """Parse ``--labels``: comma-separated digit classes 0-9 (ASCII), one per reference."""
    parts = [part.strip() for part in text.split(",")]
    if not all(_ASCII_INTEGER.fullmatch(part) for part in parts):
        raise argparse.ArgumentTypeError(
            f"--labels must be comma-separated ASCII digits 0-9 (one per reference, e.g. 3,7), got '{text}'"
        )
    labels = [int(part) for part in parts]
    if not all(0 <= label <= 9 for label in labels):
        raise argparse.ArgumentTypeError(f"--labels: digit classes are 0-9, got '{text}'")
    return labels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``swap consequence`` option group (``--compare-swap``, ``--swap-rules``, ``--labels``)."""
    group = parser.add_argument_group("swap consequence (instead of the rho run)")
    group.add_argument(
        "--compare-swap",
        action="store_true",
        help="generate every reference under stock and under the exact NW head (each --swap-rules rule, "
        "same seed) and report the pixel change, its other-seed control, CLIP-I and, with known classes, "
        "class agreement, with 95%% intervals over references; writes compare_swap.json/.csv, no rho run",
    )
    group.add_argument(
        "--swap-rules",
        type=_rules,
        default=None,
        metavar="RULES",
        help=f"comma-separated bandwidth rules or numbers h (default {','.join(DEFAULT_RULES)})",
    )
    group.add_argument(
        "--labels",
        type=_labels,
        default=None,
        metavar="DIGITS",
        help="--compare-swap with --model tiny: the references' digit classes, comma-separated, in the order "
        "the references are listed (the bundled held-out digits are recognised without it)",
    )


def given_options(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The destinations of the options given on the command line (defaults excluded).

    Parses ``argv`` again with every default suppressed, so an option given with its default value
    (e.g. ``--bandwidth matched``) still counts as given.
    """
    for action in parser._actions:  # argparse has no public accessor; set_defaults would fill the namespace
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def check_options(args: argparse.Namespace, given: set[str]) -> None:
    """Refuse option combinations that cannot take effect (before anything is read or loaded).

    Raises:
        CompareSwapError: ``--swap-rules`` / ``--labels`` without ``--compare-swap``; with it,
            ``--mode swap`` or an option of the rho run.
    """
    if not args.compare_swap:
        for dest, option in _SWAP_OPTIONS.items():
            if dest in given:
                raise CompareSwapError(
                    f"{option} applies to --compare-swap only; add --compare-swap or drop it"
                )
        return
    if args.mode == "swap":
        raise CompareSwapError(
            "--compare-swap generates stock and swap images itself; drop --mode swap (the rules go in "
            "--swap-rules)"
        )
    for dest, message in _RHO_RUN_OPTIONS.items():
        if dest in given:
            raise CompareSwapError(message)


def bundled_digit_labels() -> dict[str, int]:
    """``{sha256: digit}`` of the trained tiny model's bundled held-out reference digits."""
    from nw_adapter.correlate.sweep import file_sha256
    from nw_adapter.models.tiny_digits import example_image_path

    return {file_sha256(example_image_path(digit)): digit for digit in range(10)}


def reference_labels(
    args: argparse.Namespace, infos: Sequence[ReferenceImage]
) -> tuple[list[int] | None, str]:
    """The references' classes for the agreement column, and where they come from (or why there are none).

    Returns:
        ``(labels or None, source)``: ``source`` is ``"--labels"``, ``"bundled"``, or one sentence
        saying why class agreement is not measured.

    Raises:
        CompareSwapError: ``--labels`` with a model other than ``tiny``, with a size other than
            32 x 32, or not one label per reference.
    """
    from nw_adapter.correlate.spec import DIGIT_MODELS

    if args.model not in DIGIT_MODELS:
        if args.labels is not None:
            raise CompareSwapError(
                "--labels: class agreement needs a class judge, and only the digits models (--model tiny, "
                "tiny-flux-digits) have one; drop --labels"
            )
        return None, "class agreement not measured: only the digits models have a class judge (a digits SVM)"
    if any(size not in (None, DIGIT_SIZE) for size in (args.height, args.width)):
        if args.labels is not None:
            raise CompareSwapError(
                f"--labels: the digit judge reads {DIGIT_SIZE} x {DIGIT_SIZE} images; drop --height/--width "
                "or --labels"
            )
        return None, f"class agreement not measured: the digit judge reads {DIGIT_SIZE} x {DIGIT_SIZE} images"
    if args.labels is not None:
        if len(args.labels) != len(infos):
            raise CompareSwapError(
                f"--labels: {len(args.labels)} label(s) for {len(infos)} distinct reference image(s) "
                "(identical files count once); pass one digit per reference, in the order they are listed"
            )
        return list(args.labels), "--labels"
    bundled = bundled_digit_labels()
    unknown = [info for info in infos if info.sha256 not in bundled]
    if unknown:
        return None, (
            f"class agreement not measured: {unknown[0].path.name} is not one of the bundled held-out digits "
            "(their classes are known); pass --labels"
        )
    return [bundled[info.sha256] for info in infos], "bundled"


def run_config(args: argparse.Namespace, shown: Any, device: str, dtype: str, label_source: str) -> dict:
    """The options recorded in ``compare_swap.json`` (all of them fingerprinted)."""
    return {
        "model": shown.to_dict(),
        "prompt": args.prompt,
        "negative_prompt": args.negative_prompt,
        "steps": args.steps,
        "seed": args.seed,
        "guidance_scale": args.guidance_scale,
        "ip_scale": args.ip_scale,
        "true_cfg_scale": args.true_cfg_scale,
        "height": args.height,
        "width": args.width,
        "scheduler": args.scheduler,
        "rules": list(args.swap_rules or DEFAULT_RULES),
        "labels": label_source,
        "judge": JUDGE if label_source in ("bundled", "--labels") else None,
        "device": device,
        "dtype": dtype,
    }


def _compare(
    args: argparse.Namespace,
    spec: Any,
    infos: Sequence[ReferenceImage],
    labels: list[int] | None,
    *,
    device: str,
    dtype: Any,
    bars: bool,
) -> tuple[Any, str]:
    """Load the model and run :func:`compare_swap`; returns ``(comparison, scheduler class name)``."""
    from nw_adapter.analysis.consequence import compare_swap
    from nw_adapter.correlate import families
    from nw_adapter.correlate.html_report.images import IMAGE_CAP as REPORT_IMAGE_CAP
    from nw_adapter.correlate.images import load_reference_image
    from nw_adapter.correlate.loading import build_pipeline
    from nw_adapter.models.digits_quality import digit_judge

    pipe = build_pipeline(spec, device=device, dtype=dtype, scheduler=args.scheduler)
    pipe.set_progress_bar_config(disable=not bars, leave=False)
    pipe.set_ip_adapter_scale(args.ip_scale)
    call = families.call_kwargs(pipe, args.true_cfg_scale)
    for name in ("negative_prompt", "height", "width"):
        if getattr(args, name) is not None:
            call[name] = getattr(args, name)
    references = [load_reference_image(info.path)[0] for info in infos]
    try:
        result = compare_swap(
            pipe,
            references,
            rules=args.swap_rules or DEFAULT_RULES,
            prompt=args.prompt,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance_scale,
            seed=args.seed,
            judge=digit_judge() if labels is not None else None,
            labels=labels,
            keep_images=True,  # at the report's size
            kept_size=REPORT_IMAGE_CAP,
            **call,
        )
    except (
        ValueError
    ) as exc:  # compare_swap's documented input errors (e.g. a pipeline without image encoder)
        raise CompareSwapError(" ".join(str(exc).split())) from None
    return result, type(pipe.scheduler).__name__


def run(
    args: argparse.Namespace,
    infos: Sequence[ReferenceImage],
    out_dir: Path,
    *,
    bars: bool,
    check_true_cfg: Callable[[argparse.Namespace, str], None],
) -> int:
    """Run ``--compare-swap`` (or reuse its finished result), write the files, print the table.

    Args:
        args: The parsed options (checked by :func:`check_options`).
        infos: The validated references, in the order listed.
        out_dir: The checked ``--out`` folder.
        bars: Show the pipeline's progress bars.
        check_true_cfg: The command line's check of ``--true-cfg-scale`` for a model family.

    Returns:
        The exit status (0).

    Raises:
        CompareSwapError: Bad input (one line); the loaders' and the output folder's errors pass
            through (:class:`~nw_adapter.correlate.spec.ModelLoadError`, ``OutputError``, ``WriteError``).
    """
    from nw_adapter import atomic
    from nw_adapter.correlate import families
    from nw_adapter.correlate.html_report import remove_report, write_swap_report
    from nw_adapter.correlate.loading import ModelSpec, resolve_device, resolve_dtype, resolve_spec
    from nw_adapter.correlate.outputs import OutputLock
    from nw_adapter.correlate.report import write_json
    from nw_adapter.correlate.swap_files import (
        CSV_NAME,
        JSON_NAME,
        SWAP_FILES,
        build_document,
        format_document,
        read_text,
        remove_outputs,
        reusable_document,
        rows_csv,
    )
    from nw_adapter.correlate.sweep import fingerprint, is_distributed_launch

    if is_distributed_launch():
        raise CompareSwapError(
            "--compare-swap runs in one process (its rows pair references with consecutive seeds); run it "
            "without accelerate launch / torchrun"
        )
    from nw_adapter.correlate.images import same_content_note

    for info in infos:  # validate_images merged files of the same content: one reference each
        for duplicate in info.duplicates:
            note(args.quiet, same_content_note(duplicate, info.path))
    labels, label_source = reference_labels(args, infos)  # before the model: its errors cost nothing
    device = resolve_device(args.device)
    spec = resolve_spec(
        ModelSpec(args.model, args.ip_adapter, args.subfolder, args.weight_name, args.image_encoder)
    )
    check_true_cfg(args, families.family_of_model(spec.model))
    dtype = resolve_dtype(args.dtype, device)
    shown = families.shown_spec(args.model, args.ip_adapter, args.image_encoder, spec)
    config = run_config(args, shown, device, str(dtype).removeprefix("torch."), label_source)
    # the references are checked on their own (document_problem), so the note can say which changed
    identity = {**config, "resolved_model": spec.to_dict()}  # the classes too: checked per reference
    expected = fingerprint(identity)
    with OutputLock(out_dir):
        atomic.remove_interrupted_writes(out_dir, lambda name: name in SWAP_FILES)
        document, why = reusable_document(out_dir, expected, infos, labels)
        if document is None:
            if why:
                note(args.quiet, f"{why}; computing it again")
            remove_outputs(out_dir)
            remove_report(out_dir)  # report.html of another comparison
            result, scheduler_class = _compare(
                args, spec, infos, labels, device=device, dtype=dtype, bars=bars
            )
            config["scheduler_class"] = scheduler_class
            document = build_document(result, config=config, infos=infos, labels=labels, fingerprint=expected)
            atomic.atomic_write_text(out_dir / CSV_NAME, rows_csv(document))
            write_json(out_dir / JSON_NAME, document)  # last: the marker of a finished run
            write_swap_report(out_dir, document, result)  # report.html, with the images
        else:
            note(args.quiet, f"resumed: {JSON_NAME} of the same options and references reused from {out_dir}")
            if read_text(out_dir / CSV_NAME) != rows_csv(document):  # the rows file follows the JSON
                atomic.atomic_write_text(out_dir / CSV_NAME, rows_csv(document))
            write_swap_report(out_dir, document)  # report.html: this document's is kept
    print(format_document(document))
    return 0
