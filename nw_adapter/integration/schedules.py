"""Noise levels of a diffusers scheduler: timestep -> (alpha_t, sigma_t, h_t = sigma_t / alpha_t).

All numbers are in variance-preserving (VP) terms, x_t = alpha_t x_0 + sigma_t eps:

- schedulers without ``sigmas`` (DDIM, PNDM, DDPM ...): alpha_t = sqrt(abar_t),
  sigma_t = sqrt(1 - abar_t), with ``alphas_cumprod`` linearly interpolated at fractional t;
- schedulers with ``sigmas`` aligned to ``timesteps`` and ``alphas_cumprod`` (Euler,
  Euler-ancestral, LMS, Heun, DPM-Solver++ ...): their sigma s is the variance-exploding
  noise level s = sigma_t / alpha_t, so alpha_t = 1 / sqrt(1 + s^2), sigma_t = s alpha_t
  and h_t = s exactly (also with Karras sigmas);
- flow-matching schedulers (``FlowMatch*``, whose config has a ``shift``; or any scheduler with
  ``use_flow_sigmas`` / ``prediction_type="flow_prediction"``, e.g. UniPC for Wan, which also
  carries an unused ``alphas_cumprod``): x_s = (1 - s) x_0 + s eps, alpha = 1 - s, sigma = s,
  h = s / (1 - s), with s = ``sigmas[i]`` as the scheduler set it (shift, dynamic shifting);
- other schedulers with ``sigmas`` and no ``alphas_cumprod`` (EDM): the variance-exploding
  convention above, h = s.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _sigma_table(scheduler: Any) -> torch.Tensor | None:
    sigmas = getattr(scheduler, "sigmas", None)
    timesteps = getattr(scheduler, "timesteps", None)
    if not isinstance(sigmas, torch.Tensor) or not isinstance(timesteps, torch.Tensor):
        return None
    if sigmas.ndim != 1 or sigmas.numel() != timesteps.numel() + 1:
        return None
    return sigmas.detach().to("cpu", torch.float64)


def is_flow_matching(scheduler: Any) -> bool:
    """Whether ``scheduler`` uses the rectified-flow convention x_s = (1 - s) x_0 + s eps.

    Example:
        >>> from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler
        >>> is_flow_matching(FlowMatchEulerDiscreteScheduler()), is_flow_matching(EulerDiscreteScheduler())
        (True, False)
    """
    config = getattr(scheduler, "config", None)
    get = config.get if hasattr(config, "get") else (lambda key, default=None: default)
    if get("use_flow_sigmas", False) or get("prediction_type") == "flow_prediction":
        return True
    return getattr(scheduler, "alphas_cumprod", None) is None and get("shift") is not None


def _vp_from_abar(abar: float) -> tuple[float, float, float]:
    abar = min(max(abar, 0.0), 1.0)
    alpha, sigma = math.sqrt(abar), math.sqrt(1.0 - abar)
    return alpha, sigma, (sigma / alpha if alpha > 0 else math.inf)


def noise_level(scheduler: Any, timestep: float, step_index: int | None = None) -> tuple[float, float, float]:
    """(alpha_t, sigma_t, h_t) of ``scheduler`` at ``timestep`` (VP convention, see module doc).

    Args:
        scheduler: a diffusers scheduler after ``set_timesteps``.
        timestep: the timestep passed to the UNet.
        step_index: index of the step in ``scheduler.timesteps``; needed for sigma-based
            schedulers (else the timestep is looked up in ``scheduler.timesteps``).

    Returns:
        Python floats (alpha, sigma, h = sigma / alpha); NaNs when the scheduler exposes
        neither ``alphas_cumprod`` nor ``sigmas``.

    Example:
        >>> from diffusers import DDIMScheduler
        >>> s = DDIMScheduler(); s.set_timesteps(2)
        >>> round(noise_level(s, 1)[0], 4)
        0.9999
    """
    sigmas = _sigma_table(scheduler)
    abar_table = getattr(scheduler, "alphas_cumprod", None)
    if sigmas is not None:
        if step_index is None or not 0 <= step_index < sigmas.numel() - 1:
            matches = (scheduler.timesteps.detach().cpu().double() - float(timestep)).abs().argmin()
            step_index = int(matches)
        s = float(sigmas[step_index])
        if is_flow_matching(scheduler):  # x = (1 - s) x0 + s eps
            return 1.0 - s, s, (s / (1.0 - s) if s < 1 else math.inf)
        alpha = 1.0 / math.sqrt(1.0 + s * s)
        return alpha, s * alpha, s
    if isinstance(abar_table, torch.Tensor):
        table = abar_table.detach().to("cpu", torch.float64)
        t = min(max(float(timestep), 0.0), table.numel() - 1.0)
        lo = int(math.floor(t))
        hi = min(lo + 1, table.numel() - 1)
        frac = t - lo
        abar = float(table[lo]) * (1 - frac) + float(table[hi]) * frac
        return _vp_from_abar(abar)
    return math.nan, math.nan, math.nan


def schedule_table(scheduler: Any) -> list[dict[str, float]]:
    """One dict per entry of ``scheduler.timesteps``: step, timestep, alpha, sigma, h.

    Example:
        >>> from diffusers import DDIMScheduler
        >>> s = DDIMScheduler(); s.set_timesteps(3)
        >>> [row["timestep"] for row in schedule_table(s)]
        [666.0, 333.0, 0.0]
    """
    timesteps = scheduler.timesteps.detach().cpu().double().tolist()
    rows = []
    for i, t in enumerate(timesteps):
        alpha, sigma, h = noise_level(scheduler, t, i)
        rows.append({"step": i, "timestep": t, "alpha": alpha, "sigma": sigma, "h": h})
    return rows
