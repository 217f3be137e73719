"""The end-to-end untrained-adapter control (nw_adapter.integration.end_to_end).

A second generation of the same call with the untrained adapter in every layer: the swap is exact
and restored (also after an exception); the control pass runs the untrained adapter in every
layer, so later layers' queries are the untrained branch's own; the trained pass is a plain
observe call; the merged columns align row by row; a pure gain on the image tokens has, with scale
matching, a control equal to the trained pass (and without it, one that differs).
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline
from flow_helpers import load_flux, load_sd3
from tiny_helpers import SIZE, load_sd15, random_image

from nw_adapter.integration.end_to_end import (
    MATCHED,
    build_untrained_draw,
    end_to_end_control,
    head_scales,
    untrained_adapter_swapped,
)
from nw_adapter.integration.errors import NWConfigError, NWInstallError
from nw_adapter.integration.mixin import apply_nw_processor, nw_processor, remove_nw_processor

torch.set_num_threads(1)

STATS = ("rho", "kl", "key_norm_cv", "qk_spread_ratio", "r2_key", "r2_nw", "kl_nw_fit", "kl_key_prior",
         "nw_gain", "h_eff")  # fmt: skip
KEY = ("call", "step", "layer", "head", "half", "adapter", "image", "key_set")


@pytest.fixture(scope="module")
def sd15(tiny_sd15_dir, tiny_ip_adapter_dir):
    return load_sd15(tiny_sd15_dir, tiny_ip_adapter_dir, "base")


def _kwargs(steps: int = 2, seed: int = 0) -> dict:
    return dict(
        prompt="a cat", ip_adapter_image=random_image(1), num_inference_steps=steps, height=SIZE,
        width=SIZE, output_type="pt", generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip


def _state_bytes(module: torch.nn.Module) -> dict[str, bytes]:
    return {k: v.detach().cpu().numpy().tobytes() for k, v in module.state_dict().items()}


def _ip_layers(unet) -> dict:
    return {n: p for n, p in unet.attn_processors.items() if getattr(p, "to_k_ip", None) is not None}


def _attn(unet, name):
    return unet.get_submodule(name.removesuffix(".processor"))


def test_stock_generation_is_reproducible(sd15) -> None:
    first = sd15(**_kwargs()).images
    second = sd15(**_kwargs()).images
    assert torch.equal(first, second)


def test_swap_is_exact_and_restored_also_after_an_exception(sd15) -> None:
    unet = sd15.unet
    before_bytes = _state_bytes(unet)
    processors = dict(unet.attn_processors)
    projection = unet.encoder_hid_proj
    modules = {n: (list(p.to_k_ip), list(p.to_v_ip)) for n, p in _ip_layers(unet).items()}
    stock = sd15(**_kwargs()).images
    with untrained_adapter_swapped(sd15, seed=0) as draw:
        assert unet.encoder_hid_proj is draw.adapter.image_projection
        for name, processor in _ip_layers(unet).items():  # untrained in every IP layer
            attn = _attn(unet, name)
            assert torch.equal(processor.to_k_ip[0].weight, attn.to_k.weight)
            assert torch.equal(processor.to_v_ip[0].weight, attn.to_v.weight)
            assert processor.to_k_ip[0] is not modules[name][0][0]
        swapped = sd15(**_kwargs()).images
    assert not torch.equal(swapped, stock)
    with pytest.raises(RuntimeError, match="boom"), untrained_adapter_swapped(sd15, seed=1):
        raise RuntimeError("boom")
    assert unet.encoder_hid_proj is projection
    assert all(unet.attn_processors[n] is p for n, p in processors.items())
    for name, processor in _ip_layers(unet).items():
        assert list(processor.to_k_ip) == modules[name][0] and list(processor.to_v_ip) == modules[name][1]
    assert _state_bytes(unet) == before_bytes
    assert torch.equal(sd15(**_kwargs()).images, stock)
    sd15.set_ip_adapter_scale(0.5)  # set_ip_adapter_scale still reaches the processors
    try:
        assert all(p.scale == [0.5] for p in _ip_layers(unet).values())
        assert not torch.equal(sd15(**_kwargs()).images, stock)
    finally:
        sd15.set_ip_adapter_scale(1.0)


def test_swap_refuses_installed_processors(sd15) -> None:
    apply_nw_processor(sd15)
    try:
        with pytest.raises(NWInstallError, match="swap the adapter first"), untrained_adapter_swapped(sd15):
            pass
        with pytest.raises(NWInstallError, match="remove the installed NW processors"):
            end_to_end_control(sd15, _kwargs())
    finally:
        remove_nw_processor(sd15)


def _queries_of(unet, layer: str, into: list):
    """A forward hook on the layer's to_q keeping every query it produces."""
    return _attn(unet, layer).to_q.register_forward_hook(lambda m, a, out: into.append(out.detach().clone()))


