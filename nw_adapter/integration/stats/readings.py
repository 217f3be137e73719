"""The readings pass of the fast path: key prior against NW smoother, per (batch row, head).

Computes what :mod:`.reference` specifies for :data:`~nw_adapter.integration.schema.READING_STATS`
(on top of :mod:`nw_adapter.core.readings`) from tensors the fast path already holds: the
observed pairs ``(q.k_i, G_i)`` with ``G_i = q.k_i - ||k_i||^2 / 2``, the attention weights ``a``
and log-weights ``l_A`` of pass 3 and the per-row feature ``a.l_A = -H(A_j)``. With ``n`` query
rows and the attention logits ``L = s q.k`` over the valid keys:

- ``r2_key = n sum_i b_i^2 / <L~, L~>`` with ``L~`` the row-centred logits and ``b_i`` their
  column means; ``r2_nw = max(0, <L~, G~>)^2 / (<G~, G~> <L~, L~>)`` (both invariant to the scale
  s, so computed on ``q.k``): one batched 2 x 2 Gram per row, summed over rows, and one column sum.
- ``kl_key_prior = mean_j KL(A_j || A_bar) = H(A_bar) - mean_j H(A_j)``, ``A_bar = mean_j A_j``:
  ``mean_j a.l_A - sum_i xlogy(A_bar_i, A_bar_i)``.
- ``h_eff = beta^-1/2``, ``beta = argmin mean_j CE(A_j || softmax(beta G_j))`` over the ``fit_rows``
  evenly spaced rows (:func:`~.layout.fit_row_indices`): :data:`FIT_STEPS` safeguarded Newton steps
  (fewer eager on the CPU once no beta moves, :data:`FIT_SETTLED`) from ``beta = s slope`` (the
  least-squares slope of the row-centred logits on G~, ``<L~, G~> / <G~, G~>``; ``s`` where it is
  not positive) inside the bracket ``[1e-6 s, 1e6 s]`` (bisection at the geometric mean where Newton
  leaves it), the algorithm of :func:`nw_adapter.core.bandwidth.fitted_bandwidth`, after one look at
  the gradient at both ends of the range (an optimum at an end is that end at once). Each row is
  shifted by its target ``t_j = E_{A_j}[G]`` (a softmax does not see a row constant), so with ``G'_j
  = G_j - t_j`` and ``p_j = softmax(beta G_j)``, two sums over the keys give per row ``psi_j = p_j .
  G'_j = E_{p_j}[G] - E_{A_j}[G]`` and ``E_p[G'^2]_j = p_j . G'^2_j``, and sums over rows ``L'(beta)
  n = sum_j psi_j`` and ``L''(beta) n = sum_j Var_{p_j}(G) = sum_j (E_p[G'^2]_j - psi_j^2)``.
- ``h_eff_se``: the sandwich (delta-method) standard error of the M-estimator,
  ``Var(beta) = var_j(psi_j) / (n L''^2) (1 - n/N)`` (finite-population correction) and
  ``SE(h) = SE(beta) / (2 beta^1.5)``; exactly 0 when every row was used.
- ``kl_nw_fit = mean_j KL(A_j || NW_j(h_eff)) = mean_j (a.l_A_j + logsumexp_i(beta G'_ji))`` over
  ALL rows (``a.G'_j = 0``): one more log-sum-exp, of shifted logits (no cancellation of large
  key norms). ``nw_gain = kl_key_prior - kl_nw_fit``.

Everything is float32 and keys-major (the keys on a leading dimension, the query rows last, as the
fast path holds its tensors), written into the per-(batch row, head) tensor of the fast path by name.
No host reads and no random numbers.
"""

from __future__ import annotations

import torch

from nw_adapter.core.specification import (
    BETA_RANGE,
    H_EFF_BLIND_TOLERANCE,
    H_EFF_EDGE_TOLERANCE,
    H_EFF_QUERY_TOLERANCE,
    fit_row_indices,
)
from nw_adapter.integration.stats.workspace import EagerWriter, f32

