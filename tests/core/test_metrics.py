"""Metrics against scipy on data with ties, nulls, and the unbiased MMD^2 estimator."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.spatial.distance as ssd
import scipy.stats as ss
import torch

from nw_adapter.core import kernels
from nw_adapter.core.kernels import nw_weights
from nw_adapter.core.metrics import (
    average_ranks,
    centered_ranks,
    js_from_logits,
    kl_from_logits,
    median_heuristic_sigma,
    mmd2_unbiased,
    norm_matched_null_rho,
    pearson_raveled,
    permutation_null_rho,
    qk_spread_null_rho,
    qk_spread_ratio,
    rowwise_spearman,
    spearman_rho,
    top1_agreement,
    valid_permutation,
)


def tied_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 4, (3, 7, 9), generator=g).double() / 4  # many ties
    b = torch.randint(0, 5, (3, 7, 9), generator=g).double() / 5
    a[0, 0] = 0.5  # constant row
    b[1, 3] = 0.2
    return a, b


def test_average_ranks_match_scipy_rankdata() -> None:
    a, _ = tied_data()
    ref = ss.rankdata(a.numpy(), axis=-1)
    np.testing.assert_allclose(average_ranks(a).numpy(), ref)


def test_rowwise_spearman_matches_scipy_with_ties_and_constant_rows() -> None:
    a, b = tied_data()
    got = rowwise_spearman(a, b).numpy()
    ref = np.full(got.shape, np.nan)
    for i in range(3):
        for j in range(7):
            if np.ptp(a[i, j].numpy()) > 0 and np.ptp(b[i, j].numpy()) > 0:
                ref[i, j] = ss.spearmanr(a[i, j].numpy(), b[i, j].numpy()).statistic
    assert np.isnan(got[0, 0]) and np.isnan(got[1, 3])
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(spearman_rho(a, b).numpy(), np.nanmean(ref, axis=-1), rtol=1e-12)
    # float32 input gives float32 output with the same values
    np.testing.assert_allclose(rowwise_spearman(a.float(), b.float()).numpy(), ref, rtol=1e-5, atol=1e-6)


def test_pearson_raveled_matches_scipy() -> None:
    a, b = tied_data(1)
    got = pearson_raveled(a, b).numpy()
    ref = [ss.pearsonr(a[i].ravel().numpy(), b[i].ravel().numpy()).statistic for i in range(3)]
    np.testing.assert_allclose(got, ref, rtol=1e-12)
    assert torch.isnan(pearson_raveled(torch.full((4, 3), 0.1), b[0, :4, :3]))


def test_kl_and_js_from_logits_match_scipy() -> None:
    g = torch.Generator().manual_seed(3)
    lp = torch.randn(5, 6, generator=g, dtype=torch.float64)
    lq = 3 * torch.randn(5, 6, generator=g, dtype=torch.float64)
    p, q = torch.softmax(lp, -1).numpy(), torch.softmax(lq, -1).numpy()
    kl_ref = [ss.entropy(p[i], q[i]) for i in range(5)]
    js_ref = [ssd.jensenshannon(p[i], q[i]) ** 2 for i in range(5)]
    np.testing.assert_allclose(kl_from_logits(lp, lq).numpy(), kl_ref, rtol=1e-10)
    np.testing.assert_allclose(js_from_logits(lp, lq).numpy(), js_ref, rtol=1e-8)


def test_kl_from_logits_is_finite_where_the_weights_underflow() -> None:
    """KL(p || q) from the two log-softmaxes: finite although q underflows to 0 in float32."""
    logit_q = torch.tensor([[0.0, -800.0, -1000.0]])
    logit_p = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    assert bool((torch.softmax(logit_q, -1)[0, 1:] == 0).all())
    lq = torch.log_softmax(logit_q.double(), -1)
    entropy = 0.5 * math.log(0.5) + 0.5 * math.log(0.25)
    expected = float(entropy - (torch.tensor([0.5, 0.25, 0.25]) * lq).sum())
    assert math.isclose(float(kl_from_logits(logit_p, logit_q)), expected, rel_tol=1e-6)
    # r = (p + q)/2 = [0.75, 0.125, 0.125]: JS = (KL(p||r) + KL(q||r)) / 2, q's zero entries add 0
    js = 0.5 * (0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.25 / 0.125)) + 0.5 * math.log(1 / 0.75)
    assert math.isclose(float(js_from_logits(logit_p, logit_q)), js, rel_tol=1e-6)


def test_divergences_leave_masked_keys_out() -> None:
    g = torch.Generator().manual_seed(12)
    lp, lq = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    pad = torch.randn(4, 5, generator=g) * 100
    valid = torch.tensor([True] * 3 + [False] * 5)
    for fn in (kl_from_logits, js_from_logits):
        got = fn(torch.cat([lp, pad], -1), torch.cat([lq, -pad], -1), valid)
        torch.testing.assert_close(got, fn(lp, lq))


def test_top1_agreement() -> None:
    a = torch.tensor([[0.1, 0.9], [0.6, 0.4], [0.5, 0.5]])
    b = torch.tensor([[0.2, 0.8], [0.3, 0.7], [0.5, 0.5]])
    torch.testing.assert_close(top1_agreement(a, b), torch.tensor([1.0, 0.0, 1.0]))


def test_permutation_null_is_centred_and_reproducible() -> None:
    g = torch.Generator().manual_seed(4)
    a = torch.softmax(torch.randn(400, 16, generator=g), -1)
    b = a.clone()  # identical: rho = 1 before shuffling
    assert torch.allclose(spearman_rho(a, b), torch.tensor(1.0))
    rows = 400
    r1 = permutation_null_rho(a[None], b[None], generator=torch.Generator().manual_seed(0))
    r2 = permutation_null_rho(a[None], b[None], generator=torch.Generator().manual_seed(0))
    assert torch.equal(r1, r2)
    # per-row Spearman under a random permutation has mean 0 and variance 1/(m-1)
    se = math.sqrt(1 / (16 - 1) / rows)
    assert abs(float(r1)) < 5 * se


def test_norm_matched_null_grows_with_query_norm() -> None:
    # THEORY 4: per-row Spearman of random q, k rises with ||q||; the null must reproduce that.
    g = torch.Generator().manual_seed(5)
    d, m = 40, 16
    key = torch.randn(1, m, d, generator=g)
    q_small = torch.randn(1, 256, d, generator=g) / math.sqrt(d) * 1.6
    q_big = q_small * (51 / 1.6)

    def null(q: torch.Tensor) -> torch.Tensor:
        return norm_matched_null_rho(q, key, generator=torch.Generator().manual_seed(1))

    small, big = float(null(q_small)), float(null(q_big))
    assert small < 0.5 < 0.9 < big
    # only the query norms enter: permuting the coordinates of every query changes nothing
    assert torch.equal(null(q_small.flip(-1)), null(q_small))


def _with_padding(q: torch.Tensor, k: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys followed by ``pad`` padding keys (large, so they would dominate any ranking)."""
    return q, torch.cat([k, 10 * torch.ones(*k.shape[:-2], pad, k.shape[-1])], -2)


