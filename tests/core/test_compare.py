"""compare_attention: the three controls of issue 19 (values derived in each docstring), an independent
float64 recomputation, options, masks and input checks."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import scipy.optimize as so
import scipy.spatial.distance as ssd
import scipy.special as sp
import scipy.stats as ss
import torch

import nw_adapter
from nw_adapter.core.bandwidth import median_bandwidth
from nw_adapter.core.compare import COMPARISON_NAMES, compare_attention
from nw_adapter.core.kernels import nw_weights
from nw_adapter.core.specification import H_EFF_REASONS

torch.set_num_threads(1)
F64 = torch.float64


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def query_independent_head(n: int = 128, m: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query prefers the smallest-norm key, whatever the query.

    Keys ``k_i = [u_i, -||u_i||^2 / 2, 0]`` (u_i in R^8 of varied norms), queries
    ``q_j = [0, 2, w_j]`` with a large random w_j in the 7 coordinates no key uses:
    ``q_j.k_i = -||u_i||^2`` for every j, although the queries point in random directions.
    """
    g = _generator(seed)
    u = torch.randn(m, 8, generator=g, dtype=F64) * torch.linspace(0.3, 1.5, m, dtype=F64)[:, None]
    k = torch.zeros(m, 16, dtype=F64)
    k[:, :8], k[:, 8] = u, -0.5 * u.square().sum(-1)
    q = torch.zeros(n, 16, dtype=F64)
    q[:, 8], q[:, 9:] = 2.0, 3.0 * torch.randn(n, 7, generator=g, dtype=F64)
    return q[None, None], k[None, None]


def augmented_nw_head(h: float, equal_norms: bool, n: int = 128, m: int = 16, seed: int = 1):
    """THEORY section 3: ``q = [x/h, 1]``, ``k_i = [s_i/h, -||s_i||^2 / 2h^2]``, scale 1: A = NW_h(x; S)."""
    g = _generator(seed)
    x = torch.randn(n, 8, generator=g, dtype=F64)
    s = torch.randn(m, 8, generator=g, dtype=F64)
    if equal_norms:
        s = 2.0 * s / s.norm(dim=-1, keepdim=True)
    q = torch.cat([x / h, torch.ones(n, 1, dtype=F64)], 1)
    k = torch.cat([s / h, -s.square().sum(-1, keepdim=True) / (2 * h * h)], 1)
    return q[None, None], k[None, None], x, s


def test_control_a_a_query_independent_head_has_negative_nw_gain() -> None:
    """Derived: A_j is the same row for every j, so A_bar = A_j, kl_key_prior = 0 and r2_key = 1;
    NW's scores ``q.k_i - ||k_i||^2/2 = -||u_i||^2 - ||k_i||^2/2`` do not depend on j either, so
    ``nw_gain = -min_beta KL(A || softmax(beta G)) < 0`` (that minimum by scipy here). Both scores
    fall with ||u_i||: rho = 1, and it clears all three nulls: the rank reading is a false positive
    that nw_gain corrects."""
    q, k = query_independent_head()
    with pytest.warns(RuntimeWarning, match="h_eff: query-blind attention"):
        out = compare_attention(q, k, scale=0.25)
    assert float(out["r2_key"]) == pytest.approx(1.0, abs=1e-12)
    assert math.isnan(float(out["h_eff"]))  # no bandwidth of a query smoother is identified
    assert out.nan_reasons == {"h_eff": {H_EFF_REASONS[1]: 1}}
    assert float(out["kl_key_prior"]) == pytest.approx(0.0, abs=1e-12)
    a = sp.softmax(0.25 * (q[0, 0, 0] @ k[0, 0].T).numpy())
    dist2 = ((q[0, 0, 0] - k[0, 0]) ** 2).sum(-1).numpy()
    fit = so.minimize_scalar(
        lambda lb: float(ss.entropy(a, sp.softmax(-0.5 * math.exp(lb) * dist2))),
        bounds=(-12, 6),
        method="bounded",
        options={"xatol": 1e-10},
    )
    assert fit.fun > 1e-3
    assert float(out["kl_nw_fit"]) == pytest.approx(fit.fun, rel=1e-6)
    assert float(out["nw_gain"]) == pytest.approx(-fit.fun, rel=1e-6) and float(out["nw_gain"]) < 0
    assert float(out["rho"]) == pytest.approx(1.0, abs=1e-12)
    nulls = max(float(out[name]) for name in ("rho_perm_null", "rho_norm_matched_null", "rho_spread_null"))
    assert float(out["rho"]) - nulls > 0.3