#: Safeguarded Newton steps of the bandwidth fit (after the look at the range's ends). Measured from
#: beta = s against the float64 reference fitted with 60 steps on 60 random heads (d 4-64, 4-77 keys,
#: query scales e^(1.5 z), key offsets, anti-NW heads): worst relative error of h_eff 2e-2 after 8
#: steps, below 5e-5 after 10 (but one nearly flat loss, tiny queries: 4e-4, float32's limit there).
#: From the least-squares start (:func:`_fit`), on another 60 such heads, no worse than from s at
#: any step count (within 1e-4 of the reference: 36 of 60 after 4 steps against 33, 58 of 60 after
#: 10 and 12 either way; the other 2 within 4e-3 after 12).
FIT_STEPS = 12
#: Eager on the CPU the fit stops before :data:`FIT_STEPS` once a step moved no beta by more than
#: this (relative): near the optimum a Newton step's size is the distance left (convex loss), and
#: the next would move it by about its square. Measured on 200 random heads (d 4-64, 2-19 keys, 1-79
#: rows, query scales e^(1.5 z), shared key offsets, anti-NW heads): h_eff within 1.1e-5 of the
#: 12-step answer (1.9e-6 at 1e-5, which costs one more softmax per fit). Elsewhere (a GPU,
#: compiled) all steps run: no host read.
FIT_SETTLED = 1e-4


def fit_count(n: int, fit_rows: int | None) -> int:
    """The number of query rows the bandwidth is fitted on (all ``n`` when ``fit_rows`` is None)."""
    return n if fit_rows is None else min(n, fit_rows)


def write_readings(
    w: EagerWriter,
    out: dict[str, torch.Tensor],
    observed: torch.Tensor,
    masked: torch.Tensor,
    attn: torch.Tensor,
    neg_entropy: torch.Tensor,
    valid_keys: torch.Tensor | None,
    inv_count: torch.Tensor | float,
    scale: float | torch.Tensor,
    fit_rows: int | None,
) -> None:
    """The readings of every (batch row, head), written into ``out[name]`` (``[B, H]`` views).

    Every tensor is keys-major (the keys on a leading dimension, the query rows last), as the fast
    path holds them: each reduction over the keys runs along the rows.

    Args:
        w: the writer of this call.
        out: ``{name: [B, H] view}`` for r2_key, r2_nw, kl_nw_fit, kl_key_prior, nw_gain, h_eff
            and h_eff_se (``fit_rows`` is a constant of the call, written by the caller).
        observed: the observed pairs ``[B, H, M, 2, N]`` (``q.k``, ``G``), unmasked.
        masked: the same with a large negative finite logit at padding keys.
        attn: the attention weights A ``[B, H, M, N]`` (0 at padding keys).
        neg_entropy: ``a.l_A = -H(A_j)`` per row ``[B, H, N]``.
        valid_keys: bool ``[B, 1, M, 1, 1]`` key mask or None.
        inv_count: 1 / the number of valid keys (float, or ``[B, 1, 1, 1, 1]``).
        scale: the softmax scale s (the fit's start is s times the least-squares slope), a float or
            ``[B, H]``.
        fit_rows: rows the bandwidth is fitted on (evenly spaced), None = all.
    """
    slope, g_key_share = _write_shares(w, out, observed, valid_keys, inv_count)  # [B, H] each
    n = attn.shape[-1]
    a_bar = attn.mean(-1)  # A_bar [B, H, M]
    prior = torch.xlogy(a_bar, a_bar).sum(-1)  # -H(A_bar)
    mean_neg_entropy = neg_entropy.mean(-1)
    w.write(out["kl_key_prior"], torch.sub, mean_neg_entropy, prior).clamp_min_(0.0)

    g = masked[:, :, :, 1]  # [B, H, M, N], padding keys very negative
    targets = w.workspace("fit targets", tuple(neg_entropy.shape), g.device)
    target = w.vecdot(targets, attn, g, dim=2)  # E_A[G] per row [B, H, N]
    shifted = g - target[:, :, None]  # G'_j = G_j - t_j (padding keys stay very negative)
    count = fit_count(n, fit_rows)
    rows = None
    if count < n:
        rows = w.constant(("fit rows", n, count, g.device), lambda: _rows(n, count, g.device))
    valid = None if valid_keys is None else valid_keys[..., 0]  # [B, 1, M, 1]
    beta, moments = _fit(w, shifted, valid, rows, scale, slope, moments_at_beta=count < n)
    unidentified = _write_reason(w, out, beta, inv_count, scale, g_key_share)
    w.write(out["h_eff"], torch.rsqrt, beta).masked_fill_(unidentified, float("nan"))
    if moments is None:  # every row fitted: no sampling error
        out["h_eff_se"].fill_(0.0)
    else:
        _write_standard_error(w, out["h_eff_se"], beta, moments, count, n)
    out["h_eff_se"].masked_fill_(unidentified, float("nan"))
    lse = torch.logsumexp(shifted * beta[..., None, None], 2)  # [B, H, N]
    kl_fit = w.write(out["kl_nw_fit"], torch.add, mean_neg_entropy, lse.mean(-1)).clamp_min_(0.0)
    w.write(out["nw_gain"], torch.sub, out["kl_key_prior"], kl_fit)


