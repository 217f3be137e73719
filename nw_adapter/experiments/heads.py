"""The learned model's own cross-attention heads, analysed like IP-Adapter's (THEORY.md 3-4).

For each time t, query points are put on the OT path of held-out targets,
x_t = t x1 + (1 - (1 - sigma_min) t) z, and every block's per-head attention logits
l^A_ij = q_j . k_i / sqrt(d_k) over the support are compared with

- NW logits in the head's own projected space, l^H_ij = -||q_j - k_i||^2 / 2h^2, with the matched
  bandwidth h^2 = sqrt(d_k) (same q.k coefficient as A; A differs only by the key prior
  exp(||k_i||^2 / 2 sqrt(d_k))). This rho is high BY ALGEBRA for any model whose key norms vary
  little, trained or not, so it is reported beside the same statistic of the untrained model
  (same architecture, random initialisation) and is no evidence of learned kernel smoothing;
- NW logits in data space, the exact posterior's -||x_t / t - s_i||^2 / 2h_t^2, h_t = b_t / t
  (the weights of the plug-in field at the same point): the informative comparison;
- permutation nulls of both (NW logits shuffled per row, expected ~0).

Every rank statistic is computed on LOGITS, never on softmax weights: ranks are invariant under
the softmax, but float32 weights underflow to tied zeros when h is small (near t = 1), and tied
zeros pull rho towards 0 for reasons that have nothing to do with the attention. The data-space
logits are computed in float64 so that distinct distances never round to one value.

The statistic is the paper's rho (:func:`nw_adapter.core.metrics.spearman_rho`: per-row Spearman,
averaged over rows), averaged over tasks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nw_adapter.core.bandwidth import matched_bandwidth
from nw_adapter.core.kernels import effective_sample_size, nw_logits
from nw_adapter.core.metrics import permutation_null_rho, spearman_rho, top1_agreement
from nw_adapter.core.paths import OTPath
from nw_adapter.experiments.model import AttentionRecord, ICFMModel
from nw_adapter.experiments.tasks import TaskBatch

__all__ = ["DEFAULT_TIMES", "analyse_heads", "head_statistics", "key_norm_cv"]

DEFAULT_TIMES = (0.05, 0.2, 0.4, 0.56, 0.7, 0.85, 0.95, 0.99)


def key_norm_cv(key: Tensor) -> Tensor:
    """Coefficient of variation of the key norms, std(||k_i||) / mean(||k_i||) over the m keys.

    Uses the POPULATION std (divisor m), as the UNet processor does: it describes these m keys,
    it does not estimate a wider population.

    Args:
        key: ``[..., m, d_k]``.

    Returns:
        ``[...]``.
    """
    norm = key.norm(dim=-1)
    return norm.std(dim=-1, correction=0) / norm.mean(dim=-1)


def head_statistics(
    record: AttentionRecord,
    data_logits: Tensor,
    *,
    head_bandwidth: float | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, Tensor]:
    """Rank statistics of one block's heads against head-space and data-space NW (from logits).

    Args:
        record: The block's attention (``query [B, H, n, d_k]``, ``key [B, H, m, d_k]``,
            ``logits [B, H, n, m]``).
        data_logits: Data-space NW logits ``-||x / a - s_i||^2 / 2h^2``, ``[B, 1, n, m]`` or
            ``[B, H, n, m]``.
        head_bandwidth: h of the head-space NW logits; None = matched, h^2 = sqrt(d_k).
        generator: Seed of the permutation nulls.

    Returns:
        Per head (``[H]``, mean over tasks): ``rho_head``, ``rho_head_null``, ``rho_data``,
        ``rho_null``, ``top1_data`` (share of rows whose top key agrees with the data-space
        posterior's), ``key_norm_cv``, ``neff_attn``, ``neff_head_nw``.
    """
    h = matched_bandwidth(record.query.shape[-1]) if head_bandwidth is None else head_bandwidth
    head_logits = nw_logits(record.query.double(), record.key.double(), h)  # [B, H, n, m]
    attn = record.logits
    data = data_logits.expand_as(attn)
    return {
        "rho_head": spearman_rho(attn, head_logits).nanmean(0),
        "rho_head_null": permutation_null_rho(attn, head_logits, generator=generator).nanmean(0),
        "rho_data": spearman_rho(attn, data).nanmean(0),
        "rho_null": permutation_null_rho(attn, data, generator=generator).nanmean(0),
        "top1_data": top1_agreement(attn, data).mean((0, 2)),
        "key_norm_cv": key_norm_cv(record.key).mean(0),
        "neff_attn": effective_sample_size(torch.softmax(attn.double(), -1)).mean((0, 2)),
        "neff_head_nw": effective_sample_size(torch.softmax(head_logits, -1)).mean((0, 2)),
    }


@torch.no_grad()
def analyse_heads(
    model: ICFMModel,
    tasks: TaskBatch,
    times: tuple[float, ...] = DEFAULT_TIMES,
    *,
    sigma_min: float = 0.01,
    seed: int = 0,
) -> list[dict[str, float]]:
    """rho between each head's attention and NW weights across t (all ranks taken on logits).

    Args:
        model: A model (trained, or freshly initialised for the untrained baseline).
        tasks: Tasks with full supports ``[B, m, d]`` (no padding) and targets ``[B, n, d]``
            (queries come from the targets).
        times: Times t in (0, 1].
        sigma_min: OT path sigma_min.
        seed: Seed of the path noise and of the permutation null.

    Returns:
        One dict per (t, layer, head): ``t``, ``h_data`` (b_t / t), ``layer``, ``head`` and the
        statistics of :func:`head_statistics`, plus ``neff_data_nw``.
    """
    if tasks.support_mask is not None and not bool(tasks.support_mask.all()):
        raise ValueError("analyse_heads needs full supports; pass tasks without padded (masked) keys.")
    path = OTPath(sigma_min)
    gen = torch.Generator().manual_seed(int(seed) + 777)
    rows: list[dict[str, float]] = []
    for t in times:
        if not 0.0 < t <= 1.0:
            raise ValueError(f"times must lie in (0, 1], got {t}.")
        a, b = path.alpha(t), path.sigma(t)
        x_t = a * tasks.target + b * torch.randn(tasks.target.shape, generator=gen)
        _, records = model(x_t, t, tasks.support, None, return_attention=True)
        data_logits = nw_logits((x_t / a).double(), tasks.support.double(), b / a)[:, None]  # [B, 1, n, m]
        neff_data = float(effective_sample_size(torch.softmax(data_logits, -1)).mean())
        for layer, rec in enumerate(records):
            stats = head_statistics(rec, data_logits, generator=gen)
            for head in range(rec.logits.shape[1]):
                row = {"t": float(t), "h_data": float(b / a), "layer": layer, "head": head}
                row.update({name: float(value[head]) for name, value in stats.items()})
                row["neff_data_nw"] = neff_data
                rows.append(row)
    return rows
