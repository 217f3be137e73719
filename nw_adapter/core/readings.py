"""Readings of one attention head in its own q/k space: a key prior against an NW term of the query.

These readings describe how the attention splits in the head's own q/k space; they do not
recognise a kernel smoother: every dot-product head is exactly an NW smoother in some augmented
space (keys ``[k_i, sqrt(C - ||k_i||^2)]``), and Theorem 3's exact data-space head gets
``nw_gain < 0`` at small bandwidths and an ``h_eff`` that falls as its h rises (docs/THEORY.md,
"What the readings can and cannot establish"; :mod:`nw_adapter.experiments.head_space_limits`).
The scale readings :func:`logit_scale` and :func:`key_rms` carry the testable claims: the
bandwidth path (the slope of ``log logit_scale`` on ``log h``) and the change of scale.

Softmax attention is, by algebra, an NW smoother in the head's own q/k space times a key prior
(THEORY.md section 4): with attention logits ``L_ji = s q_j.k_i`` (softmax scale ``s``),

    ``log A_ji = log NW_ji(h^2 = 1/s) + s ||k_i||^2 / 2 + c_j``,

so comparisons of A with NW weights in head space are partly tautological. The readings below ask
how much of the attention is explained by each of the two parts:

* ``r2_key``: the share of the variance of the row-centred logits explained by a per-key bias
  that ignores the query (a key prior);
* ``r2_nw``: the share explained by one NW term ``beta G``, ``G_ji = q_j.k_i - ||k_i||^2 / 2``;
* ``kl_key_prior = mean_j KL(A_j || A_bar)`` with ``A_bar = mean_j A_j`` (the best query-blind
  weights in mean KL), ``kl_nw_fit = mean_j KL(A_j || NW_j(h_eff))`` at the cross-entropy-optimal
  bandwidth ``h_eff``, and ``nw_gain = kl_key_prior - kl_nw_fit`` (> 0: the NW smoother of the
  query predicts the attention better than the query-blind average does).

Shapes: ``logits`` ``[..., n, m]`` (n query rows, m keys), ``query`` ``[..., n, d]``, ``key``
``[..., m, d]``, ``valid`` an optional bool key mask ``[..., m]`` (broadcastable; True = the key
takes part; the values of ``logits`` at invalid keys are ignored, ``-inf`` included). Every reading
is ``[...]`` (e.g. ``[B, H]``), reduced over the query rows. Everything comes from logits (never
from probabilities that underflow) and runs in float32, or float64 for float64 inputs. Pure torch.

For small logits, ``KL(softmax(a) || softmax(b)) ~ Var_i(a_i - b_i) / 2`` (uniform weights), so
``kl_key_prior ~ (1 - r2_key) V / 2``, ``kl_nw_fit ~ (1 - r2_nw) V / 2`` and
``nw_gain ~ (r2_nw - r2_key) V / 2`` with ``V`` the mean row variance of the logits: the two
variance shares and the two divergences tell the same story in that limit (tested).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nw_adapter.core.bandwidth import fitted_bandwidth
from nw_adapter.core.kernels import compute_dtype, no_autocast, nw_logits
from nw_adapter.core.metrics import kl_from_logits

__all__ = [
    "READING_NAMES",
    "SCALE_NAMES",
    "fit_nw_to_attention",
    "key_prior_log_weights",
    "key_rms",
    "kl_key_prior",
    "logit_scale",
    "nw_readings",
    "r2_key",
    "r2_nw",
    "row_centred",
]

#: The readings of :func:`nw_readings`, in order.
READING_NAMES: tuple[str, ...] = ("r2_key", "r2_nw", "kl_nw_fit", "kl_key_prior", "nw_gain", "h_eff")


#: The scale readings (:func:`logit_scale`, :func:`key_rms`): constant gains on q or k change them
#: by a factor, so their logarithms' trends over denoising (and ratios to a control) are scale-free.
SCALE_NAMES: tuple[str, ...] = ("logit_scale", "key_rms")


def _key_mask(valid: Tensor | None, logits: Tensor) -> Tensor:
    """``valid`` as a bool ``[..., 1, m]`` tensor on ``logits``' device (all True when None)."""
    m = logits.shape[-1]
    if valid is None:
        return torch.ones(m, dtype=torch.bool, device=logits.device)[None, :]
    if not isinstance(valid, Tensor) or valid.dtype != torch.bool or valid.dim() < 1 or valid.shape[-1] != m:
        shape = tuple(valid.shape) if isinstance(valid, Tensor) else type(valid).__name__
        raise ValueError(f"valid must be a bool key mask [..., {m}] (True = the key takes part), got {shape}")
    return valid.to(logits.device)[..., None, :]