def _write_reason(
    w: EagerWriter,
    out: dict[str, torch.Tensor],
    beta: torch.Tensor,
    inv_count: torch.Tensor | float,
    scale: float | torch.Tensor,
    g_key_share: torch.Tensor,
) -> torch.Tensor:
    """h_eff's reason code into ``out["h_eff_reason"]`` ``[B, H]``, as the specification's
    :func:`~nw_adapter.core.specification.h_eff_reason_code`: 1 fewer than 2 valid keys, 2
    query-blind (``1 - r2_key < 1e-6``, or r2_key NaN: constant logits), 3 beta within 1e-3
    (relative) of an end of its bracket, 4 the NW scores' query-dependent share below 1e-4
    (``g_key_share``, r2_key of G, above ``1 - 1e-4``: a flat profile), else 0. Returns the bool
    ``[B, H]`` of the cells whose h_eff is not identified."""
    low, high = (end * scale for end in BETA_RANGE)
    inside = (low * (1.0 + H_EFF_EDGE_TOLERANCE), high * (1.0 - H_EFF_EDGE_TOLERANCE))
    edge = torch.clamp(beta, *inside) != beta
    flat = torch.le(g_key_share, 1.0 - H_EFF_QUERY_TOLERANCE).logical_not_()  # NaN share: flat too
    code = w.write(out["h_eff_reason"], torch.mul, flat, 4.0).masked_fill_(edge, 3.0)
    seen = torch.le(out["r2_key"], 1.0 - H_EFF_BLIND_TOLERANCE)  # False for NaN: blind
    two = w.constant(("reason 2", beta.device), lambda: f32(2.0, beta.device))
    w.write(code, torch.where, seen, code, two)
    if isinstance(inv_count, float):
        if inv_count > 0.5:
            code.fill_(1.0)
    else:
        code.masked_fill_(inv_count.view(-1, 1) > 0.5, 1.0)  # [B, 1, 1, 1, 1] -> [B, 1]
    return code != 0


