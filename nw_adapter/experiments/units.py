"""Sub-experiments ("units") of the three failure regimes; each writes one result JSON.

Units (ids in brackets):

- dimension sweep, Gaussian mixtures in d: a learned model per (d, seed, variant OFF/ON)
  [``dims-d<d>-s<seed>-<off|on>``] and the plug-in field per d [``dims-d<d>-plugin``];
- shells in d: a learned model per (d, seed, variant OFF/ON) [``shells-d<d>-s<seed>-<off|on>``]
  and the plug-in per d [``shells-d<d>-plugin``];
- support-size sweep on real features, in cross-validated class folds (fold k tests every
  ``digits_folds``-th class; its PCA, standardisation, learned models and amortised tau are fitted
  on the other folds' classes only): one learned model per (fold, seed, variant) trained on ragged
  m in [1, max m] [``digits-f<k>-s<seed>-<off|on>``], and the plug-in [``digits-f<k>-plugin``], all
  scored at every m of the sweep on nested supports of the same test tasks;
- the training-free fields of :mod:`nw_adapter.core.smoothed_fields` on the same tasks and noise
  [``dims-d<d>-fields``, ``shells-d<d>-fields``, ``digits-f<k>-fields``]; the amortised tau is fitted
  on training tasks of the family (of each m on features, training classes of the fold) before any
  test task is seen.

Evaluation tasks depend on the regime and d only (never on the training seed or the method),
and all methods start from the same noise, so comparisons are paired by task and by seed.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

from nw_adapter.atomic import atomic_write_json
from nw_adapter.core.smoothed_fields import fit_shared_tau, loo_tau
from nw_adapter.experiments.evaluation import EvalConfig, evaluate_methods
from nw_adapter.experiments.fields import model_field, plugin_field, training_free_builders
from nw_adapter.experiments.heads import analyse_heads
from nw_adapter.experiments.model import ICFMConfig, ICFMModel
from nw_adapter.experiments.scale import Scale
from nw_adapter.experiments.tasks import (
    FeatureSplits,
    GaussianMixtureFamily,
    ShellFamily,
    TaskBatch,
    TaskFamily,
    class_folds,
    load_digits_features,
    load_feature_file,
    make_feature_splits,
    split_generator,
)
from nw_adapter.experiments.training import TrainConfig, build_model, loss_plateau, train

__all__ = ["plan_units", "run_unit", "write_json_atomic", "SIGMA_MIN", "EVAL_SEED"]

SIGMA_MIN = 0.01
EVAL_SEED = 0
ROTATE_TRAIN = True
#: Training tasks and held-out points per task on which the amortised tau is fitted.
AMORTISE_TASKS, AMORTISE_HELDOUT = 64, 200


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write JSON (NaN allowed) to ``path`` atomically (never half-written)."""
    atomic_write_json(path, payload, allow_nan=True)


def plan_units(scale: Scale, regimes: tuple[str, ...]) -> list[dict]:
    """All units of the chosen regimes, cheapest (plug-in) first within a regime."""
    units: list[dict] = []
    if "dims" in regimes:
        for d in scale.dims:
            units.append({"id": f"dims-d{d}-plugin", "regime": "dims", "d": d, "method": "plugin"})
            units.append({"id": f"dims-d{d}-fields", "regime": "dims", "d": d, "method": "fields"})
            for seed in range(scale.seeds):
                for variant in ("off", "on"):
                    units.append(
                        {
                            "id": f"dims-d{d}-s{seed}-{variant}",
                            "regime": "dims",
                            "d": d,
                            "seed": seed,
                            "method": variant,
                        }
                    )
    if "shells" in regimes:
        for d in scale.shell_dims:
            units.append({"id": f"shells-d{d}-plugin", "regime": "shells", "d": d, "method": "plugin"})
            units.append({"id": f"shells-d{d}-fields", "regime": "shells", "d": d, "method": "fields"})
            for seed in range(scale.seeds):
                for variant in ("off", "on"):
                    units.append(
                        {
                            "id": f"shells-d{d}-s{seed}-{variant}",
                            "regime": "shells",
                            "d": d,
                            "seed": seed,
                            "method": variant,
                        }
                    )
    if "digits" in regimes:
        for fold in range(scale.digits_folds):
            stem = {"regime": "digits", "fold": fold}
            units.append({"id": f"digits-f{fold}-plugin", **stem, "method": "plugin"})
            units.append({"id": f"digits-f{fold}-fields", **stem, "method": "fields"})
            for seed in range(scale.seeds):
                for variant in ("off", "on"):
                    units.append(
                        {"id": f"digits-f{fold}-s{seed}-{variant}", **stem, "seed": seed, "method": variant}
                    )
    return units


