"""The statistics of one image-branch softmax, written plainly: the executable specification.

Read this module first (THEORY.md section 4 in code). One softmax of an IP-Adapter image
branch has queries ``q [B, H, N, d]`` and image keys ``k [B, H, M, d]``. Its attention weights
and the Nadaraya-Watson (NW) weights at bandwidth h are

    A = softmax(s q.k_i)                  (s = the stock scale, 1/sqrt(d) for SDPA)
    W = softmax(-||q - k_i||^2 / 2h^2) = softmax((q.k_i - ||k_i||^2 / 2) / h^2),

so the ranks of A in a row are those of ``q.k_i`` and the ranks of W (any h) those of
``q.k_i - ||k_i||^2 / 2``. Every statistic below is one function of a :class:`Softmax` that
returns one value per (batch row, head) ``[B, H]``, or, for rho and its nulls, one value per
query row ``[B, H, rows]`` (NaN for a constant row). :func:`reference_statistics` then pools
them over each CFG half: rho and its nulls over all query rows of the half's batch rows (NaN
rows left out), the others averaged over the half's batch rows.

Ranks and divergences come from logits through :mod:`nw_adapter.core.metrics`, never from
probabilities that underflow. Everything runs in the dtype of the inputs (float64 for float64),
with the nulls' random numbers passed in (:class:`~.nulls.NullDraws`), so the fast path
(:mod:`.fast`) is tested equal to this module on the same draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from nw_adapter.core import metrics, readings
from nw_adapter.core.bandwidth import fitted_bandwidth
from nw_adapter.integration.schema import READING_STATS, STAT_NAMES
from nw_adapter.integration.stats.layout import fit_row_indices
from nw_adapter.integration.stats.nulls import NullDraws


@dataclass(frozen=True)
class Softmax:
    """One softmax of the image branch and what every statistic reads from it.

    Attributes:
        q: queries ``[B, H, N, d]``.
        k: image keys ``[B, H, M, d]``.
        scale: s, the stock softmax scale.
        h: the NW bandwidth ``[B, H]``.
        valid: bool ``[B, M]`` mask of the keys that take part (None = all).
        draws: the nulls' random numbers (None = no nulls).
        fit_rows: the readings' bandwidth fit uses this many evenly spaced query rows (None = all).
    """

    q: torch.Tensor
    k: torch.Tensor
    scale: float
    h: torch.Tensor
    valid: torch.Tensor | None
    draws: NullDraws | None
    fit_rows: int | None = None

    @cached_property
    def row_valid(self) -> torch.Tensor | None:
        """The key mask broadcast over heads and query rows, ``[B, 1, 1, M]`` (or None)."""
        return None if self.valid is None else self.valid[:, None, None, :]

    @cached_property
    def key_valid(self) -> torch.Tensor | None:
        """The key mask broadcast over heads, ``[B, 1, M]`` (or None)."""
        return None if self.valid is None else self.valid[:, None, :]

    @cached_property
    def qk(self) -> torch.Tensor:
        """``q.k_i`` ``[B, H, N, M]``: the attention's scores."""
        return self.q @ self.k.transpose(-1, -2)

    @cached_property
    def half_sq_norms(self) -> torch.Tensor:
        """``||k_i||^2 / 2`` ``[B, H, M]``: the key prior's exponent."""
        return 0.5 * self.k.square().sum(-1)

    @cached_property
    def nw_scores(self) -> torch.Tensor:
        """``q.k_i - ||k_i||^2 / 2`` ``[B, H, N, M]``: the NW weights' scores (their ranks at any h)."""
        return self.qk - self.half_sq_norms[..., None, :]

    @cached_property
    def attn_logits(self) -> torch.Tensor:
        """``s q.k_i`` ``[B, H, N, M]``: A = softmax of these."""
        return self.scale * self.qk

    @cached_property
    def nw_logits(self) -> torch.Tensor:
        """``(q.k_i - ||k_i||^2 / 2) / h^2`` ``[B, H, N, M]``: W = softmax of these."""
        return self.nw_scores / self.h[..., None, None].square()

    def weights(self, logits: torch.Tensor) -> torch.Tensor:
        """``softmax(logits)`` over the valid keys ``[B, H, N, M]`` (0 at padding keys)."""
        if self.valid is not None:
            logits = logits.masked_fill(~self.row_valid, -math.inf)
        return torch.softmax(logits, dim=-1)

    @cached_property
    def null_rows(self) -> torch.Tensor:
        """The query rows the nulls use, ``[n0]``."""
        return self._draws().rows

    @cached_property
    def permutation(self) -> torch.Tensor:
        """One random permutation of the valid keys per null row, ``[B, H, n0, M]`` (index)."""
        return metrics.valid_permutation(self._draws().noise, self.row_valid)

    @cached_property
    def fit_row_index(self) -> list[int]:
        """The query rows the readings' bandwidth is fitted on (evenly spaced), ``n`` of ``N``."""
        n = self.q.shape[-2]
        return fit_row_indices(n, n if self.fit_rows is None else self.fit_rows)

    @cached_property
    def fitted_beta(self) -> torch.Tensor:
        """``beta = 1/h_eff^2 = argmin mean_j CE(A_j || softmax(beta G_j))`` over the fit rows ``[B, H]``
        (:func:`~nw_adapter.core.bandwidth.fitted_bandwidth`, 60 steps, bracket ``[1e-6, 1e6] s``)."""
        rows = self.fit_row_index
        attn = self.weights(self.attn_logits)[..., rows, :]
        ratio = self.scale * math.sqrt(self.q.shape[-1])  # fitted_bandwidth's range is relative to 1/sqrt(d)
        h, _ = fitted_bandwidth(
            attn,
            self.q[..., rows, :],
            self.k,
            key_mask=self.key_valid,
            steps=60,
            beta_range=(1e-6 * ratio, 1e6 * ratio),
        )
        return h.square().reciprocal()

    def _draws(self) -> NullDraws:
        if self.draws is None:
            raise ValueError("the nulls need their draws (draw_nulls); pass draws=None to skip the nulls")
        return self.draws


