"""The rules every NW processor family shares: the CFG halves of a batch and the bandwidth of a step.

Plain functions of the configuration and the step's state (no processor, no recorder), so the
deferred statistics (:mod:`.deferred`) resolve a group's bandwidth with the same rule as a layer.
"""

from __future__ import annotations

import math

import torch

from nw_adapter.core import bandwidth as bw
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.steps import StepState

PASS_HALVES = ("cond", "uncond")
"""Half label of the denoiser pass with index 0 (positive prompt) and 1 (negative; Flux's true CFG)."""


def batch_halves(batch: int, state: StepState, *, cfg: bool, by_pass: bool = False) -> tuple[str, ...]:
    """Labels of the equal blocks of rows of a batch of ``batch`` rows, in batch order.

    - ``by_pass`` (Flux, whose batch is never [uncond; cond]): the whole batch is the half of its
      pass, ``("cond",)`` for the first (positive) pass of the step, ``("uncond",)`` for the
      second (true CFG's negative pass).
    - Otherwise ``("uncond", "cond")`` under classifier-free guidance (``cfg``), with
      perturbed-attention guidance's rows (``state.perturbed``) ``("uncond", "cond", "perturbed")``
      or ``("cond", "perturbed")``; ``("all",)`` for one block or when ``batch`` does not split
      into that many blocks.
    """
    if by_pass:
        return (PASS_HALVES[min(state.pass_index, 1)],)
    labels = ("uncond",) if cfg else ()
    labels = (*labels, "cond", *(("perturbed",) if state.perturbed else ()))
    return labels if len(labels) > 1 and batch % len(labels) == 0 else ("all",)


def pure_noise_schedule(config: NWProcessorConfig, state: StepState) -> bool:
    """Whether ``bandwidth="schedule"`` meets flow matching's first step, s = 1 (alpha = 0, sigma > 0):
    h = sigma / alpha is infinite there and the NW weights are uniform."""
    return config.bandwidth == "schedule" and state.alpha == 0 and state.sigma > 0


def resolve_bandwidth(
    config: NWProcessorConfig, state: StepState, q: torch.Tensor, k: torch.Tensor, s: float
) -> torch.Tensor | float:
    """h per (batch, head) ``[B, H]`` (or a float) under ``config.bandwidth``.

    Only the data-dependent rules (median, fitted) read ``q`` [B, H, N, d] and ``k`` [B, H, M, d];
    they upcast to float32 themselves, so the other rules never copy a half-precision query.
    ``"fitted"`` fits h to A = softmax(q k^T s).

    Args:
        config: ``bandwidth`` and ``schedule_c`` are read.
        state: the step's noise level (``alpha``, ``sigma``) for ``"schedule"``.
        q: queries ``[B, H, N, d]``. k: image keys ``[B, H, M, d]``.
        s: the softmax scale of the stock attention (1/sqrt(d) for SDPA).

    Returns:
        A float (fixed, matched, schedule; ``math.inf`` at s = 1, see :func:`pure_noise_schedule`)
        or a ``[B, H]`` tensor (median, fitted).

    Raises:
        RuntimeError: ``"schedule"`` without the step's noise level (outside a pipeline call).
    """
    rule = config.bandwidth
    if isinstance(rule, float):
        return rule
    if rule == "matched":
        return bw.matched_bandwidth(scale=s)
    if rule == "schedule":
        if pure_noise_schedule(config, state):
            return math.inf
        if not (math.isfinite(state.sigma) and math.isfinite(state.alpha) and state.alpha > 0):
            raise RuntimeError(
                "bandwidth='schedule' needs the scheduler's sigma_t/alpha_t of the current "
                "step; run the processor inside a pipeline call (or call "
                "recorder.begin_step(alpha=..., sigma=...)), or pick another bandwidth"
            )
        return float(bw.schedule_bandwidth(state.sigma, state.alpha, config.schedule_c))
    q, k = q.float(), k.float()
    if rule == "median":
        return bw.median_bandwidth(q, k)
    return bw.fitted_bandwidth(torch.softmax((q @ k.transpose(-1, -2)) * s, dim=-1), q, k)[0]
