"""Write a run folder's report.md / report.json / PNG plots, beside the paper's numbers.

The numbers come from :func:`nw_adapter.experiments.aggregate.aggregate`. Every file is written
to a temporary name and moved into place with ``os.replace``. Each expected trend gets a verdict
decided from intervals (:mod:`nw_adapter.experiments.verdicts`), with the values that decided it,
so the report never claims more than it shows; every p-value names its test and its units, and a
closing section counts them and gives the Holm-adjusted values.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from nw_adapter.atomic import atomic_write, atomic_write_text
from nw_adapter.experiments.aggregate import aggregate
from nw_adapter.experiments.scale import PAPER, REGIMES, Scale

__all__ = ["aggregate", "write_report"]


def _fmt(x, spec: str = ".4f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "n/a"
    return format(x, spec)


def _pct(x) -> str:
    return "-" if x is None else ("n/a" if math.isnan(x) else f"{100 * x:+.0f}%")


def _pct_ci(ci) -> str:
    lo, hi = ci
    return "n/a" if math.isnan(lo) else f"[{100 * lo:+.0f}%, {100 * hi:+.0f}%]"


def _p(test: dict | None, key: str) -> str:
    return "-" if not test else _fmt(test.get(key, math.nan), ".3g")


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
        f"eval {summary['cpu_s_eval']:.0f} s (wall time also depends on other load on the machine)."
        + (
            f" {summary['units_loaded_trained']} learned unit(s) loaded a finished training checkpoint from "
            "an earlier invocation: their training time is in neither figure."
            if summary.get("units_loaded_trained")
            else ""
        ),
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
            "benefit = (MMD^2 OFF - MMD^2 ON) / MMD^2 OFF with its 95% bootstrap interval (tasks and seeds "
            "resampled); p seeds: paired t-test over training seeds (n = seeds); p tasks: Wilcoxon "
            "signed-rank test over the evaluation tasks (independent draws from the family, n = tasks; "
            "conditional on the trained models). OFF converged? = OFF MMD^2 not worse than the "
            "training-free plug-in's.",
            "",
            "| d | n_eff | paper n_eff | MMD^2 plug-in | MMD^2 OFF | OFF converged? | MMD^2 ON | benefit "
            "| 95% interval | benefit (fixed) | paper benefit | p seeds (t) | p tasks (Wilcoxon) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in summary["dims"]["rows"]:
            lines.append(
                f"| {r['d']} | {_fmt(r['neff'], '.2f')} | {_fmt(r['paper_neff'], '.0f')} | "
                f"{_fmt(r['mmd2_plugin'])} | {_fmt(r['mmd2_off'])} "
                f"| {'no' if r['off_unconverged'] else 'yes'} "
                f"| {_fmt(r['mmd2_on'])} | {_pct(r['benefit'])} | {_pct_ci(r['benefit_ci'])} | "
                f"{_pct(r['benefit_fixed'])} | {_pct(r['paper_benefit'])} "
                f"| {_p(r['test_seeds'], 't_p')} | {_p(r['test_tasks'], 'wilcoxon_p')} |"
            )
        lines += ["", *_verdict_lines(summary["dims"]["verdicts"]), "", "![dims](dims.png)", ""]
    if "shells" in summary:
        lines += [
            "## Geometry mismatch (concentric shells)",
            "",
            f"Paper: {PAPER['shells']['text']}.",
            "",
            "Ratio interval: 95% bootstrap (tasks and seeds resampled). p seeds: paired t-test of the "
            "plug-in's mean against each seed's (n = seeds); p tasks: Wilcoxon signed-rank over tasks.",
            "",
            "| d | MMD^2 learned | MMD^2 plug-in | plug-in / learned | 95% interval | same, fixed sigma "
            "| paper ratio | n_eff | p seeds (t) | p tasks (Wilcoxon) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in summary["shells"]["rows"]:
            lines.append(
                f"| {r['d']} | {_fmt(r['mmd2_learned'])} | "
                f"{_fmt(r['mmd2_plugin'])} | {_fmt(r['ratio'], '.1f')}x | "
                f"[{_fmt(r['ratio_ci'][0], '.1f')}, {_fmt(r['ratio_ci'][1], '.1f')}] | "
                f"{_fmt(r['ratio_fixed'], '.1f')}x | "
                f"{_fmt(r['paper_ratio'], '.1f')} | {_fmt(r['neff'], '.2f')} | "
                f"{_p(r['test_seeds'], 't_p')} | {_p(r['test_tasks'], 'wilcoxon_p')} |"
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
            f"standardised; test classes {data.get('test_classes')}, {data.get('tasks_per_class')} tasks per "
            "class (each task: a random support and disjoint held-out points of one class); supports nested "
            "across m.",
            "",
            "Tasks of one class share most of their points, so they are not independent: the independent "
            "units are the test classes and the training seeds. The advantage interval resamples classes "
            "and seeds (95% bootstrap; with 3 classes it is coarse); p classes: paired t-test over the "
            "class means (n = classes); p seeds: paired t-test of the plug-in's mean against each seed's "
            "(n = seeds; conditional on these classes). No test over tasks is reported (it would be "
            "pseudo-replicated: its p-value shrinks with the number of tasks drawn per class).",
            "",
            "| m | MMD^2 learned | MMD^2 plug-in | learned advantage | 95% interval | per class "
            "| same, fixed sigma | paper | n_eff | p classes (t) | p seeds (t) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in summary["digits"]["rows"]:
            lines.append(
                f"| {r['m']} | {_fmt(r['mmd2_learned'])} | "
                f"{_fmt(r['mmd2_plugin'])} | {_pct(r['advantage'])} | {_pct_ci(r['advantage_ci'])} | "
                f"{' / '.join(_pct(a) for a in r.get('advantage_per_class', [])) or '-'} | "
                f"{_pct(r['advantage_fixed'])} | {_pct(r['paper_advantage'])} | {_fmt(r['neff'], '.2f')} | "
                f"{_p(r.get('test_classes'), 't_p')} | {_p(r['test_seeds'], 't_p')} |"
            )
        lines += ["", *_verdict_lines(summary["digits"]["verdicts"]), "", "![digits](digits.png)", ""]
    head_sets = _head_sets(summary)
    if head_sets:
        lines += [
            "## The learned model's cross-attention heads as NW smoothers",
            "",
            "rho = per-row Spearman between a head's attention logits q k^T / sqrt(d_k) and NW logits "
            "(ranks of logits, never of float32 weights, which underflow to ties near t = 1), mean over "
            "rows, tasks, layers and heads (OFF models). 'head' = NW in the head's own q/k space with the "
            "matched bandwidth h^2 = sqrt(d_k). Attention = this NW times the key prior "
            "exp(||k||^2 / 2 sqrt(d_k)), "
            "so rho head is high BY ALGEBRA whenever key norms vary little (key-norm CV, population std): "
            "the untrained model (same architecture and initial weights, no training) shows it too, and it "
            "is NOT evidence of learned kernel smoothing. 'data' = the exact isotropic posterior in data "
            "space at the same x_t (h = b_t / t): the informative comparison, ~0 for the untrained model. "
            "Nulls = NW logits permuted per row; top-1 = share of rows whose most-attended support point is "
            "the posterior's.",
            "",
            "| task | t | h_data | rho head (null) | untrained | key-norm CV (untrained) | rho data (null) "
            "| untrained | top-1 data | heads rho data > 0.9 | n_eff attn | n_eff NW data |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for label, rows in head_sets:
            for h in rows:
                lines.append(
                    f"| {label} | {h['t']:.2f} | {h['h_data']:.3f} | {h['rho_head']:.3f} "
                    f"({h['rho_head_null']:.3f}) | {_fmt(h['untrained_rho_head'], '.3f')} "
                    f"| {h['key_norm_cv']:.2f} ({_fmt(h['untrained_key_norm_cv'], '.2f')}) "
                    f"| {h['rho_data']:.3f} "
                    f"({h['rho_null']:.3f}) | {_fmt(h['untrained_rho_data'], '.3f')} | {h['top1_data']:.2f} "
                    f"| {100 * h['frac_rho_data_gt_0_9']:.0f}% | {h['neff_attn']:.1f} "
                    f"| {h['neff_data_nw']:.2f} |"
                )
        lines += ["", "![heads](heads.png)", ""]
    lines += _p_value_section(summary.get("p_values", []))
    return "\n".join(lines) + "\n"


def _p_value_section(found: list[dict]) -> list[str]:
    """The multiple-comparison note: how many p-values, and which survive Holm at 0.05."""
    if not found:
        return []
    survive = [f for f in found if f["p_holm"] < 0.05]
    lines = [
        "## Multiple comparisons",
        "",
        f"This report prints {len(found)} p-values. Read one at a time, about {0.05 * len(found):.1f} of "
        "them would fall below 0.05 by chance if no effect existed anywhere. Holm-adjusted (family-wise "
        f"error 0.05 over all {len(found)}), {len(survive)} remain below 0.05"
        + (
            ": "
            + "; ".join(f"{f['where']} {f['test']} (p {f['p']:.3g}, Holm {f['p_holm']:.3g})" for f in survive)
            if survive
            else ""
        )
        + ". Tests over 3 seeds or 3 classes have little power: a p-value above 0.05 there is no evidence "
        "of no effect.",
        "",
    ]
    return lines


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
        for i, (label, rows) in enumerate(head_sets):
            ts, colour = [h["t"] for h in rows], f"C{i % 10}"
            ax[0].plot(ts, [h["rho_head"] for h in rows], "o-", color=colour, label=label)
            ax[1].plot(ts, [h["rho_data"] for h in rows], "o-", color=colour, label=label)
            ax[0].plot(ts, [h["untrained_rho_head"] for h in rows], "x--", color=colour, alpha=0.6)
            ax[1].plot(ts, [h["untrained_rho_data"] for h in rows], "x--", color=colour, alpha=0.6)
        ax[0].set(xlabel="t", ylabel="rho", title="head space, matched h (high by algebra)")
        ax[1].set(xlabel="t", title="data space, exact posterior")
        ax[0].plot([], [], "kx--", alpha=0.6, label="untrained (dashed)")
        ax[0].legend(fontsize=7)
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
