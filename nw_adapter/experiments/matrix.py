"""The fix x regime matrix: which training-free field closes which plug-in -> learned gap.

For each regime setting (a column: dims d, shells d, digits m) and each method (a row: the
training-free fields of :data:`nw_adapter.experiments.fields.TRAINING_FREE` and the learned ON
model), the cell is the share of the gap it closes,

    share = (MMD^2_plug-in - MMD^2_method) / (MMD^2_plug-in - MMD^2_OFF),

0 = no better than the plug-in, 1 = as good as the learned OFF model, > 1 = better than it.
Whether a method beats the learned OFF model is decided separately (also where there is no gap):
its relative gain over OFF, ``(MMD^2_OFF - MMD^2_method) / MMD^2_OFF``, has an interval above 0. Its
95% interval is a percentile bootstrap that resamples the independent units jointly for all
methods (tasks, or classes on features; and training seeds), so numerator and denominator keep
their pairing. A share is reported only where the gap exists (the learned OFF model's relative
gain over the plug-in has an interval above 0); elsewhere the cell says "no gap".

Each cell also carries a paired test of the method against the plug-in over the independent units
(Wilcoxon signed-rank over tasks for synthetic families; paired t over class means on features),
which the report Holm-adjusts with every other p-value.
"""

from __future__ import annotations

import math

import numpy as np

from nw_adapter.experiments.evaluation import paired_tests
from nw_adapter.experiments.fields import TRAINING_FREE
from nw_adapter.experiments.inference import LEVEL, RESAMPLES, cluster_means, gain_interval
from nw_adapter.experiments.scale import Scale
from nw_adapter.experiments.verdicts import fix_closes_its_gap

__all__ = ["MATRIX_SUPPORT_SIZES", "ROWS", "aggregate_matrix", "share_interval"]

#: Support sizes of the features regime that enter the matrix (its headline settings).
MATRIX_SUPPORT_SIZES = (1, 5, 10)
#: Matrix rows: the training-free fields, then the learned ON model.
ROWS = (*TRAINING_FREE, "learned_on")
REGIME_OF_ROW = {**TRAINING_FREE, "learned_on": None}


def _resampled_means(arrays: list[np.ndarray], clusters, resamples: int, seed: int) -> list[np.ndarray]:
    """Bootstrap means ``[R]`` of several ``[S_k, T]`` arrays with one shared draw of clusters and seeds."""
    num_tasks = arrays[0].shape[1]
    labels = (
        np.arange(num_tasks) if clusters is None else np.unique(np.asarray(clusters), return_inverse=True)[1]
    )
    num_clusters = int(labels.max()) + 1
    onehot = np.eye(num_clusters)[labels]
    rng = np.random.default_rng(seed)
    picks = rng.integers(num_clusters, size=(resamples, num_clusters))
    w_cluster = (picks[..., None] == np.arange(num_clusters)).sum(1).astype(np.float64)  # [R, C]
    tasks_drawn = w_cluster @ onehot.sum(0)  # [R]
    num_seeds = max(a.shape[0] for a in arrays)
    seed_picks = rng.integers(num_seeds, size=(resamples, num_seeds))
    out = []
    for a in arrays:
        if a.shape[0] == 1:
            w_seed = np.ones((resamples, 1))
        else:
            w_seed = (seed_picks[..., None] == np.arange(a.shape[0])).sum(1).astype(np.float64)
        total = np.einsum("rs,sc,rc->r", w_seed, a @ onehot, w_cluster)
        out.append(total / (w_seed.sum(1) * tasks_drawn))
    return out


