"""SD3 and Flux NW processors on the tiny flow-matching pipelines (issue 12, items 1-3).

Observe is bit-identical to stock (whole images, ``torch.equal``) with several images and
scales; swap equals a float64 reference of the Gaussian-kernel head; the recorded noise level is
h = s / (1 - s) of the scheduler's sigma at each step (SD3's shift, Flux's dynamic shifting);
processors are restored after an exception; ``set_ip_adapter_scale`` and ``unload_ip_adapter``
keep working; Flux's true-CFG passes are the cond / uncond halves of one step.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline
from diffusers.models.attention_processor import JointAttnProcessor2_0, SD3IPAdapterJointAttnProcessor2_0
from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor
from flow_helpers import SIZE, generate, load_flux, load_sd3
from tiny_helpers import random_image

from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.mixin import apply_nw_processor, nw_processor, remove_nw_processor
from nw_adapter.integration.processors import (
    NWFluxIPAdapterAttnProcessor,
    NWSD3IPAdapterJointAttnProcessor2_0,
    is_nw_processor,
)
from nw_adapter.integration.recorder import NWRecorder
from nw_adapter.pipelines.pipeline_flux_nw import FluxNWPipeline
from nw_adapter.pipelines.pipeline_stable_diffusion_3_nw import StableDiffusion3NWPipeline


@pytest.fixture(scope="module")
def sd3(tiny_sd3_dir, tiny_sd3_ip_adapter_dir):
    return load_sd3(StableDiffusion3NWPipeline, tiny_sd3_dir, tiny_sd3_ip_adapter_dir)


@pytest.fixture(scope="module")
def flux(tiny_flux_dir, tiny_flux_ip_adapter_dir):
    return load_flux(FluxNWPipeline, tiny_flux_dir, tiny_flux_ip_adapter_dir, adapters=2)


def _image(seed: int):
    return random_image(seed, SIZE)


# ---------------------------------------------------------------- observe: bit-identical


@pytest.mark.parametrize("scale", [0.5, 1.3])
def test_sd3_observe_bit_identical(sd3, scale):
    sd3.set_ip_adapter_scale(scale)
    try:
        for seed in (1, 2):  # two reference images
            stock = generate(sd3, ip_adapter_image=_image(seed))
            with nw_processor(sd3, mode="observe") as rec:
                observed = generate(sd3, ip_adapter_image=_image(seed))
            assert torch.equal(stock, observed)
            records = rec.to_records()
            assert {r["half"] for r in records} == {"uncond", "cond"}  # SD3's CFG batch
            assert {r["scale"] for r in records} == {scale}
            assert {r["num_keys"] for r in records} == {4}  # the IP tokens
    finally:
        sd3.set_ip_adapter_scale(0.5)


def test_flux_observe_bit_identical_two_adapters_several_images(flux):
    kwargs = {"ip_adapter_image": [_image(1), [_image(2), _image(3)]]}
    flux.set_ip_adapter_scale([0.7, 0.4])
    try:
        stock = generate(flux, **kwargs)
        with nw_processor(flux, mode="observe") as rec:
            observed = generate(flux, **kwargs)
            flux.set_ip_adapter_scale([1.2, 0.0])  # while installed: the stock objects' scale
            rescaled = generate(flux, **kwargs)
        assert torch.equal(stock, observed)
        assert torch.equal(rescaled, generate(flux, **kwargs))  # the new scale stayed after removal
        assert not torch.equal(stock, rescaled)
        records = rec.to_records()
        assert {(r["adapter"], r["num_keys"]) for r in records} == {(0, 4), (1, 8)}  # 1 and 2 images
        assert {(r["adapter"], r["scale"]) for r in records} == {(0, 0.7), (1, 0.4), (0, 1.2), (1, 0.0)}
    finally:
        flux.set_ip_adapter_scale(1.0)


def test_sd3_records_ip_and_joint_key_sets_with_ip_mass(sd3):
    with nw_processor(sd3, mode="observe", nulls=False) as rec:
        generate(sd3)
    ip, joint = rec.to_records(), rec.to_records(key_set="joint")
    assert len(ip) == len(joint) > 0
    tokens = (SIZE // 2 // 2) ** 2  # latent 16 x 16 in 2 x 2 patches
    assert {r["num_keys"] for r in joint} == {tokens + 4}
    for a, b in zip(ip, joint, strict=True):
        assert (a["step"], a["layer"], a["head"], a["half"]) == (b["step"], b["layer"], b["head"], b["half"])
        assert a["ip_mass"] == b["ip_mass"] and 0.0 < a["ip_mass"] < 1.0
        assert a["rho"] != b["rho"]
    assert all(math.isfinite(r["ip_mass"]) for r in rec.summary())


def test_sd3_ip_mass_and_restricted_attention_match_the_joint_softmax(sd3):
    """ip_mass and the "ip" key set's A are the stock joint softmax restricted to the IP keys."""
    attn = sd3.transformer.transformer_blocks[0].attn
    stock: SD3IPAdapterJointAttnProcessor2_0 = attn.processor
    gen = torch.Generator().manual_seed(0)
    x, ctx = torch.randn(2, 64, 16, generator=gen), torch.randn(2, 8, 16, generator=gen)
    ip, temb = torch.randn(2, 4, 16, generator=gen), torch.randn(2, 64, generator=gen)
    rec = NWRecorder()
    rec.begin_step(cfg=True)
    nw = NWSD3IPAdapterJointAttnProcessor2_0(stock, layer_name="l", config=rec.config, recorder=rec)
    with torch.no_grad():
        nw(attn, x, ctx, None, ip, temb)
        heads, d = attn.heads, 8
        q = stock.norm_q(attn.to_q(x).view(2, -1, heads, d).transpose(1, 2)).double()
        k_img = stock.norm_k(attn.to_k(x).view(2, -1, heads, d).transpose(1, 2)).double()
        ipn = stock.norm_ip(ip, temb=temb)
        k_ip = stock.norm_ip_k(stock.to_k_ip(ipn).view(2, -1, heads, d).transpose(1, 2)).double()
    joint = torch.softmax(q @ torch.cat([k_img, k_ip], 2).transpose(-1, -2) / math.sqrt(d), dim=-1)
    mass = joint[..., -4:].sum(-1).mean(-1)  # [B, H]
    expected = mass.view(2, 1, heads).squeeze(1)  # halves uncond, cond
    records = rec.to_records()
    got = torch.tensor([[r["ip_mass"] for r in records if r["half"] == h] for h in ("uncond", "cond")])
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-7)
    restricted = joint[..., -4:] / joint[..., -4:].sum(-1, keepdim=True)
    neff = (1.0 / restricted.square().sum(-1)).mean(-1)  # n_eff of the restricted, renormalised A
    got_neff = torch.tensor([[r["neff_attn"] for r in records if r["half"] == h] for h in ("uncond", "cond")])
    torch.testing.assert_close(got_neff.double(), neff, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- swap: float64 reference


def _gka64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: float) -> torch.Tensor:
    """sum_i softmax_i(-||q_n - k_i||^2 / 2h^2) v_i in float64, written out."""
    logits = -torch.cdist(q, k).square() / (2 * h * h)
    return torch.softmax(logits, dim=-1) @ v


