"""Build a run's report from what there is: an output folder, a recorder, or its records.

- :func:`report` (``nw_adapter.report``): the notebook's entry; a folder of any run kind (``rho.json``,
  ``compare_swap.json`` or ``support.json`` in it), an :class:`~nw_adapter.integration.recorder.NWRecorder`
  (its records and stored maps), a list of records, or a
  :class:`~nw_adapter.analysis.consequence.SwapComparison`;
- :func:`write_rho_report`, :func:`write_swap_report`, :func:`write_support_report`: the command
  line's one call per run kind, writing ``report.html`` into ``--out`` atomically (never through a
  link, never outside ``--out``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nw_adapter.correlate.html_report.document import REPORT_NAME, Report

__all__ = ["remove_report", "report", "write_rho_report", "write_support_report", "write_swap_report"]


def _cfg(records: Sequence[Mapping[str, Any]]) -> bool:
    return any(r.get("half") in ("cond", "uncond") for r in records)


def _folder_maps(out: Path, report: Mapping[str, Any]) -> tuple[list, list]:
    """Per image entry of a ``rho.json``: its maps (:class:`ReferenceMaps`) and its pictures."""
    from nw_adapter.correlate.html_report.images import read_image
    from nw_adapter.correlate.html_report.maps_figure import ReferenceMaps
    from nw_adapter.correlate.maps import load_maps
    from nw_adapter.correlate.out_paths import OutputError, check_entry

    maps, pictures = [], []
    records = report["records"]
    for image in report.get("images") or []:
        key = image.get("key", "?")
        generated = None
        if image.get("generated"):
            generated = read_image(check_entry(out, image["generated"], option="report"))
        reference = read_image(image["path"]) if image.get("path") else None
        pictures.append((key, reference, generated))
        if not image.get("maps"):
            continue
        try:
            path = check_entry(out, image["maps"], option="report")
            folder = path.parent
            stored = load_maps(path)
        except (OSError, ValueError, OutputError):
            continue  # an unreadable maps file: the report says what it shows (no map of this reference)
        previews = {}
        for preview in sorted(folder.glob("x0_step*.png")):
            picture = read_image(preview)
            if picture is not None:
                previews[int(preview.stem.removeprefix("x0_step"))] = picture
        mine = [r for r in records if r.get("reference") == key]
        size = (generated.height, generated.width) if generated is not None else _square(stored)
        maps.append(
            ReferenceMaps(
                name=key,
                maps=stored,
                timesteps={r["step"]: r["timestep"] for r in mine},
                image_hw=size,
                batch_row=-1 if _cfg(mine) else 0,
                generated=generated,
                previews=previews,
            )
        )
    return maps, pictures


def _square(maps: Mapping[str, Any]) -> tuple[int, int]:
    """An image size for maps without their generated image: square grids (the largest stored)."""
    rows = max(int(array.shape[2]) for array in maps.values())
    side = round(rows**0.5)
    return (side * 8, side * 8)


def rho_folder_report(out: Path) -> Report:
    """The report of a rho run's ``--out`` (its ``rho.json``, images, maps and x0 estimates)."""
    from nw_adapter.analysis.validation import check_report
    from nw_adapter.correlate.html_report.rho_report import rho_report

    saved = json.loads((out / "rho.json").read_text(encoding="utf-8"))
    check_report(saved, source=f"report: {out / 'rho.json'}", fix="rerun the original command")
    maps, pictures = _folder_maps(out, saved)
    return rho_report(saved, maps=maps, pictures=pictures)


def write_rho_report(report: Mapping[str, Any], out: Path) -> Path:
    """Write ``report.html`` of a rho run (the ``rho.json`` document ``report``) into ``out``: the
    command line's rho runs, the end-to-end control's and ``--replot``."""
    from nw_adapter.correlate.html_report.rho_report import rho_report

    out = Path(out)
    _target(out)
    maps, pictures = _folder_maps(out, report)
    return _save(rho_report(report, maps=maps, pictures=pictures), out)