def _family(unit: dict) -> TaskFamily:
    """Task family of a synthetic unit: mixtures for the dimension sweep, shells otherwise."""
    return GaussianMixtureFamily(unit["d"]) if unit["regime"] == "dims" else ShellFamily(unit["d"])


@functools.lru_cache(maxsize=4)
def _feature_splits(features: str | None, labels: str | None, fold: int, folds: int) -> FeatureSplits:
    """Feature families of one class fold (PCA on its training classes), cached per process.

    Fold ``fold`` of ``folds`` tests :func:`~nw_adapter.experiments.tasks.class_folds`'s classes
    ``fold`` and trains on all others (no validation classes: nothing is tuned on them).
    """
    x, y = load_feature_file(features, labels) if features else load_digits_features()
    classes = sorted(int(c) for c in set(y.tolist()))
    test = class_folds(classes, folds)[fold]
    train = [c for c in classes if c not in test]
    return make_feature_splits(
        x,
        y,
        num_components=min(16, x.shape[1]),
        train_classes=train,
        val_classes=None,
        test_classes=test,
        rotate_train=ROTATE_TRAIN,
    )


def _model_config(scale: Scale, dim: int, exact_head: bool) -> ICFMConfig:
    return ICFMConfig(
        dim=dim,
        d_model=scale.d_model,
        num_heads=scale.num_heads,
        num_layers=scale.num_layers,
        exact_head=exact_head,
        sigma_min=SIGMA_MIN,
    )