@pytest.mark.parametrize("h", [0.5, 0.7, 2.0])
def test_control_b_an_exact_nw_head_with_equal_key_norms_is_recovered(h: float) -> None:
    """Derived: A = NW_h(x; S) exactly; with ||s_i|| equal the augmented keys have equal norms, so
    G = q.k - ||k||^2/2 = L - const: kl_nw_fit = 0 at beta = 1, i.e. h_eff = 1 in the head's units
    (q and k are x/h and s/h: data bandwidth h_eff * h = h), r2_nw = 1, rho = 1 and
    nw_gain = kl_key_prior > 0. Written with q = [x, 1], k = [s, -||s||^2/2] and scale 1/h^2 (the same
    logits), h_eff = h itself."""
    q, k, x, s = augmented_nw_head(h, equal_norms=True)
    attn = torch.softmax(q @ k.transpose(-1, -2), -1)[0, 0]
    torch.testing.assert_close(attn, nw_weights(x, s, h), rtol=1e-12, atol=1e-14)
    out = compare_attention(q, k, scale=1.0, bandwidth="fitted")
    assert float(out["kl_nw_fit"]) == pytest.approx(0.0, abs=1e-10)
    assert float(out["h_eff"]) == pytest.approx(1.0, rel=1e-6)
    assert float(out["r2_nw"]) == pytest.approx(1.0, abs=1e-10)
    assert float(out["rho"]) == pytest.approx(1.0, abs=1e-12)
    assert float(out["nw_gain"]) == pytest.approx(float(out["kl_key_prior"]), abs=1e-10)
    assert float(out["nw_gain"]) > 0.05
    q_plain = torch.cat([x, torch.ones(len(x), 1, dtype=F64)], 1)[None, None]
    k_plain = torch.cat([s, -0.5 * s.square().sum(-1, keepdim=True)], 1)[None, None]
    plain = compare_attention(q_plain, k_plain, scale=h**-2)
    assert float(plain["h_eff"]) == pytest.approx(h, rel=1e-6)
    assert float(plain["kl_nw_fit"]) == pytest.approx(0.0, abs=1e-10)


def test_control_b_with_unequal_norms_is_not_recognised_in_head_space() -> None:
    """The limit of every head-space reading: with ||s_i|| unequal, ``||k_i||^2 / 2 = ||s_i||^2/2h^2 +
    ||s_i||^4/8h^4`` varies over keys, so no beta makes softmax(beta G) equal A although A is the exact
    data-space NW: kl_nw_fit is the positive scipy minimum and h_eff is not 1."""
    q, k, x, s = augmented_nw_head(0.7, equal_norms=False)
    torch.testing.assert_close(torch.softmax(q @ k.transpose(-1, -2), -1)[0, 0], nw_weights(x, s, 0.7))
    out = compare_attention(q, k, scale=1.0)
    log_a = sp.log_softmax((q @ k.transpose(-1, -2))[0, 0].numpy(), axis=-1)
    dist2 = ((q[0, 0][:, None] - k[0, 0][None]) ** 2).sum(-1).numpy()

    def mean_kl(log_beta: float) -> float:
        log_nw = sp.log_softmax(-0.5 * math.exp(log_beta) * dist2, axis=-1)
        return float(np.mean(np.sum(np.exp(log_a) * (log_a - log_nw), axis=-1)))

    fit = so.minimize_scalar(mean_kl, bounds=(-12, 6), method="bounded", options={"xatol": 1e-10})
    assert fit.fun > 0.1
    assert float(out["kl_nw_fit"]) == pytest.approx(fit.fun, rel=1e-6)
    assert abs(float(out["h_eff"]) - 1.0) > 0.5