def write_swap_report(out: Path, document: Mapping[str, Any], comparison: Any = None) -> Path | None:
    """Write ``report.html`` of a ``--compare-swap`` run into ``out``.

    With the ``comparison`` (a run that computed it) the report holds its images; without one (a run
    that reused ``compare_swap.json``) a report already written for the same document (its digest)
    is kept, and otherwise one of the numbers alone is written.

    Returns:
        The path written, or None when the report of this document was kept.
    """
    from nw_adapter.correlate.html_report.swap_report import swap_report

    out = Path(out)
    target = _target(out)
    marker = f'data-document-digest="{document.get("digest")}"'
    if comparison is None and _holds(target, marker):
        return None
    page = swap_report(document, comparison)
    page.attributes = {"data-document-digest": str(document.get("digest"))}
    return _save(page, out)


def write_support_report(out: Path, document: Mapping[str, Any]) -> Path:
    """Write ``report.html`` of a support-set run (its ``support.json`` document) into ``out``."""
    from nw_adapter.correlate.html_report.support_report import support_report

    _target(Path(out))
    return _save(support_report(document, Path(out)), Path(out))


def remove_report(out: Path) -> None:
    """Remove ``out/report.html`` (a regular file only), before a run's files change."""
    from nw_adapter.atomic import remove_regular_file

    remove_regular_file(Path(out) / REPORT_NAME)


def _holds(path: Path, marker: str) -> bool:
    try:
        with open(path, encoding="utf-8") as handle:
            return marker in handle.read(4096)
    except OSError:
        return False


def _target(out: Path) -> Path:
    """``out/report.html``, checked: never a link's target, never a folder (one-line OutputError)."""
    from nw_adapter.correlate.out_paths import check_entry

    return check_entry(out, REPORT_NAME)


def _save(page: Report, out: Path) -> Path:
    return page.save(_target(out))


def _recorder_report(recorder: Any, generated: Any) -> Report:
    from nw_adapter.correlate.html_report.images import thumbnail
    from nw_adapter.correlate.html_report.maps_figure import ReferenceMaps
    from nw_adapter.correlate.html_report.rho_report import rho_report

    records = recorder.records()
    if not records:
        raise ValueError(
            f"report: the recorder holds no records ({records.empty_reason or 'run the pipeline first'})"
        )
    document = _records_document(records, getattr(records, "context", {}), recorder.config)
    generated = list(generated) if isinstance(generated, list | tuple) else [generated]
    maps = []
    stored = {name: value.detach().float().cpu().numpy() for name, value in recorder.maps().items()}
    calls = sorted({int(name.split("/")[0].removeprefix("call")) for name in stored})
    for position, call in enumerate(calls):
        mine = {k: v for k, v in stored.items() if k.startswith(f"call{call}/")}
        picture = generated[position] if position < len(generated) else None
        picture = None if picture is None else thumbnail(picture, 10**6)
        ones = [r for r in records if r.get("call") == call]
        size = (picture.height, picture.width) if picture is not None else _square(mine)
        maps.append(
            ReferenceMaps(
                name=f"call {call}",
                maps=mine,
                timesteps={r["step"]: r["timestep"] for r in ones},
                image_hw=size,
                batch_row=-1 if _cfg(ones) else 0,
                generated=picture,
            )
        )
    return rho_report(document, maps=maps, source="a recorder")


def _is_calibrated_call(source: Any) -> bool:
    """Whether ``source`` is an :class:`~nw_adapter.integration.calibration.CalibratedCall` (by its
    fields: the command line's layer imports no integration module here)."""
    return all(hasattr(source, name) for name in ("records", "exact_records", "meta", "recorder"))


def _calls_report(calls: Sequence[Any]) -> Report:
    """The report of :func:`~nw_adapter.integration.calibration.observe_call` results, one reference
    each: their records (each call's records labelled ``call <i>`` unless they name their
    ``reference``), the calibration's meta in the header."""
    from nw_adapter.correlate.html_report.rho_report import rho_report

    records = [
        record if "reference" in record else {"reference": f"call {index}", **record}
        for index, call in enumerate(calls)
        for record in call.records
    ]
    if not records:
        raise ValueError("report: the calls hold no records; run observe_call first")
    meta = next((call.meta for call in calls if call.meta), None)
    first = calls[0].recorder
    context = first.records().context if first is not None else {}
    document = _records_document(records, context, getattr(first, "config", None), calibration=meta)
    return rho_report(document, source=f"observe_call ({len(calls)} call{'' if len(calls) == 1 else 's'})")


