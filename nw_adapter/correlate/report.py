"""Reports of the attention-vs-NW comparison: table, verdict, ``rho.json`` and ``rho.csv``.

Input is the tidy list of record dicts of :meth:`nw_adapter.integration.recorder.NWRecorder.to_records`
(one per call, step, layer, head, CFG half, adapter, image), each extended with a
``reference`` key (the reference image's key, see :mod:`nw_adapter.correlate.images`) by the command
line. Everything here is plain Python, so reports
can be rebuilt from a saved ``rho.json`` without torch.

Aggregation (:func:`nw_adapter.analysis.records.aggregate`, the one implementation the
recorder's summary shares): for one CFG half (``cond`` when the run used classifier-free
guidance, else ``all``), every statistic is averaged over layers, heads, adapters and reference
images per denoising step (NaN entries, e.g. the Spearman of a constant row, are left out of the
mean and counted). This module formats what the aggregation gives: table, JSON, CSV; the
verdict is tested over reference images, the independent unit (:mod:`nw_adapter.correlate.verdict`,
re-exported here). The table reports the steps whose timesteps are closest to the paper's
:data:`PAPER_TIMESTEPS` (981, 761, 501, 261, 1 for 50 SD 1.5 steps), or every step.

All files are written atomically (a temporary file in the same folder, then ``os.replace``),
so an interrupted run never leaves a half-written file under the final name.
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from nw_adapter.analysis.records import COLUMN_LEGEND as COLUMN_LEGEND  # re-exported
from nw_adapter.analysis.records import OPTIONAL_COLUMNS as OPTIONAL_COLUMNS  # re-exported
from nw_adapter.analysis.records import RHO_THRESHOLD as RHO_THRESHOLD  # re-exported
from nw_adapter.analysis.records import TABLE_COLUMNS as TABLE_COLUMNS  # re-exported
from nw_adapter.analysis.records import aggregate as aggregate_records
from nw_adapter.analysis.records import analysis_half, control_line, csv_text, records_control
from nw_adapter.analysis.records import format_legend as format_legend  # re-exported
from nw_adapter.analysis.records import format_table as format_table  # re-exported
from nw_adapter.analysis.records import repeated_timestep_note as records_note
from nw_adapter.analysis.records import repeated_timesteps as repeated_timesteps  # re-exported
from nw_adapter.analysis.validation import REPORT_SCHEMA, REPORT_SCHEMA_VERSION
from nw_adapter.atomic import atomic_write_json, atomic_write_text
from nw_adapter.correlate.verdict import format_readings
from nw_adapter.correlate.verdict import format_verdict as format_verdict  # re-exported
from nw_adapter.correlate.verdict import verdict as verdict  # re-exported
from nw_adapter.integration.families import tiny_models
from nw_adapter.integration.schema import RECORD_KEYS, RUN_KEYS, SUMMARY_STATS

SCHEMA = REPORT_SCHEMA
SCHEMA_VERSION = REPORT_SCHEMA_VERSION  # --replot refuses any other (validation.check_report)

PAPER_TIMESTEPS: tuple[int, ...] = (981, 761, 501, 261, 1)
"""Timesteps the paper reports (50 DDIM/PNDM steps of SD 1.5)."""

STAT_FIELDS: tuple[str, ...] = SUMMARY_STATS
"""Per-record statistics averaged by :func:`aggregate`."""

RECORD_FIELDS: tuple[str, ...] = ("reference", *RECORD_KEYS, *RUN_KEYS, *STAT_FIELDS)
"""Column order of ``rho.csv``: the statistics in reporting order (extra record keys follow, sorted)."""


def aggregate(
    records: Sequence[dict], by: Sequence[str] = ("step",), *, half: str | None = None
) -> list[dict]:
    """Average :data:`STAT_FIELDS` per group, for one CFG half (default :func:`analysis_half`).

    :func:`nw_adapter.analysis.records.aggregate` with the step's ``timestep``: one dict per
    group, sorted by the group keys, with ``half``, ``timestep``, the mean of every statistic
    over its finite values (None when there is none: JSON-ready; the readings and the
    scale-matched control's draws' means ``{X}_control``, ``key_scale`` and ``control_draws``
    where recorded), ``nonfinite``, ``frac_rho_gt_0_9`` and ``count``.
    """
    half = half or analysis_half(records)
    return [json_ready(row) for row in aggregate_records(records, by, half=half, optional_stats=True)]


def select_steps(step_rows: Sequence[dict], targets: Sequence[float] = PAPER_TIMESTEPS) -> list[dict]:
    """Rows whose timesteps are closest to each target (each row at most once, step order).

    Args:
        step_rows: Output of :func:`aggregate` with ``by=("step",)``.
        targets: Timesteps to match; an empty sequence keeps every row.
    """
    if not targets or not step_rows:
        return list(step_rows)

    def closest(target: float) -> int:
        return min(range(len(step_rows)), key=lambda i: (abs(step_rows[i]["timestep"] - target), i))

    chosen = {closest(t) for t in targets}
    return [step_rows[i] for i in sorted(chosen)]


def parse_table(text: str) -> list[dict]:
    """Inverse of :func:`format_table` (numbers as floats, ``nan`` as None; columns from the header)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    by_header = {header: key for key, header, _ in TABLE_COLUMNS}
    keys = [by_header[header] for header in lines[0].split()]
    rows = []
    for line in lines[1:]:
        values = line.split()
        rows.append({key: (None if v == "nan" else float(v)) for key, v in zip(keys, values, strict=True)})
    return rows


