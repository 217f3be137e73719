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
            "| d | MMD^2 learned | MMD^2 learned ON | MMD^2 plug-in | plug-in / learned | 95% interval "
            "| same, fixed sigma | paper ratio | n_eff | p seeds (t) | p tasks (Wilcoxon) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in summary["shells"]["rows"]:
            lines.append(
                f"| {r['d']} | {_fmt(r['mmd2_learned'])} | {_fmt(r.get('mmd2_on'))} | "
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
    lines += matrix_lines(summary)
    lines += baseline_lines(summary, scale)
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


ROW_LABELS = {
    "smoothed": "smoothed support, LOO tau (scarcity)",
    "local_cov": "local covariance / manifold Parzen (geometry)",
    "projected": "projected NW + Gaussian complement (collapse)",
    "amortised": "smoothed support, amortised tau (scarcity)",
    "learned_on": "learned ON (exact NW head as input)",
}


def _share_cell(col: dict, cell: dict | None, own: bool) -> str:
    if cell is None:
        return "-"
    beats = f", beats learned OFF by {_pct(cell['gain_vs_off'])} {_pct_ci(cell['gain_vs_off_ci'])}"
    if not col["has_gap"]:
        return f"no gap ({_pct(cell['gain_vs_plugin'])} vs plug-in{beats if cell['beats_learned'] else ''})"
    lo, hi = cell["share_ci"]
    text = f"{100 * cell['share']:+.0f}% [{_fmt(100 * lo, '+.0f')}, {_fmt(100 * hi, '+.0f')}]"
    if cell["beats_learned"]:
        text += beats
    return f"**{text}**" if own else text


def matrix_lines(summary: dict) -> list[str]:
    """The fix x regime matrix section (empty when no training-free field was run)."""
    from nw_adapter.experiments.matrix import REGIME_OF_ROW, ROWS

    mat = summary.get("matrix") or {}
    cols = mat.get("columns", [])
    if not cols:
        return []
    head = " | ".join(f"{c['regime']} {c['setting']}" for c in cols)
    lines = [
        "## Training-free fixes: the fix x regime matrix",
        "",
        "Each field is the exact field of a smoothed target built from the support alone "
        "(nw_adapter.core.smoothed_fields; THEORY.md section 5): one lesson of the paper each. Cell = share "
        "of the plug-in -> learned gap the method closes, (MMD^2 plug-in - MMD^2 method) / (MMD^2 plug-in - "
        "MMD^2 learned OFF): 0% = no better than the plug-in, 100% = as good as the learned OFF model, "
        "> 100% = better; 'beats learned OFF' = the method's MMD^2 gain over the OFF model has its interval "
        "above 0 (also shown where there is no gap). 95% percentile bootstrap interval resampling the "
        "independent units jointly for "
        "all methods (tasks on synthetic families, classes on features; and training seeds). Bold = the "
        "regime the fix is meant for. 'no gap' = the learned OFF model is not significantly better than "
        "the plug-in there (its gain interval reaches 0), so no share is defined; the field's relative "
        "MMD^2 gain over the plug-in is shown instead. Same tasks and the same initial noise for every "
        "method (paired).",
        "",
        f"| method | {head} |",
        "|---" * (len(cols) + 1) + "|",
        "| MMD^2 plug-in / learned OFF / learned ON | "
        + " | ".join(
            f"{_fmt(c['mmd2_plugin'])} / {_fmt(c['mmd2_off'])} / {_fmt(c.get('mmd2_on'))}" for c in cols
        )
        + " |",
        "| gap: OFF gain over plug-in | "
        + " | ".join(f"{_pct(c['gap'])} {_pct_ci(c['gap_ci'])}" for c in cols)
        + " |",
    ]
    for row in ROWS:
        cells = mat["cells"].get(row, [])
        if not any(cells):
            continue
        own = REGIME_OF_ROW[row]
        lines.append(
            f"| {ROW_LABELS[row]} | "
            + " | ".join(_share_cell(c, x, c["regime"] == own) for c, x in zip(cols, cells, strict=True))
            + " |"
        )
    lines.append(
        "| MMD^2 of each field (smoothed / local / projected / amortised) | "
        + " | ".join(
            " / ".join(_fmt((mat["cells"][r][i] or {}).get("mmd2", math.nan)) for r in ROWS[:4])
            for i in range(len(cols))
        )
        + " |"
    )
    lines.append(
        "| tau: LOO (mean over tasks) / amortised | "
        + " | ".join(f"{_fmt(c['loo_tau_mean'], '.3f')} / {_fmt(c['amortised_tau'], '.3f')}" for c in cols)
        + " |"
    )
    lines += [
        "",
        "Each cell's paired test of the method against the plug-in (Wilcoxon signed-rank over tasks on "
        "synthetic families, paired t over class means on features) is in report.json and in the Holm "
        "family below. Verdicts (one per fix: it must close part of its own regime's gap, interval above "
        "0, and no other regime's):",
        "",
        *_verdict_lines(mat.get("verdicts", [])),
        "",
        "![matrix](matrix.png)",
        "",
    ]
    return lines


def baseline_lines(summary: dict, scale: Scale) -> list[str]:
    """The learned baseline's convergence table."""
    rows = summary.get("baseline") or []
    if not rows:
        return []
    lines = [
        "## The learned baseline: convergence",
        "",
        "Criterion (nw_adapter.experiments.training.loss_plateau): every step draws new tasks, so the "
        "per-step loss is a held-out loss; over the last 20% of steps a least-squares line is fitted, "
        "and the model counts as converged when its fitted decrease over that window is within 2 "
        "standard errors of 0 or below 1% of the loss. 'drop' = that fitted decrease relative to the "
        "mean loss (+ = still falling), +- 2 standard errors, per seed.",
        "",
        "| regime | setting | variant | steps | seeds converged | drop per seed (+- 2 se) | final loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        drops = ", ".join(
            f"{100 * d:+.1f}% +- {200 * e:.1f}%" if math.isfinite(d) else "n/a"
            for d, e in zip(r["drop"], r["drop_se"], strict=True)
        )
        lines.append(
            f"| {r['regime']} | {r['setting']} | {r['variant']} | {r['steps']} | {r['converged']} / "
            f"{r['seeds']} | {drops} | {_fmt(r['loss_last'], '.4f')} |"
        )
    bad = [f"{r['regime']} {r['setting']} {r['variant']}" for r in rows if r["converged"] < r["seeds"]]
    lines += [
        "",
        (
            "The criterion does not hold for every seed at: " + "; ".join(bad) + ". "
            if bad
            else "The criterion holds for every model. "
        )
        + f"Paper: 100k steps of 256 tasks x 256 targets; here {scale.steps} steps "
        f"({scale.digits_steps} on features) of {scale.tasks_per_batch} x {scale.targets_per_task}.",
        "",
    ]
    return lines


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


def _matrix_plot(mat: dict, out_dir: Path, plt) -> None:
    """Heat map of the gap shares (rows: fields and learned ON; columns: settings); grey = no gap."""
    from nw_adapter.experiments.matrix import ROWS

    cols = mat["columns"]
    rows = [r for r in ROWS if any(mat["cells"].get(r, []))]
    share = np.full((len(rows), len(cols)), np.nan)
    for i, r in enumerate(rows):
        for j, cell in enumerate(mat["cells"][r]):
            if cell is not None and cols[j]["has_gap"]:
                share[i, j] = 100 * cell["share"]
    fig, ax = plt.subplots(figsize=(1.25 * len(cols) + 3.2, 0.55 * len(rows) + 1.6))
    cmap = plt.get_cmap("RdBu").with_extremes(bad="0.85")
    img = ax.imshow(np.clip(share, -150, 150), cmap=cmap, vmin=-150, vmax=150, aspect="auto")
    for i, r in enumerate(rows):
        for j, cell in enumerate(mat["cells"][r]):
            if cell is None:
                continue
            if not cols[j]["has_gap"]:
                text = f"no gap\n({100 * cell['gain_vs_plugin']:+.0f}% vs plug-in)"
                if cell["beats_learned"]:
                    text += "\nbeats learned"
            else:
                lo, hi = cell["share_ci"]
                text = f"{share[i, j]:+.0f}%\n[{100 * lo:+.0f}, {100 * hi:+.0f}]"
            dark = np.isfinite(share[i, j]) and abs(share[i, j]) > 90
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    ax.set_xticks(range(len(cols)), [f"{c['regime']}\n{c['setting']}" for c in cols], fontsize=8)
    ax.set_yticks(range(len(rows)), [ROW_LABELS[r] for r in rows], fontsize=8)
    ax.set_title("share of the plug-in -> learned OFF gap closed (100% = learned OFF)", fontsize=9)
    fig.colorbar(img, ax=ax, label="share closed (%)", shrink=0.8)
    _save_fig(fig, out_dir / "matrix.png")
    plt.close(fig)


def _plots(summary: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    written = []
    if summary.get("dims", {}).get("rows"):
        rows = summary["dims"]["rows"]
        ds = [r["d"] for r in rows]
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
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
    if summary.get("matrix", {}).get("columns"):
        _matrix_plot(summary["matrix"], out_dir, plt)
        written.append("matrix.png")
    head_sets = _head_sets(summary)
    if head_sets:
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True, layout="constrained")
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
        ("matrix.md", "\n".join(matrix_lines(summary) + baseline_lines(summary, scale)) + "\n"),
    ):
        atomic_write_text(out_dir / name, text)
    return out_dir / "report.md"