def share_interval(
    plugin, method, learned, *, clusters=None, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the gap share ``(P - X) / (P - L)``.

    Args:
        plugin: ``[tasks]`` MMD^2 of the plug-in (deterministic).
        method: ``[tasks]`` or ``[seeds, tasks]`` MMD^2 of the method.
        learned: ``[seeds, tasks]`` MMD^2 of the learned OFF model.
        clusters: optional label per task (classes on features).

    Returns:
        ``(low, high)``; resamples whose gap is <= 0 are left out (NaN when all are).
    """
    arrays = [np.atleast_2d(np.asarray(a, dtype=np.float64)) for a in (plugin, method, learned)]
    p, x, lrn = _resampled_means(arrays, clusters, resamples, seed)
    gap = p - lrn
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(gap > 0, (p - x) / gap, np.nan)
    share = share[np.isfinite(share)]
    if share.size < 0.5 * resamples:
        return math.nan, math.nan
    lo, hi = np.quantile(share, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _columns(results: dict, scale: Scale) -> list[dict]:
    """Per-task MMD^2 of every method at every matrix setting present in the results."""
    cols = []
    for regime, dims in (("dims", scale.dims), ("shells", scale.shell_dims)):
        for d in dims:
            plug, fields = results.get(f"{regime}-d{d}-plugin"), results.get(f"{regime}-d{d}-fields")
            off = [
                r
                for uid, r in sorted(results.items())
                if uid.startswith(f"{regime}-d{d}-s") and uid.endswith("-off")
            ]
            on = [
                r
                for uid, r in sorted(results.items())
                if uid.startswith(f"{regime}-d{d}-s") and uid.endswith("-on")
            ]
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
    plug, fields = results.get("digits-plugin"), results.get("digits-fields")
    off = [r for uid, r in sorted(results.items()) if uid.startswith("digits-s") and uid.endswith("-off")]
    on = [r for uid, r in sorted(results.items()) if uid.startswith("digits-s") and uid.endswith("-on")]
    if plug is not None and fields is not None and off:
        for m in (m for m in MATRIX_SUPPORT_SIZES if m in scale.support_sizes):
            key = str(m)
            f = fields["per_m"][key]
            methods = {name: np.asarray(f["fields"][name]["mmd2_median"])[None] for name in TRAINING_FREE}
            if on and len(on) == len(off):
                methods["learned_on"] = np.asarray([r["per_m"][key]["mmd2_median"] for r in on])
            cols.append(
                {
                    "regime": "digits",
                    "setting": f"m={m}",
                    "plugin": np.asarray(plug["per_m"][key]["mmd2_median"], dtype=np.float64),
                    "off": np.asarray([r["per_m"][key]["mmd2_median"] for r in off], dtype=np.float64),
                    "methods": methods,
                    "clusters": plug.get("task_classes"),
                    "amortised_tau": f.get("amortised_tau"),
                    "loo_tau_mean": f.get("loo_tau_mean"),
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
    """The learned baseline per (regime setting, variant): steps and the convergence criterion per seed."""
    rows = []
    settings = [("dims", f"dims-d{d}", f"d={d}") for d in scale.dims]
    settings += [("shells", f"shells-d{d}", f"d={d}") for d in scale.shell_dims]
    settings += [("digits", "digits", f"m=1..{max(scale.support_sizes)}")]
    for regime, prefix, label in settings:
        for variant in ("off", "on"):
            units = [
                r
                for uid, r in sorted(results.items())
                if uid.startswith(f"{prefix}-s") and uid.endswith(f"-{variant}")
            ]
            if not units:
                continue
            plateaus = [r["train"].get("plateau", {}) for r in units]
            rows.append(
                {
                    "regime": regime,
                    "setting": label,
                    "variant": variant.upper(),
                    "steps": units[0]["train"]["steps"],
                    "seeds": len(units),
                    "converged": sum(bool(p.get("converged")) for p in plateaus),
                    "drop": [p.get("drop", math.nan) for p in plateaus],
                    "drop_se": [p.get("drop_se", math.nan) for p in plateaus],
                    "loss_last": float(np.mean([r["train"]["loss_last"] for r in units])),
                }
            )
    return rows