def test_masked_keys_are_left_out_of_every_rank_statistic() -> None:
    """4 valid keys + 8 masked ones give exactly the statistics of the 4 keys alone."""
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(3, 200, 8, generator=g), torch.randn(3, 4, 8, generator=g)
    qp, kp = _with_padding(q, k, 8)
    valid = torch.tensor([True] * 4 + [False] * 8)
    for null in (norm_matched_null_rho, qk_spread_null_rho):
        alone = null(q, k, generator=torch.Generator().manual_seed(0))
        # the same random stream: the directions do not depend on M; the key noise has more columns
        padded = null(qp, kp, valid, generator=torch.Generator().manual_seed(0))
        assert torch.isfinite(padded).all()
        if null is norm_matched_null_rho:
            torch.testing.assert_close(padded, alone)
    # scores of independent a, b (rho ~ 0) on 4 keys; padding equal in both would tie and agree
    a, b = torch.randn(3, 200, 4, generator=g), torch.randn(3, 200, 4, generator=g)
    pad = torch.full((3, 200, 8), -1e4)
    ap, bp = torch.cat([a, pad], -1), torch.cat([b, pad], -1)
    torch.testing.assert_close(spearman_rho(ap, bp, valid), spearman_rho(a, b))
    assert float(spearman_rho(a, b).abs().max()) < 0.15 < 0.5 < float(spearman_rho(ap, bp).min())
    torch.testing.assert_close(top1_agreement(ap, bp, valid), top1_agreement(a, b))
    alone = permutation_null_rho(a, b, generator=torch.Generator().manual_seed(1))
    assert float(permutation_null_rho(ap, bp, valid, generator=g).abs().max()) < 0.15
    assert float(alone.abs().max()) < 0.15


