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
from nw_adapter.experiments.baseline import FAIR_MARGIN, fair_baseline
from nw_adapter.experiments.collect import digits_column
from nw_adapter.experiments.evaluation import benefit, paired_tests
from nw_adapter.experiments.inference import cluster_means, gain_interval, holm, mean_interval, ratio_interval
from nw_adapter.experiments.matrix import aggregate_matrix, baseline_rows
from nw_adapter.experiments.scale import PAPER, REGIMES, Scale
from nw_adapter.experiments.verdicts import (
    benefit_vanishes,
    learned_wins_small_m,
    neff_falls,
    plugin_catches_up,
    plugin_worse,
)

__all__ = ["aggregate", "heads_summary", "run_coverage", "paper_table", "COVERAGE_REPS"]

#: Samples of the coverage check at the run's own unit counts.
COVERAGE_REPS = 1000


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


HEAD_INTERVAL_FIELDS = ("rho_head", "rho_data", "untrained_rho_head", "untrained_rho_data")
"""Fields of :func:`heads_summary` given a 95% interval over training seeds by :func:`_heads_of`."""


def _heads_of(units: list[dict]) -> list[dict]:
    """Per t: :func:`heads_summary` of all units, plus a Student t interval over the units.

    The independent unit is the training seed (one unit = one trained model and its untrained
    twin); the layers and heads of one model are not independent, and the analysed tasks are
    averaged inside each unit, so each unit gives one value per t: the mean over its layers and
    heads, ``<field>_per_seed`` ``(n,)``. ``<field>_ci`` is ``mean +- t_{n-1} s / sqrt(n)`` over
    those n values, cut to rho's range [-1, 1] (``[nan, nan]`` when n < 2: not identified with one
    seed); ``seeds`` = n.
    """
    rows = heads_summary(
        [h for r in units for h in r.get("heads", [])],
        [h for r in units for h in r.get("heads_untrained", [])],
    )
    per_unit = [
        {row["t"]: row for row in heads_summary(r["heads"], r.get("heads_untrained"))}
        for r in units
        if r.get("heads")
    ]
    for row in rows:
        for key in HEAD_INTERVAL_FIELDS:
            values = [u[row["t"]].get(key, math.nan) for u in per_unit if row["t"] in u]
            values = [v for v in values if math.isfinite(v)]
            row[f"{key}_per_seed"] = values
            low, high = t_interval(values)[1:] if values else (math.nan, math.nan)
            row[f"{key}_ci"] = [max(low, -1.0), min(high, 1.0)]  # within rho's range: coverage kept
        row["seeds"] = len(per_unit)
    return rows


