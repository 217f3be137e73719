"""Kernel math: SDPA Gaussian-kernel head vs an explicit float64 softmax, masks, chunks, dtypes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nw_adapter.core import kernels
from nw_adapter.core.kernels import (
    effective_sample_size,
    gaussian_kernel_attention,
    nw_logits,
    nw_mean,
    nw_weights,
)

EPS32 = torch.finfo(torch.float32).eps


def reference_weights(query: torch.Tensor, support: torch.Tensor, h: torch.Tensor, mask=None) -> torch.Tensor:
    """Explicit float64 softmax of -||x - s||^2 / 2h^2 by direct differences (no centring tricks)."""
    q, s = query.double(), support.double()
    h = torch.as_tensor(h, dtype=torch.float64)
    logits = -((q[..., :, None, :] - s[..., None, :, :]) ** 2).sum(-1) / (2 * h[..., None, None] ** 2)
    if mask is not None:
        logits = logits.masked_fill(~mask[..., None, :], -math.inf)
    return torch.softmax(logits, dim=-1)


def tolerances(query, support, h, eps: float = EPS32) -> tuple[float, float]:
    """Derived error bounds (weights, means) for a float32 computation by the expanded SDPA form.

    After centring on the support mean c, every logit is a sum of d products plus a bias, each
    term at most L = max (||x - c||^2 + ||s - c||^2) / 2h^2 + 1 in size; accumulation gives an
    absolute logit error <= (d + 4) eps L. A softmax perturbation obeys
    sum_i |dw_i| = sum_i w_i |dl_i - sum_j w_j dl_j| <= 2 max|dl|, so weights move by at most
    2 (d + 4) eps L and a mean sum_i w_i v_i by that times max|v - c|, plus the rounding of the
    normalisation and of the output itself, (m + 4) eps max|v|.
    """
    q, s = query.double(), support.double()
    d, m = q.shape[-1], s.shape[-2]
    c = s.mean(-2, keepdim=True)
    h = torch.as_tensor(h, dtype=torch.float64)
    big = ((q - c).square().sum(-1).amax(-1) + (s - c).square().sum(-1).amax(-1)) / (2 * h**2)
    tol_w = 2 * (d + 4) * eps * (float(big.max()) + 1.0)
    tol_mean = tol_w * float((s - c).abs().max()) + (m + 4) * eps * float(s.abs().max())
    return tol_w, tol_mean


CASES = {
    # name: (offset, spread, bandwidth scale, dtype)
    "standard": (0.0, 2.0, 0.7, torch.float32),
    "far_from_origin": (1e3, 2.0, 0.7, torch.float32),
    "tiny_bandwidth": (1e3, 2e-3, 1e-3, torch.float32),
    "fp16": (1e2, 2.0, 0.7, torch.float16),
    "bf16": (1e2, 2.0, 0.7, torch.bfloat16),
    "float64": (1e3, 2.0, 0.7, torch.float64),
}


def make_case(name: str, masked: bool):
    offset, spread, hscale, dtype = CASES[name]
    g = torch.Generator().manual_seed(list(CASES).index(name))
    d, n, m = 8, 37, 11
    q = (offset + spread * torch.randn(2, 3, n, d, generator=g, dtype=torch.float64)).to(dtype)
    s = (offset + spread * torch.randn(2, 3, m, d, generator=g, dtype=torch.float64)).to(dtype)
    h = hscale * (0.5 + torch.rand(3, generator=g, dtype=torch.float64))  # per head, [H]
    mask = None
    if masked:
        mask = torch.rand(2, 3, m, generator=g) < 0.6
        mask[..., 0] = True
    return q, s, h, mask


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_weights_and_sdpa_match_float64_formula(name: str, masked: bool) -> None:
    q, s, h, mask = make_case(name, masked)
    ref_w = reference_weights(q, s, h, mask)  # from the same rounded inputs
    ref_mean = ref_w @ s.double()
    eps = torch.finfo(torch.float64).eps if q.dtype == torch.float64 else EPS32
    tol_w, tol_mean = tolerances(q, s, h, eps)
    w = nw_weights(q, s, h, support_mask=mask)
    assert w.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    assert (w.double() - ref_w).abs().max() <= tol_w
    for form in ("bias", "augmented"):
        for chunk in (None, 5):
            out = nw_mean(q, s, h, support_mask=mask, form=form, chunk_size=chunk)
            assert out.dtype == w.dtype
            assert (out.double() - ref_mean).abs().max() <= tol_mean, (form, chunk)


def test_tolerance_is_tight_enough_to_catch_an_uncentred_float32_computation() -> None:
    # Without centring, x.s/h^2 terms of size ~1e3^2 d/h^2 swamp float32: the same test fails.
    q, s, h, _ = make_case("far_from_origin", False)
    ref = reference_weights(q, s, h) @ s.double()
    _, tol = tolerances(q, s, h)
    hh = h[:, None, None].float()
    naive = torch.softmax((q @ s.transpose(-1, -2) - 0.5 * s.square().sum(-1)[..., None, :]) / hh**2, -1) @ s
    assert (naive.double() - ref).abs().max() > tol


def test_nw_logits_match_formula_and_mask_with_minus_inf() -> None:
    q, s, h, mask = make_case("standard", True)
    logits = nw_logits(q, s, h, support_mask=mask)
    ref = -((q[..., :, None, :].double() - s[..., None, :, :].double()) ** 2).sum(-1) / (
        2 * h[..., None, None] ** 2
    )
    valid = mask[..., None, :].expand_as(logits)
    assert torch.isneginf(logits[~valid]).all()
    torch.testing.assert_close(logits[valid].double(), ref[valid], rtol=1e-6, atol=1e-5)


def test_masked_support_rows_may_hold_garbage() -> None:
    q, s, h, mask = make_case("standard", True)
    s_garbage = s.clone()
    s_garbage[~mask] = math.nan
    v = torch.randn(*s.shape[:-1], 4)
    v[~mask] = math.inf
    ref = reference_weights(q, s, h, mask) @ torch.where(mask[..., None], v, 0).double()
    for form in ("bias", "augmented"):
        out = gaussian_kernel_attention(q, s_garbage, v, h, key_mask=mask, form=form)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_out_dtype_follows_value_and_can_be_overridden() -> None:
    q, s, h, _ = make_case("fp16", False)
    out = gaussian_kernel_attention(q, s, s, h)
    assert out.dtype == torch.float16
    assert gaussian_kernel_attention(q, s, s, h, out_dtype=torch.float32).dtype == torch.float32
    assert nw_mean(q, s, h).dtype == torch.float32


def test_fp16_inputs_that_overflow_in_fp16_are_upcast() -> None:
    # ||s||^2 / 2h^2 ~ 8 * 1e4 / 0.98 > 65504 = fp16 max; an fp16 computation would give inf/NaN.
    q, s, h, _ = make_case("fp16", False)
    assert float((s.float().square().sum(-1) / (2 * h[:, None] ** 2)).max()) > torch.finfo(torch.float16).max
    assert torch.isfinite(nw_mean(q, s, h)).all()


def test_autocast_is_disabled_inside() -> None:
    q, s, h, _ = make_case("standard", False)
    ref = reference_weights(q, s, h) @ s.double()
    _, tol = tolerances(q, s, h)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = nw_mean(q, s, h)
        w = nw_weights(q, s, h)
    assert out.dtype == torch.float32 and w.dtype == torch.float32
    assert (out.double() - ref).abs().max() <= tol


def test_chunking_bounds_each_sdpa_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append(tuple(q.shape) + (k.shape[-2],))
        return real(q, k, v, **kw)

    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", spy)
    q, s, h, _ = make_case("standard", False)
    gaussian_kernel_attention(q, s, s, h, chunk_size=4)
    assert all(c[-3] <= 4 for c in calls) and sum(c[-3] for c in calls) == q.shape[-2]
    assert all(len(c) == 5 for c in calls)  # 4-D inputs, the fused kernels' layout
    calls.clear()
    monkeypatch.setattr(kernels, "ELEMENT_BUDGET", 6 * 2 * 3 * 11)  # room for 6 rows of [B, H, rows, m]
    gaussian_kernel_attention(q, s, s, h)
    assert max(c[-3] for c in calls) == 6


def test_value_dim_may_differ_from_key_dim() -> None:
    q, s, h, mask = make_case("standard", True)
    v = torch.randn(*s.shape[:-1], 13, dtype=torch.float64)
    ref = reference_weights(q, s, h, mask) @ v
    for form in ("bias", "augmented"):
        out = gaussian_kernel_attention(q, s, v, h, key_mask=mask, form=form)
        assert out.shape == (2, 3, 37, 13)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_bandwidth_broadcasting_rule() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 5, 4, generator=g)
    s = torch.randn(2, 3, 6, 4, generator=g)
    per_head = torch.tensor([0.5, 1.0, 2.0])
    w = nw_weights(q, s, per_head)
    for head in range(3):
        torch.testing.assert_close(w[:, head], nw_weights(q[:, head], s[:, head], float(per_head[head])))
    per_bh = torch.rand(2, 3, generator=g) + 0.5
    w = nw_weights(q, s, per_bh)
    torch.testing.assert_close(w[1, 2], nw_weights(q[1, 2], s[1, 2], float(per_bh[1, 2])))
    # extra leading dims of the bandwidth appear in the output: [T] bandwidths with [n, d] queries
    hs = torch.tensor([0.3, 3.0])
    w = nw_weights(q[0, 0], s[0, 0], hs)
    assert w.shape == (2, 5, 6)
    torch.testing.assert_close(w[1], nw_weights(q[0, 0], s[0, 0], 3.0))
    out = gaussian_kernel_attention(q[0, 0], s[0, 0], s[0, 0], hs)
    torch.testing.assert_close(out[0], nw_mean(q[0, 0], s[0, 0], 0.3), rtol=1e-5, atol=1e-5)


def test_huge_and_tiny_bandwidth_limits() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(20, 3, generator=g, dtype=torch.float64)
    s = torch.randn(7, 3, generator=g, dtype=torch.float64)
    w = nw_weights(q, s, 1e8)
    torch.testing.assert_close(w, torch.full_like(w, 1 / 7))
    torch.testing.assert_close(nw_mean(q, s, 1e8), s.mean(0).expand(20, 3))
    nearest = torch.cdist(q, s).argmin(-1)
    torch.testing.assert_close(nw_mean(q, s, 1e-4), s[nearest])
    torch.testing.assert_close(effective_sample_size(nw_weights(q, s, 1e-4)), torch.ones(20, dtype=q.dtype))


def test_effective_sample_size() -> None:
    w = torch.tensor([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    torch.testing.assert_close(effective_sample_size(w), torch.tensor([4.0, 1.0, 2.0]))
    assert effective_sample_size(w.half()).dtype == torch.float32


def test_all_masked_row_raises_or_gives_nan() -> None:
    q, s, h, mask = make_case("standard", True)
    mask[1, 2] = False
    with pytest.raises(ValueError, match="support_mask"):
        nw_weights(q, s, h, support_mask=mask)
    with pytest.raises(ValueError, match="key_mask"):
        gaussian_kernel_attention(q, s, s, h, key_mask=mask)
    w = nw_weights(q, s, h, support_mask=mask, validate=False)
    assert torch.isnan(w[1, 2]).all() and torch.isfinite(w[0]).all()
    for form in ("bias", "augmented"):
        out = nw_mean(q, s, h, support_mask=mask, validate=False, form=form)
        assert torch.isnan(out[1, 2]).all()
        assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, :2]).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"query": torch.randn(4, 3), "support": torch.randn(5, 2)}, "feature dim"),
        ({"support": torch.randn(0, 3)}, "support is empty"),
        ({"bandwidth": 0.0}, "bandwidth"),
        ({"bandwidth": -1.0}, "bandwidth"),
        ({"bandwidth": math.nan}, "bandwidth"),
        ({"bandwidth": torch.tensor([1.0, 0.0])}, "bandwidth"),
        ({"bandwidth": "wide"}, "bandwidth"),
        ({"query": torch.tensor([[math.nan, 0.0, 0.0]])}, "query"),
        ({"support": torch.full((5, 3), math.inf)}, "support"),
        ({"query": torch.randn(3)}, "query"),
        ({"query": torch.randn(2, 4, 3), "support": torch.randn(3, 5, 3)}, "do not broadcast"),
        ({"support_mask": torch.ones(4, dtype=torch.bool)}, "support_mask"),
        ({"support_mask": torch.ones(5)}, "support_mask"),
        ({"query": torch.ones(4, 3, dtype=torch.long)}, "query"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(kwargs: dict, match: str) -> None:
    args = {"query": torch.randn(4, 3), "support": torch.randn(5, 3), "bandwidth": 1.0} | kwargs
    mask = args.pop("support_mask", None)
    with pytest.raises(ValueError, match=match):
        nw_weights(args["query"], args["support"], args["bandwidth"], support_mask=mask)
    with pytest.raises(ValueError, match=match.replace("support", "key")):
        gaussian_kernel_attention(
            args["query"], args["support"], args["support"], args["bandwidth"], key_mask=mask
        )


def test_bad_attention_arguments() -> None:
    q, s = torch.randn(4, 3), torch.randn(5, 3)
    with pytest.raises(ValueError, match="form"):
        gaussian_kernel_attention(q, s, s, 1.0, form="dot")
    with pytest.raises(ValueError, match="chunk_size"):
        gaussian_kernel_attention(q, s, s, 1.0, chunk_size=0)
    with pytest.raises(ValueError, match="value"):
        gaussian_kernel_attention(q, s, torch.randn(6, 3), 1.0)
    with pytest.raises(ValueError, match="values"):
        nw_mean(q, s, 1.0, values=torch.randn(6, 3), form="direct")


def test_validate_false_skips_value_checks_but_not_shape_checks() -> None:
    q, s = torch.randn(4, 3), torch.randn(5, 3)
    out = nw_weights(q, s, torch.tensor(-1.0), validate=False)  # no device sync, no check
    assert out.shape == (4, 5)
    with pytest.raises(ValueError, match="feature dim"):
        nw_weights(q, torch.randn(5, 2), 1.0, validate=False)
