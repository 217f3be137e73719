"""The side computation shared by every NW processor family (UNet today; SD3 and Flux next).

Given the queries and the image keys of ONE softmax of an IP-Adapter image branch, exactly as
the stock processor forms them, this module computes the attention weights
A = softmax(q k^T * s), the Nadaraya-Watson weights W = softmax(-||q - k||^2 / 2h^2) at the
configured bandwidth h, and reduces their comparison over query rows to one statistics tensor
``[S, B, H]`` (S = ``len(STAT_NAMES)``, B batch rows, H heads). The family modules only find
q and k in their layer (hooks, head split, masks, adapters) and hand the result to the recorder.

Imports: torch, the math layer (:mod:`nw_adapter.core`) and the integration's config/recorder
state; nothing of diffusers, so one implementation serves every model family.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nw_adapter.core import bandwidth as bw
from nw_adapter.core import kernels, metrics
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.recorder import StepState


def resolve_bandwidth(
    config: NWProcessorConfig,
    state: StepState,
    q: torch.Tensor,
    k: torch.Tensor,
    attn_weights: torch.Tensor | None,
    s: float,
) -> torch.Tensor | float:
    """h per (batch, head) ``[B, H]`` (or a float) under ``config.bandwidth``.

    Only the data-dependent rules (median, fitted) read ``q`` [B, H, N, d] and ``k`` [B, H, M, d];
    they upcast to float32 themselves, so the other rules never copy a half-precision query.

    Args:
        config: the processor configuration (``bandwidth``, ``schedule_c``).
        state: the recorder's step state (``alpha``, ``sigma`` of the step for ``"schedule"``).
        q: queries ``[B, H, N, d]``.
        k: image keys ``[B, H, M, d]``.
        attn_weights: A ``[B, H, N, M]`` if already computed (used by ``"fitted"``).
        s: the softmax scale of the stock attention (1/sqrt(d) for SDPA).
    """
    rule = config.bandwidth
    if isinstance(rule, float):
        return rule
    if rule == "matched":
        return bw.matched_bandwidth(scale=s)
    if rule == "schedule":
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
    if attn_weights is None:
        attn_weights = torch.softmax((q @ k.transpose(-1, -2)) * s, dim=-1)
    return bw.fitted_bandwidth(attn_weights, q, k)[0]


def softmax_statistics(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    bandwidth: Callable[[torch.Tensor], torch.Tensor | float],
    q_norm: torch.Tensor,
    config: NWProcessorConfig,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Statistics of A = softmax(q k^T * s) against the NW weights W, per (batch row, head).

    Args:
        q: float32 queries ``[B, H, N, d]``.
        k: float32 image keys ``[B, H, M, d]`` of one softmax.
        scale: s, the stock softmax scale.
        bandwidth: ``A -> h`` (a float or ``[B, H]``), see :func:`resolve_bandwidth`.
        q_norm: mean query norm ``[B, H]``.
        config: ``nulls`` and ``null_rows`` are read.
        generator: the seeded generator of the nulls (``None`` when ``config.nulls`` is off).

    Returns:
        ``(stats [S, B, H], A [B, H, N, M], W [B, H, N, M])`` with the rows of ``stats`` in the
        order of :data:`~nw_adapter.integration.schema.STAT_NAMES`.
    """
    qk = q @ k.transpose(-1, -2)  # [B, H, N, M], shared by A and W
    logit_a = qk * scale
    attn_w = torch.softmax(logit_a, dim=-1)  # A [B, H, N, M]
    h = bandwidth(attn_w)
    logit_w = nw_logits_from_qk(qk, k, h)
    nw_w = torch.softmax(logit_w, dim=-1)  # W [B, H, N, M]
    # log A from its logits; log W of the float32 weights as recorded (KL(A || W) is inf
    # where W underflowed to 0 < A, as the statistic of the stored maps); JS is finite.
    log_a, log_w = torch.log_softmax(logit_a, dim=-1), torch.log(nw_w)
    if isinstance(h, torch.Tensor):
        h_t = h.float().expand(q.shape[:2])
    else:
        h_t = torch.full(q.shape[:2], float(h), device=q.device)
    knorm = k.norm(dim=-1)
    nan = torch.full(q.shape[:2], math.nan, device=q.device)
    if config.nulls and generator is not None:
        gen = generator
        a_n, w_n, q_n = attn_w, nw_w, q
        if config.null_rows is not None and q.shape[-2] > config.null_rows:
            rows = torch.randperm(q.shape[-2], generator=gen, device=q.device)[: config.null_rows]
            a_n, w_n, q_n = attn_w[..., rows, :], nw_w[..., rows, :], q[..., rows, :]
        perm_null = metrics.permutation_null_rho(a_n, w_n, generator=gen)
        norm_null = metrics.norm_equalised_null_rho(q_n, k, scale=scale, bandwidth=h, generator=gen)
    else:
        perm_null = norm_null = nan
    stats = torch.stack(
        [
            h_t,
            metrics.spearman_rho(attn_w, nw_w),
            perm_null.float(),
            norm_null.float(),
            metrics.pearson_raveled(attn_w, nw_w),
            metrics.kl_divergence(attn_w, nw_w, log_p=log_a, log_q=log_w).mean(-1),
            metrics.js_divergence(attn_w, nw_w, log_p=log_a, log_q=log_w).mean(-1),
            kernels.effective_sample_size(attn_w).mean(-1),
            kernels.effective_sample_size(nw_w).mean(-1),
            metrics.top1_agreement(attn_w, nw_w).mean(-1),
            q_norm,
            knorm.std(dim=-1, unbiased=False) / knorm.mean(dim=-1),
        ]
    ).float()  # [S, B, H]
    return stats, attn_w, nw_w