def package_versions() -> dict[str, str | None]:
    """Versions of Python and of the packages a result depends on."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("nw-adapter", "torch", "diffusers", "transformers", "accelerate", "numpy", "pillow"):
        try:
            versions[name.replace("-", "_")] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name.replace("-", "_")] = None
    return versions


def json_ready(value: Any) -> Any:
    """Replace non-finite floats by None (strict JSON) and tuples by lists, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


CONTROL_KINDS: tuple[str, ...] = ("per-layer", "end-to-end")
"""Kinds of untrained-adapter control a run's ``control`` meta names (docs/controls.md)."""

CONTROL_MATCHED = "keys rescaled per layer and head to the trained keys' RMS norm"
"""How the control is matched in scale (the ``matched`` field of the ``control`` meta)."""


def control_meta(*, draws: int, seed: int, kind: str = "per-layer") -> dict:
    """The ``control`` field of ``rho.json``: ``{"kind", "draws", "seeds", "matched"}``.

    Args:
        draws: the number K of control draws. seed: the first draw's seed s (draw k: s + k).
        kind: ``"per-layer"`` (the untrained keys of each layer against the trained run's
            queries) or ``"end-to-end"`` (a second pass with the untrained adapter everywhere).

    Raises:
        ValueError: an unknown kind, or draws not an int >= 1.
    """
    if kind not in CONTROL_KINDS:
        raise ValueError(f"control kind must be one of {CONTROL_KINDS}, got {kind!r}")
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ValueError(f"control draws must be an int >= 1, got {draws!r}")
    seeds = [seed + k for k in range(draws)]
    return {"kind": kind, "draws": draws, "seeds": seeds, "matched": CONTROL_MATCHED}


def _run_control(config: dict) -> dict | None:
    """The per-layer control meta of a run's options (None when the control is off, or for the
    options of an earlier version, whose one-draw control was not matched in scale)."""
    if not config.get("untrained_control") or config.get("untrained_draws") is None:
        return None
    return control_meta(draws=int(config["untrained_draws"]), seed=int(config.get("untrained_seed") or 0))


def build_report(
    records: Sequence[dict],
    *,
    config: dict,
    images: Sequence[dict],
    targets: Sequence[float] = PAPER_TIMESTEPS,
    versions: dict | None = None,
    control: dict | None = None,
) -> dict:
    """Assemble the ``rho.json`` document (schema: docs/rho_json_schema.md).

    Args:
        records: All record dicts, each with a ``reference`` key.
        config: The run's resolved options.
        images: Per-image descriptions (``ReferenceImage.to_dict()`` plus output paths).
        targets: Timesteps for the table (empty: every step).
        versions: Package versions (default :func:`package_versions`).
        control: The ``control`` meta (:func:`control_meta`); default: the per-layer control of
            ``config`` (``untrained_control``, ``untrained_draws``, ``untrained_seed``), absent
            when it is off.
    """
    control = control if control is not None else _run_control(config)
    half = analysis_half(records)
    steps = aggregate(records, ("step",), half=half)
    table = select_steps(steps, targets)
    return json_ready(
        {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "config": config,
            **({"control": control} if control is not None else {}),
            "versions": versions if versions is not None else package_versions(),
            "images": list(images),
            "half": half,
            "table": table,
            "steps": steps,
            "blocks": aggregate(records, ("block", "step"), half=half),
            "verdict": verdict(records, half=half, merged_files=sum(i.get("duplicates", 0) for i in images)),
            "warning": random_weights_note({"config": config}),
            "records": list(records),
        }
    )


def write_json(path: str | os.PathLike, document: Any) -> Path:
    """Write strict JSON (NaN -> null), indented, atomically."""
    return atomic_write_json(path, json_ready(document))


def records_csv(records: Sequence[dict]) -> str:
    """CSV text of the records, columns :data:`RECORD_FIELDS` then any extra keys (sorted)."""
    return csv_text(records, order=RECORD_FIELDS)


