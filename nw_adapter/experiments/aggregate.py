"""Summaries of a run folder's unit results: tables, intervals, tests and verdicts per regime.

Tests are reported at every level of independent units that exists (see
:mod:`nw_adapter.experiments.inference`): synthetic regimes give a paired t-test over training
seeds and a Wilcoxon signed-rank test over tasks (fresh draws from the family); real features
give paired t-tests over test classes and over training seeds only, because tasks of one class
share most of their points (a test over them would be pseudo-replicated). Every p-value reported
is collected in ``p_values`` with its Holm-adjusted value (family-wise error over all of them).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from nw_adapter.core.intervals import t_interval
from nw_adapter.experiments.evaluation import benefit, paired_tests
from nw_adapter.experiments.inference import cluster_means, gain_interval, holm, ratio_interval
from nw_adapter.experiments.matrix import aggregate_matrix, baseline_rows
from nw_adapter.experiments.scale import PAPER, REGIMES, Scale
from nw_adapter.experiments.verdicts import (
    benefit_vanishes,
    learned_wins_small_m,
    neff_falls,
    plugin_catches_up,
    plugin_worse,
)

__all__ = ["aggregate", "heads_summary"]


def _load(out_dir: Path) -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted((out_dir / "results").glob("*.json"))}


def _mean(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(np.mean(x)) if x.size else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def _units(results: dict, prefix: str, suffix: str) -> list[dict]:
    return [r for uid, r in sorted(results.items()) if uid.startswith(prefix) and uid.endswith(suffix)]


def _seed_stack(results: dict, prefix: str, suffix: str, key: str) -> np.ndarray:
    """Per-task arrays of all seeds of one configuration, ``[seeds, tasks]``."""
    return np.asarray([r[key] for r in _units(results, prefix, suffix)], dtype=np.float64)


def _nanmean(values: list[float]) -> float:
    arr = np.asarray(values, dtype=np.float64)
    return float(np.nanmean(arr)) if np.isfinite(arr).any() else math.nan


def _seed_test(plugin_tasks: np.ndarray, learned: np.ndarray) -> dict:
    """Paired t-test over training seeds of the deterministic plug-in's mean against each seed's mean."""
    seeds = learned.mean(1)
    return paired_tests(np.full(seeds.shape, float(np.mean(plugin_tasks))), seeds)


HEAD_FIELDS = ("rho_head", "rho_data", "rho_null", "rho_head_null", "top1_data", "key_norm_cv", "neff_attn")


def heads_summary(rows: list[dict], untrained: list[dict] | None = None) -> list[dict]:
    """Mean over layers, heads (and seeds) per t; ``untrained_*`` = the same for the untrained baseline."""
    by_t: dict[float, list[dict]] = {}
    for r in rows:
        by_t.setdefault(r["t"], []).append(r)
    base_by_t: dict[float, list[dict]] = {}
    for r in untrained or []:
        base_by_t.setdefault(r["t"], []).append(r)
    out = []
    for t in sorted(by_t):
        rs = by_t[t]
        row = {"t": t, "h_data": rs[0]["h_data"]}
        row.update({k: _nanmean([r.get(k, math.nan) for r in rs]) for k in HEAD_FIELDS})
        row["frac_rho_data_gt_0_9"] = float(np.mean([r["rho_data"] > 0.9 for r in rs]))
        row["neff_data_nw"] = _nanmean([r["neff_data_nw"] for r in rs])
        base = base_by_t.get(t, [])
        for k in ("rho_head", "rho_data", "key_norm_cv"):
            row[f"untrained_{k}"] = _nanmean([r.get(k, math.nan) for r in base]) if base else math.nan
        out.append(row)
    return out


def _heads_of(units: list[dict]) -> list[dict]:
    return heads_summary(
        [h for r in units for h in r.get("heads", [])],
        [h for r in units for h in r.get("heads_untrained", [])],
    )


def _aggregate_dims(results: dict, scale: Scale) -> dict:
    rows = []
    for d in scale.dims:
        plug = results.get(f"dims-d{d}-plugin")
        off = _seed_stack(results, f"dims-d{d}-s", "-off", "mmd2_median")
        on = _seed_stack(results, f"dims-d{d}-s", "-on", "mmd2_median")
        off_f = _seed_stack(results, f"dims-d{d}-s", "-off", "mmd2_fixed")
        on_f = _seed_stack(results, f"dims-d{d}-s", "-on", "mmd2_fixed")
        if plug is None or off.size == 0 or on.size == 0 or off.shape != on.shape:
            continue
        seeds_off, seeds_on = off.mean(1), on.mean(1)
        off_units = _units(results, f"dims-d{d}-s", "-off")
        mmd_plugin, mmd_off = _mean(plug["mmd2_median"]), float(seeds_off.mean())
        rows.append(
            {
                "d": d,
                "neff": _mean(plug["neff"]),
                "neff_ci": list(t_interval(plug["neff"])[1:]),  # over tasks: the dims figure's interval
                "mmd2_plugin": mmd_plugin,
                "mmd2_off": mmd_off,
                "mmd2_on": float(seeds_on.mean()),
                # the OFF model is worse than the training-free plug-in: not converged, so its benefit
                # is not like for like with the paper's (measured against a converged OFF model)
                "off_unconverged": bool(mmd_off > mmd_plugin),
                "benefit": benefit(mmd_off, float(seeds_on.mean())),
                "benefit_ci": gain_interval(off, on),
                "benefit_per_seed": [benefit(a, b) for a, b in zip(seeds_off, seeds_on, strict=True)],
                "benefit_fixed": benefit(float(off_f.mean()), float(on_f.mean())),
                "mmd2_fixed_plugin": _mean(plug["mmd2_fixed"]),
                "seeds": int(off.shape[0]),
                "test_seeds": paired_tests(seeds_off, seeds_on),
                "test_tasks": paired_tests(off.mean(0), on.mean(0)),
                "paper_benefit": PAPER["dims"]["benefit"].get(d),
                "paper_neff": PAPER["dims"]["neff"].get(d),
                "loss_last_off": _mean([r["train"]["loss_last"] for r in off_units]),
                "heads": _heads_of(off_units),
            }
        )
    verdicts = []
    if len(rows) >= 2:
        v = neff_falls(rows)
        if rows[-1]["neff"] > 1.5:
            v["evidence"] += (
                f" At d={rows[-1]['d']} it is {rows[-1]['neff']:.1f}, above the paper's ~1: the level "
                "depends on the component spread (ours: geometric-mean std 0.3-0.8, aspect 3-10), which the "
                "paper does not state."
            )
        verdicts.append(v)
        v = benefit_vanishes(rows)
        bad = [r["d"] for r in rows if r["off_unconverged"]]
        if bad:
            v["evidence"] += (
                f" The OFF model is not converged at d = {', '.join(map(str, bad))} (its MMD^2 is worse "
                f"than the training-free plug-in's after {scale.steps} steps; paper 100k), so the benefit "
                "there is measured against a weaker baseline than the paper's and is not like for like."
            )
        verdicts.append(v)
    return {"rows": rows, "verdicts": verdicts}


def _aggregate_shells(results: dict, scale: Scale) -> dict:
    rows = []
    for d in scale.shell_dims:
        plug = results.get(f"shells-d{d}-plugin")
        learned = _seed_stack(results, f"shells-d{d}-s", "-off", "mmd2_median")
        learned_f = _seed_stack(results, f"shells-d{d}-s", "-off", "mmd2_fixed")
        learned_on = _seed_stack(results, f"shells-d{d}-s", "-on", "mmd2_median")
        if plug is None or learned.size == 0:
            continue
        pm_tasks = np.asarray(plug["mmd2_median"], dtype=np.float64)
        lm, pm = float(learned.mean()), float(pm_tasks.mean())
        rows.append(
            {
                "d": d,
                "mmd2_learned": lm,
                "mmd2_plugin": pm,
                "mmd2_on": float(learned_on.mean()) if learned_on.size else math.nan,
                "ratio": _ratio(pm, lm),
                "ratio_ci": ratio_interval(pm_tasks, learned),
                "ratio_fixed": _ratio(_mean(plug["mmd2_fixed"]), float(learned_f.mean())),
                "neff": _mean(plug["neff"]),
                "seeds": int(learned.shape[0]),
                "test_tasks": paired_tests(pm_tasks, learned.mean(0)),
                "test_seeds": _seed_test(pm_tasks, learned),
                "paper_ratio": PAPER["shells"]["ratio"].get(d),
                "heads": _heads_of(_units(results, f"shells-d{d}-s", "-off")),
            }
        )
    verdicts = []
    if rows:
        verdicts.append(plugin_worse(rows))
        ne = [r["neff"] for r in rows]
        lo, hi = PAPER["shells"]["neff"]
        healthy = all(n >= 3 for n in ne)
        verdicts.append(
            {
                "trend": f"plug-in n_eff stays healthy (paper {lo}-{hi}; we call >= 3 healthy)",
                "appeared": bool(healthy),
                "evidence": ", ".join(f"d={r['d']}: {r['neff']:.2f}" for r in rows)
                + (
                    "."
                    if healthy
                    else ". Our shells (radii stratified in [2, 8], centred) give a sharper posterior at "
                    "t = 0.56 than the paper's unreleased generator; the ratio is still a geometry effect "
                    "(the plug-in's samples are copies of the support, the learned model fills the shells)."
                ),
            }
        )
    return {"rows": rows, "verdicts": verdicts}


def _aggregate_digits(results: dict, scale: Scale) -> dict:
    plug = results.get("digits-plugin")
    learned = [r for uid, r in sorted(results.items()) if uid.startswith("digits-s") and uid.endswith("-off")]
    rows = []
    classes = None if plug is None else plug.get("task_classes")
    if plug is not None and learned:
        for m in scale.support_sizes:
            key = str(m)
            lm = np.asarray([r["per_m"][key]["mmd2_median"] for r in learned], dtype=np.float64)
            pm = np.asarray(plug["per_m"][key]["mmd2_median"], dtype=np.float64)
            lmf = np.asarray([r["per_m"][key]["mmd2_fixed"] for r in learned])
            pmf = np.asarray(plug["per_m"][key]["mmd2_fixed"])
            row = {
                "m": m,
                "mmd2_learned": float(lm.mean()),
                "mmd2_plugin": float(pm.mean()),
                "advantage": benefit(float(pm.mean()), float(lm.mean())),
                "advantage_ci": gain_interval(pm, lm, clusters=classes),
                "advantage_fixed": benefit(float(pmf.mean()), float(lmf.mean())),
                "neff": _mean(plug["per_m"][key]["neff"]),
                "seeds": len(learned),
                "test_seeds": _seed_test(pm, lm),
                "paper_advantage": PAPER["digits"]["advantage"].get(m),
            }
            if classes is not None:
                pc, lc = cluster_means(pm, classes), cluster_means(lm.mean(0), classes)
                row["advantage_per_class"] = [benefit(a, b) for a, b in zip(pc, lc, strict=True)]
                row["mmd2_plugin_per_class"] = pc.tolist()  # the digits verdicts' units
                row["mmd2_learned_per_class"] = lc.tolist()
                row["test_classes"] = paired_tests(pc, lc)
            rows.append(row)
    verdicts = []
    if len(rows) >= 2:
        verdicts.append(learned_wins_small_m(rows))
        verdicts.append(plugin_catches_up(rows, PAPER["digits"]["catch_up_m"]))
    meta = {}
    if plug is not None:
        meta = {k: plug.get(k) for k in ("explained_variance", "train_classes", "test_classes")}
        meta["tasks_per_class"] = scale.digits_tasks_per_class
    return {"rows": rows, "verdicts": verdicts, "data": meta}


def _p_values(summary: dict) -> list[dict]:
    """Every p-value the report prints, labelled, with its Holm-adjusted value over all of them."""
    found = []
    tests = {
        "dims": (
            ("test_seeds", "t_p", "paired t over seeds"),
            ("test_tasks", "wilcoxon_p", "Wilcoxon over tasks"),
        ),
        "shells": (
            ("test_seeds", "t_p", "paired t over seeds"),
            ("test_tasks", "wilcoxon_p", "Wilcoxon over tasks"),
        ),
        "digits": (
            ("test_classes", "t_p", "paired t over classes"),
            ("test_seeds", "t_p", "paired t over seeds"),
        ),
    }
    for regime, specs in tests.items():
        for row in summary.get(regime, {}).get("rows", []):
            where = f"{regime} {'m' if regime == 'digits' else 'd'}={row.get('m', row.get('d'))}"
            for field, key, name in specs:
                p = row.get(field, {}).get(key, math.nan)
                if math.isfinite(p):
                    found.append({"where": where, "test": name, "n": row[field]["n"], "p": p})
    for test in summary.get("matrix", {}).get("tests", []):
        found.append(dict(test))
    adjusted = holm([f["p"] for f in found])
    for f, a in zip(found, adjusted, strict=True):
        f["p_holm"] = float(a)
    return found


def aggregate(out_dir: str | Path, scale: Scale, regimes: tuple[str, ...] = REGIMES) -> dict:
    """Summaries of every regime present in ``out_dir/results`` (see module docstring)."""
    out_dir = Path(out_dir)
    results = _load(out_dir)
    summary: dict = {"scale": scale.to_dict(), "units": len(results)}
    if "dims" in regimes:
        summary["dims"] = _aggregate_dims(results, scale)
    if "shells" in regimes:
        summary["shells"] = _aggregate_shells(results, scale)
    if "digits" in regimes:
        summary["digits"] = _aggregate_digits(results, scale)
    summary["matrix"] = aggregate_matrix(results, scale)
    summary["baseline"] = baseline_rows(results, scale)
    summary["p_values"] = _p_values(summary)
    summary["cpu_s_train"] = sum(r.get("train", {}).get("cpu_s", 0.0) for r in results.values())
    summary["cpu_s_eval"] = sum(r.get("eval_cpu_s", 0.0) for r in results.values())
    summary["units_loaded_trained"] = sum(
        1 for r in results.values() if "train" in r and r["train"]["resumed_from"] >= r["train"]["steps"]
    )
    timing = out_dir / "timing.json"
    summary["timing"] = json.loads(timing.read_text()) if timing.exists() else {"invocations": []}
    return summary
