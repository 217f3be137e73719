"""KL and JS from logits with infinite logits: -inf is a zero-probability key, +inf takes all the mass."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.spatial.distance as ssd
import scipy.stats as ss
import torch

from nw_adapter.core.metrics import js_from_logits, kl_from_logits

INF = math.inf


def test_kl_is_log2_when_p_masks_a_key_with_minus_inf() -> None:
    """The reviewed case: p = [1, 0] written with the masked_fill convention, q uniform: KL = log 2."""
    logit_p = torch.tensor([0.0, -INF], dtype=torch.float64)
    logit_q = torch.tensor([0.0, 0.0], dtype=torch.float64)
    assert float(kl_from_logits(logit_p, logit_q)) == pytest.approx(math.log(2.0), rel=1e-12)
    assert float(kl_from_logits(logit_p.float(), logit_q.float())) == pytest.approx(math.log(2.0), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_divergences_with_minus_inf_logits_match_scipy(dtype: torch.dtype) -> None:
    """-inf logits in p, in q and in both at one key: scipy on the probabilities (0 log 0 = 0)."""
    g = torch.Generator().manual_seed(0)
    logit_p = torch.randn(4, 5, generator=g, dtype=torch.float64)
    logit_q = torch.randn(4, 5, generator=g, dtype=torch.float64)
    logit_p[:, 0] = -INF  # both zero at key 0
    logit_q[:, 0] = -INF
    logit_p[1, 3] = -INF  # only p zero
    logit_q[2, 4] = -INF  # only q zero where p > 0: KL = inf, JS finite
    p, q = torch.softmax(logit_p, -1).numpy(), torch.softmax(logit_q, -1).numpy()
    kl_ref = np.array([ss.entropy(p[i], q[i]) for i in range(4)])
    js_ref = np.array([ssd.jensenshannon(p[i], q[i]) ** 2 for i in range(4)])
    kl = kl_from_logits(logit_p.to(dtype), logit_q.to(dtype)).double().numpy()
    js = js_from_logits(logit_p.to(dtype), logit_q.to(dtype)).double().numpy()
    assert np.isinf(kl_ref[2]) and np.isinf(kl[2]) and kl[2] > 0
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    np.testing.assert_allclose(kl[[0, 1, 3]], kl_ref[[0, 1, 3]], rtol=tol)
    np.testing.assert_allclose(js, js_ref, rtol=tol)


def test_js_of_disjoint_supports_is_log2() -> None:
    logit_p = torch.tensor([0.0, 1.0, -INF, -INF])
    logit_q = torch.tensor([-INF, -INF, 3.0, 0.0])
    assert float(js_from_logits(logit_p, logit_q)) == pytest.approx(math.log(2.0), rel=1e-6)


def test_plus_inf_logits_put_all_mass_equally_on_those_keys() -> None:
    """+inf is the limit of a logit growing without bound: compare with a very large finite logit."""
    big = torch.tensor([1e4, 0.5, 1e4, -1.0], dtype=torch.float64)  # limit: [1/2, 0, 1/2, 0]
    inf_row = torch.tensor([INF, 0.5, INF, -1.0], dtype=torch.float64)
    logit_q = torch.tensor([0.0, 0.0, math.log(3.0), 0.0], dtype=torch.float64)
    q = torch.softmax(logit_q, -1)
    expected = 0.5 * math.log(0.5 / float(q[0])) + 0.5 * math.log(0.5 / float(q[2]))
    assert float(kl_from_logits(inf_row, logit_q)) == pytest.approx(expected, rel=1e-12)
    assert float(kl_from_logits(big, logit_q)) == pytest.approx(expected, rel=1e-12)
    assert float(js_from_logits(inf_row, logit_q)) == pytest.approx(
        float(js_from_logits(big, logit_q)), rel=1e-12
    )
    # +inf in both: the same limit, zero divergence; +inf only in q where p has mass elsewhere: inf
    assert float(kl_from_logits(inf_row, inf_row)) == 0.0
    assert math.isinf(float(kl_from_logits(logit_q, inf_row)))


def test_a_row_without_keys_is_nan_and_other_rows_are_unaffected() -> None:
    logit_p = torch.tensor([[-INF, -INF], [0.0, 1.0]])
    logit_q = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    kl = kl_from_logits(logit_p, logit_q)
    assert math.isnan(float(kl[0])) and math.isfinite(float(kl[1]))