def test_sd3_swap_equals_float64_gaussian_kernel_head(sd3):
    attn = sd3.transformer.transformer_blocks[0].attn
    stock: SD3IPAdapterJointAttnProcessor2_0 = attn.processor
    gen = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(2, 64, 16, generator=gen), torch.randn(2, 8, 16, generator=gen)
    ip, temb = torch.randn(2, 4, 16, generator=gen), torch.randn(2, 64, generator=gen)
    config = NWProcessorConfig(mode="swap", bandwidth=1.7)
    nw = NWSD3IPAdapterJointAttnProcessor2_0(
        stock, layer_name="l", config=config, recorder=NWRecorder(config)
    )
    with torch.no_grad():
        out, ctx_out = nw(attn, x, ctx, None, ip, temb)
        stock_out, stock_ctx = stock(attn, x, ctx, None, ip, temb)
    assert torch.equal(ctx_out, stock_ctx)  # the text stream is diffusers' own
    assert not torch.allclose(out, stock_out)
    # float64 reference: the text/joint attention without the image branch, captured at to_out's input
    attn64, proc64 = copy.deepcopy(attn).double(), copy.deepcopy(stock).double()
    captured = {}
    hook = attn64.to_out[0].register_forward_pre_hook(lambda m, a: captured.update(t=a[0]))
    with torch.no_grad():
        proc64(attn64, x.double(), ctx.double(), None, None, temb.double())
        hook.remove()
        heads, d = attn.heads, 8

        def split(t):
            return t.view(2, -1, heads, d).transpose(1, 2)

        x64, ipn = x.double(), proc64.norm_ip(ip.double(), temb=temb.double())
        q = proc64.norm_q(split(attn64.to_q(x64)))
        k = torch.cat(
            [proc64.norm_k(split(attn64.to_k(x64))), proc64.norm_ip_k(split(proc64.to_k_ip(ipn)))], 2
        )
        v = torch.cat([split(attn64.to_v(x64)), split(proc64.to_v_ip(ipn))], 2)
        branch = _gka64(q, k, v, 1.7).transpose(1, 2).reshape(2, -1, heads * d)
        expected = attn64.to_out[0](captured["t"] + branch * stock.scale)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


