"""The rho run of ``correlate.py`` (and its end-to-end control): rho between IP-Adapter attention
and NW weights per timestep, for one or many reference images.

Order of work, so that bad input costs nothing and leaves nothing behind: the options were
parsed and checked (:mod:`~nw_adapter.correlate.options`); here every reference image is
validated, ``--out`` is checked (writable, no link, apart from the inputs, no files of another
kind of run), the processor configuration is built (all before torch is imported), the lock on
``--out`` is taken (single-process runs), the model is resolved and checked, loaded, and the
images are generated (:func:`~nw_adapter.correlate.sweep.run_sweep`: resumable, sharded over the
processes of ``accelerate launch``). A write failure during the run exits 2 with one line; the
images finished before it are kept, a report written in part is removed, and a rerun resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nw_adapter.commands import note, progress_line
from nw_adapter.correlate.console import library_output, quiet_libraries, show_progress_bars
from nw_adapter.correlate.images import ReferenceImage, collect_image_paths, validate_images
from nw_adapter.correlate.options import END_TO_END, CLIError
from nw_adapter.correlate.outputs import check_apart, check_apart_from_models, check_output_dir
from nw_adapter.correlate.report import PAPER_TIMESTEPS

__all__ = ["processor_config", "reported_steps", "run"]


def processor_config(args: argparse.Namespace, map_steps: Sequence[int] | None = None):
    """The :class:`~nw_adapter.integration.config.NWProcessorConfig` of the options.

    Statistics are recorded in swap mode too (the comparison is the point of this run); maps, with
    ``--store-maps``, are kept head-averaged at ``map_steps``.
    """
    from nw_adapter.integration.config import NWProcessorConfig

    end_to_end = args.run.name == END_TO_END
    options: dict[str, Any] = {
        "mode": args.mode,
        "bandwidth": args.bandwidth,
        "layers": args.layers,
        "statistics": True,
        "seed": args.seed,
        "store_maps": args.store_maps,
        # the end-to-end control writes the control columns itself (from its own passes)
        "untrained_control": args.untrained_control and not end_to_end,
        "untrained_seed": args.untrained_seed,
        "untrained_draws": args.control_draws,
    }
    if args.store_maps:
        options.update(map_steps=list(map_steps) if map_steps else None, map_head_mean=True)
    return NWProcessorConfig(**options)


def reported_steps(
    pipe: Any, steps: int, *, all_steps: bool = False, height: int | None = None, width: int | None = None
) -> tuple[list[int], dict[int, float]]:
    """Step indices (denoiser calls) whose timesteps are closest to the paper's, and every step's timestep.

    Uses a copy of the pipeline's scheduler, so the pipeline itself is untouched (flow-matching
    pipelines: the sigmas and shift they pass, see :func:`nw_adapter.correlate.families.planned_timesteps`).
    """
    from nw_adapter.correlate.families import planned_timesteps
    from nw_adapter.correlate.report import select_steps

    timesteps = planned_timesteps(pipe, steps, height, width)
    rows = [{"step": i, "timestep": t} for i, t in enumerate(timesteps)]
    chosen = select_steps(rows, () if all_steps else PAPER_TIMESTEPS)
    return [r["step"] for r in chosen], {r["step"]: r["timestep"] for r in rows}


def _generate(
    args: argparse.Namespace, pipe: Any, config: Any, call: dict, model: Any
) -> tuple[Any, Any, list[dict], Any]:
    """One reference's generation as the run chose it: the plain observed call (with ``--store-maps``
    its x0 estimates), the calibrated pair (``--calibrate``: the adapter's call and the exact NW
    head's) or the trained call and its end-to-end control passes.

    Returns:
        ``(the adapter's pipeline output, its pass's recorder (skipped pairs, failed steps, maps),
        its records of every key set with the calibration's or the control's columns merged, the x0
        previews or None)``.
    """
    from nw_adapter.correlate.calibrate_cli import run_calibrated
    from nw_adapter.correlate.end_to_end_cli import run_end_to_end
    from nw_adapter.correlate.previews import X0Previews
    from nw_adapter.integration.mixin import nw_processor

    if args.calibrate:  # the adapter's call and the exact NW head's (no maps: refused)
        calibrated = run_calibrated(args, pipe, config, call)
        return calibrated.output, calibrated.recorder, calibrated.records, None
    if args.end_to_end_control:  # the trained call and K untrained passes (no maps: refused)
        controlled = run_end_to_end(args, pipe, config, call)
        return controlled.trained_output, controlled.recorder, controlled.records, None
    with contextlib.ExitStack() as stack:
        recorder = stack.enter_context(nw_processor(pipe, config))
        previews = None
        if args.store_maps:  # x0 estimates at the map steps, from a hook that changes nothing
            true_cfg = model.call.get("true_cfg_scale", 1.0)
            previews = stack.enter_context(
                X0Previews(pipe, recorder, config.map_steps, true_cfg_scale=true_cfg)
            )
        output = pipe(**call)
    return output, recorder, recorder.to_records(key_set=None), previews


def _image_worker(
    args: argparse.Namespace,
    pipe: Any,
    config: Any,
    infos: dict[str, ReferenceImage],
    out_dir: Path,
    model: Any,
    run_id: str | None = None,
):
    """``work(key) -> (image_entry, records)`` for :func:`nw_adapter.correlate.sweep.run_sweep`;
    the records' ``run`` is ``run_id`` (one per run: the sweep's fingerprint) when given.

    Every kind of rho run (plain, ``--calibrate``, ``--end-to-end-control``) generates through
    :func:`_generate` and writes through one path: the skipped note and the failed steps of the
    adapter's pass, ``generated.png``, SD 3.5's joint key set as ``rho_joint.csv``, the IP key set's
    records, and with ``--store-maps`` the maps and x0 estimates."""
    import torch

    from nw_adapter.atomic import atomic_write
    from nw_adapter.correlate import families
    from nw_adapter.correlate.images import load_reference_image
    from nw_adapter.correlate.outputs import draw_image_maps, skipped_note
    from nw_adapter.correlate.sweep import image_dir

    def work(key: str) -> tuple[dict, list[dict]]:
        info = infos[key]
        reference, _ = load_reference_image(info.path)
        folder = image_dir(out_dir, key)
        generator = torch.Generator(device="cpu").manual_seed(args.seed)
        call = {**model.call_arguments(args), "ip_adapter_image": reference, "generator": generator}
        run = {"run": run_id} if run_id else {}
        with warnings.catch_warnings():
            # the recorder's skip warning becomes one note below (raw warnings only with -v)
            if not args.verbose:
                warnings.filterwarnings("ignore", message="NWRecorder: the NW side computation failed")
            output, recorder, recorded, previews = _generate(args, pipe, config, call, model)
        skipped = skipped_note(recorder, args.mode, info.path.name)
        if skipped:
            note(args.quiet, skipped)
        failure = recorder.failed_steps_line(see=None)  # steps without statistics: even with -qq
        if failure:
            print(f"error: {info.path.name}: {failure}", file=sys.stderr)
        generated = output.images[0]
        relative = folder.relative_to(out_dir)
        atomic_write(folder / "generated.png", lambda tmp: generated.save(tmp))
        entry = {**info.to_dict(), "generated": str(relative / "generated.png")}
        if families.write_joint_records(recorded, folder) is not None:  # SD 3.5's joint key set
            entry["joint_records"] = str(relative / "rho_joint.csv")
        records = [{"reference": key, **r, **run} for r in recorded if r.get("key_set", "ip") == "ip"]
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


def run(args: argparse.Namespace) -> int:
    """Check the inputs and ``--out``, load the model, compute every (unfinished) image, and on the
    main process write the report.

    Returns:
        The exit status (0).
    """
    infos = validate_images(collect_image_paths(args.image, args.image_dir))
    check_apart(args.out, files=args.image, folders=args.image_dir, option="--image")
    check_apart_from_models(args.out, args)
    out_dir = check_output_dir(args.out, [info.key for info in infos])
    processor_config(args)  # option errors now, before any model is loaded
    quiet_libraries(args)
    from nw_adapter.correlate.run_model import join_processes, prepare_model
    from nw_adapter.correlate.sweep import is_distributed_launch

    # the lock first (the processes of one launch share --out: none), then the model's files and
    # family (offline: before torch is imported); what fails there leaves nothing in --out
    with _lock(out_dir, not is_distributed_launch()):
        model = prepare_model(args)
        state = join_processes(model, args.device)
        for info in infos:
            for text in info.notes:
                note(args.quiet, f"{info.path.name}: {text}", shown=state.is_main_process)
        with library_output(args):
            return _sweep(args, model, infos, out_dir, state)


def _lock(out_dir: Path, lock: bool):
    from nw_adapter.correlate.outputs import OutputLock

    return OutputLock(out_dir) if lock else contextlib.nullcontext()


def _sweep(
    args: argparse.Namespace, model: Any, infos: Sequence[ReferenceImage], out_dir: Path, state: Any
) -> int:
    """Load, check ``--layers``, sweep, report."""
    from nw_adapter.atomic import WriteError
    from nw_adapter.correlate.options import fingerprint, options_record
    from nw_adapter.correlate.outputs import (
        check_image_result_file,
        remove_interrupted_writes,
        remove_report,
        write_outputs,
    )
    from nw_adapter.correlate.report import build_report
    from nw_adapter.correlate.run_model import check_layers
    from nw_adapter.correlate.sweep import run_sweep

    bars = show_progress_bars(args)
    pipe = model.load(args, bars=bars and state.is_main_process)
    map_steps, _ = reported_steps(
        pipe, args.steps, all_steps=args.all_steps, height=args.height, width=args.width
    )
    config = processor_config(args, map_steps)
    check_layers(args.layers, pipe)
    resolved = model.resolved()
    options = options_record(args.run.name, args, resolved)
    by_key = {info.key: info for info in infos}
    # The resolved model (for tiny: the cache folder named by the builder's source hash) is part of
    # the fingerprint, so a result is only reused with the model that produced it.
    expected = fingerprint(args.run.name, args, resolved)
    run_id = expected[:12]  # the records' run: the same for images reused on a resume
    if state.is_main_process:  # before any process writes (they wait for the main one in run_sweep)
        remove_interrupted_writes(out_dir, list(by_key))
    outcome = run_sweep(
        list(by_key),
        _image_worker(args, pipe, config, by_key, out_dir, model, run_id),
        out_dir=out_dir,
        expected_fingerprint=expected,
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
    try:
        text = write_outputs(report, out_dir, detail=args.verbose)
    except WriteError:
        remove_report(out_dir)  # no report of this run in part: rho.json without its figures
        raise
    print(text)
    return 0
