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
branch wants generations, not a second observe run (which options it reads: its row of the
option table, :mod:`nw_adapter.correlate.options`; the rho run's ``--mode``, ``--bandwidth``,
``--layers``, ``--store-maps``, ``--all-steps`` are refused).

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
from collections.abc import Sequence
from typing import Any

from nw_adapter.commands import note, progress_line
from nw_adapter.correlate.images import ReferenceImage
from nw_adapter.integration.config import BANDWIDTH_RULES as DEFAULT_RULES  # consequence's, without torch

__all__ = ["CompareSwapError", "reference_labels", "run"]

JUDGE = "nw_adapter.models.digits_quality.digit_judge (RBF SVM fitted on the held-out judge split)"
DIGIT_SIZE = 32


class CompareSwapError(ValueError):
    """Bad input to ``--compare-swap``: printed as one line, exit status 2."""


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
                "--labels: class agreement needs a class judge, and only the digits models (--model "
                f"{', '.join(DIGIT_MODELS)}) have one; drop --labels"
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


def _compare(
    args: argparse.Namespace,
    model: Any,
    infos: Sequence[ReferenceImage],
    labels: list[int] | None,
    *,
    bars: bool,
) -> Any:
    """Load the model and run :func:`compare_swap`, a progress line per reference where no bar is
    drawn (:func:`~nw_adapter.commands.progress_line`); returns the comparison."""
    import time

    from nw_adapter.analysis.consequence import compare_swap
    from nw_adapter.correlate.html_report.images import IMAGE_CAP as REPORT_IMAGE_CAP
    from nw_adapter.correlate.images import load_reference_image
    from nw_adapter.models.digits_quality import digit_judge

    pipe = model.load(args, bars=bars)
    references = [load_reference_image(info.path)[0] for info in infos]
    started = [time.perf_counter()]

    def done(index: int, count: int) -> None:  # a plain line per reference in a log
        now = time.perf_counter()
        text = f"reference {index + 1} of {count} done in {now - started[0]:.0f} s: {infos[index].key}"
        progress_line(args.quiet, bars, text)
        started[0] = now

    try:
        return compare_swap(
            pipe,
            references,
            rules=args.swap_rules or DEFAULT_RULES,
            seed=args.seed,
            judge=digit_judge() if labels is not None else None,
            labels=labels,
            keep_images=True,  # at the report's size
            kept_size=REPORT_IMAGE_CAP,
            on_reference_done=done,
            **model.call_arguments(args),
        )
    except ValueError as exc:  # compare_swap's input errors (e.g. a pipeline without image encoder)
        raise CompareSwapError(" ".join(str(exc).split())) from None


def run(args: argparse.Namespace) -> int:
    """Run ``--compare-swap`` (or reuse its finished result), write the files, print the table.

    Args:
        args: The parsed options (:func:`nw_adapter.correlate.options.parse_args`).

    Returns:
        The exit status (0).

    Raises:
        CompareSwapError: Bad input (one line); the loaders' and the output folder's errors pass
            through (:class:`~nw_adapter.correlate.spec.ModelLoadError`, ``OutputError``, ``WriteError``:
            a failed write removes the files of the comparison written before it).
    """
    from nw_adapter import atomic
    from nw_adapter.correlate.console import library_output, quiet_libraries, show_progress_bars
    from nw_adapter.correlate.html_report import remove_report, write_swap_report
    from nw_adapter.correlate.images import collect_image_paths, validate_images
    from nw_adapter.correlate.options import fingerprint, options_record
    from nw_adapter.correlate.outputs import (
        SWAP_RUN,
        OutputLock,
        check_apart,
        check_apart_from_models,
        check_output_dir,
        remove_interrupted_writes,
    )
    from nw_adapter.correlate.report import write_json
    from nw_adapter.correlate.run_model import prepare_model
    from nw_adapter.correlate.swap_files import (
        CSV_NAME,
        JSON_NAME,
        build_document,
        format_document,
        read_text,
        remove_outputs,
        reusable_document,
        rows_csv,
    )

    infos = validate_images(collect_image_paths(args.image, args.image_dir))
    check_apart(args.out, files=args.image, folders=args.image_dir, option="--image")
    check_apart_from_models(args.out, args)
    out_dir = check_output_dir(args.out, run=SWAP_RUN)
    for info in infos:  # validate_images merged files of the same content: one reference each
        for text in info.notes:
            note(args.quiet, f"{info.path.name}: {text}")
    labels, label_source = reference_labels(args, infos)  # before the model: its errors cost nothing
    bars = show_progress_bars(args)
    quiet_libraries(args)
    with OutputLock(out_dir):  # before the model: a second run is refused at once
        model = prepare_model(args)
        judge = JUDGE if label_source in ("bundled", "--labels") else None
        resolved = model.resolved(labels=label_source, judge=judge)
        # the references are checked on their own (document_problem), so the note can say which changed
        expected = fingerprint(args.run.name, args, resolved)
        remove_interrupted_writes(out_dir, run=SWAP_RUN)  # a killed run's files, report.html's too
        fingerprinted = options_record(args.run.name, args, resolved, fingerprinted=True)
        document, why = reusable_document(out_dir, expected, infos, labels, fingerprinted)
        if document is None:
            if why:
                note(args.quiet, f"{why}; computing it again")
            remove_outputs(out_dir)
            remove_report(out_dir)  # report.html of another comparison
            with library_output(args):
                result = _compare(args, model, infos, labels, bars=bars)
            config = options_record(args.run.name, args, model.resolved(labels=label_source, judge=judge))
            document = build_document(result, config=config, infos=infos, labels=labels, fingerprint=expected)
            try:
                atomic.atomic_write_text(out_dir / CSV_NAME, rows_csv(document))
                write_json(out_dir / JSON_NAME, document)  # last: the marker of a finished run
                write_swap_report(out_dir, document, result)  # report.html, with the images
            except atomic.WriteError:
                remove_outputs(out_dir)  # no rows file without its document
                raise
        else:
            note(args.quiet, f"resumed: {JSON_NAME} of the same options and references reused from {out_dir}")
            if read_text(out_dir / CSV_NAME) != rows_csv(document):  # the rows file follows the JSON
                atomic.atomic_write_text(out_dir / CSV_NAME, rows_csv(document))
            write_swap_report(out_dir, document)  # report.html: this document's is kept
    print(format_document(document, detail=args.verbose, out_dir=out_dir))
    return 0
