"""Aggregate unit results into report.md / report.json / PNG plots, beside the paper's numbers.

Every file is written to a temporary name and moved into place with ``os.replace``. Each
expected trend gets a verdict computed from the numbers ("appeared" or "did not appear"),
with the measured values that decided it, so the report never claims more than it shows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from nw_adapter.atomic import atomic_write, atomic_write_text
from nw_adapter.experiments.evaluation import benefit, paired_tests
from nw_adapter.experiments.scale import PAPER, REGIMES, Scale

__all__ = ["aggregate", "write_report"]


def _load(out_dir: Path) -> dict[str, dict]:
    results = {}
    for path in sorted((out_dir / "results").glob("*.json")):
        results[path.stem] = json.loads(path.read_text())
    return results


def _mean(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(np.mean(x)) if x.size else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def _seed_stack(results: dict, prefix: str, suffix: str, key: str) -> np.ndarray:
    """Per-task arrays of all seeds of one configuration, ``[seeds, tasks]``."""
    rows = [r[key] for uid, r in sorted(results.items()) if uid.startswith(prefix) and uid.endswith(suffix)]
    return np.asarray(rows, dtype=np.float64)


def _nanmean(values: list[float]) -> float:
    arr = np.asarray(values, dtype=np.float64)
    return float(np.nanmean(arr)) if np.isfinite(arr).any() else math.nan


def _heads_summary(rows: list[dict]) -> list[dict]:
    """Mean over layers, heads (and seeds) per t."""
    by_t: dict[float, list[dict]] = {}
    for r in rows:
        by_t.setdefault(r["t"], []).append(r)
    out = []
    for t in sorted(by_t):
        rs = by_t[t]
        out.append(
            {
                "t": t,
                "h_data": rs[0]["h_data"],
                "rho_head": _nanmean([r["rho_head"] for r in rs]),
                "rho_data": _nanmean([r["rho_data"] for r in rs]),
                "rho_null": _nanmean([r["rho_null"] for r in rs]),
                "rho_head_null": _nanmean([r.get("rho_head_null", math.nan) for r in rs]),
                "key_norm_cv": _nanmean([r.get("key_norm_cv", math.nan) for r in rs]),
                "frac_rho_data_gt_0_9": float(np.mean([r["rho_data"] > 0.9 for r in rs])),
                "neff_attn": _nanmean([r["neff_attn"] for r in rs]),
                "neff_data_nw": _nanmean([r["neff_data_nw"] for r in rs]),
            }
        )
    return out


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
        heads = [
            h
            for uid, r in results.items()
            if uid.startswith(f"dims-d{d}-s") and uid.endswith("-off")
            for h in r.get("heads", [])
        ]
        rows.append(
            {
                "d": d,
                "neff": _mean(plug["neff"]),
                "mmd2_plugin": _mean(plug["mmd2_median"]),
                "mmd2_off": float(seeds_off.mean()),
                "mmd2_on": float(seeds_on.mean()),
                "benefit": benefit(float(seeds_off.mean()), float(seeds_on.mean())),
                "benefit_per_seed": [benefit(a, b) for a, b in zip(seeds_off, seeds_on, strict=True)],
                "benefit_fixed": benefit(float(off_f.mean()), float(on_f.mean())),
                "mmd2_fixed_plugin": _mean(plug["mmd2_fixed"]),
                "seeds": int(off.shape[0]),
                "test_seeds": paired_tests(seeds_off, seeds_on),
                "test_tasks": paired_tests(off.mean(0), on.mean(0)),
                "paper_benefit": PAPER["dims"]["benefit"].get(d),
                "paper_neff": PAPER["dims"]["neff"].get(d),
                "loss_last_off": _mean(
                    [
                        r["train"]["loss_last"]
                        for uid, r in results.items()
                        if uid.startswith(f"dims-d{d}-s") and uid.endswith("-off")
                    ]
                ),
                "heads": _heads_summary(heads),
            }
        )
    verdicts = []
    if len(rows) >= 2:
        ne = [r["neff"] for r in rows]
        falls = all(a >= b for a, b in zip(ne, ne[1:], strict=False)) and ne[0] >= 3 and ne[-1] <= ne[0] / 3
        level = (
            f" At d={rows[-1]['d']} it is {ne[-1]:.1f}, above the paper's ~1: the level depends on the "
            "component spread (ours: geometric-mean std 0.3-0.8, aspect 3-10), which the paper "
            "does not state."
            if ne[-1] > 1.5
            else ""
        )
        verdicts.append(
            {
                "trend": "n_eff falls as d grows (monotone, at least 3x from the smallest to the largest d)",
                "appeared": bool(falls),
                "evidence": ", ".join(f"d={r['d']}: {r['neff']:.2f}" for r in rows) + "." + level,
            }
        )
        b0, b1 = rows[0]["benefit"], rows[-1]["benefit"]
        appeared = b0 > 0 and abs(b1) <= 0.1 and b1 < b0
        why = ""
        if not appeared:
            gap = rows[-1]["mmd2_off"] / rows[-1]["mmd2_plugin"] if rows[-1]["mmd2_plugin"] > 0 else math.nan
            why = (
                f". At d={rows[-1]['d']} the OFF model's MMD^2 is still {gap:.1f}x the plug-in's after "
                f"{scale.steps} training steps (paper 100k): it is not converged, so the frozen exact "
                "head (at low n_eff it points to the nearest support point, i.e. it reproduces the "
                "support) still helps; the paper's ~0 benefit is measured against a converged OFF model."
            )
        verdicts.append(
            {
                "trend": "exact-head benefit positive at small d and about 0 at the largest d",
                "appeared": bool(appeared),
                "evidence": ", ".join(f"d={r['d']}: {100 * r['benefit']:+.0f}%" for r in rows) + why,
            }
        )
    return {"rows": rows, "verdicts": verdicts}


def _aggregate_shells(results: dict, scale: Scale) -> dict:
    rows = []
    for d in scale.shell_dims:
        plug = results.get(f"shells-d{d}-plugin")
        learned = _seed_stack(results, f"shells-d{d}-s", "-off", "mmd2_median")
        learned_f = _seed_stack(results, f"shells-d{d}-s", "-off", "mmd2_fixed")
        if plug is None or learned.size == 0:
            continue
        heads = [
            h for uid, r in results.items() if uid.startswith(f"shells-d{d}-s") for h in r.get("heads", [])
        ]
        lm, pm = float(learned.mean()), _mean(plug["mmd2_median"])
        rows.append(
            {
                "d": d,
                "mmd2_learned": lm,
                "mmd2_plugin": pm,
                "ratio": _ratio(pm, lm),
                "ratio_fixed": _ratio(_mean(plug["mmd2_fixed"]), float(learned_f.mean())),
                "neff": _mean(plug["neff"]),
                "test_tasks": paired_tests(np.asarray(plug["mmd2_median"]), learned.mean(0)),
                "paper_ratio": PAPER["shells"]["ratio"].get(d),
                "heads": _heads_summary(heads),
            }
        )
    verdicts = []
    if rows:
        ratios = [r["ratio"] for r in rows]
        verdicts.append(
            {
                "trend": "isotropic plug-in several times (>= 2x) worse MMD^2 than the learned model",
                "appeared": bool(all(r >= 2 for r in ratios)),
                "evidence": ", ".join(f"d={r['d']}: {r['ratio']:.1f}x" for r in rows),
            }
        )
        ne = [r["neff"] for r in rows]
        lo, hi = PAPER["shells"]["neff"]
        verdicts.append(
            {
                "trend": f"plug-in n_eff stays healthy (paper {lo}-{hi}; we call >= 3 healthy)",
                "appeared": bool(all(n >= 3 for n in ne)),
                "evidence": ", ".join(f"d={r['d']}: {r['neff']:.2f}" for r in rows)
                + (
                    ""
                    if all(n >= 3 for n in ne)
                    else ". Our shells (radii stratified in [2, 8], centred) give a sharper posterior at "
                    "t = 0.56 than the paper's unreleased generator; the ratio is still a geometry effect "
                    "(the plug-in's samples are copies of the support, the learned model fills the shells)."
                ),
            }
        )
    return {"rows": rows, "verdicts": verdicts}


def _aggregate_digits(results: dict, scale: Scale) -> dict:
    plug = results.get("digits-plugin")
    learned = [r for uid, r in sorted(results.items()) if uid.startswith("digits-s")]
    rows = []
    if plug is not None and learned:
        for m in scale.support_sizes:
            key = str(m)
            lm = np.asarray([r["per_m"][key]["mmd2_median"] for r in learned])
            pm = np.asarray(plug["per_m"][key]["mmd2_median"])
            lmf = np.asarray([r["per_m"][key]["mmd2_fixed"] for r in learned])
            pmf = np.asarray(plug["per_m"][key]["mmd2_fixed"])
            rows.append(
                {
                    "m": m,
                    "mmd2_learned": float(lm.mean()),
                    "mmd2_plugin": float(pm.mean()),
                    "advantage": benefit(float(pm.mean()), float(lm.mean())),
                    "advantage_fixed": benefit(float(pmf.mean()), float(lmf.mean())),
                    "neff": _mean(plug["per_m"][key]["neff"]),
                    "test_tasks": paired_tests(pm, lm.mean(0)),
                    "paper_advantage": PAPER["digits"]["advantage"].get(m),
                }
            )
    verdicts = []
    if len(rows) >= 2:
        small = [r for r in rows if r["m"] <= 10] or rows[:1]
        best_small = max(r["advantage"] for r in small)
        last = rows[-1]["advantage"]
        crossover = next((r["m"] for r in rows if r["advantage"] <= 0), "none of the sizes run")
        verdicts.append(
            {
                "trend": "learned model wins at small m (advantage > 0 at some m <= 10)",
                "appeared": bool(best_small > 0),
                "evidence": ", ".join(f"m={r['m']}: {100 * r['advantage']:+.0f}%" for r in rows),
            }
        )
        verdicts.append(
            {
                "trend": (
                    "plug-in catches up as m grows (advantage at the largest m below the small-m advantage)"
                ),
                "appeared": bool(last < best_small),
                "evidence": (
                    f"best small-m advantage {100 * best_small:+.0f}%, "
                    f"at m={rows[-1]['m']}: {100 * last:+.0f}%; the plug-in first matches or beats "
                    f"the learned model at m={crossover} (paper: m ~{PAPER['digits']['catch_up_m']})"
                ),
            }
        )
    meta = {}
    if plug is not None:
        meta = {k: plug.get(k) for k in ("explained_variance", "train_classes", "test_classes")}
    return {"rows": rows, "verdicts": verdicts, "data": meta}


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
    summary["cpu_s_train"] = sum(r.get("train", {}).get("cpu_s", 0.0) for r in results.values())
    summary["cpu_s_eval"] = sum(r.get("eval_cpu_s", 0.0) for r in results.values())
    timing = out_dir / "timing.json"
    summary["timing"] = json.loads(timing.read_text()) if timing.exists() else {"invocations": []}
    return summary


def _fmt(x, spec: str = ".4f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "n/a"
    return format(x, spec)


def _pct(x) -> str:
    return "-" if x is None else ("n/a" if math.isnan(x) else f"{100 * x:+.0f}%")


def _verdict_lines(verdicts: list[dict]) -> list[str]:
    return [
        f"- **{'appeared' if v['appeared'] else 'did not appear'}**: {v['trend']}. {v['evidence']}"
        for v in verdicts
    ]


def _markdown(summary: dict, scale: Scale) -> str:
    inv = summary["timing"]["invocations"]
    lines = [
        "# Failure regimes of the plug-in NW field versus a learned ICFM model",
        "",
        f"Scale **{scale.name}**: model d_model {scale.d_model} "
        f"/ H {scale.num_heads} / L {scale.num_layers}, "
        f"{scale.steps} steps ({scale.digits_steps} on features) of {scale.tasks_per_batch} tasks x "
        f"{scale.targets_per_task} targets, lr {scale.lr:g}, {scale.seeds} seed(s); evaluation "
        f"{scale.eval_tasks} tasks x {scale.eval_generated} generated points, Euler on {scale.grid_points} "
        "points of [1e-5, 1], sigma_min 0.01. Paper: d_model 128 / H 4 / L 3, 100k steps, 256 x 256, "
        "100 tasks x 500 points.",
        "",
        "Wall time per invocation: "
        + "; ".join(f"{v['wall_s']:.0f} s ({v['units_run']} units, {v['workers']} worker(s))" for v in inv)
        + f". CPU time of the finished units: train {summary['cpu_s_train']:.0f} s, "
        f"eval {summary['cpu_s_eval']:.0f} s (wall time also depends on other load on the machine).",
        "",
        "MMD^2 is the unbiased estimate with the median-heuristic bandwidth of the pooled sample (the "
        "'fixed' columns use one task-only bandwidth shared by all methods); means over tasks (and seeds). "
        "n_eff is the plug-in's 1 / sum w_i^2 at t = 0.56 on the OT path of held-out targets.",
        "",
    ]
    if "dims" in summary:
        lines += [
            "## Nearest-neighbour collapse (Gaussian mixtures, dimension sweep)",
            "",
            f"Paper: {PAPER['dims']['text']}.",
            "",
            "| d | n_eff | paper n_eff | MMD^2 plug-in | MMD^2 OFF | MMD^2 ON | benefit | benefit (fixed) "
            "| paper benefit | p seeds (t) | p tasks (Wilcoxon) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in summary["dims"]["rows"]:
            lines.append(
                f"| {r['d']} | {_fmt(r['neff'], '.2f')} | {_fmt(r['paper_neff'], '.0f')} | "
                f"{_fmt(r['mmd2_plugin'])} | {_fmt(r['mmd2_off'])} "
                f"| {_fmt(r['mmd2_on'])} | {_pct(r['benefit'])} | "
                f"{_pct(r['benefit_fixed'])} | {_pct(r['paper_benefit'])} "
                f"| {_fmt(r['test_seeds']['t_p'], '.3f')} "
                f"| {_fmt(r['test_tasks']['wilcoxon_p'], '.3g')} |"
            )
        lines += ["", *_verdict_lines(summary["dims"]["verdicts"]), "", "![dims](dims.png)", ""]
    if "shells" in summary:
        lines += [
            "## Geometry mismatch (concentric shells)",
            "",
            f"Paper: {PAPER['shells']['text']}.",
            "",
            "| d | MMD^2 learned | MMD^2 plug-in | plug-in / "
            "learned | same, fixed sigma | paper ratio | n_eff "
            "| p tasks (Wilcoxon) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in summary["shells"]["rows"]:
            lines.append(
                f"| {r['d']} | {_fmt(r['mmd2_learned'])} | "
                f"{_fmt(r['mmd2_plugin'])} | {_fmt(r['ratio'], '.1f')}x | "
                f"{_fmt(r['ratio_fixed'], '.1f')}x | "
                f"{_fmt(r['paper_ratio'], '.1f')} | {_fmt(r['neff'], '.2f')} | "
                f"{_fmt(r['test_tasks']['wilcoxon_p'], '.3g')} |"
            )
        lines += ["", *_verdict_lines(summary["shells"]["verdicts"]), "", "![shells](shells.png)", ""]
    if "digits" in summary:
        data = summary["digits"]["data"]
        source = scale.features or "scikit-learn digits (offline substitute for DINOv2 ImageNet CLS features)"
        lines += [
            "## Support scarcity (real features, support-size sweep)",
            "",
            f"Paper: {PAPER['digits']['text']}. Here: {source}, PCA to 16 d fitted on training classes "
            f"{data.get('train_classes')} only (explained variance "
            f"{_fmt(data.get('explained_variance'), '.2f')}), "
            f"standardised; test classes {data.get('test_classes')}; one class = one task; supports nested "
            "across m.",
            "",
            "| m | MMD^2 learned | MMD^2 plug-in | learned advantage | same, fixed sigma | paper | n_eff "
            "| p tasks (Wilcoxon) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in summary["digits"]["rows"]:
            lines.append(
                f"| {r['m']} | {_fmt(r['mmd2_learned'])} | "
                f"{_fmt(r['mmd2_plugin'])} | {_pct(r['advantage'])} | "
                f"{_pct(r['advantage_fixed'])} | {_pct(r['paper_advantage'])} | {_fmt(r['neff'], '.2f')} | "
                f"{_fmt(r['test_tasks']['wilcoxon_p'], '.3g')} |"
            )
        lines += ["", *_verdict_lines(summary["digits"]["verdicts"]), "", "![digits](digits.png)", ""]
    head_sets = _head_sets(summary)
    if head_sets:
        lines += [
            "## The learned model's cross-attention heads as NW smoothers",
            "",
            "rho = per-row Spearman between a head's attention softmax(q k^T / sqrt(d_k)) and NW weights, "
            "mean over rows, tasks, layers and heads (OFF models). 'head' = NW in the head's own q/k space "
            "with the matched bandwidth h^2 = sqrt(d_k) (attention = this NW times the key prior "
            "exp(||k||^2 / 2 sqrt(d_k)), so rho head < 1 only through unequal key norms, see key-norm CV); "
            "'data' = the exact isotropic posterior in data space at the same x_t (h = b_t / t); "
            "nulls = NW weights permuted per row.",
            "",
            "| task | t | h_data | rho head (null) | key-norm CV | rho data (null) | heads rho data > 0.9 "
            "| n_eff attn | n_eff NW data |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for label, rows in head_sets:
            for h in rows:
                lines.append(
                    f"| {label} | {h['t']:.2f} | {h['h_data']:.3f} | {h['rho_head']:.3f} "
                    f"({h['rho_head_null']:.3f}) | {h['key_norm_cv']:.2f} | {h['rho_data']:.3f} "
                    f"({h['rho_null']:.3f}) | {100 * h['frac_rho_data_gt_0_9']:.0f}% "
                    f"| {h['neff_attn']:.1f} | {h['neff_data_nw']:.2f} |"
                )
        lines += ["", "![heads](heads.png)", ""]
    return "\n".join(lines) + "\n"


def _head_sets(summary: dict) -> list[tuple[str, list[dict]]]:
    """``(label, per-t head rows)`` of every synthetic sub-experiment that analysed its heads."""
    return [
        (f"{name} d={r['d']}", r["heads"])
        for name in ("dims", "shells")
        if name in summary
        for r in summary[name]["rows"]
        if r.get("heads")
    ]


def _save_fig(fig, path: Path) -> None:
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, bbox_inches="tight"))


def _plots(summary: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    written = []
    if summary.get("dims", {}).get("rows"):
        rows = summary["dims"]["rows"]
        ds = [r["d"] for r in rows]
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
        ax[0].plot(ds, [r["neff"] for r in rows], "o-", label="ours")
        ax[0].plot(list(PAPER["dims"]["neff"]), list(PAPER["dims"]["neff"].values()), "s--", label="paper")
        ax[0].set(xlabel="d", ylabel="n_eff at t = 0.56", title="nearest-neighbour collapse")
        ax[1].plot(ds, [100 * r["benefit"] for r in rows], "o-", label="ours (median sigma)")
        ax[1].plot(ds, [100 * r["benefit_fixed"] for r in rows], "^:", label="ours (fixed sigma)")
        ax[1].plot(
            list(PAPER["dims"]["benefit"]),
            [100 * v for v in PAPER["dims"]["benefit"].values()],
            "s--",
            label="paper",
        )
        ax[1].axhline(0, color="grey", lw=0.8)
        ax[1].set(xlabel="d", ylabel="benefit of exact head (%)")
        for a in ax:
            a.set_xscale("log", base=2)
            a.set_xticks(ds, [str(d) for d in ds])
            a.xaxis.set_minor_formatter(NullFormatter())
            a.legend(fontsize=8)
        _save_fig(fig, out_dir / "dims.png")
        plt.close(fig)
        written.append("dims.png")
    if summary.get("shells", {}).get("rows"):
        rows = summary["shells"]["rows"]
        x = np.arange(len(rows))
        fig, ax = plt.subplots(figsize=(5, 3.4))
        ax.bar(x - 0.2, [r["mmd2_learned"] for r in rows], 0.4, label="learned")
        ax.bar(x + 0.2, [r["mmd2_plugin"] for r in rows], 0.4, label="plug-in NW")
        ax.set_xticks(x, [f"d={r['d']}" for r in rows])
        ax.set(ylabel="MMD^2", title="shells: geometry mismatch")
        ax.legend(fontsize=8)
        _save_fig(fig, out_dir / "shells.png")
        plt.close(fig)
        written.append("shells.png")
    if summary.get("digits", {}).get("rows"):
        rows = summary["digits"]["rows"]
        fig, ax = plt.subplots(figsize=(5, 3.4))
        ms = [r["m"] for r in rows]
        ax.plot(ms, [r["mmd2_learned"] for r in rows], "o-", label="learned")
        ax.plot(ms, [r["mmd2_plugin"] for r in rows], "s-", label="plug-in NW")
        ax.set(xscale="log", yscale="log", xlabel="support size m", ylabel="MMD^2", title="support scarcity")
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=8)
        _save_fig(fig, out_dir / "digits.png")
        plt.close(fig)
        written.append("digits.png")
    head_sets = _head_sets(summary)
    if head_sets:
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
        for label, rows in head_sets:
            ts = [h["t"] for h in rows]
            ax[0].plot(ts, [h["rho_head"] for h in rows], "o-", label=label)
            ax[1].plot(ts, [h["rho_data"] for h in rows], "o-", label=label)
        ax[0].set(xlabel="t", ylabel="rho", title="head space, matched h")
        ax[1].set(xlabel="t", title="data space, exact posterior")
        ax[1].legend(fontsize=7)
        _save_fig(fig, out_dir / "heads.png")
        plt.close(fig)
        written.append("heads.png")
    return written


def write_report(out_dir: str | Path, scale: Scale, regimes: tuple[str, ...] = REGIMES) -> Path:
    """Write ``report.json``, ``report.md`` and the plots into ``out_dir``; returns the markdown path."""
    out_dir = Path(out_dir)
    summary = aggregate(out_dir, scale, regimes)
    summary["plots"] = _plots(summary, out_dir)
    for name, text in (
        ("report.json", json.dumps(summary, indent=1)),
        ("report.md", _markdown(summary, scale)),
    ):
        atomic_write_text(out_dir / name, text)
    return out_dir / "report.md"