def _check_logits(logits: Tensor) -> Tensor:
    if not isinstance(logits, Tensor) or logits.dim() < 2 or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor [..., n, m] (query rows x keys)")
    return logits.to(compute_dtype(logits))


def row_centred(x: Tensor, valid: Tensor | None = None) -> Tensor:
    """Each row minus its mean over the valid keys; 0 at invalid keys.

    ``x~_ji = x_ji - (1/m') sum_{i valid} x_ji`` (m' valid keys).

    Args:
        x: ``[..., n, m]`` scores (logits).
        valid: optional bool ``[..., m]`` key mask.

    Returns:
        ``[..., n, m]`` in the compute dtype (float32, float64 for float64 input).
    """
    x = _check_logits(x)
    mask = _key_mask(valid, x)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    x = torch.where(mask, x, zero)
    count = mask.sum(-1, keepdim=True).to(x.dtype)
    return torch.where(mask, x - x.sum(-1, keepdim=True) / count, zero)


def _share(explained: Tensor, total: Tensor) -> Tensor:
    """``explained / total``; NaN where ``total`` is 0 (every row constant over its valid keys)."""
    nan = torch.full((), math.nan, dtype=total.dtype, device=total.device)
    return torch.where(total > 0, explained / total, nan)


def r2_key(logits: Tensor, valid: Tensor | None = None) -> Tensor:
    """Share of the variance of the row-centred logits explained by a query-blind per-key bias.

    ``b_i = (1/n) sum_j L~_ji`` (column means of the row-centred logits ``L~``; the least-squares
    key bias of the additive model ``L_ji = c_j + b_i + e_ji``) and
    ``r2_key = sum_ji (b_i)^2 / sum_ji (L~_ji)^2 = 1 - sum_ji (L~_ji - b_i)^2 / sum_ji (L~_ji)^2``
    over the valid keys. 1: every query ranks the keys alike (a key prior); about ``1/n`` for
    logits whose key pattern is independent across n rows.

    Args:
        logits: ``[..., n, m]`` attention logits.
        valid: optional bool ``[..., m]`` key mask.

    Returns:
        ``[...]``; NaN where every row is constant over its valid keys (one valid key included).
    """
    centred = row_centred(logits, valid)
    with no_autocast(centred.device):
        bias = centred.mean(-2, keepdim=True)  # [..., 1, m], 0 at invalid keys
        explained = bias.square().sum(-1).squeeze(-1) * centred.shape[-2]
        return _share(explained, centred.square().sum((-1, -2)))


def _nw_scores(query: Tensor, key: Tensor, dtype: torch.dtype) -> Tensor:
    """``G_ji = q_j.k_i - ||k_i||^2 / 2`` (``-||q_j - k_i||^2 / 2`` up to a row constant), ``[..., n, m]``."""
    if not isinstance(query, Tensor) or not isinstance(key, Tensor) or query.dim() < 2 or key.dim() < 2:
        raise ValueError("query must be a tensor [..., n, d] and key [..., m, d]")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must share the head dim d, got {query.shape[-1]} and {key.shape[-1]}"
        )
    q, k = query.to(dtype), key.to(device=query.device, dtype=dtype)
    return q @ k.transpose(-1, -2) - 0.5 * k.square().sum(-1)[..., None, :]


def r2_nw(logits: Tensor, query: Tensor, key: Tensor, valid: Tensor | None = None) -> Tensor:
    """Share of the variance of the row-centred logits explained by one NW term ``beta G~``.

    ``G_ji = q_j.k_i - ||k_i||^2 / 2`` (the NW logits at ``h = 1``, up to a row constant),
    row-centred over the valid keys; ``beta = max(0, <L~, G~> / <G~, G~>)`` (least squares over
    ``beta = 1/h^2 >= 0``), ``r2_nw = 1 - ||L~ - beta G~||^2 / ||L~||^2 = beta <L~, G~> / ||L~||^2``
    (sums over rows and valid keys). An anti-NW head (``<L~, G~> < 0``) gets 0.

    Args:
        logits: ``[..., n, m]`` attention logits.
        query: ``[..., n, d]`` the head's queries.
        key: ``[..., m, d]`` the head's keys.
        valid: optional bool ``[..., m]`` key mask.

    Returns:
        ``[...]``; NaN where the logits are constant in every row; 0 where ``G~`` is 0.
    """
    centred = row_centred(logits, valid)
    g = row_centred(_nw_scores(query, key, centred.dtype), valid)
    with no_autocast(centred.device):
        cross = (centred * g).sum((-1, -2))
        g_square = g.square().sum((-1, -2))
        explained = torch.where(g_square > 0, cross.clamp_min(0.0).square() / g_square, 0.0)
        return _share(explained, centred.square().sum((-1, -2)))