def test_permutation_null_on_masked_keys_equals_the_null_of_the_valid_keys_alone() -> None:
    """The shuffle stays among the valid keys: same noise, same null as the 4 keys alone."""
    g = torch.Generator().manual_seed(13)
    b = torch.randn(2, 50, 4, generator=g)
    noise = torch.rand(2, 50, 4, generator=g)
    valid = torch.tensor([False, True, True, False, False, True, False, True, False, False, False, False])
    spread = torch.zeros(2, 50, 12)
    spread[..., valid] = noise
    perm = valid_permutation(spread, valid)
    pos = valid.nonzero().squeeze(-1)
    assert bool((valid[perm] == valid).all())  # valid slots receive valid keys
    expand = torch.full((2, 50, 12), 0.0)
    expand[..., valid] = b
    shuffled = torch.gather(expand, -1, perm)[..., pos]
    torch.testing.assert_close(shuffled, torch.gather(b, -1, noise.argsort(-1)))


def test_spread_null_keeps_the_qk_spread_and_breaks_the_pairing() -> None:
    """Random queries inside the span of the keys clear the norm-matched null, not the spread null."""
    g = torch.Generator().manual_seed(14)
    d, m, n = 40, 4, 2000
    k = torch.randn(m, d, generator=g, dtype=torch.float64)
    for q_norm in (8.0, 32.0):
        q = torch.randn(n, m, generator=g, dtype=torch.float64) @ k
        q = q * (q_norm / q.norm(dim=-1, keepdim=True))
        qk = q @ k.T
        rho = float(spearman_rho(qk, qk - 0.5 * k.square().sum(-1)))
        matched = float(norm_matched_null_rho(q, k, generator=g))
        spread = float(qk_spread_null_rho(q, k, generator=g))
        assert rho > matched + 0.05  # the norm-matched null alone would call this evidence
        assert rho < spread + 0.02  # the spread null explains it
    ratio = qk_spread_ratio(q, k)
    half = 0.5 * k.square().sum(-1)
    ref = (qk.std(-1, unbiased=False).mean() / half.std(unbiased=False)).item()
    assert math.isclose(float(ratio), ref, rel_tol=1e-12)


def test_centered_ranks_are_scipy_ranks_with_ties_and_masks() -> None:
    a, _ = tied_data()
    valid = torch.rand(9, generator=torch.Generator().manual_seed(0)) > 0.3
    got = centered_ranks(a, valid).numpy()
    ref = np.zeros(a.shape)
    ranks = ss.rankdata(a[..., valid].numpy(), axis=-1)
    ref[..., valid.numpy()] = ranks - ranks.mean(-1, keepdims=True)
    np.testing.assert_allclose(got, ref, atol=1e-12)
    avg = average_ranks(a, valid).numpy()
    np.testing.assert_allclose(avg[..., valid.numpy()], ranks)
    assert np.isnan(avg[..., ~valid.numpy()]).all()


