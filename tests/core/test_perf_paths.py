"""The chunked SDPA paths of NWVelocityField: accuracy at extreme t and bounded chunks (no timing).

The default ``NWVelocityField`` (``form="bias"``) computes the NW mean by chunked SDPA: scalar
``t`` through :func:`nw_adapter.core.kernels.nw_mean`, per-sample ``t`` through the shared-key
augmented form. Both are compared with the float64 direct-difference reference
(``form="direct"``) on data far from the origin, at ``t`` from ``1e-5`` to ``1 - 1e-5``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nw_adapter.core.paths import NWVelocityField, OTPath, VPPath

F64 = torch.float64
EPS32 = torch.finfo(torch.float32).eps


def offset_support(m: int = 64, d: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 2.0 * torch.randn(m, d, generator=g, dtype=F64) + 5.0


def path_samples(support: torch.Tensor, t: torch.Tensor, sigma_min: float, seed: int = 1) -> torch.Tensor:
    """x_t = t x1 + (1 - (1 - sigma_min) t) x0 for x1 drawn from the support (OT path)."""
    g = torch.Generator().manual_seed(seed)
    x1 = support[torch.randint(0, support.shape[0], (t.shape[0],), generator=g)]
    x0 = torch.randn(x1.shape, generator=g, dtype=F64)
    return t[:, None] * x1 + (1 - (1 - sigma_min) * t[:, None]) * x0


@pytest.mark.parametrize("t", [1e-5, 0.3, 0.5, 0.999, 1 - 1e-5])
def test_float32_default_matches_float64_direct_reference_at_extreme_t(t: float) -> None:
    support, path = offset_support(), OTPath(sigma_min=1e-3)
    tt = torch.full((500,), t, dtype=F64)
    x = path_samples(support, tt, 1e-3)
    ref = NWVelocityField(support, path, form="direct").mean(x, t)
    field32 = NWVelocityField(support.float(), path)
    assert field32.form == "bias"
    # float32 rounding of inputs and of an average of values of size max|s|: a few hundred ulps
    tol = 256 * EPS32 * float(support.abs().max())
    scalar = field32.mean(x.float(), t)
    per_sample = field32.mean(x.float(), tt.float())
    assert scalar.dtype == per_sample.dtype == torch.float32
    assert (scalar.double() - ref).abs().max() <= tol
    assert (per_sample.double() - ref).abs().max() <= tol


def test_per_sample_times_mixing_extremes_match_the_float64_reference() -> None:
    support, path = offset_support(seed=2), OTPath(sigma_min=1e-3)
    g = torch.Generator().manual_seed(3)
    tt = torch.cat(
        [torch.tensor([0.0, 1e-5, 1 - 1e-5, 1.0], dtype=F64), torch.rand(296, generator=g, dtype=F64)]
    )
    x = path_samples(support, tt, 1e-3, seed=4)
    ref = torch.stack(
        [
            NWVelocityField(support, path, form="direct").mean(x[i : i + 1], float(tt[i]))[0]
            for i in range(tt.shape[0])
        ]
    )
    out64 = NWVelocityField(support, path).mean(x, tt)
    out32 = NWVelocityField(support.float(), path).mean(x.float(), tt.float())
    torch.testing.assert_close(out64, ref, rtol=0, atol=1e-11)
    assert (out32.double() - ref).abs().max() <= 256 * EPS32 * float(support.abs().max())
    # a = 0 gives exactly uniform weights: the support mean
    torch.testing.assert_close(out64[0], support.mean(0), rtol=0, atol=1e-13)


def test_vp_path_per_sample_timesteps_match_the_reference() -> None:
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=F64) ** 2
    path = VPPath(torch.cumprod(1 - betas, 0), "epsilon")
    support = offset_support(m=16, d=8, seed=5)
    g = torch.Generator().manual_seed(6)
    t = torch.randint(0, 1000, (200,), generator=g)
    x = 3 * torch.randn(200, 8, generator=g, dtype=F64)
    ref = torch.stack(
        [NWVelocityField(support, path, form="direct")(x[i : i + 1], int(t[i]))[0] for i in range(200)]
    )
    torch.testing.assert_close(NWVelocityField(support, path)(x, t), ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("per_sample", [False, True])
def test_sdpa_calls_never_exceed_the_chunk(monkeypatch: pytest.MonkeyPatch, per_sample: bool) -> None:
    support = offset_support(m=32, d=8, seed=7).float()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(1000, 8, generator=g)
    t = torch.rand(1000, generator=g) if per_sample else 0.7
    whole = NWVelocityField(support, OTPath(0.01))(x, t)
    rows_seen: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def counting_sdpa(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        rows_seen.append(q.shape[-2])
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    chunked = NWVelocityField(support, OTPath(0.01), chunk_size=96)(x, t)
    assert rows_seen == [96] * 10 + [40]  # every query row once, at most 96 per call
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-5)


def test_per_sample_chunk_size_is_validated() -> None:
    field = NWVelocityField(torch.randn(4, 2), OTPath(), chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        field(torch.randn(3, 2), torch.rand(3))