def test_control_c_an_isotropic_random_head() -> None:
    """q, k ~ N(0, I_32), scale 1/sqrt(32), n = 1024 rows, 32 heads. Derived per head, given its keys
    (k~ = keys centred over keys, c_i = ||k_i||^2/2 centred likewise):

    - r2_key: the key bias is ``scale qbar.k~_i`` with ``sqrt(n) qbar ~ N(0, I)``, so
      ``n r2_key ~ z^T M z / tr M`` (M = K~^T K~): mean 1, sd ``sqrt(2 tr M^2) / tr M`` per head;
    - r2_nw -> T / (T + C) as n grows, ``T = sum ||k~_i||^2``, ``C = sum c_i^2`` (cross terms have
      mean 0), within a few ``1/sqrt(n)``;
    - the queries are draws of the norm-matched null itself: rho - that null has mean 0;
    - a query-dependent head: nw_gain > 0 (small-logit form ``(r2_nw - r2_key) V / 2``, r2_nw ~ 2/3).
    """
    g = _generator(2)
    n, m, d = 1024, 16, 32
    q = torch.randn(4, 8, n, d, generator=g, dtype=F64)
    k = torch.randn(4, 8, m, d, generator=g, dtype=F64)
    out = compare_attention(q, k, scale=d**-0.5)
    k_c = k - k.mean(-2, keepdim=True)
    gram = k_c @ k_c.transpose(-1, -2)  # nonzero spectrum of M
    trace, trace2 = gram.diagonal(dim1=-2, dim2=-1).sum(-1), gram.square().sum((-1, -2))
    sd = (2 * trace2).sqrt() / trace
    heads = 32
    scaled = n * out["r2_key"]
    assert abs(float(scaled.mean()) - 1.0) < 4 * float(sd.square().mean().sqrt()) / math.sqrt(heads)
    half_sq = 0.5 * k.square().sum(-1)
    c = (half_sq - half_sq.mean(-1, keepdim=True)).square().sum(-1)
    limit = trace / (trace + c)
    assert float((out["r2_nw"] - limit).abs().max()) < 4 / math.sqrt(n)
    diff = out["rho"] - out["rho_norm_matched_null"]
    assert abs(float(diff.mean())) < 4 * float(diff.std()) / math.sqrt(heads)
    assert bool((out["nw_gain"] > 0).all())


def _row_pearson(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a - a.mean(-1, keepdims=True), b - b.mean(-1, keepdims=True)
    return (a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1))


def test_statistics_match_an_independent_float64_computation() -> None:
    g = _generator(3)
    q = torch.randn(2, 3, 40, 6, generator=g, dtype=F64)
    k = torch.randn(2, 3, 5, 6, generator=g, dtype=F64) * 1.3
    scale, h = 0.4, 1.7
    out = compare_attention(q, k, scale=scale, bandwidth=h)
    qk = (q @ k.transpose(-1, -2)).numpy()
    half = 0.5 * (k**2).sum(-1).numpy()[..., None, :]
    la = sp.log_softmax(scale * qk, axis=-1)
    dist2 = ((q.numpy()[..., :, None, :] - k.numpy()[..., None, :, :]) ** 2).sum(-1)
    lw = sp.log_softmax(-dist2 / (2 * h * h), axis=-1)
    a, w = np.exp(la), np.exp(lw)
    ranks_a, ranks_w = ss.rankdata(qk, axis=-1), ss.rankdata(qk - half, axis=-1)
    kn = np.linalg.norm(k.numpy(), axis=-1)
    expected = {
        "bandwidth": np.full((2, 3), h),
        "rho": _row_pearson(ranks_a, ranks_w).mean(-1),
        "pearson": _row_pearson(a.reshape(2, 3, -1), w.reshape(2, 3, -1)),
        "kl": (a * (la - lw)).sum(-1).mean(-1),
        "js": np.array(
            [
                [np.mean([ssd_js(a[i, j, r], w[i, j, r]) for r in range(40)]) for j in range(3)]
                for i in range(2)
            ]
        ),
        "neff_attn": (1 / (a**2).sum(-1)).mean(-1),
        "neff_nw": (1 / (w**2).sum(-1)).mean(-1),
        "top1": (qk.argmax(-1) == (qk - half).argmax(-1)).mean(-1),
        "key_norm_cv": kn.std(-1) / kn.mean(-1),
        "qk_spread_ratio": qk.std(-1).mean(-1) / half[..., 0, :].std(-1),
    }
    for name, value in expected.items():
        np.testing.assert_allclose(out[name].numpy(), value, rtol=1e-9, err_msg=name)
    assert list(out) == list(COMPARISON_NAMES)
    assert all(v.shape == (2, 3) and v.dtype == F64 for v in out.values())