def test_control_pass_runs_the_untrained_adapter_in_every_layer(sd15) -> None:
    unet = sd15.unet
    names = list(_ip_layers(unet))
    first, last = names[0], names[-1]
    trained_q: list = []
    trained_first: list = []
    handles = [_queries_of(unet, last, trained_q), _queries_of(unet, first, trained_first)]
    try:
        with nw_processor(sd15) as rec:
            plain = sd15(**_kwargs()).images
    finally:
        for h in handles:
            h.remove()
    plain_records = _by_key(rec.to_records(key_set=None))
    seen_weights: list[bool] = []

    def check(module, args, kwargs):  # every denoiser forward of the control pass
        layers = _ip_layers(unet)
        seen_weights.append(all(
            torch.equal(p.to_k_ip[0].weight, _attn(unet, n).to_k.weight) for n, p in layers.items()
        ))  # fmt: skip

    pass_q: list = []
    pass_first: list = []
    handles = [
        unet.register_forward_pre_hook(check, with_kwargs=True),
        _queries_of(unet, last, pass_q),
        _queries_of(unet, first, pass_first),
    ]
    try:
        result = end_to_end_control(sd15, _kwargs(), draws=1, scale_match=False)
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(result.trained_output.images, plain)  # the trained pass is a plain observe call
    for record in result.records:
        twin = plain_records[tuple(record.get(key) for key in KEY)]
        assert all(record[s] == twin[s] for s in STATS if not math.isnan(twin[s]))
    steps = len(trained_q)
    # the end-to-end pass: trained queries first, then the control's (2 steps: 2 forwards each)
    assert seen_weights[:steps] == [False] * steps and seen_weights[steps:] == [True] * steps
    assert all(torch.equal(a, b) for a, b in zip(pass_q[:steps], trained_q, strict=True))
    control_q = pass_q[steps:]
    # the last layer's queries are the untrained branch's own: a stock generation with the
    # untrained adapter swapped in gives them, and they differ from the trained queries
    swapped_q: list = []
    handle = _queries_of(unet, last, swapped_q)
    try:
        with untrained_adapter_swapped(sd15, seed=0):
            control_image = sd15(**_kwargs()).images
    finally:
        handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(control_q, swapped_q, strict=True))
    assert torch.equal(result.control_outputs[0].images, control_image)
    assert not torch.equal(control_q[-1], trained_q[-1])
    # the first IP layer at the first step: no image branch has acted yet, so the same queries
    assert torch.equal(pass_first[steps], trained_first[0])
    assert not torch.equal(pass_first[-1], trained_first[-1])  # the next step's: shaped by the branch
    differs = [r["key_norm_cv"] != r["key_norm_cv_control_0"] for r in result.records]
    assert all(differs)
    assert result.control["kind"] == "end-to-end" and result.control["matched"] is None


def test_generator_state_is_that_of_one_plain_call(sd15) -> None:
    plain = _kwargs()
    sd15(**plain)
    kwargs = _kwargs()
    global_before = torch.get_rng_state()
    end_to_end_control(sd15, kwargs, draws=2)
    assert torch.equal(kwargs["generator"].get_state(), plain["generator"].get_state())
    assert torch.equal(torch.get_rng_state(), global_before)  # the tiny call draws nothing globally


def _by_key(records):
    return {tuple(r.get(k) for k in KEY): r for r in records}


def test_merged_columns_align_row_by_row(sd15) -> None:
    result = end_to_end_control(sd15, _kwargs(), draws=2, seed=5)
    assert result.unmatched == [0, 0]
    assert result.control["seeds"] == [5, 6] and result.control["draws"] == 2
    assert result.control["matched"] == MATCHED
    for k in range(2):
        draw = build_untrained_draw(sd15, seed=5 + k)
        embeds: list = []
        hook = sd15.unet.encoder_hid_proj.register_forward_pre_hook(
            lambda m, a, into=embeds: into.append(a[0])
        )
        with nw_processor(sd15):
            sd15(**_kwargs())
        hook.remove()
        keys, values, by_half = head_scales(sd15, draw, embeds[0], cfg=True)
        with untrained_adapter_swapped(sd15, draw=draw, key_scales=keys, value_scales=values):
            with nw_processor(sd15) as rec:
                sd15(**_kwargs())
        control = _by_key(rec.to_records(key_set=None))
        assert len(control) == len(result.records)
        for record in result.records:
            twin = control[tuple(record.get(key) for key in KEY)]
            for stat in STATS:
                assert record[f"{stat}_control_{k}"] == twin[stat] or (
                    math.isnan(record[f"{stat}_control_{k}"]) and math.isnan(twin[stat])
                )
            ratio = by_half[record["layer"], record["adapter"], record["half"]][record["head"]]
            assert record[f"key_scale_{k}"] == float(ratio)
    assert {r["half"] for r in result.records} == {"uncond", "cond"}


