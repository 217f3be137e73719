"""ODE sampler: Euler/Heun from a support set, convergence orders on a known solution, grids, callback."""

from __future__ import annotations

import math

import pytest
import torch

from nw_adapter.core.paths import ConstantNoisePath, NWVelocityField, OTPath, RectifiedFlowPath, SigmaFlowPath
from nw_adapter.core.sampling import sample_ode, time_grid

F64 = torch.float64
NW_FIELD = NWVelocityField(torch.randn(3, 2, generator=torch.Generator().manual_seed(0)), OTPath())


@pytest.mark.parametrize("method", ["euler", "heun"])
def test_samples_from_a_support_set_land_on_support_points_with_uniform_frequencies(method: str) -> None:
    # With sigma_min = 1e-3 the exact flow ends at N(s_i, sigma_min^2 I) with i uniform on the m points.
    sigma_min, m, n = 1e-3, 8, 1000
    support = 2 * torch.randn(m, 2, generator=torch.Generator().manual_seed(1))
    x0 = torch.randn(n, 2, generator=torch.Generator().manual_seed(2))
    x = sample_ode(NWVelocityField(support, OTPath(sigma_min)), x0, time_grid(100), method=method)
    dist, idx = torch.cdist(x, support).min(-1)
    # exact endpoint: distance = sigma_min |z|, mean 1.25 sigma_min in 2-D, P(|z| > 10) ~ e^-50
    assert float(dist.max()) < 10 * sigma_min
    assert float(dist.mean()) < 3 * sigma_min
    counts = torch.bincount(idx, minlength=m).double()
    se = math.sqrt(n * (1 / m) * (1 - 1 / m))  # binomial standard error of each count
    assert float((counts - n / m).abs().max()) < 5 * se


def _known_case(c: float = 0.5):
    """Single support point s on the constant-noise path: y = x - t s obeys
    dy/dt = -(1 - t) y / ((1 - t)^2 + c^2), so y(1) = y(0) c / sqrt(1 + c^2) and
    x(1) = s + x(0) c / sqrt(1 + c^2) (a curved trajectory, unlike the straight OT paths)."""
    s = torch.tensor([[1.0, -2.0]], dtype=F64)
    x0 = torch.randn(100, 2, generator=torch.Generator().manual_seed(0), dtype=F64)
    exact = s + x0 * c / math.sqrt(1 + c**2)
    return NWVelocityField(s, ConstantNoisePath(c)), x0, exact


def test_heun_is_more_accurate_than_euler_with_the_right_orders() -> None:
    field, x0, exact = _known_case()
    errors = {}
    for method in ("euler", "heun"):
        errors[method] = [
            float((sample_ode(field, x0, time_grid(k + 1, 0.0, 1.0), method=method) - exact).abs().max())
            for k in (10, 20, 40)
        ]
    assert all(h * 10 < e for h, e in zip(errors["heun"], errors["euler"], strict=True))
    # halving the step halves Euler's error (order 1) and quarters Heun's (order 2)
    for k in range(2):
        assert 1.8 < errors["euler"][k] / errors["euler"][k + 1] < 2.2
        assert 3.6 < errors["heun"][k] / errors["heun"][k + 1] < 4.4


def test_generic_callable_linear_ode() -> None:
    x0 = torch.ones(3, 1, dtype=F64)
    grid = time_grid(11, 0.0, 1.0)
    euler = sample_ode(lambda x, t: -x, x0, grid)
    heun = sample_ode(lambda x, t: -x, x0, grid, method="heun")
    torch.testing.assert_close(euler, x0 * 0.9**10)
    torch.testing.assert_close(heun, x0 * (1 - 0.1 + 0.005) ** 10)


@pytest.mark.parametrize("method", ["euler", "heun"])
def test_decreasing_grid_sd3_convention_reaches_the_data(method: str) -> None:
    # one support point: x_s = (1 - s) x0 + s eps is a straight line, so both methods are exact;
    # the field is undefined at s = 0, so Heun's last step falls back to Euler.
    s = torch.tensor([[0.5, 2.0]], dtype=F64)
    eps = torch.randn(10, 2, generator=torch.Generator().manual_seed(3), dtype=F64)
    field = NWVelocityField(s, SigmaFlowPath())
    x = sample_ode(field, eps, time_grid(20, 1.0, 0.0), method=method)
    torch.testing.assert_close(x, s.expand_as(x), rtol=0, atol=1e-12)


def test_heun_to_the_singular_end_of_rectified_flow() -> None:
    support = torch.randn(4, 2, generator=torch.Generator().manual_seed(4), dtype=F64)
    field = NWVelocityField(support, RectifiedFlowPath())
    assert not field.defined_at(1.0)
    x0 = torch.randn(50, 2, generator=torch.Generator().manual_seed(5), dtype=F64)
    x = sample_ode(field, x0, time_grid(50, 0.0, 1.0), method="heun")
    # rectified flow with sigma_min = 0 ends exactly on support points
    assert float(torch.cdist(x, support).min(-1).values.max()) < 1e-6


def test_callback_receives_each_step() -> None:
    field, x0, _ = _known_case()
    grid = time_grid(6, 0.0, 1.0)
    seen: list[dict] = []
    out = sample_ode(field, x0, grid, callback=seen.append)
    assert [r["i"] for r in seen] == list(range(5))
    assert set(seen[0]) == {"x", "i", "t", "t_next", "velocity"}
    torch.testing.assert_close(torch.stack([r["t"] for r in seen]), grid[:-1])
    torch.testing.assert_close(seen[0]["x"], x0)
    torch.testing.assert_close(seen[2]["velocity"], field(seen[2]["x"], float(grid[2])))
    torch.testing.assert_close(seen[-1]["x"] + 0.2 * seen[-1]["velocity"], out)


def test_time_grid() -> None:
    g = time_grid(100)
    assert g.shape == (100,) and g.dtype == F64
    assert float(g[0]) == 1e-5 and float(g[-1]) == 1.0
    torch.testing.assert_close(time_grid(3, 1.0, 0.0, dtype=torch.float32), torch.tensor([1.0, 0.5, 0.0]))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: time_grid(1), "num_points"),
        (lambda: time_grid(5, 0.5, 0.5), "t_start"),
        (lambda: sample_ode(lambda x, t: x, torch.zeros(2, 2), time_grid(3), method="rk4"), "method"),
        (lambda: sample_ode(lambda x, t: x, torch.zeros(2, 2), torch.tensor([0.0, 0.5, 0.2])), "monotone"),
        (lambda: sample_ode(lambda x, t: x, torch.zeros(2, 2), torch.tensor([0.0])), "grid"),
        (lambda: sample_ode(lambda x, t: x, torch.zeros(2, 2), torch.zeros(2, 2)), "grid"),
        (lambda: sample_ode(lambda x, t: x, torch.zeros(2, 2), torch.tensor([0.0, math.nan])), "grid"),
        (lambda: sample_ode("field", torch.zeros(2, 2), time_grid(3)), "field"),
        (lambda: sample_ode(lambda x, t: x, torch.zeros(2, 2, dtype=torch.long), time_grid(3)), "x must"),
        (lambda: sample_ode(NW_FIELD, torch.zeros(2, 2), time_grid(3, -1.0)), r"t must lie in \[0, 1\)"),
    ],
)
def test_bad_input_raises_value_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
