"""Bandwidth rules: matched, fitted (convex 1-D solve), median, schedule-shaped."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.optimize as so
import torch

from nw_adapter.core.bandwidth import (
    fit_schedule_constant,
    fitted_bandwidth,
    matched_bandwidth,
    median_bandwidth,
    schedule_bandwidth,
)
from nw_adapter.core.kernels import nw_weights


def heads(seed: int, b: int = 2, h: int = 3, n: int = 20, m: int = 6, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, h, m, d, generator=g, dtype=torch.float64)
    return q, k


def test_matched_bandwidth() -> None:
    assert matched_bandwidth(16) == 2.0
    assert matched_bandwidth(scale=0.25) == 2.0
    assert math.isclose(matched_bandwidth(40) ** 2, math.sqrt(40))


def test_matched_bandwidth_equals_attention_when_key_norms_are_equal() -> None:
    # THEORY 4: softmax(q.k / sqrt(d)) = NW(h^2 = sqrt(d)) x key prior exp(||k||^2 / 2 sqrt(d)).
    q, k = heads(0)
    d = q.shape[-1]
    attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1)
    k_eq = k / k.norm(dim=-1, keepdim=True) * 3.0
    attn_eq = torch.softmax(q @ k_eq.transpose(-1, -2) / math.sqrt(d), -1)
    torch.testing.assert_close(attn_eq, nw_weights(q, k_eq, matched_bandwidth(d)))
    prior = torch.softmax(k.square().sum(-1) / (2 * math.sqrt(d)), -1)[..., None, :]
    nw_prior = nw_weights(q, k, matched_bandwidth(d)) * prior
    torch.testing.assert_close(attn, nw_prior / nw_prior.sum(-1, keepdim=True))


def test_fitted_bandwidth_recovers_the_bandwidth_of_nw_weights() -> None:
    q, k = heads(1)
    h_true = torch.tensor([[0.5, 2.0, 8.0], [1.0, 3.0, 30.0]], dtype=torch.float64)
    h, kl = fitted_bandwidth(nw_weights(q, k, h_true), q, k)
    assert h.shape == (2, 3) and kl.shape == (2, 3)
    torch.testing.assert_close(h, h_true, rtol=1e-9, atol=0)
    assert float(kl.max()) < 1e-12


def test_fitted_bandwidth_minimises_the_cross_entropy() -> None:
    q, k = heads(2)
    d = q.shape[-1]
    attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1)
    mask = torch.tensor([True, True, False, True, True, True])
    attn_masked = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~mask, -math.inf), -1)
    for a, km in ((attn, None), (attn_masked, mask)):
        h, kl = fitted_bandwidth(a, q, k, key_mask=km)
        for bi, hi in ((0, 0), (1, 2)):
            g = (q[bi, hi] @ k[bi, hi].T - 0.5 * k[bi, hi].square().sum(-1)).numpy()
            ai = a[bi, hi].numpy()
            valid = np.ones(6, bool) if km is None else km.numpy()

            def loss(log_beta: float, g=g, ai=ai, valid=valid) -> float:
                z = np.exp(log_beta) * g[:, valid]
                lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
                return float((-(ai[:, valid] * z).sum(1) + lse).mean())

            res = so.minimize_scalar(loss, bounds=(-15, 10), method="bounded", options={"xatol": 1e-10})
            assert math.isclose(float(h[bi, hi]), math.exp(-res.x / 2), rel_tol=1e-4)
            entropy = float(-(torch.xlogy(a[bi, hi], a[bi, hi])).sum(-1).mean())
            assert math.isclose(float(kl[bi, hi]), res.fun - entropy, rel_tol=1e-6, abs_tol=1e-12)


def test_fitted_bandwidth_newton_converges_in_a_few_steps_and_stays() -> None:
    q, k = heads(6, b=2, h=8, n=256, m=4, d=40)
    attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(40), -1)
    h = {steps: fitted_bandwidth(attn, q, k, steps=steps)[0] for steps in (6, 7, 9, 24, 48)}
    for steps in (6, 7, 9, 24):  # converged iterates must not wander off afterwards
        torch.testing.assert_close(h[steps], h[48], rtol=1e-12, atol=0)
    h32, _ = fitted_bandwidth(attn.float(), q.float(), k.float())
    torch.testing.assert_close(h32.double(), h[48], rtol=1e-5, atol=0)


def test_fitted_bandwidth_is_float32_for_half_inputs_and_handles_one_hot_attention() -> None:
    q, k = heads(3, b=1, h=1, n=8, m=4, d=8)
    q, k = q.half(), k.half()
    g = q.double() @ k.double().transpose(-1, -2) - 0.5 * k.double().square().sum(-1)[..., None, :]
    one_hot = torch.nn.functional.one_hot(g.argmax(-1), 4).half()
    # the optimum is beta -> inf; any beta where the NW weights have saturated is optimal
    h, kl = fitted_bandwidth(one_hot, q, k)
    assert h.dtype == torch.float32 and kl.dtype == torch.float32
    assert float(kl) < 1e-6
    w = nw_weights(q, k, h)
    assert torch.equal(w.argmax(-1), g.argmax(-1)) and float(w.amax(-1).min()) > 1 - 1e-6


def test_fitted_bandwidth_bracket_end_is_returned_when_the_optimum_lies_beyond() -> None:
    q, k = heads(5, b=1, h=1, n=8, m=4, d=8)
    uniform = torch.full((1, 1, 8, 4), 0.25, dtype=torch.float64)  # optimum beta -> 0, h -> inf
    h, _ = fitted_bandwidth(uniform, q, k, beta_range=(1e-3, 1e3))
    # L' > 0 everywhere: pure bisection towards the lower end, log(1e6) / 2^24 ~ 1e-6 in log beta
    assert math.isclose(float(h), (1e-3 / math.sqrt(8)) ** -0.5, rel_tol=1e-5)


def test_median_bandwidth_matches_numpy() -> None:
    q, k = heads(4, n=5, m=3)  # 15 pairs: an odd count, the median is one value
    h = median_bandwidth(q, k)
    d2 = ((q[..., :, None, :] - k[..., None, :, :]) ** 2).sum(-1).flatten(-2).numpy()
    torch.testing.assert_close(h, torch.from_numpy(np.sqrt(np.median(d2, axis=-1) / 2)))
    mask = torch.tensor([True, False, True])
    hm = median_bandwidth(q, k, key_mask=mask)
    d2m = ((q[..., :, None, :] - k[..., None, [0, 2], :]) ** 2).sum(-1).flatten(-2)
    torch.testing.assert_close(hm, (d2m.nanmedian(-1).values / 2).sqrt())


def test_schedule_bandwidth_and_constant_fit() -> None:
    assert schedule_bandwidth(0.6, 0.8, c=2.0) == pytest.approx(1.5)
    r = torch.tensor([13.1, 4.30, 1.62, 0.725, 0.041], dtype=torch.float64)
    c_true = torch.tensor([[0.5, 2.0], [1.0, 3.0]], dtype=torch.float64)
    h = schedule_bandwidth(r[:, None, None], 1.0, c_true)
    assert h.shape == (5, 2, 2)
    h[2, 0, 0] = math.nan  # a step without a fit is ignored
    torch.testing.assert_close(fit_schedule_constant(h, r), c_true)
    # multiplicative noise: log-space least squares = geometric mean of the ratios
    noisy = h[:, 1, 1] * torch.tensor([1.1, 0.9, 1.2, 1.0, 0.8], dtype=torch.float64)
    expected = math.exp(float(torch.log(noisy / r).mean()))
    assert math.isclose(float(fit_schedule_constant(noisy, r)), expected, rel_tol=1e-12)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: matched_bandwidth(), "exactly one"),
        (lambda: matched_bandwidth(16, scale=0.25), "exactly one"),
        (lambda: matched_bandwidth(0), "head_dim"),
        (lambda: matched_bandwidth(scale=-1.0), "scale"),
        (lambda: fitted_bandwidth(torch.rand(4, 5), torch.rand(4, 3), torch.rand(6, 3)), "attn"),
        (lambda: fitted_bandwidth(torch.rand(4), torch.rand(4, 3), torch.rand(6, 3)), "attn"),
        (lambda: fitted_bandwidth(torch.rand(4, 6), torch.rand(4, 3), torch.rand(6, 2)), "feature dim"),
        (lambda: fitted_bandwidth(torch.rand(4, 6), torch.rand(4, 3), torch.rand(6, 3), steps=0), "steps"),
        (lambda: median_bandwidth(torch.rand(4, 3), torch.rand(0, 3)), "key is empty"),
        (lambda: schedule_bandwidth(0.5, 0.0), "alpha"),
        (lambda: fit_schedule_constant(torch.rand(5, 2), torch.rand(4)), "sigma_over_alpha"),
    ],
)
def test_bad_input_raises_value_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