def ssd_js(p: np.ndarray, r: np.ndarray) -> float:
    return float(ssd.jensenshannon(p, r) ** 2)


def test_bandwidth_rules_are_used() -> None:
    g = _generator(4)
    q, k = torch.randn(1, 2, 30, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    results = {
        rule: compare_attention(q, k, scale=0.3, bandwidth=rule)
        for rule in ("matched", "fitted", "median", 0.9)
    }
    torch.testing.assert_close(results["matched"]["bandwidth"], torch.full((1, 2), 0.3**-0.5))
    torch.testing.assert_close(results["fitted"]["bandwidth"], results["fitted"]["h_eff"])
    torch.testing.assert_close(results["median"]["bandwidth"], median_bandwidth(q, k))
    torch.testing.assert_close(results[0.9]["bandwidth"], torch.full((1, 2), 0.9))
    kls = [float(r["kl"][0, 0]) for r in results.values()]
    assert len(set(kls)) == 4  # the NW weights follow the bandwidth
    # the fitted bandwidth minimises the mean KL: the other rules are not better
    assert min(kls) == pytest.approx(float(results["fitted"]["kl"][0, 0]), rel=1e-4)


def test_masked_keys_equal_the_valid_keys_alone_and_nulls_are_seeded() -> None:
    g = _generator(5)
    q, k = torch.randn(2, 2, 25, 4, generator=g, dtype=F64), torch.randn(2, 2, 6, 4, generator=g, dtype=F64)
    valid = torch.ones(2, 2, 6, dtype=torch.bool)
    valid[1, 0, 3:] = False
    out = compare_attention(q, k, scale=0.5, valid=valid, bandwidth="fitted")
    alone = compare_attention(q[1:, :1], k[1:, :1, :3], scale=0.5, bandwidth="fitted")
    for name in COMPARISON_NAMES:
        if "null" not in name:
            assert float(out[name][1, 0]) == pytest.approx(float(alone[name][0, 0]), rel=1e-9, abs=1e-12), (
                name
            )
    again = compare_attention(q, k, scale=0.5, valid=valid, bandwidth="fitted")
    other = compare_attention(q, k, scale=0.5, valid=valid, bandwidth="fitted", seed=1)
    for name in ("rho_perm_null", "rho_norm_matched_null", "rho_spread_null"):
        assert torch.equal(out[name], again[name])
        assert not torch.equal(out[name], other[name])
    per_batch = compare_attention(q, k, scale=0.5, valid=valid[:, 0], bandwidth="fitted")  # [B, M] mask
    head1 = compare_attention(q[1:, 1:], k[1:, 1:, :3], scale=0.5, bandwidth="fitted")
    for name in ("kl", "r2_key", "r2_nw", "kl_nw_fit", "h_eff", "rho"):
        assert float(per_batch[name][1, 0]) == pytest.approx(float(out[name][1, 0]), rel=1e-9), name
        assert float(per_batch[name][1, 1]) == pytest.approx(float(head1[name][0, 0]), rel=1e-9), name


def test_float32_agrees_with_float64_and_the_lazy_export() -> None:
    g = _generator(6)
    q, k = torch.randn(1, 2, 30, 8, generator=g, dtype=F64), torch.randn(1, 2, 5, 8, generator=g, dtype=F64)
    assert nw_adapter.compare_attention is compare_attention
    f64 = compare_attention(q, k, scale=0.35)
    f32 = compare_attention(q.float(), k.float(), scale=0.35)
    for name in COMPARISON_NAMES:  # the nulls' draws depend on the dtype (normal directions)
        assert f32[name].dtype == torch.float32
        if name in ("rho_norm_matched_null", "rho_spread_null"):
            continue
        np.testing.assert_allclose(
            f32[name].double().numpy(), f64[name].numpy(), rtol=2e-3, atol=1e-5, err_msg=name
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": torch.zeros(2, 5, 4)}, "q must be a floating-point tensor"),
        ({"k": torch.zeros(1, 3, 5, 4)}, "must share B, H and d"),
        ({"k": torch.zeros(1, 2, 5, 3)}, "must share B, H and d"),
        ({"q": torch.full((1, 2, 5, 4), math.nan)}, "q contains NaN or inf"),
        ({"scale": 0.0}, "scale must be a finite float > 0"),
        ({"scale": math.inf}, "scale must be a finite float > 0"),
        ({"bandwidth": "schedule"}, "bandwidth must be one of"),
        ({"bandwidth": -1.0}, "bandwidth must be one of"),
        ({"valid": torch.ones(1, 2, 4, dtype=torch.bool)}, "valid must be a bool key mask"),
        ({"valid": torch.ones(1, 2, 5)}, "valid must be a bool key mask"),
        ({"valid": torch.zeros(5, dtype=torch.bool)}, "without any key"),
        ({"seed": 1.5}, "seed must be an int"),
    ],
)
def test_bad_input_is_one_line_value_error(change: dict, message: str) -> None:
    args = {"q": torch.zeros(1, 2, 5, 4), "k": torch.ones(1, 2, 5, 4), "scale": 0.5}
    args.update(change)
    q, k = args.pop("q"), args.pop("k")
    with pytest.raises(ValueError, match=message) as err:
        compare_attention(q, k, **args)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ extreme and degenerate inputs (issue 30)
