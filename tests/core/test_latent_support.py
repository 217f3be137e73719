"""The latent-space posterior over references and the x0 readings (core/latent_support.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nw_adapter.core.latent_support import (
    posterior_summary,
    reference_log_posterior,
    relative_distance,
    x0_from_output,
)
from nw_adapter.core.paths import NWVelocityField, SigmaFlowPath, VPPath


def _numpy_posterior(x: np.ndarray, s: np.ndarray, a: float, b: float) -> np.ndarray:
    logits = -((x[:, None, :] - a * s[None]) ** 2).sum(-1) / (2 * b * b)
    logits -= logits.max(-1, keepdims=True)
    w = np.exp(logits)
    return w / w.sum(-1, keepdims=True)


def test_the_posterior_is_the_softmax_of_scaled_distances():
    rng = np.random.default_rng(0)
    s, x = rng.normal(size=(4, 32)) * 3, rng.normal(size=(5, 32)) * 2
    for a, b in ((0.9, 0.4), (0.3, 0.95), (0.999, 0.04)):
        got = reference_log_posterior(torch.tensor(x, dtype=torch.float32), torch.tensor(s), a, b).exp()
        assert got.dtype == torch.float64
        np.testing.assert_allclose(got.numpy(), _numpy_posterior(x.astype(np.float32).astype(float), s, a, b),
                                   rtol=1e-9, atol=1e-12)  # fmt: skip


def test_pure_noise_is_uniform_and_a_small_bandwidth_is_one_hot():
    s = torch.tensor([[0.0, 0.0], [4.0, 0.0], [0.0, 4.0]])
    uniform = posterior_summary(reference_log_posterior(torch.randn(3, 2), s, 0.0, 1.0))
    assert torch.allclose(uniform.weights, torch.full((3, 3), 1 / 3, dtype=torch.float64))
    assert torch.allclose(uniform.entropy_share, torch.ones(3, dtype=torch.float64))
    assert torch.allclose(uniform.n_eff, torch.full((3,), 3.0, dtype=torch.float64))
    sharp = posterior_summary(reference_log_posterior(torch.tensor([[3.9, 0.1]]), s, 1.0, 0.01))
    assert sharp.favoured.tolist() == [1] and sharp.n_eff.item() == pytest.approx(1.0)
    assert sharp.entropy_share.item() == pytest.approx(0.0, abs=1e-12)  # 0 log 0 = 0, no NaN
    assert math.isnan(posterior_summary(torch.zeros(2, 1)).entropy_share[0].item())  # m = 1


@pytest.mark.parametrize(
    ("x", "support", "alpha", "sigma", "message"),
    [
        (torch.zeros(2, 3), torch.zeros(2, 4), 0.5, 0.5, "D = 4"),
        (torch.zeros(2, 4), torch.zeros(4), 0.5, 0.5, r"\[m, D\]"),
        (torch.zeros(2, 4), torch.zeros(2, 4), 0.5, 0.0, "sigma > 0"),
        (torch.zeros(2, 4), torch.zeros(2, 4), math.nan, 0.5, "alpha must be a finite number"),
    ],
)
def test_bad_inputs_are_refused_in_one_line(x, support, alpha, sigma, message):
    with pytest.raises(ValueError, match=message):
        reference_log_posterior(x, support, alpha, sigma)


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction", "sample"])
def test_x0_inverts_the_vp_field(kind):
    gen = torch.Generator().manual_seed(1)
    support, x = (
        torch.randn(3, 8, generator=gen, dtype=torch.float64),
        torch.randn(4, 8, generator=gen, dtype=torch.float64),
    )
    path = VPPath(torch.linspace(0.999, 0.01, 1000, dtype=torch.float64), kind)
    field = NWVelocityField(support, path, form="direct")
    for t in (10, 500, 990):
        a, b = path.alpha(t), path.sigma(t)
        got = x0_from_output(field(x, t), x, a, b, kind)
        torch.testing.assert_close(got, field.mean(x, t), rtol=1e-10, atol=1e-10)


def test_x0_inverts_the_sigma_flow_field():
    gen = torch.Generator().manual_seed(2)
    support, x = (
        torch.randn(3, 8, generator=gen, dtype=torch.float64),
        torch.randn(4, 8, generator=gen, dtype=torch.float64),
    )
    field = NWVelocityField(support, SigmaFlowPath(), form="direct")
    for s in (1.0, 0.6, 0.05):
        got = x0_from_output(field(x, s), x, 1 - s, s, "flow")
        torch.testing.assert_close(got, field.mean(x, s), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="kind must be one of"):
        x0_from_output(x, x, 0.5, 0.5, "velocity")
    with pytest.raises(ValueError, match="no x0 at alpha = 0"):
        x0_from_output(x, x, 0.0, 1.0, "epsilon")


def test_relative_distance_is_zero_on_the_plug_in_and_one_at_the_mean():
    support = torch.tensor([[0.0, 0.0], [2.0, 0.0]], dtype=torch.float64)
    mean = support.mean(0)
    x0 = torch.tensor([[1.0, 3.0], [5.0, 0.0]], dtype=torch.float64)
    assert relative_distance(x0, x0, mean).tolist() == [0.0, 0.0]
    assert relative_distance(x0, mean.expand(2, 2), mean).tolist() == [1.0, 1.0]  # even posterior: 1 always
    assert relative_distance(x0, support[1].expand(2, 2), mean).tolist() == pytest.approx(
        [math.sqrt(10) / 3, 0.75]
    )
    assert math.isnan(relative_distance(mean[None], support[:1], mean).item())
