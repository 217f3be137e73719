"""Every UNet pipeline with IP-Adapter, through diffusers' stock classes on tiny models (issue 12).

For each pipeline (img2img, inpainting, ControlNet, SDXL base and the ``denoising_end`` /
``denoising_start`` split, LCM, AnimateDiff, PAG): observe returns the stock output bit for bit
(``torch.equal``) and every record carries the scheduler's own noise level at the timestep the
UNet received. Also: the LCM IP-mask case of diffusers' ``IPAdapterTesterMixin`` (item 5) in
observe and swap, and observe returning the stock image when the side computation fails (item 6).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from diffusers import (
    AnimateDiffPipeline,
    ControlNetModel,
    DDIMScheduler,
    LatentConsistencyModelPipeline,
    LCMScheduler,
    MotionAdapter,
    StableDiffusionControlNetPipeline,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionPAGPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from diffusers.image_processor import IPAdapterMaskProcessor
from PIL import Image
from tiny_helpers import SIZE, check_recorded_levels, random_image, record_denoiser_timesteps

from nw_adapter.integration import stats
from nw_adapter.integration.mixin import nw_processor
from nw_adapter.integration.processors import is_nw_processor
from nw_adapter.models.tiny import ip_adapter_weight_name

STEPS = 2


def _with_ip_adapter(pipe, ip_folder, *, sdxl=False):
    pipe.set_progress_bar_config(disable=True)
    if not getattr(pipe.unet, "encoder_hid_proj", None):
        pipe.load_ip_adapter(
            ip_folder,
            subfolder="sdxl_models" if sdxl else "models",
            weight_name=ip_adapter_weight_name("base", sdxl=sdxl),
        )
    return pipe


@pytest.fixture(scope="module")
def sd15(tiny_sd15_dir, tiny_ip_adapter_dir):
    return _with_ip_adapter(StableDiffusionPipeline.from_pretrained(tiny_sd15_dir), tiny_ip_adapter_dir)


@pytest.fixture(scope="module")
def sdxl(tiny_sdxl_dir, tiny_ip_adapter_dir):
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir)
    return _with_ip_adapter(pipe, tiny_ip_adapter_dir, sdxl=True)


def _call(pipe, **kwargs):
    kwargs.setdefault("ip_adapter_image", random_image(1))
    kwargs.setdefault("num_inference_steps", STEPS)
    kwargs.setdefault("output_type", "pt")
    kwargs.setdefault("height", SIZE)
    kwargs.setdefault("width", SIZE)
    out = pipe("a cat", generator=torch.Generator().manual_seed(0), **kwargs)
    return out.frames if hasattr(out, "frames") else out.images


def _observe_equals_stock(pipe, **kwargs):
    """Stock call, then the same call in observe; returns the recorder after the checks."""
    stock = _call(pipe, **kwargs)
    seen, handle = record_denoiser_timesteps(pipe.unet)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="NWRecorder")  # nothing may be skipped
            with nw_processor(pipe, mode="observe", nulls=False) as rec:
                observed = _call(pipe, **kwargs)
    finally:
        handle.remove()
    assert torch.equal(stock, observed)
    assert rec.skipped()["count"] == 0
    check_recorded_levels(rec.to_records(), pipe.scheduler, seen)
    return rec


def test_img2img(sd15):
    pipe = StableDiffusionImg2ImgPipeline.from_pipe(sd15)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    rec = _observe_equals_stock(pipe, image=random_image(7), strength=0.5, num_inference_steps=4)
    assert min(r["step"] for r in rec.to_records()) == 2


def test_img2img_strength_is_a_setting_of_the_records(sd15):
    """Two img2img calls of another strength (4 steps: the loop begins at step 2 or at step 0) are
    different settings, named ``start_step`` and nothing else; two calls of the same strength over
    different input images are one setting."""
    from nw_adapter.integration.settings import SETTINGS_FIELD, differing_settings

    pipe = StableDiffusionImg2ImgPipeline.from_pipe(sd15)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    digests = []
    with nw_processor(pipe, mode="observe", nulls=False, readings=False) as rec:
        for image, strength in ((7, 0.5), (8, 0.5), (7, 1.0)):
            _call(pipe, image=random_image(image), strength=strength, num_inference_steps=4)
        records = rec.to_records()
    for call in range(3):
        of_call = {r[SETTINGS_FIELD] for r in records if r["call"] == call}
        assert len(of_call) == 1
        digests.append(of_call.pop())
    assert [min(r["step"] for r in records if r["call"] == c) for c in range(3)] == [2, 2, 0]
    assert digests[0] == digests[1]
    assert differing_settings([digests[0], digests[2]]) == ["start_step"]
    assert rec.tracker.call_settings_of(0)["start_step"] == 2
    assert rec.tracker.call_settings_of(2)["start_step"] == 0


def test_inpainting(sd15):
    pipe = StableDiffusionInpaintPipeline.from_pipe(sd15)
    mask = np.zeros((SIZE, SIZE), dtype="uint8")
    mask[:, SIZE // 2 :] = 255
    _observe_equals_stock(pipe, image=random_image(7), mask_image=Image.fromarray(mask), strength=0.7)


def test_controlnet(sd15):
    torch.manual_seed(0)
    config = sd15.unet.config
    controlnet = ControlNetModel(
        in_channels=config.in_channels,
        down_block_types=config.down_block_types,
        block_out_channels=config.block_out_channels,
        layers_per_block=config.layers_per_block,
        cross_attention_dim=config.cross_attention_dim,
        attention_head_dim=config.attention_head_dim,
        norm_num_groups=config.norm_num_groups,
        conditioning_embedding_out_channels=(16, 32),  # downsamples by 2, the tiny VAE's factor
    )
    pipe = StableDiffusionControlNetPipeline.from_pipe(sd15, controlnet=controlnet)
    rec = _observe_equals_stock(pipe, image=random_image(9))
    assert {r["half"] for r in rec.to_records()} == {"uncond", "cond"}


def test_sdxl_base_and_split(sdxl):
    _observe_equals_stock(sdxl)
    _observe_equals_stock(sdxl, denoising_end=0.5, output_type="latent", num_inference_steps=4)
    refiner = StableDiffusionXLImg2ImgPipeline.from_pipe(sdxl)
    latents = torch.randn(1, 4, SIZE // 2, SIZE // 2, generator=torch.Generator().manual_seed(3))
    rec = _observe_equals_stock(refiner, image=latents, denoising_start=0.5, num_inference_steps=4)
    assert sorted({r["step"] for r in rec.to_records()}) == [2, 3]


def _lcm(sd15):
    torch.manual_seed(0)  # LCM's UNet embeds the guidance scale: time_cond_proj_dim
    unet = UNet2DConditionModel.from_config({**sd15.unet.config, "time_cond_proj_dim": 32})
    pipe = LatentConsistencyModelPipeline.from_pipe(
        sd15, unet=unet, scheduler=LCMScheduler.from_config(sd15.scheduler.config)
    )
    return pipe


def test_lcm(sd15, tiny_ip_adapter_dir):
    pipe = _with_ip_adapter(_lcm(sd15), tiny_ip_adapter_dir)
    rec = _observe_equals_stock(pipe, num_inference_steps=3)
    assert {r["half"] for r in rec.to_records()} == {"all"}  # LCM: no classifier-free guidance


@pytest.mark.parametrize("mode", ["observe", "swap"])
def test_lcm_ip_mask_with_cfg_layout_embeds(sd15, tiny_ip_adapter_dir, mode):
    """diffusers' test_ip_adapter_masks on LCM: 2 embed rows (CFG layout) for a batch of 1, a mask."""
    pipe = _with_ip_adapter(_lcm(sd15), tiny_ip_adapter_dir)
    pipe.set_ip_adapter_scale(0.7)
    half = np.zeros((SIZE, SIZE), dtype="uint8")
    half[:, : SIZE // 2] = 255
    mask = IPAdapterMaskProcessor().preprocess([Image.fromarray(half)], height=SIZE, width=SIZE)
    embeds = torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(0))
    kwargs = {
        "ip_adapter_image": None,
        "ip_adapter_image_embeds": [embeds],
        "cross_attention_kwargs": {"ip_adapter_masks": [mask.reshape(1, 1, SIZE, SIZE)]},
    }
    stock = _call(pipe, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="NWRecorder")
        with nw_processor(pipe, mode=mode, statistics=True, nulls=False) as rec:
            out = _call(pipe, **kwargs)
    assert torch.equal(out, stock) == (mode == "observe")
    assert torch.isfinite(out).all()
    assert {r["num_keys"] for r in rec.to_records()} == {2 * 4}  # both rows' 4 tokens, as stock