def _fair_note(bad: list, regime_word: str, steps: int) -> str:
    return (
        f" The learned OFF model is not a fair baseline at {regime_word} {', '.join(map(str, bad))} (not "
        f"at least as good as the training-free plug-in on its own training distribution, within "
        f"{100 * FAIR_MARGIN:.0f}%, after {steps} steps; paper 100k): no conclusion is drawn from it there."
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
        plugin_tasks = np.asarray(plug["mmd2_median"], dtype=np.float64)
        mmd_plugin, mmd_off = _mean(plugin_tasks), float(seeds_off.mean())
        fair = fair_baseline(plugin_tasks, off)
        rows.append(
            {
                "d": d,
                "neff": _mean(plug["neff"]),
                "neff_ci": list(t_interval(plug["neff"])[1:]),  # over tasks: the dims figure's interval
                "mmd2_plugin": mmd_plugin,
                "mmd2_off": mmd_off,
                "mmd2_on": float(seeds_on.mean()),
                "fair": fair,
                "benefit": benefit(mmd_off, float(seeds_on.mean())),
                "benefit_ci": gain_interval(off, on),
                "diff_off_on": float(mmd_off - seeds_on.mean()),
                "diff_off_on_ci": mean_interval(off.mean(0) - on.mean(0)),
                "benefit_per_seed": [benefit(a, b) for a, b in zip(seeds_off, seeds_on, strict=True)],
                "benefit_fixed": benefit(float(off_f.mean()), float(on_f.mean())),
                "mmd2_fixed_plugin": _mean(plug["mmd2_fixed"]),
                "seeds": int(off.shape[0]),
                "tasks": int(off.shape[1]),
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
        bad = [r["d"] for r in rows if not r["fair"]["fair"]]
        if bad:
            v["evidence"] += _fair_note(bad, "d =", scale.steps)
            v["conclusive"] = False
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
                "fair": fair_baseline(pm_tasks, learned),
                "ratio": _ratio(pm, lm),
                "ratio_ci": ratio_interval(pm_tasks, learned),
                "diff": pm - lm,
                "diff_ci": mean_interval(pm_tasks - learned.mean(0)),
                "ratio_fixed": _ratio(_mean(plug["mmd2_fixed"]), float(learned_f.mean())),
                "neff": _mean(plug["neff"]),
                "seeds": int(learned.shape[0]),
                "tasks": int(learned.shape[1]),
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
    rows = []
    meta: dict = {}
    for m in scale.support_sizes:
        col = digits_column(results, m)
        if col is None or col["off"] is None:
            continue
        classes = col["classes"]
        pm, lm = col["plugin"]["mmd2_median"], col["off"]["mmd2_median"]  # [T], [S, T]
        pmf, lmf = col["plugin"]["mmd2_fixed"], col["off"]["mmd2_fixed"]
        pc, lc = cluster_means(pm, classes), cluster_means(lm.mean(0), classes)
        row = {
            "m": m,
            "mmd2_learned": float(lm.mean()),
            "mmd2_plugin": float(pm.mean()),
            "advantage": benefit(float(pm.mean()), float(lm.mean())),
            "advantage_ci": gain_interval(pm, lm, clusters=classes),
            "diff": float(pm.mean() - lm.mean()),
            "diff_ci": mean_interval(pc - lc),
            "advantage_fixed": benefit(float(pmf.mean()), float(lmf.mean())),
            "neff": _mean(col["neff"]),
            "seeds": int(lm.shape[0]),
            "folds": len(col["folds"]),
            "classes": sorted(int(c) for c in np.unique(classes)),
            "test_seeds": _seed_test(pm, lm),
            "paper_advantage": PAPER["digits"]["advantage"].get(m),
            "advantage_per_class": [benefit(a, b) for a, b in zip(pc, lc, strict=True)],
            "mmd2_plugin_per_class": pc.tolist(),  # the digits verdicts' units
            "mmd2_learned_per_class": lc.tolist(),
            "test_classes": paired_tests(pc, lc),
        }
        rows.append(row)
        meta = {
            "explained_variance": col["explained_variance"],
            "train_classes": col["train_classes"],
            "test_classes": col["test_classes"],
            "folds": col["folds"],
        }
    verdicts = []
    if len(rows) >= 2:
        verdicts.append(learned_wins_small_m(rows))
        verdicts.append(plugin_catches_up(rows, PAPER["digits"]["catch_up_m"]))
    meta["tasks_per_class"] = scale.digits_tasks_per_class
    meta["num_folds"] = scale.digits_folds
    return {"rows": rows, "verdicts": verdicts, "data": meta}


def _fieller_rows(n_cols: int, fn):
    return lambda rows: fn(*(rows[:, i] for i in range(n_cols)))


def run_coverage(results: dict, summary: dict) -> list[dict]:
    """Coverage of the report's 95% intervals at the run's own unit counts, measured by resampling.

    The run's units (tasks of a synthetic setting; classes on features) are taken as the
    population; samples of the same number of units are drawn with replacement and the interval's
    share covering the population's value is counted (:func:`~nw_adapter.experiments.inference.
    resampled_coverage`, :data:`COVERAGE_REPS` samples). A check of the interval on data shaped
    like the run's, not a proof; tests/experiments/test_experiments_inference.py simulates it too.
    """
    from nw_adapter.experiments.inference import fieller_interval, resampled_coverage, unit_values

    checks = []

    def add(quantity: str, units: str, a: np.ndarray, b: np.ndarray) -> None:
        pop = np.stack([a, b], 1)
        if pop.shape[0] < 3:
            return
        cov = resampled_coverage(
            pop,
            lambda p: p[:, 0].mean() / p[:, 1].mean(),
            lambda r: fieller_interval(r[:, 0], r[:, 1]),
            pop.shape[0],
            reps=COVERAGE_REPS,
        )
        checks.append({"quantity": quantity, "units": units, "n": int(pop.shape[0]), "coverage": cov})

    for d in [r["d"] for r in summary.get("dims", {}).get("rows", [])]:
        off = _seed_stack(results, f"dims-d{d}-s", "-off", "mmd2_median")
        on = _seed_stack(results, f"dims-d{d}-s", "-on", "mmd2_median")
        add(f"dims d={d}: MMD^2 ON / OFF (benefit)", "tasks", unit_values(on), unit_values(off))
    for d in [r["d"] for r in summary.get("shells", {}).get("rows", [])]:
        plug = np.asarray(results[f"shells-d{d}-plugin"]["mmd2_median"], dtype=np.float64)
        off = _seed_stack(results, f"shells-d{d}-s", "-off", "mmd2_median")
        add(f"shells d={d}: MMD^2 plug-in / learned", "tasks", plug, unit_values(off))
    for row in summary.get("digits", {}).get("rows", []):
        add(
            f"digits m={row['m']}: MMD^2 learned / plug-in (advantage)",
            "classes",
            np.asarray(row["mmd2_learned_per_class"]),
            np.asarray(row["mmd2_plugin_per_class"]),
        )
    return checks


def _inside(value: float, ci) -> bool:
    lo, hi = ci
    return bool(math.isfinite(lo) and math.isfinite(hi) and lo <= value <= hi)


PERCENT_BAND = 0.10
"""Half-width of the band around a paper's percentage (benefit, advantage) that counts as the same
value: +-10 percentage points (the band a paper value of 0 has always had here)."""

RATIO_BAND = 1.5
"""Factor of the band around a paper's ratio that counts as the same value: ``[paper / 1.5, paper x
1.5]`` (the paper's 6.4x: 4.3x - 9.6x; its 11.2x at d = 8 lies outside the band of its 6.4x at d =
32, so the band can tell the paper's two shells numbers apart)."""


def reproduction(paper: float, ci, band: tuple[float, float]) -> str | None:
    """Whether an interval says the paper's value is reproduced (an equivalence: a claim follows from
    its interval): ``"yes"`` when the 95% interval lies inside ``band`` (the values that count as the
    paper's), ``"too wide to tell (...)"`` when it holds the paper's value but reaches beyond the band,
    None otherwise (the caller says "no" or "direction only")."""
    lo, hi = ci
    if math.isfinite(lo) and math.isfinite(hi) and band[0] <= lo and hi <= band[1]:
        return "yes"
    if not _inside(paper, ci):
        return None
    return (
        f"too wide to tell (the interval holds it but reaches beyond the band {band[0]:.3g} to {band[1]:.3g})"
    )


def _ratio_band(paper: float) -> tuple[float, float]:
    return paper / RATIO_BAND, paper * RATIO_BAND


def _percent_band(paper: float) -> tuple[float, float]:
    return paper - PERCENT_BAND, paper + PERCENT_BAND


def _pct_ci_text(x: float, ci) -> str:
    lo, hi = ci
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{100 * x:+.0f}% [unbounded]"
    return f"{100 * x:+.0f}% [{100 * lo:+.0f}, {100 * hi:+.0f}]"


def paper_table(summary: dict) -> list[dict]:
    """The paper-vs-project rows: the paper's number, the project's, same quantity?, reproduces?

    "reproduces" is decided from the run (:func:`reproduction`): "yes" when the project's 95%
    interval lies inside the band that counts as the paper's value (+-10
    percentage points, :data:`PERCENT_BAND`; a factor of 1.5 for a ratio, :data:`RATIO_BAND`); "too
    wide to tell" when it holds the value but reaches beyond the band; "no conclusion" where the
    learned OFF model is not a fair baseline; "direction only" where the trend's sign holds but not
    the value.
    """
    table = []
    dims = summary.get("dims", {}).get("rows", [])
    for r in dims:
        paper = r.get("paper_benefit")
        if paper is None:
            continue
        fair = r["fair"]["fair"]
        agreement = reproduction(paper, r["benefit_ci"], _percent_band(paper)) or "no"
        table.append(
            {
                "claim": f"exact-head benefit at d = {r['d']}",
                "paper": f"{100 * paper:+.0f}%",
                "project": _pct_ci_text(r["benefit"], r["benefit_ci"]),
                "same": "yes"
                if fair
                else "no: OFF is not a fair baseline "
                f"(excess over plug-in {100 * r['fair']['excess']:+.0f}%)",
                "reproduces": agreement if fair else "no conclusion",
            }
        )
    if dims:
        ne = ", ".join(f"{r['neff']:.2f}" for r in dims)
        verdicts = summary["dims"]["verdicts"]
        falls = next((v["appeared"] for v in verdicts if v["trend"].startswith("n_eff")), False)
        table.append(
            {
                "claim": f"plug-in n_eff at t = 0.56, d = {', '.join(str(r['d']) for r in dims)}",
                "paper": "~9 -> ~1",
                "project": ne,
                "same": "yes (mixture spread not given by the paper)",
                "reproduces": "direction only" if falls else "no",
            }
        )
    for r in summary.get("shells", {}).get("rows", []):
        if r.get("paper_ratio") is None:
            continue
        lo, hi = r["ratio_ci"]
        table.append(
            {
                "claim": f"shells: plug-in / learned MMD^2 at d = {r['d']}",
                "paper": f"{r['paper_ratio']:.1f}x",
                "project": f"{r['ratio']:.1f}x [{lo:.1f}, {hi:.1f}]",
                "same": "yes (our shell generator is a reconstruction)"
                if r["fair"]["fair"]
                else "no: learned is not a fair baseline",
                "reproduces": reproduction(r["paper_ratio"], r["ratio_ci"], _ratio_band(r["paper_ratio"]))
                or ("direction only" if lo > 1 else "no"),
            }
        )
    shells = summary.get("shells", {}).get("rows", [])
    if shells:
        lo, hi = PAPER["shells"]["neff"]
        table.append(
            {
                "claim": "shells: plug-in n_eff",
                "paper": f"{lo}-{hi}",
                "project": ", ".join(f"{r['neff']:.2f}" for r in shells),
                "same": "no: another shell generator",
                "reproduces": "yes" if all(lo <= r["neff"] <= hi for r in shells) else "no",
            }
        )
    digits = summary.get("digits", {}).get("rows", [])
    for r in digits:
        if r.get("paper_advantage") is None:
            continue
        table.append(
            {
                "claim": f"scarcity: learned advantage at m = {r['m']}",
                "paper": f"{100 * r['paper_advantage']:+.0f}%",
                "project": f"{_pct_ci_text(r['advantage'], r['advantage_ci'])} ({len(r['classes'])} classes)",
                "same": "same statistic on other features (digits, not DINOv2)",
                "reproduces": reproduction(
                    r["paper_advantage"], r["advantage_ci"], _percent_band(r["paper_advantage"])
                )
                or "no",
            }
        )
    verdicts = summary.get("digits", {}).get("verdicts", [])
    if len(verdicts) == 2:
        caught, paper_m = verdicts[1].get("caught_up_m"), PAPER["digits"]["catch_up_m"]
        table.append(
            {
                "claim": "scarcity: plug-in catches up as m grows",
                "paper": f"for m > ~{paper_m}",
                "project": f"caught up at m = {caught}" if caught else "not caught up at any size run",
                "same": "same test (classes as units) on other features",
                "reproduces": "no"
                if caught is None
                else ("yes" if caught >= paper_m else f"direction only (earlier: m = {caught})"),
            }
        )
    return table


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
    summary["coverage"] = run_coverage(results, summary)
    summary["paper_table"] = paper_table(summary)
    summary["p_values"] = _p_values(summary)
    summary["cpu_s_train"] = sum(r.get("train", {}).get("cpu_s", 0.0) for r in results.values())
    summary["cpu_s_eval"] = sum(r.get("eval_cpu_s", 0.0) for r in results.values())
    summary["units_loaded_trained"] = sum(
        1 for r in results.values() if "train" in r and r["train"]["resumed_from"] >= r["train"]["steps"]
    )
    timing = out_dir / "timing.json"
    summary["timing"] = json.loads(timing.read_text()) if timing.exists() else {"invocations": []}
    return summary
