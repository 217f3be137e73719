"""Evaluation protocol of THEORY.md section 5: sample, compare with held-out points, test.

Per task: ``num_generated`` points from N(0, I) pushed through the field by Euler on
``time_grid(100)`` (100 points of [1e-5, 1]); unbiased MMD^2 against the task's held-out
target points with (a) the median-heuristic bandwidth sigma = median pairwise distance of the
pooled sample (generated and held-out points together, THEORY.md section 5) and (b) a fixed
bandwidth that depends on the task only, sigma = median pairwise distance of the pooled held-out
targets, so that all methods share one kernel. Every method sees the same initial noise
(common random numbers), which makes the per-task comparison paired.

n_eff at t = 0.56: with x1 a held-out target and z ~ N(0, I), x_t = a_t x1 + b_t z and
n_eff = 1 / sum_i w_i(x_t)^2 of the plug-in NW posterior (query x_t / a_t, h = b_t / a_t),
averaged over the targets of the task.

benefit = (MMD^2_OFF - MMD^2_ON) / MMD^2_OFF on task-averaged MMD^2. :func:`paired_tests` gives a
paired t-test (``scipy.stats.ttest_rel``) and a Wilcoxon signed-rank test; use them only over
independent units (see :mod:`nw_adapter.experiments.inference`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from nw_adapter.core.kernels import effective_sample_size, nw_weights
from nw_adapter.core.metrics import median_heuristic_sigma, mmd2_unbiased
from nw_adapter.core.paths import OTPath
from nw_adapter.core.sampling import sample_ode, time_grid
from nw_adapter.experiments.tasks import TaskBatch

__all__ = [
    "EvalConfig",
    "FieldBuilder",
    "generate",
    "fixed_sigma",
    "neff_on_path",
    "evaluate_methods",
    "benefit",
    "paired_tests",
]

FieldBuilder = Callable[[Tensor, Tensor | None], Callable[[Tensor, Tensor], Tensor]]
"""``(support [B, m, d], support_mask [B, m] | None) -> field(x [B, n, d], t) -> [B, n, d]``."""


@dataclass
class EvalConfig:
    """Evaluation settings.

    Attributes:
        num_generated: Generated points per task (paper 500).
        grid_points: Points of the Euler time grid on [t_start, 1] (paper 100).
        t_start: First time of the grid (paper 1e-5).
        neff_time: Time of the n_eff measurement (paper 0.56).
        sigma_min: OT path sigma_min (for n_eff).
        batch_tasks: Tasks integrated together (memory bound).
        seed: Seed of the initial noise and of the n_eff path noise.
        device: Device of the sampling and scoring; noise is drawn on the CPU and moved, so every
            device starts from the same noise.
    """

    num_generated: int = 500
    grid_points: int = 100
    t_start: float = 1e-5
    neff_time: float = 0.56
    sigma_min: float = 0.01
    batch_tasks: int = 25
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.num_generated < 2 or self.grid_points < 2 or self.batch_tasks < 1:
            raise ValueError("num_generated and grid_points must be >= 2 and batch_tasks >= 1.")
        if not 0.0 < self.neff_time <= 1.0:
            raise ValueError(f"neff_time={self.neff_time} must be in (0, 1].")


def generate(field: Callable[[Tensor, Tensor], Tensor], x0: Tensor, grid: Tensor) -> Tensor:
    """Push noise ``x0 [B, N, d]`` through ``field`` with Euler on ``grid``; returns ``[B, N, d]``."""
    return sample_ode(field, x0, grid, method="euler")


def fixed_sigma(target: Tensor) -> Tensor:
    """Task-only kernel bandwidth: median pairwise distance of all the held-out targets ``[B, n, d]``.

    The same quantity as the median heuristic (the pairs i < j of the pooled sample), computed on
    the targets alone, so it does not depend on the method being scored.

    Returns:
        ``[B]``.
    """
    n = target.shape[-2]
    if n < 4:
        raise ValueError(f"fixed_sigma needs at least 4 target points per task, got {n}.")
    return median_heuristic_sigma(target[:, : n // 2], target[:, n // 2 :])  # pools the two halves


def neff_on_path(tasks: TaskBatch, t: float, *, sigma_min: float, generator: torch.Generator) -> Tensor:
    """Mean plug-in n_eff over the targets of each task at time t on the OT path.

    x_t = t x1 + (1 - (1 - sigma_min) t) z; weights softmax_i(-||x_t / t - s_i||^2 / 2h^2), h = b_t / t.

    Returns:
        ``[B]`` mean of 1 / sum_i w_i^2.
    """
    path = OTPath(sigma_min)
    a, b = path.alpha(t), path.sigma(t)
    z = torch.randn(tasks.target.shape, generator=generator).to(tasks.target.device)
    x_t = a * tasks.target + b * z
    w = nw_weights(x_t / a, tasks.support, b / a, support_mask=tasks.support_mask)
    return effective_sample_size(w).mean(-1)


def evaluate_methods(
    methods: dict[str, FieldBuilder], tasks: TaskBatch, config: EvalConfig
) -> dict[str, np.ndarray | dict[str, np.ndarray]]:
    """Generate with every method on every task and score against the held-out targets.

    Args:
        methods: Name -> field builder (called once per chunk of tasks).
        tasks: Evaluation tasks (support ``[B, m, d]``, targets ``[B, n, d]``).
        config: Evaluation settings.

    Returns:
        ``{"neff": [B], "sigma_fixed": [B], name: {"mmd2_median": [B], "mmd2_fixed": [B]}}``
        as float64 NumPy arrays.
    """
    device = torch.device(config.device)
    grid = time_grid(config.grid_points, config.t_start, 1.0).to(device)
    gen = torch.Generator().manual_seed(int(config.seed) + 12345)
    out: dict[str, list] = {name: [] for name in methods}
    neffs, sigmas = [], []
    for start in range(0, tasks.num_tasks, config.batch_tasks):
        sl = slice(start, start + config.batch_tasks)
        mask = None if tasks.support_mask is None else tasks.support_mask[sl].to(device)
        chunk = TaskBatch(tasks.support[sl].to(device), tasks.target[sl].to(device), mask)
        x0 = torch.randn(chunk.num_tasks, config.num_generated, chunk.dim, generator=gen).to(device)
        sig = fixed_sigma(chunk.target)
        sigmas.append(sig)
        neffs.append(neff_on_path(chunk, config.neff_time, sigma_min=config.sigma_min, generator=gen))
        for name, build in methods.items():
            samples = generate(build(chunk.support, mask), x0, grid)
            if not bool(torch.isfinite(samples).all()):
                samples = torch.nan_to_num(samples, nan=1e6, posinf=1e6, neginf=-1e6)
            out[name].append(
                (mmd2_unbiased(samples, chunk.target), mmd2_unbiased(samples, chunk.target, sigma=sig))
            )
    result: dict[str, np.ndarray | dict[str, np.ndarray]] = {
        "neff": torch.cat(neffs).double().cpu().numpy(),
        "sigma_fixed": torch.cat(sigmas).double().cpu().numpy(),
    }
    for name, parts in out.items():
        result[name] = {
            "mmd2_median": torch.cat([p[0] for p in parts]).double().cpu().numpy(),
            "mmd2_fixed": torch.cat([p[1] for p in parts]).double().cpu().numpy(),
        }
    return result


def benefit(mmd_off: float, mmd_on: float) -> float:
    """Relative benefit of the exact head: (MMD^2_OFF - MMD^2_ON) / MMD^2_OFF (NaN if OFF <= 0)."""
    return (mmd_off - mmd_on) / mmd_off if mmd_off > 0 else math.nan


def paired_tests(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Paired tests of a vs b (same length; pairs share a task or a seed).

    Returns:
        ``{"n", "mean_diff" (a - b), "t_p" (ttest_rel, NaN if n < 2), "wilcoxon_p" (NaN if n < 2 or
        all differences are 0)}``.
    """
    from scipy import stats

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired samples must have the same shape, got {a.shape} and {b.shape}.")
    res = {"n": int(a.size), "mean_diff": float(np.mean(a - b)) if a.size else math.nan}
    testable = a.size >= 2 and bool(np.any(a != b))
    with warnings.catch_warnings():  # constant differences: scipy warns about precision, p is still defined
        warnings.simplefilter("ignore", RuntimeWarning)
        res["t_p"] = float(stats.ttest_rel(a, b).pvalue) if testable else math.nan
        res["wilcoxon_p"] = float(stats.wilcoxon(a, b).pvalue) if testable else math.nan
    return res
