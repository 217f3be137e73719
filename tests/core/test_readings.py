"""core.readings against independent float64 computations (numpy least squares, scipy), and edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.optimize as so
import scipy.special as sp
import scipy.stats as ss
import torch

from nw_adapter.core.readings import (
    fit_nw_to_attention,
    key_prior_log_weights,
    kl_key_prior,
    nw_readings,
    r2_key,
    r2_nw,
    row_centred,
)

torch.set_num_threads(1)


def _head(seed: int = 0, n: int = 30, m: int = 6, d: int = 5, scale: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d, generator=g, dtype=torch.float64)
    k = (
        torch.randn(m, d, generator=g, dtype=torch.float64)
        * torch.linspace(0.5, 1.5, m, dtype=torch.float64)[:, None]
    )
    return scale * q @ k.T, q, k


def _rss(design: np.ndarray, y: np.ndarray) -> float:
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    return float(np.sum((y - design @ coef) ** 2))


def _dummies(index: np.ndarray, levels: int) -> np.ndarray:
    return np.eye(levels)[index]


def test_r2_key_and_r2_nw_equal_least_squares_shares_of_a_two_way_design() -> None:
    """r2 = (RSS(row effects) - RSS(row effects + term)) / RSS(row effects), by numpy lstsq."""
    logits, q, k = _head()
    n, m = logits.shape
    y = logits.numpy().ravel()
    rows, keys = np.repeat(np.arange(n), m), np.tile(np.arange(m), n)
    row_design = _dummies(rows, n)
    base = _rss(row_design, y)
    with_keys = _rss(np.hstack([row_design, _dummies(keys, m)]), y)
    g = (q @ k.T - 0.5 * k.square().sum(-1)).numpy().ravel()
    with_nw = _rss(np.hstack([row_design, g[:, None]]), y)
    assert float(r2_key(logits)) == pytest.approx((base - with_keys) / base, rel=1e-10)
    assert float(r2_nw(logits, q, k)) == pytest.approx((base - with_nw) / base, rel=1e-10)


def test_r2_nw_is_zero_for_an_anti_nw_head() -> None:
    """beta = 1/h^2 >= 0: logits = -G (the NW ranking reversed) explain nothing."""
    _, q, k = _head(1)
    g = q @ k.T - 0.5 * k.square().sum(-1)
    assert float(r2_nw(-g, q, k)) == 0.0
    assert float(r2_nw(3.0 * g, q, k)) == pytest.approx(1.0, abs=1e-12)


def test_kl_key_prior_matches_scipy() -> None:
    logits, _, _ = _head(2)
    a = sp.softmax(logits.numpy(), axis=-1)
    bar = a.mean(0)
    expected = np.mean([ss.entropy(row, bar) for row in a])
    assert float(kl_key_prior(logits)) == pytest.approx(expected, rel=1e-10)
    np.testing.assert_allclose(key_prior_log_weights(logits).numpy(), np.log(bar), rtol=1e-12)


def test_fitted_nw_matches_a_scipy_minimisation_of_the_cross_entropy() -> None:
    logits, q, k = _head(3)
    a = sp.softmax(logits.numpy(), axis=-1)
    dist2 = ((q.numpy()[:, None, :] - k.numpy()[None, :, :]) ** 2).sum(-1)

    def mean_kl(log_beta: float) -> float:
        log_nw = sp.log_softmax(-0.5 * math.exp(log_beta) * dist2, axis=-1)
        return float(np.mean(np.sum(a * (np.log(a) - log_nw), axis=-1)))

    best = so.minimize_scalar(mean_kl, bounds=(-12.0, 6.0), method="bounded", options={"xatol": 1e-10})
    h, kl = fit_nw_to_attention(logits, q, k)
    assert float(h) == pytest.approx(math.exp(-0.5 * best.x), rel=1e-6)
    assert float(kl) == pytest.approx(best.fun, rel=1e-8)


def test_masked_keys_give_the_readings_of_the_valid_keys_alone() -> None:
    """Garbage (inf, NaN-free huge values) at masked keys changes nothing."""
    logits, q, k = _head(4, m=6)
    valid = torch.tensor([True, False, True, True, False, True])
    padded = logits.clone()
    padded[:, ~valid] = torch.tensor([math.inf, -1e30], dtype=torch.float64)
    k_padded = k.clone()
    k_padded[~valid] = 1e3
    got = nw_readings(padded, q, k_padded, valid)
    expected = nw_readings(logits[:, valid], q, k[valid])
    for name, value in expected.items():
        assert float(got[name]) == pytest.approx(float(value), rel=1e-9, abs=1e-12), name


def test_per_head_masks_broadcast_over_leading_dims() -> None:
    logits, q, k = _head(5, m=5)
    stacked = torch.stack([logits, logits])  # [2, n, m]
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    got = nw_readings(stacked, q.expand(2, -1, -1), k.expand(2, -1, -1), valid)
    alone = nw_readings(logits[:, :3], q, k[:3])
    full = nw_readings(logits, q, k)
    for name in alone:
        assert float(got[name][0]) == pytest.approx(float(full[name]), rel=1e-9), name
        assert float(got[name][1]) == pytest.approx(float(alone[name]), rel=1e-9), name


def test_one_valid_key_has_no_variance_and_no_bandwidth() -> None:
    logits, q, k = _head(6, m=4)
    valid = torch.tensor([False, True, False, False])
    out = nw_readings(logits, q, k, valid)
    assert math.isnan(float(out["r2_key"])) and math.isnan(float(out["r2_nw"]))
    assert math.isnan(float(out["h_eff"]))
    assert (
        float(out["kl_key_prior"]) == 0.0 and float(out["kl_nw_fit"]) == 0.0 and float(out["nw_gain"]) == 0.0
    )


def test_constant_rows() -> None:
    """Rows constant over the keys: no variance to explain (NaN), every row uniform (KL 0)."""
    _, q, k = _head(7)
    logits = torch.arange(q.shape[0], dtype=torch.float64)[:, None].expand(-1, k.shape[0])
    assert torch.equal(row_centred(logits), torch.zeros_like(logits))
    assert math.isnan(float(r2_key(logits))) and math.isnan(float(r2_nw(logits, q, k)))
    assert float(kl_key_prior(logits)) == 0.0


def test_small_logits_tie_the_divergences_to_the_variance_shares() -> None:
    """KL(softmax a || softmax b) ~ Var_i(a - b) / 2 for small logits: with V the mean row variance,
    kl_key_prior ~ (1 - r2_key) V / 2, kl_nw_fit ~ (1 - r2_nw) V / 2, nw_gain ~ (r2_nw - r2_key) V / 2
    (relative error O(logit size), here 1e-2)."""
    logits, q, k = _head(8, n=200, m=8, d=6, scale=0.01)
    out = nw_readings(logits, q, k)
    v = float(row_centred(logits).square().mean())
    assert float(out["kl_key_prior"]) == pytest.approx((1 - float(out["r2_key"])) * v / 2, rel=0.05)
    assert float(out["kl_nw_fit"]) == pytest.approx((1 - float(out["r2_nw"])) * v / 2, rel=0.05)
    assert float(out["nw_gain"]) == pytest.approx(
        (float(out["r2_nw"]) - float(out["r2_key"])) * v / 2, rel=0.05
    )


def test_float32_agrees_with_float64() -> None:
    logits, q, k = _head(9)
    f64 = nw_readings(logits, q, k)
    f32 = nw_readings(logits.float(), q.float(), k.float())
    for name in f64:
        assert f32[name].dtype == torch.float32
        assert float(f32[name]) == pytest.approx(float(f64[name]), rel=2e-3, abs=1e-5), name


@pytest.mark.parametrize(
    "valid",
    [torch.ones(5, dtype=torch.int64), torch.ones(4, dtype=torch.bool), "mask"],
)
def test_bad_masks_are_one_line_errors(valid) -> None:
    logits, q, k = _head(10, m=6)
    with pytest.raises(ValueError, match="valid must be a bool key mask") as err:
        nw_readings(logits, q, k, valid)
    assert "\n" not in str(err.value)