def _base(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, float]:
    g = _generator(30)
    q = torch.randn(1, 2, 16, 8, generator=g, dtype=F64).to(dtype)
    k = torch.randn(1, 2, 6, 8, generator=g, dtype=F64).to(dtype)
    return q, k, 8**-0.5


# (c, bandwidth at c = 1): float32 q, k times c and the scale over c^2 give the same attention logits,
# the same NW logits at h times c and the same ranks; float32 alone overflows or underflows there.
EQUIVARIANT_CASES = {
    "norms x1e10": (1e10, "matched"),
    "norms x1e10, fitted": (1e10, "fitted"),
    "norms x1e10, median": (1e10, "median"),
    "scale 1e30 (norms x1e-15)": (1e-15, "matched"),
    "h 1e-20 (norms x1e-20)": (1e-20, 1.0),
    "h 1e-20, fitted": (1e-20, "fitted"),
}


@pytest.mark.parametrize("case", list(EQUIVARIANT_CASES))
def test_extreme_finite_inputs_give_the_values_of_the_rescaled_problem(case: str) -> None:
    c, bandwidth = EQUIVARIANT_CASES[case]
    q, k, s = _base(F64)
    reference = compare_attention(q, k, scale=s, bandwidth=bandwidth)
    scaled = bandwidth * c if isinstance(bandwidth, float) else bandwidth
    out = compare_attention((q * c).float(), (k * c).float(), scale=s / c**2, bandwidth=scaled)
    assert out.nan_reasons == {}
    for name in COMPARISON_NAMES:
        expected = reference[name] * (c if name in ("bandwidth", "h_eff", "key_rms", "q_norm") else 1.0)
        if name in ("rho_norm_matched_null", "rho_spread_null", "rho_perm_null"):  # seeded draws
            expected = reference[name]
        np.testing.assert_allclose(
            out[name].double().numpy(), expected.numpy(), rtol=1e-4, atol=1e-6, err_msg=f"{case}: {name}"
        )