def test_rho_of_logits_does_not_depend_on_the_bandwidth() -> None:
    """Ranks of logits: rho identical for h from 1e-3 to 1e3 (float32 weights would tie at 0)."""
    g = torch.Generator().manual_seed(15)
    q, k = torch.randn(4, 300, 64, generator=g), torch.randn(4, 16, 64, generator=g)
    qk = q @ k.transpose(-1, -2)
    nw_logit = qk - 0.5 * k.square().sum(-1)[..., None, :]
    values = [spearman_rho(qk / 8, nw_logit / h**2) for h in (1e-3, 0.041, 0.3, 2.83, 1e3)]
    assert all(torch.equal(v, values[0]) for v in values)
    underflowed = spearman_rho(torch.softmax(qk / 8, -1), torch.softmax(nw_logit / 0.041**2, -1))
    assert float((values[0] - underflowed).min()) > 0.1  # what ranking probabilities did


def _mmd2_reference(x: np.ndarray, y: np.ndarray, sigma: float) -> float:
    def k(u, v):
        return np.exp(-ssd.cdist(u, v, "sqeuclidean") / (2 * sigma**2))

    n, m = len(x), len(y)
    kxx, kyy = k(x, x), k(y, y)
    return (
        (kxx.sum() - np.trace(kxx)) / (n * (n - 1))
        + (kyy.sum() - np.trace(kyy)) / (m * (m - 1))
        - 2 * k(x, y).mean()
    )


def test_mmd2_matches_explicit_formula_and_median_heuristic() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(30, 3, generator=g, dtype=torch.float64)
    y = torch.randn(41, 3, generator=g, dtype=torch.float64) + 0.5
    pooled = np.concatenate([x.numpy(), y.numpy()])
    sigma = float(np.median(ssd.pdist(pooled)))
    torch.testing.assert_close(median_heuristic_sigma(x, y), torch.tensor(sigma, dtype=torch.float64))
    ref = _mmd2_reference(x.numpy(), y.numpy(), sigma)
    assert math.isclose(float(mmd2_unbiased(x, y)), ref, rel_tol=1e-10)
    ref_fixed = _mmd2_reference(x.numpy(), y.numpy(), 0.7)
    assert math.isclose(float(mmd2_unbiased(x, y, sigma=0.7)), ref_fixed, rel_tol=1e-10)
    # batched over leading dims with a per-batch sigma tensor
    xb, yb = torch.stack([x, x + 1]), torch.stack([y, y])
    out = mmd2_unbiased(xb, yb, sigma=torch.tensor([0.7, 0.7], dtype=torch.float64))
    assert math.isclose(float(out[0]), ref_fixed, rel_tol=1e-10)


def test_mmd2_float32_far_from_origin_matches_float64() -> None:
    g = torch.Generator().manual_seed(10)
    x = (1e3 + torch.randn(200, 8, generator=g)).float()
    y = (1e3 + torch.randn(200, 8, generator=g) + 0.1).float()
    ref = float(mmd2_unbiased(x.double(), y.double()))  # same rounded inputs
    # centred distances: kernel errors ~ eps * 2 d spread^2 / sigma^2 ~ 1e-6 (uncentred: ~eps * 1e6 ~ 0.1)
    assert abs(float(mmd2_unbiased(x, y)) - ref) < 1e-5