# --- rho and its nulls: one value per query row -------------------------------------------------


def rho(x: Softmax) -> torch.Tensor:
    """Per-row Spearman correlation of A and W: ranks of ``q.k_i`` against ``q.k_i - ||k_i||^2 / 2``."""
    return metrics.rowwise_spearman(x.qk, x.nw_scores, x.row_valid)


def rho_perm_null(x: Softmax) -> torch.Tensor:
    """rho with the attention scores of each null row shuffled across the valid keys (expected ~0)."""
    qk = x.qk[..., x.null_rows, :]
    shuffled = torch.gather(qk, -1, x.permutation)
    return metrics.rowwise_spearman(shuffled, x.nw_scores[..., x.null_rows, :], x.row_valid)


def rho_norm_matched_null(x: Softmax) -> torch.Tensor:
    """rho of queries of the same norms in random directions: ``q' = ||q|| z / ||z||``, z ~ N(0, I)."""
    q = x.q[..., x.null_rows, :]
    z = x._draws().directions.to(q.dtype)
    q_null = z * (q.norm(dim=-1, keepdim=True) / z.norm(dim=-1, keepdim=True))
    qk = q_null @ x.k.transpose(-1, -2)
    return metrics.rowwise_spearman(qk, qk - x.half_sq_norms[..., None, :], x.row_valid)


def rho_spread_null(x: Softmax) -> torch.Tensor:
    """rho with each row's ``q.k`` kept and its pairing with the key norms shuffled:
    ``q.k_i`` against ``q.k_i - ||k_pi(i)||^2 / 2``."""
    qk = x.qk[..., x.null_rows, :]
    shuffled_half_sq = torch.gather(x.half_sq_norms[..., None, :].expand_as(qk), -1, x.permutation)
    return metrics.rowwise_spearman(qk, qk - shuffled_half_sq, x.row_valid)


# --- the other statistics: one value per (batch row, head) -------------------------------------


def bandwidth(x: Softmax) -> torch.Tensor:
    """The bandwidth h the NW weights were computed at."""
    return x.h


def pearson(x: Softmax) -> torch.Tensor:
    """Pearson correlation of A and W over all query rows and valid keys (the raveled matrices)."""
    attn, nw = x.weights(x.attn_logits), x.weights(x.nw_logits)
    if x.valid is None:
        return metrics.pearson_raveled(attn, nw)
    return torch.stack(
        [metrics.pearson_raveled(attn[i][..., keep], nw[i][..., keep]) for i, keep in enumerate(x.valid)]
    )


def kl(x: Softmax) -> torch.Tensor:
    """``KL(A || W)`` in nats, averaged over the query rows."""
    return metrics.kl_from_logits(x.attn_logits, x.nw_logits, x.row_valid).mean(-1)


def js(x: Softmax) -> torch.Tensor:
    """Jensen-Shannon divergence of A and W, averaged over the query rows."""
    return metrics.js_from_logits(x.attn_logits, x.nw_logits, x.row_valid).mean(-1)


