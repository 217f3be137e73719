"""Every reading of "is this attention head a Nadaraya-Watson smoother?" for any q and k (THEORY.md 4).

:func:`compare_attention` takes the queries and keys of a dot-product attention head, recomputes
its weights ``A = softmax(scale q k^T)`` and compares them with the NW weights in the head's own
q/k space, ``NW = softmax(-||q - k_i||^2 / 2h^2)``, per (batch row, head): the rank statistics
and their three nulls (:mod:`nw_adapter.core.metrics`), the divergences, effective sample sizes,
and the readings that split the attention into a key prior and an NW smoother of the query
(:mod:`nw_adapter.core.readings`). It is a plain reference of these statistics, float64
capable. The processors record all of them on the fly, per (layer, head, step, CFG half)
(:mod:`nw_adapter.integration.stats`, ``NWProcessorConfig(readings=True)``, the default), the
readings with ``h_eff`` fitted on ``fit_rows`` evenly spaced query rows (``h_eff_se``: the
standard error that adds) where this function fits it on all rows.

A reading is evidence only against a control with the same algebra but not the learning (the
same queries against an untrained adapter's keys, or the nulls): a random head already has
``rho`` well above 0 and ``nw_gain > 0``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nw_adapter.core.bandwidth import matched_bandwidth, median_bandwidth
from nw_adapter.core.kernels import compute_dtype, effective_sample_size, no_autocast, nw_logits
from nw_adapter.core.metrics import (
    js_from_logits,
    kl_from_logits,
    masked_std,
    norm_matched_null_rho,
    permutation_null_rho,
    qk_spread_null_rho,
    spearman_rho,
    top1_agreement,
)
from nw_adapter.core.readings import READING_NAMES, nw_readings

__all__ = ["BANDWIDTH_RULES", "COMPARISON_NAMES", "compare_attention"]

#: Bandwidth rules of :func:`compare_attention` (besides a positive float).
BANDWIDTH_RULES: tuple[str, ...] = ("matched", "fitted", "median")

#: The keys of :func:`compare_attention`'s result, in order.
COMPARISON_NAMES: tuple[str, ...] = (
    "bandwidth",
    "rho",
    "rho_perm_null",
    "rho_norm_matched_null",
    "rho_spread_null",
    "pearson",
    "kl",
    "js",
    "neff_attn",
    "neff_nw",
    "top1",
    "key_norm_cv",
    "qk_spread_ratio",
    *READING_NAMES,
)


def _check_inputs(
    q: object, k: object, scale: object, bandwidth: object, valid: object, seed: object
) -> None:
    for name, x, dims in (("q", q, "[B, H, N, d]"), ("k", k, "[B, H, M, d]")):
        if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a floating-point tensor {dims}, got {shape}")
        if x.shape[-2] < 1 or x.shape[-1] < 1:
            raise ValueError(f"{name} must have at least one row and one feature, got {tuple(x.shape)}")
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} contains NaN or inf values; remove them or mask the keys with valid")
    assert isinstance(q, Tensor) and isinstance(k, Tensor)
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q [B, H, N, d] and k [B, H, M, d] must share B, H and d, "
            f"got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if (
        isinstance(scale, bool)
        or not isinstance(scale, int | float)
        or not (math.isfinite(scale) and scale > 0)
    ):
        raise ValueError(
            f"scale must be a finite float > 0 (the softmax scale, e.g. 1/sqrt(d)), got {scale!r}"
        )
    if isinstance(bandwidth, str):
        if bandwidth not in BANDWIDTH_RULES:
            raise ValueError(f"bandwidth must be one of {BANDWIDTH_RULES} or a float > 0, got {bandwidth!r}")
    elif (
        isinstance(bandwidth, bool)
        or not isinstance(bandwidth, int | float)
        or not (math.isfinite(bandwidth) and bandwidth > 0)
    ):
        raise ValueError(
            f"bandwidth must be one of {BANDWIDTH_RULES} or a finite float > 0, got {bandwidth!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int (the nulls' generator seed), got {seed!r}")
    if valid is not None:
        b, h, m = q.shape[0], q.shape[1], k.shape[-2]
        ok = isinstance(valid, Tensor) and valid.dtype == torch.bool and 1 <= valid.dim() <= 3
        if ok:
            try:
                ok = torch.broadcast_shapes(_as_key_mask(valid).shape, (b, h, m)) == (b, h, m)
            except RuntimeError:
                ok = False
        if not ok:
            shape = tuple(valid.shape) if isinstance(valid, Tensor) else type(valid).__name__
            raise ValueError(
                f"valid must be a bool key mask [B, H, M], [B, M] or [M] = [{b}, {h}, {m}], got {shape}"
            )
        if not bool(_as_key_mask(valid).expand(b, h, m).any(-1).all()):
            raise ValueError(
                "valid leaves a (batch row, head) without any key; keep at least one key per row"
            )


def _as_key_mask(valid: Tensor) -> Tensor:
    """``[M]`` / ``[B, M]`` / ``[B, H, M]`` -> a mask broadcastable to ``[B, H, M]``."""
    return valid[:, None, :] if valid.dim() == 2 else valid


def _masked_pearson(a: Tensor, b: Tensor, weight: Tensor) -> Tensor:
    """Pearson correlation of the flattened ``[..., n, m]`` matrices over the entries of weight 1."""
    count = weight.sum((-1, -2))
    a_centred = (a - (a * weight).sum((-1, -2), keepdim=True) / count[..., None, None]) * weight
    b_centred = (b - (b * weight).sum((-1, -2), keepdim=True) / count[..., None, None]) * weight
    num = (a_centred * b_centred).sum((-1, -2))
    den = torch.sqrt(a_centred.square().sum((-1, -2)) * b_centred.square().sum((-1, -2)))
    return torch.where(den > 0, num / den, torch.full((), math.nan, dtype=num.dtype, device=num.device))


def compare_attention(
    q: Tensor,
    k: Tensor,
    *,
    scale: float,
    bandwidth: str | float = "matched",
    valid: Tensor | None = None,
    seed: int = 0,
) -> dict[str, Tensor]:
    """Compare the attention ``softmax(scale q k^T)`` with NW weights, per (batch row, head).

    ``A_ji = softmax_i(scale q_j.k_i)``, ``NW_ji = softmax_i(-||q_j - k_i||^2 / 2h^2)`` over the
    valid keys; by algebra ``log A_ji = log NW_ji(h^2 = 1/scale) + scale ||k_i||^2 / 2 + c_j``.
    Returned, each ``[B, H]`` and averaged over the N query rows where a row statistic:

    - ``bandwidth``: the h used for ``NW`` (``"matched"``: ``h = scale^(-1/2)``; ``"fitted"``: ``h_eff``,
      NaN with fewer than 2 valid keys, and so are the NW statistics then; ``"median"``:
      ``h^2 = median ||q - k||^2 / 2``; a float: that h);
    - ``rho``: per-row Spearman between A and NW (ranks of ``q.k`` and of ``q.k - ||k||^2 / 2``;
      any h) and its nulls ``rho_perm_null`` (NW scores shuffled across keys),
      ``rho_norm_matched_null`` (queries of the same norms in random directions) and
      ``rho_spread_null`` (each row's ``q.k`` kept, paired with shuffled key norms);
    - ``pearson``: Pearson r of the flattened (rows x valid keys) matrices A and NW;
    - ``kl`` = ``KL(A || NW)``, ``js``: Jensen-Shannon, both from logits, in nats;
    - ``neff_attn``, ``neff_nw``: ``1 / sum_i w_i^2`` of A and of NW;
    - ``top1``: share of rows whose largest weight is on the same key;
    - ``key_norm_cv``: std / mean of ``||k_i||``; ``qk_spread_ratio``: mean over rows of
      ``std_i(q.k_i) / std_i(||k_i||^2 / 2)`` (what rho is a function of);
    - ``r2_key``, ``r2_nw``, ``kl_nw_fit``, ``kl_key_prior``, ``nw_gain``, ``h_eff``: see
      :func:`nw_adapter.core.readings.nw_readings` (``h_eff`` fitted on all N rows).

    Args:
        q: ``[B, H, N, d]`` queries of the head (after any normalisation the layer applies).
        k: ``[B, H, M, d]`` keys.
        scale: the softmax scale (``1/sqrt(d)`` for standard attention), > 0.
        bandwidth: ``"matched"``, ``"fitted"``, ``"median"`` or a float h > 0.
        valid: optional bool key mask ``[B, H, M]``, ``[B, M]`` or ``[M]`` (True = the key takes
            part); every (batch row, head) needs at least one valid key.
        seed: seed of the nulls' random numbers (deterministic for a given device and dtype).

    Returns:
        ``{name: [B, H] tensor}`` in :data:`COMPARISON_NAMES` order, float32 (float64 when q or k
        is float64), on q's device.

    Raises:
        ValueError: bad shapes, dtypes, non-finite inputs, scale, bandwidth, mask or seed.

    Example:
        >>> q, k = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 4, 16)
        >>> out = compare_attention(q, k, scale=16**-0.5)
        >>> out["rho"].shape, out["nw_gain"].shape
        (torch.Size([1, 2]), torch.Size([1, 2]))
    """
    _check_inputs(q, k, scale, bandwidth, valid, seed)
    dtype = compute_dtype(q, k)
    q, k = q.to(dtype), k.to(device=q.device, dtype=dtype)
    # key masks: [B, H, M] for the kernels and readings, [B, H, 1, M] against [B, H, N, M] rows (metrics)
    mask = None if valid is None else _as_key_mask(valid.to(q.device)).expand(q.shape[0], q.shape[1], -1)
    row_mask = None if mask is None else mask[..., None, :]
    generator = torch.Generator(device=q.device).manual_seed(seed)
    with no_autocast(q.device):
        qk = q @ k.transpose(-1, -2)  # [B, H, N, M]
        scores_nw = qk - 0.5 * k.square().sum(-1)[..., None, :]
        attn_logits = scale * qk
        readings = nw_readings(attn_logits, q, k, mask)
        if bandwidth == "matched":
            h = torch.full(q.shape[:2], matched_bandwidth(scale=float(scale)), dtype=dtype, device=q.device)
        elif bandwidth == "fitted":
            h = readings["h_eff"]
        elif bandwidth == "median":
            h = median_bandwidth(q, k, key_mask=mask)
        else:
            h = torch.full(q.shape[:2], float(bandwidth), dtype=dtype, device=q.device)
        logits_nw = nw_logits(q, k, h, support_mask=mask, validate=False)
        key_weight = torch.ones_like(qk) if row_mask is None else row_mask.expand_as(qk).to(dtype)
        masked_attn = attn_logits.masked_fill(key_weight == 0, -math.inf)
        weights_attn = torch.softmax(masked_attn, -1)
        weights_nw = torch.softmax(logits_nw, -1)
        key_norm = k.norm(dim=-1)
        spread = masked_std(qk, row_mask).mean(-1) / masked_std(0.5 * key_norm.square(), mask)
        out = {
            "bandwidth": h,
            "rho": spearman_rho(qk, scores_nw, row_mask),
            "rho_perm_null": permutation_null_rho(qk, scores_nw, row_mask, generator=generator),
            "rho_norm_matched_null": norm_matched_null_rho(q, k, row_mask, generator=generator),
            "rho_spread_null": qk_spread_null_rho(q, k, row_mask, generator=generator),
            "pearson": _masked_pearson(weights_attn, weights_nw, key_weight),
            "kl": kl_from_logits(attn_logits, logits_nw, row_mask).mean(-1),
            "js": js_from_logits(attn_logits, logits_nw, row_mask).mean(-1),
            "neff_attn": effective_sample_size(weights_attn).mean(-1),
            "neff_nw": effective_sample_size(weights_nw).mean(-1),
            "top1": top1_agreement(qk, scores_nw, row_mask).to(dtype).mean(-1),
            "key_norm_cv": masked_std(key_norm, mask) / _masked_mean(key_norm, mask),
            "qk_spread_ratio": spread,
            **readings,
        }
    return {name: out[name] for name in COMPARISON_NAMES}


def _masked_mean(x: Tensor, valid: Tensor | None) -> Tensor:
    """Mean over the last dim, over the valid entries only."""
    if valid is None:
        return x.mean(-1)
    w = valid.to(x.dtype)
    return (x * w).sum(-1) / w.sum(-1)