def test_flux_swap_equals_float64_gaussian_kernel_head(flux):
    attn = flux.transformer.transformer_blocks[0].attn
    stock: FluxIPAdapterAttnProcessor = attn.processor
    flux.set_ip_adapter_scale([0.8, 0.3])
    gen = torch.Generator().manual_seed(2)
    x, ctx = torch.randn(1, 64, 32, generator=gen), torch.randn(1, 8, 32, generator=gen)
    ips = [torch.randn(1, 4, 32, generator=gen), torch.randn(1, 2, 4, 32, generator=gen)]
    config = NWProcessorConfig(mode="swap", bandwidth="matched")
    nw = NWFluxIPAdapterAttnProcessor(stock, layer_name="l", config=config, recorder=NWRecorder(config))
    try:
        with torch.no_grad():
            text, context, ip_out = nw(attn, x, ctx, None, None, ips)
            stock_text, stock_context, stock_ip = stock(attn, x, ctx, None, None, ips)
            assert torch.equal(text, stock_text) and torch.equal(context, stock_context)
            assert not torch.allclose(ip_out, stock_ip)
            attn64, proc64 = copy.deepcopy(attn).double(), copy.deepcopy(stock).double()
            heads, d = attn.heads, 16
            q = attn64.norm_q(attn64.to_q(x.double()).unflatten(-1, (heads, d))).transpose(1, 2)
            expected = torch.zeros(1, 64, heads * d, dtype=torch.float64)
            for j, (states, scale) in enumerate(zip(ips, [0.8, 0.3], strict=True)):
                k = proc64.to_k_ip[j](states.double()).reshape(1, -1, heads, d).transpose(1, 2)
                v = proc64.to_v_ip[j](states.double()).reshape(1, -1, heads, d).transpose(1, 2)
                h = d**0.25  # matched: h^2 = sqrt(d_k)
                expected += scale * _gka64(q, k, v, h).transpose(1, 2).reshape(1, -1, heads * d)
        torch.testing.assert_close(ip_out.double(), expected, rtol=1e-4, atol=1e-5)
    finally:
        flux.set_ip_adapter_scale(1.0)