def test_animatediff_frames_in_the_batch(sd15, tiny_ip_adapter_dir):
    torch.manual_seed(0)
    adapter = MotionAdapter(
        block_out_channels=(32, 64), motion_layers_per_block=1, motion_num_attention_heads=2
    )
    pipe = AnimateDiffPipeline.from_pipe(sd15, motion_adapter=adapter)
    pipe.scheduler = DDIMScheduler.from_config(sd15.scheduler.config, beta_schedule="linear")
    pipe = _with_ip_adapter(pipe, tiny_ip_adapter_dir)
    rec = _observe_equals_stock(pipe, num_frames=3)
    records = rec.to_records()
    assert {r["half"] for r in records} == {"uncond", "cond"}
    assert {r["num_keys"] for r in records} == {4}


def test_pag_keeps_its_own_processors(sd15):
    pipe = StableDiffusionPAGPipeline.from_pipe(sd15, pag_applied_layers=["mid"])
    during: list[dict] = []

    def look(p, i, t, kw):
        during.append(dict(p.unet.attn_processors))
        return kw

    rec = _observe_equals_stock(pipe, pag_scale=2.0, callback_on_step_end=look)
    procs = during[-1]  # the observe call's processors, mid-call
    mid = {n: type(p).__name__ for n, p in procs.items() if n.startswith("mid_block")}
    assert any("PAG" in name for name in mid.values()), mid
    assert all(is_nw_processor(p) for n, p in procs.items() if n.endswith("attn2.processor"))
    assert not any(is_nw_processor(p) for n, p in procs.items() if n.endswith("attn1.processor"))
    # batch [uncond; cond; perturbed]: the perturbed rows are their own half, identical to the cond
    # rows before PAG's perturbed layer (down blocks) and different after it (up blocks)
    records = rec.to_records()
    assert {r["half"] for r in records} == {"uncond", "cond", "perturbed"}
    q = {(r["half"], r["step"], r["layer"], r["head"]): r["q_norm"] for r in records}
    for (half, *key), value in q.items():
        if half == "perturbed":
            assert (value == q[("cond", *key)]) == key[1].startswith("down_blocks"), key


