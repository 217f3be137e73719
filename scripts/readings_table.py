"""Trained vs untrained-adapter readings of correlate.py runs, as a markdown table with t intervals.

Usage:
    python scripts/readings_table.py out_digits/rho.json           # unit: reference image
    python scripts/readings_table.py runs/*/rho.json               # unit: run (mean of its images)

Reads each run's records (the verdict's CFG half, the IP key set, every recorded step), averages
every reading per reference image, and prints the mean and Student t 95% interval over the unit of
the trained value, the untrained-adapter control's value and their difference.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from nw_adapter.core.intervals import t_interval

READINGS = ("rho", "r2_key", "r2_nw", "kl_nw_fit", "kl_key_prior", "nw_gain", "kl", "key_norm_cv")


def image_means(path: Path) -> dict[str, dict[str, float]]:
    """``{reference: {column: mean over its records}}`` of one run's rho.json."""
    document = json.loads(path.read_text())
    half = document["verdict"]["half"]
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record in document["records"]:
        if record.get("half") != half or record.get("key_set", "ip") != "ip":
            continue
        for name in READINGS:
            for column in (name, name + "_untrained"):
                value = record.get(column)
                if value is not None and math.isfinite(float(value)):
                    values[record["reference"]][column].append(float(value))
    return {ref: {c: sum(v) / len(v) for c, v in columns.items()} for ref, columns in values.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="rho.json of one or several runs")
    args = parser.parse_args(argv)
    runs = [image_means(path) for path in args.files]
    if len(runs) == 1:
        units, unit = list(runs[0].values()), "reference image"
    else:
        units = [
            {c: sum(i[c] for i in run.values()) / len(run) for c in next(iter(run.values()))} for run in runs
        ]
        unit = "run"
    print(f"unit: {unit}, n = {len(units)}; mean [Student t 95% interval]\n")
    print("| reading | trained | untrained | trained - untrained |")
    print("|---|---|---|---|")
    for name in READINGS:
        trained = [u[name] for u in units]
        control = [u[name + "_untrained"] for u in units]
        cells = [
            t_interval(x) for x in (trained, control, [a - b for a, b in zip(trained, control, strict=True)])
        ]
        text = [f"{m:.3f} [{lo:.3f}, {hi:.3f}]" for m, lo, hi in cells[:2]]
        text.append("{:+.3f} [{:+.3f}, {:+.3f}]".format(*cells[2]))
        print(f"| {name} | " + " | ".join(text) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
