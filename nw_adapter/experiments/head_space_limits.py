"""What a head-space reading can and cannot establish, measured (docs/THEORY.md, issue 26 item 1).

Two facts, each measured here with :func:`nw_adapter.core.compare.compare_attention`:

1. **Any dot-product head is exactly an NW smoother in an augmented space.** With keys
   ``v_i = [k_i, sqrt(C - ||k_i||^2)]`` (any ``C >= max_i ||k_i||^2``) and queries ``u_j = [q_j, 0]``,
   ``||u_j - v_i||^2 = ||q_j||^2 + C - 2 q_j.k_i``, so

       ``softmax_i(s q_j.k_i) = softmax_i(-||u_j - v_i||^2 / 2h^2)`` at ``h^2 = 1/s``

   for every head (:func:`augmented_space`, :func:`augmented_space_gap`). "NW-like in head space"
   therefore has no content until the space and the bandwidth are fixed.
2. **A head-space NW fit does not recognise Theorem 3's exact head.** The exact data-space NW head
   (THEORY section 3: augmented ``q = [x / h, 1]``, ``k_i = [s_i / h, -||s_i||^2 / 2h^2]``, support
   norms unequal) gets ``nw_gain < 0`` at small h and a fitted ``h_eff`` that *falls* as the true h
   rises (:func:`measure_bandwidth_sweep`); written with the ``1/h^2`` in the softmax scale instead
   (same attention, other head space) the same readings give other numbers. ``logit_scale`` (the RMS
   of the row-centred logits) depends on the logits only and follows ``1/h^2`` exactly: its log-log
   slope on h is -2 for any support and either form, and 0 when the bandwidth is held fixed
   (:func:`bandwidth_path_slopes`), the falsifiable reading of the bandwidth path.

The draw (one seeded support and query set, two heads, readings averaged over the heads) is the
independent unit; every draw is reused at every bandwidth, so the slopes are within-draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from nw_adapter.core.compare import compare_attention
from nw_adapter.core.kernels import nw_logits

__all__ = [
    "BANDWIDTHS",
    "HEAD_FORMS",
    "SUPPORT_GAINS",
    "BandwidthSweep",
    "augmented_space",
    "augmented_space_gap",
    "bandwidth_path_slopes",
    "exact_nw_head",
    "log_log_slope",
    "measure_bandwidth_sweep",
]

#: The true bandwidths of the sweep (issue 26).
BANDWIDTHS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)

#: Norm gains of the support points of :func:`exact_nw_head` (unequal norms, as in
#: :func:`nw_adapter.experiments.synthetic_heads.augmented_nw_head`).
SUPPORT_GAINS: tuple[float, ...] = (0.8, 1.0 + 1 / 15, 1.0 + 1 / 3, 1.6)

#: The two q/k forms of Theorem 3's head (:func:`exact_nw_head`): same attention, different head space.
HEAD_FORMS: tuple[str, ...] = ("folded", "scaled")


def augmented_space(q: Tensor, k: Tensor, c: float | None = None) -> tuple[Tensor, Tensor]:
    """Queries ``[q, 0]`` and keys ``[k_i, sqrt(C - ||k_i||^2)]``: the space where the head is NW.

    Args:
        q: ``[..., n, d]`` queries.
        k: ``[..., m, d]`` keys.
        c: the constant ``C >= max ||k_i||^2`` over each ``[..., m]`` key set (``None``: that maximum,
            per key set).

    Returns:
        ``(u [..., n, d + 1], v [..., m, d + 1])`` with ``||v_i||^2 = C`` for every key, so
        ``-||u_j - v_i||^2 / 2h^2 = q_j.k_i / h^2 - (||q_j||^2 + C) / 2h^2`` (a row constant aside, the
        head's logits at scale ``1/h^2``).

    Raises:
        ValueError: ``c`` below the largest squared key norm.
    """
    squared = k.square().sum(-1, keepdim=True)  # [..., m, 1]
    top = squared.amax(-2, keepdim=True)  # [..., 1, 1]
    if c is not None:
        if c < float(top.max()):
            raise ValueError(
                f"c = {c} is below the largest squared key norm {float(top.max()):.6g}; pass c >= it"
            )
        top = torch.full_like(top, c)
    v = torch.cat([k, (top - squared).clamp_min(0.0).sqrt()], -1)
    u = torch.cat([q, q.new_zeros((*q.shape[:-1], 1))], -1)
    return u, v


def augmented_space_gap(q: Tensor, k: Tensor, scale: float, c: float | None = None) -> float:
    """Largest ``|log softmax(scale q k^T) - log NW(u, v; h = scale^(-1/2))|`` over all entries.

    ``u, v`` from :func:`augmented_space`; the NW logits come from
    :func:`nw_adapter.core.kernels.nw_logits` (direct differences). 0 up to the rounding of the
    dtype for every dot-product head.
    """
    u, v = augmented_space(q, k, c)
    attention = torch.log_softmax(scale * (q @ k.transpose(-1, -2)), -1)
    smoother = torch.log_softmax(nw_logits(u, v, scale**-0.5, validate=False), -1)
    return float((attention - smoother).abs().max())


def exact_nw_head(
    generator: torch.Generator,
    bandwidth: float,
    *,
    form: str = "folded",
    gains: Sequence[float] = SUPPORT_GAINS,
    rows: int = 256,
    dim: int = 8,
    heads: int = 2,
) -> tuple[Tensor, Tensor, float]:
    """Theorem 3's exact NW head over a seeded support, at bandwidth ``h``, in one of two q/k forms.

    Both forms have the same attention, ``softmax_i(-||x_j - s_i||^2 / 2h^2)`` (the NW weights of the
    support in data space), and so the same logits:

    - ``"folded"`` (THEORY section 3 as written): ``q_j = [x_j / h, 1]``,
      ``k_i = [s_i / h, -||s_i||^2 / 2h^2]``, scale 1 (the keys shrink as h grows);
    - ``"scaled"``: ``q_j = [x_j, 1]``, ``k_i = [s_i, -||s_i||^2 / 2]``, scale ``1/h^2``
      (:func:`nw_adapter.experiments.synthetic_heads.augmented_nw_head`).

    Support ``s_i = g_i z_i``, ``z_i ~ N(0, I_d)`` (norms set by ``gains``), queries
    ``x_j ~ N(0, 1.5^2 I_d)``. The same generator state gives the same support and queries at every
    bandwidth and form.

    Returns:
        ``(q [1, heads, rows, dim + 1], k [1, heads, m, dim + 1], scale)``, float64.

    Raises:
        ValueError: an unknown ``form`` or a bandwidth that is not > 0.
    """
    if form not in HEAD_FORMS:
        raise ValueError(f"form must be one of {HEAD_FORMS}, got {form!r}")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
    norm_gains = torch.tensor(list(gains), dtype=torch.float64).view(1, 1, -1, 1)
    support = torch.randn((1, heads, len(gains), dim), generator=generator, dtype=torch.float64) * norm_gains
    x = 1.5 * torch.randn((1, heads, rows, dim), generator=generator, dtype=torch.float64)
    ones = torch.ones(1, heads, rows, 1, dtype=torch.float64)
    half_norms = -0.5 * support.square().sum(-1, keepdim=True)
    if form == "scaled":
        return torch.cat([x, ones], -1), torch.cat([support, half_norms], -1), bandwidth**-2
    h = bandwidth
    return torch.cat([x / h, ones], -1), torch.cat([support / h, half_norms / h**2], -1), 1.0


def log_log_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """OLS slope of ``log y`` on ``log x`` over the pairs with both positive and finite (NaN if < 2)."""
    pairs = [
        (math.log(a), math.log(b))
        for a, b in zip(x, y, strict=True)
        if a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b)
    ]
    if len(pairs) < 2:
        return math.nan
    log_x, log_y = np.array(pairs).T
    return float(np.polyfit(log_x, log_y, 1)[0])


def bandwidth_path_slopes(
    draws: int = 10,
    schedule: Sequence[float] = BANDWIDTHS,
    *,
    fixed: float | None = None,
    form: str = "folded",
    gains: Sequence[float] = SUPPORT_GAINS,
) -> list[float]:
    """Per draw, the OLS slope of ``log logit_scale`` on ``log h_schedule`` (the bandwidth-path reading).

    At step t the head is :func:`exact_nw_head` at bandwidth ``schedule[t]`` (``fixed=None``: it
    follows the schedule) or at ``fixed`` for every step (a fixed-temperature head); ``logit_scale``
    comes from :func:`~nw_adapter.core.compare.compare_attention` (mean over the draw's heads). With
    fixed queries and support the logits are ``c / h^2`` times fixed ones, so the slope is -2 for any
    support and form when the head follows the schedule and 0 when it is fixed.
    """
    slopes = []
    for seed in range(draws):
        scales = []
        for h in schedule:
            head_h = h if fixed is None else fixed
            q, k, scale = exact_nw_head(torch.Generator().manual_seed(seed), head_h, form=form, gains=gains)
            scales.append(float(compare_attention(q, k, scale=scale, seed=seed)["logit_scale"].mean()))
        slopes.append(log_log_slope(schedule, scales))
    return slopes


@dataclass(frozen=True)
class BandwidthSweep:
    """:func:`measure_bandwidth_sweep`'s result; ``[draw][bandwidth]`` values (mean over the heads)."""

    bandwidths: tuple[float, ...]
    nw_gain: list[list[float]]
    h_eff: list[list[float]]
    logit_scale: list[list[float]]

    def share_negative_gain(self) -> list[float]:
        """Per bandwidth, the share of draws with ``nw_gain < 0``."""
        return [float(np.mean([row[b] < 0 for row in self.nw_gain])) for b in range(len(self.bandwidths))]

    def median_h_eff(self) -> list[float]:
        """Per bandwidth, the median fitted ``h_eff`` over the draws (NaN draws left out)."""
        return [float(np.nanmedian([row[b] for row in self.h_eff])) for b in range(len(self.bandwidths))]

    def h_eff_slopes(self) -> list[float]:
        """Per draw, the OLS slope of ``log h_eff`` on ``log h`` (true h)."""
        return [log_log_slope(self.bandwidths, row) for row in self.h_eff]

    def logit_scale_slopes(self) -> list[float]:
        """Per draw, the OLS slope of ``log logit_scale`` on ``log h``."""
        return [log_log_slope(self.bandwidths, row) for row in self.logit_scale]


def measure_bandwidth_sweep(
    draws: int = 10,
    bandwidths: Sequence[float] = BANDWIDTHS,
    *,
    form: str = "folded",
    gains: Sequence[float] = SUPPORT_GAINS,
) -> BandwidthSweep:
    """``compare_attention`` readings of :func:`exact_nw_head` per draw (seed) and true bandwidth.

    Draw ``s`` uses ``torch.Generator().manual_seed(s)`` for the head and ``seed=s`` for the nulls;
    each value is the mean over the draw's heads (``float64``).
    """
    gain, h_eff, scale_reading = [], [], []
    for seed in range(draws):
        per_h: dict[str, list[float]] = {"nw_gain": [], "h_eff": [], "logit_scale": []}
        for h in bandwidths:
            q, k, scale = exact_nw_head(torch.Generator().manual_seed(seed), h, form=form, gains=gains)
            readings = compare_attention(q, k, scale=scale, seed=seed)
            for name, values in per_h.items():
                values.append(float(readings[name].mean()))
        gain.append(per_h["nw_gain"])
        h_eff.append(per_h["h_eff"])
        scale_reading.append(per_h["logit_scale"])
    return BandwidthSweep(tuple(float(h) for h in bandwidths), gain, h_eff, scale_reading)