@pytest.mark.parametrize(
    ("case", "args"),
    [
        ("scale 1e30", {"scale": 1e30}),
        ("scale 1e-30", {"scale": 1e-30}),
        ("bandwidth 1e30", {"bandwidth": 1e30}),
        ("norms x1e10", {"times": 1e10}),
        ("float64 h 1e-100", {"bandwidth": 1e-100, "dtype": F64}),
    ],
)
def test_extreme_finite_inputs_give_numbers_and_the_near_uniform_limit(case: str, args: dict) -> None:
    """No NaN at the extremes. At scale 1e-30 (and h = 1e30) the weights are within rounding of
    uniform; Pearson r of A and NW is then that of their first-order deviations, the row-centred
    logits (scale q.k and -||q - k||^2 / 2h^2), here from numpy."""
    q, k, s = _base(args.get("dtype", torch.float32))
    times = args.get("times", 1.0)
    scale, bandwidth = args.get("scale", s), args.get("bandwidth", "matched")
    one_hot = case in ("scale 1e30", "norms x1e10")  # logits ~1e20: one-hot attention rows
    with warnings.catch_warnings():
        warnings.simplefilter("error" if not one_hot else "ignore")
        out = compare_attention(q * times, k * times, scale=scale, bandwidth=bandwidth)
    # one-hot rows: any larger beta fits better, the fit ends at its range: h_eff is not identified
    assert out.nan_reasons == ({"h_eff": {H_EFF_REASONS[2]: 2}} if one_hot else {}), case
    numbers = [name for name in COMPARISON_NAMES if not (one_hot and name == "h_eff")]
    assert all(bool(torch.isfinite(out[name]).all()) for name in numbers), case
    if scale < 1e-20 or (isinstance(bandwidth, float) and bandwidth > 1e20):
        qn, kn = q.double().numpy()[0], k.double().numpy()[0]
        h = float(out["bandwidth"][0, 0])
        for head in range(2):
            a = scale * qn[head] @ kn[head].T
            w = -ssd.cdist(qn[head], kn[head], "sqeuclidean") / (2 * h * h)
            a = a - a.mean(1, keepdims=True) if scale < 1e-20 else sp.softmax(a, axis=1) - 1 / a.shape[1]
            w = w - w.mean(1, keepdims=True)  # NW is near uniform in both cases
            expected = (a * w).sum() / np.sqrt((a * a).sum() * (w * w).sum())
            assert float(out["pearson"][0, head]) == pytest.approx(expected, rel=1e-5), case


def _one_key(q, k):
    return q, k[:, :, :1], None


def _one_valid_key(q, k):
    valid = torch.zeros(k.shape[-2], dtype=torch.bool)
    valid[2] = True
    return q, k, valid


def _identical_keys(q, k):
    return q, k[:, :, :1].expand(-1, -1, 6, -1).contiguous(), None


def _zero_queries(q, k):
    return torch.zeros_like(q), k, None


def _median_zero(q, k):
    """Every query on one point where 4 of the 6 keys lie: the median squared distance is 0."""
    point = q[0, 0, 0]
    k = k.clone()
    k[:, :, :4] = point
    return point.expand_as(q).contiguous(), k, None


# case -> (inputs, reason, readings that must be among the NaN ones[, bandwidth])
DEGENERATE_CASES = {
    "median bandwidth 0": (
        _median_zero,
        "the bandwidth is 0 (the median rule on coincident queries and keys)",
        {"kl", "js", "pearson", "neff_nw"},
        "median",
    ),
    "one key": (_one_key, "fewer than 2 valid keys", {"rho", "pearson", "r2_key", "h_eff"}),
    "one valid key": (_one_valid_key, "fewer than 2 valid keys", {"rho", "pearson", "r2_key", "h_eff"}),
    "identical keys": (
        _identical_keys,
        "the valid keys are identical",
        {"rho", "pearson", "qk_spread_ratio"},
    ),
    "zero queries": (_zero_queries, "the queries are all zero", {"rho", "pearson", "r2_key", "r2_nw"}),
}