def neff_attn(x: Softmax) -> torch.Tensor:
    """Effective number of keys of A, ``1 / sum_i a_i^2``, averaged over the query rows."""
    return x.weights(x.attn_logits).square().sum(-1).reciprocal().mean(-1)


def neff_nw(x: Softmax) -> torch.Tensor:
    """Effective number of keys of W, ``1 / sum_i w_i^2``, averaged over the query rows."""
    return x.weights(x.nw_logits).square().sum(-1).reciprocal().mean(-1)


def top1(x: Softmax) -> torch.Tensor:
    """Fraction of query rows whose top key is the same under A and W."""
    return metrics.top1_agreement(x.qk, x.nw_scores, x.row_valid).mean(-1)


def q_norm(x: Softmax) -> torch.Tensor:
    """Mean query norm ``||q||`` (rho rises with it even for random queries)."""
    return x.q.norm(dim=-1).mean(-1)


def key_norm_cv(x: Softmax) -> torch.Tensor:
    """Coefficient of variation of the key norms, ``std_i ||k_i|| / mean_i ||k_i||`` (valid keys)."""
    norms = x.k.norm(dim=-1)
    if x.valid is None:
        return norms.std(-1, correction=0) / norms.mean(-1)
    weight = x.key_valid.to(norms.dtype)
    mean = (norms * weight).sum(-1) / weight.sum(-1)
    return metrics.masked_std(norms, x.key_valid) / mean


def qk_spread_ratio(x: Softmax) -> torch.Tensor:
    """``mean_rows std_i(q.k_i) / std_i(||k_i||^2 / 2)``: what rho is a function of.

    :func:`~nw_adapter.core.metrics.qk_spread_ratio` without a key mask; with one, its two
    population standard deviations over the valid keys of each batch row.
    """
    if x.valid is None:
        return metrics.qk_spread_ratio(x.q, x.k)
    return metrics.masked_std(x.qk, x.row_valid).mean(-1) / metrics.masked_std(x.half_sq_norms, x.key_valid)


# --- the readings: key prior against NW smoother (THEORY.md section 4), per (batch row, head) ----


def r2_key(x: Softmax) -> torch.Tensor:
    """Share of the row-centred logit variance explained by a query-blind key bias (all rows)."""
    return readings.r2_key(x.attn_logits, x.key_valid)


def r2_nw(x: Softmax) -> torch.Tensor:
    """Share of the row-centred logit variance explained by one NW term ``beta G`` (all rows)."""
    return readings.r2_nw(x.attn_logits, x.q, x.k, x.key_valid)


def kl_key_prior(x: Softmax) -> torch.Tensor:
    """``mean_j KL(A_j || A_bar)``, A_bar the attention averaged over the query rows (all rows)."""
    return readings.kl_key_prior(x.attn_logits, x.key_valid)


def kl_nw_fit(x: Softmax) -> torch.Tensor:
    """``mean_j KL(A_j || NW_j(h_eff))`` over all query rows (h_eff fitted on the fit rows)."""
    nw = x.nw_scores * x.fitted_beta[..., None, None]
    return metrics.kl_from_logits(x.attn_logits, nw, x.row_valid).mean(-1).clamp_min(0.0)


def nw_gain(x: Softmax) -> torch.Tensor:
    """``kl_key_prior - kl_nw_fit``: > 0 when the fitted NW smoother beats the query-blind average."""
    return kl_key_prior(x) - kl_nw_fit(x)


def h_eff(x: Softmax) -> torch.Tensor:
    """The fitted bandwidth ``beta^-1/2``."""
    return x.fitted_beta.rsqrt()


def h_eff_se(x: Softmax) -> torch.Tensor:
    """Standard error of h_eff from fitting on n of the N query rows (0 when n = N).

    The sandwich variance of the M-estimator: ``psi_j = E_{NW_j}[G] - E_{A_j}[G]`` and
    ``L'' = mean_j Var_{NW_j}(G)`` at the fitted beta, ``Var(beta) = var_j(psi_j) / (n L''^2)
    (1 - n/N)`` (sample variance over the fit rows, finite-population correction), and
    ``SE(h) = SE(beta) / (2 beta^1.5)`` (delta method, h = beta^-1/2).
    """
    rows, total = x.fit_row_index, x.q.shape[-2]
    n, beta = len(rows), x.fitted_beta
    if n == total:
        return torch.zeros_like(beta)
    g = x.nw_scores[..., rows, :]
    g0 = g if x.valid is None else g.masked_fill(~x.row_valid, 0.0)
    attn = x.weights(x.attn_logits)[..., rows, :]
    nw = x.weights(g * beta[..., None, None])
    mean_nw = (nw * g0).sum(-1)
    psi = mean_nw - (attn * g0).sum(-1)
    curvature = (nw * (g0 - mean_nw[..., None]).square()).sum(-1).mean(-1)
    var_beta = psi.var(-1) / (n * curvature.square()) * (1.0 - n / total)
    return var_beta.sqrt() / (2.0 * beta.pow(1.5))


