"""Unit tests of the NW processors on a bare diffusers ``Attention`` module.

Covers: observe bit-identity (SDPA and classic processors, 3-D / 4-D inputs, group norm,
spatial norm, residual connection, output rescale, masks, several adapters); swap against an
explicit float64 reference of the Gaussian-kernel head; every statistic against a brute-force
recomputation; and every processor option (bandwidth rules, heads, steps, nulls, seed, cfg,
statistics, chunk_size).
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.image_processor import IPAdapterMaskProcessor
from diffusers.models.attention_processor import Attention, IPAdapterAttnProcessor, IPAdapterAttnProcessor2_0

from nw_adapter.core import bandwidth as bw
from nw_adapter.core import metrics
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.processors import (
    NWIPAdapterAttnProcessor,
    NWIPAdapterAttnProcessor2_0,
    nw_processor_for,
)
from nw_adapter.integration.recorder import NWRecorder
from nw_adapter.integration.schema import NULL_STATS, STAT_NAMES
from nw_adapter.integration.stats import draw_nulls
from nw_adapter.integration.stats.reference import pool_halves, reference_statistics

B, C, CROSS, HEADS, DIM = 4, 32, 24, 2, 16
STOCK = {"sdpa": IPAdapterAttnProcessor2_0, "classic": IPAdapterAttnProcessor}


def _attention(kind: str = "plain", seed: int = 0) -> Attention:
    torch.manual_seed(seed)
    kw = {}
    if kind == "norms":
        kw = {
            "norm_num_groups": 4,
            "spatial_norm_dim": 8,
            "residual_connection": True,
            "rescale_output_factor": 2.0,
        }
    return Attention(C, cross_attention_dim=CROSS, heads=HEADS, dim_head=DIM, bias=True, **kw).eval()


def _stock(cls=IPAdapterAttnProcessor2_0, tokens=(4, 4), scale=(0.7, 0.4), seed=1):
    proc = cls(HEADS * DIM, CROSS, num_tokens=list(tokens), scale=list(scale))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lin in [*proc.to_k_ip, *proc.to_v_ip]:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.5)
    return proc


def _inputs(seed=2, spatial=False, images=(1, 2), tokens=(4, 4)):
    gen = torch.Generator().manual_seed(seed)
    if spatial:
        x = torch.randn(B, C, 4, 6, generator=gen)
    else:
        x = torch.randn(B, 24, C, generator=gen)
    text = torch.randn(B, 7, CROSS, generator=gen)
    ip = [torch.randn(B, n, t, CROSS, generator=gen) for n, t in zip(images, tokens, strict=True)]
    return x, text, ip


def _masks(rows_hw=(4, 6), images=(1, 2)):
    gen = torch.Generator().manual_seed(5)
    return [(torch.rand(1, n, 16, 24, generator=gen) > 0.5).float() for n in images]


def _install(attn, stock, **options):
    cfg = NWProcessorConfig(**options)
    rec = NWRecorder(cfg)
    attn.set_processor(
        nw_processor_for(stock, layer_name="down_blocks.0.attn2.processor", config=cfg, recorder=rec)
    )
    return rec


@pytest.mark.parametrize("kind", ["sdpa", "classic"])
@pytest.mark.parametrize("variant", ["plain", "norms", "masks", "zero_scale"])
def test_observe_bit_identical(kind, variant):
    attn = _attention("norms" if variant == "norms" else "plain")
    stock = _stock(STOCK[kind], scale=(0.0, 0.0) if variant == "zero_scale" else (0.7, 0.4))
    x, text, ip = _inputs(spatial=variant == "norms")
    kwargs = {}
    if variant == "norms":
        kwargs["temb"] = torch.randn(B, 8, 2, 3)
    if variant == "masks":
        kwargs["ip_adapter_masks"] = _masks()
        stock.scale[1] = [0.3, 0.9]
    attn.set_processor(stock)
    ref = attn(x, (text, ip), **kwargs)
    rec = _install(attn, stock, cfg=True)
    out = attn(x, (text, ip), **kwargs)
    assert torch.equal(out, ref)
    records = rec.to_records()
    assert {r["half"] for r in records} == {"uncond", "cond"}
    groups = {(r["adapter"], r["image"], r["num_keys"]) for r in records}
    assert groups == ({(0, 0, 4), (1, 0, 4), (1, 1, 4)} if variant == "masks" else {(0, 0, 4), (1, 0, 8)})


def test_processor_shares_weights_and_scale():
    stock = _stock()
    rec = NWRecorder(NWProcessorConfig())
    nw = NWIPAdapterAttnProcessor2_0(stock, layer_name="x", config=rec.config, recorder=rec)
    assert nw.to_k_ip is stock.to_k_ip and nw.to_v_ip is stock.to_v_ip and nw.scale is stock.scale
    assert nw.num_tokens is stock.num_tokens
    assert isinstance(nw, IPAdapterAttnProcessor2_0)
    classic = NWIPAdapterAttnProcessor(
        _stock(IPAdapterAttnProcessor), layer_name="x", config=rec.config, recorder=rec
    )
    assert isinstance(classic, IPAdapterAttnProcessor)
    with pytest.raises(ValueError, match="already has an NW processor"):
        nw_processor_for(nw, layer_name="x", config=rec.config, recorder=rec)
    with pytest.raises(ValueError, match="load_ip_adapter"):
        nw_processor_for(torch.nn.Identity(), layer_name="x", config=rec.config, recorder=rec)


def _reference_swap(attn, stock, x, text, ip, masks, h, temb=None):
    """Explicit float64 layer output with the image branch = Gaussian-kernel NW head."""
    attn, x, text = attn.double(), x.double(), text.double()
    ip = [t.double() for t in ip]
    residual = x
    hs = x
    if attn.spatial_norm is not None:
        hs = attn.spatial_norm(hs, temb.double())
    four_d = hs.ndim == 4
    if four_d:
        b, c, hh, ww = hs.shape
        hs = hs.view(b, c, hh * ww).transpose(1, 2)
    if attn.group_norm is not None:
        hs = attn.group_norm(hs.transpose(1, 2)).transpose(1, 2)
    q = attn.to_q(hs)
    k, v = attn.to_k(text), attn.to_v(text)
    n = q.shape[1]

    def heads(t):
        return t.view(t.shape[0], t.shape[1], HEADS, DIM).transpose(1, 2)

    def merge(t):
        return t.transpose(1, 2).reshape(t.shape[0], n, HEADS * DIM)

    qh = heads(q)
    out = merge(torch.softmax(qh @ heads(k).transpose(-1, -2) / math.sqrt(DIM), -1) @ heads(v))
    for j, states in enumerate(ip):
        to_k, to_v = stock.to_k_ip[j].double(), stock.to_v_ip[j].double()
        groups = (
            [states.reshape(B, -1, CROSS)]
            if masks is None
            else [states[:, i] for i in range(states.shape[1])]
        )
        for i, g in enumerate(groups):
            kh, vh = heads(to_k(g)), heads(to_v(g))
            d2 = ((qh[..., :, None, :] - kh[..., None, :, :]) ** 2).sum(-1)
            w = torch.exp(-d2 / (2 * h * h))
            w = w / w.sum(-1, keepdim=True)
            branch = merge(w @ vh)
            s = stock.scale[j]
            if masks is not None:
                s = s[i] if isinstance(s, list) else s
                branch = (
                    branch * IPAdapterMaskProcessor.downsample(masks[j][:, i], B, n, HEADS * DIM).double()
                )
            out = out + s * branch
    out = attn.to_out[0](out)
    if four_d:
        out = out.transpose(-1, -2).reshape(b, c, hh, ww)
    if attn.residual_connection:
        out = out + residual
    return out / attn.rescale_output_factor


@pytest.mark.parametrize("kind", ["sdpa", "classic"])
@pytest.mark.parametrize("variant", ["plain", "norms", "masks"])
def test_swap_equals_float64_reference(kind, variant):
    attn = _attention("norms" if variant == "norms" else "plain")
    stock = _stock(STOCK[kind])
    x, text, ip = _inputs(spatial=variant == "norms")
    kwargs, masks = {}, None
    if variant == "norms":
        kwargs["temb"] = torch.randn(B, 8, 2, 3)
    if variant == "masks":
        masks = kwargs["ip_adapter_masks"] = _masks()
        stock.scale[1] = [0.3, 0.9]
    h = 2.5
    rec = _install(attn, stock, mode="swap", bandwidth=h)
    out32 = attn(x, (text, ip), **kwargs)
    attn.set_processor(stock)
    stock_out = attn(x, (text, ip), **kwargs)
    assert not torch.allclose(out32, stock_out, atol=1e-3)
    assert rec.to_records() == []  # swap records nothing unless statistics=True
    rec = _install(attn.double(), stock.double(), mode="swap", bandwidth=h)
    x64, text64, ip64 = x.double(), text.double(), [t.double() for t in ip]
    kw64 = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    out64 = attn(x64, (text64, ip64), **kw64)
    ref = _reference_swap(attn, stock, x, text, ip, masks, h, kwargs.get("temb"))
    torch.testing.assert_close(out64, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out32.double(), ref, rtol=1e-4, atol=1e-4)
    assert stock.scale[0] == 0.7  # scales restored after the temporary zeroing


def test_swap_matched_rule_uses_d_quarter_power():
    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    _install(attn, stock, mode="swap", bandwidth="matched")
    matched = attn(x, (text, ip))
    _install(attn, stock, mode="swap", bandwidth=DIM**0.25)
    explicit = attn(x, (text, ip))
    _install(attn, stock, mode="swap", bandwidth="median")
    median = attn(x, (text, ip))
    assert torch.equal(matched, explicit)
    assert not torch.allclose(matched, median)


def test_swap_chunk_size_is_passed(monkeypatch):
    import nw_adapter.core.kernels as kernels

    seen = []
    real = kernels.gaussian_kernel_head

    def spy(*args, **kwargs):
        seen.append(kwargs.get("chunk_size"))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "gaussian_kernel_head", spy)
    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    _install(attn, stock, mode="swap", chunk_size=5)
    chunked = attn(x, (text, ip))
    _install(attn, stock, mode="swap")
    whole = attn(x, (text, ip))
    # chunked: the core head with the chunk size, once per adapter; unchunked float32 with a
    # float h: the processor's fused head (one SDPA with the per-key bias), the same output
    assert seen == [5, 5]
    torch.testing.assert_close(chunked, whole)


def _captured_qk(attn, stock, x, ip):
    with torch.no_grad():
        q = attn.to_q(x).view(B, -1, HEADS, DIM).transpose(1, 2).double()
        ks = [
            stock.to_k_ip[j](t.reshape(B, -1, CROSS)).view(B, -1, HEADS, DIM).transpose(1, 2).double()
            for j, t in enumerate(ip)
        ]
    return q, ks


def reference_stats(q, k, h, s, gen=None, null_rows=None, halves=1) -> dict[str, torch.Tensor]:
    """Every statistic ``[halves, H]`` by name, from the float64 reference (stats.reference).

    The nulls replay the processor's draws from ``gen`` (row subsample, key permutation, directions).
    """
    draws = None if gen is None else draw_nulls(q, k.shape[-2], null_rows, gen)
    values = reference_statistics(q, k, scale=s, h=h, draws=draws, halves=halves)
    return dict(zip(STAT_NAMES, values, strict=True))


@pytest.mark.parametrize("rule", ["matched", "fitted", "median", "schedule", 1.7])
def test_statistics_match_brute_force(rule):
    """Every recorded statistic, nulls included, equals a float64 scipy recomputation."""
    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    rec = _install(
        attn,
        stock,
        bandwidth=rule,
        cfg=True,
        store_maps=True,
        map_dtype="float32",
        seed=3,
        null_rows=10,
        **({"schedule_c": 0.5} if rule == "schedule" else {}),  # read by that rule only (refused else)
    )
    rec.begin_step(call=0, step=0, timestep=torch.tensor(500), alpha=0.6, sigma=0.8)
    attn(x, (text, ip))
    q, ks = _captured_qk(attn, stock, x, ip)
    maps = rec.maps()
    records = rec.to_records()
    gen = torch.Generator().manual_seed(3)
    for j, k in enumerate(ks):
        A_ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(DIM), -1)
        A = maps[f"call0/step0/down_blocks.0.attn2.processor/adapter{j}/image0/attn"].double()
        W = maps[f"call0/step0/down_blocks.0.attn2.processor/adapter{j}/image0/nw"].double()
        torch.testing.assert_close(A, A_ref, rtol=1e-5, atol=1e-6)
        if rule == "matched":
            h = torch.full((B, HEADS), DIM**0.25, dtype=torch.float64)
        elif rule == "fitted":
            A32 = torch.softmax((q.float() @ k.float().transpose(-1, -2)) / math.sqrt(DIM), -1)
            h = bw.fitted_bandwidth(A32, q.float(), k.float())[0].double()
        elif rule == "median":
            h = bw.median_bandwidth(q.float(), k.float()).double()
        elif rule == "schedule":
            h = torch.full((B, HEADS), 0.5 * 0.8 / 0.6, dtype=torch.float64)
        else:
            h = torch.full((B, HEADS), 1.7, dtype=torch.float64)
        d2 = ((q[..., :, None, :] - k[..., None, :, :]) ** 2).sum(-1)
        W_ref = torch.softmax(-d2 / (2 * h[..., None, None] ** 2), -1)
        torch.testing.assert_close(W, W_ref, rtol=1e-4, atol=1e-5)
        expected = reference_stats(q, k, h, 1 / math.sqrt(DIM), gen, null_rows=10, halves=2)
        assert set(expected) == set(STAT_NAMES)
        # Pearson of the recorded float32 weights (W is nearly uniform where "fitted" hits h = 2000,
        # so its float64 recomputation differs by the weights' rounding)
        expected["pearson"] = pool_halves(metrics.pearson_raveled(A, W), 2, per_query_row=False)
        for name, per_half in expected.items():
            for hi, half in enumerate(("uncond", "cond")):
                for head in range(HEADS):
                    got = [
                        r[name]
                        for r in records
                        if r["adapter"] == j and r["half"] == half and r["head"] == head
                    ]
                    assert len(got) == 1
                    want = float(per_half[hi, head])
                    # NaN in both where h_eff is not identified (the uncond half's equal image tokens)
                    assert got[0] == pytest.approx(want, rel=2e-4, abs=2e-5, nan_ok=True), (name, half, head)
        rows = [r for r in records if r["adapter"] == j]
        assert all(r["timestep"] == 500.0 and r["h_schedule"] == pytest.approx(0.8 / 0.6) for r in rows)


def test_heads_option_restricts_and_matches():
    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    rec_all = _install(attn, stock, nulls=False)
    attn(x, (text, ip))
    rec_one = _install(attn, stock, nulls=False, heads=[1])
    attn(x, (text, ip))
    one = rec_one.to_records()
    assert {r["head"] for r in one} == {1}
    full = {(r["adapter"], r["head"]): r for r in rec_all.to_records()}
    for r in one:
        assert r["rho"] == pytest.approx(full[(r["adapter"], 1)]["rho"])
        assert r["kl"] == pytest.approx(full[(r["adapter"], 1)]["kl"])


def test_steps_option_selects_steps():
    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    rec = _install(attn, stock, steps=[1])
    for step in range(3):
        rec.begin_step(step=step)
        attn(x, (text, ip))
    assert {r["step"] for r in rec.to_records()} == {1}


def test_rank_statistics_do_not_depend_on_the_bandwidth():
    """rho, its nulls and top-1 rank logits: identical from h = 1e-3 (weights underflow) to 1e3."""
    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    ranked = ("rho", "rho_perm_null", "rho_norm_matched_null", "rho_spread_null", "top1")
    results = []
    for h in (1e-3, 1e-1, 1.0, 1e3):
        rec = _install(attn, stock, bandwidth=h, store_maps=True, map_dtype="float32", cfg=False, seed=5)
        attn(x, (text, ip))
        if h == 1e-3:
            W = rec.maps()["call0/step0/down_blocks.0.attn2.processor/adapter0/image0/nw"]
            assert bool((W == 0).any())  # the float32 weights underflow: ranking them would tie
        results.append([[r[name] for name in ranked] for r in rec.to_records()])
        assert all(math.isfinite(r["kl"]) and 0 <= r["js"] <= math.log(2) + 1e-6 for r in rec.to_records())
    assert all(res == results[0] for res in results[1:])


def test_tiny_bandwidth_divergences_come_from_the_logits():
    """At h = 1e-3 KL(A || W) is finite: both log-weights are log-softmaxes of the logits."""
    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    rec = _install(attn, stock, bandwidth=1e-3, cfg=False, nulls=False)
    attn(x, (text, ip))
    q, ks = _captured_qk(attn, stock, x, ip)
    for j, k in enumerate(ks):
        ref = reference_stats(q, k, torch.full((B, HEADS), 1e-3, dtype=torch.float64), 1 / math.sqrt(DIM))
        for r in (r for r in rec.to_records() if r["adapter"] == j):
            for name in ("kl", "js"):
                assert math.isfinite(r[name])
                assert r[name] == pytest.approx(float(ref[name][0, r["head"]]), rel=1e-3, abs=1e-5)


def test_statistics_option():
    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    rec = _install(attn, stock, statistics=False)
    attn(x, (text, ip))
    assert rec.to_records() == []
    rec = _install(attn, stock, mode="swap", statistics=True)
    attn(x, (text, ip))
    assert len(rec.to_records()) == 2 * HEADS


@pytest.mark.parametrize("kind", ["sdpa", "classic"])
@pytest.mark.parametrize("rule", [1.5, "median"])
def test_swap_records_the_softmax_its_branch_computes(kind, rule):
    """Issue 42: in swap, every recorded attention quantity is of the swapped head's own weights,
    ``softmax(-||q - k_i||^2 / 2h^2)`` at the h the branch used (a float, or one per batch row and
    head under the median rule), not of the stock ``softmax(s q.k)`` it replaced. The maps equal
    those weights (float tolerance), every statistic equals the specification of that head
    (``key_norm_weight=1``, ``scale = 1/h^2``), and differs from what observe records of the same
    call (the control of the test: main at f073761 recorded observe's numbers in swap)."""
    attn, stock = _attention(), _stock(STOCK[kind])
    x, text, ip = _inputs()
    names = [n for n in STAT_NAMES if n not in NULL_STATS]

    def run(mode):
        rec = _install(
            attn, stock, mode=mode, statistics=True, nulls=False, bandwidth=rule, store_maps=True,
            map_dtype="float32", fit_rows=None,
        )  # fmt: skip
        with torch.no_grad():
            attn(x, (text, ip))
        return rec

    swapped, observed = run("swap"), run("observe")
    q, ks = _captured_qk(attn, stock, x, ip)
    maps = swapped.maps()
    records = swapped.to_records()
    assert len(records) == 2 * HEADS  # two adapters, one (pooled) half
    for j, k in enumerate(ks):
        h = rule if isinstance(rule, float) else bw.median_bandwidth(q.float(), k.float()).double()
        hb = h if isinstance(h, float) else h[..., None, None]
        weights = torch.softmax(-torch.cdist(q, k).square() / (2 * hb**2), -1)
        got = maps[f"call0/step0/down_blocks.0.attn2.processor/adapter{j}/image0/attn"]
        torch.testing.assert_close(got.double(), weights, rtol=1e-5, atol=1e-6)
        want = reference_statistics(
            q, k, scale=1.0 / h**2, h=h, draws=None, halves=1, fit_rows=None, key_norm_weight=1.0
        )
        rows = [r for r in records if r["adapter"] == j]
        for name, value in zip(STAT_NAMES, want, strict=True):
            got_values = torch.tensor(
                [r[name] for r in sorted(rows, key=lambda r: r["head"])], dtype=torch.float64
            )
            torch.testing.assert_close(got_values, value[0], rtol=2e-4, atol=2e-5, equal_nan=True, msg=name)
        assert all(r["r2_nw"] == pytest.approx(1.0, abs=1e-5) for r in rows)  # the NW form, all of it
        if j == 1:  # two reference images pooled: the support-set masses are of the same weights
            masses = weights.view(B, HEADS, -1, 2, 4).sum(-1).mean(2).mean(0)  # [H, 2]
            for r in rows:
                got_mass = [r["ref_mass_0"], r["ref_mass_1"]]
                assert got_mass == pytest.approx(masses[r["head"]].tolist(), abs=1e-5)
    stock_values = torch.tensor([[r[n] for n in names] for r in observed.to_records()])
    swap_values = torch.tensor([[r[n] for n in names] for r in records])
    assert not torch.allclose(swap_values, stock_values, equal_nan=True)


def test_the_exact_head_as_a_dot_product_keeps_its_scores_and_distances():
    from nw_adapter.integration.processors.base import exact_head_as_dot_product

    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 7, 5, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    k = k * torch.linspace(0.5, 3.0, 4, dtype=torch.float64)[:, None]
    q2, k2 = exact_head_as_dot_product(q, k)
    scores = q @ k.transpose(-1, -2) - 0.5 * k.square().sum(-1)[..., None, :]
    torch.testing.assert_close(q2 @ k2.transpose(-1, -2), scores)
    shift = torch.cdist(q2, k2).square() - torch.cdist(q, k).square()  # constant over the keys
    torch.testing.assert_close(shift - shift[..., :1], torch.zeros_like(shift), atol=1e-9, rtol=0)


def test_swap_with_ip_masks_records_each_group_as_its_branch_computes():
    """Masked groups (one softmax per image) in swap: their maps are the NW weights at h too."""
    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    masks = _masks()
    stock.scale[1] = [0.3, 0.9]
    rec = _install(attn, stock, mode="swap", statistics=True, nulls=False, bandwidth=2.0, store_maps=True,
                   map_dtype="float32")  # fmt: skip
    with torch.no_grad():
        attn(x, (text, ip), ip_adapter_masks=masks)
    q, ks = _captured_qk(attn, stock, x, ip)
    maps = rec.maps()
    k1 = ks[1].view(B, HEADS, 2, 4, DIM)  # adapter 1: two images of four tokens, one softmax each
    for image in range(2):
        weights = torch.softmax(-torch.cdist(q, k1[:, :, image]).square() / 8.0, -1)
        got = maps[f"call0/step0/down_blocks.0.attn2.processor/adapter1/image{image}/attn"]
        torch.testing.assert_close(got.double(), weights, rtol=1e-5, atol=1e-6)


def test_nulls_and_seed_options():
    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    runs = {}
    for key, opts in {"a": {"seed": 0}, "b": {"seed": 0}, "c": {"seed": 1}, "off": {"nulls": False}}.items():
        rec = _install(attn, stock, **opts)
        attn(x, (text, ip))
        runs[key] = [tuple(r[n] for n in NULL_STATS) for r in rec.to_records()]
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["c"]
    assert all(math.isnan(v) for nulls in runs["off"] for v in nulls)
    assert all(not math.isnan(v) for nulls in runs["a"] for v in nulls)


def test_nulls_reseeded_each_call():
    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    rec = _install(attn, stock)
    for call in range(2):
        rec.begin_step(call=call, step=0)
        attn(x, (text, ip))
    by_call = [[r["rho_perm_null"] for r in rec.to_records() if r["call"] == c] for c in range(2)]
    assert by_call[0] != by_call[1]  # different calls use different (but reproducible) streams


def test_nulls_at_the_largest_seed_after_many_calls():
    """seed 2**63 - 1 with a large call index stays inside the generator's seed range."""
    from nw_adapter.integration.config import SEED_LIMIT

    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    rec = _install(attn, stock, seed=SEED_LIMIT - 1)
    for call in (0, 10**13):
        rec.begin_step(call=call, step=0)
        attn(x, (text, ip))
    by_call = [[r["rho_perm_null"] for r in rec.to_records() if r["call"] == c] for c in (0, 10**13)]
    assert len(by_call[0]) == len(by_call[1]) > 0  # neither call skipped by a failing side computation
    assert all(not math.isnan(v) for v in by_call[0] + by_call[1]) and by_call[0] != by_call[1]


def test_cfg_option_on_bare_layer():
    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    rec = _install(attn, stock, cfg=False)
    attn(x, (text, ip))
    assert {r["half"] for r in rec.to_records()} == {"all"}
    rec = _install(attn, stock)  # cfg=None: taken from the step state (no pipeline: False)
    rec.begin_step(cfg=True)
    attn(x, (text, ip))
    assert {r["half"] for r in rec.to_records()} == {"uncond", "cond"}


def test_schedule_rule_needs_noise_level():
    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    _install(attn, stock, mode="swap", bandwidth="schedule")  # observe skips instead (robustness tests)
    with pytest.raises(RuntimeError, match="schedule"):
        attn(x, (text, ip))


def test_schedule_c_scales_bandwidth():
    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    values = []
    for c in (1.0, 3.0):
        rec = _install(attn, stock, bandwidth="schedule", schedule_c=c)
        rec.begin_step(alpha=0.5, sigma=1.0)
        attn(x, (text, ip))
        values.append(rec.to_records()[0]["bandwidth"])
    assert values == pytest.approx([2.0, 6.0])


def test_legacy_tensor_encoder_states_fall_back_to_stock():
    attn, stock = _attention(), _stock(tokens=(4,), scale=(0.5,))
    x, text, ip = _inputs(images=(1,), tokens=(4,))
    packed = torch.cat([text, ip[0][:, 0]], dim=1)
    attn.set_processor(stock)
    ref = attn(x, packed)
    rec = _install(attn, stock)
    assert torch.equal(attn(x, packed), ref)
    assert rec.to_records() == []


def test_null_rows_subsample_is_reproduced():
    attn, stock = _attention(), _stock(tokens=(4,), scale=(1.0,))
    x, text, ip = _inputs(images=(1,), tokens=(4,))
    rec = _install(attn, stock, null_rows=5, seed=7, cfg=False)
    attn(x, (text, ip))
    q, (k,) = _captured_qk(attn, stock, x, ip)
    h = torch.full((B, HEADS), DIM**0.25, dtype=torch.float64)
    ref = reference_stats(q, k, h, 1 / math.sqrt(DIM), torch.Generator().manual_seed(7), null_rows=5)
    records = rec.to_records()
    for name in NULL_STATS:
        assert [r[name] for r in records] == pytest.approx(ref[name][0].tolist(), abs=1e-6)
    rec_all = _install(attn, stock, null_rows=None, seed=7, cfg=False)
    attn(x, (text, ip))
    assert [r["rho_norm_matched_null"] for r in rec_all.to_records()] != [
        r["rho_norm_matched_null"] for r in records
    ]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"bandwidth": "fitted", "heads": [1]},
        {"bandwidth": "median", "cfg": True},
        {"mode": "swap", "bandwidth": "median", "statistics": True},
        {"mode": "swap", "bandwidth": "fitted"},
        {"store_maps": True, "map_downsample": 2, "map_heads": [0]},
    ],
)
def test_no_host_reads_during_a_layer_call(monkeypatch, options):
    """Neither observe nor swap reads a tensor value on the host (no device sync per layer), as on a
    GPU: the one host read the statistics allow themselves on a CPU, where it costs no sync (the
    bandwidth fit's early stop, ``EagerWriter.settled``), is off as it is on any other device. The
    guarded call must record without a skip: a host read anywhere in the layer (the maps path
    included, which computes in the layer) raises there and would be counted as a skipped pair."""
    from nw_adapter.integration.stats.workspace import EagerWriter

    attn, stock = _attention(), _stock()
    x, text, ip = _inputs()
    rec = _install(attn, stock, **options)
    rec.begin_step(latent_hw=(4, 6))
    attn(x, (text, ip))  # warm caches (index tensors) outside the guarded call
    warm = len(rec.to_records())  # and the deferred statistics of that call
    monkeypatch.setattr(EagerWriter, "settled", lambda self, new, old, tolerance: False)

    def forbidden(self, *args, **kwargs):
        raise AssertionError("host read of a tensor value during the layer call")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    attn(x, (text, ip))
    monkeypatch.undo()
    assert rec.skipped()["count"] == 0, rec.skipped()
    assert len(rec.to_records()) == 2 * warm  # the guarded call recorded as the warm one did
    assert warm or (options.get("mode") == "swap" and not options.get("statistics"))
