"""The bandwidth path as data: the lines ``bandwidth.png`` and the report's figure both draw.

Per arm (the trained adapter, the scale-matched control, and in a calibrated run the exact NW head
measured in the same pipeline), per step: the schedule's h and the geometric mean over units
(reference images, else pipeline calls) of each unit's geometric mean ``logit_scale`` over layers,
heads and adapters (the verdict's own per-step means,
:func:`nw_adapter.correlate.verdict.image_step_means`), with the 95% Student t interval over units;
and each line's exponent ``-d log logit_scale / d log h`` (theory 2) as the verdict computes it, the
mean over units of the per-unit OLS exponents (the control's over units and draws, its path read
with the scale matched once per run: ``log_control_path_k``, as the verdict reads it).

Plain numpy; the figures (:func:`nw_adapter.correlate.plotting.bandwidth_figure`,
:func:`nw_adapter.correlate.html_report.rho_figures.bandwidth_figure`) only choose how to draw it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["ARMS", "PathLine", "bandwidth_lines", "guide"]

ARMS: dict[str, tuple[str, str]] = {
    "adapter": ("trained adapter", "#1f77b4"),
    "control": ("scale-matched control", "#ff7f0e"),
    "exact": ("exact NW head (measured)", "#2ca02c"),
}
"""Per arm, its name in the figures' legends and its colour (the control's name is the figures' own:
they name the kind of control that ran)."""


@dataclass(frozen=True)
class PathLine:
    """One arm's bandwidth path, its steps in increasing h.

    Attributes:
        arm: ``"adapter"``, ``"control"`` or ``"exact"`` (:data:`ARMS`).
        steps: the steps (denoiser calls) with a value.
        h: per step, the geometric mean over units of the schedule's h.
        log_mean, log_low, log_high: per step, the mean over units of log ``logit_scale`` and its 95%
            Student t interval (NaN bounds with one unit).
        units: the most units of any step.
        exponent: the mean over units (and draws) of the per-unit exponents (None: none computable).
    """

    arm: str
    steps: list[int]
    h: list[float]
    log_mean: list[float]
    log_low: list[float]
    log_high: list[float]
    units: int
    exponent: float | None

    @property
    def mean(self) -> list[float]:
        """The geometric means of ``logit_scale`` per step."""
        return [math.exp(v) for v in self.log_mean]

    @property
    def low(self) -> list[float]:
        """The intervals' lower ends (geometric; NaN where not computable)."""
        return [math.exp(v) if math.isfinite(v) else math.nan for v in self.log_low]

    @property
    def high(self) -> list[float]:
        """The intervals' upper ends (geometric; NaN where not computable)."""
        return [math.exp(v) if math.isfinite(v) else math.nan for v in self.log_high]


def _line(arm: str, by_unit: dict, key: str, sloped: Sequence[str]) -> PathLine | None:
    from nw_adapter.core.intervals import t_interval
    from nw_adapter.correlate.verdict import slope_on_log_h

    per_step: dict[int, list[tuple[float, float]]] = {}
    for rows in by_unit.values():
        for row in rows:
            h, value = row.get("h_schedule"), row.get(key)
            if value is not None and h is not None and math.isfinite(h) and h > 0:
                per_step.setdefault(int(row["step"]), []).append((math.log(h), value))
    if not per_step:
        return None
    steps = sorted(per_step, key=lambda step: float(np.mean([p[0] for p in per_step[step]])))
    stats = [t_interval([p[1] for p in per_step[step]]) for step in steps]
    exponents = [
        v
        for rows in by_unit.values()
        for name in sloped
        if (v := slope_on_log_h(rows, name, -1.0)) is not None
    ]
    return PathLine(
        arm=arm,
        steps=steps,
        h=[math.exp(float(np.mean([p[0] for p in per_step[step]]))) for step in steps],
        log_mean=[float(m) for m, _, _ in stats],
        log_low=[float(lo) for _, lo, _ in stats],
        log_high=[float(hi) for _, _, hi in stats],
        units=max(len(per_step[step]) for step in steps),
        exponent=float(np.mean(exponents)) if exponents else None,
    )


def bandwidth_lines(records: Sequence[dict], half: str) -> list[PathLine]:
    """The lines of the bandwidth path: the adapter's, the control's (with its draws) and the exact
    head's (a calibrated run's ``_exact`` columns), each left out where no step has a positive
    ``logit_scale`` and h (module docstring)."""
    from nw_adapter.correlate.verdict import EXACT, image_step_means
    from nw_adapter.integration.schema import control_draws

    draws = control_draws({name for r in records for name in r})
    by_unit = image_step_means(records, half, draws)
    controls = [f"log_control_path_{k}" for k in range(draws)]
    for rows in by_unit.values():  # the control's line: per step, the mean over its draws
        for row in rows:
            logs = [row[name] for name in controls if row.get(name) is not None]
            row["log_control"] = float(np.mean(logs)) if logs else None
    arms = [
        _line("adapter", by_unit, "log_logit_scale", ("log_logit_scale",)),
        _line("control", by_unit, "log_control", controls) if draws else None,
        _line("exact", image_step_means(records, half, 0, EXACT), "log_logit_scale", ("log_logit_scale",)),
    ]
    return [line for line in arms if line is not None]


def guide(line: PathLine, exponent: float = 2.0) -> tuple[list[float], list[float]]:
    """The line of ``exponent`` through ``line``'s centre (mean log h, mean log logit_scale) over its
    range of h: ``(h, logit_scale)`` at 30 points (an exact NW head: ``c / h^2``)."""
    centre_h, centre_scale = float(np.mean(np.log(line.h))), float(np.mean(line.log_mean))
    grid = np.linspace(math.log(min(line.h)), math.log(max(line.h)), 30)
    return np.exp(grid).tolist(), np.exp(centre_scale - exponent * (grid - centre_h)).tolist()
