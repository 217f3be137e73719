"""The statistics of one softmax, written plainly: the one executable specification.

Read this module first (THEORY.md section 4 in code). One softmax has queries ``q [B, H, N, d]``
and keys ``k [B, H, M, d]``. Its attention weights and the Nadaraya-Watson (NW) weights at
bandwidth h are

    A = softmax(s q.k_i)                  (s = the softmax scale, 1/sqrt(d) for SDPA)
    W = softmax(-||q - k_i||^2 / 2h^2) = softmax((q.k_i - ||k_i||^2 / 2) / h^2),

so the ranks of A in a row are those of ``q.k_i`` and the ranks of W (any h) those of
``q.k_i - ||k_i||^2 / 2``. A softmax may also carry a share ``c`` of the key-norm term in its own
logits (:attr:`Softmax.key_norm_weight`): ``A = softmax(s (q.k_i - c ||k_i||^2 / 2))``. ``c = 0``
is dot-product attention; ``c = 1`` with ``s = 1/h^2`` is the exact NW head at bandwidth h
(Theorem 3's additive-bias form, THEORY.md section 3), whose weights are W at that h: this is how
the processors record a swapped branch (the softmax that produces its output). Every statistic
reads the attention through its scores ``q.k_i - c ||k_i||^2 / 2`` (:attr:`Softmax.attn_scores`);
the NW weights, the nulls' NW side and the key geometry stay those of the head's own q and k.

Every statistic is one function of a :class:`Softmax` that returns
one value per (batch row, head) ``[B, H]``, or, for rho and its nulls, one value per query row
``[B, H, rows]`` (NaN for a constant row). :data:`SPECIFICATION` is the table of them: its keys
are :data:`STAT_NAMES` (the recorder's names, re-exported by ``integration/schema.py``), and
every other list of names is derived from it.

Two consumers evaluate it:

- :func:`nw_adapter.core.compare.compare_attention`: every statistic but the fast-path-only ones
  (:data:`FAST_PATH_ONLY`) on all query rows, in float64, averaged over the rows;
- the recorder's fast path (``integration/stats/fast.py``), tested equal to it on the same null
  draws (:func:`draw_nulls`) and fit rows, pooled per CFG half (``integration/stats/reference.py``).

Ranks and divergences come from logits through :mod:`nw_adapter.core.metrics`, never from
probabilities that underflow. Everything runs in the dtype of the inputs (float64 for float64).

How to add a statistic: one function here and its entry in :data:`SPECIFICATION`, and one
writer in the fast path's producer table (docs/architecture.md, "How to add a statistic").
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from nw_adapter.core import kernels, metrics, readings

__all__ = [
    "BETA_RANGE",
    "FAST_PATH_ONLY",
    "H_EFF_BLIND_TOLERANCE",
    "H_EFF_EDGE_TOLERANCE",
    "H_EFF_QUERY_TOLERANCE",
    "H_EFF_REASONS",
    "NEEDS_DRAWS",
    "PER_QUERY_ROW",
    "READING_STATS",
    "SPECIFICATION",
    "STAT_NAMES",
    "STAT_ROWS",
    "NullDraws",
    "Softmax",
    "Statistic",
    "draw_nulls",
    "fit_row_indices",
    "h_eff_reason_code",
]


class _OnFirstUse:
    """A module imported on first attribute access: the names table below needs no torch, so
    ``integration/schema.py`` re-exports it and reports rebuild from saved files without torch."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)


if not TYPE_CHECKING:
    torch = _OnFirstUse("torch")
    metrics = _OnFirstUse("nw_adapter.core.metrics")
    kernels = _OnFirstUse("nw_adapter.core.kernels")
    readings = _OnFirstUse("nw_adapter.core.readings")
    _bandwidth_rules = _OnFirstUse("nw_adapter.core.bandwidth")