def _records_document(
    records: Sequence[Mapping[str, Any]],
    context: Mapping[str, Any],
    config: Any = None,
    *,
    calibration: Mapping[str, Any] | None = None,
) -> dict:
    """The ``rho.json``-shaped document of records from a notebook (no reference images, no files;
    ``calibration``: the exact head's meta of a calibrated call, rho.json's ``config["calibration"]``)."""
    from nw_adapter.analysis.records import Records
    from nw_adapter.correlate.report import build_report, control_meta

    records = list(records)
    models = sorted({str(r["model"]) for r in records if r.get("model")})
    first = min((r.get("call", 0) for r in records), default=0)
    options = {
        "model": {"model": ", ".join(models) or None},
        "steps": len({r.get("timestep") for r in records if r.get("call", 0) == first}),
        "bandwidth": context.get("bandwidth"),
        "mode": getattr(config, "mode", None) or (records[0].get("mode") if records else None),
        "scheduler_class": context.get("scheduler"),
        **({"calibration": dict(calibration)} if calibration else {}),
    }
    control = None
    draws = Records(records).summary()
    count = max((int(r.get("control_draws") or 0) for r in draws), default=0)
    if count and context.get("control"):
        control = control_meta(
            draws=count, seed=int(getattr(config, "untrained_seed", 0) or 0), kind=context["control"]
        )
    return build_report(records, config=options, images=[], targets=(), control=control)


def report(source: Any, *, generated: Any = None) -> Report:
    """The interactive report of a run, for a notebook (``nw_adapter.report``).

    Args:
        source: an output folder of the command line (a rho run, ``--compare-swap`` or a support-set
            run; or the path of its ``rho.json`` / ``compare_swap.json`` / ``support.json``), an
            :class:`~nw_adapter.integration.recorder.NWRecorder` (its records and, with
            ``store_maps=True``, its maps), a list of records (``rec.to_records()``), or a
            :class:`~nw_adapter.analysis.consequence.SwapComparison` of
            :func:`~nw_adapter.compare_swap` (its images included), or the result of
            :func:`~nw_adapter.observe_call` (a ``CalibratedCall``) or a list of them, one reference
            each (with ``calibrate=True``: the adapter beside the exact NW head and the control), or
            :func:`~nw_adapter.observe_support_set`'s result (a ``SupportSetRun``) or a list of them,
            one set each (their references and generations shown from memory).
        generated: with a recorder: the generated image(s), one per pipeline call, drawn under its
            maps (PIL images; default: the maps alone).

    Returns:
        A :class:`~nw_adapter.correlate.html_report.document.Report`: it displays inline in Jupyter
        and ``.save(path)`` writes the self-contained HTML file.

    Raises:
        ValueError: a source of none of these kinds, a folder without a run's file, no records.

    Example:
        >>> import nw_adapter
        >>> with nw_adapter.nw_processor(pipe, store_maps=True) as rec:  # doctest: +SKIP
        ...     image = pipe("a photograph", ip_adapter_image=ref).images[0]
        >>> nw_adapter.report(rec, generated=image)  # doctest: +SKIP
        >>> nw_adapter.report("out_tiny").save("out_tiny/report.html")  # doctest: +SKIP
    """
    if isinstance(source, str | os.PathLike):
        return _path_report(Path(source))
    if hasattr(source, "to_records") and hasattr(source, "maps"):
        return _recorder_report(source, generated)
    if _is_calibrated_call(source):
        return _calls_report([source])
    if isinstance(source, list | tuple) and source and all(_is_calibrated_call(s) for s in source):
        return _calls_report(source)
    if hasattr(source, "per_reference") and hasattr(source, "rules"):
        return _comparison_report(source)
    if _is_support_run(source):
        return _support_runs_report([source])
    if isinstance(source, list | tuple) and source and all(_is_support_run(s) for s in source):
        return _support_runs_report(source)
    if isinstance(source, list | tuple) and all(isinstance(r, Mapping) for r in source):
        from nw_adapter.correlate.html_report.rho_report import rho_report

        if not source:
            raise ValueError("report: no records; pass rec.to_records() of a recorder that ran")
        document = _records_document(source, getattr(source, "context", {}))
        return rho_report(document, source="records")
    raise ValueError(
        f"report: cannot make a report of {type(source).__name__}; pass an output folder, an NWRecorder, its "
        "records (a list of dicts), observe_call's result(s), a SwapComparison or observe_support_set's "
        "result(s)"
    )