def write_report_files(report: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``rho.json`` and ``rho.csv`` into ``out_dir`` (atomically)."""
    out_dir = Path(out_dir)
    return {
        "json": write_json(out_dir / "rho.json", report),
        "csv": atomic_write_text(out_dir / "rho.csv", records_csv(report["records"])),
    }


def repeated_timestep_note(report: dict) -> str | None:
    """One sentence explaining repeated timesteps (documented choice: steps are denoiser calls):
    :func:`nw_adapter.analysis.records.repeated_timestep_note` of the report's ``steps``, naming
    its scheduler and the steps asked for."""
    config = report.get("config") or {}
    return records_note(
        report.get("steps", []), scheduler=config.get("scheduler_class"), requested=config.get("steps")
    )


def control_kind_and_draws(report: dict) -> tuple[str | None, int]:
    """The control of a report: ``(kind, draws)`` from its ``control`` meta (``"per-layer"``,
    ``"end-to-end"``), else from its records' columns (kind None); ``(None, 0)`` without one."""
    meta = report.get("control") or {}
    draws = records_control(report.get("records", []))
    if meta and not draws:
        draws = int(meta.get("draws") or 0)
    return meta.get("kind"), draws


RANDOM_WEIGHT_MODELS: tuple[str, ...] = tiny_models(trained=False)
"""``--model`` values with random weights: stand-ins that exercise the code, not models."""


def random_weights_note(report: dict) -> str | None:
    """The warning every output of a random-weight tiny model carries (None for other models)."""
    model = ((report.get("config") or {}).get("model") or {}).get("model")
    if model not in RANDOM_WEIGHT_MODELS:
        return None
    return f"{model} has random weights: these numbers test the code and say nothing about any trained model"


def format_report(report: dict, *, detail: bool = True, out_dir: str | os.PathLike | None = None) -> str:
    """What the command line prints.

    ``detail=True`` (the default; ``correlate.py -v``): a context line, the table, its legend, the
    calibrated table of a calibrated run (adapter, exact head and control side by side, one row per
    reading: :func:`~nw_adapter.correlate.verdict.format_readings`) and the full verdict.

    ``detail=False`` (``correlate.py`` without ``-v``: one screen): what ran (model, references,
    steps, the control and the calibration), the table, the brief verdict
    (:func:`~nw_adapter.correlate.verdict.format_verdict` with ``detail=False``) and one line saying
    where the details are (``-v``, and ``report.html``, ``rho.json``, ``rho.csv`` in ``out_dir``).
    """
    if not detail:
        return _brief_report(report, out_dir)
    records = report["records"]
    half = report["half"]
    kept = [r for r in records if r.get("half") == half]
    layers = len({r.get("layer") for r in kept})
    heads = len({r.get("head") for r in kept})
    references = len({r.get("reference") for r in kept})
    config = report.get("config", {})
    context = (
        f"attention vs NW weights, {half} half, mean over {layers} layer(s) x {heads} head(s) x "
        f"{references} reference image(s); bandwidth {config.get('bandwidth')}, mode {config.get('mode')}, "
        f"{config.get('steps')} steps ({config.get('scheduler_class', 'scheduler')})"
    )
    note = repeated_timestep_note(report)
    if note:
        context += f"; note: {note}"
    table = report["table"]
    lines = [context, controls_line(report), format_table(table), format_legend(table)]
    calibrated = format_readings(report["verdict"])
    if calibrated:
        lines.append(calibrated)
    lines.append(format_verdict(report["verdict"]))
    warning = random_weights_note(report)
    if warning:
        lines.insert(0, f"WARNING: {warning}")
    return "\n".join(lines)


def controls_line(report: dict) -> str:
    """What the adapter is read beside: the control that ran and, in a calibrated run, the exact head
    (one line, the same under ``-v``, without it and in ``--replot``)."""
    line = control_line(*control_kind_and_draws(report))
    if report.get("config", {}).get("calibration"):
        line += "; calibrated: each reference run again with the exact NW head at the schedule's h, same seed"
    return line


def details_line(verdict_result: dict, out_dir: str | os.PathLike | None) -> str:
    """The last line of the brief report: where the rest is (``-v``; the files of ``out_dir``)."""
    from nw_adapter.correlate.verdict import skipped_count

    skipped = skipped_count(verdict_result)
    left_out = f", the {skipped} values left out of the means" if skipped else ""
    report = "report.html" if out_dir is None else str(Path(out_dir) / "report.html")
    return (
        f"details: -v prints every part's interval, p and n{left_out} and the legends; open {report} in a "
        "browser (offline, interactive); every record in rho.json / rho.csv"
    )


def _brief_report(report: dict, out_dir: str | os.PathLike | None) -> str:
    records = report["records"]
    half = report["half"]
    kept = [r for r in records if r.get("half") == half]
    config = report.get("config", {})
    model = (config.get("model") or {}).get("model")
    references = len({r.get("reference") for r in kept})
    layers, heads = len({r.get("layer") for r in kept}), len({r.get("head") for r in kept})
    lines = [
        f"attention vs NW weights, {model}: {references} reference image(s), {config.get('steps')} steps "
        f"({config.get('scheduler_class', 'scheduler')}), bandwidth {config.get('bandwidth')}, mode "
        f"{config.get('mode')}; {half} half, means over {layers} layer(s) x {heads} head(s)"
    ]
    lines.append(controls_line(report))
    note = repeated_timestep_note(report)
    if note:
        lines.append(f"note: {note}")
    verdict_result = report["verdict"]
    lines += [format_table(report["table"]), format_verdict(verdict_result, detail=False)]
    lines.append(details_line(verdict_result, out_dir))
    warning = random_weights_note(report)
    if warning:
        lines.insert(0, f"WARNING: {warning}")
    return "\n".join(lines)