@pytest.mark.parametrize("case", list(DEGENERATE_CASES))
def test_a_reading_that_cannot_be_computed_is_nan_with_a_counted_reason(case: str) -> None:
    make, reason, must, *bandwidth = DEGENERATE_CASES[case]
    q, k, valid = make(*_base()[:2])
    with pytest.warns(RuntimeWarning, match="compare_attention: NaN readings") as caught:
        out = compare_attention(q, k, scale=8**-0.5, valid=valid, bandwidth=(bandwidth or ["matched"])[0])
    nan = {name for name in COMPARISON_NAMES if bool(torch.isnan(out[name]).any())}
    assert must <= nan, case
    assert set(out.nan_reasons) == nan  # every NaN reading has its reason, counted per (row, head)
    for name, why in out.nan_reasons.items():
        if name == "h_eff" and reason != H_EFF_REASONS[0]:  # h_eff has its own reasons
            assert why == {H_EFF_REASONS[1]: 2}, (name, why)  # these queries see one attention row
        elif "null" in name and case == "identical keys":  # random queries: q'.k ties up to rounding
            assert list(why) == [reason], (name, why)
        else:
            assert why == {reason: 2}, (name, why)
    assert all(bool(torch.isfinite(out[name]).all()) for name in set(COMPARISON_NAMES) - nan)
    message = str(caught[0].message)
    assert "\n" not in message and all(
        f"{name}: {next(iter(out.nan_reasons[name]))}" in message for name in nan
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"bandwidth": 1e39}, r"bandwidth must be one of .* or a float in \[1.18e-38, 3.4e\+38\]"),
        ({"bandwidth": 1e-39}, r"bandwidth must be one of .* or a float in \[1.18e-38, 3.4e\+38\]"),
        ({"bandwidth": 1e200, "dtype": F64}, r"bandwidth must be .* a float in \[1e-150, 1e\+150\]"),
        ({"bandwidth": 1e-20}, r"kl = .* is beyond the float32 range .*; pass q and k as float64"),
        ({"times": 1e200, "dtype": F64}, r"q.k overflows float64 .*; scale q and k down"),
        (
            {"scale": 1e300, "times": 1e10, "dtype": F64},
            r"scale \* q.k overflows float64 .*scale must be at most",
        ),
    ],
)
def test_arguments_out_of_range_are_one_line_value_errors(args: dict, message: str) -> None:
    q, k, s = _base(args.get("dtype", torch.float32))
    times = args.get("times", 1.0)
    with pytest.raises(ValueError, match=message) as err:
        compare_attention(
            q * times, k * times, scale=args.get("scale", s), bandwidth=args.get("bandwidth", "matched")
        )
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"seed": 2**70},
            r"seed must be an int in \[0, 2\*\*63\)",
        ),  # was "Overflow when unpacking long long"
        ({"seed": -1}, r"seed must be an int in \[0, 2\*\*63\)"),
        ({"q": "meta", "k": "meta"}, r"q is a meta tensor \(a shape without values\)"),  # was a RuntimeError
        ({"k": "meta"}, r"k is a meta tensor"),
    ],
    ids=["seed-2**70", "negative-seed", "meta", "meta-keys"],
)
def test_an_out_of_range_seed_or_a_meta_tensor_is_a_clear_value_error(change, message) -> None:
    gen = torch.Generator().manual_seed(0)
    inputs = {"q": torch.randn(1, 2, 4, 3, generator=gen), "k": torch.randn(1, 2, 5, 3, generator=gen)}
    for name in ("q", "k"):
        if change.get(name) == "meta":
            inputs[name] = inputs[name].to("meta")
    seed = change.get("seed", 0)
    with pytest.raises(ValueError, match=message) as caught:
        compare_attention(inputs["q"], inputs["k"], scale=0.5, seed=seed)
    assert "\n" not in str(caught.value)


def test_the_largest_seed_is_accepted() -> None:
    q, k = torch.randn(1, 1, 4, 3), torch.randn(1, 1, 5, 3)
    assert set(compare_attention(q, k, scale=0.5, seed=2**63 - 1)) == set(COMPARISON_NAMES)
