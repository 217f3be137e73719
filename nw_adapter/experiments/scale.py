"""Scale presets of the failure-regime experiments (how much training and evaluation).

The paper trains d_model 128 / H 4 / L 3 for 100k steps on 256 tasks x 256 targets and
evaluates 100 tasks x 500 points. Two CPU cores allow far less; ``QUICK`` (< 5 minutes) and
``FULL`` (about 20 CPU-minutes; 40-70 minutes of wall time on a loaded 2-core machine) are the
documented compromises. Both run the headline settings of each regime only (mixtures d = 2, 16;
shells d = 8, 32; every m on features), with learned ON and OFF models everywhere and the
training-free fields beside them (the fix x regime matrix). Every field can be overridden
(``--dims 2,4,8,16`` restores the full sweep).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

__all__ = ["Scale", "QUICK", "FULL", "PAPER_SCALE", "SCALES", "REGIMES", "PAPER"]

REGIMES = ("dims", "shells", "digits")

PAPER = {
    "dims": {
        "benefit": {2: 0.28, 16: 0.0},
        "neff": {2: 9.0, 16: 1.0},
        "text": "exact-head benefit +28% at d = 2 falling to 0% at d = 16; n_eff ~9 -> ~1",
    },
    "shells": {
        "ratio": {8: 11.2, 32: 6.4},
        "neff": (6.5, 8.0),
        "text": "isotropic plug-in 11.2x (d = 8) and 6.4x (d = 32) worse MMD^2 than learned, n_eff 6.5-8",
    },
    "digits": {
        "advantage": {10: 0.24},
        "catch_up_m": 25,
        "text": "learned 24% lower MMD^2 at m = 10; plug-in catches up for m > ~25 (DINOv2 ImageNet, 16 d)",
    },
}


@dataclass
class Scale:
    """How big each experiment is.

    Attributes:
        name: Label in the report.
        d_model, num_heads, num_layers: Learned model size.
        steps: Training steps of the synthetic regimes (per model).
        digits_steps: Training steps of the real-feature model.
        tasks_per_batch, targets_per_task: Training batch (tasks x targets).
        lr: Peak AdamW learning rate.
        seeds: Training seeds per configuration (paired tests over seeds need >= 2).
        num_support: m of the synthetic regimes (paper 50).
        eval_tasks: Held-out tasks per configuration (paper 100).
        eval_generated: Generated points per task (paper 500).
        eval_targets: Held-out target points per task of synthetic regimes (paper 500).
        digits_targets: Held-out points per real-feature task (limited by class sizes).
        digits_tasks_per_class: Evaluation tasks per test class.
        digits_folds: Cross-validated class folds on features: fold k tests every ``digits_folds``-th
            class and trains (model, PCA, amortised tau) on the others; every class is tested once.
        grid_points: Euler grid points on [1e-5, 1] (paper 100).
        dims: d of the dimension sweep.
        shell_dims: d of the shells regime.
        support_sizes: m of the support-size sweep.
        head_times: Times of the head analysis.
        head_tasks, head_targets: Size of the head analysis.
        features, labels: Optional user feature file (.npz, or .npy + labels .npy) instead of digits.
    """

    name: str = "quick"
    d_model: int = 32
    num_heads: int = 4
    num_layers: int = 2
    steps: int = 300
    digits_steps: int = 400
    tasks_per_batch: int = 16
    targets_per_task: int = 32
    lr: float = 2e-3
    seeds: int = 1
    num_support: int = 50
    eval_tasks: int = 16
    eval_generated: int = 256
    eval_targets: int = 256
    digits_targets: int = 120
    digits_tasks_per_class: int = 5
    digits_folds: int = 5
    grid_points: int = 100
    dims: tuple[int, ...] = (2, 16)
    shell_dims: tuple[int, ...] = (8, 32)
    support_sizes: tuple[int, ...] = (1, 2, 5, 10, 25, 50)
    head_times: tuple[float, ...] = (0.05, 0.2, 0.4, 0.56, 0.7, 0.85, 0.95, 0.99)
    head_tasks: int = 8
    head_targets: int = 64
    features: str | None = None
    labels: str | None = None

    def __post_init__(self) -> None:
        for name in ("dims", "shell_dims", "support_sizes", "head_times"):
            setattr(self, name, tuple(getattr(self, name)))
        positive = (
            "d_model",
            "num_heads",
            "num_layers",
            "steps",
            "digits_steps",
            "tasks_per_batch",
            "targets_per_task",
            "seeds",
            "num_support",
            "eval_tasks",
            "digits_tasks_per_class",
            "digits_folds",
            "head_tasks",
            "head_targets",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        for name in ("eval_generated", "eval_targets", "digits_targets", "grid_points"):
            if getattr(self, name) < 4:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 4.")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of num_heads={self.num_heads}.")
        if not self.dims or min(self.dims) < 1:
            raise ValueError(f"dims={self.dims} must be a non-empty list of ints >= 1.")
        if not self.shell_dims or min(self.shell_dims) < 2:
            raise ValueError(f"shell_dims={self.shell_dims} must be a non-empty list of ints >= 2.")
        if not self.support_sizes or min(self.support_sizes) < 1:
            raise ValueError(f"support_sizes={self.support_sizes} must be a non-empty list of ints >= 1.")
        if any(not 0.0 < t <= 1.0 for t in self.head_times):
            raise ValueError(f"head_times={self.head_times} must lie in (0, 1].")

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> Scale:
        """A copy with some fields changed (None values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


QUICK = Scale()
FULL = Scale(
    name="full",
    d_model=32,
    steps=1500,
    digits_steps=2000,
    tasks_per_batch=16,
    targets_per_task=32,
    lr=2e-3,
    seeds=2,
    eval_tasks=32,
    eval_generated=400,
    eval_targets=400,
    digits_tasks_per_class=10,
    head_tasks=8,
    dims=(2, 4, 8, 16),
)

PAPER_SCALE = Scale(
    name="paper",
    d_model=128,
    num_heads=4,
    num_layers=3,
    steps=100_000,
    digits_steps=100_000,
    tasks_per_batch=256,
    targets_per_task=256,
    lr=1e-4,
    seeds=3,
    eval_tasks=100,
    eval_generated=500,
    eval_targets=500,
    digits_tasks_per_class=10,
    dims=(2, 4, 8, 16),
    shell_dims=(8, 16, 32),
)
"""The paper's width (d_model 128, H 4, L 3), steps (100k), batch (256 tasks x 256 targets), learning rate
(1e-4) and evaluation (100 tasks x 500 points), THEORY.md section 5 / docs/experiments.md; for a GPU
(``--device cuda``) or a cluster (``--engine dask``). Digits keep 120 held-out points per task (the
smallest class has 174 points)."""

SCALES = {"quick": QUICK, "full": FULL, "paper": PAPER_SCALE}
