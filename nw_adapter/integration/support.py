"""Support sets at run time: the per-reference attention mass of one softmax, pooled per CFG half.

A processor whose adapter was given several reference images (diffusers' list-per-adapter
convention, ``ip_adapter_image=[[a, b, c]]``: one softmax over ``m x T`` image keys) hands the
queries and keys of that softmax to :func:`support_values`; the recorder writes the rows as the
columns of :func:`~nw_adapter.integration.schema.support_columns` (``ref_mass_{r}``, ``ref_entropy``,
``ref_row_entropy``). The quantities are :mod:`nw_adapter.core.support`'s (the specification, from
logits via logsumexp), averaged over the batch rows of each CFG half as every statistic is.

The theory's prediction for the same references is not recorded here: its posterior over them
lives in the space of x_t, not in the head's q/k space
(:class:`~nw_adapter.integration.latent_probe.LatentSupportProbe`, THEORY.md 4b).
"""

from __future__ import annotations

import torch

from nw_adapter.core.support import support_statistics

__all__ = ["reference_count", "support_references", "support_rows", "support_values"]


def reference_count(states: torch.Tensor) -> int:
    """m, the reference images of one adapter's image tokens ``[B, m, T, D]`` (1 for 3-D tokens)."""
    return int(states.shape[1]) if states.dim() == 4 else 1


def support_rows(references: int) -> int:
    """Rows of :func:`support_values`: m masses, 2 entropies."""
    return references + 2


def support_references(rows: int) -> int:
    """m from the rows of a :func:`support_values` tensor (the inverse of :func:`support_rows`)."""
    return rows - 2


def support_values(
    q: torch.Tensor, k: torch.Tensor, *, scale: float, references: int, halves: int
) -> torch.Tensor:
    """``[support_rows(m), halves, H]``: per CFG half and head, the attention mass on each reference,
    then ``entropy`` and ``row_entropy`` (:class:`~nw_adapter.core.support.SupportStatistics`; the
    order of :func:`~nw_adapter.integration.schema.support_columns` after ``num_refs``).

    Args:
        q: float32 queries ``[B, H, N, d]``; k: the softmax's keys ``[B, H, m T, d]``.
        scale: the softmax scale s.
        references: m. halves: the CFG halves the batch is split into (equal blocks of rows).
    """
    out = support_statistics(q, k, scale=scale, references=references)
    per_row = torch.cat([out.mass, torch.stack([out.entropy, out.row_entropy], -1)], dim=-1)  # [B, H, rows]
    batch, heads = per_row.shape[:2]
    pooled = per_row.view(halves, batch // halves, heads, -1).mean(1)  # [halves, H, rows]
    return pooled.permute(2, 0, 1)
