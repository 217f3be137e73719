"""Every reading that compares a dot-product attention head with NW weights, for any q and k (THEORY.md 4).

None of them decides whether a head is a Nadaraya-Watson smoother of its data: any dot-product head
is one in some augmented space, and the head-space readings do not recognise Theorem 3's exact head
(docs/THEORY.md, "What the readings can and cannot establish"). ``logit_scale``'s trend over log h
(the bandwidth path) and comparisons with a scale-matched control are the testable uses.

:func:`compare_attention` takes the queries and keys of a dot-product attention head, recomputes
its weights ``A = softmax(scale q k^T)`` and compares them with the NW weights in the head's own
q/k space, ``NW = softmax(-||q - k_i||^2 / 2h^2)``, per (batch row, head): the rank statistics
and their three nulls (:mod:`nw_adapter.core.metrics`), the divergences, effective sample sizes,
and the readings that split the attention into a key prior and an NW smoother of the query
(:mod:`nw_adapter.core.readings`). It is the one specification of these statistics
(:mod:`nw_adapter.core.specification`) evaluated on all query rows, in float64; a reading that
cannot be computed is NaN with a counted reason (:attr:`AttentionComparison.nan_reasons`;
``h_eff`` is NaN where it is not identified, with a reason of
:data:`~nw_adapter.core.specification.H_EFF_REASONS`). The processors record all of them on
the fly, per (layer, head, step, CFG half) (:mod:`nw_adapter.integration.stats`,
``NWProcessorConfig(readings=True)``, the default), the readings with ``h_eff`` fitted on
``fit_rows`` evenly spaced query rows (``h_eff_se``: the standard error that adds) where this
function fits it on all rows.

A reading is evidence only against a control with the same algebra but not the learning (the
same queries against an untrained adapter's keys, or the nulls): a random head already has
``rho`` well above 0 and ``nw_gain > 0``.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from nw_adapter.core import specification
from nw_adapter.core.bandwidth import matched_bandwidth, median_bandwidth
from nw_adapter.core.kernels import compute_dtype, no_autocast
from nw_adapter.core.specification import FAST_PATH_ONLY, H_EFF_REASONS, SPECIFICATION, STAT_NAMES, Softmax

__all__ = ["BANDWIDTH_RULES", "COMPARISON_NAMES", "NAN_REASONS", "AttentionComparison", "compare_attention"]

#: Bandwidth rules of :func:`compare_attention` (besides a positive float).
BANDWIDTH_RULES: tuple[str, ...] = ("matched", "fitted", "median")

#: The keys of :func:`compare_attention`'s result, in order: the specification's statistics
#: (:data:`~nw_adapter.core.specification.STAT_NAMES`) but the fast path's subsample-fit ones.
COMPARISON_NAMES: tuple[str, ...] = tuple(n for n in STAT_NAMES if n not in FAST_PATH_ONLY)

#: Why a reading of one (batch row, head) cannot be computed, in the order they are checked: a NaN
#: value's reason is the first that holds for its cell (:attr:`AttentionComparison.nan_reasons`).
#: ``h_eff`` (and the bandwidth of the ``"fitted"`` rule) has only the reasons of
#: :data:`~nw_adapter.core.specification.H_EFF_REASONS` (the first is shared).
NAN_REASONS: tuple[str, ...] = (
    H_EFF_REASONS[0],
    "the valid keys are identical",
    "the queries are all zero",
    "the attention logits are constant over the keys in every row",
    "the NW scores are constant over the keys in every row",
    *H_EFF_REASONS[1:],
    "the bandwidth is 0 (the median rule on coincident queries and keys)",
    "not defined for these inputs",
)

_WORK_DTYPE = torch.float64
"""The dtype of the computation (float64 everywhere but on devices without it): extreme finite
float32 inputs (norms of 1e10, scale 1e30, h of 1e-20) stay in range."""

SEED_LIMIT = 2**63
"""Seeds of the nulls' generator lie in [0, 2**63), as the processors' (``NWProcessorConfig.seed``)."""

# float64 bandwidths whose h^2 and 1 / h^2 are finite normal numbers
_F64_BANDWIDTH = (1e-150, 1e150)


class AttentionComparison(dict):
    """:func:`compare_attention`'s result: ``{name: [B, H] tensor}`` in :data:`COMPARISON_NAMES`
    order, with ``nan_reasons``: per reading with NaN values, ``{reason: number of (batch row,
    head) cells}`` (reasons of :data:`NAN_REASONS`; ``{}`` when every value is a number)."""

    nan_reasons: dict[str, dict[str, int]]

    def __init__(self, values: dict[str, Tensor], nan_reasons: dict[str, dict[str, int]]) -> None:
        super().__init__(values)
        self.nan_reasons = nan_reasons


def _check_inputs(
    q: object, k: object, scale: object, bandwidth: object, valid: object, seed: object,
    key_norm_weight: object = 0.0,
) -> None:  # fmt: skip
    for name, x, dims in (("q", q, "[B, H, N, d]"), ("k", k, "[B, H, M, d]")):
        if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a floating-point tensor {dims}, got {shape}")
        if x.shape[-2] < 1 or x.shape[-1] < 1:
            raise ValueError(f"{name} must have at least one row and one feature, got {tuple(x.shape)}")
        if x.is_meta:
            raise ValueError(
                f"{name} is a meta tensor (a shape without values); pass tensors that hold values "
                "(e.g. on cpu or cuda)"
            )
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} contains NaN or inf values; remove them or mask the keys with valid")
    assert isinstance(q, Tensor) and isinstance(k, Tensor)
    if q.device != k.device:
        raise ValueError(f"q and k must be on one device, got {q.device} and {k.device}; move one with .to()")
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
    if (
        isinstance(key_norm_weight, bool)
        or not isinstance(key_norm_weight, int | float)
        or not math.isfinite(key_norm_weight)
    ):
        raise ValueError(
            "key_norm_weight must be a finite number (0: dot-product attention softmax(scale q.k); "
            f"1: the exact NW head softmax(scale (q.k - ||k||^2 / 2))), got {key_norm_weight!r}"
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
    else:
        low, high = _bandwidth_range(compute_dtype(q, k))
        if not low <= bandwidth <= high:
            name = str(compute_dtype(q, k)).removeprefix("torch.")
            raise ValueError(
                f"bandwidth must be one of {BANDWIDTH_RULES} or a float in [{low:.3g}, {high:.3g}] "
                f"(the range of h, h^2 and 1/h^2 for {name} results), got {bandwidth!r}"
            )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**63) (the nulls' generator seed), got {seed!r}")
    if valid is not None:
        b, h, m = q.shape[0], q.shape[1], k.shape[-2]
        ok = isinstance(valid, Tensor) and valid.dtype == torch.bool and 1 <= valid.dim() <= 3
        if ok and valid.device != q.device:
            raise ValueError(
                f"valid must be on q's device {q.device}, got {valid.device}; move it with .to()"
            )
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


def _bandwidth_range(dtype: torch.dtype) -> tuple[float, float]:
    """The float bandwidths h accepted for results of ``dtype``: representable there, and with
    h^2 and 1/h^2 finite in the float64 computation."""
    info = torch.finfo(dtype)
    return max(info.tiny, _F64_BANDWIDTH[0]), min(info.max, _F64_BANDWIDTH[1])


def _as_key_mask(valid: Tensor) -> Tensor:
    """``[M]`` / ``[B, M]`` / ``[B, H, M]`` -> a mask broadcastable to ``[B, H, M]``."""
    return valid[:, None, :] if valid.dim() == 2 else valid


def _spread(x: Tensor, mask: Tensor) -> Tensor:
    """``max - min`` of ``x`` ``[..., m]`` over the valid entries (``mask`` broadcastable), exact."""
    top = torch.where(mask, x, -math.inf).amax(-1)
    bottom = torch.where(mask, x, math.inf).amin(-1)
    return top - bottom


def _degenerate_cells(x: Softmax, mask: Tensor) -> list[Tensor]:
    """Per reason of :data:`NAN_REASONS`, the bool ``[B, H]`` cells where it holds.

    ``mask``: bool ``[B, H, M]`` valid keys. The checks but h_eff's are exact (no tolerance): they
    name why a value is NaN, they do not make values NaN.
    """
    q, k, attn_logits, scores_nw, h = x.q, x.k, x.attn_logits, x.nw_scores, x.h
    row_mask = mask[..., None, :]
    keys = mask.sum(-1)
    identical = (_spread(k.transpose(-1, -2), row_mask) == 0).all(-1)
    zero_queries = (q == 0).flatten(-2).all(-1)
    constant_logits = (_spread(attn_logits, row_mask) == 0).all(-1)
    constant_scores = (_spread(scores_nw, row_mask) == 0).all(-1)
    code = specification.h_eff_reason_code(x)
    blind, edge, flat = code == 2, code == 3, code == 4
    no_bandwidth = ~(torch.isfinite(h) & (h > 0))
    always = torch.ones_like(no_bandwidth)
    return [
        keys < 2,
        identical,
        zero_queries,
        constant_logits,
        constant_scores,
        blind,
        edge,
        flat,
        no_bandwidth,
        always,
    ]


def _nan_reasons(values: dict[str, Tensor], cells: list[Tensor], fitted: bool) -> dict[str, dict[str, int]]:
    """``{reading: {reason: NaN cells}}`` for the readings with NaN values (first reason that holds;
    h_eff, and the bandwidth when ``fitted``, by the reasons of ``H_EFF_REASONS`` alone)."""
    reasons: dict[str, dict[str, int]] = {}
    for name, value in values.items():
        left = torch.isnan(value)
        if not bool(left.any()):
            continue
        counted: dict[str, int] = {}
        only_h_eff = name == "h_eff" or (fitted and name == "bandwidth")
        h_eff_follows = only_h_eff or fitted  # the NW statistics of the fitted rule share h_eff's NaN
        for reason, holds in zip(NAN_REASONS, cells, strict=True):
            if only_h_eff and reason not in H_EFF_REASONS and reason != NAN_REASONS[-1]:
                continue
            if not h_eff_follows and reason in H_EFF_REASONS[1:]:
                continue
            here = left & holds
            if bool(here.any()):
                counted[reason] = int(here.sum())
                left = left & ~holds
        reasons[name] = counted
    return reasons


def _check_in_range(name: str, x: Tensor, fix: str) -> None:
    """ValueError unless ``x`` is finite where it is not NaN (the float64 computation overflowed)."""
    if bool(torch.isinf(x).any()):
        raise ValueError(f"compare_attention: {name} overflows float64 with these inputs; {fix}")


def _cast_results(values: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """The float64 results in the result dtype; ValueError where a finite value does not fit."""
    out = {}
    for name, value in values.items():
        cast = value.to(dtype)
        overflow = torch.isinf(cast) & torch.isfinite(value)
        if bool(overflow.any()):
            raise ValueError(
                f"compare_attention: {name} = {float(value[overflow][0]):.3g} is beyond the "
                f"{str(dtype).removeprefix('torch.')} range ({torch.finfo(dtype).max:.3g}) for these q, k, "
                "scale and bandwidth; pass q and k as float64"
            )
        out[name] = cast
    return out


def compare_attention(
    q: Tensor,
    k: Tensor,
    *,
    scale: float,
    bandwidth: str | float = "matched",
    valid: Tensor | None = None,
    seed: int = 0,
    key_norm_weight: float = 0.0,
) -> dict[str, Tensor]:
    """Compare the attention ``softmax(scale q k^T)`` with NW weights, per (batch row, head).

    With ``key_norm_weight`` c the attention is ``softmax(scale (q.k_i - c ||k_i||^2 / 2))``: c = 1
    and ``scale = 1/h^2`` is the exact NW head at bandwidth h in Theorem 3's additive-bias form
    (``q = x``, ``k = s``: the support's own space), whose weights are the NW weights at that h;
    every statistic then reads those weights (its scores ``q.k - c ||k||^2 / 2``), the NW side and
    the key geometry staying the head's own.

    ``A_ji = softmax_i(scale q_j.k_i)``, ``NW_ji = softmax_i(-||q_j - k_i||^2 / 2h^2)`` over the
    valid keys; by algebra ``log A_ji = log NW_ji(h^2 = 1/scale) + scale ||k_i||^2 / 2 + c_j``.
    Returned, each ``[B, H]`` and averaged over the N query rows where a row statistic:

    - ``bandwidth``: the h used for ``NW`` (``"matched"``: ``h = scale^(-1/2)``; ``"fitted"``: ``h_eff``,
      NaN where h_eff is not identified, and so are the NW statistics then; ``"median"``:
      ``h^2 = median ||q - k||^2 / 2``; a float: that h);
    - ``rho``: per-row Spearman between A and NW (ranks of ``q.k`` and of ``q.k - ||k||^2 / 2``;
      any h) and its nulls ``rho_perm_null`` (NW scores shuffled across keys),
      ``rho_norm_matched_null`` (queries of the same norms in random directions) and
      ``rho_spread_null`` (each row's ``q.k`` kept, paired with shuffled key norms);
    - ``pearson``: Pearson r of the flattened (rows x valid keys) matrices A and NW;
    - ``kl`` = ``KL(A || NW)``, ``js``: Jensen-Shannon, both from logits, in nats;
    - ``neff_attn``, ``neff_nw``: ``1 / sum_i w_i^2`` of A and of NW;
    - ``top1``: share of rows whose largest weight is on the same key; ``q_norm``: mean ``||q_j||``;
    - ``key_norm_cv``: std / mean of ``||k_i||``; ``qk_spread_ratio``: mean over rows of
      ``std_i(q.k_i) / std_i(||k_i||^2 / 2)`` (what rho is a function of);
    - ``logit_scale``: the RMS of the row-centred logits ``scale q.k`` (the effective inverse
      temperature; ``c / h^2`` for an NW head), ``key_rms``: the RMS key norm
      (:mod:`nw_adapter.core.readings`; scale readings: their log trends and ratios are scale-free);
    - ``r2_key``, ``r2_nw``, ``kl_nw_fit``, ``kl_key_prior``, ``nw_gain``, ``h_eff``: see
      :func:`nw_adapter.core.readings.nw_readings` (``h_eff`` fitted on all N rows; NaN where it
      is not identified: fewer than 2 valid keys, query-blind attention with
      ``1 - r2_key < 1e-6``, the fit at an end of its range ``[1e-6, 1e6] * scale``, or NW scores
      whose query-dependent share is below 1e-4 (a flat profile), the reasons of
      :data:`~nw_adapter.core.specification.H_EFF_REASONS` in ``nan_reasons``).

    Each is the function of that name in :data:`nw_adapter.core.specification.SPECIFICATION`
    (per-row statistics averaged over the rows, NaN rows left out), with the nulls' draws of
    :func:`~nw_adapter.core.specification.draw_nulls` on every query row.

    Args:
        q: ``[B, H, N, d]`` queries of the head (after any normalisation the layer applies).
        k: ``[B, H, M, d]`` keys.
        scale: the softmax scale (``1/sqrt(d)`` for standard attention), > 0.
        bandwidth: ``"matched"``, ``"fitted"``, ``"median"`` or a float h > 0.
        valid: optional bool key mask ``[B, H, M]``, ``[B, M]`` or ``[M]`` (True = the key takes
            part); every (batch row, head) needs at least one valid key.
        seed: seed of the nulls' random numbers, in [0, 2**63) (deterministic for a given device and
            dtype).
        key_norm_weight: c, the share of the key-norm term in the attention's own logits (0: a
            dot-product head, the default; 1: the exact NW head).

    Everything is computed in float64 (extreme finite float32 inputs, e.g. norms of 1e10,
    ``scale=1e30`` or ``h=1e-20``, keep their values; Pearson r comes from the logits, so weights
    within rounding of uniform still give it) and returned in the result dtype.

    Returns:
        An :class:`AttentionComparison`: ``{name: [B, H] tensor}`` in :data:`COMPARISON_NAMES`
        order, float32 (float64 when q or k is float64), on q's device. A reading that cannot be
        computed for a (batch row, head) is NaN there; ``result.nan_reasons`` counts those cells
        per reading and reason (:data:`NAN_REASONS`: one valid key, identical keys, zero queries,
        logits or NW scores constant in every row, a bandwidth of 0), and one RuntimeWarning
        says the same.

    Raises:
        ValueError: bad shapes, dtypes, non-finite inputs, scale, bandwidth (a float outside
            the range its dtype can hold), mask or seed; float64 overflow of ``q.k`` or
            ``scale * q.k``; a result beyond the float32 range (pass float64 q and k).

    Example:
        >>> q, k = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 4, 16)
        >>> out = compare_attention(q, k, scale=16**-0.5)
        >>> out["rho"].shape, out["nw_gain"].shape
        (torch.Size([1, 2]), torch.Size([1, 2]))
    """
    _check_inputs(q, k, scale, bandwidth, valid, seed, key_norm_weight)
    c = float(key_norm_weight)
    result_dtype = compute_dtype(q, k)
    dtype = result_dtype if q.device.type == "mps" else _WORK_DTYPE  # MPS has no float64
    q, k = q.to(dtype), k.to(device=q.device, dtype=dtype)
    b, nh, m = q.shape[0], q.shape[1], k.shape[-2]
    mask = None if valid is None else _as_key_mask(valid.to(q.device)).expand(b, nh, m)
    generator = torch.Generator(device=q.device).manual_seed(seed)
    with no_autocast(q.device):
        qk = q @ k.transpose(-1, -2)  # [B, H, N, M]
        _check_in_range("q.k", qk, "scale q and k down (the attention uses scale * q.k only)")
        _check_in_range("||k||^2", 0.5 * k.square().sum(-1), "scale k down")
        _check_in_range("||q||^2", q.square().sum(-1), "scale q down")
        bound = torch.finfo(dtype).max / float(qk.abs().amax().clamp_min(1.0))
        _check_in_range("scale * q.k", scale * qk, f"scale must be at most {bound:.3g} for these q and k")
        draws = specification.draw_nulls(q, m, None, generator)  # every query row, in random order
        x = Softmax(q, k, float(scale), _bandwidth(q, k, scale, bandwidth, mask), mask, draws, None, c)
        if bandwidth == "fitted":
            x = Softmax(q, k, float(scale), SPECIFICATION["h_eff"].function(x), mask, draws, None, c)
        values = {name: _over_rows(name, x) for name in COMPARISON_NAMES}
        every_key = torch.ones(b, nh, m, dtype=torch.bool, device=q.device) if mask is None else mask
        cells = _degenerate_cells(x, every_key)
    reasons = _nan_reasons(values, cells, bandwidth == "fitted")
    if reasons:
        counted = "; ".join(
            f"{name}: " + ", ".join(f"{reason} ({n})" for reason, n in why.items())
            for name, why in reasons.items()
        )
        warnings.warn(
            f"compare_attention: NaN readings (cells per reason): {counted}", RuntimeWarning, stacklevel=2
        )
    return AttentionComparison(_cast_results(values, result_dtype), reasons)


def _bandwidth(q: Tensor, k: Tensor, scale: float, rule: str | float, mask: Tensor | None) -> Tensor:
    """The h ``[B, H]`` of a rule (``"fitted"``: a placeholder, h_eff does not depend on it)."""
    if rule == "median":
        return median_bandwidth(q, k, key_mask=mask)
    value = matched_bandwidth(scale=float(scale)) if isinstance(rule, str) else float(rule)
    return torch.full(q.shape[:2], value, dtype=q.dtype, device=q.device)


def _over_rows(name: str, x: Softmax) -> Tensor:
    """The specification's statistic ``name`` ``[B, H]``: per-row ones averaged over the query rows
    (NaN rows left out)."""
    statistic = SPECIFICATION[name]
    value = statistic.function(x)
    return torch.nanmean(value, dim=-1) if statistic.per_query_row else value
