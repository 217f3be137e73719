"""``correlate.py --support-set a.png,b.png``: generations conditioned on support sets, observed.

A run of its own, like ``--compare-swap``: each support set (several reference images for the one
adapter, diffusers' list-per-adapter convention) conditions one generation, observed by the NW
processors (:func:`nw_adapter.analysis.support_sets.observe_support_set`; the image is the stock
one, ``--layers`` selects the layers observed). The sets come from

- ``--support-set FILES`` (repeatable): one set per occurrence, comma-separated image files, in
  the order their masses are numbered (a file may appear twice: identical references must share
  the mass evenly, a control);
- ``--support-dir DIR`` (repeatable): every subfolder of DIR holding images is one set (named by
  the subfolder, files in name order).

A set is a unit of the summary's intervals and tests, so sets of the same content (the same
references' pixels, in any order: their generations are the same) are one set, counted once
with a note, as reference images are in the rho run.

Written into ``--out`` (atomically): ``sets/<key>/generated.png`` and ``sets/<key>/mass.png`` (the
set's per-reference attention mass over denoising beside the theory's posterior over the references'
latents, in the space of x_t), ``support.csv`` (the attention's support-set columns of every record:
step, layer, head, CFG half; and the latent posterior per step and CFG half), ``support.json`` (schema
``nw-adapter/support-sets``: the options, per set the references with their CLIP-I and classes,
the winner and its step, the per-step masses, and the summary per group of sets) and
``support_mass.png`` (:func:`~nw_adapter.correlate.support_report.plot_sweep`). On the digits models
the class judge (:func:`nw_adapter.models.digits_quality.digit_judge`, 32 x 32 images) labels the
generation and each reference. Every run recomputes its sets (no resume): it first removes the
files of an earlier support-set run in ``--out`` (a killed run's temporary files too), and an
interrupted or failed run removes what it wrote. Where stderr is no terminal (a log), a plain
progress line per set.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nw_adapter.commands import note, progress_line
from nw_adapter.correlate.option_values import MAX_SET_REFERENCES as MAX_REFERENCES

__all__ = ["MAX_REFERENCES", "SupportSetError", "SupportSetInput", "collect_sets", "run"]

JUDGE = "nw_adapter.models.digits_quality.digit_judge (RBF SVM fitted on the held-out judge split)"
DIGIT_SIZE = 32

_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", re.ASCII)


class SupportSetError(ValueError):
    """Bad support-set input: printed as one line, exit status 2."""


@dataclass(frozen=True)
class SupportSetInput:
    """One support set: its key (output folder name) and its reference files, in order."""

    key: str
    files: tuple[Path, ...]


def _dir_sets(folder: Path) -> list[SupportSetInput]:
    from nw_adapter.correlate.images import NoImagesError, collect_image_paths

    if not folder.is_dir():
        raise SupportSetError(
            f"--support-dir '{folder}' is not a folder; pass a folder of one subfolder per set"
        )
    sets = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            files = tuple(path for path, _ in collect_image_paths([], [str(sub)]))
        except NoImagesError:  # a subfolder without images is not a set (a bad entry is refused)
            files = ()
        except OSError as exc:
            raise SupportSetError(
                f"--support-dir: cannot read '{sub}' ({exc.strerror or type(exc).__name__}); fix its "
                "permissions or move it out of the folder"
            ) from None
        if not files:
            continue
        if len(files) > MAX_REFERENCES:
            raise SupportSetError(
                f"--support-dir: '{sub}' holds {len(files)} images; a set takes at most {MAX_REFERENCES}"
            )
        sets.append(SupportSetInput(sub.name, tuple(sorted(files, key=lambda p: p.name))))
    if not sets:
        raise SupportSetError(
            f"--support-dir '{folder}' has no subfolder with images; put each set's images in a subfolder"
        )
    return sets


def collect_sets(args: argparse.Namespace, *, quiet: int = 2) -> list[tuple[SupportSetInput, list[Any]]]:
    """The sets of ``--support-set`` then ``--support-dir``, every file validated, each content once.

    Prints (unless ``quiet``) each file's conversion notes once, and a note per set merged into an
    earlier set of the same content: the references' pixels (:attr:`ReferenceImage.pixels`), in any
    order (one softmax over the concatenated keys: the order changes nothing).

    Returns:
        ``[(set, [ReferenceImage per file])]``, in input order.

    Raises:
        SupportSetError: a bad folder, two sets of the same key.
        ImageInputError: a bad image file (one line, from :mod:`nw_adapter.correlate.images`).
    """
    from nw_adapter.correlate.images import load_reference_image

    sets = [
        SupportSetInput(f"set{i:02d}", tuple(Path(f) for f in files))
        for i, files in enumerate(args.support_set)
    ]
    for folder in args.support_dir:
        sets.extend(_dir_sets(Path(folder)))
    keys = [s.key for s in sets]
    for key in keys:
        if not _KEY.fullmatch(key):
            raise SupportSetError(
                f"--support-dir: subfolder '{key}' is no safe output name; rename it (A-z, 0-9, ._-)"
            )
        if keys.count(key) > 1:
            raise SupportSetError(f"two support sets are named '{key}'; rename one subfolder")
    checked: list[tuple[SupportSetInput, list[Any]]] = []
    by_content: dict[tuple[str, ...], str] = {}
    noted: set[Path] = set()
    for s in sets:
        infos = [load_reference_image(path, label="--support-set")[1] for path in s.files]
        for info in infos:
            if info.path not in noted:
                noted.add(info.path)
                for text in info.notes:
                    note(quiet, f"{info.path.name}: {text}")
        content = tuple(sorted(info.pixels for info in infos))
        if content in by_content:
            note(quiet, f"set '{s.key}' holds the same references as set '{by_content[content]}' (their "
                 f"pixels, in any order); counted once, as '{by_content[content]}'")  # fmt: skip
            continue
        by_content[content] = s.key
        checked.append((s, infos))
    return checked


def _check_judged_sizes(sets: list[tuple[SupportSetInput, list[Any]]], model: str) -> None:
    """The digit judge reads 32 x 32 images: refuse another size of reference before the model loads."""
    for _, infos in sets:
        for info in infos:
            if tuple(info.size) != (DIGIT_SIZE, DIGIT_SIZE):
                width, height = info.size
                raise SupportSetError(
                    f"--support-set '{info.path}': {width} x {height} pixels; the digit judge of --model "
                    f"{model} reads {DIGIT_SIZE} x {DIGIT_SIZE} images (it labels the references too): pass "
                    f"{DIGIT_SIZE} x {DIGIT_SIZE} references, or --height/--width other than {DIGIT_SIZE} to "
                    "run without the judge"
                )


def remove_outputs(out_dir: Path) -> list[Path]:
    """Remove the files of a support-set run in ``out_dir`` (``support.json`` first), and only those.

    Regular files only, never through a symbolic link (checked before:
    :func:`~nw_adapter.correlate.outputs.check_output_dir`): ``support.json``, ``support.csv``,
    ``support_mass.png``, and ``generated.png`` and ``mass.png`` in each folder of ``sets/``; a
    set folder left empty is removed, and so is ``sets/``.

    Returns:
        The files removed.
    """
    from nw_adapter.atomic import remove_regular_file
    from nw_adapter.correlate.outputs import REPORT_HTML, SET_FILES
    from nw_adapter.correlate.support_report import CSV_NAME, FIGURE_NAME, JSON_NAME
    from nw_adapter.correlate.sweep import is_regular_file

    removed = []
    paths = [out_dir / JSON_NAME, out_dir / CSV_NAME, out_dir / FIGURE_NAME, out_dir / REPORT_HTML]
    sets = out_dir / "sets"
    folders = [] if sets.is_symlink() or not sets.is_dir() else sorted(sets.iterdir())
    folders = [folder for folder in folders if folder.is_dir() and not folder.is_symlink()]
    paths += [folder / name for folder in folders for name in SET_FILES]
    for path in paths:
        if is_regular_file(path):
            remove_regular_file(path)
            removed.append(path)
    for folder in [*folders, sets]:
        try:
            folder.rmdir()  # only when empty
        except OSError:
            pass
    return removed


def run(args: argparse.Namespace) -> int:
    """Validate the sets and ``--out``, load the model, generate and observe each set, write and print
    the report.

    Under ``accelerate launch`` the sets are split over the processes (contiguous shards, each set
    generated with ``--seed`` as in one process) and the main process writes the one report.

    Returns:
        The exit status (0).

    Raises:
        SupportSetError, ImageInputError, OutputError, ModelLoadError, CLIError: bad input, one line,
            before the model loads. An interruption or a failed write removes the run's files first.
    """
    import contextlib

    from nw_adapter.correlate.console import library_output, quiet_libraries
    from nw_adapter.correlate.outputs import (
        SUPPORT_RUN,
        OutputLock,
        check_apart,
        check_apart_from_models,
        check_output_dir,
        remove_interrupted_writes,
    )
    from nw_adapter.correlate.run_model import join_processes, prepare_model
    from nw_adapter.correlate.spec import DIGIT_MODELS
    from nw_adapter.correlate.sweep import is_distributed_launch, is_main_launch_process

    sets = collect_sets(args, quiet=args.quiet if is_main_launch_process() else 2)
    check_apart(
        args.out, files=[file for files in args.support_set for file in files], folders=args.support_dir,
        option="--support-set",
    )  # fmt: skip
    check_apart_from_models(args.out, args)
    out_dir = check_output_dir(args.out, [s.key for s, _ in sets], run=SUPPORT_RUN)
    judged = args.model in DIGIT_MODELS and all(
        size in (None, DIGIT_SIZE) for size in (args.height, args.width)
    )
    if judged:
        _check_judged_sizes(sets, args.model)
    quiet_libraries(args)
    lock = contextlib.nullcontext() if is_distributed_launch() else OutputLock(out_dir)
    with lock:  # before the model: a second run is refused at once
        model = prepare_model(args)  # SD 3.5 is refused here (the run table), before loading
        state = join_processes(model, args.device)
        if state.is_main_process:
            remove_interrupted_writes(out_dir, run=SUPPORT_RUN)  # a killed run's, report.html's too
        if state.is_main_process and remove_outputs(out_dir):
            note(args.quiet, f"the files of an earlier support-set run in {out_dir} were removed")
        state.wait_for_everyone()  # nothing is written before the earlier run's files are gone
        try:
            with library_output(args):
                document = _generate(args, model, sets, out_dir, judged=judged, state=state)
        except BaseException:  # an interruption or a failed write: no run in part is left behind
            if state.is_main_process:
                remove_outputs(out_dir)
            raise
    if not state.is_main_process:
        return 0
    if not judged:
        note(args.quiet, "classes not judged: the digit judge reads the digits models' 32 x 32 images only")
    from nw_adapter.correlate import support_report as report

    print(report.format_document(document, detail=args.verbose, out_dir=out_dir))
    return 0


def _observe(
    args: argparse.Namespace, pipe: Any, call: dict, config: Any, judge: Any, known: dict, out_dir: Path,
    index: int, support: tuple[SupportSetInput, list[Any]],
) -> tuple[int, dict, list[dict]]:  # fmt: skip
    """Generate and observe one set; write its image and mass figure. Returns ``(index, entry, csv rows)``."""
    from nw_adapter import atomic
    from nw_adapter.analysis.support_sets import observe_support_set
    from nw_adapter.correlate import support_report as report
    from nw_adapter.correlate.digit_sets import pixel_digest
    from nw_adapter.correlate.images import load_reference_image

    s, infos = support
    references = [load_reference_image(info.path)[0] for info in infos]
    result = observe_support_set(pipe, references, config=config, judge=judge, seed=args.seed, **call)
    folder = out_dir / "sets" / s.key
    folder.mkdir(parents=True, exist_ok=True)
    atomic.atomic_write(folder / "generated.png", lambda tmp, image=result.image: image.save(tmp))
    files = [{"file": str(info.path), "sha256": info.sha256} for info in infos]
    digests = [pixel_digest(image) for image in references]
    labels = [known[d] for d in digests] if judge is not None and all(d in known for d in digests) else None
    entry = report.set_entry(s.key, files, result, f"sets/{s.key}/generated.png", labels)
    report.plot_set(entry, folder / "mass.png", title=f"{s.key}: attention mass and latent posterior")
    return index, entry, report.csv_rows(s.key, result)


def _generate(
    args: argparse.Namespace,
    model: Any,
    sets: list[tuple[SupportSetInput, list[Any]]],
    out_dir: Path,
    *,
    judged: bool,
    state: Any,
) -> dict | None:
    """Load the model, generate and observe this process's sets (a progress line per set where no
    bar is drawn); on the main process gather every set, write the report files and return
    ``support.json``'s document (None on the others)."""
    import time

    from nw_adapter import atomic
    from nw_adapter.analysis.records import csv_text
    from nw_adapter.correlate import support_report as report
    from nw_adapter.correlate.console import show_progress_bars
    from nw_adapter.correlate.html_report import write_support_report
    from nw_adapter.correlate.options import options_record
    from nw_adapter.correlate.report import write_json
    from nw_adapter.correlate.run_model import check_layers
    from nw_adapter.correlate.sweep import gather
    from nw_adapter.integration.config import NWProcessorConfig

    pipe = model.load(args, bars=show_progress_bars(args) and state.is_main_process)
    check_layers(args.layers, pipe)
    config = NWProcessorConfig(mode="observe", layers=args.layers)
    call = model.call_arguments(args)
    judge, known = None, {}
    if judged:
        from nw_adapter.correlate.digit_sets import known_digit_labels
        from nw_adapter.models.digits_quality import digit_judge

        judge, known = digit_judge(), known_digit_labels()
    bars = show_progress_bars(args)
    done = []
    with state.split_between_processes(list(enumerate(sets))) as mine:
        for i, s in mine:  # a plain line per set in a log (no bar drawn)
            start = time.perf_counter()
            done.append(_observe(args, pipe, call, config, judge, known, out_dir, i, s))
            seconds = time.perf_counter() - start
            progress_line(args.quiet, bars, f"set {i + 1} of {len(sets)} done in {seconds:.0f} s: {s[0].key}")
    done = sorted(gather(done, state), key=lambda item: item[0])
    if not state.is_main_process:
        return None
    entries = [entry for _, entry, _ in done]
    rows = [row for _, _, set_rows in done for row in set_rows]
    document = {
        "schema": report.SUPPORT_SCHEMA,
        "config": options_record(args.run.name, args, model.resolved(judge=JUDGE if judged else None)),
        "sets": entries,
        "summary": report.group_summary(entries),
    }
    atomic.atomic_write_text(out_dir / report.CSV_NAME, csv_text(rows) if rows else "set\n")
    report.plot_sweep(document, out_dir / report.FIGURE_NAME, title=f"support sets, {args.model}")
    write_json(out_dir / report.JSON_NAME, document)  # the marker of a finished run
    write_support_report(out_dir, document)  # report.html
    return document
