"""ICFM model: shapes, ragged-support masking, attention records, time embedding."""

from __future__ import annotations

import math

import pytest
import torch

from nw_adapter.experiments.fields import exact_nw_velocity
from nw_adapter.experiments.model import ICFMConfig, ICFMModel, sinusoidal_embedding
from nw_adapter.experiments.training import build_model


def small(exact_head: bool = False, dim: int = 3) -> ICFMModel:
    return build_model(ICFMConfig(dim=dim, d_model=16, num_heads=4, num_layers=2, exact_head=exact_head), 0)


@pytest.mark.parametrize("exact_head", [False, True])
@pytest.mark.parametrize("t_shape", ["scalar", "batch", "rows"])
def test_output_shape(exact_head, t_shape):
    model = small(exact_head)
    x, s = torch.randn(2, 7, 3), torch.randn(2, 5, 3)
    t = {"scalar": torch.tensor(0.3), "batch": torch.rand(2), "rows": torch.rand(2, 7)}[t_shape]
    assert model(x, t, s).shape == (2, 7, 3)


@pytest.mark.parametrize("exact_head", [False, True])
def test_padding_does_not_change_outputs(exact_head):
    torch.manual_seed(0)
    model = small(exact_head)
    x, t = torch.randn(2, 6, 3), torch.rand(2, 6)
    s_a, s_b = torch.randn(1, 4, 3), torch.randn(1, 7, 3)
    ref_a, ref_b = model(x[:1], t[:1], s_a), model(x[1:], t[1:], s_b)
    padded = torch.full((2, 7, 3), 1e3)  # garbage in the padding
    padded[0, :4], padded[1] = s_a[0], s_b[0]
    mask = torch.arange(7)[None] < torch.tensor([[4], [7]])
    out = model(x, t, padded, mask)
    torch.testing.assert_close(out[0], ref_a[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1], ref_b[0], rtol=1e-5, atol=1e-5)
    out_w, records = model(x, t, padded, mask, return_attention=True)
    torch.testing.assert_close(out_w, out, rtol=1e-5, atol=1e-5)
    for rec in records:
        assert rec.weights.shape == (2, 4, 6, 7) and rec.query.shape == (2, 4, 6, 4)
        assert torch.all(rec.weights[0, ..., 4:] == 0)
        torch.testing.assert_close(rec.weights.sum(-1), torch.ones(2, 4, 6))


def test_queries_are_independent():
    model = small()
    x, t, s = torch.randn(1, 5, 3), torch.rand(1, 5), torch.randn(1, 8, 3)
    full = model(x, t, s)
    torch.testing.assert_close(model(x[:, 2:3], t[:, 2:3], s), full[:, 2:3], rtol=1e-5, atol=1e-6)


def test_exact_head_input_is_the_core_nw_velocity():
    s = torch.randn(2, 5, 3)
    x, t = torch.randn(2, 4, 3), torch.full((2, 4), 0.5)
    u = exact_nw_velocity(x, t, s, sigma_min=0.01)
    w = torch.softmax(-((x[:, :, None] / 0.5 - s[:, None]) ** 2).sum(-1) / (2 * (0.505 / 0.5) ** 2), -1)
    torch.testing.assert_close(u, (w @ s - 0.99 * x) / 0.505, rtol=1e-4, atol=1e-4)


def test_sinusoidal_embedding():
    e = sinusoidal_embedding(torch.tensor([0.0, 0.5]), 8)
    assert e.shape == (2, 8)
    torch.testing.assert_close(e[0], torch.tensor([0.0] * 4 + [1.0] * 4))
    assert math.isclose(float(e[1, 0]), math.sin(0.5), rel_tol=1e-6)


def test_bad_inputs():
    with pytest.raises(ValueError, match="d_model"):
        ICFMConfig(dim=2, d_model=10, num_heads=4)
    with pytest.raises(ValueError, match="time_dim"):
        ICFMConfig(dim=2, time_dim=3)
    with pytest.raises(ValueError, match="must be"):
        small()(torch.randn(1, 2, 2), 0.5, torch.randn(1, 3, 2))