def _log_weights(logits: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(log_softmax(L) [..., n, m], mask [..., 1, m])`` with ``-inf`` at invalid keys."""
    logits = _check_logits(logits)
    mask = _key_mask(valid, logits)
    masked = torch.where(mask, logits, torch.full((), -math.inf, dtype=logits.dtype, device=logits.device))
    return torch.log_softmax(masked, dim=-1), mask


def key_prior_log_weights(logits: Tensor, valid: Tensor | None = None) -> Tensor:
    """``log A_bar_i = log((1/n) sum_j A_ji)``: the attention averaged over the query rows, in log space.

    ``A_bar`` minimises ``mean_j KL(A_j || p)`` over query-blind weights p (the mixture is the
    KL barycentre in this direction). Computed as ``logsumexp_j log A_ji - log n``.

    Args:
        logits: ``[..., n, m]`` attention logits.
        valid: optional bool ``[..., m]`` key mask.

    Returns:
        ``[..., m]``; ``-inf`` at invalid keys.
    """
    log_a, _ = _log_weights(logits, valid)
    with no_autocast(log_a.device):
        return torch.logsumexp(log_a, dim=-2) - math.log(log_a.shape[-2])


def kl_key_prior(logits: Tensor, valid: Tensor | None = None) -> Tensor:
    """``mean_j KL(A_j || A_bar)`` (nats): how far the rows are from the query-blind average.

    0 when every query attends alike; the mutual information between the query row (uniform) and
    the key drawn from its attention row.

    Args:
        logits: ``[..., n, m]`` attention logits.
        valid: optional bool ``[..., m]`` key mask.

    Returns:
        ``[...]`` (clamped at 0 against rounding).
    """
    log_a, mask = _log_weights(logits, valid)
    log_bar = key_prior_log_weights(logits, valid)[..., None, :]
    kl = kl_from_logits(log_a, log_bar.expand_as(log_a), mask.expand_as(log_a)).mean(-1)
    return kl.clamp_min(0.0)  # >= 0 exactly; rounding can give -1e-17


def fit_nw_to_attention(
    logits: Tensor, query: Tensor, key: Tensor, valid: Tensor | None = None, *, steps: int = 40
) -> tuple[Tensor, Tensor]:
    """The NW weights closest to the attention: ``h_eff`` and ``kl_nw_fit = mean_j KL(A_j || NW_j(h_eff))``.

    ``1/h_eff^2 = argmin_beta mean_j CE(A_j || softmax(beta G_j))`` with ``G_ji = -||q_j - k_i||^2 / 2``,
    a convex problem in ``beta`` solved on all query rows (no subsample) by the safeguarded Newton
    iteration of :func:`nw_adapter.core.bandwidth.fitted_bandwidth` (``beta`` in ``[1e-6, 1e6] /
    sqrt(d)``); the divergence is then recomputed from the two sets of logits
    (:func:`~nw_adapter.core.metrics.kl_from_logits`).

    Args:
        logits: ``[..., n, m]`` attention logits.
        query: ``[..., n, d]``.
        key: ``[..., m, d]``.
        valid: optional bool ``[..., m]`` key mask.
        steps: Newton/bisection steps of the fit.

    Returns:
        ``(h_eff, kl_nw_fit)``, both ``[...]``; ``h_eff`` is NaN with fewer than 2 valid keys (no
        bandwidth is identified; the divergence is then 0). Where the loss is flat in ``beta``
        (e.g. one-hot attention rows) any minimiser is returned.
    """
    log_a, mask = _log_weights(logits, valid)
    dtype = compute_dtype(log_a, query, key)
    log_a = log_a.to(dtype)
    q, k = query.to(dtype), key.to(device=query.device, dtype=dtype)
    key_mask = None if valid is None else mask[..., 0, :]
    h, _ = fitted_bandwidth(log_a.exp(), q, k, key_mask=key_mask, steps=steps)
    enough = mask.sum(-1)[..., 0] >= 2
    nw = nw_logits(q, k, h.clamp_min(torch.finfo(dtype).tiny), support_mask=key_mask, validate=False)
    kl = kl_from_logits(log_a, nw, mask.expand_as(log_a)).mean(-1).clamp_min(0.0)  # rounding
    nan = torch.full((), math.nan, dtype=dtype, device=h.device)
    return torch.where(enough, h, nan), torch.where(enough, kl, 0.0)


def nw_readings(logits: Tensor, query: Tensor, key: Tensor, valid: Tensor | None = None) -> dict[str, Tensor]:
    """Every reading of the module (:data:`READING_NAMES`) for one set of heads.

    ``nw_gain = kl_key_prior - kl_nw_fit``: positive when the fitted NW smoother of the query
    predicts the attention rows better (in mean KL) than the query-blind average does.

    Args:
        logits: ``[..., n, m]`` attention logits (e.g. ``q k^T / sqrt(d)``).
        query: ``[..., n, d]`` the head's queries.
        key: ``[..., m, d]`` the head's keys.
        valid: optional bool ``[..., m]`` key mask.

    Returns:
        ``{name: [...] tensor}`` in :data:`READING_NAMES` order.

    Example:
        >>> q, k = torch.randn(2, 4, 64, 8), torch.randn(2, 4, 16, 8)
        >>> out = nw_readings(q @ k.transpose(-1, -2) / 8**0.5, q, k)
        >>> sorted(out) == sorted(READING_NAMES) and out["nw_gain"].shape == (2, 4)
        True
    """
    h_eff, kl_fit = fit_nw_to_attention(logits, query, key, valid)
    prior = kl_key_prior(logits, valid)
    return {
        "r2_key": r2_key(logits, valid),
        "r2_nw": r2_nw(logits, query, key, valid),
        "kl_nw_fit": kl_fit,
        "kl_key_prior": prior,
        "nw_gain": prior - kl_fit,
        "h_eff": h_eff,
    }


def logit_scale(logits: Tensor, valid: Tensor | None = None) -> Tensor:
    """The RMS of the row-centred attention logits: the head's effective inverse temperature (nats).

    ``logit_scale = sqrt((1 / (n m')) sum_j sum_{i valid} L~_ji^2)`` with ``L~`` the logits
    row-centred over the ``m'`` valid keys (:func:`row_centred`). For NW logits
    ``-||q_j - s_i||^2 / 2h^2`` over fixed queries and support it is ``c / h^2`` (``c`` set by the
    geometry), so ``d log logit_scale / d log h = -2`` for Theorem 3's exact head at any support and
    0 for a head of fixed temperature; a constant gain ``g`` on q or on k multiplies it by ``g``
    (adds ``log g`` to its logarithm, leaving that slope unchanged).

    Args:
        logits: ``[..., n, m]`` attention logits (``scale q k^T``).
        valid: optional bool ``[..., m]`` key mask.

    Returns:
        ``[...]``; 0 where every row is constant over its valid keys.

    Example:
        >>> logit_scale(torch.tensor([[[0.0, 2.0]]])).item()
        1.0
    """
    centred = row_centred(logits, valid)
    mask = _key_mask(valid, centred)
    with no_autocast(centred.device):
        count = mask.sum(-1).to(centred.dtype).clamp_min(1.0)  # [..., 1]
        per_row = centred.square().sum(-1) / count  # [..., n]
        return per_row.mean(-1).sqrt()


def key_rms(key: Tensor, valid: Tensor | None = None) -> Tensor:
    """The RMS norm of the valid keys, ``sqrt((1/m') sum_{i valid} ||k_i||^2)`` (head space).

    The ratio of two adapters' ``key_rms`` over the same image tokens is their change of scale:
    a gain ``c`` on the image tokens of a bias-free key projection multiplies it by ``|c|``.

    Args:
        key: ``[..., m, d]`` keys.
        valid: optional bool ``[..., m]`` key mask.

    Returns:
        ``[...]`` in the compute dtype (float32, float64 for float64 input).
    """
    if not isinstance(key, Tensor) or key.dim() < 2 or not key.is_floating_point():
        raise ValueError("key must be a floating-point tensor [..., m, d]")
    k = key.to(compute_dtype(key))
    square = k.square().sum(-1)  # [..., m]
    with no_autocast(k.device):
        if valid is None:
            return square.mean(-1).sqrt()
        mask = _key_mask(valid, square[..., None, :])[..., 0, :]
        weight = mask.to(k.dtype)
        return ((square * weight).sum(-1) / weight.sum(-1).clamp_min(1.0)).sqrt()
