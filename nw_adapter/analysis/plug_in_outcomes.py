"""The paper's scarcity claim by outcome, in a diffusers pipeline: learned adapter against plug-in field.

For each support set (m reference images) and seed, four arms are compared on the same pipeline:

- ``learned``: the stock pipeline conditioned on the set through its IP-Adapter
  (:func:`~nw_adapter.analysis.support_sets.observe_support_set`, so its attention, the latent
  posterior and the learned x0 against the plug-in's NW mean are read on the way);
- ``plug-in``: the exact field of the empirical target on the references' latents
  (:func:`~nw_adapter.integration.nw_field.plug_in_field`): at h -> 0 it copies a reference;
- ``plug-in, tau fitted``: the exact field of the smoothed support ``(1/m) sum_i N(s_i, tau^2 I)``
  with one tau per (m, kind) fitted on *training* tasks by held-out likelihood
  (:func:`~nw_adapter.core.smoothed_fields.fit_shared_tau`, the amortised bandwidth of THEORY.md 5);
- ``held-out data``: real images of the set's classes that are in no set (the control: what a new
  sample of the class scores on the distances below).

Per set (the unit; its seeds averaged): the share of generations whose class the judge reads as the
set's (same-class sets) or as one of the set's classes (mixed sets); the diversity across seeds
(mean pairwise distance of the generated latents); the distance of each generated latent to the
nearest reference latent. Latent units throughout: the space of x_t, where the plug-in's support
lives. Per (m, kind, arm) the mean and 95% Student t interval over sets, and per arm its paired
difference from the learned adapter over the same sets.

What this tests of the paper's scarcity regime (THEORY.md 5: at small m the plug-in reproduces its
support, a learned model generalises; amortised smoothing closes part of the gap): whether, at
m = 1..8, the plug-in copies (nearest distance at the scheduler's residual noise, diversity bounded
by m), the learned adapter produces new samples of the class, and a tau fitted on training tasks
moves the plug-in towards the held-out data. What differs from the paper: digit VAE latents (256
numbers) instead of DINOv2 features in 16 PCA dimensions, a trained IP-Adapter instead of an ICFM
transformer, and class / diversity / copy readings instead of MMD^2 to held-out samples (a few seeds
per set give no usable MMD).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nw_adapter.integration.latent_support import encode_references, flatten_states
from nw_adapter.integration.nw_field import plug_in_field

__all__ = [
    "ARMS",
    "OutcomeSet",
    "fit_tau",
    "outcome_figure",
    "paired_differences",
    "run_set",
    "set_metrics",
    "summarise",
    "x0_figure",
    "x0_table",
]

ARMS = ("learned", "plug-in", "plug-in, tau fitted", "held-out data")
METRICS = ("class_kept", "diversity", "nearest")
METRIC_LABELS = {
    "class_kept": "class kept\n(share of seeds)",
    "diversity": "diversity across seeds\n(latent units)",
    "nearest": "distance to the nearest\nreference (latent units)",
}


@dataclass(frozen=True)
class OutcomeSet:
    """One support set and its held-out control.

    Attributes:
        key: its name. kind: ``"same"`` (one class) or ``"mixed"`` (m classes).
        images: the m reference images (PIL). labels: their classes.
        heldout: real images of the set's classes in no set (as many as seeds), the control arm.
    """

    key: str
    kind: str
    images: list[Any]
    labels: list[int]
    heldout: list[Any]

    @property
    def m(self) -> int:
        return len(self.images)


def fit_tau(pipe: Any, tasks: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> float:
    """tau for the smoothed support, fitted once on training tasks (held-out likelihood).

    Args:
        pipe: the pipeline whose VAE defines the latent space.
        tasks: ``(support images, held-out images)`` per training task, equal sizes across tasks.

    Returns:
        :func:`~nw_adapter.core.smoothed_fields.fit_shared_tau` of the tasks' latents.
    """
    from nw_adapter.core.smoothed_fields import fit_shared_tau

    support = torch.stack([flatten_states(encode_references(pipe, s)) for s, _ in tasks])
    heldout = torch.stack([flatten_states(encode_references(pipe, h)) for _, h in tasks])
    return fit_shared_tau(support, heldout)


def _field_generation(pipe: Any, support: torch.Tensor, seed: int, tau: float, call: dict[str, Any]):
    """One generation of the (smoothed) plug-in field: ``(image, latent [D])``."""
    kept: dict[str, torch.Tensor] = {}

    def capture(_pipe: Any, _step: int, _t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        kept["latents"] = tensors["latents"].detach()
        return {}

    with plug_in_field(pipe, support, tau=tau):
        generator = torch.Generator(pipe.device).manual_seed(seed)
        out = pipe(generator=generator, callback_on_step_end=capture, **call)
    return out.images[0], flatten_states(kept["latents"]).to(torch.float64)[0]


def set_metrics(
    latents: torch.Tensor, support: torch.Tensor, kept: Sequence[bool | None]
) -> dict[str, float]:
    """One set's readings of one arm.

    Args:
        latents: ``[S, D]`` the seeds' final latents. support: ``[m, D]`` the references' latents.
        kept: per seed whether the judge's class is the set's (None: not judged).

    Returns:
        ``class_kept`` (share of judged seeds; NaN if none), ``diversity`` (mean pairwise distance of
        the seeds' latents; NaN for one seed), ``nearest`` (mean over seeds of the distance to the
        nearest reference).
    """
    z = latents.to(torch.float64)
    s = support.to(torch.float64)
    pairs = list(itertools.combinations(range(z.shape[0]), 2))
    diversity = float(np.mean([float((z[i] - z[j]).norm()) for i, j in pairs])) if pairs else math.nan
    judged = [bool(k) for k in kept if k is not None]
    return {
        "class_kept": float(np.mean(judged)) if judged else math.nan,
        "diversity": diversity,
        "nearest": float(torch.cdist(z, s).min(-1).values.mean()),
    }


def run_set(
    pipe: Any,
    outcome_set: OutcomeSet,
    *,
    seeds: Sequence[int],
    tau: float,
    judge: Callable[[list[Any]], Sequence[int]],
    learned_call: dict[str, Any],
    field_call: dict[str, Any],
) -> dict[str, Any]:
    """Every arm on one set: per arm its :func:`set_metrics`, and the learned arm's per-step readings.

    Args:
        pipe: the pipeline with its IP-Adapter loaded (and a scheduler that does not clip x0).
        outcome_set: the set and its held-out control.
        seeds: one generation per seed and arm (the same seeds for every arm).
        tau: the fitted smoothing of the third arm (latent units).
        judge: images -> classes.
        learned_call: the learned arm's pipeline arguments (prompt, steps, guidance ...).
        field_call: the plug-in arms' (prompt, steps, size ...).

    Returns:
        ``{"key", "kind", "m", "labels", "tau", "arms": {arm: metrics}, "steps": [...]}`` with
        ``steps`` the learned arm's cond-half rows of every seed
        (:func:`~nw_adapter.analysis.support_sets.support_steps` plus ``seed``).
    """
    from nw_adapter.analysis.support_sets import observe_support_set

    classes = set(outcome_set.labels)
    size = {k: learned_call[k] for k in ("height", "width") if k in learned_call}
    reference_latents = encode_references(pipe, outcome_set.images, **size)  # [m, *state]
    support = flatten_states(reference_latents)
    arms: dict[str, dict[str, float]] = {}
    latents, images, steps = [], [], []
    for seed in seeds:
        run = observe_support_set(pipe, outcome_set.images, seed=seed, **learned_call)
        latents.append(run.final_latent)
        images.append(run.image)
        steps += [{**row, "seed": seed} for row in run.steps]
    labels = list(judge(images))
    arms["learned"] = set_metrics(torch.stack(latents), support, [c in classes for c in labels])
    for arm, arm_tau in (("plug-in", 0.0), ("plug-in, tau fitted", tau)):
        generated = [_field_generation(pipe, reference_latents, seed, arm_tau, field_call) for seed in seeds]
        labels = list(judge([image for image, _ in generated]))
        arms[arm] = set_metrics(
            torch.stack([z for _, z in generated]), support, [c in classes for c in labels]
        )
    heldout = flatten_states(encode_references(pipe, outcome_set.heldout, **size))
    arms["held-out data"] = set_metrics(heldout, support, [None] * len(outcome_set.heldout))
    return {
        "key": outcome_set.key,
        "kind": outcome_set.kind,
        "m": outcome_set.m,
        "labels": list(outcome_set.labels),
        "tau": tau,
        "arms": arms,
        "steps": steps,
    }


def _interval(values: Sequence[float], bounds: tuple[float, float] | None = None) -> dict[str, Any]:
    """Mean and 95% Student t interval over sets; with ``bounds`` the interval is clipped to the
    quantity's range (a share's t interval can pass 1)."""
    from nw_adapter.core.intervals import t_interval

    kept = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not kept:
        return {"mean": None, "low": None, "high": None, "n": 0}
    mean, low, high = t_interval(kept)
    if bounds is not None and math.isfinite(low):
        low, high = max(low, bounds[0]), min(high, bounds[1])
    return {
        "mean": mean,
        "low": low if math.isfinite(low) else None,
        "high": high if math.isfinite(high) else None,
        "n": len(kept),
    }


#: The range of each metric (the class share's t interval is clipped to it).
BOUNDS = {"class_kept": (0.0, 1.0), "diversity": None, "nearest": None}


def summarise(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (m, kind, arm): each metric's mean and 95% t interval over sets (class kept: clipped to
    [0, 1])."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["m"], r["kind"]), []).append(r)
    rows = []
    for (m, kind), members in sorted(groups.items()):
        for arm in ARMS:
            row = {"m": m, "kind": kind, "arm": arm, "sets": len(members)}
            row.update(
                {
                    metric: _interval([e["arms"][arm][metric] for e in members], BOUNDS[metric])
                    for metric in METRICS
                }
            )
            row["tau"] = members[0]["tau"] if arm == "plug-in, tau fitted" else None
            rows.append(row)
    return rows


def paired_differences(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (m, kind) and arm other than ``learned``: the arm minus the learned adapter on the same
    sets, each metric's mean and 95% t interval over sets (paired by set)."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["m"], r["kind"]), []).append(r)
    rows = []
    for (m, kind), members in sorted(groups.items()):
        for arm in ARMS[1:]:
            row = {"m": m, "kind": kind, "arm": f"{arm} - learned", "sets": len(members)}
            for metric in METRICS:
                diffs = [e["arms"][arm][metric] - e["arms"]["learned"][metric] for e in members]
                row[metric] = _interval(diffs)
            rows.append(row)
    return rows


def _cell(stat: dict[str, Any], digits: int = 2) -> str:
    if stat.get("mean") is None:
        return "-"
    if stat.get("low") is None:
        return f"{stat['mean']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} [{stat['low']:.{digits}f}, {stat['high']:.{digits}f}]"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The summary (or paired differences) as text, one line per (m, kind, arm)."""
    lines = [f"{'m':>2} {'kind':<6} {'arm':<28} {'sets':>4}  " + "  ".join(f"{m:<22}" for m in METRICS)]
    for row in rows:
        cells = "  ".join(f"{_cell(row[m]):<22}" for m in METRICS)
        lines.append(f"{row['m']:>2} {row['kind']:<6} {row['arm']:<28} {row['sets']:>4}  {cells}")
    return "\n".join(lines)


