"""Support sets at run time: the per-reference mass of one softmax, pooled per CFG half.

A processor whose adapter was given several reference images (diffusers' list-per-adapter
convention, ``ip_adapter_image=[[a, b, c]]``: one softmax over ``m x T`` image keys) hands the
queries and keys of that softmax to :func:`support_values`; the recorder writes the rows as the
columns of :func:`~nw_adapter.integration.schema.support_columns` (``ref_mass_{r}``,
``ref_mass_nw_{r}``, the entropies). The quantities are :mod:`nw_adapter.core.support`'s (the
specification, from logits via logsumexp), averaged over the batch rows of each CFG half as every
statistic is; the NW weights are taken at the schedule's bandwidth :func:`support_bandwidth`, whatever
``config.bandwidth`` the other statistics use (the theory's prediction needs no fitted h).
"""

from __future__ import annotations

import math

import torch

from nw_adapter.core.support import support_statistics
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.steps import StepState

__all__ = ["reference_count", "support_bandwidth", "support_rows", "support_values"]


def reference_count(states: torch.Tensor) -> int:
    """m, the reference images of one adapter's image tokens ``[B, m, T, D]`` (1 for 3-D tokens)."""
    return int(states.shape[1]) if states.dim() == 4 else 1


def support_bandwidth(config: NWProcessorConfig, state: StepState) -> float:
    """The NW bandwidth of the support-set columns: ``schedule_c * sigma_t / alpha_t`` of the step.

    ``math.inf`` at flow matching's pure-noise step (alpha = 0, sigma > 0: uniform NW weights);
    NaN where the step's noise level is unknown (outside a pipeline call).
    """
    alpha, sigma = float(state.alpha), float(state.sigma)
    if alpha == 0 and sigma > 0:
        return math.inf
    if not (math.isfinite(alpha) and math.isfinite(sigma) and alpha > 0):
        return math.nan
    return config.schedule_c * sigma / alpha


def support_rows(references: int) -> int:
    """Rows of :func:`support_values`: the bandwidth, 2 m masses, 4 entropies."""
    return 1 + 2 * references + 4


def support_values(
    q: torch.Tensor, k: torch.Tensor, *, scale: float, h: float, references: int, halves: int
) -> torch.Tensor:
    """``[support_rows(m), halves, H]``: per CFG half and head, the bandwidth h, the attention mass
    on each reference, the NW mass on each, then ``entropy``, ``entropy_nw``, ``row_entropy``,
    ``row_entropy_nw`` (:class:`~nw_adapter.core.support.SupportStatistics`; the order of
    :func:`~nw_adapter.integration.schema.support_columns` after ``num_refs``).

    Args:
        q: float32 queries ``[B, H, N, d]``; k: the softmax's keys ``[B, H, m T, d]``.
        scale: the softmax scale s. h: the NW bandwidth (:func:`support_bandwidth`).
        references: m. halves: the CFG halves the batch is split into (equal blocks of rows).
    """
    out = support_statistics(q, k, scale=scale, h=h, references=references)
    per_row = torch.cat(
        [
            torch.full_like(out.entropy, h)[..., None],
            out.mass,
            out.mass_nw,
            torch.stack([out.entropy, out.entropy_nw, out.row_entropy, out.row_entropy_nw], -1),
        ],
        dim=-1,
    )  # [B, H, rows]
    batch, heads = per_row.shape[:2]
    pooled = per_row.view(halves, batch // halves, heads, -1).mean(1)  # [halves, H, rows]
    return pooled.permute(2, 0, 1)
