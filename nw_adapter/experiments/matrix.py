"""The fix x regime matrix: which training-free field closes which plug-in -> learned gap.

For each regime setting (a column: dims d, shells d, digits m) and each method (a row: the
training-free fields of :data:`nw_adapter.experiments.fields.TRAINING_FREE` and the learned ON
model), the cell is the share of the gap it closes,

    share = (MMD^2_plug-in - MMD^2_method) / (MMD^2_plug-in - MMD^2_OFF),

0 = no better than the plug-in, 1 = as good as the learned OFF model, > 1 = better than it.
Whether a method beats the learned OFF model is decided separately (also where there is no gap):
its relative gain over OFF, ``(MMD^2_OFF - MMD^2_method) / MMD^2_OFF``, has an interval above 0. Its
95% interval is Fieller's over the independent units (tasks, or classes on features; values
averaged over training seeds first), built from the paired per-unit differences ``P - X`` and
``P - L``, so it carries the gap's own uncertainty and is unbounded where the gap is not clearly
non-zero (no resample is ever dropped: there are none). A share is reported only where the gap
exists (the learned OFF model's relative gain over the plug-in has an interval above 0); elsewhere
the cell says "no gap".

Each cell also carries a paired test of the method against the plug-in over the independent units
(Wilcoxon signed-rank over tasks for synthetic families; paired t over class means on features),
which the report Holm-adjusts with every other p-value.
"""

from __future__ import annotations

import math

import numpy as np

from nw_adapter.experiments.collect import digits_column, learned_units
from nw_adapter.experiments.evaluation import paired_tests
from nw_adapter.experiments.fields import TRAINING_FREE
from nw_adapter.experiments.inference import cluster_means, gain_interval, share_interval
from nw_adapter.experiments.scale import Scale
from nw_adapter.experiments.verdicts import fix_closes_its_gap

__all__ = ["MATRIX_SUPPORT_SIZES", "ROWS", "aggregate_matrix", "share_interval", "baseline_rows"]

#: Support sizes of the features regime that enter the matrix (its headline settings).
MATRIX_SUPPORT_SIZES = (1, 5, 10)
#: Matrix rows: the training-free fields, then the learned ON model.
ROWS = (*TRAINING_FREE, "learned_on")
REGIME_OF_ROW = {**TRAINING_FREE, "learned_on": None}


def _columns(results: dict, scale: Scale) -> list[dict]:
    """Per-task MMD^2 of every method at every matrix setting present in the results."""
    cols = []
    for regime, dims in (("dims", scale.dims), ("shells", scale.shell_dims)):
        for d in dims:
            plug, fields = results.get(f"{regime}-d{d}-plugin"), results.get(f"{regime}-d{d}-fields")
            off = learned_units(results, f"{regime}-d{d}", "off")
            on = learned_units(results, f"{regime}-d{d}", "on")
            if plug is None or fields is None or not off:
                continue
            methods = {
                name: np.asarray(fields["fields"][name]["mmd2_median"])[None] for name in TRAINING_FREE
            }
            if on and len(on) == len(off):
                methods["learned_on"] = np.asarray([r["mmd2_median"] for r in on])
            cols.append(
                {
                    "regime": regime,
                    "setting": f"d={d}",
                    "plugin": np.asarray(plug["mmd2_median"], dtype=np.float64),
                    "off": np.asarray([r["mmd2_median"] for r in off], dtype=np.float64),
                    "methods": methods,
                    "clusters": None,
                    "amortised_tau": fields.get("amortised_tau"),
                    "loo_tau_mean": fields.get("loo_tau_mean"),
                }
            )
    for m in (m for m in MATRIX_SUPPORT_SIZES if m in scale.support_sizes):
        col = digits_column(results, m)
        if col is None or col["off"] is None or col["fields"] is None:
            continue
        methods = {name: col["fields"][name][None] for name in TRAINING_FREE}
        if col["on"] is not None and col["on"]["mmd2_median"].shape == col["off"]["mmd2_median"].shape:
            methods["learned_on"] = col["on"]["mmd2_median"]
        cols.append(
            {
                "regime": "digits",
                "setting": f"m={m}",
                "plugin": col["plugin"]["mmd2_median"],
                "off": col["off"]["mmd2_median"],
                "methods": methods,
                "clusters": col["classes"],
                "amortised_tau": float(np.mean(col["amortised_tau"])),  # mean over the folds' fits
                "loo_tau_mean": float(np.mean(col["loo_tau_mean"])),
            }
        )
    return cols