def test_observe_returns_the_stock_image_when_the_side_computation_fails(sd15, monkeypatch, tmp_path):
    stock = _call(sd15)

    def broken(*args, **kwargs):
        raise FloatingPointError("injected")

    monkeypatch.setattr(stats, "softmax_statistics", broken)
    with pytest.warns(RuntimeWarning, match="NW side computation failed") as caught:
        with nw_processor(sd15, mode="observe") as rec:
            observed = _call(sd15)
    assert torch.equal(stock, observed)
    assert len([w for w in caught if "NWRecorder" in str(w.message)]) == 1
    n_layers = sum(1 for n in sd15.unet.attn_processors if n.endswith("attn2.processor"))
    forwards = len(sd15.scheduler.timesteps)  # PNDM: one UNet forward per entry
    assert rec.skipped()["count"] == n_layers * forwards
    assert rec.to_records() == []
    payload = json.loads(rec.to_json(tmp_path / "rho.json").read_text())
    assert payload["skipped"]["count"] == n_layers * forwards


def test_a_failing_step_tracker_does_not_fail_the_generation(sd15, monkeypatch):
    from nw_adapter.integration import steps as steps_module

    def broken(scheduler):
        raise KeyError("schedule table")

    monkeypatch.setattr(steps_module, "schedule_table", broken)
    stock = _call(sd15)
    with pytest.warns(RuntimeWarning, match="step tracking"):
        with nw_processor(sd15, mode="observe") as rec:
            observed = _call(sd15)
    assert torch.equal(stock, observed)
    assert rec.skipped()["count"] >= 1
    assert {p["layer"] for p in rec.skipped()["pairs"]} == {"step tracking"}