def test_mmd2_is_centred_on_zero_for_one_distribution_and_positive_for_two() -> None:
    gen = torch.Generator().manual_seed(8)
    seeds, n, d = 200, 60, 2
    x = torch.randn(seeds, n, d, generator=gen)
    y = torch.randn(seeds, n, d, generator=gen)
    same = mmd2_unbiased(x, y, sigma=1.0).double()
    se = float(same.std()) / math.sqrt(seeds)
    assert abs(float(same.mean())) < 4 * se
    assert float(same.min()) < 0  # unbiased: can be negative
    shifted = mmd2_unbiased(x, y + 0.5, sigma=1.0).double()
    assert float(shifted.mean()) > float(same.mean()) + 10 * se
    median = mmd2_unbiased(x, y).double()  # median heuristic per seed
    assert abs(float(median.mean())) < 4 * float(median.std()) / math.sqrt(seeds)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: rowwise_spearman(torch.rand(3, 4), torch.rand(3, 5)), "same last dim"),
        (lambda: spearman_rho([0.1, 0.2], torch.rand(2)), "a must be a torch.Tensor"),
        (lambda: kl_from_logits(torch.rand(3), torch.rand(4)), "logit_p and logit_q"),
        (lambda: spearman_rho(torch.rand(3, 4), torch.rand(3, 4), torch.ones(4)), "bool"),
        (lambda: pearson_raveled(torch.rand(4), torch.rand(4)), "at least 2 dims"),
        (lambda: mmd2_unbiased(torch.rand(1, 2), torch.rand(5, 2)), "x needs at least 2 samples"),
        (lambda: mmd2_unbiased(torch.rand(4, 2), torch.rand(5, 3)), "same last dim"),
        (lambda: mmd2_unbiased(torch.rand(4, 2), torch.rand(5, 2), sigma=0.0), "sigma"),
        (lambda: norm_matched_null_rho(torch.rand(3, 4), torch.rand(2, 5)), "feat"),
        (lambda: qk_spread_null_rho(torch.rand(4), torch.rand(2, 4)), "query"),
    ],
)
def test_bad_input_raises_value_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_metrics_on_nw_weights_are_batched() -> None:
    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(2, 4, 10, 8, generator=g), torch.randn(2, 4, 5, 8, generator=g)
    a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1)
    b = nw_weights(q, k, 8**0.25)
    assert spearman_rho(a, b).shape == (2, 4)
    assert pearson_raveled(a, b).shape == (2, 4)
    assert kl_from_logits(a.log(), b.log()).shape == (2, 4, 10)
    assert permutation_null_rho(a, b).shape == (2, 4)


@pytest.mark.parametrize("t", [0.56, 0.85, 0.95, 0.99])
def test_attention_monotone_in_distance_has_rho_one_at_every_t(t: float) -> None:
    """Data space, OT path: an attention monotone in ||x - a_t s_i|| ranks like the NW weights."""
    g = torch.Generator().manual_seed(16)
    support = 5 * torch.randn(16, 2, generator=g)
    a, b = t, 1 - (1 - 0.01) * t
    x = a * support[torch.randint(0, 16, (500,), generator=g)] + b * torch.randn(500, 2, generator=g)
    d2 = torch.cdist(x, a * support).square()
    attention_logits = -torch.sqrt(d2)  # any decreasing function of the distance
    nw_logits = kernels.nw_logits(x / a, support, b / a, validate=False)
    assert float(spearman_rho(attention_logits, nw_logits)) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("m", [4, 12, 16])
def test_sorted_and_pairwise_ranks_agree_with_ties_and_masks(m: int, monkeypatch) -> None:
    """The two rank paths (pairwise for few keys, one sort above) give identical results."""
    from nw_adapter.core import metrics

    g = torch.Generator().manual_seed(m)
    x = torch.randint(0, 5, (3, 50, m), generator=g).float()  # many ties
    x[0, 0] = 1.0  # a constant row
    valid = torch.rand(3, 1, m, generator=g) > 0.3
    got = {}
    for threshold in (0, 1000):  # 0: always sort; 1000: always pairwise
        monkeypatch.setattr(metrics, "SORT_RANKS_ABOVE", threshold)
        got[threshold] = (metrics.rank_sign_sums(x), metrics.rank_sign_sums(x, valid))
    for a, b in zip(got[0], got[1000], strict=True):
        torch.testing.assert_close(a, b)