def _test_vs_plugin(col: dict, values: np.ndarray) -> dict:
    """Paired test of a method against the plug-in over the column's independent units."""
    per_task = values.mean(0)
    if col["clusters"] is None:
        res = paired_tests(col["plugin"], per_task)
        return {"test": "Wilcoxon over tasks", "n": res["n"], "p": res["wilcoxon_p"]}
    res = paired_tests(
        cluster_means(col["plugin"], col["clusters"]), cluster_means(per_task, col["clusters"])
    )
    return {"test": "paired t over classes", "n": res["n"], "p": res["t_p"]}


def aggregate_matrix(results: dict, scale: Scale) -> dict:
    """The matrix: columns (settings), one cell per (row, column), verdicts per fix and the tests.

    Returns:
        ``{"columns": [{regime, setting, mmd2_plugin, mmd2_off, gap, gap_ci, amortised_tau, ...}],
        "cells": {row: [cell per column]}, "verdicts": [...], "tests": [{where, test, n, p}]}``.
    """
    cols = _columns(results, scale)
    columns, cells, tests = [], {row: [] for row in ROWS}, []
    for col in cols:
        gap = (float(col["plugin"].mean()) - float(col["off"].mean())) / float(col["plugin"].mean())
        gap_ci = gain_interval(col["plugin"], col["off"], clusters=col["clusters"])
        has_gap = bool(gap_ci[0] > 0)
        columns.append(
            {
                "regime": col["regime"],
                "setting": col["setting"],
                "mmd2_plugin": float(col["plugin"].mean()),
                "mmd2_off": float(col["off"].mean()),
                "mmd2_on": float(col["methods"]["learned_on"].mean())
                if "learned_on" in col["methods"]
                else None,
                "gap": gap,
                "gap_ci": gap_ci,
                "has_gap": has_gap,
                "amortised_tau": col["amortised_tau"],
                "loo_tau_mean": col["loo_tau_mean"],
            }
        )
        p_mean, off_mean = float(col["plugin"].mean()), float(col["off"].mean())
        for row in ROWS:
            values = col["methods"].get(row)
            if values is None:
                cells[row].append(None)
                continue
            mean = float(values.mean())
            share = (p_mean - mean) / (p_mean - off_mean) if has_gap else math.nan
            ci = (
                share_interval(col["plugin"], values, col["off"], clusters=col["clusters"])
                if has_gap
                else (
                    math.nan,
                    math.nan,
                )
            )
            test = _test_vs_plugin(col, values)
            vs_off_ci = gain_interval(col["off"], values, clusters=col["clusters"])
            cell = {
                "mmd2": mean,
                "share": share,
                "share_ci": ci,
                # better than the learned OFF model: its relative MMD^2 gain over OFF has an interval above 0
                "gain_vs_off": (off_mean - mean) / off_mean,
                "gain_vs_off_ci": vs_off_ci,
                "beats_learned": bool(vs_off_ci[0] > 0),
                "gain_vs_plugin": (p_mean - mean) / p_mean,
                "test_vs_plugin": test,
            }
            cells[row].append(cell)
            if math.isfinite(test["p"]):
                tests.append(
                    {
                        "where": f"matrix {row} {col['regime']} {col['setting']}",
                        "test": test["test"],
                        "n": test["n"],
                        "p": test["p"],
                    }
                )
    verdicts = [fix_closes_its_gap(row, regime, columns, cells[row]) for row, regime in TRAINING_FREE.items()]
    return {"columns": columns, "cells": cells, "verdicts": verdicts, "tests": tests}


def baseline_rows(results: dict, scale: Scale) -> list[dict]:
    """The learned baseline per (regime setting, variant): steps, and per model (seed; fold on
    features) the convergence criterion :func:`~nw_adapter.experiments.training.loss_plateau`."""
    rows = []
    settings = [("dims", [f"dims-d{d}"], f"d={d}") for d in scale.dims]
    settings += [("shells", [f"shells-d{d}"], f"d={d}") for d in scale.shell_dims]
    settings += [
        ("digits", [f"digits-f{k}" for k in range(scale.digits_folds)], f"m=1..{max(scale.support_sizes)}")
    ]
    for regime, prefixes, label in settings:
        for variant in ("off", "on"):
            units = [r for prefix in prefixes for r in learned_units(results, prefix, variant)]
            if not units:
                continue
            plateaus = [r["train"].get("plateau", {}) for r in units]
            rows.append(
                {
                    "regime": regime,
                    "setting": label,
                    "variant": variant.upper(),
                    "steps": units[0]["train"]["steps"],
                    "models": len(units),
                    "converged": sum(bool(p.get("converged")) for p in plateaus),
                    "drop": [p.get("drop", math.nan) for p in plateaus],
                    "drop_upper": [p.get("drop_upper", math.nan) for p in plateaus],
                    "loss_last": float(np.mean([r["train"]["loss_last"] for r in units])),
                }
            )
    return rows