def fit_rows(x: Softmax) -> torch.Tensor:
    """The number of query rows h_eff was fitted on."""
    return torch.full(x.h.shape, float(len(x.fit_row_index)), dtype=x.q.dtype, device=x.q.device)


# --- the table and the pooling over CFG halves ---------------------------------------------------

#: Every statistic of :data:`~nw_adapter.integration.schema.STAT_NAMES`, by name.
REFERENCE: dict[str, Callable[[Softmax], torch.Tensor]] = {
    "bandwidth": bandwidth,
    "rho": rho,
    "rho_perm_null": rho_perm_null,
    "rho_norm_matched_null": rho_norm_matched_null,
    "rho_spread_null": rho_spread_null,
    "pearson": pearson,
    "kl": kl,
    "js": js,
    "neff_attn": neff_attn,
    "neff_nw": neff_nw,
    "top1": top1,
    "q_norm": q_norm,
    "key_norm_cv": key_norm_cv,
    "qk_spread_ratio": qk_spread_ratio,
    "r2_key": r2_key,
    "r2_nw": r2_nw,
    "kl_nw_fit": kl_nw_fit,
    "kl_key_prior": kl_key_prior,
    "nw_gain": nw_gain,
    "h_eff": h_eff,
    "h_eff_se": h_eff_se,
    "fit_rows": fit_rows,
}

#: The statistics of one value per query row, pooled over rows (the others per batch row).
PER_QUERY_ROW: frozenset[str] = frozenset(
    {"rho", "rho_perm_null", "rho_norm_matched_null", "rho_spread_null"}
)

#: The statistics that need the nulls' draws (NaN without them).
NEEDS_DRAWS: frozenset[str] = frozenset({"rho_perm_null", "rho_norm_matched_null", "rho_spread_null"})

assert tuple(REFERENCE) == STAT_NAMES, "reference.REFERENCE must list STAT_NAMES, in order"


def pool_halves(values: torch.Tensor, halves: int, per_query_row: bool) -> torch.Tensor:
    """Pool ``[B, H]`` (or ``[B, H, rows]``) values over the batch rows of each CFG half.

    Per batch row: the mean over the half's batch rows. Per query row: the mean over every
    query row of the half's batch rows, NaN (constant) rows left out. Returns ``[halves, H]``.
    """
    b, nh = values.shape[:2]
    grouped = values.reshape(halves, b // halves, nh, -1)
    if per_query_row:
        return grouped.transpose(1, 2).flatten(2).nanmean(-1)
    return grouped[..., 0].mean(1)


def reference_statistics(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    h: torch.Tensor | float,
    draws: NullDraws | None = None,
    valid: torch.Tensor | None = None,
    halves: int = 1,
    readings: bool = True,
    fit_rows: int | None = 256,
) -> torch.Tensor:
    """Every statistic of one softmax, pooled per CFG half: ``[S, halves, H]`` in STAT_NAMES order.

    Args:
        q: queries ``[B, H, N, d]`` (float64 for a float64 reference).
        k: image keys ``[B, H, M, d]``.
        scale: s, the stock softmax scale.
        h: the NW bandwidth: a float, a 0-d or a ``[B, H]`` tensor.
        draws: the nulls' random numbers; None = the nulls are NaN.
        valid: optional bool ``[B, M]`` mask of the keys that take part.
        halves: 2 when the batch is [uncond; cond].
        readings: compute the readings (:data:`~nw_adapter.integration.schema.READING_STATS`);
            False = NaN.
        fit_rows: evenly spaced query rows of the readings' bandwidth fit (None = all).

    Returns:
        ``[S, halves, H]`` in the dtype of ``q``.
    """
    b, nh = q.shape[:2]
    k = k.to(q.dtype)
    h = torch.as_tensor(h, dtype=q.dtype, device=q.device).expand(b, nh)
    x = Softmax(q, k, scale, h, valid, draws, fit_rows)
    rows = []
    for name, statistic in REFERENCE.items():
        if (draws is None and name in NEEDS_DRAWS) or (not readings and name in READING_STATS):
            rows.append(torch.full((halves, nh), math.nan, dtype=q.dtype, device=q.device))
        else:
            rows.append(pool_halves(statistic(x), halves, name in PER_QUERY_ROW))
    return torch.stack(rows)
