"""ODE samplers for velocity fields: ``dx/dt = v(x, t)`` integrated along a time grid.

One uniform signature (in the spirit of k-diffusion): ``sample_ode(field, x, grid, method=...,
callback=...)``. The grid may increase (flow paths, t: 0 -> 1) or decrease (SD3/Flux sigma
convention, s: 1 -> 0). ``callback`` receives, at every step before the update, a dict
``{"x": x_i, "i": i, "t": t_i, "t_next": t_{i+1}, "velocity": v(x_i, t_i)}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["METHODS", "sample_ode", "time_grid"]

METHODS = ("euler", "heun")


def time_grid(
    num_points: int, t_start: float = 1e-5, t_end: float = 1.0, *, dtype: torch.dtype = torch.float64
) -> Tensor:
    """Uniform grid of ``num_points`` times from ``t_start`` to ``t_end`` (both included).

    The paper's evaluation uses ``time_grid(100)`` (100 points on ``[1e-5, 1]``).

    Args:
        num_points: number of grid points (>= 2), i.e. ``num_points - 1`` steps.
        t_start: first time.
        t_end: last time (may be smaller than ``t_start`` for decreasing grids).
        dtype: dtype of the grid.

    Returns:
        ``[num_points]`` tensor.
    """
    if isinstance(num_points, bool) or not isinstance(num_points, int) or num_points < 2:
        raise ValueError(f"num_points must be an int >= 2, got {num_points!r}")
    if t_start == t_end:
        raise ValueError(f"t_start and t_end must differ, got both = {t_start}")
    return torch.linspace(t_start, t_end, num_points, dtype=dtype)


def _check_grid(grid: Tensor) -> Tensor:
    if not isinstance(grid, Tensor) or grid.dim() != 1 or grid.numel() < 2:
        raise ValueError("grid must be a 1-D tensor of at least 2 times (see time_grid)")
    if not bool(torch.isfinite(grid).all()):
        raise ValueError("grid contains NaN or inf times")
    dt = grid[1:] - grid[:-1]
    if not (bool((dt > 0).all()) or bool((dt < 0).all())):
        raise ValueError("grid must be strictly monotone (all increasing or all decreasing)")
    return grid


def sample_ode(
    field: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    grid: Tensor,
    *,
    method: str = "euler",
    callback: Callable[[dict[str, Any]], None] | None = None,
) -> Tensor:
    """Integrate ``dx/dt = field(x, t)`` from ``grid[0]`` to ``grid[-1]``.

    * Euler: ``x_{i+1} = x_i + (t_{i+1} - t_i) v(x_i, t_i)``.
    * Heun (explicit trapezoid): ``x~ = x_i + dt v(x_i, t_i)``,
      ``x_{i+1} = x_i + dt (v(x_i, t_i) + v(x~, t_{i+1})) / 2``; on the last step, if the field
      reports ``field.defined_at(t_end) == False`` (e.g. rectified flow at t = 1), an Euler step
      is taken instead.

    The field is called with ``t`` as a 0-dim tensor on ``x``'s device.

    Args:
        field: callable ``(x [..., n, d], t) -> velocity [..., n, d]``, e.g. a
            :class:`nw_adapter.core.paths.NWVelocityField`.
        x: ``[..., n, d]`` initial points at ``grid[0]`` (e.g. standard normal noise).
        grid: ``[K]`` strictly monotone times.
        method: ``"euler"`` or ``"heun"``.
        callback: optional function called once per step with a dict (see module docstring).

    Returns:
        ``[..., n, d]`` points at ``grid[-1]``.

    Example:
        >>> from nw_adapter.core.paths import NWVelocityField, OTPath
        >>> field = NWVelocityField(torch.randn(50, 2), OTPath(sigma_min=0.01))
        >>> samples = sample_ode(field, torch.randn(500, 2), time_grid(100), method="heun")
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ValueError("x must be a floating-point tensor [..., n, d]")
    if not callable(field):
        raise ValueError("field must be callable as field(x, t)")
    grid = _check_grid(grid).to(x.device)
    steps = grid.numel() - 1
    defined_at = getattr(field, "defined_at", None)
    last_heun = method == "heun" and (defined_at is None or bool(defined_at(grid[-1])))
    for i in range(steps):
        t, t_next = grid[i], grid[i + 1]
        dt = (t_next - t).to(x.dtype)
        v = field(x, t)
        if callback is not None:
            callback({"x": x, "i": i, "t": t, "t_next": t_next, "velocity": v})
        x_euler = x + dt * v
        if method == "euler" or (i == steps - 1 and not last_heun):
            x = x_euler.to(x.dtype)
        else:
            v_next = field(x_euler.to(x.dtype), t_next)
            x = (x + dt * 0.5 * (v + v_next)).to(x.dtype)
    return x
