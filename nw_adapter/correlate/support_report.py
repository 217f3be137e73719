"""The support-set report: per set, which reference wins the attention, which the theory's posterior
favours, and which the generation resembles.

Built from the per-set results of :func:`nw_adapter.analysis.support_sets.observe_support_set`
(torch-free once built, so the files redraw without a model):

- per set: the per-step readings (:func:`~nw_adapter.analysis.support_sets.support_steps`, the
  conditional half): the attention's mass per reference (averaged over layers and heads) beside the
  theory's posterior over the references *in latent space* (``w_i(x_t) = softmax_i(-||x_t - a_t
  s_i||^2 / 2 b_t^2)`` over the references' VAE latents, THEORY.md 4b), its entropy share and n_eff,
  and the learned x0's distance to the plug-in field's NW mean; the attention's winner (the largest
  mass at the last step) and the step from which it keeps the lead; the posterior's winner and its
  step; the reference nearest the generated latent; per-reference CLIP-I and the CLIP-nearest
  reference; on digits the judge's classes of the generation and of each reference;
- per group of sets (m references, classes ``same`` / ``mixed`` / ``unknown``): at the last step
  the concentration on the winner, ``(max_r share_r - 1/m) / (1 - 1/m)`` (0: even shares, 1: all on
  one reference), of the attention mass and of the latent posterior; the attention's query-row
  entropy over references and the posterior's entropy, as shares of ``log m``; the progress
  (step / last step) at which each winner is decided; each with its 95% Student t interval over the
  sets (the unit: one support set, one generation); how often the CLIP-nearest reference and the
  generated latent's nearest reference are the attention's winner, and on digits how often the
  generation's class is one of its references', with Clopper-Pearson 95% intervals.

No NW weights of the head's q/k space appear here: at the data-space bandwidth they have no unit.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "SUPPORT_SCHEMA",
    "concentration",
    "csv_rows",
    "format_document",
    "group_summary",
    "plot_set",
    "plot_sweep",
    "set_entry",
    "set_figure",
    "sweep_figure",
]

SUPPORT_SCHEMA = "nw-adapter/support-sets"
JSON_NAME, CSV_NAME, FIGURE_NAME = "support.json", "support.csv", "support_mass.png"
SUPPORT_FILES = (JSON_NAME, CSV_NAME, FIGURE_NAME, "sets")


def concentration(mass: Sequence[float], m: int) -> float:
    """``(max_r mass_r - 1/m) / (1 - 1/m)``: 0 for even shares, 1 when one reference has all the
    mass (NaN for m = 1 or no finite mass)."""
    finite = [x for x in mass if math.isfinite(x)]
    if m < 2 or not finite:
        return math.nan
    return (max(finite) - 1.0 / m) / (1.0 - 1.0 / m)


def _entropy_share(value: float, m: int) -> float:
    return value / math.log(m) if m >= 2 and math.isfinite(value) else math.nan


def _classes(labels: Sequence[Any] | None) -> str:
    if not labels:
        return "unknown"
    return "same" if len(set(labels)) == 1 else "mixed"


def set_entry(
    key: str, files: Sequence[dict[str, Any]], run: Any, generated: str, labels: Sequence[int] | None = None
) -> dict[str, Any]:
    """The JSON entry of one set from its :class:`~nw_adapter.analysis.support_sets.SupportSetRun`.

    Args:
        key: the set's name. files: per reference ``{"file", "sha256"}``, in set order.
        run: the run. generated: the generated image's path relative to ``--out``.
        labels: the references' known classes (held-out digits,
            :func:`~nw_adapter.correlate.digit_sets.known_digit_labels`); None: the judge's reading of
            the references stands in (``class_source`` says which).
    """
    from nw_adapter.analysis.support_sets import decided_step

    m = len(files)
    judged = run.judged
    classes = list(labels) if labels is not None else (None if judged is None else list(judged[1:]))
    references = [
        {**f, "clip_cosine": run.clip_cosine[i], "judged": None if judged is None else judged[i + 1],
         "label": None if labels is None else labels[i]}
        for i, f in enumerate(files)
    ]  # fmt: skip
    winner, decided = decided_step(run.steps)
    posterior_winner, posterior_decided = decided_step(run.steps, "posterior")
    last = run.steps[-1] if run.steps else None
    last_step = max(len(run.steps) - 1, 1)
    judged_generated = None if judged is None else judged[0]
    winner_class = None if classes is None or winner is None else classes[winner]
    final_nearest = run.final_nearest
    return {
        "key": key,
        "num_refs": m,
        "classes": _classes(classes),
        "class_source": "known" if labels is not None else ("judge" if judged is not None else None),
        "references": references,
        "generated": generated,
        "clip_embedding": run.clip_embedding,
        "clip_nearest": run.clip_nearest,
        "winner": winner,
        "decided_step": decided,
        "decided_progress": None if decided is None else _position(run.steps, decided) / last_step,
        "posterior_winner": posterior_winner,
        "posterior_decided_step": posterior_decided,
        "posterior_decided_progress": None
        if posterior_decided is None
        else _position(run.steps, posterior_decided) / last_step,
        "final_distances": list(run.final_distances),
        "final_nearest": final_nearest,
        "judged_generated": judged_generated,
        "clip_nearest_is_winner": None if winner is None else run.clip_nearest == winner,
        "final_nearest_is_winner": None
        if winner is None or final_nearest is None
        else final_nearest == winner,
        "class_of_winner": None
        if winner_class is None or judged is None
        else judged_generated == winner_class,
        "class_of_a_reference": None if classes is None or judged is None else judged_generated in classes,
        "final_concentration": None if last is None else concentration(last["mass"], m),
        "final_posterior_concentration": None
        if last is None
        else concentration(last.get("posterior", []), m),
        "final_row_entropy_share": None if last is None else _entropy_share(last["ref_row_entropy"], m),
        "final_posterior_entropy_share": None if last is None else last.get("posterior_entropy_share"),
        "steps": run.steps,
    }


def _position(steps: Sequence[dict[str, Any]], step: int) -> int:
    """The index of ``step`` among the recorded steps (steps of a truncated schedule start above 0)."""
    return [s["step"] for s in steps].index(step)


def csv_rows(key: str, run: Any) -> list[dict[str, Any]]:
    """``support.csv``'s rows of one set: per record of the attention (step, layer, head, CFG half:
    ``ref_mass_{r}``, ``ref_entropy``, ``ref_row_entropy``; ``source = "attention"``), then per step
    and CFG half the latent posterior (``posterior_{r}``, its entropy share, n_eff, favoured reference,
    the x0-to-NW-mean readings; ``source = "latent posterior"``)."""
    from nw_adapter.analysis.support_sets import LATENT_FIELDS
    from nw_adapter.integration.schema import SUPPORT_REFERENCES, support_columns

    rows = []
    keys = ("step", "timestep", "h_schedule", "layer", "block", "head", "half", "adapter")
    for record in run.records:
        if record.get(SUPPORT_REFERENCES) is not None:
            columns = set(support_columns(int(record[SUPPORT_REFERENCES])))
            kept = {k: record[k] for k in keys if k in record}
            kept.update({k: v for k, v in record.items() if k in columns})
            rows.append({"set": key, "source": "attention", **kept})
    for point in run.latent_steps:
        row = {"set": key, "source": "latent posterior", "step": point["step"], "half": point["half"]}
        row.update(timestep=point["timestep"], h_schedule=point["h"], num_refs=len(point["posterior"]))
        row.update({f"posterior_{r}": w for r, w in enumerate(point["posterior"])})
        row.update({name: point.get(name) for name in LATENT_FIELDS})
        rows.append(row)
    return rows


def _interval(values: Sequence[Any]) -> dict[str, Any]:
    """Mean and 95% Student t interval over sets, the interval clipped to [0, 1] (every group field is a
    share or a progress in that range)."""
    from nw_adapter.core.intervals import t_interval

    kept = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not kept:
        return {"mean": None, "low": None, "high": None, "n": 0}
    mean, low, high = t_interval(kept)
    if math.isfinite(low):
        low, high = max(low, 0.0), min(high, 1.0)
    clean = [None if not math.isfinite(x) else x for x in (mean, low, high)]
    return {"mean": clean[0], "low": clean[1], "high": clean[2], "n": len(kept)}


def _proportion(flags: Sequence[Any], chance: float | None = None) -> dict[str, Any]:
    """Count, Clopper-Pearson 95% interval and, given ``chance``, the exact one-sided binomial test
    of the proportion above it (over sets, the independent units)."""
    from scipy.stats import binomtest

    kept = [bool(f) for f in flags if f is not None]
    if not kept:
        return {"count": 0, "n": 0, "low": None, "high": None, "chance": chance, "p_above_chance": None}
    test = binomtest(sum(kept), len(kept), p=0.5 if chance is None else chance, alternative="greater")
    interval = binomtest(sum(kept), len(kept)).proportion_ci(0.95, method="exact")
    return {
        "count": sum(kept),
        "n": len(kept),
        "low": float(interval.low),
        "high": float(interval.high),
        "chance": chance,
        "p_above_chance": None if chance is None else float(test.pvalue),
    }


GROUP_FIELDS = (
    "final_concentration",
    "final_posterior_concentration",
    "final_row_entropy_share",
    "final_posterior_entropy_share",
    "decided_progress",
    "posterior_decided_progress",
)
GROUP_COUNTS = (
    "clip_nearest_is_winner",
    "final_nearest_is_winner",
    "class_of_winner",
    "class_of_a_reference",
)
#: The counts tested against the chance 1/m of picking one of m references at random (the class
#: count on mixed-class sets only).
CHANCE_COUNTS = ("clip_nearest_is_winner", "final_nearest_is_winner", "class_of_winner")


def group_summary(sets: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (m, classes) group of sets: the means with 95% t intervals over sets of
    :data:`GROUP_FIELDS` and the counts with Clopper-Pearson intervals of :data:`GROUP_COUNTS`."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for entry in sets:
        groups.setdefault((entry["num_refs"], entry["classes"]), []).append(entry)
    rows = []
    for (m, classes), members in sorted(groups.items()):
        row: dict[str, Any] = {"num_refs": m, "classes": classes, "sets": len(members)}
        row.update({name: _interval([e[name] for e in members]) for name in GROUP_FIELDS})
        for name in GROUP_COUNTS:
            # a same-class set's generation has its winner's class whenever it has any reference's
            chance = 1.0 / m if name in CHANCE_COUNTS and m >= 2 and not (
                name == "class_of_winner" and classes == "same"
            ) else None  # fmt: skip
            row[name] = _proportion([e[name] for e in members], chance)
        rows.append(row)
    return rows


def _cell(stat: dict[str, Any]) -> str:
    if stat.get("mean") is None:
        return "-"
    if stat.get("low") is None:
        return f"{stat['mean']:.3f}"
    return f"{stat['mean']:.3f} [{stat['low']:.3f}, {stat['high']:.3f}]"


def _count(stat: dict[str, Any]) -> str:
    if not stat["n"]:
        return "-"
    p = stat.get("p_above_chance")
    return f"{stat['count']}/{stat['n']}" + ("" if p is None else f" p{p:.2g}")


#: The console's group tables: (title, ((summary field, column label), ...)); the report's too.
TABLES = (
    (
        "last step",
        (
            ("final_concentration", "concentration A"),
            ("final_posterior_concentration", "concentration posterior"),
            ("final_row_entropy_share", "row entropy/log m A"),
            ("final_posterior_entropy_share", "entropy/log m posterior"),
        ),
    ),
    (
        "decided (step / last step)",
        (("decided_progress", "winner A decided"), ("posterior_decided_progress", "posterior decided")),
    ),
)


#: The console's labels of :data:`GROUP_COUNTS` (the counts table's columns).
COUNT_LABELS = ("CLIP=winner", "latent=winner", "class=winner", "class in refs")

HEADER = (
    "support sets (cond half; A = attention mass per reference, means over layers and heads; posterior = "
    "the theory's w_i(x_t) over the references' latents, in the space of x_t)"
)
"""The first line of the terminal report: what A and the posterior are."""

LEGEND = (
    "concentration = (largest share - 1/m) / (1 - 1/m) at the last step (0 even, 1 one reference); "
    "[95% t interval over sets, clipped to [0, 1]]; CLIP=winner / latent=winner: sets whose CLIP-nearest "
    "reference / whose generated latent's nearest reference is the attention's winner; class=winner: "
    "whose generation the judge gives the winner's class; p: exact one-sided binomial test over sets "
    "against chance 1/m"
)
"""The last line of the terminal report: the legend of its tables."""

READINGS = {
    "winner A": "the reference of the largest attention mass at the last step; 'from step s': the first step "
    "from which it keeps the lead to the end",
    "posterior winner": "the reference the latent posterior favours at the last step, and the step from "
    "which it keeps the lead",
    "generated latent nearest": "the reference whose VAE latent is nearest the generated latent (the "
    "distances in brackets)",
    "CLIP-I": "cosine of the generation's and the reference's embeddings in the pipeline's image encoder; "
    "nearest: the largest",
    "row entropy/log m A": "each query row's entropy over references, averaged over rows, as a share of "
    "log m",
    "entropy/log m posterior": "the latent posterior's entropy over references as a share of log m; n_eff = "
    "1 / sum_i w_i^2, from 1 (one reference) to m (even)",
    "x0 / NW mean": "||x0 - m_h|| / ||x0 - mean of the references||: the learned denoiser's x0 estimate "
    "against the plug-in field's (the posterior's NW mean m_h = sum_i w_i s_i); 0: the model is the "
    "plug-in, 1 by construction wherever the posterior is even",
}
"""The per-set readings, in the words of the terminal report's set lines (the HTML report's legend)."""


BRIEF_LEGEND = (
    "concentration = (largest share - 1/m) / (1 - 1/m) at the last step (0 even, 1 one reference); "
    "[95% t interval over sets]; p: exact one-sided binomial test over sets against chance 1/m"
)
"""The legend of the brief terminal report: the tables' terms a reader needs first (:data:`LEGEND`
with ``-v``)."""


def _set_line(e: dict[str, Any]) -> str:
    clip = ", ".join(f"{r['clip_cosine']:.3f}" for r in e["references"])
    shown = [r["label"] if r.get("label") is not None else r["judged"] for r in e["references"]]
    classes = (
        ""
        if e["judged_generated"] is None
        else f"; classes refs {shown} -> generated {e['judged_generated']}"
    )
    final = e["steps"][-1] if e["steps"] else None
    mass = ""
    if final is not None:
        shares = [[round(x, 3) for x in final.get(key, [])] for key in ("mass", "posterior")]
        mass = f"; last step A {shares[0]} posterior {shares[1]}"
    distances = ", ".join(f"{d:.2f}" for d in e.get("final_distances", []))
    return (
        f"  {e['key']} (m={e['num_refs']}, {e['classes']}): winner A {e['winner']} from step "
        f"{e['decided_step']}, posterior {e['posterior_winner']} from step "
        f"{e['posterior_decided_step']}; "
        f"generated latent nearest {e['final_nearest']} [{distances}]; CLIP-I [{clip}] nearest "
        f"{e['clip_nearest']}{mass}{classes}"
    )


def format_document(
    document: dict[str, Any], *, detail: bool = True, out_dir: str | os.PathLike | None = None
) -> str:
    """The terminal report: with ``detail`` (``-v``) one line per set, then the groups' tables and their
    legend (:data:`LEGEND`); without it (one screen) the groups' tables, their brief legend
    (:data:`BRIEF_LEGEND`) and a last line saying where the per-set readings are (``out_dir``'s
    ``report.html``, ``support.json`` / ``support.csv``)."""
    lines = [HEADER]
    if detail:
        lines += [_set_line(e) for e in document["sets"]]
    gap = [""] if detail else []
    for title, columns in TABLES:
        lines += [*gap, f"{title}:"]
        lines.append(
            f"{'m':>2} {'classes':<8} {'sets':>4}  " + " ".join(f"{label:<26}" for _, label in columns)
        )
        for row in document["summary"]:
            lines.append(
                f"{row['num_refs']:>2} {row['classes']:<8} {row['sets']:>4}  "
                + " ".join(f"{_cell(row[name]):<26}" for name, _ in columns)
            )
    lines += [*gap, "counts over sets:"]
    lines.append(
        f"{'m':>2} {'classes':<8} {'sets':>4}  " + " ".join(f"{label:>15}" for label in COUNT_LABELS)
    )
    for row in document["summary"]:
        lines.append(
            f"{row['num_refs']:>2} {row['classes']:<8} {row['sets']:>4}  "
            + " ".join(f"{_count(row[name]):>15}" for name in GROUP_COUNTS)
        )
    if detail:
        lines.append(LEGEND)
        return "\n".join(lines)
    report = "report.html" if out_dir is None else str(Path(out_dir) / "report.html")
    sets = len(document["sets"])
    lines += [
        BRIEF_LEGEND,
        f"details: -v prints every set's readings ({sets} set(s)) and the full legend; open {report} in a "
        "browser (offline: each set's attention mass beside its latent posterior); every set in "
        "support.json / support.csv",
    ]
    return "\n".join(lines)


# --- figures --------------------------------------------------------------------------------


def _progress(steps: Sequence[dict[str, Any]]) -> np.ndarray:
    last = max(len(steps) - 1, 1)
    return np.array([s["step"] / last for s in steps])


def plot_set(entry: dict[str, Any], path: str | os.PathLike, *, title: str | None = None) -> Path | None:
    """Write :func:`set_figure` to ``path`` (PNG, atomically); None (nothing written) for m = 1."""
    from nw_adapter.analysis.records import save_figure

    fig = set_figure(entry, title=title)
    return None if fig is None else save_figure(fig, path)


def set_figure(entry: dict[str, Any], *, title: str | None = None):
    """One set's per-reference shares over denoising: the attention's mass (solid) beside the theory's
    posterior over the references' latents (dashed), one colour per reference; 3.5 in wide. None for
    m = 1."""
    from matplotlib.figure import Figure

    from nw_adapter.analysis.records import wrap_title

    steps = entry["steps"]
    if not steps:
        return None
    fig = Figure(figsize=(3.5, 2.8), layout="constrained")
    ax = fig.subplots()
    x = _progress(steps)
    for r in range(entry["num_refs"]):
        color = f"C{r}"
        name = Path(entry["references"][r]["file"]).name
        ax.plot(x, [s["mass"][r] for s in steps], color=color, linewidth=1.2, label=f"{r}: {name}, attention")
        if all("posterior" in s for s in steps):
            ax.plot(x, [s["posterior"][r] for s in steps], color=color, linewidth=1.0, linestyle="--",
                    label=f"{r}: latent posterior")  # fmt: skip
    ax.axhline(1.0 / entry["num_refs"], color="0.5", linestyle=":", linewidth=0.8, label="1/m, an even share")
    ax.set_xlabel("denoising progress (step / last step)", fontsize=8)
    ax.set_ylabel("share of reference", fontsize=8)
    ax.set_ylim(-0.02, 1.02)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", fontsize=6, frameon=False, ncol=2)
    if title:
        fig.suptitle(wrap_title(title, 3.3, 8), fontsize=8)
    return fig


def _band(ax: Any, x: np.ndarray, per_set: np.ndarray, color: str, style: str, label: str) -> None:
    """Mean over sets with its 95% t band (two or more sets), clipped to [0, 1] as the table's
    intervals are (every value drawn is a share)."""
    from nw_adapter.core.intervals import t_interval

    stats = np.array([t_interval(column[np.isfinite(column)]) if np.isfinite(column).any()
                      else (math.nan,) * 3 for column in per_set.T])  # fmt: skip
    stats[:, 1:] = np.clip(stats[:, 1:], 0.0, 1.0)
    ax.plot(x, stats[:, 0], color=color, linestyle=style, linewidth=1.1, label=label)
    if per_set.shape[0] >= 2:
        ax.fill_between(x, stats[:, 1], stats[:, 2], color=color, alpha=0.18 if style == "-" else 0.08,
                        linewidth=0)  # fmt: skip


def plot_sweep(document: dict[str, Any], path: str | os.PathLike, *, title: str | None = None) -> Path | None:
    """Write :func:`sweep_figure` to ``path`` (PNG, atomically); None (nothing written) without a set of
    m >= 2."""
    from nw_adapter.analysis.records import save_figure

    fig = sweep_figure(document, title=title)
    return None if fig is None else save_figure(fig, path)


def sweep_figure(document: dict[str, Any], *, title: str | None = None):
    """The support-set figure: per group of sets (m, classes), over denoising, (a) the concentration
    on the leading reference, ``(max_r share_r - 1/m) / (1 - 1/m)`` (:func:`concentration`), and (b)
    the entropy over references as a share of log m (the attention's query rows; the posterior's);
    the attention mass solid, the theory's latent posterior dashed, 95% t bands over sets (two or
    more; clipped to [0, 1]). 3.5 in wide. None when no set has m >= 2."""
    from matplotlib.figure import Figure

    from nw_adapter.analysis.records import wrap_title

    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for e in document["sets"]:
        if e["num_refs"] >= 2 and e["steps"]:
            groups.setdefault((e["num_refs"], e["classes"]), []).append(e)
    if not groups:
        return None
    fig = Figure(figsize=(3.5, 5.4), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    for g, ((m, classes), members) in enumerate(sorted(groups.items())):
        length = min(len(e["steps"]) for e in members)
        x = _progress(members[0]["steps"][:length])
        color = f"C{g}"
        label = f"m={m}, {classes} ({len(members)} set{'s' if len(members) > 1 else ''})"
        arms = [("mass", "ref_row_entropy", "-", "attention")]  # mass: the attention's max share
        if all("posterior" in s for e in members for s in e["steps"][:length]):
            arms.append(("posterior", "posterior_entropy_share", "--", "latent posterior"))
        for key, entropy_key, style, arm in arms:
            conc = np.array([[concentration(s[key], m) for s in e["steps"][:length]] for e in members])
            _band(top, x, conc, color, style, f"{label}: {arm}")
            scale = math.log(m) if key == "mass" else 1.0  # the posterior's entropy is stored as a share
            share = np.array(
                [[_number(s[entropy_key]) / scale for s in e["steps"][:length]] for e in members]
            )
            _band(bottom, x, share, color, style, f"{label}: {arm}")
    top.set_ylabel("concentration\n(max share - 1/m) / (1 - 1/m)", fontsize=7)
    bottom.set_ylabel("entropy over\nreferences / log m", fontsize=7)
    bottom.set_xlabel("denoising progress (step / last step)", fontsize=8)
    for ax in (top, bottom):
        ax.set_ylim(-0.05, 1.05)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    handles, labels = top.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", fontsize=6, frameon=False, ncol=1)
    if title:
        fig.suptitle(wrap_title(title, 3.3, 8), fontsize=8)
    return fig


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)