def _rows(n: int, count: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(fit_row_indices(n, count), dtype=torch.long, device=device)


def _write_shares(
    w: EagerWriter,
    out: dict[str, torch.Tensor],
    observed: torch.Tensor,
    valid_keys: torch.Tensor | None,
    inv_count: torch.Tensor | float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``r2_key`` and ``r2_nw`` from the row-centred keys-major pairs (``q.k``, ``G``) ``[B, H, M, 2, N]``
    over the valid keys; returns the least-squares slope ``<L~, G~> / <G~, G~>`` ``[B, H]`` (NaN
    where G~ is 0), the fit's start, and ``r2_key`` of the NW scores ``n sum_i g_i^2 / <G~, G~>``
    (``g_i`` the column means of G~; NaN where G~ is 0): 1 minus their query-dependent share."""
    n = observed.shape[-1]
    if valid_keys is None:
        centred = observed - observed.mean(2, keepdim=True)
    else:
        weight = valid_keys.to(observed.dtype)  # [B, 1, M, 1, 1]
        kept = observed * weight
        centred = torch.sub(kept, kept.sum(2, keepdim=True) * inv_count).mul_(weight)
    logit, nw = centred[:, :, :, 0], centred[:, :, :, 1]  # [B, H, M, N]
    ll = (logit * logit).sum((-2, -1))
    lg = (logit * nw).sum((-2, -1))
    gg = (nw * nw).sum((-2, -1))
    columns = centred.sum(-1)  # n b_i and n g_i [B, H, M, 2]
    bias = torch.linalg.vector_norm(columns, dim=2).square_()  # [B, H, 2]
    w.write(out["r2_key"], torch.div, bias[..., 0], ll * n)
    explained = torch.where(gg > 0, lg.clamp_min(0.0).square() / gg, 0.0)  # 0 where G~ is 0
    w.write(out["r2_nw"], torch.div, explained, ll)
    return lg / gg, torch.div(bias[..., 1], gg * n)


def _fit(
    w: EagerWriter,
    shifted: torch.Tensor,
    valid: torch.Tensor | None,
    rows: torch.Tensor | None,
    scale: float | torch.Tensor,
    slope: torch.Tensor,
    moments_at_beta: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """beta ``[B, H]`` and the per-row moments ``[B, H, 2, n]`` (``psi_j``, ``E_p[G'^2]_j``) at beta
    (None unless ``moments_at_beta``: only the standard error of a fit on a subset of the rows reads
    them, and they cost one more softmax), from ``beta = s slope`` (``slope [B, H]``: ``<L~, G~> /
    <G~, G~>`` over all rows; ``s`` where it is not positive) inside the bracket.

    Keys-major (``shifted [B, H, M, N]``, ``valid [B, 1, M, 1]``): every softmax over the M keys
    runs along a non-last dimension, vectorised across the rows. Per Newton step
    ``p = softmax(beta G')``, ``psi_j = p_j . G'_j`` and ``E_p[G'^2]_j = p_j . G'^2_j``, then one
    Gram product over rows of ``[1, psi_j, E_p[G'^2]_j]`` gives ``n L' = sum_j psi_j`` and
    ``n L'' = sum_j (E_p[G'^2]_j - psi_j^2)`` (the weights sum to 1)."""
    logits = shifted if rows is None else shifted.index_select(-1, rows)  # [B, H, M, n]
    b, nh, m, n = logits.shape
    powers = w.workspace("fit powers", (b, nh, 2, m, n), logits.device)  # [G', G'^2] (0: padding)
    if valid is None:
        zeroed = powers[:, :, 0].copy_(logits)
    else:
        zeroed = w.write(powers[:, :, 0], torch.mul, logits, valid)
    w.write(powers[:, :, 1], torch.square, zeroed)
    low, high = BETA_RANGE
    if isinstance(scale, torch.Tensor):  # a per-head scale: [B, H, 2] ends, [B, H] start
        s = scale.float().expand(b, nh)
        ends = torch.stack([s * low, s * high], -1)
        start = s
    else:
        ends = w.constant(
            ("fit bracket", scale, logits.device), lambda: f32([low * scale, high * scale], logits.device)
        )
        # the start: s times the least-squares slope of the row-centred logits on G~ (the answer when
        # A is an NW smoother, s log A = beta G + row constants), s where that slope is not positive
        start = w.constant(("fit start", scale, logits.device), lambda: f32(scale, logits.device))
    bracket = _bracket(logits, zeroed, ends)
    sides = w.constant(("fit sides", logits.device), lambda: f32([1.0, -1.0], logits.device))
    beta = torch.clamp(torch.where(slope > 0, slope * scale, start), bracket[..., 0], bracket[..., 1])
    moments = w.workspace("fit moments", (b, nh, 3, n), logits.device)  # per row [1, psi_j, E_p[G'^2]_j]
    moments[:, :, 0].fill_(1.0)
    sums = w.workspace("fit moment sums", (b, nh, 3, 3), logits.device)
    for _ in range(FIT_STEPS):
        _moments(w, moments, logits, powers, beta)
        w.products(sums, moments, moments)  # their Gram over rows
        grad = sums[..., 0, 1]  # n L'(beta) = sum_j psi_j
        hess = sums[..., 0, 2] - sums[..., 1, 1]  # n L'' = sum_j (E_p[G'^2]_j - psi_j^2)
        # the optimum lies right of beta where L' < 0 (raise the lower end), left where L' > 0
        bracket = torch.where(grad[..., None] * sides < 0, beta[..., None], bracket)
        newton = torch.addcdiv(beta, grad, hess, value=-1.0)
        inside = torch.clamp(newton, bracket[..., 0], bracket[..., 1]) == newton  # NaN (flat loss): not
        beta, previous = torch.where(inside, newton, bracket.prod(-1).sqrt()), beta
        if w.settled(beta, previous, FIT_SETTLED):  # eager on the CPU only (FIT_SETTLED)
            break
    if not moments_at_beta:
        return beta, None
    return beta, _moments(w, moments, logits, powers, beta)[:, :, 1:]


def _bracket(logits: torch.Tensor, shifted_zeroed: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The bracket ``[B, H, 2]`` of beta: the range ``ends`` (``[lo, hi]``, or ``[B, H, 2]``),
    collapsed onto an end where the optimum lies at or beyond it (``L'(lo) >= 0``: the loss rises
    from the lower end, e.g. an anti-NW head; ``L'(hi) <= 0``), so that Newton steps never bisect
    towards it.
    ``logits``, ``shifted_zeroed``: keys-major ``[B, H, M, n]``."""
    p = torch.softmax(logits[:, :, None] * ends[..., None, None], -2)  # [B, H, 2, M, n]
    grad = (p * shifted_zeroed[:, :, None]).sum((-1, -2))  # n L' at both ends [B, H, 2]
    bracket = ends.expand(*grad.shape)
    bracket = torch.where(grad[..., :1] >= 0, bracket[..., :1], bracket)
    return torch.where(grad[..., 1:] <= 0, bracket[..., 1:], bracket)


def _moments(
    w: EagerWriter, out: torch.Tensor, logits: torch.Tensor, powers: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """Per row ``p_j . [G'_j, G'^2_j]`` into ``out[:, :, 1:]`` (``out [B, H, 3, n]``, its row 0 the
    ones), ``p = softmax(beta G')`` over the keys of the keys-major ``logits [B, H, M, n]``;
    ``powers [B, H, 2, M, n]``. Returns ``out``."""
    p = torch.softmax(logits * beta[..., None, None], -2)  # [B, H, M, n]
    w.vecdot(out[:, :, 1:], powers, p[:, :, None], dim=-2)
    return out


def _write_standard_error(
    w: EagerWriter, out: torch.Tensor, beta: torch.Tensor, moments: torch.Tensor, count: int, total: int
) -> None:
    """``SE(h) = sqrt(var_j(psi_j) / (n L''^2) (1 - n/N)) / (2 beta^1.5)`` into ``out [B, H]``."""
    psi, second = moments[:, :, 0], moments[:, :, 1]
    var_psi = psi.var(-1)  # sample variance over the n fit rows
    curvature = (second - psi.square()).mean(-1)  # L'' = mean_j Var_{p_j}(G)
    correction = (1.0 - count / total) / count
    var_beta = var_psi / curvature.square() * correction
    w.write(out, torch.div, var_beta.sqrt(), beta.pow(1.5).mul_(2.0))
