"""Trained vs scale-matched control readings of correlate.py runs, as a markdown table with t intervals.

Usage:
    python scripts/readings_table.py out_digits/rho.json           # unit: reference image
    python scripts/readings_table.py runs/*/rho.json               # unit: run (mean of its images)

Reads each run's records (the verdict's CFG half, the IP key set, every recorded step), averages
every reading per reference image, and prints the mean and Student t 95% interval over the unit of
the trained value, the scale-matched control's value (the untrained adapter's keys rescaled per
layer and head to the trained keys' RMS norm; per record the mean over its K draws) and their
difference, and the change of scale (the geometric mean of ``key_scale_k``). Files of earlier
versions (``*_untrained`` columns: one draw, not matched in scale) have no scale-matched control:
the script says so and stops.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from nw_adapter.commands import ScriptParser
from nw_adapter.core.intervals import t_interval
from nw_adapter.integration.schema import (
    CONTROL_MEAN_SUFFIX,
    KEY_SCALE,
    control_draws,
    control_label,
    control_mean,
)

READINGS = ("rho", "r2_key", "r2_nw", "kl_nw_fit", "kl_key_prior", "nw_gain", "kl", "key_norm_cv")


PROG = "readings_table.py"
FIX = "pass the rho.json a correlate.py run wrote"


class ReadingsError(ValueError):
    """A file this script cannot read: printed as one line, exit status 2."""


def read_report(path: Path) -> dict:
    """The ``rho.json`` document at ``path``, with the fields this script reads checked.

    Raises:
        ReadingsError: a missing, unreadable, empty, truncated or non-JSON file, a folder, or a
            document that is no object with ``records`` (objects) and ``verdict.half``; one line
            naming the file and the fix.
    """
    if path.is_dir():
        raise ReadingsError(f"{path} is a folder; {FIX} (e.g. {path / 'rho.json'})")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReadingsError(f"{path} does not exist; {FIX}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReadingsError(
            f"{path} cannot be read ({getattr(exc, 'strerror', None) or exc}); {FIX}"
        ) from None
    if not text.strip():
        raise ReadingsError(f"{path} is empty; {FIX}")
    try:
        document = json.loads(text)
    except ValueError:
        raise ReadingsError(f"{path} is not valid JSON (a truncated or damaged file?); {FIX}") from None
    if not isinstance(document, dict):
        raise ReadingsError(f"{path} holds a JSON {type(document).__name__}, not a report object; {FIX}")
    records, verdict = document.get("records"), document.get("verdict")
    if not isinstance(records, list) or not all(isinstance(r, dict) and "reference" in r for r in records):
        raise ReadingsError(f"{path} has no list of records with their reference image; {FIX}")
    if not isinstance(verdict, dict) or not isinstance(verdict.get("half"), str):
        raise ReadingsError(f"{path} has no verdict naming its CFG half; {FIX}")
    return document


def _log(value: float | None) -> float | None:
    return math.log(value) if value is not None and math.isfinite(value) and value > 0 else None


def image_means(path: Path) -> tuple[dict[str, dict[str, float]], int]:
    """``({reference: {column: mean over its records}}, K)`` of one run's rho.json: every reading,
    its scale-matched control ``{X}_control`` (the draws' mean per record) and ``log_key_scale``.

    Raises:
        ReadingsError: the file cannot be read (:func:`read_report`) or has no scale-matched control
            (control off, or an earlier version's).
    """
    document = read_report(path)
    half = document["verdict"]["half"]
    draws = max((control_draws(r) for r in document["records"]), default=0)
    if not draws:
        raise ReadingsError(
            f"{path}: no scale-matched control was recorded (control off, or a file of an earlier version "
            "with the unmatched *_untrained columns); rerun correlate.py without --no-untrained-control"
        )
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for index, record in enumerate(document["records"]):
        if record.get("half") != half or record.get("key_set", "ip") != "ip":
            continue
        try:
            cells = {name: _number(record.get(name)) for name in READINGS}
            cells.update({name + CONTROL_MEAN_SUFFIX: control_mean(record, name) for name in READINGS})
            cells["log_" + KEY_SCALE] = _log(control_mean(record, KEY_SCALE))
        except (TypeError, ValueError) as exc:
            raise ReadingsError(
                f"{path}: records[{index}] holds a value that is not a number ({exc}); {FIX}"
            ) from None
        for column, value in cells.items():
            if value is not None and math.isfinite(value):
                values[str(record["reference"])][column].append(value)
    if not values:
        raise ReadingsError(f"{path}: no record of the verdict's half {half!r} over the IP keys; {FIX}")
    means = {ref: {c: sum(v) / len(v) for c, v in columns.items()} for ref, columns in values.items()}
    return means, draws


def _number(value: object) -> float | None:
    """``value`` as a float (None stays None); TypeError for anything that is not a number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{value!r}")
    return float(value)


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="rho.json of one or several runs")
    args = parser.parse_args(argv)
    try:
        read = [image_means(path) for path in args.files]
    except ReadingsError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    runs, draws = [means for means, _ in read], min(k for _, k in read)
    if len(runs) == 1:
        units, unit = list(runs[0].values()), "reference image"
    else:
        units = [
            {c: sum(i[c] for i in run.values()) / len(run) for c in next(iter(run.values()))} for run in runs
        ]
        unit = "run"
    label = control_label(draws)
    print(f"unit: {unit}, n = {len(units)}; mean [Student t 95% interval]; control: {label}\n")
    print(f"| reading | trained | {label} | trained - control |")
    print("|---|---|---|---|")
    for name in READINGS:
        if not all(name in u and name + CONTROL_MEAN_SUFFIX in u for u in units):
            continue  # not recorded (e.g. a reading this version does not control)
        trained = [u[name] for u in units]
        control = [u[name + CONTROL_MEAN_SUFFIX] for u in units]
        cells = [
            t_interval(x) for x in (trained, control, [a - b for a, b in zip(trained, control, strict=True)])
        ]
        text = [f"{m:.3f} [{lo:.3f}, {hi:.3f}]" for m, lo, hi in cells[:2]]
        text.append("{:+.3f} [{:+.3f}, {:+.3f}]".format(*cells[2]))
        print(f"| {name} | " + " | ".join(text) + " |")
    logs = [u["log_" + KEY_SCALE] for u in units if "log_" + KEY_SCALE in u]
    scale = [math.exp(x) for x in t_interval(logs)]  # geometric mean over the units, its interval
    print("\nkey scale (key RMS trained / untrained): {:.3f} [{:.3f}, {:.3f}]".format(*scale))
    return 0


if __name__ == "__main__":
    sys.exit(main())