def x0_table(
    results: Sequence[dict[str, Any]], bins: Sequence[float] = (0.1, 0.3, 1.0, 3.0, 10.0)
) -> list[dict]:
    """The learned x0 against the plug-in's NW mean by noise level: per (m, h bin) the mean over sets
    (each set: its seeds' and steps' mean in the bin) of ``||x0 - m_h|| / ||x0 - mean s_i||``, of
    ``||x0 - m_h||`` and of the posterior's entropy share, with 95% t intervals over sets."""
    edges = [0.0, *bins, math.inf]
    table = []
    for m in sorted({r["m"] for r in results}):
        for low, high in itertools.pairwise(edges):
            per_set: dict[str, list[float]] = {
                "x0_nw_ratio": [],
                "x0_nw_distance": [],
                "posterior_entropy_share": [],
            }
            for r in results:
                if r["m"] != m:
                    continue
                inside = [s for s in r["steps"] if low <= _h(s) < high and s.get("x0_nw_ratio") is not None]
                for key, values in per_set.items():
                    data = [
                        float(s[key])
                        for s in inside
                        if s.get(key) is not None and math.isfinite(float(s[key]))
                    ]
                    if data:
                        values.append(float(np.mean(data)))
            if per_set["x0_nw_ratio"]:
                row = {"m": m, "h_low": low, "h_high": high}
                row.update({key: _interval(values) for key, values in per_set.items()})
                table.append(row)
    return table


