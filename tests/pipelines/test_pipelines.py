"""Whole-pipeline behaviour of the NW processors on the tiny SD 1.5 and SDXL models.

Must-show items of issue 3: observe is bit-identical to stock for every IP-Adapter feature;
swap changes the image and unset brings the stock image back; step labels equal the
scheduler's timesteps; CFG halves are separate; an exception restores the processors;
companion pipelines load by from_pretrained, from_pipe and custom_pipeline.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DiffusionPipeline,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
)
from diffusers.image_processor import IPAdapterMaskProcessor
from PIL import Image
from tiny_helpers import SIZE
from tiny_helpers import generate as _run
from tiny_helpers import random_image as _image

from nw_adapter.integration.mixin import nw_processor
from nw_adapter.integration.processors import is_nw_processor
from nw_adapter.models.tiny import ip_adapter_weight_name
from nw_adapter.pipelines.pipeline_stable_diffusion_nw import StableDiffusionNWPipeline
from nw_adapter.pipelines.pipeline_stable_diffusion_xl_nw import StableDiffusionXLNWPipeline

ROOT = Path(__file__).resolve().parents[2]


def _masks() -> list[torch.Tensor]:
    left = np.zeros((SIZE, SIZE), dtype="uint8")
    left[:, : SIZE // 2] = 255
    proc = IPAdapterMaskProcessor()
    m0 = proc.preprocess([Image.fromarray(left)], height=SIZE, width=SIZE)
    m1 = proc.preprocess([Image.fromarray(255 - left), Image.fromarray(left)], height=SIZE, width=SIZE)
    return [m.reshape(1, m.shape[0], SIZE, SIZE) for m in (m0, m1)]


@pytest.fixture(scope="module")
def sd15(tiny_sd15_dir, tiny_ip_adapter_dir):
    pipe = StableDiffusionNWPipeline.from_pretrained(tiny_sd15_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_ip_adapter(
        tiny_ip_adapter_dir,
        subfolder="models",
        weight_name=[ip_adapter_weight_name("base"), ip_adapter_weight_name("plus")],
    )
    return pipe


@pytest.fixture(scope="module")
def sdxl(tiny_sdxl_dir, tiny_ip_adapter_dir):
    pipe = StableDiffusionXLNWPipeline.from_pretrained(tiny_sdxl_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_ip_adapter(
        tiny_ip_adapter_dir,
        subfolder="sdxl_models",
        weight_name=[ip_adapter_weight_name("base", sdxl=True), ip_adapter_weight_name("plus", sdxl=True)],
    )
    return pipe


# feature -> (call kwargs, scale passed to set_ip_adapter_scale)
FEATURES = {
    "two_adapters_plus": (lambda: {"ip_adapter_image": [_image(1), _image(2)]}, [0.8, 0.6]),
    "images_per_adapter": (lambda: {"ip_adapter_image": [_image(1), [_image(2), _image(3)]]}, [0.8, 0.6]),
    "ip_masks": (
        lambda: {
            "ip_adapter_image": [[_image(1)], [_image(2), _image(3)]],
            "cross_attention_kwargs": {"ip_adapter_masks": _masks()},
        },
        [0.7, [0.5, 0.9]],
    ),
    "instantstyle_layer_scales": (
        lambda: {"ip_adapter_image": [_image(1), _image(2)]},
        [{"up": {"block_1": [1.0]}}, {"down": 0.5, "mid": 0.0}],
    ),
    "scale_zero": (lambda: {"ip_adapter_image": [_image(1), _image(2)]}, [0.0, 0.0]),
}


def _check_observe_identity(pipe, feature: str) -> None:
    kwargs, scale = FEATURES[feature]
    pipe.set_ip_adapter_scale(scale)
    stock = _run(pipe, **kwargs())
    rec = pipe.set_ip_adapter_nw_processor(mode="observe", bandwidth="matched")
    try:
        observed = _run(pipe, **kwargs())
    finally:
        pipe.unset_ip_adapter_nw_processor()
        pipe.set_ip_adapter_scale([1.0, 1.0])
    assert np.array_equal(stock, observed), f"observe changed the image for {feature}"
    records = rec.to_records()
    assert records and {r["adapter"] for r in records} == {0, 1}
    if feature == "ip_masks":
        assert {(r["adapter"], r["image"]) for r in records} == {(0, 0), (1, 0), (1, 1)}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_observe_bit_identical_sd15(sd15, feature):
    _check_observe_identity(sd15, feature)


@pytest.mark.parametrize("feature", ["images_per_adapter", "ip_masks", "instantstyle_layer_scales"])
def test_observe_bit_identical_sdxl(sdxl, feature):
    _check_observe_identity(sdxl, feature)


def test_observe_bit_identical_single_plus_adapter(tiny_sd15_dir, tiny_ip_adapter_dir):
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd15_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_ip_adapter(tiny_ip_adapter_dir, subfolder="models", weight_name=ip_adapter_weight_name("plus"))
    stock = _run(pipe)
    with nw_processor(pipe, mode="observe") as rec:
        observed = _run(pipe)
    assert np.array_equal(stock, observed)
    assert {r["num_keys"] for r in rec.to_records()} == {16}


def test_swap_changes_image_and_unset_restores(sd15):
    sd15.set_ip_adapter_scale([1.0, 0.0])
    kwargs = {"ip_adapter_image": [_image(1), _image(2)]}
    stock = _run(sd15, **kwargs)
    sd15.set_ip_adapter_nw_processor(mode="swap", bandwidth="matched")
    swapped = _run(sd15, **kwargs)
    sd15.set_ip_adapter_nw_processor(mode="swap", bandwidth="matched", layers=["up_blocks"])
    swapped_up = _run(sd15, **kwargs)
    sd15.set_ip_adapter_nw_processor(mode="swap", bandwidth="matched", steps=[1])
    swapped_late = _run(sd15, **kwargs)
    sd15.unset_ip_adapter_nw_processor()
    back = _run(sd15, **kwargs)
    sd15.set_ip_adapter_scale([1.0, 1.0])
    assert not np.array_equal(stock, swapped)
    assert not np.array_equal(swapped, swapped_up) and not np.array_equal(stock, swapped_up)
    assert not np.array_equal(swapped, swapped_late) and not np.array_equal(stock, swapped_late)
    assert np.array_equal(stock, back)


@pytest.mark.parametrize(
    "scheduler_cls", [DDIMScheduler, PNDMScheduler, EulerDiscreteScheduler, DPMSolverMultistepScheduler]
)
def test_step_labels_equal_scheduler_timesteps(sd15, scheduler_cls):
    from nw_adapter.integration.schedules import noise_level

    original = sd15.scheduler
    sd15.scheduler = scheduler_cls.from_config(original.config)
    try:
        rec = sd15.set_ip_adapter_nw_processor(layers=["mid_block"], nulls=False)
        _run(sd15, steps=3, ip_adapter_image=[_image(1), _image(2)])
        _run(sd15, steps=2, ip_adapter_image=[_image(1), _image(2)])
        timesteps = sd15.scheduler.timesteps.tolist()
    finally:
        sd15.unset_ip_adapter_nw_processor()
        sd15.scheduler = original
    records = rec.to_records()
    for call, n in ((0, None), (1, len(timesteps))):
        labels = {}
        for r in records:
            if r["call"] == call:
                labels[r["step"]] = r["timestep"]
        got = [labels[s] for s in sorted(labels)]
        if n is not None:
            assert got == [float(t) for t in timesteps]
        else:
            assert len(got) >= 3
    fresh = scheduler_cls.from_config(original.config)
    fresh.set_timesteps(2)
    for r in records:
        if r["call"] == 1:
            alpha, sigma, h = noise_level(fresh, r["timestep"], r["step"])
            assert (r["alpha"], r["sigma"], r["h_schedule"]) == pytest.approx((alpha, sigma, h))


def test_pndm_has_repeated_step(sd15):
    assert isinstance(sd15.scheduler, PNDMScheduler)
    rec = sd15.set_ip_adapter_nw_processor(layers=["mid_block"], nulls=False)
    try:
        _run(sd15, steps=3, ip_adapter_image=[_image(1), _image(2)])
    finally:
        sd15.unset_ip_adapter_nw_processor()
    steps = sorted({(r["step"], r["timestep"]) for r in rec.to_records()})
    assert [t for _, t in steps] == [float(t) for t in sd15.scheduler.timesteps]
    assert len(steps) == 4  # PLMS repeats its second timestep


def test_cfg_halves_reported_separately(sd15):
    kwargs = {"ip_adapter_image": [_image(1), _image(2)]}
    rec = sd15.set_ip_adapter_nw_processor(layers=["mid_block"], nulls=False)
    try:
        _run(sd15, **kwargs)
        _run(sd15, guidance_scale=1.0, **kwargs)
    finally:
        sd15.unset_ip_adapter_nw_processor()
    records = rec.to_records()
    assert {r["half"] for r in records if r["call"] == 0} == {"uncond", "cond"}
    assert {r["half"] for r in records if r["call"] == 1} == {"all"}
    by = {(r["half"], r["step"], r["adapter"], r["head"]): r["q_norm"] for r in records if r["call"] == 0}
    assert any(by[("cond", *k[1:])] != by[("uncond", *k[1:])] for k in by if k[0] == "cond")
    rec_forced = sd15.set_ip_adapter_nw_processor(layers=["mid_block"], nulls=False, cfg=False)
    try:
        _run(sd15, **kwargs)  # CFG batch, but cfg=False reports the whole batch as one half
    finally:
        sd15.unset_ip_adapter_nw_processor()
    assert {r["half"] for r in rec_forced.to_records()} == {"all"}
    # summary is per (call, step, half)
    keys = {(s["call"], s["step"], s["half"]) for s in rec.summary()}
    assert keys == {(r["call"], r["step"], r["half"]) for r in records}


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_interrupted_call_keeps_the_processors_and_drops_its_partial_records(sd15, error):
    """Processors stay where the user put them (DAAM-style hooks): a call that raises or is
    interrupted (Ctrl-C) drops only its own partial records, with one warning; the next call
    records normally, and unset restores the exact originals."""
    before = dict(sd15.unet.attn_processors)
    rec = sd15.set_ip_adapter_nw_processor(mode="observe", store_maps=True)
    kwargs = {"ip_adapter_image": [_image(1), _image(2)]}
    try:
        _run(sd15, **kwargs)  # call 0: complete

        def boom(pipe, i, t, kw):
            if i == 1:
                raise error("stop at step 1")
            return kw

        with pytest.warns(RuntimeWarning, match=f"raised {error.__name__}; its \\d+ partial record"):
            with pytest.raises(error, match="stop at step 1"):
                _run(sd15, callback_on_step_end=boom, **kwargs)  # call 1: interrupted
        assert sum(is_nw_processor(p) for p in sd15.unet.attn_processors.values()) > 0
        assert sd15.nw_recorder is rec
        assert {r["call"] for r in rec.to_records()} == {0}  # call 1's partial records dropped
        assert all(name.startswith("call0/") for name in rec.maps())
        # no per-call hook is left: the only hooks are the processors' taps (registered once,
        # disarmed between calls; removed with the processors, checked after unset below)
        assert rec.taps and all(not t.armed and t.branch is None and not t.captured for t in rec.taps)
        tapped = {id(h.hooks_dict_ref()) for t in rec.taps for h in t.handles}
        inner = [m for m in sd15.unet.modules() if m is not sd15.unet]
        assert all(id(m._forward_hooks) in tapped for m in inner if m._forward_hooks)
        _run(sd15, **kwargs)  # call 2 records again
        assert {r["call"] for r in rec.to_records()} == {0, 2}
    finally:
        sd15.unset_ip_adapter_nw_processor()
    after = sd15.unet.attn_processors
    assert all(after[n] is before[n] for n in before)
    assert sd15.nw_recorder is None
    assert not sd15.unet._forward_pre_hooks
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in sd15.unet.modules())  # taps removed


def test_context_manager_restores_on_exception_for_stock_pipeline(tiny_sd15_dir, tiny_ip_adapter_dir):
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd15_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_ip_adapter(tiny_ip_adapter_dir, subfolder="models", weight_name=ip_adapter_weight_name("base"))
    before = dict(pipe.unet.attn_processors)

    def boom(pipe, i, t, kw):
        raise KeyError("x")

    with pytest.raises(KeyError), nw_processor(pipe, mode="observe"):
        _run(pipe, callback_on_step_end=boom)
    assert all(pipe.unet.attn_processors[n] is before[n] for n in before)


def test_from_pipe_both_ways(sd15):
    stock = StableDiffusionPipeline.from_pipe(sd15)
    assert not hasattr(stock, "set_ip_adapter_nw_processor")
    kwargs = {"ip_adapter_image": [_image(1), _image(2)]}
    ref = _run(stock, **kwargs)
    nw = StableDiffusionNWPipeline.from_pipe(stock)
    rec = nw.set_ip_adapter_nw_processor(mode="observe", layers=["mid_block"])
    try:
        out = _run(nw, **kwargs)
    finally:
        nw.unset_ip_adapter_nw_processor()
    assert np.array_equal(ref, out) and len(rec.to_records()) > 0


def test_sdxl_from_pipe_and_swap(sdxl):
    stock = StableDiffusionXLPipeline.from_pipe(sdxl)
    kwargs = {"ip_adapter_image": [_image(1), _image(2)]}
    ref = _run(stock, **kwargs)
    with nw_processor(stock, mode="swap", bandwidth="median"):
        swapped = _run(stock, **kwargs)
    assert not np.array_equal(ref, swapped)
    assert np.array_equal(ref, _run(StableDiffusionXLNWPipeline.from_pipe(stock), **kwargs))


@pytest.mark.parametrize(
    ("file", "cls_name"),
    [
        ("pipeline_stable_diffusion_nw.py", "StableDiffusionNWPipeline"),
        ("pipeline_stable_diffusion_xl_nw.py", "StableDiffusionXLNWPipeline"),
    ],
)
def test_custom_pipeline_file(tiny_sd15_dir, tiny_sdxl_dir, file, cls_name, tmp_path, monkeypatch):
    import diffusers.utils.dynamic_modules_utils as dyn

    monkeypatch.setattr(dyn, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    folder = tiny_sdxl_dir if "xl" in file else tiny_sd15_dir
    pipe = DiffusionPipeline.from_pretrained(
        folder, custom_pipeline=str(ROOT / "pipelines" / file), trust_remote_code=True
    )
    assert type(pipe).__name__ == cls_name
    assert hasattr(pipe, "set_ip_adapter_nw_processor")