def _train_config(scale: Scale, seed: int, steps: int, num_support) -> TrainConfig:
    return TrainConfig(
        steps=steps,
        tasks_per_batch=scale.tasks_per_batch,
        targets_per_task=scale.targets_per_task,
        num_support=num_support,
        lr=scale.lr,
        warmup_steps=min(50, max(1, steps // 10)),
        sigma_min=SIGMA_MIN,
        seed=seed,
        checkpoint_every=max(1, steps // 4),
    )


def _eval_config(scale: Scale, device: str) -> EvalConfig:
    return EvalConfig(
        num_generated=scale.eval_generated,
        grid_points=scale.grid_points,
        sigma_min=SIGMA_MIN,
        seed=EVAL_SEED,
        device=device,
    )


def _lists(res: dict, name: str) -> dict:
    """One method's per-task MMD^2 arrays as JSON lists."""
    return {k: v.tolist() for k, v in res[name].items()}


def _train_unit(
    unit: dict,
    scale: Scale,
    family: TaskFamily,
    steps: int,
    num_support: int | tuple[int, int],
    ckpt_dir: Path,
    progress: bool,
    device: str,
) -> tuple[ICFMModel, dict]:
    """Train (or resume) the unit's model; returns it with loss and CPU-time information."""
    t0 = time.process_time()
    result = train(
        family,
        _model_config(scale, family.dim, unit["method"] == "on"),
        _train_config(scale, unit["seed"], steps, num_support),
        checkpoint_dir=ckpt_dir,
        progress=progress,
        description=unit["id"],
        device=device,
    )
    losses = result.losses
    k = max(1, len(losses) // 10)
    info = {
        "steps": result.step,
        "resumed_from": result.resumed_from,
        "loss_first": sum(losses[:k]) / k,
        "loss_last": sum(losses[-k:]) / k,
        "loss_curve": losses[:: max(1, len(losses) // 50)],
        "plateau": loss_plateau(losses),
        "cpu_s": time.process_time() - t0,
    }
    return result.model, info


def run_unit(unit: dict, scale: Scale, out_dir: Path, *, progress: bool = False, device: str = "cpu") -> dict:
    """Run one unit (train if learned, evaluate, analyse heads) and write its result JSON.

    Args:
        unit: A dict from :func:`plan_units`.
        scale: Experiment scale.
        out_dir: Run folder; the result goes to ``results/<id>.json``, checkpoints to
            ``checkpoints/<id>/`` (training resumes from them).
        progress: Show the training progress bar.
        device: torch device of training and evaluation (the head analysis runs on the CPU).

    Returns:
        The result dict (also written to disk).
    """
    out_dir = Path(out_dir)
    ckpt_dir = out_dir / "checkpoints" / unit["id"]
    wall0 = time.time()
    payload: dict = dict(unit)
    ecfg = _eval_config(scale, device)
    if unit["regime"] in ("dims", "shells"):
        family = _family(unit)
        tasks = family.sample(
            scale.eval_tasks,
            scale.num_support,
            scale.eval_targets,
            generator=split_generator(EVAL_SEED, "test"),
        )
        if unit["method"] == "plugin":
            t0 = time.process_time()
            res = evaluate_methods(
                {"plugin": lambda s, mk: plugin_field(s, mk, sigma_min=SIGMA_MIN)}, tasks, ecfg
            )
            payload.update(
                _lists(res, "plugin"), neff=res["neff"].tolist(), sigma_fixed=res["sigma_fixed"].tolist()
            )
        elif unit["method"] == "fields":
            train_tasks = family.sample(
                AMORTISE_TASKS,
                scale.num_support,
                AMORTISE_HELDOUT,
                generator=split_generator(EVAL_SEED, "train"),
            )
            tau = fit_shared_tau(train_tasks.support, train_tasks.target)
            t0 = time.process_time()
            builders = training_free_builders(tau, sigma_min=SIGMA_MIN)
            res = evaluate_methods(builders, tasks, ecfg)
            payload["fields"] = {name: _lists(res, name) for name in builders}
            payload["amortised_tau"] = tau
            payload["loo_tau_mean"] = float(loo_tau(tasks.support).mean())
        else:
            model, payload["train"] = _train_unit(
                unit, scale, family, scale.steps, scale.num_support, ckpt_dir, progress, device
            )
            t0 = time.process_time()
            res = evaluate_methods({"model": lambda s, mk: model_field(model, s, mk)}, tasks, ecfg)
            payload.update(_lists(res, "model"))
            if unit["method"] == "off":
                model = model.cpu()
                head_tasks = TaskBatch(
                    tasks.support[: scale.head_tasks], tasks.target[: scale.head_tasks, : scale.head_targets]
                )
                payload["heads"] = analyse_heads(model, head_tasks, scale.head_times, sigma_min=SIGMA_MIN)
                # baseline: same architecture and initial weights, untrained (head-space rho is high
                # by algebra; only what training adds over this baseline is a learned effect)
                untrained = build_model(_model_config(scale, family.dim, False), unit["seed"])
                payload["heads_untrained"] = analyse_heads(
                    untrained.eval(), head_tasks, scale.head_times, sigma_min=SIGMA_MIN
                )
        payload["eval_cpu_s"] = time.process_time() - t0
    elif unit["regime"] == "digits":
        splits = _feature_splits(scale.features, scale.labels, unit["fold"], scale.digits_folds)
        m_max = max(scale.support_sizes)
        base, task_classes = splits.test.sample_per_class(
            scale.digits_tasks_per_class,
            m_max,
            scale.digits_targets,
            generator=split_generator(EVAL_SEED, "test"),
        )
        payload["task_classes"] = task_classes
        payload["explained_variance"] = splits.explained_variance
        payload["train_classes"], payload["test_classes"] = splits.train.classes, splits.test.classes
        if unit["method"] == "plugin":
            methods = {"plugin": lambda s, mk: plugin_field(s, mk, sigma_min=SIGMA_MIN)}
        elif unit["method"] == "fields":
            methods = None
        else:
            model, payload["train"] = _train_unit(
                unit, scale, splits.train, scale.digits_steps, (1, m_max), ckpt_dir, progress, device
            )
            methods = {"model": lambda s, mk: model_field(model, s, mk)}
        t0 = time.process_time()
        per_m = {}
        for m in scale.support_sizes:
            batch = TaskBatch(base.support[:, :m], base.target)
            if unit["method"] == "fields":
                train_tasks = splits.train.sample(
                    AMORTISE_TASKS, m, scale.digits_targets, generator=split_generator(EVAL_SEED, "train")
                )
                tau = fit_shared_tau(train_tasks.support, train_tasks.target)
                builders = training_free_builders(tau, sigma_min=SIGMA_MIN)
                res = evaluate_methods(builders, batch, ecfg)
                per_m[str(m)] = {
                    "fields": {name: _lists(res, name) for name in builders},
                    "amortised_tau": tau,
                    "loo_tau_mean": float(loo_tau(batch.support).mean()),
                }
                continue
            res = evaluate_methods(methods, batch, ecfg)
            name = next(iter(methods))
            per_m[str(m)] = {**_lists(res, name), "neff": res["neff"].tolist()}
        payload["per_m"] = per_m
        payload["eval_cpu_s"] = time.process_time() - t0
    else:
        raise ValueError(f"unknown regime {unit['regime']!r}; use one of dims, shells, digits.")
    payload["wall_s"] = time.time() - wall0
    write_json_atomic(out_dir / "results" / f"{unit['id']}.json", payload)
    return payload
