"""``correlate.py --support-set a.png,b.png``: generations conditioned on support sets, observed.

A mode of its own, like ``--compare-swap``: each support set (several reference images for the one
adapter, diffusers' list-per-adapter convention) conditions one generation, observed by the NW
processors (:func:`nw_adapter.analysis.support_sets.observe_support_set`; the image is the stock
one). The sets come from

- ``--support-set FILES`` (repeatable): one set per occurrence, comma-separated image files, in
  the order their masses are numbered (a file may appear twice: identical references must share
  the mass evenly, a control);
- ``--support-dir DIR`` (repeatable): every subfolder of DIR holding images is one set (named by
  the subfolder, files in name order).

Written into ``--out`` (atomically): ``sets/<key>/generated.png`` and ``sets/<key>/mass.png`` (the
set's per-reference mass over denoising, attention beside NW at the schedule's h), ``support.csv``
(the support-set columns of every record: step, layer, head, CFG half), ``support.json`` (schema
``nw-adapter/support-sets``: the options, per set the references with their CLIP-I and classes,
the winner and its step, the per-step masses, and the summary per group of sets) and
``support_mass.png`` (:func:`~nw_adapter.correlate.support_report.plot_sweep`). On the digits models
the class judge (:func:`nw_adapter.models.digits_quality.digit_judge`) labels the generation and
each reference. Every run recomputes its sets (no resume).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nw_adapter.commands import note

__all__ = ["MAX_REFERENCES", "SupportSetError", "SupportSetInput", "add_arguments", "check_options", "run"]

MAX_REFERENCES = 16
"""The most reference images one set may hold."""


JUDGE = "nw_adapter.models.digits_quality.digit_judge (RBF SVM fitted on the held-out judge split)"

_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", re.ASCII)

_REFUSED = {
    "image": "{given} names the references itself; drop --image",
    "image_dir": "{given} names the references itself; drop --image-dir",
    "compare_swap": "--compare-swap is a run of its own; run it without --support-set/--support-dir",
    "replot": "--replot redraws a rho run; drop it with --support-set/--support-dir",
    "store_maps": "--store-maps belongs to the rho run; drop it with --support-set/--support-dir",
    "end_to_end_control": "--end-to-end-control belongs to the rho run; drop it with the support sets",
}


class SupportSetError(ValueError):
    """Bad support-set input: printed as one line, exit status 2."""


@dataclass(frozen=True)
class SupportSetInput:
    """One support set: its key (output folder name) and its reference files, in order."""

    key: str
    files: tuple[Path, ...]


def _support_set(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(","))
    if not all(parts):
        raise argparse.ArgumentTypeError(
            f"--support-set '{text}' has an empty entry; pass comma-separated image files, e.g. a.png,b.png"
        )
    if len(parts) > MAX_REFERENCES:
        raise argparse.ArgumentTypeError(
            f"--support-set holds {len(parts)} images; a set takes at most {MAX_REFERENCES}, split it"
        )
    return parts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``support sets`` option group (``--support-set``, ``--support-dir``)."""
    group = parser.add_argument_group("support sets (instead of the rho run)")
    group.add_argument(
        "--support-set",
        action="append",
        type=_support_set,
        default=[],
        metavar="FILES",
        help="one generation conditioned on these reference images together (comma-separated, one adapter; "
        "repeatable: one set each); reports the attention mass per reference over denoising beside the NW "
        "weights at the schedule's h, and which reference the image resembles; writes support.json/.csv",
    )
    group.add_argument(
        "--support-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="every subfolder of DIR holding images is one support set (repeatable)",
    )


def check_options(args: argparse.Namespace) -> None:
    """Refuse options that cannot take effect with support sets (before anything is read).

    Raises:
        SupportSetError: one line naming the option and the fix.
    """
    if not (args.support_set or args.support_dir):
        return
    given = "--support-set" if args.support_set else "--support-dir"  # the option the user gave
    for dest, message in _REFUSED.items():
        value = getattr(args, dest, None)
        if value:
            raise SupportSetError(message.format(given=given))
    if args.mode == "swap":
        raise SupportSetError(f"{given} observes the stock generation; drop --mode swap")
    if any(not d.strip() for d in args.support_dir):
        raise SupportSetError("--support-dir is empty; pass a folder whose subfolders hold the sets")


def _dir_sets(folder: Path) -> list[SupportSetInput]:
    from nw_adapter.correlate.images import collect_image_paths

    if not folder.is_dir():
        raise SupportSetError(
            f"--support-dir '{folder}' is not a folder; pass a folder of one subfolder per set"
        )
    sets = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            files = tuple(path for path, _ in collect_image_paths([], [str(sub)]))
        except Exception:  # noqa: BLE001 - an empty or unreadable subfolder is not a set
            files = ()
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


