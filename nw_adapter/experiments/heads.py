"""The learned model's own cross-attention heads, analysed like IP-Adapter's (THEORY.md 3-4).

For each time t, query points are put on the OT path of held-out targets,
x_t = t x1 + (1 - (1 - sigma_min) t) z, and every block's per-head attention
A = softmax(q k^T / sqrt(d_k)) over the support is compared with

- NW weights in the head's own projected space: softmax_i(-||q - k_i||^2 / 2h^2) with the matched
  bandwidth h^2 = sqrt(d_k) (same q.k coefficient as A; A differs only by the key prior
  exp(||k_i||^2 / 2 sqrt(d_k)));
- NW weights in data space: the exact posterior softmax_i(-||x_t / t - s_i||^2 / 2h_t^2),
  h_t = b_t / t, i.e. the weights of the plug-in field at the same point;
- permutation nulls (NW weights shuffled per row, expected ~0).

The statistic is the paper's rho (:func:`nw_adapter.core.metrics.spearman_rho`: per-row Spearman,
averaged over rows), averaged over tasks.
"""

from __future__ import annotations

import torch

from nw_adapter.core.bandwidth import matched_bandwidth
from nw_adapter.core.kernels import effective_sample_size, nw_weights
from nw_adapter.core.metrics import permutation_null_rho, spearman_rho
from nw_adapter.core.paths import OTPath
from nw_adapter.experiments.model import ICFMModel
from nw_adapter.experiments.tasks import TaskBatch

__all__ = ["DEFAULT_TIMES", "analyse_heads"]

DEFAULT_TIMES = (0.05, 0.2, 0.4, 0.56, 0.7, 0.85, 0.95, 0.99)


@torch.no_grad()
def analyse_heads(
    model: ICFMModel,
    tasks: TaskBatch,
    times: tuple[float, ...] = DEFAULT_TIMES,
    *,
    sigma_min: float = 0.01,
    seed: int = 0,
) -> list[dict[str, float]]:
    """rho between each head's attention and NW weights across t.

    Args:
        model: Trained model.
        tasks: Tasks with support ``[B, m, d]`` and targets ``[B, n, d]`` (queries come from
            the targets).
        times: Times t in (0, 1].
        sigma_min: OT path sigma_min.
        seed: Seed of the path noise and of the permutation null.

    Returns:
        One dict per (t, layer, head): ``t``, ``h_data`` (b_t / t), ``layer``, ``head``,
        ``rho_head`` (matched bandwidth, head space), ``rho_data`` (data space),
        ``rho_null`` / ``rho_head_null`` (permutation nulls of both), ``key_norm_cv`` (coefficient of
        variation of the head's key norms: the key prior, and so rho_head < 1, comes from it),
        ``neff_attn``, ``neff_head_nw``, ``neff_data_nw``.
    """
    path = OTPath(sigma_min)
    gen = torch.Generator().manual_seed(int(seed) + 777)
    mask = tasks.support_mask
    rows: list[dict[str, float]] = []
    for t in times:
        if not 0.0 < t <= 1.0:
            raise ValueError(f"times must lie in (0, 1], got {t}.")
        a, b = path.alpha(t), path.sigma(t)
        x_t = a * tasks.target + b * torch.randn(tasks.target.shape, generator=gen)
        _, records = model(x_t, t, tasks.support, mask, return_attention=True)
        w_data = nw_weights(x_t / a, tasks.support, b / a, support_mask=mask)[:, None]  # [B, 1, n, m]
        head_mask = None if mask is None else mask[:, None]
        for layer, rec in enumerate(records):
            h = matched_bandwidth(rec.query.shape[-1])
            w_head = nw_weights(rec.query, rec.key, h, support_mask=head_mask)  # [B, H, n, m]
            w_data_h = w_data.expand_as(rec.weights)
            rho_head = spearman_rho(rec.weights, w_head).nanmean(0)
            rho_data = spearman_rho(rec.weights, w_data_h).nanmean(0)
            rho_null = permutation_null_rho(rec.weights, w_data_h, generator=gen).nanmean(0)
            rho_head_null = permutation_null_rho(rec.weights, w_head, generator=gen).nanmean(0)
            key_norm = rec.key.norm(dim=-1)  # [B, H, m]; equal norms <=> attention == matched NW exactly
            key_cv = (key_norm.std(-1) / key_norm.mean(-1)).mean(0)
            neff_attn = effective_sample_size(rec.weights).mean((0, 2))
            neff_head = effective_sample_size(w_head).mean((0, 2))
            neff_data = float(effective_sample_size(w_data).mean())
            for head in range(rec.weights.shape[1]):
                rows.append(
                    {
                        "t": float(t),
                        "h_data": float(b / a),
                        "layer": layer,
                        "head": head,
                        "rho_head": float(rho_head[head]),
                        "rho_data": float(rho_data[head]),
                        "rho_null": float(rho_null[head]),
                        "rho_head_null": float(rho_head_null[head]),
                        "key_norm_cv": float(key_cv[head]),
                        "neff_attn": float(neff_attn[head]),
                        "neff_head_nw": float(neff_head[head]),
                        "neff_data_nw": neff_data,
                    }
                )
    return rows