def _set_pure_gain_adapter(pipe, gain: float) -> None:
    """The pipeline's adapter := the draw-0 initialisation, its image tokens multiplied by ``gain``
    (the projection's output LayerNorm's weight and bias times gain)."""
    draw = build_untrained_draw(pipe, seed=0)
    projection = pipe.unet.encoder_hid_proj
    projection.load_state_dict(draw.adapter.image_projection.state_dict())
    norm = projection.image_projection_layers[0].norm
    with torch.no_grad():
        norm.weight.mul_(gain)
        norm.bias.mul_(gain)
        for name, processor in _ip_layers(pipe.unet).items():
            attn = _attn(pipe.unet, name)
            processor.to_k_ip[0].weight.copy_(attn.to_k.weight)
            processor.to_v_ip[0].weight.copy_(attn.to_v.weight)


@pytest.mark.parametrize("gain", [0.5, 1.4, 2.0])
def test_pure_gain_has_a_control_equal_to_the_trained_pass_when_scale_matched(
    tiny_sd15_dir, tiny_ip_adapter_dir, gain
) -> None:
    pipe = load_sd15(tiny_sd15_dir, tiny_ip_adapter_dir, "base")
    _set_pure_gain_adapter(pipe, gain)
    matched = end_to_end_control(pipe, _kwargs(), draws=1, seed=0)
    for record in matched.records:
        assert record["key_scale_0"] == pytest.approx(gain, rel=1e-5)
        for stat in STATS:
            assert record[f"{stat}_control_0"] == pytest.approx(record[stat], rel=1e-3, abs=1e-4), stat
    raw = end_to_end_control(pipe, _kwargs(), draws=1, seed=0, scale_match=False)
    gaps = [abs(r["kl_control_0"] - r["kl"]) for r in raw.records]
    assert max(gaps) > 1e-3  # unmatched, the gain's change of scale shows


def test_bad_arguments_are_one_line_errors(sd15) -> None:
    with pytest.raises(NWConfigError, match="draws must be an int >= 1"):
        end_to_end_control(sd15, _kwargs(), draws=0)
    with pytest.raises(NWConfigError, match="seed must be an int >= 0"):
        end_to_end_control(sd15, _kwargs(), seed=-1)
    with pytest.raises(NWConfigError, match="mode must be 'observe'"):
        end_to_end_control(sd15, _kwargs(), recorder_config={"mode": "swap"})
    with pytest.raises(NWConfigError, match="untrained_control must be False"):
        end_to_end_control(sd15, _kwargs(), recorder_config={"untrained_control": True})


def test_flux_end_to_end_control(tiny_flux_dir, tiny_flux_ip_adapter_dir) -> None:
    pipe = load_flux(FluxPipeline, tiny_flux_dir, tiny_flux_ip_adapter_dir)
    kwargs = dict(
        prompt="a cat", ip_adapter_image=random_image(1, 32), num_inference_steps=2, height=32, width=32,
        output_type="pt", max_sequence_length=16, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    before = _state_bytes(pipe.transformer)
    with nw_processor(pipe):
        plain = pipe(**dict(kwargs, generator=torch.Generator().manual_seed(0))).images
    result = end_to_end_control(pipe, kwargs, draws=1)
    assert torch.equal(result.trained_output.images, plain)
    assert result.unmatched == [0] and result.records
    layers = _ip_layers(pipe.transformer)
    same = all(
        p.to_k_ip[0].weight.shape == _attn(pipe.transformer, n).to_k.weight.shape for n, p in layers.items()
    )
    assert result.control["keys_copied"] is same  # the real Flux: 4096 -> 3072 against 3072 x 3072
    assert all(math.isfinite(r["key_scale_0"]) for r in result.records if r["half"] == "cond")
    assert _state_bytes(pipe.transformer) == before


def test_sd3_is_refused_naming_the_limit(tiny_sd3_dir, tiny_sd3_ip_adapter_dir) -> None:
    pipe = load_sd3(StableDiffusion3Pipeline, tiny_sd3_dir, tiny_sd3_ip_adapter_dir)
    with pytest.raises(NWInstallError, match="cannot run on Stable Diffusion 3 / 3.5: .* per-head RMSNorm"):
        end_to_end_control(pipe, dict(prompt="a cat", ip_adapter_image=random_image(1, 32)))


def test_plus_adapter_end_to_end_control(tiny_sd15_dir, tiny_ip_adapter_dir) -> None:
    pipe = load_sd15(tiny_sd15_dir, tiny_ip_adapter_dir, "plus")
    before = _state_bytes(pipe.unet)
    with nw_processor(pipe):
        plain = pipe(**_kwargs()).images
    result = end_to_end_control(pipe, _kwargs(), draws=1)
    assert torch.equal(result.trained_output.images, plain)
    assert result.unmatched == [0]
    assert not torch.equal(result.control_outputs[0].images, plain)
    assert _state_bytes(pipe.unet) == before
