"""Smoothed-target fields against Monte-Carlo samples of their own targets on every path class.

Each target is sampled here from its definition (component index uniform, then a Gaussian draw
written out with the fitted parameters: tau, local directions and variances, principal axes),
independently of the library's posterior formulas. With ``u*`` the exact regression function of
the path, ``E[(target - u*(x_t, t)) phi(x_t, t)] = 0`` for every test function ``phi``; each such
mean is compared with 5 of its standard errors (std / sqrt(N); a one-sided false alarm at 5 SE has
probability ~3e-7 per statistic). Power checks: the plug-in field (tau = 0) and a field with the
wrong tau fail the same test on the same samples.
"""

from __future__ import annotations

import math

import pytest
import torch

from nw_adapter.core.paths import (
    ConstantNoisePath,
    NWVelocityField,
    OTPath,
    RectifiedFlowPath,
    SigmaFlowPath,
    VPPath,
)
from nw_adapter.core.smoothed_fields import (
    LocalCovarianceField,
    ProjectedField,
    SmoothedSupportField,
    fit_shared_tau,
    local_covariances,
    loo_tau,
    principal_subspace,
)

torch.set_num_threads(1)
N = 20000
D = 3
F64 = torch.float64


def support_set(seed: int = 0, m: int = 8) -> torch.Tensor:
    """Points near a curve in 3-d (so local and principal structure is anisotropic)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(m, generator=g, dtype=F64) * 3
    base = torch.stack([2 * torch.cos(u), 2 * torch.sin(u), 0.5 * u], dim=1)
    return base + 0.15 * torch.randn(m, D, generator=g, dtype=F64)


def sd15_alphas_cumprod() -> torch.Tensor:
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=F64) ** 2
    return torch.cumprod(1 - betas, 0)


PATHS = {
    "ot": lambda: OTPath(sigma_min=0.05),
    "rectified": RectifiedFlowPath,
    "constant_noise": lambda: ConstantNoisePath(c=0.3),
    "sigma_flow": SigmaFlowPath,
    "vp_epsilon": lambda: VPPath(sd15_alphas_cumprod(), "epsilon"),
    "vp_v_prediction": lambda: VPPath(sd15_alphas_cumprod(), "v_prediction"),
}


def draw_path(path_name: str, x1: torch.Tensor, g: torch.Generator):
    """(x_t, t, regression target) from each path's definition, given target samples x1."""
    n = x1.shape[0]
    x0 = torch.randn(n, D, generator=g, dtype=F64)
    eps = torch.randn(n, D, generator=g, dtype=F64)
    u = torch.rand(n, generator=g, dtype=F64)
    if path_name == "ot":
        t = u
        return t[:, None] * x1 + (1 - 0.95 * t[:, None]) * x0, t, x1 - 0.95 * x0
    if path_name == "rectified":
        t = 0.99 * u
        return t[:, None] * x1 + (1 - t[:, None]) * x0, t, x1 - x0
    if path_name == "constant_noise":
        return u[:, None] * x1 + (1 - u[:, None]) * x0 + 0.3 * eps, u, x1 - x0
    if path_name == "sigma_flow":
        s = 1 - u
        return (1 - s[:, None]) * x1 + s[:, None] * eps, s, eps - x1
    ac = sd15_alphas_cumprod()
    t = torch.randint(0, 1000, (n,), generator=g)
    a, b = ac[t].sqrt()[:, None], (1 - ac[t]).sqrt()[:, None]
    target = eps if path_name == "vp_epsilon" else a * eps - b * x1
    return a * x1 + b * eps, t, target


def sample_smoothed(support: torch.Tensor, tau: float, g: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, support.shape[0], (N,), generator=g)
    return support[idx] + tau * torch.randn(N, D, generator=g, dtype=F64)


def sample_local(support, dirs, lam, tau: float, g: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, support.shape[0], (N,), generator=g)
    z = torch.randn(N, lam.shape[-1], generator=g, dtype=F64)
    along = (dirs[idx] @ (lam[idx].sqrt() * z)[:, :, None])[:, :, 0]
    return support[idx] + along + tau * torch.randn(N, D, generator=g, dtype=F64)


def sample_projected(support, axes, variances, in_sub, g: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, support.shape[0], (N,), generator=g)
    c = support.mean(0)
    P, Q = axes[:, in_sub], axes[:, ~in_sub]
    sub = (support[idx] - c) @ P @ P.T
    perp = (variances[~in_sub].sqrt() * torch.randn(N, int((~in_sub).sum()), generator=g, dtype=F64)) @ Q.T
    return c + sub + perp


