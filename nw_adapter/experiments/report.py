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
from nw_adapter.experiments.aggregate import COVERAGE_REPS as COVERAGE_SAMPLES
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
    if math.isnan(lo) or math.isnan(hi):
        return "n/a"
    if math.isinf(lo) or math.isinf(hi):
        return "unbounded"
    return f"[{100 * lo:+.0f}%, {100 * hi:+.0f}%]"


def _diff_ci(x: float, ci) -> str:
    """A difference of MMD^2 with its t interval, in units of 1e-3."""
    lo, hi = ci
    return f"{1e3 * x:+.2f} [{1e3 * lo:+.2f}, {1e3 * hi:+.2f}]" if math.isfinite(lo) else f"{1e3 * x:+.2f}"


def paper_lines(summary: dict) -> list[str]:
    """The paper-vs-project table that opens the report, and the intervals' measured coverage."""
    rows = summary.get("paper_table") or []
    lines = []
    if rows:
        lines += [
            "## The paper beside this run",
            "",
            "Regenerated from this run's results. 'yes' = the project's 95% interval lies inside the "
            "band that counts as the paper's value (+-10 percentage points; a factor of 1.5 for a "
            "ratio); 'too wide to tell' = the interval holds the paper's value but reaches "
            "beyond that band, so the run cannot say it reproduces it; 'no conclusion' = the learned OFF "
            "model is not a fair baseline there (not at least as good as the training-free plug-in on its "
            "own training distribution), so its comparison says nothing.",
            "",
            "| paper | claim | project (95% interval) | same quantity? | reproduces? |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['paper']} | {r['claim']} | {r['project']} | {r['same']} | {r['reproduces']} |"
            for r in rows
        ]
        lines.append("")
    cov = summary.get("coverage") or []
    if cov:
        low = min(c["coverage"] for c in cov)
        lines += [
            "Intervals: Student t (differences) and Fieller (ratios) over the independent units, no "
            "bootstrap. Their coverage at this run's own unit counts, measured by drawing as many units "
            "with replacement from the run's units (taken as the population) "
            f"{COVERAGE_SAMPLES} times: lowest {100 * low:.1f}% at nominal 95% ("
            + "; ".join(
                f"{c['quantity']}, n = {c['n']} {c['units']}: {100 * c['coverage']:.1f}%" for c in cov
            )
            + "). The check is pessimistic (from a sample of 10 normal units it reads 94% on average, 92% "
            "at its 10th percentile); a value well below that flags units far from normal (one outlying "
            "class or task), where no interval over that few units holds its level. The simulated coverage "
            "at the runs' unit counts is in docs/experiments.md.",
            "",
        ]
    return lines


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
        *paper_lines(summary),
    ]
    if "dims" in summary:
        lines += [
            "## Nearest-neighbour collapse (Gaussian mixtures, dimension sweep)",
            "",
            f"Paper: {PAPER['dims']['text']}.",
            "",
            "benefit = (MMD^2 OFF - MMD^2 ON) / MMD^2 OFF with its 95% Fieller interval over the "
            "evaluation tasks (independent draws from the family; seeds averaged first, so conditional on "
            "the trained models; unbounded when OFF's MMD^2 is not distinguishable from 0); OFF - ON = the "
            "same comparison as a difference of MMD^2 (x 1e-3, t interval over tasks). p seeds: paired "
            "t-test over training seeds (n = seeds); p tasks: Wilcoxon signed-rank test over the tasks. "
            "OFF fair? = the OFF model is at least as good as the plug-in within 10% (upper end of the 95% "
            "interval of its MMD^2 excess over the plug-in below +10%); where it is not, the benefit is "
            "measured against a baseline worse than the training-free field and no conclusion is drawn.",
            "",
            "| d | n_eff | paper n_eff | MMD^2 plug-in | MMD^2 OFF | OFF fair? (excess) | MMD^2 ON | benefit "
            "| 95% interval | OFF - ON (1e-3) | benefit (fixed) | paper benefit | p seeds (t) "
            "| p tasks (Wilcoxon) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in summary["dims"]["rows"]:
            lines.append(
                f"| {r['d']} | {_fmt(r['neff'], '.2f')} | {_fmt(r['paper_neff'], '.0f')} | "
                f"{_fmt(r['mmd2_plugin'])} | {_fmt(r['mmd2_off'])} "
                f"| {'yes' if r['fair']['fair'] else 'no'} ({_pct(r['fair']['excess'])} "
                f"{_pct_ci(r['fair']['excess_ci'])}) "
                f"| {_fmt(r['mmd2_on'])} | {_pct(r['benefit'])} | {_pct_ci(r['benefit_ci'])} | "
                f"{_diff_ci(r['diff_off_on'], r['diff_off_on_ci'])} | "
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
            "Ratio interval: 95% Fieller interval over the evaluation tasks (seeds averaged first); "
            "plug-in - learned = the same comparison as a difference (x 1e-3, t interval over tasks). "
            "p seeds: paired t-test of the plug-in's mean against each seed's (n = seeds); p tasks: "
            "Wilcoxon signed-rank over tasks.",
            "",
            "| d | MMD^2 learned | MMD^2 learned ON | MMD^2 plug-in | plug-in / learned | 95% interval "
            "| plug-in - learned (1e-3) | same, fixed sigma | paper ratio | n_eff | p seeds (t) "
            "| p tasks (Wilcoxon) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in summary["shells"]["rows"]:
            lines.append(
                f"| {r['d']} | {_fmt(r['mmd2_learned'])} | {_fmt(r.get('mmd2_on'))} | "
                f"{_fmt(r['mmd2_plugin'])} | {_fmt(r['ratio'], '.1f')}x | "
                f"[{_fmt(r['ratio_ci'][0], '.1f')}, {_fmt(r['ratio_ci'][1], '.1f')}] | "
                f"{_diff_ci(r['diff'], r['diff_ci'])} | "
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
            f"Paper: {PAPER['digits']['text']}. Here: {source}, in {data.get('num_folds')} cross-validated "
            "class folds: fold k tests every "
            f"{data.get('num_folds')}-th class (test classes over all folds: {data.get('test_classes')}) and "
            "fits its PCA to 16 d, the standardisation, the learned models and the amortised tau on the "
            "other classes only (explained variance per fold "
            f"{', '.join(_fmt(v, '.2f') for v in data.get('explained_variance') or [])}); "
            f"{data.get('tasks_per_class')} tasks per test class (each task: a random support and disjoint "
            "held-out points of one class); supports nested across m.",
            "",
            "Tasks of one class share most of their points, so they are not independent: the independent "
            "units are the classes, every one of them a test class once. The advantage interval is Fieller's "
            "over the class means (seeds averaged first); plug-in - learned = the same as a difference "
            "(x 1e-3, t interval over classes); p classes: paired t-test over the class means (n = classes); "
            "p seeds: paired t-test of the plug-in's mean against each seed's (n = seeds; conditional on "
            "these classes). No test over tasks is reported (it would be pseudo-replicated: its p-value "
            "shrinks with the number of tasks drawn per class). Classes of one fold share its models.",
            "",
            "| m | MMD^2 learned | MMD^2 plug-in | learned advantage | 95% interval "
            "| plug-in - learned (1e-3) | classes won by learned | same, fixed sigma | paper | n_eff "
            "| p classes (t) | p seeds (t) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in summary["digits"]["rows"]:
            lines.append(
                f"| {r['m']} | {_fmt(r['mmd2_learned'])} | "
                f"{_fmt(r['mmd2_plugin'])} | {_pct(r['advantage'])} | {_pct_ci(r['advantage_ci'])} | "
                f"{_diff_ci(r['diff'], r['diff_ci'])} | "
                f"{sum(a > 0 for a in r.get('advantage_per_class', []))} / "
                f"{len(r.get('advantage_per_class', []))} | "
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
        seeds = max((h.get("seeds", 1) for _, rows in head_sets for h in rows), default=1)
        lines += [
            "",
            "![heads](heads.png)",
            "",
            "heads.png: the table's rho head and rho data per t as points; bars = 95% Student t interval "
            f"over the {seeds} training seed{'s' if seeds != 1 else ''} (the unit: each seed's mean over "
            "its layers and heads and the analysed tasks; layers and heads of one model are not independent)"
            + (", wide with 1 degree of freedom" if seeds == 2 else "")
            + ("" if seeds >= 2 else ": with one seed no interval is drawn (not identified)")
            + ".",
            "",
        ]
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
        "above 0 (also shown where there is no gap). 95% Fieller interval over the independent units "
        "(tasks on synthetic families, classes on features; seeds averaged first) of the paired "
        "differences plug-in - method and plug-in - OFF: it carries the gap's own uncertainty and is "
        "'unbounded' where the gap is not clearly non-zero. Bold = the "
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
        "| MMD^2 of each field (smooth. / local / proj. / amort.) | "
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
    ]
    return lines


def baseline_lines(summary: dict, scale: Scale) -> list[str]:
    """The learned baseline's convergence table (the one meaning of "converged")."""
    rows = summary.get("baseline") or []
    if not rows:
        return []
    lines = [
        "## The learned baseline: converged and fair",
        "",
        "Converged (the one meaning of the word in this report; nw_adapter.experiments.training."
        "loss_plateau): every step draws new tasks, so the per-step loss is a held-out loss; over the last "
        "20% of steps a least-squares line is fitted, and a model has converged when the one-sided 95% "
        "upper bound of its fitted decrease over that window is below 2% of the loss. It fails for a loss "
        "still falling and for one too noisy to tell. 'drop' = the fitted decrease relative to the mean "
        "loss (+ = still falling) and its upper bound, per model (seed; fold on features). Fair baseline "
        "(a separate condition, in the regime tables): at least as good as the plug-in within 10% on its "
        "own training distribution.",
        "",
        "| regime | setting | variant | steps | models converged | drop (upper bound) per model "
        "| final loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        drops = ", ".join(
            f"{100 * d:+.1f}% ({100 * u:+.1f}%)" if math.isfinite(d) else "n/a"
            for d, u in zip(r["drop"], r["drop_upper"], strict=True)
        )
        lines.append(
            f"| {r['regime']} | {r['setting']} | {r['variant']} | {r['steps']} | {r['converged']} / "
            f"{r['models']} | {drops} | {_fmt(r['loss_last'], '.4f')} |"
        )
    bad = [f"{r['regime']} {r['setting']} {r['variant']}" for r in rows if r["converged"] < r["models"]]
    lines += [
        "",
        (
            "Not every model has converged at: " + "; ".join(bad) + ". "
            if bad
            else "Every model has converged. "
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
        + ". Tests over a few seeds have little power: a p-value above 0.05 there is no evidence "
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


FIGURE_DPI = 300
"""Resolution of the PNGs: print quality at the figures' width (3.5 in a column, 7 in a page)."""

COLUMN, PAGE = 3.5, 7.0
"""A paper's column and full width, in inches."""


def _save_fig(fig, path: Path) -> None:
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=FIGURE_DPI))


def _style(ax, *, xlabel: str = "", ylabel: str = "", title: str = "") -> None:
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    if title:
        ax.set_title(title, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def _errors(means, cis, scale: float = 1.0) -> np.ndarray:
    """``[2, n]`` distances below and above each mean of its interval (NaN interval: none drawn)."""
    means = np.asarray(means, dtype=np.float64) * scale
    lo = np.array([math.nan if c is None else c[0] for c in cis], dtype=np.float64) * scale
    hi = np.array([math.nan if c is None else c[1] for c in cis], dtype=np.float64) * scale
    return np.nan_to_num(np.vstack([means - lo, hi - means]), nan=0.0, posinf=0.0, neginf=0.0).clip(min=0.0)


def _paper_points(ax, xs, values: dict, *, scale: float = 1.0, offset: float = 1.0) -> None:
    """The paper's numbers as open squares at the same x (no line: they are not a series)."""
    kept = [(x, values[x]) for x in xs if values.get(x) is not None]
    if kept:
        ax.plot(
            [x * offset for x, _ in kept],
            [scale * v for _, v in kept],
            "s",
            mfc="none",
            color="k",
            markersize=4,
            linestyle="None",
            label="paper",
        )


def _legend_below(ax) -> None:
    """The axes' legend under its x label (clear of the data and of reference lines)."""
    ax.legend(fontsize=6, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=1)


def _log2_ticks(ax, xs) -> None:
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(min(xs) / 1.6, max(xs) * 1.6)


def dims_figure(rows: list[dict]):
    """``dims.png``: plug-in n_eff and the exact head's benefit per dimension d, as points with
    their 95% intervals (no line: two or three d values are not a curve).

    Left: the plug-in's n_eff at t = 0.56, mean and Student t interval over tasks (``neff_ci``).
    Right: the benefit of the exact NW head as input (learned ON vs OFF, median-sigma MMD^2),
    with its bootstrap interval over seeds and tasks (``benefit_ci``); the fixed-sigma benefit as
    a second point. The paper's values are open squares. 7 in wide.
    """
    from matplotlib.figure import Figure

    ds = [r["d"] for r in rows]
    fig = Figure(figsize=(PAGE, 3.0), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.errorbar(
        ds,
        [r["neff"] for r in rows],
        yerr=_errors([r["neff"] for r in rows], [r.get("neff_ci") for r in rows]),
        fmt="o",
        color="C0",
        capsize=3,
        markersize=4,
        label="ours (plug-in, 95% t interval over tasks)",
    )
    _paper_points(left, ds, PAPER["dims"]["neff"], offset=1.12)
    _style(left, xlabel="dimension d", ylabel="n_eff at t = 0.56", title="nearest-neighbour collapse")
    seeds = max((r.get("seeds", 0) for r in rows), default=0)
    right.errorbar(
        ds,
        [100 * r["benefit"] for r in rows],
        yerr=_errors([r["benefit"] for r in rows], [r.get("benefit_ci") for r in rows], 100),
        fmt="o",
        color="C0",
        capsize=3,
        markersize=4,
        label=f"ours, median sigma (95% Fieller interval over tasks; seeds averaged: {seeds})",
    )
    right.plot(
        [d / 1.12 for d in ds],
        [100 * r["benefit_fixed"] for r in rows],
        "^",
        color="C1",
        markersize=4,
        linestyle="None",
        label="ours, fixed sigma",
    )
    _paper_points(right, ds, PAPER["dims"]["benefit"], scale=100, offset=1.12)
    right.axhline(0, color="0.4", lw=0.6)
    _style(
        right, xlabel="dimension d", ylabel="benefit of the exact head (%)", title="benefit of the NW head"
    )
    for ax in (left, right):
        _log2_ticks(ax, ds)
        _legend_below(ax)
    return fig


def shells_figure(rows: list[dict]):
    """``shells.png``: plug-in MMD^2 / learned MMD^2 per dimension, a point with its 95% bootstrap
    interval over seeds and tasks (``ratio_ci``); above 1 the learned model matches the shells
    better. The paper's ratios are open squares. 3.5 in wide."""
    from matplotlib.figure import Figure

    ds = [r["d"] for r in rows]
    fig = Figure(figsize=(COLUMN, 3.0), layout="constrained")
    ax = fig.subplots()
    seeds = max((r.get("seeds", 0) for r in rows), default=0)
    ax.errorbar(
        ds,
        [r["ratio"] for r in rows],
        yerr=_errors([r["ratio"] for r in rows], [r.get("ratio_ci") for r in rows]),
        fmt="o",
        color="C0",
        capsize=3,
        markersize=4,
        label=f"ours (95% Fieller interval over tasks; seeds averaged: {seeds})",
    )
    _paper_points(ax, ds, PAPER["shells"]["ratio"], offset=1.12)
    ax.axhline(1.0, color="0.4", lw=0.6)
    ax.set_yscale("log")
    _log2_ticks(ax, ds)
    _style(
        ax,
        xlabel="dimension d",
        ylabel="MMD^2 plug-in / MMD^2 learned",
        title="shells: geometry mismatch (> 1: learned better)",
    )
    _legend_below(ax)
    return fig


def digits_figure(rows: list[dict]):
    """``digits.png``: MMD^2 of the learned model and the plug-in against the support size m, as
    points with the 95% Student t interval of log MMD^2 over the classes (a geometric interval,
    above 0 as MMD^2 is; only the mean where per-class values are missing), and the learned model's
    advantage with its Fieller interval over the classes (``advantage_ci``; an unbounded interval is
    drawn as an open marker without bars). 7 in wide."""
    from matplotlib.figure import Figure

    from nw_adapter.core.intervals import t_interval

    ms = [r["m"] for r in rows]
    fig = Figure(figsize=(PAGE, 3.0), layout="constrained")
    left, right = fig.subplots(1, 2)
    arms = (("learned", "learned", "C0", "o", 1 / 1.08), ("plugin", "plug-in NW", "C1", "s", 1.08))
    classes = 0
    for key, label, colour, marker, offset in arms:
        means = np.array([r[f"mmd2_{key}"] for r in rows])
        per_class = [r.get(f"mmd2_{key}_per_class") for r in rows]
        cis = [None] * len(rows)
        if all(v is not None and len(v) >= 2 and min(v) > 0 for v in per_class):
            classes = len(per_class[0])
            # on log MMD^2 (a positive quantity on a log axis): a geometric interval that stays above 0
            cis = [tuple(np.exp(t_interval(np.log(v))[1:])) for v in per_class]
        left.errorbar(
            [m * offset for m in ms],
            means,
            yerr=_errors(means, cis),
            fmt=marker,
            color=colour,
            capsize=2,
            markersize=3,
            linestyle="None",
            label=f"{label} (95% t interval, {classes} classes, log)" if classes else label,
        )
    left.set_xscale("log")
    left.set_yscale("log")
    _style(left, xlabel="support size m", ylabel="MMD^2", title="support scarcity: MMD^2 per method")
    adv = np.array([r["advantage"] for r in rows])
    cis = [r.get("advantage_ci") for r in rows]
    bounded = np.array([c is not None and all(math.isfinite(v) for v in c) for c in cis])
    right.errorbar(
        np.array(ms)[bounded],
        100 * adv[bounded],
        yerr=_errors(adv[bounded], [c for c, b in zip(cis, bounded, strict=True) if b], 100),
        fmt="o",
        color="C0",
        capsize=3,
        markersize=4,
        linestyle="None",
        label="ours (95% Fieller interval over classes)",
    )
    if (~bounded).any():
        right.plot(
            np.array(ms)[~bounded],
            100 * adv[~bounded],
            "o",
            mfc="none",
            color="C0",
            markersize=4,
            linestyle="None",
            label="ours, interval unbounded",
        )
    _paper_points(right, ms, PAPER["digits"]["advantage"], scale=100, offset=1.12)
    right.axhline(0, color="0.4", lw=0.6)
    right.set_xscale("log")
    _style(
        right,
        xlabel="support size m",
        ylabel="advantage of learned (%)",
        title="learned vs plug-in: relative advantage",
    )
    for ax in (left, right):
        from matplotlib.ticker import NullFormatter

        ax.set_xticks(ms, [str(m) for m in ms])
        ax.xaxis.set_minor_formatter(NullFormatter())
        _legend_below(ax)
    return fig


HEAD_DODGE = 0.015
"""Half-width in t over which the series of ``heads.png`` are spread so their bars stay apart."""


def heads_figure(head_sets: list[tuple[str, list[dict]]]):
    """``heads.png``: rho per t of the trained heads (filled circles) and the untrained baseline
    (crosses), head space (left) and data space (right), one colour per sub-experiment, as points
    with their 95% Student t interval over training seeds (``<key>_ci`` of each row, the mean over
    a model's layers and heads being one value per seed; no bar where it is NaN, i.e. one seed).
    No line joins the t values; the series are spread over +- ``HEAD_DODGE`` in t around the
    measured t so that their bars do not cover each other. 7 in wide."""
    from matplotlib.figure import Figure
    from matplotlib.legend_handler import HandlerTuple

    fig = Figure(figsize=(PAGE, 3.3), layout="constrained")
    left, right = fig.subplots(1, 2, sharey=True)
    handles, labels = [], []
    series = 2 * len(head_sets)
    shifts = np.linspace(-HEAD_DODGE, HEAD_DODGE, series) if series > 1 else np.zeros(1)
    seeds = max((h.get("seeds", 1) for _, rows in head_sets for h in rows), default=1)
    for i, (label, rows) in enumerate(head_sets):
        ts, colour = np.array([h["t"] for h in rows]), f"C{i % 10}"
        drawn = []
        for ax, key in ((left, "rho_head"), (right, "rho_data")):
            drawn = []  # the legend shows the right panel's markers (the same styles as the left)
            for j, (name, marker) in enumerate(((key, "o"), (f"untrained_{key}", "x"))):
                means = [h[name] for h in rows]
                yerr = _errors(means, [h.get(f"{name}_ci") for h in rows])
                bars = ax.errorbar(
                    ts + shifts[2 * i + j],
                    means,
                    yerr=yerr,
                    fmt=marker,
                    color=colour,
                    markersize=3,
                    capsize=1.5,
                    elinewidth=0.7,
                    linestyle="None",
                )
                drawn.append(bars[0])
        handles.append(tuple(drawn))
        labels.append(label)
    _style(left, xlabel="t", ylabel="Spearman rho", title="head space, matched h (high by algebra)")
    _style(right, xlabel="t", title="data space, exact posterior")
    interval = (
        f"bars: 95% t interval over {seeds} training seeds (each the mean of its layers and heads)"
        if seeds >= 2
        else "one training seed: no interval (not identified)"
    )
    fig.legend(
        handles,
        labels,
        handler_map={tuple: HandlerTuple(ndivide=None, pad=0.6)},
        loc="outside lower center",
        ncol=min(4, len(labels)),
        fontsize=7,
        frameon=False,
        title=f"each colour: trained (o) | untrained baseline (x); {interval}\n"
        f"(points spread over +-{HEAD_DODGE} in t around the measured t)",
        title_fontsize=6,
    )
    return fig


def _plots(summary: dict, out_dir: Path) -> list[str]:
    figures = []
    if summary.get("dims", {}).get("rows"):
        figures.append(("dims.png", dims_figure(summary["dims"]["rows"])))
    if summary.get("shells", {}).get("rows"):
        figures.append(("shells.png", shells_figure(summary["shells"]["rows"])))
    if summary.get("digits", {}).get("rows"):
        figures.append(("digits.png", digits_figure(summary["digits"]["rows"])))
    head_sets = _head_sets(summary)
    if head_sets:
        figures.append(("heads.png", heads_figure(head_sets)))
    for name, fig in figures:
        _save_fig(fig, out_dir / name)
    return [name for name, _ in figures]


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