def _h(step: dict[str, Any]) -> float:
    value = step.get("h_schedule")
    return math.inf if value is None or not math.isfinite(float(value)) else float(value)


def format_x0_table(rows: Sequence[dict[str, Any]]) -> str:
    """:func:`x0_table` as text."""
    lines = [f"{'m':>2} {'h':<12} {'sets':>4}  {'||x0 - m_h|| / ||x0 - mean||':<30} {'||x0 - m_h||':<24} "
             f"{'posterior entropy / log m':<24}"]  # fmt: skip
    for row in rows:
        band = f"[{row['h_low']:g}, {row['h_high']:g})"
        lines.append(
            f"{row['m']:>2} {band:<12} {row['x0_nw_ratio']['n']:>4}  {_cell(row['x0_nw_ratio'], 3):<30} "
            f"{_cell(row['x0_nw_distance']):<24} {_cell(row['posterior_entropy_share'], 3):<24}"
        )
    return "\n".join(lines)


# --- figures --------------------------------------------------------------------------------

ARM_STYLE = {
    "learned": ("C0", "o"),
    "plug-in": ("C3", "s"),
    "plug-in, tau fitted": ("C2", "^"),
    "held-out data": ("0.35", "D"),
}


def outcome_figure(summaries: dict[str, Sequence[dict[str, Any]]], *, title: str | None = None):
    """The outcome table as a figure: rows = metrics, columns = models; per arm the mean over sets
    against m with its 95% t interval, same-class sets solid, mixed dashed. 7 in wide."""
    from matplotlib.figure import Figure

    models = list(summaries)
    fig = Figure(figsize=(7.0, 7.2), layout="constrained")
    axes = fig.subplots(len(METRICS), len(models), squeeze=False, sharex=True)
    for c, model in enumerate(models):
        rows = summaries[model]
        for r, metric in enumerate(METRICS):
            ax = axes[r][c]
            for arm in ARMS:
                if metric == "class_kept" and arm == "held-out data":
                    continue
                color, marker = ARM_STYLE[arm]
                for kind, style, shift in (("same", "-", -0.04), ("mixed", "--", 0.04)):
                    points = [row for row in rows if row["arm"] == arm and row["kind"] == kind]
                    points = [p for p in points if p[metric]["mean"] is not None]
                    if not points:
                        continue
                    x = np.array([p["m"] for p in points], dtype=float) * (1 + shift)
                    y = np.array([p[metric]["mean"] for p in points])
                    low = np.array([p[metric]["low"] if p[metric]["low"] is not None else p[metric]["mean"]
                                    for p in points])  # fmt: skip
                    high = np.array([p[metric]["high"] if p[metric]["high"] is not None else p[metric]["mean"]
                                     for p in points])  # fmt: skip
                    style_of = {"color": color, "marker": marker, "markersize": 3.5, "linestyle": style}
                    ax.errorbar(
                        x,
                        y,
                        yerr=[y - low, high - y],
                        linewidth=1.1,
                        capsize=2,
                        label=f"{arm}, {kind}",
                        **style_of,
                    )
            ax.set_xscale("log", base=2)
            ax.set_xticks([1, 2, 4, 8], labels=["1", "2", "4", "8"])
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if c == 0:
                ax.set_ylabel(METRIC_LABELS[metric], fontsize=8)
            if r == 0:
                ax.set_title(model, fontsize=9)
            if r == len(METRICS) - 1:
                ax.set_xlabel("support size m (held-out digits)", fontsize=8)
            if metric == "class_kept":
                ax.set_ylim(-0.03, 1.03)
    handles, labels = axes[-1][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", fontsize=7, frameon=False, ncol=4)
    fig.suptitle(title or "learned adapter vs plug-in NW field (mean, 95% t interval over support sets)",
                 fontsize=9)  # fmt: skip
    return fig


def x0_figure(results_by_model: dict[str, Sequence[dict[str, Any]]], *, title: str | None = None):
    """The learned x0 against the plug-in field over the noise level: per model (columns), per m, the
    mean over sets of ``||x0 - m_h|| / ||x0 - mean s_i||`` per step against h (top) and the posterior's
    entropy share (bottom; where it is 1 the NW mean is the references' mean and the ratio is 1 by
    construction), 95% t bands over sets. 7 in wide."""
    from matplotlib.figure import Figure

    from nw_adapter.core.intervals import t_interval

    models = list(results_by_model)
    fig = Figure(figsize=(7.0, 4.6), layout="constrained")
    axes = fig.subplots(2, len(models), squeeze=False, sharex="col")
    for c, model in enumerate(models):
        results = results_by_model[model]
        for g, m in enumerate(sorted({r["m"] for r in results if r["m"] > 1})):
            members = [r for r in results if r["m"] == m]
            steps = sorted({s["step"] for r in members for s in r["steps"]})
            for row, key in ((0, "x0_nw_ratio"), (1, "posterior_entropy_share")):
                hs, means, lows, highs = [], [], [], []
                for step in steps:
                    per_set = []
                    for r in members:
                        vals = [
                            float(s[key]) for s in r["steps"] if s["step"] == step and s.get(key) is not None
                        ]
                        if vals:
                            per_set.append(float(np.mean(vals)))
                    h = [_h(s) for r in members for s in r["steps"] if s["step"] == step]
                    if not per_set or not h or not math.isfinite(h[0]):
                        continue
                    mean, low, high = t_interval(per_set)
                    hs.append(float(np.mean(h)))
                    means.append(mean)
                    lows.append(low if math.isfinite(low) else mean)
                    highs.append(high if math.isfinite(high) else mean)
                ax = axes[row][c]
                ax.plot(hs, means, color=f"C{g}", linewidth=1.2, label=f"m = {m}")
                ax.fill_between(hs, lows, highs, color=f"C{g}", alpha=0.18, linewidth=0)
        top, bottom = axes[0][c], axes[1][c]
        top.axhline(1.0, color="0.4", linestyle=":", linewidth=0.8)
        top.axhline(0.0, color="C3", linestyle="--", linewidth=0.8, label="plug-in field (0)")
        top.set_title(model, fontsize=9)
        bottom.set_xscale("log")
        ticks = [t for t in (0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0) if _in_range(t, bottom)]
        bottom.set_xticks(ticks, labels=[f"{t:g}" for t in ticks])
        bottom.minorticks_off()
        bottom.invert_xaxis()
        bottom.set_xlabel("h = b_t / a_t (noise level; denoising runs left to right)", fontsize=8)
        bottom.set_ylim(-0.03, 1.03)
        for ax in (top, bottom):
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        if c == 0:
            top.set_ylabel("||x0 - m_h|| / ||x0 - mean of refs||", fontsize=8)
            bottom.set_ylabel("latent posterior\nentropy / log m", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", fontsize=7, frameon=False, ncol=5)
    fig.suptitle(
        title or "learned x0 against the plug-in NW mean (mean, 95% t band over support sets)", fontsize=9
    )
    return fig


def _in_range(value: float, ax: Any) -> bool:
    low, high = sorted(ax.get_xlim())
    return low <= value <= high


def attention_posterior_figure(
    results_by_model: dict[str, Sequence[dict[str, Any]]], *, title: str | None = None
):
    """Attention mass against the latent posterior over denoising: per model (columns) and m (rows of
    the legend), the concentration on the leading reference, ``(max share - 1/m) / (1 - 1/m)``, of the
    attention mass (solid) and of the posterior over the references' latents (dashed), mean over sets
    with 95% t bands (learned adapter's own generations). 7 in wide."""
    from matplotlib.figure import Figure

    from nw_adapter.core.intervals import t_interval

    def concentration(shares: Sequence[float], m: int) -> float:
        finite = [x for x in shares if math.isfinite(x)]
        return (max(finite) - 1 / m) / (1 - 1 / m) if finite and m > 1 else math.nan

    models = list(results_by_model)
    fig = Figure(figsize=(7.0, 3.2), layout="constrained")
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for c, model in enumerate(models):
        ax = axes[c]
        results = results_by_model[model]
        for g, m in enumerate(sorted({r["m"] for r in results if r["m"] > 1})):
            members = [r for r in results if r["m"] == m]
            last = max(s["step"] for r in members for s in r["steps"])
            first = min(s["step"] for r in members for s in r["steps"])
            for key, style, arm in (("mass", "-", "attention"), ("posterior", "--", "latent posterior")):
                xs, means, lows, highs = [], [], [], []
                for step in range(first, last + 1):
                    per_set = []
                    for r in members:
                        vals = [concentration(s[key], m) for s in r["steps"] if s["step"] == step]
                        vals = [v for v in vals if math.isfinite(v)]
                        if vals:
                            per_set.append(float(np.mean(vals)))
                    if not per_set:
                        continue
                    mean, low, high = t_interval(per_set)
                    xs.append((step - first) / max(last - first, 1))
                    means.append(mean)
                    lows.append(low if math.isfinite(low) else mean)
                    highs.append(high if math.isfinite(high) else mean)
                ax.plot(xs, means, color=f"C{g}", linestyle=style, linewidth=1.2, label=f"m = {m}, {arm}")
                ax.fill_between(xs, lows, highs, color=f"C{g}", alpha=0.15, linewidth=0)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("denoising progress (step / last step)", fontsize=8)
        ax.set_ylim(-0.03, 1.03)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if c == 0:
            ax.set_ylabel("concentration on the leading reference\n(max share - 1/m) / (1 - 1/m)", fontsize=8)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=7, frameon=False, ncol=1)
    fig.suptitle(title or "attention mass per reference vs the theory's latent posterior (learned adapter)",
                 fontsize=9)  # fmt: skip
    return fig