def features(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(123)
    w = torch.randn(D, 4, generator=g, dtype=F64)
    b = 2 * math.pi * torch.rand(4, generator=g, dtype=F64)
    tt = t.to(F64)[:, None]
    tt = tt / tt.abs().max().clamp_min(1)
    return torch.cat([torch.ones_like(tt), x, tt, torch.sin(x @ w + b), torch.tanh(x * tt)], dim=1)


def max_z(residual: torch.Tensor, feats: torch.Tensor) -> float:
    prod = (residual[:, :, None] * feats[:, None, :]).reshape(residual.shape[0], -1)
    return float((prod.mean(0) / (prod.std(0) / math.sqrt(prod.shape[0]))).abs().max())


def build(kind: str, support: torch.Tensor, path, g: torch.Generator):
    """(field, target samples x1) for one kind of smoothed target."""
    if kind == "smoothed":
        field = SmoothedSupportField(support, path)
        return field, sample_smoothed(support, float(field.tau), g)
    if kind == "local":
        field = LocalCovarianceField(support, path, neighbours=4)
        return field, sample_local(support, field.directions, field.eigenvalues, float(field.tau), g)
    if kind == "projected":
        field = ProjectedField(support, path, explained=0.8)
        return field, sample_projected(support, field.axes, field.variances, field.in_subspace, g)
    field = SmoothedSupportField(support, path, tau=0.4)  # amortised: a tau given from elsewhere
    return field, sample_smoothed(support, 0.4, g)


KINDS = ("smoothed", "local", "projected", "amortised")


@pytest.mark.parametrize("path_name", list(PATHS))
@pytest.mark.parametrize("kind", KINDS)
def test_field_is_the_regression_function_of_its_target(kind: str, path_name: str) -> None:
    support = support_set()
    g = torch.Generator().manual_seed(7)
    field, x1 = build(kind, support, PATHS[path_name](), g)
    x, t, target = draw_path(path_name, x1, g)
    pred = field(x, t)
    assert max_z(target - pred, features(x, t)) < 5.0


@pytest.mark.parametrize("kind", ["smoothed", "local", "projected"])
def test_power_the_plugin_field_fails_on_the_smoothed_target(kind: str) -> None:
    support = support_set()
    g = torch.Generator().manual_seed(8)
    path = OTPath(sigma_min=0.05)
    _, x1 = build(kind, support, path, g)
    x, t, target = draw_path("ot", x1, g)
    keep = t > 0.5  # where the smoothing matters most
    plug = NWVelocityField(support, path)(x[keep], t[keep])
    assert max_z(target[keep] - plug, features(x[keep], t[keep])) > 10


def test_power_a_wrong_tau_fails() -> None:
    support = support_set()
    g = torch.Generator().manual_seed(9)
    path = RectifiedFlowPath()
    x1 = sample_smoothed(support, 0.4, g)
    x, t, target = draw_path("rectified", x1, g)
    assert max_z(target - SmoothedSupportField(support, path, tau=0.2)(x, t), features(x, t)) > 10
    assert max_z(target - SmoothedSupportField(support, path, tau=0.4)(x, t), features(x, t)) < 5


def test_zero_smoothing_is_the_plugin_field() -> None:
    support = support_set()
    x = torch.randn(64, D, dtype=F64)
    t = torch.rand(64, dtype=F64) * 0.99
    path = OTPath(0.01)
    plug = NWVelocityField(support, path)(x, t)
    torch.testing.assert_close(SmoothedSupportField(support, path, tau=0.0)(x, t), plug)
    local = LocalCovarianceField(support, path, tau=0.3)
    local.eigenvalues = torch.zeros_like(local.eigenvalues)  # no local variance: the isotropic smoothed field
    torch.testing.assert_close(local(x, t), SmoothedSupportField(support, path, tau=0.3)(x, t))
    one = support[:1]
    torch.testing.assert_close(ProjectedField(one, path)(x, t), NWVelocityField(one, path)(x, t))
    torch.testing.assert_close(SmoothedSupportField(one, path)(x, t), NWVelocityField(one, path)(x, t))


def test_batched_float32_matches_float64_per_task_and_chunks() -> None:
    supports = torch.stack([support_set(i) for i in range(3)])  # [3, 8, 3]
    x = 3 * torch.randn(3, 50, D, dtype=F64)
    t = torch.rand(3, 50, dtype=F64) * 0.99
    path = OTPath(0.01)
    for cls in (SmoothedSupportField, ProjectedField, LocalCovarianceField):
        full = cls(supports, path)(x, t)
        assert full.dtype == F64
        for i in range(3):
            torch.testing.assert_close(full[i], cls(supports[i], path)(x[i], t[i]))
        torch.testing.assert_close(cls(supports, path, chunk_size=7)(x, t), full)
        f32 = cls(supports.float(), path)(x.float(), t.float())
        assert f32.dtype == torch.float32
        torch.testing.assert_close(f32.double(), full, atol=2e-3, rtol=2e-3)


def test_stable_at_a_equal_zero_and_near_the_data() -> None:
    support = support_set().float()
    x = torch.randn(20, D)
    path = OTPath(0.01)
    fields = (
        SmoothedSupportField(support, path),
        ProjectedField(support, path),
        LocalCovarianceField(support, path),
    )
    for field in fields:
        at0 = field.mean(x, 0.0)
        assert torch.isfinite(at0).all()
        torch.testing.assert_close(at0, support.mean(0).expand_as(at0), atol=1e-5, rtol=1e-5)
        assert torch.isfinite(field(100 * x, 1.0)).all()


def test_likelihood_taus_follow_the_kde_bandwidth_law() -> None:
    # For Gaussian data N(c, 0.25 I) in 4-d with n = 400 points, the likelihood-optimal KDE bandwidth is
    # close to Silverman's 0.5 (4 / (d + 2))^(1/(d+4)) n^(-1/(d+4)) = 0.225; a 4x larger spread of the
    # data gives a 4x larger tau (the rules are scale-equivariant).
    g = torch.Generator().manual_seed(1)
    centres = 10 * torch.randn(1, 4, dtype=F64)
    noise = torch.randn(400, 4, generator=g, dtype=F64)
    silverman = 0.5 * (4 / 6) ** (1 / 8) * 400 ** (-1 / 8)
    pts = (centres + 0.5 * noise)[None]
    tau = float(loo_tau(pts))
    assert 0.6 * silverman < tau < 1.6 * silverman
    assert float(loo_tau(centres + 2.0 * noise)) == pytest.approx(4 * tau)
    heldout = centres + 0.5 * torch.randn(1, 400, 4, generator=g, dtype=F64)
    assert 0.6 * silverman < fit_shared_tau(pts, heldout) < 1.6 * silverman
    assert float(loo_tau(pts[:, :1])) == 0.0


def test_local_covariances_find_a_line_and_principal_subspace_a_plane() -> None:
    g = torch.Generator().manual_seed(2)
    u = torch.linspace(-3, 3, 40, dtype=F64)[:, None]
    line = u * torch.tensor([[1.0, 2.0, 2.0]], dtype=F64) / 3
    line = line + 0.01 * torch.randn(40, D, generator=g, dtype=F64)
    dirs, lam = local_covariances(line, neighbours=4)
    assert int((lam[0] > 0).sum()) == 1
    assert float((dirs[:, :, 0] @ torch.tensor([1.0, 2.0, 2.0], dtype=F64) / 3).abs().min()) > 0.99
    plane = torch.randn(60, D, generator=g, dtype=F64) * torch.tensor([3.0, 2.0, 0.1], dtype=F64)
    axes, var, sel = principal_subspace(plane)
    assert sel.tolist() == [True, True, False]
    assert float(axes[2, 2].abs()) > 0.99


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: SmoothedSupportField(torch.zeros(0, 2), OTPath()), "empty"),
        (lambda: SmoothedSupportField(torch.zeros(3, 2), OTPath(), tau=-1.0), "tau"),
        (lambda: ProjectedField(torch.zeros(3, 2), "ot"), "ProbabilityPath"),
        (lambda: ProjectedField(torch.zeros(3, 2), OTPath(), explained=0.0), "explained"),
        (lambda: LocalCovarianceField(torch.zeros(3, 2), OTPath(), neighbours=0), "neighbours"),
        (lambda: SmoothedSupportField(torch.ones(3, 2), OTPath())(torch.zeros(4, 3), 0.5), "features"),
        (lambda: SmoothedSupportField(torch.ones(3, 2), OTPath())(torch.zeros(4, 2), 1.5), "t must lie"),
        (lambda: fit_shared_tau(torch.ones(2, 3, 2), torch.ones(3, 3, 2)), "must match"),
    ],
)
def test_bad_input_raises_value_error(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_local_loo_likelihood_matches_dense_gaussians() -> None:
    from nw_adapter.core.smoothed_fields import _local_loo_loglik

    support = support_set(m=6)
    dirs, lam = local_covariances(support, neighbours=3)
    tau2 = torch.tensor([0.01, 0.3], dtype=F64)
    fast = _local_loo_loglik(support, dirs, lam, tau2)
    for g, t2 in enumerate(tau2):
        total = 0.0
        for i in range(6):
            logs = [
                torch.distributions.MultivariateNormal(
                    support[j], dirs[j] @ torch.diag(lam[j]) @ dirs[j].T + t2 * torch.eye(D, dtype=F64)
                ).log_prob(support[i])
                for j in range(6)
                if j != i
            ]
            total += float(torch.logsumexp(torch.stack(logs), 0)) - math.log(5)
        assert float(fast[g]) == pytest.approx(total, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("cls", [SmoothedSupportField, ProjectedField, LocalCovarianceField])
def test_scalar_time_equals_the_same_time_per_sample(cls) -> None:
    supports = torch.stack([support_set(i) for i in range(2)])
    x = 2 * torch.randn(2, 40, D, dtype=F64)
    for path in (OTPath(0.01), VPPath(sd15_alphas_cumprod(), "v_prediction")):
        field = cls(supports, path)
        t = 0.7 if isinstance(path, OTPath) else 300
        torch.testing.assert_close(field(x, t), field(x, torch.full((2, 40), t, dtype=F64)))
