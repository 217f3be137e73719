"""The optimised statistics of one softmax: few dispatched operations, one compiled graph per shape.

Computes what :mod:`nw_adapter.core.specification` specifies (and is tested equal to it) in three passes over
stacked tensors, each with named columns derived from one table (:data:`PRODUCERS`, one
producer per name of :data:`~nw_adapter.core.specification.STAT_NAMES`). Every tensor is
**keys-major**: the M keys on a leading dimension, the query rows last, so that each op over the
keys (softmax, log-sum-exp, ranks, the per-row sums over keys) runs along the long contiguous
row dimension; over a last dimension of 4-16 keys the same CPU ops are several times slower
(measured 1.7-1.9x less CPU time for the whole statistics of the host-cost proxy's largest group,
``benchmarks/README.md``).

1. **Scores** (:class:`Scores`): the pairs ``P [B, H, M, 2, R]``, for each compared pair of key
   rankings the (attention, NW) scores ``(q.k_i, q.k_i - ||k_i||^2 / 2)`` of the N observed
   queries and the n0 norm-matched queries ``q' = ||q|| z / ||z||`` (one product of the stacked
   queries ``[q; q']`` with the keys; R = N + n0), then the q.k-spread null's NW scores
   ``q_r.k_i - ||k_pi(i)||^2 / 2`` (n0 rows). The spread null's attention scores and both scores
   of the permutation null ``(q_r.k_pi(i), q_r.k_i - ||k_i||^2 / 2)`` are those of the observed
   row r, permuted for the latter: their ranks are the observed ranks (permuted), not recomputed.
2. **Ranks** of every scored row at once (sign sums over the keys), the per-row 2 x 2 Gram
   matrix of each compared pair (the nulls' from the observed rows' ranks and Gram entries where
   they are the same), per row ``(rho_r, c_r) = (G_ab / sqrt(G_aa G_bb), 1)`` (``(0, 0)`` for a
   constant row, left out), summed over the batch rows of each CFG half and one product with a
   0/1 segment matrix: ``rho = sum rho_r / sum c_r`` per segment (observed, each null) and CFG half.
3. **Weights** of the observed rows, ``Z [B, H, M, 4, N]`` with rows (a, b, c_A, c_B): the
   weights and the centred weights ``c = w - 1/M`` (Pearson), with the log-weights (l_A, l_W)
   and ``l_AW = log(a + b)``. Four products over the keys (:data:`PRODUCT_GROUPS`) give per row
   every inner product the divergences need (KL = a.l_A - a.l_W, JS = (a.l_A + b.l_W - a.l_AW -
   b.l_AW) / 2 + log 2, n_eff = 1 / a.a), and one product with the row-mean matrix averages the
   per-row features ``[B, H, F, N]`` into the statistics (:class:`~.layout.RowMean`). The
   remaining statistics follow per (batch row, head) (:class:`~.layout.PerHead`); one
   ``addcmul`` applies the gains and offsets.
4. **Readings** (unless ``readings=False``): the readings of
   :data:`~nw_adapter.core.specification.READING_STATS` per (batch row, head) from the observed
   pairs, A and ``a.l_A`` (:mod:`.readings`: the variance shares, the key-prior KL, the
   bandwidth fit on ``fit_rows`` rows and its standard error), written into their columns before
   the per-half means (:class:`~.layout.Reading`), and h_eff's reason code (the stats tensor's
   last row; h_eff and h_eff_se NaN where it is not 0).

Eager, intermediate tensors are written with ``out=`` into per-thread workspaces; under
``torch.compile`` the same code runs as plain operations (:mod:`.workspace`, chosen once per
call). The weights A and W are returned as views of a tensor allocated by each call, never of
a workspace. No random numbers and no host reads.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from nw_adapter.core import metrics
from nw_adapter.core.specification import STAT_NAMES, STAT_ROWS
from nw_adapter.integration.stats.layout import (
    Bandwidth,
    Columns,
    PerHead,
    Producer,
    RankPool,
    Reading,
    RowMean,
)
from nw_adapter.integration.stats.nulls import NullDraws
from nw_adapter.integration.stats.readings import fit_count, write_readings
from nw_adapter.integration.stats.workspace import EagerWriter, f32, writer

MASKED_LOGIT = -1e20
"""Finite logit of a padding key: weight exactly 0, log-weight differences stay finite."""

# --- named columns of the intermediate tensors -------------------------------------------------

#: The two scores of a pair row of P (pass 1): attention ``q.k`` and NW ``q.k - ||k||^2 / 2``.
PAIR = Columns(("attn", "nw"))
#: The null pair rows' blocks, after the N observed and n0 norm-matched rows (pass 1): n0 rows each.
NULL_PAIR_ROWS = ("rho_spread_null", "rho_perm_null")
#: The powers of the key norms (pass 1): ``||k||`` and ``||k||^2``.
KEY = Columns(("norm", "sq_norm"))
#: The per-row rank Gram matrix (pass 2) and the product of its diagonal.
GRAM = Columns(("aa", "ab", "bb", "aa*bb"))
#: The rows of Z (pass 3): weights, centred weights; A and W are returned as views of it.
Z = Columns(("a", "b", "cA", "cB"))
#: The rows of the log-weights (pass 3): the log-softmax's own output, not copied into Z.
LOG = Columns(("lA", "lW"))
#: The per-row inner products over the keys (pass 3), one product per group ``(left, right,
#: outer)`` of rows of Z, of the log-weights or ``lAW = log(a + b)``: with ``outer`` every left row
#: times every right row (``b.lA`` is not read), else the left and right rows taken pairwise (the
#: squares ``a.a, b.b, cA.cA, cB.cB``, then ``cA.cB``): 12 products, where an outer product of the
#: weights with themselves and all log-weights computed 14.
PRODUCT_GROUPS = (
    (("a", "b", "cA", "cB"), ("a", "b", "cA", "cB"), False),
    (("a", "b"), ("lA", "lW"), True),
    (("a", "b"), ("lAW",), True),
    (("cA",), ("cB",), False),
)
#: The feature names of each group's products, left-major.
GROUP_NAMES = tuple(
    tuple(f"{x}.{y}" for x in left for y in right)
    if outer
    else tuple(f"{x}.{y}" for x, y in zip(left, right, strict=True))
    for left, right, outer in PRODUCT_GROUPS
)
PRODUCTS = tuple(name for names in GROUP_NAMES for name in names)
#: Per-row features, stored feature-major ``[B, H, F, N]`` (pass 3).
ROW = Columns((*PRODUCTS, "1/a.a", "1/b.b", "top1", "q_norm", "qk_std", "qk_var"))
#: The stats tensor's row after the statistics: h_eff's reason code (0: identified; 1 + the index
#: in :data:`~nw_adapter.core.specification.H_EFF_REASONS`), written by the readings pass.
CODE = STAT_ROWS[len(STAT_NAMES)]


class KeyNorms(NamedTuple):
    """Key statistics of pass 1: ``||k||^2 [B, H, M]`` and std / mean ``[2, B, H]`` over the valid
    keys of ``(||k||, ||k||^2)`` (rows :data:`KEY`)."""

    sq: torch.Tensor
    std: torch.Tensor
    mean: torch.Tensor


# --- the producer of every statistic ------------------------------------------------------------


def _pearson(w: EagerWriter, out: torch.Tensor, head: torch.Tensor, keys: KeyNorms) -> None:
    """Pearson of A and W over all rows and valid keys: ``cov / sqrt(var_A var_W)`` (row means)."""
    moments = head[..., HEAD["var_a"]] * head[..., HEAD["var_b"]]
    w.write(out, torch.mul, head[..., HEAD["cov_ab"]], torch.rsqrt(moments))


def _key_norm_cv(w: EagerWriter, out: torch.Tensor, head: torch.Tensor, keys: KeyNorms) -> None:
    """``std_i ||k_i|| / mean_i ||k_i||``."""
    w.write(out, torch.div, keys.std[KEY["norm"]], keys.mean[KEY["norm"]])


def _qk_spread_ratio(w: EagerWriter, out: torch.Tensor, head: torch.Tensor, keys: KeyNorms) -> None:
    """``mean std_i(q.k_i) / std_i(||k_i||^2)``; its gain 2 makes the denominator ``std(||k||^2 / 2)``."""
    w.write(out, torch.div, head[..., HEAD["mean_qk_std"]], keys.std[KEY["sq_norm"]])


def _logit_scale(w: EagerWriter, out: torch.Tensor, head: torch.Tensor, keys: KeyNorms) -> None:
    """``sqrt(mean_j var_i(q.k_i))``, times s (its gain): the RMS of the row-centred logits (the row
    variances of ``q.k`` over the valid keys are the squared row features ``qk_std``)."""
    w.write(out, torch.sqrt, head[..., HEAD["mean_qk_var"]])


def _key_rms(w: EagerWriter, out: torch.Tensor, head: torch.Tensor, keys: KeyNorms) -> None:
    """``sqrt(mean_i ||k_i||^2)`` over the valid keys (pass 1's mean of the squared norms)."""
    w.write(out, torch.sqrt, keys.mean[KEY["sq_norm"]])


#: One producer per statistic, in STAT_NAMES order (:mod:`.layout`). Adding a statistic: its
#: function in the specification (:mod:`nw_adapter.core.specification`) and one entry here.
PRODUCERS: dict[str, Producer] = {
    "bandwidth": Bandwidth(),
    "rho": RankPool("rho"),
    "rho_perm_null": RankPool("rho_perm_null"),
    "rho_norm_matched_null": RankPool("rho_norm_matched_null"),
    "rho_spread_null": RankPool("rho_spread_null"),
    "pearson": PerHead(_pearson),
    "kl": RowMean({"a.lA": 1.0, "a.lW": -1.0}),
    "js": RowMean({"a.lA": 0.5, "b.lW": 0.5, "a.lAW": -0.5, "b.lAW": -0.5}, offset=math.log(2.0)),
    "neff_attn": RowMean({"1/a.a": 1.0}),
    "neff_nw": RowMean({"1/b.b": 1.0}),
    "top1": RowMean({"top1": 1.0}),
    "q_norm": RowMean({"q_norm": 1.0}),
    "key_norm_cv": PerHead(_key_norm_cv),
    "qk_spread_ratio": PerHead(_qk_spread_ratio, gain=2.0),
    "logit_scale": PerHead(_logit_scale, scaled=True),
    "key_rms": PerHead(_key_rms),
    "r2_key": Reading(),
    "r2_nw": Reading(),
    "kl_nw_fit": Reading(),
    "kl_key_prior": Reading(),
    "nw_gain": Reading(),
    "h_eff": Reading(),
    "h_eff_se": Reading(),
    "fit_rows": Reading(constant=True),
}

#: Row means the per-head producers read (after the statistics in the per-head tensor).
HELPERS: dict[str, RowMean] = {
    "mean_qk_std": RowMean({"qk_std": 1.0}),
    "mean_qk_var": RowMean({"qk_var": 1.0}),
    "cov_ab": RowMean({"cA.cB": 1.0}),
    "var_a": RowMean({"cA.cA": 1.0}),
    "var_b": RowMean({"cB.cB": 1.0}),
}

#: Per-(batch row, head) values ``[B, H, C]``: the statistics, h_eff's reason code, then the helpers.
HEAD = Columns((*STAT_ROWS, *HELPERS))
#: The columns the readings pass writes (the constant fit_rows is the column's offset).
READINGS = tuple(n for n, p in PRODUCERS.items() if isinstance(p, Reading) and not p.constant)
_ROW_MEANS = {name: p for name, p in {**PRODUCERS, **HELPERS}.items() if isinstance(p, RowMean)}
#: The columns one matrix product writes: from the first row mean to the last (others get 0).
ROW_MEAN_SPAN = slice(min(HEAD[n] for n in _ROW_MEANS), max(HEAD[n] for n in _ROW_MEANS) + 1)
#: Rank segments in column order: rho's columns are consecutive, each filled by its segment.
SEGMENTS = tuple(p.segment for p in PRODUCERS.values() if isinstance(p, RankPool))


def _check_table() -> None:
    """Every statistic has exactly one producer and every producer names known columns."""
    assert tuple(PRODUCERS) == STAT_NAMES, "fast.PRODUCERS must list STAT_NAMES, in order"
    assert not set(HELPERS) & set(STAT_ROWS), "a helper column shadows a statistic"
    assert STAT_ROWS == (*STAT_NAMES, CODE)
    for name, producer in _ROW_MEANS.items():
        unknown = set(producer.terms) - set(ROW.names)
        assert not unknown, f"{name}: unknown per-row features {unknown}"
    rank_columns = [HEAD[name] for name, p in PRODUCERS.items() if isinstance(p, RankPool)]
    assert rank_columns == list(range(rank_columns[0], rank_columns[0] + len(rank_columns)))
    assert SEGMENTS[0] == "rho" and set(SEGMENTS) == {"rho", "rho_norm_matched_null", *NULL_PAIR_ROWS}
    assert sum(isinstance(p, Bandwidth) for p in PRODUCERS.values()) == 1


_check_table()


# --- the computation ----------------------------------------------------------------------------


def layer_statistics(
    q: torch.Tensor,
    k: torch.Tensor,
    h: torch.Tensor | float,
    scale: float,
    valid: torch.Tensor | None = None,
    draws: NullDraws | None = None,
    halves: int = 1,
    readings: bool = True,
    fit_rows: int | None = 256,
    key_norm_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All statistics of one softmax of the image branch (see the module docstring).

    Args:
        q: queries ``[B, H, N, d]`` (any float dtype; computed in float32).
        k: image keys ``[B, H, M, d]``.
        h: NW bandwidth, a float or a ``[B, H]`` (or 0-d) tensor.
        scale: the softmax scale s, a float or a ``[B, H]`` tensor (a swapped head at a per-head h).
        valid: optional bool ``[B, M]`` mask of the keys that take part (padding keys: False).
        draws: the nulls' random numbers (:func:`~.nulls.draw_nulls`); None = nulls recorded as NaN.
        halves: 2 when the batch is [uncond; cond]: rho and its nulls are pooled over the query
            rows of each half's batch rows (constant rows left out), the other statistics
            averaged over them.
        readings: compute the readings of :data:`~nw_adapter.integration.schema.READING_STATS`
            (:mod:`.readings`); False = NaN.
        fit_rows: the readings' bandwidth fit uses this many evenly spaced query rows (None = all).
        key_norm_weight: c of the attention's scores ``q.k_i - c ||k_i||^2 / 2`` (0: dot-product
            attention; 1: the exact NW head at ``h^2 = 1/s``, a swapped branch): a constant of the
            pairs' shift, so it costs no operation.

    Returns:
        ``(stats [S + 1, halves, H], weights [2, B, H, N, M])``: the statistics in STAT_NAMES
        order, then h_eff's reason code (:data:`~nw_adapter.core.specification.STAT_ROWS`), and
        A, W (views of a tensor of this call, not of a workspace: safe to keep).
    """
    w = writer()
    k = k.to(torch.float32, memory_format=torch.contiguous_format)
    n = q.shape[2]
    b, nh, m = k.shape[0], k.shape[1], k.shape[2]
    valid_keys = None if valid is None else valid.view(b, 1, m, 1, 1)  # keys-major mask [B, 1, M, 1, 1]
    keys = _key_norms(w, k, valid)
    feats = w.workspace("row features", (b, nh, len(ROW), n), q.device)
    scores = _scores(w, q, k, keys, feats, draws, valid, key_norm_weight)
    rho_sums = _pooled_rank_correlations(w, scores, None if valid is None else valid_keys[..., 0], halves, n)
    pairs = scores.pairs
    z, masked, inv_count = _weights_and_row_features(w, pairs[..., :n], scale, h, valid_keys, feats)
    head = _per_head(w, feats, keys, h, scale)
    if readings:
        columns = {name: head[..., HEAD[name]] for name in (*READINGS, CODE)}
        attn, neg_entropy = z[:, :, :, Z["a"]], feats[:, :, ROW["a.lA"]]
        write_readings(
            w, columns, pairs[..., :n], masked, attn, neg_entropy, valid_keys, inv_count, scale, fit_rows
        )
    fit = fit_count(n, fit_rows) if readings else None
    means = _half_means(head, halves)
    if readings and q.shape[0] != halves:  # a half's reason: the first among its batch rows
        means[..., HEAD[CODE]] = _first_reason(head[..., HEAD[CODE]], halves)
    stats = _statistics(
        w, means, rho_sums, h, 1.0 if isinstance(scale, torch.Tensor) else scale, draws is not None, fit
    )
    return stats, z[:, :, :, Z.slice("a", "b")].permute(3, 0, 1, 4, 2)


def _key_norms(w: EagerWriter, k: torch.Tensor, valid: torch.Tensor | None) -> KeyNorms:
    """``||k||^2`` and the spreads of ``||k||`` and ``||k||^2`` over the valid keys."""
    powers = w.constant(("key powers", k.device), lambda: f32([[[[1.0]]], [[[2.0]]]], k.device))
    norms = torch.pow(torch.linalg.vector_norm(k, dim=-1), powers)  # [2, B, H, M]
    if valid is None:  # two passes: torch.std_mean over a last dim of 4-16 keys costs ~8x as much
        mean = norms.mean(-1)
        std = torch.sub(norms, mean[..., None]).square_().mean(-1).sqrt_()
    else:
        weight = valid[:, None, :].to(torch.float32)
        mean = (norms * weight).sum(-1) / weight.sum(-1)
        std = metrics.masked_std(norms, valid[:, None, :])
    return KeyNorms(norms[KEY["sq_norm"]], std, mean)


class Scores(NamedTuple):
    """Pass 1's scores, keys-major (see :func:`_scores`).

    ``ranked [B, H, M, 2 R + n0]`` is everything pass 2 ranks in one call: the pairs ``[B, H, M, 2,
    R]`` (``R = N + n0``: the N observed rows and the n0 norm-matched rows; a view of its first 2 R
    columns), then the q.k-spread null's NW scores ``q_r.k_i - ||k_pi(i)||^2 / 2`` (n0 columns).
    ``shuffle``: the keys' permutation of each null row (:class:`KeyShuffle`); ``rows``: the nulls'
    query rows, None when they are the N observed rows in order (the key noise reordered to match)."""

    ranked: torch.Tensor
    pairs: torch.Tensor
    shuffle: KeyShuffle | None
    rows: torch.Tensor | None


class KeyShuffle(NamedTuple):
    """The permutation null's shuffle of the keys of every null row, ``x [B, H, M, n0] -> x_pi``
    along the keys, ``pi`` the argsort of the row's key noise
    (:func:`~nw_adapter.core.metrics.valid_permutation`).

    ``index [B, H, M, n0]`` int64: ``pi`` itself (``slots`` False: ``x_pi = gather(x, pi)``), or
    each key's place in its row's noise order, ``pi^-1`` (``slots`` True: ``x_pi`` is ``x``
    scattered to those places; :func:`_noise_places`)."""

    index: torch.Tensor
    slots: bool

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x_pi`` for ``x [B, H, M, n0]`` (a fresh tensor)."""
        if self.slots:
            return torch.empty(x.shape, dtype=x.dtype, device=x.device).scatter_(2, self.index, x)
        return torch.gather(x, 2, self.index)


def _noise_places(w: EagerWriter, noise: torch.Tensor) -> torch.Tensor:
    """Each key's place in its row's noise order, ``noise [B, H, M, n0]`` keys-major: ``#{j : x_j <
    x_i} + #{j < i : x_j = x_i}`` (ties by index: a stable argsort's inverse), int64. One comparison
    per shift of keys, every pair compared once (as :meth:`~.workspace.EagerWriter.ranks`), along
    the long contiguous rows: at the proxy's largest group ~2x less CPU time than the argsort of
    ``[B, H, n0, M]`` over its last dimension of 4 keys."""
    m = noise.shape[2]
    places = w.workspace("noise places", tuple(noise.shape), noise.device)
    # key i starts as the lower key of its m - 1 - i pairs with a later key: +1 each, undone below
    # for every pair whose later key does not come first
    count = w.constant(("places", m, noise.device), lambda: f32(range(m - 1, -1, -1), noise.device))
    places.copy_(count.view(1, 1, m, 1).expand(places.shape))
    later = w.workspace("noise order", (*noise.shape[:2], m - 1, noise.shape[3]), noise.device)
    for shift in range(1, m):  # the pairs (i, i + shift): does the later key come after (ties: yes)?
        low, high = noise.narrow(2, 0, m - shift), noise.narrow(2, shift, m - shift)
        after = torch.ge(high, low, out=later.narrow(2, 0, m - shift))
        places.narrow(2, shift, m - shift).add_(after)
        places.narrow(2, 0, m - shift).sub_(after)
    return places.long()


def _scores(
    w: EagerWriter,
    q: torch.Tensor,
    k: torch.Tensor,
    keys: KeyNorms,
    feats: torch.Tensor,
    draws: NullDraws | None,
    valid: torch.Tensor | None,
    key_norm_weight: float = 0.0,
) -> Scores:
    """Pass 1: the pairs of the observed and norm-matched rows and the spread null's NW scores
    (:class:`Scores`); writes ``||q||`` into the row features.

    The two other nulls need no scores of their own: the q.k-spread null's attention scores are
    the observed ``q_r.k``, whose ranks pass 2 already has, and the permutation null's pair
    ``(q_r.k_pi(i), G_ri)`` has the ranks of row r with the attention's permuted (the ranks of
    permuted values are the permuted ranks). When the nulls use every row (n0 = N, rows drawn in
    a random order), the permutation noise is reordered by the rows instead (null row j of the draws
    goes with observed row ``rows[j]``, as before), so that null row i is observed row i: nothing
    is selected from the pairs. The norm-matched rows keep the draws' order (``||q_rows[j]||``).
    Keys-major: every later op over the keys runs along the long contiguous rows. The attention's
    score is ``q.k_i - c ||k_i||^2 / 2`` (``c = key_norm_weight``): the same one ``addcmul`` whose
    shift constant holds ``(-c/2, -1/2)``."""
    b, nh, n, d = q.shape
    m = k.shape[-2]
    rows, noise, n0 = None, None, 0
    # on a CPU the keys are shuffled by their noise's places (:func:`_noise_places`): more ops
    places = draws is not None and valid is None and w.eager and w.on_cpu(q)
    if draws is not None:
        n0, noise, rows = draws.noise.shape[2], draws.noise, draws.rows
        if places:  # keys-major [B, H, M, n0], the rows reordered as below when n0 = N
            noise = noise.transpose(-1, -2)
            noise = noise.index_select(3, rows.argsort()) if n0 == n else noise.contiguous()
            rows = None if n0 == n else rows
        elif n0 == n and w.eager:  # null row j is observed row rows[j]: its key noise goes to rows[j]
            # (compiled, the selection of the rows fuses into the kernels that read them instead)
            flat = noise.flatten(0, 1).index_select(1, rows.argsort())  # [B H, n0, M]: 4x less CPU
            noise, rows = flat.view(noise.shape), None
    selected = 0 if rows is None else n0
    # the stacked queries [q; q'; q_r]: the observed rows, the norm-matched rows and, for a subset
    # of rows, the nulls' rows of q (selected as rows of d values, not as columns of the pairs)
    queries = w.workspace("queries", (b, nh, n + n0 + selected, d), q.device)
    queries[:, :, :n].copy_(q)
    q_norm = w.write(feats[:, :, ROW["q_norm"]], torch.linalg.vector_norm, queries[:, :, :n], dim=-1)
    if draws is not None:  # the norm-matched rows, in the draws' order (their own ranks only)
        ratio = q_norm.index_select(-1, draws.rows) / torch.linalg.vector_norm(draws.directions, dim=-1)
        w.write(queries[:, :, n : n + n0], torch.mul, draws.directions, ratio[..., None])
    if rows is not None:
        w.write(queries[:, :, n + n0 :], torch.index_select, queries[:, :, :n], 2, rows)
    logits = k @ queries.transpose(-1, -2)  # [B, H, M, N + n0 (+ n0)], keys-major and contiguous
    r = n + n0
    ranked = w.workspace("scores", (b, nh, m, len(PAIR) * r + n0), q.device)
    pairs = ranked[..., : len(PAIR) * r].view(b, nh, m, len(PAIR), r)
    c = float(key_norm_weight)
    shift = w.constant(("pair shift", c, q.device), lambda: f32([[-0.5 * c], [-0.5]], q.device))  # PAIR order
    w.write(pairs, torch.addcmul, logits[:, :, :, None, :r], shift, keys.sq[..., None, None])
    if noise is None:
        return Scores(ranked, pairs, None, None)
    if places:
        shuffle = KeyShuffle(_noise_places(w, noise), slots=True)
    else:
        valid_rows = None if valid is None else valid[:, None, None, :]  # [B, 1, 1, M]
        perm = metrics.valid_permutation(noise, valid_rows).transpose(-1, -2)  # [B, H, M, n0]
        shuffle = KeyShuffle(perm, slots=False)
    spread_qk = logits[..., :n] if rows is None else logits[..., r:]  # q_r.k
    shuffled_sq = shuffle.apply(keys.sq[..., None].expand(b, nh, m, n0))
    w.write(ranked[..., len(PAIR) * r :], torch.sub, spread_qk, shuffled_sq, alpha=0.5)
    return Scores(ranked, pairs, shuffle, rows)


def _pooled_rank_correlations(
    w: EagerWriter, scores: Scores, valid_keys: torch.Tensor | None, halves: int, n: int
) -> torch.Tensor:
    """Pass 2: ``[H, halves * segments, 2]`` = (sum of per-row Spearman, non-constant rows) of the
    observed rows and each null (the rank comparisons and the per-row products over the keys run
    along the long contiguous rows).

    One rank call over :attr:`Scores.ranked`; the per-row 2 x 2 Gram of ranks ``(G_aa, G_ab,
    G_bb)``: three products for the observed and norm-matched rows; for the q.k-spread null
    (attention ranks: the observed row's) its ``G_aa`` is the row's, ``G_ab`` and ``G_bb`` two
    products; for the permutation null ``G_aa`` and ``G_bb`` are the row's (a permutation keeps a
    sum of squares), ``G_ab`` one product of the permuted attention ranks with the NW ranks."""
    b, nh, m, _ = scores.ranked.shape
    r, n0 = scores.pairs.shape[-1], scores.ranked.shape[-1] - len(PAIR) * scores.pairs.shape[-1]
    rows = n + 3 * n0
    device = scores.ranked.device
    out = w.workspace("ranks", tuple(scores.ranked.shape), device)
    ranked = w.ranks(scores.ranked, valid_keys, out, dim=2)
    ranks = ranked[..., : len(PAIR) * r].view(b, nh, m, len(PAIR), r)
    gram = w.workspace("rank gram", (b, nh, len(GRAM), rows), device)
    # the observed and norm-matched rows: (a.a, a.b) in one product, b.b in another
    w.vecdot(gram[:, :, GRAM.slice("aa", "ab"), :r], ranks, ranks[:, :, :, :1], dim=2)
    w.vecdot(gram[:, :, GRAM["bb"], :r], ranks[:, :, :, 1], ranks[:, :, :, 1], dim=2)
    if n0:
        observed, row_gram = ranks[..., :n], gram[..., :n]  # the nulls' rows: [B, H, M, 2, n0], [B, H, 4, n0]
        if scores.rows is not None:
            observed, row_gram = (x.index_select(-1, scores.rows) for x in (observed, row_gram))
        attn, nw = observed[:, :, :, PAIR["attn"]], observed[:, :, :, PAIR["nw"]]
        spread_nw = ranked[..., len(PAIR) * r :]  # [B, H, M, n0]
        spread, perm_block = slice(r, r + n0), slice(r + n0, r + 2 * n0)
        nulls_aa = gram[:, :, GRAM["aa"], r:].view(b, nh, 2, n0)  # both null blocks: the row's G_aa
        nulls_aa.copy_(row_gram[:, :, GRAM["aa"], None])
        w.vecdot(gram[:, :, GRAM["ab"], spread], attn, spread_nw, dim=2)
        w.vecdot(gram[:, :, GRAM["bb"], spread], spread_nw, spread_nw, dim=2)
        permuted = scores.shuffle.apply(attn)
        w.vecdot(gram[:, :, GRAM["ab"], perm_block], permuted, nw, dim=2)
        gram[:, :, GRAM["bb"], perm_block].copy_(row_gram[:, :, GRAM["bb"]])
    aa, bb = gram[:, :, GRAM["aa"]], gram[:, :, GRAM["bb"]]
    w.write(gram[:, :, GRAM["aa*bb"]], torch.mul, aa, bb)  # 0: a constant row
    num_den = gram[:, :, GRAM.slice("ab", "aa*bb")]  # per row: (G_ab, G_aa G_bb) [B, H, 2, R]
    # (rho_r, c_r) = (G_ab, G_aa G_bb) / (sqrt(D), D), D = max(G_aa G_bb, 1/2): (0, 0) for a constant
    # row (sign sums are integers, so a non-constant row has G_aa G_bb >= 1)
    denominator = w.workspace("rho denominators", (b, nh, 2, rows), device)
    clamped = w.write(denominator[:, :, 1], torch.clamp_min, num_den[:, :, 1], 0.5)
    w.write(denominator[:, :, 0], torch.sqrt, clamped)
    per_row = w.workspace("rho rows", (nh, b, 2, rows), device)  # head-major: one pooling product
    w.write(per_row.transpose(0, 1), torch.div, num_den, denominator)
    within = per_row.view(nh, halves, b // halves, 2, rows).sum(2)  # [H, halves, 2, R]: the half's rows
    key = ("segments", n, n0, device)
    segments = w.constant(key, lambda: _segment_matrix(n, n0, device))  # [segments, R]
    return (within @ segments.T).transpose(-1, -2).reshape(nh, -1, 2)


def _weights_and_row_features(
    w: EagerWriter,
    observed: torch.Tensor,
    scale: float,
    h: torch.Tensor | float,
    valid_keys: torch.Tensor | None,
    feats: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | float]:
    """Pass 3: Z of the observed pairs ``[B, H, M, 2, N]`` (keys-major) and the per-row features;
    returns Z ``[B, H, M, 4, N]`` (a fresh tensor: A and W are views of it), the observed pairs
    with a large negative logit at padding keys, and 1 / the number of valid keys."""
    b, nh, m, _, n = observed.shape
    qk = observed[:, :, :, PAIR["attn"]]  # [B, H, M, N]
    if valid_keys is not None:
        observed = observed.masked_fill(~valid_keys, MASKED_LOGIT)
    z = torch.empty((b, nh, m, len(Z), n), dtype=torch.float32, device=observed.device)  # fresh: returned
    coefficients = _logit_coefficients(w, scale, h, observed)  # s, 1/h^2
    # the log-weights [B, H, M, 2, N] (LOG): one log-softmax over the keys (a CPU log-sum-exp over
    # a non-last dimension and a subtraction cost ~2x as much), kept as it comes (a copy into a
    # slice of Z cost ~1-2 ms on the proxy's largest group)
    log_w = torch.log_softmax(torch.mul(observed, coefficients), 2)
    weights = w.write(z[:, :, :, Z.slice("a", "b")], torch.exp, log_w)
    l_aw = torch.logaddexp(log_w[:, :, :, LOG["lA"]], log_w[:, :, :, LOG["lW"]])  # [B, H, M, N]
    centred = z[:, :, :, Z.slice("cA", "cB")]
    if valid_keys is None:
        inv_count: torch.Tensor | float = 1.0 / m
        w.write(centred, torch.sub, weights, inv_count)
    else:
        weight = valid_keys.to(torch.float32)
        inv_count = weight.sum(2, keepdim=True).reciprocal()  # [B, 1, 1, 1, 1]: 1/M'
        w.write(centred, torch.sub, weights, inv_count).mul_(weight)
    top = _first_peak(w, observed)  # [B, H, 2, N]
    w.write(feats[:, :, ROW["top1"]], torch.eq, top[:, :, PAIR["attn"]], top[:, :, PAIR["nw"]])

    def rows(names: tuple[str, ...]) -> torch.Tensor:  # [B, H, M, P, N]: the named rows, a view
        if names == ("lAW",):
            return l_aw[:, :, :, None]
        return log_w[:, :, :, LOG.slice(*names)] if names[0] in LOG else z[:, :, :, Z.slice(*names)]

    for (left, right, outer), names in zip(PRODUCT_GROUPS, GROUP_NAMES, strict=True):  # sums over the keys
        x, y = rows(left), rows(right)  # [B, H, M, P, N], [B, H, M, Q, N]
        out = feats[:, :, ROW.slice(*names)]  # [B, H, P Q, N] (outer) or [B, H, P, N]
        if outer:
            x, y, out = x[:, :, :, :, None], y[:, :, :, None], out.unflatten(2, (len(left), len(right)))
        w.vecdot(out, x, y, dim=2)
    w.write(feats[:, :, ROW.slice("1/a.a", "1/b.b")], torch.reciprocal, feats[:, :, ROW.slice("a.a", "b.b")])
    if valid_keys is None:  # the mean square of the centred row (torch.std over 4-16 keys is slower)
        centred_qk = torch.sub(qk, qk.mean(2, keepdim=True)).square_()
        w.write(feats[:, :, ROW["qk_var"]], torch.mean, centred_qk, 2)
        w.write(feats[:, :, ROW["qk_std"]], torch.sqrt, feats[:, :, ROW["qk_var"]])
    else:
        rows_valid = valid_keys.view(b, 1, 1, m)
        feats[:, :, ROW["qk_std"]].copy_(metrics.masked_std(qk.transpose(-1, -2), rows_valid))
        w.write(feats[:, :, ROW["qk_var"]], torch.square, feats[:, :, ROW["qk_std"]])
    return z, observed, inv_count


def _first_peak(w: EagerWriter, scores: torch.Tensor) -> torch.Tensor:
    """``M - argmax`` over the keys (dim 2) of ``scores [B, H, M, ...]``: M minus the index of the first
    key at the maximum, from two ``amax`` reductions (an ``argmax`` over a non-last dimension is
    several times slower on a CPU): ``max_i (M - i) [x_i = max x]``; 0 where the keys hold a NaN
    (no maximum)."""
    m = scores.shape[2]
    countdown = w.constant(
        ("countdown", m, scores.dim(), scores.device),
        lambda: f32(range(m, 0, -1), scores.device).view(1, 1, m, *[1] * (scores.dim() - 3)),
    )
    at_peak = torch.eq(scores, scores.amax(2, keepdim=True))
    return torch.mul(at_peak, countdown).amax(2)  # 1/3 of the CPU time of where(at_peak, countdown, 0)


def _per_head(
    w: EagerWriter,
    feats: torch.Tensor,
    keys: KeyNorms,
    h: torch.Tensor | float,
    scale: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """Per-(batch row, head) values ``[B, H, C]`` (:data:`HEAD`; the readings' columns written later).
    A ``[B, H]`` tensor ``scale`` multiplies the scaled producers' columns here (a float one is
    their gain in :func:`_affine`)."""
    b, nh, _, n = feats.shape
    tensor_h = isinstance(h, torch.Tensor)
    # never written: the columns of rho (gain 0) and of a float h (gain 0, offset h); a float h has
    # its own workspace so that a tensor h (even NaN) of an earlier call cannot leak into it
    buffer = "head statistics, tensor h" if tensor_h else "head statistics"
    head = w.workspace(buffer, (b, nh, len(HEAD)), feats.device, zero=True)
    matrix = w.constant(("row means", n, feats.device), lambda: _row_mean_matrix(n, feats.device))
    w.products(head.view(b * nh, 1, -1)[..., ROW_MEAN_SPAN], feats.view(b * nh, 1, -1), matrix)
    for name, producer in PRODUCERS.items():
        if isinstance(producer, PerHead):
            producer.write(w, head[..., HEAD[name]], head, keys)
            if producer.scaled and isinstance(scale, torch.Tensor):
                head[..., HEAD[name]].mul_(scale.to(head.dtype).expand(b, nh))
    if tensor_h:
        head[..., HEAD["bandwidth"]].copy_(h.expand(b, nh))
    return head


def _half_means(head: torch.Tensor, halves: int) -> torch.Tensor:
    """``[B, H, C]`` averaged over the batch rows of each CFG half: ``[halves, H, C]``."""
    b, nh = head.shape[:2]
    if b == halves:
        return head.view(halves, nh, -1)
    return head.view(halves, b // halves, nh, -1).mean(1)


def _first_reason(codes: torch.Tensor, halves: int) -> torch.Tensor:
    """``[B, H]`` reason codes -> ``[halves, H]``: the smallest non-zero code of each half's batch rows."""
    b, nh = codes.shape
    grouped = codes.reshape(halves, b // halves, nh)
    first = torch.where(grouped > 0, grouped, math.inf).amin(1)
    return torch.where(torch.isinf(first), 0.0, first)


def _statistics(
    w: EagerWriter,
    head: torch.Tensor,
    rho_sums: torch.Tensor,
    h: torch.Tensor | float,
    scale: float,
    nulls: bool,
    fit: int | None,
) -> torch.Tensor:
    """``[S + 1, halves, H]``: gains and offsets applied to the per-head values, rho and its nulls
    written (``fit``: the readings' fit rows, None = readings off)."""
    halves, nh = head.shape[:2]
    h_offset = None if isinstance(h, torch.Tensor) else float(h)
    key = ("affine", h_offset, scale, nulls, fit, head.device)
    gain_offset = w.constant(key, lambda: _affine(h_offset, scale, nulls, fit, head.device))
    out = torch.addcmul(gain_offset[1], head, gain_offset[0])  # [halves, H, C]
    segments = len(SEGMENTS) if nulls else 1
    sums = rho_sums.view(nh, halves, segments, 2).transpose(0, 1)
    w.write(out[..., HEAD.slice(*SEGMENTS[:segments])], torch.div, sums[..., 0], sums[..., 1])
    return out[..., : len(STAT_ROWS)].permute(2, 0, 1)


# --- constants derived from the table -----------------------------------------------------------


def _segment_of_rows(n: int, n0: int) -> list[str]:
    """The rank segment of each pair row (pass 1's order: observed, norm-matched, the null blocks)."""
    nulls = [name for name in NULL_PAIR_ROWS for _ in range(n0)]
    return ["rho"] * n + ["rho_norm_matched_null"] * n0 + nulls


def _segment_matrix(n: int, n0: int, device: torch.device) -> torch.Tensor:
    """``[segments, R]`` 0/1: pair row r -> its rank segment (pass 1's order)."""
    segments = SEGMENTS if n0 else SEGMENTS[:1]
    segment = torch.tensor([segments.index(s) for s in _segment_of_rows(n, n0)], device=device)
    return (torch.arange(len(segments), device=device)[:, None] == segment[None, :]).float()


def _row_mean_matrix(n: int, device: torch.device) -> torch.Tensor:
    """``[C', F * N]``: the row features ``[F, N]`` (flattened) -> the row-mean columns of HEAD."""
    columns = HEAD.names[ROW_MEAN_SPAN]
    matrix = torch.zeros(len(columns), len(ROW), dtype=torch.float32)
    for c, name in enumerate(columns):
        for feature, coefficient in getattr(_ROW_MEANS.get(name), "terms", {}).items():
            matrix[c, ROW[feature]] = coefficient / n
    return matrix.repeat_interleave(n, dim=1).to(device)


def _affine(
    h: float | None, scale: float, nulls: bool, fit: int | None, device: torch.device
) -> torch.Tensor:
    """``[2, C]`` (gain, offset) of every HEAD column, from the producers."""
    gain, offset = [0.0] * len(HEAD), [0.0] * len(HEAD)
    for name, producer in PRODUCERS.items():
        i = HEAD[name]
        if isinstance(producer, Reading):  # off: NaN; the fit rows: a constant of the call
            if fit is None:
                gain[i], offset[i] = 0.0, math.nan
            else:
                gain[i], offset[i] = (0.0, float(fit)) if producer.constant else (1.0, 0.0)
        elif isinstance(producer, RowMean | PerHead):
            gain[i], offset[i] = getattr(producer, "gain", 1.0), producer.offset
            gain[i] *= scale if getattr(producer, "scaled", False) else 1.0
        elif isinstance(producer, Bandwidth):
            gain[i], offset[i] = (1.0, 0.0) if h is None else (0.0, h)
        elif not nulls and producer.segment != "rho":
            offset[i] = math.nan  # RankPool: written afterwards; a null without draws stays NaN
    gain[HEAD[CODE]] = 0.0 if fit is None else 1.0  # h_eff's reason code: 0 with the readings off
    return f32([gain, offset], device)


def _logit_coefficients(
    w: EagerWriter, scale: float | torch.Tensor, h: torch.Tensor | float, like: torch.Tensor
) -> torch.Tensor:
    """Multipliers of the pairs into logits: s and 1/h^2, ``[2, 1]`` (``[B, H, 1, 2, 1]`` for a
    ``[B, H]`` h or s)."""
    if isinstance(scale, torch.Tensor):
        b, nh = like.shape[:2]
        s = scale.float().expand(b, nh)
        inv_h2 = (h.float() if isinstance(h, torch.Tensor) else torch.full_like(s, float(h))).reciprocal()
        inv_h2 = inv_h2.square().expand(b, nh)
        return torch.stack([s, inv_h2], -1).view(b, nh, 1, 2, 1)
    if isinstance(h, torch.Tensor):
        inv_h2 = h.float().reciprocal().square()  # [] or [B, H]
        coef = torch.stack([torch.full_like(inv_h2, scale), inv_h2], -1)
        return coef.view(2, 1) if inv_h2.dim() == 0 else coef.view(*inv_h2.shape, 1, 2, 1)
    key = ("coef", scale, float(h), like.device)
    return w.constant(key, lambda: f32([[scale], [float(h) ** -2]], like.device))