def _is_support_run(source: Any) -> bool:
    """Whether ``source`` is a :class:`~nw_adapter.analysis.support_sets.SupportSetRun` (by its fields)."""
    return all(hasattr(source, name) for name in ("latent_steps", "clip_cosine", "references", "settings"))


def _support_runs_report(runs: Sequence[Any]) -> Report:
    """The support-set report of :func:`~nw_adapter.analysis.support_sets.observe_support_set`'s runs,
    one set each (``set 0``, ``set 1``, ...), their images from memory; the settings shown are the
    first run's, and runs of other settings are refused (their sets would not be comparable)."""
    from nw_adapter.correlate.html_report.support_report import support_report
    from nw_adapter.correlate.support_report import SUPPORT_SCHEMA, group_summary, set_entry

    settings = [dict(run.settings) for run in runs]

    def seedless(one: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in one.items() if k != "seed"}

    for i, other in enumerate(settings[1:], start=1):
        if seedless(other) != seedless(settings[0]):
            raise ValueError(
                f"report: support-set run {i} ran with other settings than run 0 ({other} against "
                f"{settings[0]}); pass runs of one setting (the seed may differ)"
            )
    entries, pictures = [], {}
    for i, run in enumerate(runs):
        key = f"set {i}"
        files = [{"file": None, "sha256": None} for _ in run.clip_cosine]
        entries.append(set_entry(key, files, run, generated=None))
        pictures[key] = (list(run.references), run.image)
    first = settings[0]
    seeds = list(dict.fromkeys(str(one.get("seed")) for one in settings))
    if len(seeds) > 1:  # one set per seed, all shown: "seed 0, 1, 2"
        first = {**first, "seed": ", ".join(seeds)}
    config = {
        "model": {"model": first.get("model")},
        "steps": first.get("num_inference_steps"),
        **{k: v for k, v in first.items() if k not in ("model", "num_inference_steps")},
    }
    document = {
        "schema": SUPPORT_SCHEMA,
        "config": config,
        "sets": entries,
        "summary": group_summary(entries),
    }
    return support_report(document, None, source="observe_support_set", pictures=pictures)


def _path_report(path: Path) -> Report:
    from nw_adapter.correlate.html_report.support_report import support_report
    from nw_adapter.correlate.html_report.swap_report import swap_report

    folder = path.parent if path.is_file() else path
    names = ("rho.json", "compare_swap.json", "support.json")
    found = [name for name in names if (folder / name).is_file() and (path.is_dir() or path.name == name)]
    if not found:
        raise ValueError(
            f"report: '{path}' holds no run's file ({', '.join(names)}); "
            "pass the --out folder of a finished run"
        )
    name = found[0]
    try:
        document = json.loads((folder / name).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"report: cannot read '{folder / name}' ({exc}); rerun the original command"
        ) from None
    if name == "rho.json":
        return rho_folder_report(folder)
    if name == "compare_swap.json":
        return swap_report(document, source=str(folder / name))
    return support_report(document, folder, source=str(folder / name))


def _comparison_report(comparison: Any) -> Report:
    from nw_adapter.correlate.html_report.swap_report import swap_report

    rows = [dict(row, key=f"reference {row['reference']}") for row in comparison.per_reference]
    count = 1 + max((row["reference"] for row in rows), default=-1)
    document = {
        "config": {"model": {"model": None}, **comparison.settings},
        "images": [{"key": f"reference {i}"} for i in range(count)],
        "rules": list(comparison.rules),
        "per_reference": rows,
        "summary": comparison.summary(),
        "embedding": comparison.embedding,
        "settings": comparison.settings,
    }
    return swap_report(document, comparison, source="a SwapComparison")
