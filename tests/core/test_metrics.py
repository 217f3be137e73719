"""Metrics against scipy on data with ties, nulls, and the unbiased MMD^2 estimator."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.spatial.distance as ssd
import scipy.stats as ss
import torch

from nw_adapter.core.kernels import nw_weights
from nw_adapter.core.metrics import (
    average_ranks,
    js_divergence,
    kl_divergence,
    median_heuristic_sigma,
    mmd2_unbiased,
    norm_equalised_null_rho,
    pearson_raveled,
    permutation_null_rho,
    rowwise_spearman,
    spearman_rho,
    top1_agreement,
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


def test_kl_and_js_match_scipy() -> None:
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(5, 6, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(5, 6, generator=g, dtype=torch.float64), -1)
    p[0, 2] = 0.0
    p[0] /= p[0].sum()
    kl_ref = [ss.entropy(p[i].numpy(), q[i].numpy()) for i in range(5)]
    js_ref = [ssd.jensenshannon(p[i].numpy(), q[i].numpy()) ** 2 for i in range(5)]
    np.testing.assert_allclose(kl_divergence(p, q).numpy(), kl_ref, rtol=1e-12)
    np.testing.assert_allclose(js_divergence(p, q).numpy(), js_ref, rtol=1e-10)
    assert torch.isinf(kl_divergence(q[:1], p[:1]))  # q > 0 where p = 0
    np.testing.assert_allclose(kl_divergence(p, q, log_q=q.log()).numpy(), kl_ref, rtol=1e-12)
    assert float(js_divergence(q[:1], p[:1])) <= math.log(2)


def test_kl_from_log_probabilities_stays_finite_when_weights_underflow() -> None:
    logits = torch.tensor([[0.0, -800.0, -1000.0]])  # exp underflows to 0 in float32 and float64
    q = torch.softmax(logits, -1)
    p = torch.tensor([[0.5, 0.25, 0.25]])
    assert torch.isinf(kl_divergence(p, q))
    expected = float((p * p.log()).sum() - (p * torch.log_softmax(logits, -1)).sum())
    got = kl_divergence(p, q, log_q=torch.log_softmax(logits, -1))
    assert math.isclose(float(got), expected, rel_tol=1e-6)


def test_kl_and_js_in_log_space_match_the_probability_forms() -> None:
    g = torch.Generator().manual_seed(11)
    la = torch.randn(3, 7, 5, generator=g, dtype=torch.float64)
    lb = 3 * torch.randn(3, 7, 5, generator=g, dtype=torch.float64)
    p, q = torch.softmax(la, -1), torch.softmax(lb, -1)
    lp, lq = torch.log_softmax(la, -1), torch.log_softmax(lb, -1)
    torch.testing.assert_close(
        kl_divergence(p, q, log_p=lp, log_q=lq), kl_divergence(p, q), rtol=1e-12, atol=0
    )
    torch.testing.assert_close(
        js_divergence(p, q, log_p=lp, log_q=lq), js_divergence(p, q), rtol=1e-11, atol=0
    )
    torch.testing.assert_close(js_divergence(p, q, log_q=lq), js_divergence(p, q), rtol=1e-11, atol=0)


def test_js_from_log_probabilities_stays_finite_when_weights_underflow() -> None:
    logits_q = torch.tensor([[0.0, -800.0, -1000.0]])  # q = [1, 0, 0] after underflow
    logits_p = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    p, q = torch.softmax(logits_p, -1), torch.softmax(logits_q, -1)
    lp, lq = torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
    got = js_divergence(p, q, log_p=lp, log_q=lq)
    # r = (p + q)/2 = [0.75, 0.125, 0.125]: JS = (KL(p||r) + KL(q||r)) / 2, q's zero entries add 0
    expected = 0.5 * (0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.25 / 0.125)) + 0.5 * math.log(1 / 0.75)
    assert math.isclose(float(got), expected, rel_tol=1e-6)
    assert math.isfinite(float(kl_divergence(p, q, log_p=lp, log_q=lq)))


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


def test_norm_equalised_null_grows_with_query_norm() -> None:
    # THEORY 4: per-row Spearman of random q, k rises with ||q||; the null must reproduce that.
    g = torch.Generator().manual_seed(5)
    d, m = 40, 16
    key = torch.randn(1, m, d, generator=g)
    q_small = torch.randn(1, 256, d, generator=g) / math.sqrt(d) * 1.6
    q_big = q_small * (51 / 1.6)

    def null(q: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1)
        return norm_equalised_null_rho(q, key, scale=d**-0.5, bandwidth=d**0.25, generator=gen)

    small, big = float(null(q_small)), float(null(q_big))
    assert small < 0.5 < 0.9 < big
    # only the query norms enter: permuting the coordinates of every query changes nothing
    assert torch.equal(null(q_small.flip(-1)), null(q_small))


def test_norm_equalised_null_respects_key_mask() -> None:
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(2, 30, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    mask = torch.tensor([[True, True, True, False, False], [True] * 5])
    out = norm_equalised_null_rho(q, k, scale=0.35, bandwidth=1.7, key_mask=mask, generator=g)
    assert out.shape == (2,) and torch.isfinite(out).all()


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
        (lambda: kl_divergence(torch.rand(3), torch.rand(4)), "p and q"),
        (lambda: pearson_raveled(torch.rand(4), torch.rand(4)), "at least 2 dims"),
        (lambda: mmd2_unbiased(torch.rand(1, 2), torch.rand(5, 2)), "x needs at least 2 samples"),
        (lambda: mmd2_unbiased(torch.rand(4, 2), torch.rand(5, 3)), "same last dim"),
        (lambda: mmd2_unbiased(torch.rand(4, 2), torch.rand(5, 2), sigma=0.0), "sigma"),
        (lambda: norm_equalised_null_rho(torch.rand(3, 4), torch.rand(2, 5), scale=1, bandwidth=1), "feat"),
        (lambda: norm_equalised_null_rho(torch.rand(4), torch.rand(2, 4), scale=1, bandwidth=1), "query"),
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
    assert kl_divergence(a, b).shape == (2, 4, 10)
    assert permutation_null_rho(a, b).shape == (2, 4)
