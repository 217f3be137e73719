"""Per-task arrays of a run folder's unit results, gathered across seeds and class folds.

Synthetic settings hold one plug-in unit and one unit per (seed, variant). On features the
results are split by cross-validated class folds (``digits-f<k>-...``); every fold scores its own
test classes, so the folds' tasks are concatenated into one task axis whose ``classes`` label
gives the independent units (every class once).
"""

from __future__ import annotations

import numpy as np

from nw_adapter.experiments.fields import TRAINING_FREE

__all__ = ["learned_units", "digits_folds", "digits_column"]


def learned_units(results: dict, prefix: str, variant: str) -> list[dict]:
    """The learned units ``<prefix>-s<seed>-<variant>`` in seed order."""
    start, end = f"{prefix}-s", f"-{variant}"
    return [r for uid, r in sorted(results.items()) if uid.startswith(start) and uid.endswith(end)]


def digits_folds(results: dict) -> list[int]:
    """Folds whose plug-in unit and at least one OFF unit have finished, in order."""
    plugins = [uid for uid in results if uid.startswith("digits-f") and uid.endswith("-plugin")]
    folds = sorted(int(uid.split("-")[1][1:]) for uid in plugins)
    return [k for k in folds if learned_units(results, f"digits-f{k}", "off")]


def digits_column(results: dict, m: int) -> dict | None:
    """Every finished fold's tasks at support size ``m``, concatenated.

    Returns:
        None when no fold has finished; else ``{"plugin": {stat: [T]}, "off": {stat: [S, T]},
        "on": {stat: [S, T]} or None, "fields": {name: [T]} or None, "neff": [T], "classes": [T],
        "amortised_tau": [folds], "loo_tau_mean": [folds], "folds": [...], "test_classes": [...]}``
        with stat in ``mmd2_median``, ``mmd2_fixed``. Folds must have the same number of seeds.
    """
    folds = digits_folds(results)
    if not folds:
        return None
    key = str(m)
    plugs = [results[f"digits-f{k}-plugin"] for k in folds]
    stats = ("mmd2_median", "mmd2_fixed")
    out: dict = {
        "plugin": {s: np.concatenate([p["per_m"][key][s] for p in plugs]).astype(np.float64) for s in stats},
        "neff": np.concatenate([p["per_m"][key]["neff"] for p in plugs]).astype(np.float64),
        "classes": np.concatenate([p["task_classes"] for p in plugs]),
        "folds": folds,
        "test_classes": sorted(c for p in plugs for c in p["test_classes"]),
        "train_classes": [p["train_classes"] for p in plugs],
        "explained_variance": [p.get("explained_variance") for p in plugs],
    }
    for variant in ("off", "on"):
        per_fold = [learned_units(results, f"digits-f{k}", variant) for k in folds]
        if not all(per_fold) or len({len(u) for u in per_fold}) != 1:
            out[variant] = None
            continue
        out[variant] = {
            s: np.concatenate([np.asarray([r["per_m"][key][s] for r in units]) for units in per_fold], axis=1)
            for s in stats
        }
    fields = [results.get(f"digits-f{k}-fields") for k in folds]
    if all(f is not None for f in fields):
        out["fields"] = {
            name: np.concatenate([f["per_m"][key]["fields"][name]["mmd2_median"] for f in fields]).astype(
                np.float64
            )
            for name in TRAINING_FREE
        }
        out["amortised_tau"] = [f["per_m"][key]["amortised_tau"] for f in fields]
        out["loo_tau_mean"] = [f["per_m"][key]["loo_tau_mean"] for f in fields]
    else:
        out["fields"], out["amortised_tau"], out["loo_tau_mean"] = None, [], []
    return out