def test_sd3_swap_records_the_softmax_its_branch_computes(sd3):
    """Issue 42: swap's "ip" record and maps are the exact NW head over the IP keys (the joint
    head restricted and renormalised), ``ip_mass`` is that joint head's mass on the IP keys."""
    attn = sd3.transformer.transformer_blocks[0].attn
    stock: SD3IPAdapterJointAttnProcessor2_0 = attn.processor
    gen = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(2, 64, 16, generator=gen), torch.randn(2, 8, 16, generator=gen)
    ip, temb = torch.randn(2, 4, 16, generator=gen), torch.randn(2, 64, generator=gen)
    h = 1.7
    config = NWProcessorConfig(mode="swap", bandwidth=h, statistics=True, nulls=False, store_maps=True,
                               map_dtype="float32", cfg=False)  # fmt: skip
    rec = NWRecorder(config)
    nw = NWSD3IPAdapterJointAttnProcessor2_0(stock, layer_name="l", config=config, recorder=rec)
    with torch.no_grad():
        nw(attn, x, ctx, None, ip, temb)
        heads, d = attn.heads, 8

        def split(t):
            return t.view(2, -1, heads, d).transpose(1, 2)

        q = stock.norm_q(split(attn.to_q(x))).double()
        k_img = stock.norm_k(split(attn.to_k(x))).double()
        k_ip = stock.norm_ip_k(split(stock.to_k_ip(stock.norm_ip(ip, temb=temb)))).double()
    logits = -torch.cdist(q, torch.cat([k_img, k_ip], 2)).square() / (2 * h * h)
    joint = torch.softmax(logits, -1)
    restricted = torch.softmax(logits[..., -4:], -1)
    torch.testing.assert_close(rec.maps()["call0/step0/l/adapter0/image0/attn"].double(), restricted,
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    records = sorted(rec.to_records(), key=lambda r: r["head"])
    assert [r["ip_mass"] for r in records] == pytest.approx(
        joint[..., -4:].sum(-1).mean((0, 2)).tolist(), abs=1e-5
    )
    assert all(r["r2_nw"] == pytest.approx(1.0, abs=1e-5) for r in records)


def test_flux_swap_records_the_softmax_its_branch_computes(flux):
    attn = flux.transformer.transformer_blocks[0].attn
    stock: FluxIPAdapterAttnProcessor = attn.processor
    gen = torch.Generator().manual_seed(2)
    x, ctx = torch.randn(1, 64, 32, generator=gen), torch.randn(1, 8, 32, generator=gen)
    ips = [torch.randn(1, 4, 32, generator=gen), torch.randn(1, 2, 4, 32, generator=gen)]
    config = NWProcessorConfig(
        mode="swap", bandwidth="matched", statistics=True, nulls=False, store_maps=True, map_dtype="float32",
        cfg=False,
    )  # fmt: skip
    rec = NWRecorder(config)
    nw = NWFluxIPAdapterAttnProcessor(stock, layer_name="l", config=config, recorder=rec)
    heads, d = attn.heads, 16
    with torch.no_grad():
        nw(attn, x, ctx, None, None, ips)
        q = attn.norm_q(attn.to_q(x).unflatten(-1, (heads, d))).transpose(1, 2).double()
        for j, states in enumerate(ips):
            k = stock.to_k_ip[j](states).reshape(1, -1, heads, d).transpose(1, 2).double()
            weights = torch.softmax(-torch.cdist(q, k).square() / (2 * d**0.5), -1)  # matched: h^2 = sqrt(d)
            got = rec.maps()[f"call0/step0/l/adapter{j}/image0/attn"].double()
            torch.testing.assert_close(got, weights, rtol=1e-5, atol=1e-6)


def test_swap_changes_images_and_removal_restores_stock(sd3, flux):
    for pipe in (sd3, flux):
        stock = generate(pipe, ip_adapter_image=[_image(1), _image(2)] if pipe is flux else _image(1))
        with nw_processor(pipe, mode="swap", bandwidth="median"):
            swapped = generate(pipe, ip_adapter_image=[_image(1), _image(2)] if pipe is flux else _image(1))
        again = generate(pipe, ip_adapter_image=[_image(1), _image(2)] if pipe is flux else _image(1))
        assert not torch.equal(stock, swapped) and torch.equal(stock, again)


# ---------------------------------------------------------------- noise levels and labels


def _assert_flow_noise_levels(rec: NWRecorder, scheduler, steps: int) -> None:
    sigmas = scheduler.sigmas.double()
    timesteps = scheduler.timesteps.double()
    rows = {r["step"]: r for r in rec.summary()}
    assert sorted(rows) == list(range(steps))
    for i, row in rows.items():
        s = float(sigmas[i])
        assert row["timestep"] == pytest.approx(float(timesteps[i]))
        assert row["sigma"] == pytest.approx(s, rel=1e-6) and row["alpha"] == pytest.approx(1 - s, abs=1e-6)
        assert row["h_schedule"] == (pytest.approx(s / (1 - s), rel=1e-5) if s < 1 else math.inf)


def test_sd3_records_h_of_the_shifted_sigmas(sd3):
    assert sd3.scheduler.config.shift == 3.0
    with nw_processor(sd3, mode="observe", nulls=False) as rec:
        generate(sd3, steps=4)
    unshifted = torch.linspace(1, 0, 5)[:-1]
    assert not torch.allclose(sd3.scheduler.sigmas[:-1].float(), unshifted)  # the shift is in force
    _assert_flow_noise_levels(rec, sd3.scheduler, 4)


def test_flux_records_h_of_the_dynamically_shifted_sigmas(flux):
    assert flux.scheduler.config.use_dynamic_shifting
    with nw_processor(flux, mode="observe", nulls=False) as rec:
        generate(flux, steps=3, ip_adapter_image=[_image(1), _image(2)])
    linear = torch.tensor([1.0, 2 / 3, 1 / 3])
    assert not torch.allclose(flux.scheduler.sigmas[:-1].float(), linear)  # mu shifted them
    _assert_flow_noise_levels(rec, flux.scheduler, 3)
    assert {r["half"] for r in rec.to_records()} == {"cond"}  # one positive pass per step


def test_flux_true_cfg_passes_are_the_halves_of_one_step(flux):
    with nw_processor(flux, mode="observe", nulls=False) as rec:
        generate(
            flux, steps=3, ip_adapter_image=[_image(1), _image(2)], true_cfg_scale=3.0, negative_prompt="x"
        )
    records = rec.to_records()
    assert sorted({r["step"] for r in records}) == [0, 1, 2]
    for step in range(3):
        assert {r["half"] for r in records if r["step"] == step} == {"cond", "uncond"}
    _assert_flow_noise_levels(rec, flux.scheduler, 3)


# ---------------------------------------------------------------- restoring, scale, unload


@pytest.mark.parametrize("family", ["sd3", "flux"])
@pytest.mark.parametrize("mode", ["observe", "swap"])
def test_processors_stay_after_an_exception_and_unset_restores_them(request, family, mode):
    pipe = request.getfixturevalue(family)
    before = dict(pipe.transformer.attn_processors)
    rec = pipe.set_ip_adapter_nw_processor(mode=mode)
    assert any(is_nw_processor(p) for p in pipe.transformer.attn_processors.values())

    def boom(pipe, i, t, kwargs):
        raise RuntimeError("stop at step 0")

    kwargs = {"ip_adapter_image": [_image(1), _image(2)]} if family == "flux" else {}
    with pytest.warns(RuntimeWarning, match="partial record"):
        with pytest.raises(RuntimeError, match="stop at step 0"):
            generate(pipe, callback_on_step_end=boom, **kwargs)
    assert pipe.nw_recorder is rec and rec.to_records() == []  # the partial call is dropped
    assert any(is_nw_processor(p) for p in pipe.transformer.attn_processors.values())
    pipe.unset_ip_adapter_nw_processor()
    after = pipe.transformer.attn_processors
    assert all(after[n] is p for n, p in before.items())
    assert not pipe.transformer._forward_pre_hooks  # the step hook is gone too


def test_sd3_scale_set_while_installed_reaches_the_stock_processor_and_unload_works(
    tiny_sd3_dir, tiny_sd3_ip_adapter_dir
):
    pipe = load_sd3(StableDiffusion3Pipeline, tiny_sd3_dir, tiny_sd3_ip_adapter_dir)
    originals = dict(pipe.transformer.attn_processors)
    apply_nw_processor(pipe, mode="observe")
    pipe.set_ip_adapter_scale(0.25)
    assert pipe.is_ip_adapter_active
    remove_nw_processor(pipe)
    assert all(
        p.scale == 0.25 for p in originals.values() if isinstance(p, SD3IPAdapterJointAttnProcessor2_0)
    )
    apply_nw_processor(pipe, mode="observe")
    pipe.unload_ip_adapter()
    remove_nw_processor(pipe)  # must not bring the unloaded adapter back
    processors = pipe.transformer.attn_processors
    assert isinstance(processors["transformer_blocks.0.attn.processor"], JointAttnProcessor2_0)
    assert not any(isinstance(p, SD3IPAdapterJointAttnProcessor2_0) for p in processors.values())
    assert generate(pipe, ip_adapter_image=None).shape == (1, 3, SIZE, SIZE)


def test_flux_unload_while_installed(tiny_flux_dir, tiny_flux_ip_adapter_dir):
    pipe = load_flux(FluxPipeline, tiny_flux_dir, tiny_flux_ip_adapter_dir)
    apply_nw_processor(pipe, mode="observe")
    pipe.unload_ip_adapter()
    remove_nw_processor(pipe)
    assert not any(
        isinstance(p, FluxIPAdapterAttnProcessor) for p in pipe.transformer.attn_processors.values()
    )
    assert generate(pipe, ip_adapter_image=None).shape == (1, 3, SIZE, SIZE)


def test_state_dict_unchanged_by_installing(sd3):
    keys = set(sd3.transformer.state_dict())
    with nw_processor(sd3):
        assert set(sd3.transformer.state_dict()) == keys


# ---------------------------------------------------------------- failures


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_observe_never_fails_and_swap_names_the_layer(request, family, monkeypatch):
    from nw_adapter.integration import stats

    pipe = request.getfixturevalue(family)
    kwargs = {"ip_adapter_image": [_image(1), _image(2)]} if family == "flux" else {}
    stock = generate(pipe, **kwargs)

    def broken(*args, **kw):
        raise FloatingPointError("injected")

    monkeypatch.setattr(stats, "softmax_statistics", broken)
    with pytest.warns(RuntimeWarning, match="injected"):
        with nw_processor(pipe, mode="observe") as rec:
            observed = generate(pipe, **kwargs)
    assert torch.equal(stock, observed)
    skipped = rec.skipped()
    layers = [n for n, p in pipe.transformer.attn_processors.items() if hasattr(p, "to_k_ip")]
    assert skipped["count"] == 2 * len(layers) and rec.to_records(key_set=None) == []
    monkeypatch.setattr(
        "nw_adapter.core.kernels.gaussian_kernel_attention", broken
    )  # the swap branch's kernel
    with pytest.raises(
        RuntimeError, match=r"NW swap failed in layer 'transformer_blocks\.0\.attn\.processor'"
    ):
        with nw_processor(pipe, mode="swap"):
            generate(pipe, **kwargs)
    assert not any(is_nw_processor(p) for p in pipe.transformer.attn_processors.values())


def test_schedule_bandwidth_follows_s_over_1_minus_s_and_its_pure_noise_limit(sd3):
    """h = c s / (1 - s) at every step; at s = 1 (step 0) swap uses the exact h -> inf limit (the
    mean of the values) and observe skips the step, saying why (uniform NW weights)."""
    with pytest.warns(RuntimeWarning, match="infinite at s = 1"):
        with nw_processor(sd3, mode="observe", bandwidth="schedule", schedule_c=0.5, nulls=False) as rec:
            generate(sd3, steps=3)
    sigmas = sd3.scheduler.sigmas.double()
    assert float(sigmas[0]) == 1.0
    records = rec.to_records()
    assert {r["step"] for r in records} == {1, 2}
    for r in records:
        s = float(sigmas[r["step"]])
        assert r["bandwidth"] == pytest.approx(0.5 * s / (1 - s), rel=1e-5)
    assert {p["step"] for p in rec.skipped()["pairs"]} == {0}
    # swap at s = 1, on one layer: the branch is the mean of the joint values
    attn = sd3.transformer.transformer_blocks[0].attn
    stock = attn.processor
    gen = torch.Generator().manual_seed(3)
    x, ctx = torch.randn(2, 64, 16, generator=gen), torch.randn(2, 8, 16, generator=gen)
    ip, temb = torch.randn(2, 4, 16, generator=gen), torch.randn(2, 64, generator=gen)
    config = NWProcessorConfig(mode="swap", bandwidth="schedule")
    recorder = NWRecorder(config)
    recorder.begin_step(alpha=0.0, sigma=1.0)
    nw = NWSD3IPAdapterJointAttnProcessor2_0(stock, layer_name="l", config=config, recorder=recorder)
    captured = {}
    hook = attn.to_out[0].register_forward_pre_hook(lambda m, a: captured.update(t=a[0]))
    with torch.no_grad():
        stock(attn, x, ctx, None, None, temb)  # no image branch: the text part at to_out's input
        text = captured["t"]
        out, _ = nw(attn, x, ctx, None, ip, temb)
        hook.remove()

        def split(t):
            return t.view(2, -1, attn.heads, 8).transpose(1, 2)

        ipn = stock.norm_ip(ip, temb=temb)
        v = torch.cat([split(attn.to_v(x)), split(stock.to_v_ip(ipn))], 2)
        branch = v.mean(-2, keepdim=True).expand(2, attn.heads, 64, 8).transpose(1, 2).reshape(2, 64, 16)
        expected = attn.to_out[0](text + branch * stock.scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_sd3_skip_layer_guidance_pass_is_not_recorded(sd3):
    kwargs = {"skip_guidance_layers": [1], "skip_layer_guidance_start": 0.0, "steps": 3}
    stock = generate(sd3, **kwargs)
    with nw_processor(sd3, mode="observe", nulls=False) as rec:
        observed = generate(sd3, **kwargs)
    assert torch.equal(stock, observed)
    records = rec.to_records()
    assert {(r["step"], r["half"]) for r in records} == {(s, h) for s in range(3) for h in ("uncond", "cond")}
    assert len(records) == 3 * 2 * 2 * 2  # steps x halves x layers x heads: one record each


# ---------------------------------------------------------------- hooks: registered once, not per call


def _hook_count(module: torch.nn.Module) -> int:
    """Forward hooks and forward pre-hooks on ``module`` and every module below it."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


@pytest.mark.parametrize("family", ["sd3", "flux"])
@pytest.mark.parametrize("mode", ["observe", "swap"])
def test_a_call_registers_no_hook_the_taps_stay_until_removal(request, family, mode, monkeypatch):
    """The taps (hooks on the attention modules) are registered at the processors' first call and
    only armed / disarmed after it: a second pipeline call registers no hook at all, leaves the
    same hooks in place, and removing the processors removes every hook they added."""
    pipe = request.getfixturevalue(family)
    kwargs = {"ip_adapter_image": [_image(1), _image(2)]} if family == "flux" else {}
    before = _hook_count(pipe.transformer)
    registered: list[str] = []

    def counting(real):
        def register(module, *args, **kw):
            registered.append(type(module).__name__)
            return real(module, *args, **kw)

        return register

    with nw_processor(pipe, mode=mode, nulls=False) as rec:
        generate(pipe, **kwargs)  # the first call registers the taps
        tapped = _hook_count(pipe.transformer)
        with monkeypatch.context() as patch:
            for name in ("register_forward_hook", "register_forward_pre_hook"):
                patch.setattr(torch.nn.Module, name, counting(getattr(torch.nn.Module, name)))
            generate(pipe, **kwargs)
        assert registered == []  # no hook registered during the second call
        assert _hook_count(pipe.transformer) == tapped > before + 1  # the step tracker's and the taps
        assert rec.taps and all(not t.armed and t.branch is None for t in rec.taps)
        if mode == "observe":
            assert {r["call"] for r in rec.to_records()} == {0, 1}
    assert _hook_count(pipe.transformer) == before  # detach removed the taps