#: Why ``h_eff`` is not identified (NaN), in the order they are checked; the code of a reason is
#: its position + 1 (0: identified), the recorder's ``h_eff_reason`` column is its text.
H_EFF_REASONS: tuple[str, ...] = (
    "fewer than 2 valid keys",
    "query-blind attention (1 - r2_key < 1e-6): no bandwidth of a query smoother is identified",
    "fitted bandwidth at the edge of its search range (not identified)",
    "not identified: the NW scores barely vary with the query (their query-dependent share of "
    "variance < 1e-4), so the fit rests on the key norms alone and its profile is flat once a key "
    "prior is allowed",
)

#: ``1 - r2_key`` below this: the attention does not depend on the query row (all of its
#: row-centred logit variance is a key bias), so no bandwidth of a smoother of the query is read.
H_EFF_BLIND_TOLERANCE = 1e-6

#: ``1 - r2_key`` of the NW scores ``G = q.k - ||k||^2 / 2`` below this: the part of G that varies
#: with the query row carries less than this share of G's row-centred variance, so the fit of
#: ``beta`` is carried by the key-norm term (a query-blind pattern) and a key prior could absorb
#: any ``beta``: its profile over ``beta`` is flat once that prior is free. In the small-logit
#: limit the information the fit has about ``log beta`` from the query's variation is this share of
#: its total, so below 1e-4 (queries equal up to ~1e-2 of their spread) ``h_eff`` is not identified.
#: Measured: queries equal up to 1e-3 of their norm gave h_eff 2.2 or 4.9 by the draw, shares ~1e-6.
H_EFF_QUERY_TOLERANCE = 1e-4

#: A fitted ``beta = 1/h_eff^2`` within this relative distance of an end of :data:`BETA_RANGE` is
#: at the edge: the loss still falls there, so the optimum is not inside the search range.
H_EFF_EDGE_TOLERANCE = 1e-3

#: The bandwidth fit's search range of ``beta``, relative to the softmax scale s: ``[1e-6 s, 1e6 s]``.
BETA_RANGE: tuple[float, float] = (1e-6, 1e6)

#: Newton/bisection steps of the plain fit (the fast path uses at most 12, from the least-squares start;
#: :mod:`nw_adapter.integration.stats.readings`).
FIT_STEPS = 60


@dataclass(frozen=True)
class NullDraws:
    """The random numbers of the three nulls of one softmax (float32).

    Attributes:
        rows: ``[n0]`` int64 indices of the query rows the nulls use (distinct, random order).
        noise: ``[B, H, n0, M]`` standard normal values: their argsort per row is the random
            permutation of the keys (:func:`~nw_adapter.core.metrics.valid_permutation`).
        directions: ``[B, H, n0, d]`` standard normal values: the norm-matched queries' directions.
    """

    rows: Tensor
    noise: Tensor
    directions: Tensor


def draw_nulls(q: Tensor, num_keys: int, null_rows: int | None, generator: torch.Generator) -> NullDraws:
    """Draw the nulls' random numbers for queries ``q`` ``[B, H, N, d]`` and ``num_keys`` keys.

    ``null_rows`` rows out of N are drawn without replacement (all N, in random order, when
    None or >= N), then one normal tensor ``[B, H, n0, M + d]`` gives the permutation noise
    (the argsort of i.i.d. continuous values is a uniform permutation) and the directions:
    2 random-number ops per softmax.

    Args:
        q: queries ``[B, H, N, d]`` (only the shape and device are read).
        num_keys: M, the keys of the softmax.
        null_rows: n0, the rows the nulls are estimated on (None = all N).
        generator: the seeded generator on ``q``'s device.

    Returns:
        The draws; float32 whatever the default dtype.
    """
    b, nh, n, d = q.shape
    n0 = n if null_rows is None else min(n, null_rows)
    rows = torch.randperm(n, generator=generator, device=q.device)[:n0]
    gauss = torch.randn((b, nh, n0, num_keys + d), generator=generator, device=q.device, dtype=torch.float32)
    return NullDraws(rows, gauss[..., :num_keys], gauss[..., num_keys:])