def nw_logits_from_qk(qk: torch.Tensor, k: torch.Tensor, h: torch.Tensor | float) -> torch.Tensor:
    """NW logits [B, H, N, M] from the attention's own ``q k^T`` (no second distance pass).

    ``-||q_n - k_i||^2 / 2h^2 = (q_n.k_i - ||k_i||^2 / 2) / h^2 - ||q_n||^2 / 2h^2``; the last term is
    constant along the keys and cancels in the softmax, so the logits are
    ``(q k^T - ||k||^2 / 2) / h^2`` with ``h`` a float or a ``[B, H]`` tensor (applied as
    ``h[..., None, None]``).

    Args:
        qk: ``[B, H, N, M]`` float32 dot products ``q_n.k_i``.
        k: ``[B, H, M, d]`` float32 keys.
        h: bandwidth, float or ``[B, H]`` tensor.

    Returns:
        ``[B, H, N, M]`` logits whose softmax is the NW weights.
    """
    inv_h2 = h.to(qk.dtype)[..., None, None] ** -2 if isinstance(h, torch.Tensor) else float(h) ** -2
    return (qk - 0.5 * k.square().sum(-1)[..., None, :]) * inv_h2


def pool_query_rows(
    m: torch.Tensor, factor: int, latent_hw: tuple[int, int] | None
) -> tuple[torch.Tensor, tuple[int, int]]:
    """Average-pool the query rows of maps [B, H, N, M] over the (h, w) grid by ``factor``."""
    b, nh, rows, keys = m.shape
    if latent_hw is not None:
        f = math.sqrt(latent_hw[0] * latent_hw[1] / rows)
        gh, gw = round(latent_hw[0] / f), round(latent_hw[1] / f)
    else:
        gh = gw = math.isqrt(rows)
    if gh * gw != rows:
        raise ValueError(f"map_downsample: cannot infer the query grid of {rows} rows; pass map_downsample=1")
    grid = m.permute(0, 1, 3, 2).reshape(b * nh * keys, 1, gh, gw)
    pooled = F.avg_pool2d(grid, factor, ceil_mode=True)
    ph, pw = pooled.shape[-2:]
    return pooled.reshape(b, nh, keys, ph * pw).permute(0, 1, 3, 2), (ph, pw)