def collect_sets(args: argparse.Namespace) -> list[tuple[SupportSetInput, list[Any]]]:
    """The sets of ``--support-set`` then ``--support-dir``, every file validated.

    Returns:
        ``[(set, [ReferenceImage per file])]``.

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
    checked = []
    for s in sets:
        infos = [load_reference_image(path, label="--support-set")[1] for path in s.files]
        checked.append((s, infos))
    return checked


def _check_out(out: Path) -> Path:
    from nw_adapter.correlate.outputs import RHO_RUN, SWAP_RUN, OutputError, run_files

    out = out.expanduser()
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out '{out}': exists and is not a folder; pass a folder path")
    if out.is_dir():
        found = run_files(out, RHO_RUN) + run_files(out, SWAP_RUN)
        if found:
            raise OutputError(
                f"--out '{out}' holds another run's files ({', '.join(found)}); support sets do not share a "
                "folder with it: pass another --out"
            )
    return out


def run_config(args: argparse.Namespace, shown: Any, device: str, dtype: str, judged: bool) -> dict[str, Any]:
    """The options recorded in ``support.json``."""
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
        "bandwidth_of_nw_columns": "schedule_c * sigma_t / alpha_t, schedule_c = 1",
        "judge": JUDGE if judged else None,
        "device": device,
        "dtype": dtype,
    }


def run(args: argparse.Namespace, *, bars: bool, check_true_cfg: Any) -> int:
    """Validate the sets, load the model, generate and observe each set, write and print the report.

    Returns:
        The exit status (0).
    """
    from nw_adapter import atomic
    from nw_adapter.correlate import families
    from nw_adapter.correlate import support_report as report
    from nw_adapter.correlate.html_report import write_support_report
    from nw_adapter.correlate.loading import (
        ModelSpec,
        build_pipeline,
        check_hub_files,
        resolve_device,
        resolve_dtype,
        resolve_spec,
    )
    from nw_adapter.correlate.outputs import OutputLock
    from nw_adapter.correlate.report import write_json
    from nw_adapter.correlate.spec import DIGIT_MODELS

    sets = collect_sets(args)
    out_dir = _check_out(args.out)
    spec = resolve_spec(
        ModelSpec(args.model, args.ip_adapter, args.subfolder, args.weight_name, args.image_encoder)
    )
    check_hub_files(spec)
    family = families.family_of_model(spec.model)
    check_true_cfg(args, family)
    if family == families.SD3:
        raise SupportSetError(
            "support sets need one adapter's list of images, which diffusers' SD 3.5 pipeline does not take "
            "(it fails on a list per adapter); use an SD 1.5 / SDXL or Flux model"
        )
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    judged = args.model in DIGIT_MODELS and all(size in (None, 32) for size in (args.height, args.width))
    out_dir.mkdir(parents=True, exist_ok=True)
    with OutputLock(out_dir):
        from nw_adapter.analysis.records import csv_text
        from nw_adapter.analysis.support_sets import observe_support_set
        from nw_adapter.correlate.digit_sets import pixel_digest
        from nw_adapter.correlate.images import load_reference_image
        from nw_adapter.integration.schema import SUPPORT_REFERENCES, support_columns

        pipe = build_pipeline(spec, device=device, dtype=dtype, scheduler=args.scheduler)
        pipe.set_progress_bar_config(disable=not bars, leave=False)
        pipe.set_ip_adapter_scale(args.ip_scale)
        call = families.call_kwargs(pipe, args.true_cfg_scale)
        for name in ("negative_prompt", "height", "width"):
            if getattr(args, name) is not None:
                call[name] = getattr(args, name)
        judge, known = None, {}
        if judged:
            from nw_adapter.correlate.digit_sets import known_digit_labels
            from nw_adapter.models.digits_quality import digit_judge

            judge, known = digit_judge(), known_digit_labels()
        shown = families.shown_spec(args.model, args.ip_adapter, args.image_encoder, spec)
        config = run_config(args, shown, device, str(dtype).removeprefix("torch."), judged)
        config["scheduler_class"] = type(pipe.scheduler).__name__
        entries, rows = [], []
        for s, infos in sets:
            references = [load_reference_image(info.path)[0] for info in infos]
            result = observe_support_set(
                pipe, references, judge=judge, seed=args.seed, prompt=args.prompt,
                num_inference_steps=args.steps, guidance_scale=args.guidance_scale, **call,
            )  # fmt: skip
            folder = out_dir / "sets" / s.key
            folder.mkdir(parents=True, exist_ok=True)
            atomic.atomic_write(folder / "generated.png", lambda tmp, image=result.image: image.save(tmp))
            files = [{"file": str(info.path), "sha256": info.sha256} for info in infos]
            digests = [pixel_digest(image) for image in references]
            labels = [known[d] for d in digests] if judged and all(d in known for d in digests) else None
            entry = report.set_entry(s.key, files, result, f"sets/{s.key}/generated.png", labels)
            report.plot_set(entry, folder / "mass.png", title=f"{s.key}: attention mass per reference")
            entries.append(entry)
            columns = set(support_columns(len(infos)))
            keys = ("step", "timestep", "h_schedule", "layer", "block", "head", "half", "adapter")
            for record in result.records:
                if record.get(SUPPORT_REFERENCES) is not None:
                    kept = {k: record[k] for k in keys if k in record}
                    kept.update({k: v for k, v in record.items() if k in columns})
                    rows.append({"set": s.key, **kept})
        document = {
            "schema": report.SUPPORT_SCHEMA,
            "config": config,
            "sets": entries,
            "summary": report.group_summary(entries),
        }
        atomic.atomic_write_text(out_dir / report.CSV_NAME, csv_text(rows) if rows else "set\n")
        report.plot_sweep(document, out_dir / report.FIGURE_NAME, title=f"support sets, {args.model}")
        write_json(out_dir / report.JSON_NAME, document)
        write_support_report(out_dir, document)  # report.html
    if not judged:
        note(args.quiet, "classes not judged: the digit judge reads the digits models' 32 x 32 images only")
    print(report.format_document(document))
    return 0