def fit_row_indices(n: int, count: int) -> list[int]:
    """``count`` evenly spaced query rows of ``n`` (all rows when ``count >= n``).

    Row ``floor(r n / count)`` for ``r = 0 .. count - 1``: distinct, ascending, spread over the
    whole query grid (never only its top rows).

    Example:
        >>> fit_row_indices(10, 4)
        [0, 2, 5, 7]
    """
    if count >= n:
        return list(range(n))
    return [(r * n) // count for r in range(count)]


@dataclass(frozen=True)
class Softmax:
    """One softmax and what every statistic reads from it.

    Attributes:
        q: queries ``[B, H, N, d]``.
        k: keys ``[B, H, M, d]`` (same dtype as q).
        scale: s, the softmax scale: a float, or ``[B, H]`` (a swapped head at a per-head h).
        h: the NW bandwidth ``[B, H]``.
        valid: bool key mask broadcastable to ``[B, H, M]`` (``[B, 1, M]`` or ``[B, H, M]``;
            None = all keys), True = the key takes part; every (batch row, head) keeps one.
        draws: the nulls' random numbers (None = no nulls).
        fit_rows: the bandwidth fit uses this many evenly spaced query rows (None = all).
        key_norm_weight: c, the share of the key-norm term in the attention's own logits,
            ``A = softmax(s (q.k_i - c ||k_i||^2 / 2))``: 0 dot-product attention, 1 the exact NW
            head at ``h^2 = 1/s`` (a swapped branch).
    """

    q: Tensor
    k: Tensor
    scale: float | Tensor
    h: Tensor
    valid: Tensor | None
    draws: NullDraws | None
    fit_rows: int | None = None
    key_norm_weight: float = 0.0

    @cached_property
    def scale_rows(self) -> float | Tensor:
        """s broadcastable over ``[B, H, N, M]`` (a float as it is, ``[B, H]`` as ``[B, H, 1, 1]``)."""
        return self.scale[..., None, None] if isinstance(self.scale, torch.Tensor) else self.scale

    @cached_property
    def key_valid(self) -> Tensor | None:
        """The key mask ``[B, H|1, M]`` (or None)."""
        return self.valid

    @cached_property
    def row_valid(self) -> Tensor | None:
        """The key mask broadcast over query rows, ``[B, H|1, 1, M]`` (or None)."""
        return None if self.valid is None else self.valid[..., None, :]

    @cached_property
    def key_count(self) -> Tensor:
        """The number of valid keys per (batch row, head), ``[B, H]``."""
        b, nh, m = self.k.shape[:3]
        if self.valid is None:
            return torch.full((b, nh), m, dtype=torch.long, device=self.k.device)
        return self.valid.sum(-1).expand(b, nh)

    @cached_property
    def qk(self) -> Tensor:
        """``q.k_i`` ``[B, H, N, M]``: the attention's scores."""
        return self.q @ self.k.transpose(-1, -2)

    @cached_property
    def half_sq_norms(self) -> Tensor:
        """``||k_i||^2 / 2`` ``[B, H, M]``: the key prior's exponent."""
        return 0.5 * self.k.square().sum(-1)

    @cached_property
    def nw_scores(self) -> Tensor:
        """``q.k_i - ||k_i||^2 / 2`` ``[B, H, N, M]``: the NW weights' scores (their ranks at any h)."""
        return self.qk - self.half_sq_norms[..., None, :]

    @cached_property
    def attn_scores(self) -> Tensor:
        """``q.k_i - c ||k_i||^2 / 2`` ``[B, H, N, M]``: the attention's scores (``q.k_i`` for
        dot-product attention, c = 0; the NW scores for the exact head, c = 1)."""
        if self.key_norm_weight == 0:
            return self.qk
        return self.qk - self.key_norm_weight * self.half_sq_norms[..., None, :]

    @cached_property
    def attn_logits(self) -> Tensor:
        """``s (q.k_i - c ||k_i||^2 / 2)`` ``[B, H, N, M]``: A = softmax of these."""
        return self.scale_rows * self.attn_scores

    @cached_property
    def nw_logits(self) -> Tensor:
        """``-||q - k_i||^2 / 2h^2`` ``[B, H, N, M]`` (``-inf`` at invalid keys): W = softmax of these
        (:func:`~nw_adapter.core.kernels.nw_logits`, direct differences; ``(q.k_i - ||k_i||^2 / 2)
        / h^2`` up to a row constant; NaN at coincident points when h is 0)."""
        mask = None if self.valid is None else self.valid.expand(*self.k.shape[:3])
        return kernels.nw_logits(self.q, self.k, self.h, support_mask=mask, validate=False)

    def masked(self, logits: Tensor) -> Tensor:
        """``logits`` with ``-inf`` at invalid keys."""
        return logits if self.valid is None else logits.masked_fill(~self.row_valid, -math.inf)

    def weights(self, logits: Tensor) -> Tensor:
        """``softmax(logits)`` over the valid keys ``[B, H, N, M]`` (0 at invalid keys)."""
        return torch.softmax(self.masked(logits), dim=-1)

    @cached_property
    def null_rows(self) -> Tensor:
        """The query rows the nulls use, ``[n0]``."""
        return self._draws().rows

    @cached_property
    def permutation(self) -> Tensor:
        """One random permutation of the valid keys per null row, ``[B, H, n0, M]`` (index)."""
        return metrics.valid_permutation(self._draws().noise.to(self.q.device), self.row_valid)

    @cached_property
    def fit_row_index(self) -> list[int]:
        """The query rows the bandwidth is fitted on (evenly spaced), ``n`` of ``N``."""
        n = self.q.shape[-2]
        return fit_row_indices(n, n if self.fit_rows is None else self.fit_rows)

    @cached_property
    def fitted_beta(self) -> Tensor:
        """``beta = 1/h_eff^2 = argmin mean_j CE(A_j || softmax(beta G_j))`` over the fit rows ``[B, H]``.

        :func:`~nw_adapter.core.bandwidth.fitted_bandwidth` (:data:`FIT_STEPS` steps from
        ``beta = s``, inside ``BETA_RANGE * s``) on ``r q``, ``r k`` with ``r^2 = s sqrt(d)``: the
        same logits at the standard scale, so the range and the start hold any s and key norm;
        ``beta = beta' r^2``.
        """
        rows = self.fit_row_index
        r2 = self.scale * math.sqrt(self.q.shape[-1])
        attn = self.weights(self.attn_logits)[..., rows, :]
        if isinstance(r2, torch.Tensor):  # a per-head scale: r [B, H, 1, 1]
            r = r2.sqrt()[..., None, None]
        else:
            r = math.sqrt(r2)
        h, _ = _bandwidth_rules.fitted_bandwidth(
            attn, self.q[..., rows, :] * r, self.k * r, key_mask=self.key_valid, steps=FIT_STEPS
        )
        return h.square().reciprocal() * r2

    def _draws(self) -> NullDraws:
        if self.draws is None:
            raise ValueError("the nulls need their draws (draw_nulls); pass draws=None to skip the nulls")
        return self.draws


# --- rho and its nulls: one value per query row -------------------------------------------------


def rho(x: Softmax) -> Tensor:
    """Per-row Spearman correlation of A and W: ranks of the attention scores (``q.k_i`` for
    dot-product attention) against ``q.k_i - ||k_i||^2 / 2``."""
    return metrics.rowwise_spearman(x.attn_scores, x.nw_scores, x.row_valid)


def rho_perm_null(x: Softmax) -> Tensor:
    """rho with the attention scores of each null row shuffled across the valid keys (expected ~0)."""
    scores = x.attn_scores[..., x.null_rows, :]
    shuffled = torch.gather(scores, -1, x.permutation)
    return metrics.rowwise_spearman(shuffled, x.nw_scores[..., x.null_rows, :], x.row_valid)


def rho_norm_matched_null(x: Softmax) -> Tensor:
    """rho of queries of the same norms in random directions: ``q' = ||q|| z / ||z||``, z ~ N(0, I)
    (the attention's scores of q' against the NW scores of q')."""
    q = x.q[..., x.null_rows, :]
    z = x._draws().directions.to(device=q.device, dtype=q.dtype)
    q_null = z * (q.norm(dim=-1, keepdim=True) / z.norm(dim=-1, keepdim=True))
    qk = q_null @ x.k.transpose(-1, -2)
    half_sq = x.half_sq_norms[..., None, :]
    attn = qk if x.key_norm_weight == 0 else qk - x.key_norm_weight * half_sq
    return metrics.rowwise_spearman(attn, qk - half_sq, x.row_valid)


def rho_spread_null(x: Softmax) -> Tensor:
    """rho with each row's attention scores kept and the NW side's pairing of ``q.k`` with the key
    norms shuffled: the attention scores against ``q.k_i - ||k_pi(i)||^2 / 2``."""
    qk = x.qk[..., x.null_rows, :]
    shuffled_half_sq = torch.gather(x.half_sq_norms[..., None, :].expand_as(qk), -1, x.permutation)
    return metrics.rowwise_spearman(x.attn_scores[..., x.null_rows, :], qk - shuffled_half_sq, x.row_valid)


# --- the other statistics: one value per (batch row, head) -------------------------------------


def bandwidth(x: Softmax) -> Tensor:
    """The bandwidth h the NW weights were computed at."""
    return x.h


def _centred_weights(logits: Tensor, key_mask: Tensor) -> Tensor:
    """``softmax(logits) - 1/m'`` per row over the ``m'`` valid keys, from the logits, 0 at invalid keys.

    ``w_i - 1/m' = expm1(delta_i) / m'`` with ``delta_i = l_i - c - log1p(mean_i expm1(l_i - c))``,
    ``c = max_i l_i``: exact where the weights are within rounding of uniform (logits of 1e-30,
    where ``softmax - 1/m'`` is 0 in floating point) and where they are one-hot.

    Args:
        logits: ``[..., n, m]``.
        key_mask: bool ``[..., 1, m]`` (True = valid key; every row has one).

    Returns:
        ``[..., n, m]``, each row summing to 0.
    """
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    top = torch.where(key_mask, logits, -math.inf).amax(-1, keepdim=True)
    shifted = torch.where(key_mask, logits - top, zero)
    count = key_mask.sum(-1, keepdim=True).to(logits.dtype)
    mean_excess = torch.where(key_mask, torch.expm1(shifted), zero).sum(-1, keepdim=True) / count
    delta = shifted - torch.log1p(mean_excess)
    return torch.where(key_mask, torch.expm1(delta) / count, zero)


def pearson(x: Softmax) -> Tensor:
    """Pearson r of the flattened (rows x valid keys) matrices A and W.

    Each weight row's mean is ``1/m'``, so the centred weights are :func:`_centred_weights` (from
    the logits); each matrix is divided by its largest centred entry before the products (r does
    not change), so weights that differ from uniform by 1e-200 still give r. NaN where either
    matrix is uniform.
    """
    mask = x.row_valid
    if mask is None:
        mask = torch.ones(x.k.shape[-2], dtype=torch.bool, device=x.q.device)[None, :]
    a = _centred_weights(x.attn_logits, mask)
    b = _centred_weights(x.nw_logits, mask)
    a = a / a.abs().amax((-1, -2), keepdim=True).clamp_min(torch.finfo(a.dtype).tiny)
    b = b / b.abs().amax((-1, -2), keepdim=True).clamp_min(torch.finfo(b.dtype).tiny)
    num = (a * b).sum((-1, -2))
    den = torch.sqrt(a.square().sum((-1, -2)) * b.square().sum((-1, -2)))
    return torch.where(den > 0, num / den, torch.full((), math.nan, dtype=num.dtype, device=num.device))


def kl(x: Softmax) -> Tensor:
    """``KL(A || W)`` in nats, averaged over the query rows."""
    return metrics.kl_from_logits(x.attn_logits, x.nw_logits, x.row_valid).mean(-1)


def js(x: Softmax) -> Tensor:
    """Jensen-Shannon divergence of A and W, averaged over the query rows."""
    return metrics.js_from_logits(x.attn_logits, x.nw_logits, x.row_valid).mean(-1)


def neff_attn(x: Softmax) -> Tensor:
    """Effective number of keys of A, ``1 / sum_i a_i^2``, averaged over the query rows."""
    return x.weights(x.attn_logits).square().sum(-1).reciprocal().mean(-1)


def neff_nw(x: Softmax) -> Tensor:
    """Effective number of keys of W, ``1 / sum_i w_i^2``, averaged over the query rows."""
    return x.weights(x.nw_logits).square().sum(-1).reciprocal().mean(-1)


def top1(x: Softmax) -> Tensor:
    """Fraction of query rows whose top key is the same under A and W."""
    return metrics.top1_agreement(x.attn_scores, x.nw_scores, x.row_valid).to(x.q.dtype).mean(-1)


def q_norm(x: Softmax) -> Tensor:
    """Mean query norm ``||q||`` (rho rises with it even for random queries)."""
    return x.q.norm(dim=-1).mean(-1)


def _masked_mean(values: Tensor, valid: Tensor | None) -> Tensor:
    """Mean over the last dim, over the valid entries only."""
    if valid is None:
        return values.mean(-1)
    weight = valid.to(values.dtype)
    return (values * weight).sum(-1) / weight.sum(-1)


def key_norm_cv(x: Softmax) -> Tensor:
    """Coefficient of variation of the key norms, ``std_i ||k_i|| / mean_i ||k_i||`` (valid keys,
    population standard deviation)."""
    norms = x.k.norm(dim=-1)
    return metrics.masked_std(norms, x.key_valid) / _masked_mean(norms, x.key_valid)


def qk_spread_ratio(x: Softmax) -> Tensor:
    """``mean_rows std_i(q.k_i) / std_i(||k_i||^2 / 2)`` over the valid keys: what rho is a function of
    (the attention's scores in place of ``q.k`` for a head with a key-norm term, c > 0).

    Population standard deviations; NaN where the valid keys' norms are all equal (the
    denominator is 0: identical keys, or keys on a sphere, where rho is 1 by algebra).
    """
    spread = metrics.masked_std(x.attn_scores, x.row_valid).mean(-1)
    norms = metrics.masked_std(x.half_sq_norms, x.key_valid)
    return torch.where(
        norms > 0, spread / norms, torch.full((), math.nan, dtype=spread.dtype, device=x.q.device)
    )


def logit_scale(x: Softmax) -> Tensor:
    """The RMS of the row-centred attention logits ``s (q.k_i - c ||k_i||^2 / 2)`` (the effective inverse
    temperature, nats).

    :func:`nw_adapter.core.readings.logit_scale`: ``c / h^2`` for NW logits over fixed queries
    and support; a constant gain on q or k multiplies it.
    """
    return readings.logit_scale(x.attn_logits, x.key_valid)


def key_rms(x: Softmax) -> Tensor:
    """The RMS key norm ``sqrt(mean_{valid i} ||k_i||^2)`` (:func:`nw_adapter.core.readings.key_rms`)."""
    return readings.key_rms(x.k, x.key_valid)


# --- the readings: key prior against NW smoother (THEORY.md section 4), per (batch row, head) ----


def r2_key(x: Softmax) -> Tensor:
    """Share of the row-centred logit variance explained by a query-blind key bias (all rows)."""
    return readings.r2_key(x.attn_logits, x.key_valid)


def r2_nw(x: Softmax) -> Tensor:
    """Share of the row-centred logit variance explained by one NW term ``beta G`` (all rows)."""
    return readings.r2_nw(x.attn_logits, x.q, x.k, x.key_valid)


def kl_key_prior(x: Softmax) -> Tensor:
    """``mean_j KL(A_j || A_bar)``, A_bar the attention averaged over the query rows (all rows)."""
    return readings.kl_key_prior(x.attn_logits, x.key_valid)


def kl_nw_fit(x: Softmax) -> Tensor:
    """``mean_j KL(A_j || NW_j(h_eff))`` over all query rows at the fitted beta (fitted on the fit
    rows; a number also where h_eff is not identified: the best NW weights in the search range)."""
    nw = x.nw_scores * x.fitted_beta[..., None, None]
    return metrics.kl_from_logits(x.attn_logits, nw, x.row_valid).mean(-1).clamp_min(0.0)


def nw_gain(x: Softmax) -> Tensor:
    """``kl_key_prior - kl_nw_fit``: > 0 when the fitted NW smoother beats the query-blind average."""
    return kl_key_prior(x) - kl_nw_fit(x)


def h_eff_reason_code(x: Softmax) -> Tensor:
    """Why h_eff is not identified, ``[B, H]`` int64: 0 identified, else 1 + the index in
    :data:`H_EFF_REASONS` of the first reason that holds.

    1: fewer than 2 valid keys; 2: ``1 - r2_key < 1e-6`` (or r2_key undefined: every row's logits
    constant), the attention is the same for every query row; 3: the fitted beta within
    :data:`H_EFF_EDGE_TOLERANCE` (relative) of an end of ``BETA_RANGE * s``; 4: the NW scores'
    query-dependent share ``1 - r2_key(G)`` below :data:`H_EFF_QUERY_TOLERANCE` (the fit's profile
    is flat once a key prior is free: nothing but the key norms fixes beta).
    """
    beta = x.fitted_beta
    ends = [end * x.scale for end in BETA_RANGE]
    edge = ~torch.isfinite(beta)  # no minimiser found at all: nothing identified either
    for end in ends:
        edge = edge | ((beta / end - 1.0).abs() <= H_EFF_EDGE_TOLERANCE)
    blind = ~(1.0 - r2_key(x) >= H_EFF_BLIND_TOLERANCE)
    flat = ~(1.0 - readings.r2_key(x.nw_scores, x.key_valid) >= H_EFF_QUERY_TOLERANCE)
    code = torch.where(flat, 4, 0)
    code = torch.where(edge, 3, code)
    code = torch.where(blind, 2, code)
    return torch.where(x.key_count < 2, 1, code).to(torch.long)


def h_eff(x: Softmax) -> Tensor:
    """The fitted bandwidth ``beta^-1/2``; NaN where it is not identified (:func:`h_eff_reason_code`)."""
    nan = torch.full((), math.nan, dtype=x.fitted_beta.dtype, device=x.q.device)
    return torch.where(h_eff_reason_code(x) == 0, x.fitted_beta.rsqrt(), nan)


def h_eff_se(x: Softmax) -> Tensor:
    """Standard error of h_eff from fitting on n of the N query rows (0 when n = N; NaN with h_eff).

    Fast path only (what its subsample fit adds). The sandwich variance of the M-estimator:
    ``psi_j = E_{NW_j}[G] - E_{A_j}[G]`` and ``L'' = mean_j Var_{NW_j}(G)`` at the fitted beta,
    ``Var(beta) = var_j(psi_j) / (n L''^2) (1 - n/N)`` (sample variance over the fit rows,
    finite-population correction), and ``SE(h) = SE(beta) / (2 beta^1.5)`` (delta method).
    """
    rows, total = x.fit_row_index, x.q.shape[-2]
    n, beta = len(rows), x.fitted_beta
    identified = h_eff_reason_code(x) == 0
    if n == total:
        return torch.where(identified, torch.zeros_like(beta), math.nan)
    g = x.nw_scores[..., rows, :]
    g0 = g if x.valid is None else g.masked_fill(~x.row_valid, 0.0)
    attn = x.weights(x.attn_logits)[..., rows, :]
    nw = x.weights(g * beta[..., None, None])
    mean_nw = (nw * g0).sum(-1)
    psi = mean_nw - (attn * g0).sum(-1)
    curvature = (nw * (g0 - mean_nw[..., None]).square()).sum(-1).mean(-1)
    var_beta = psi.var(-1) / (n * curvature.square()) * (1.0 - n / total)
    return torch.where(identified, var_beta.sqrt() / (2.0 * beta.pow(1.5)), math.nan)


def fit_rows(x: Softmax) -> Tensor:
    """The number of query rows h_eff was fitted on (fast path only)."""
    return torch.full(x.h.shape, float(len(x.fit_row_index)), dtype=x.q.dtype, device=x.q.device)


# --- the table ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Statistic:
    """One entry of :data:`SPECIFICATION`.

    Attributes:
        function: ``Softmax -> [B, H]`` (``[B, H, rows]`` when ``per_query_row``).
        per_query_row: one value per query row, pooled over rows (NaN rows left out).
        needs_draws: reads the nulls' random numbers (NaN without them).
        reading: a reading of the readings pass (NaN when the readings are off).
        fast_path_only: defined for the fast path's subsample fit only (not in compare_attention).
    """

    function: Callable[[Softmax], Tensor]
    per_query_row: bool = False
    needs_draws: bool = False
    reading: bool = False
    fast_path_only: bool = False


#: Every statistic, by name, in record order: the one table of names.
SPECIFICATION: dict[str, Statistic] = {
    "bandwidth": Statistic(bandwidth),
    "rho": Statistic(rho, per_query_row=True),
    "rho_perm_null": Statistic(rho_perm_null, per_query_row=True, needs_draws=True),
    "rho_norm_matched_null": Statistic(rho_norm_matched_null, per_query_row=True, needs_draws=True),
    "rho_spread_null": Statistic(rho_spread_null, per_query_row=True, needs_draws=True),
    "pearson": Statistic(pearson),
    "kl": Statistic(kl),
    "js": Statistic(js),
    "neff_attn": Statistic(neff_attn),
    "neff_nw": Statistic(neff_nw),
    "top1": Statistic(top1),
    "q_norm": Statistic(q_norm),
    "key_norm_cv": Statistic(key_norm_cv),
    "qk_spread_ratio": Statistic(qk_spread_ratio),
    "logit_scale": Statistic(logit_scale),
    "key_rms": Statistic(key_rms),
    "r2_key": Statistic(r2_key, reading=True),
    "r2_nw": Statistic(r2_nw, reading=True),
    "kl_nw_fit": Statistic(kl_nw_fit, reading=True),
    "kl_key_prior": Statistic(kl_key_prior, reading=True),
    "nw_gain": Statistic(nw_gain, reading=True),
    "h_eff": Statistic(h_eff, reading=True),
    "h_eff_se": Statistic(h_eff_se, reading=True, fast_path_only=True),
    "fit_rows": Statistic(fit_rows, reading=True, fast_path_only=True),
}

#: The statistics in record order (the names of the recorder's stats tensor, its CSV and JSON).
STAT_NAMES: tuple[str, ...] = tuple(SPECIFICATION)
#: The readings (NaN when ``NWProcessorConfig(readings=False)``).
READING_STATS: tuple[str, ...] = tuple(n for n, s in SPECIFICATION.items() if s.reading)
#: Defined for the fast path's subsample fit only (``compare_attention`` fits on all rows).
FAST_PATH_ONLY: tuple[str, ...] = tuple(n for n, s in SPECIFICATION.items() if s.fast_path_only)
#: The statistics of one value per query row, pooled over rows.
PER_QUERY_ROW: frozenset[str] = frozenset(n for n, s in SPECIFICATION.items() if s.per_query_row)
#: The statistics that read the nulls' random numbers.
NEEDS_DRAWS: frozenset[str] = frozenset(n for n, s in SPECIFICATION.items() if s.needs_draws)
#: The rows of the recorder's stats tensor: the statistics, then the numeric reason code of h_eff
#: (:func:`h_eff_reason_code`, pooled per CFG half as the first reason among its batch rows).
STAT_ROWS: tuple[str, ...] = (*STAT_NAMES, "h_eff_reason")
