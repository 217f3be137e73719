"""Recorded noise levels on truncated schedules, through diffusers' stock pipelines (issue 10 item 2).

img2img and inpainting with ``strength`` < 1 and the SDXL base + refiner-style split
(``denoising_end`` then ``denoising_start``) run only part of ``scheduler.timesteps``. Every record
must carry the timestep the UNet received, its index in ``scheduler.timesteps`` as the step, and
the scheduler's own noise level there: ``alphas_cumprod[t]`` for DDIM / PNDM, ``sigmas[i]`` for
Euler / DPM-Solver++ (whose h = sigma_t / alpha_t is exactly that sigma).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLPipeline,
)
from PIL import Image
from tiny_helpers import SIZE, check_recorded_levels, random_image, record_denoiser_timesteps

from nw_adapter.integration.mixin import nw_processor
from nw_adapter.models.tiny import ip_adapter_weight_name

SCHEDULERS = [DDIMScheduler, EulerDiscreteScheduler, DPMSolverMultistepScheduler, PNDMScheduler]
STEPS = 4


def _load(cls, folder, ip_folder, *, sdxl=False):
    pipe = cls.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_ip_adapter(
        ip_folder,
        subfolder="sdxl_models" if sdxl else "models",
        weight_name=ip_adapter_weight_name("base", sdxl=sdxl),
    )
    return pipe


@pytest.fixture(scope="module")
def img2img(tiny_sd15_dir, tiny_ip_adapter_dir):
    return _load(StableDiffusionImg2ImgPipeline, tiny_sd15_dir, tiny_ip_adapter_dir)


@pytest.fixture(scope="module")
def sdxl_base(tiny_sdxl_dir, tiny_ip_adapter_dir):
    return _load(StableDiffusionXLPipeline, tiny_sdxl_dir, tiny_ip_adapter_dir, sdxl=True)


def _run_and_check(pipe, scheduler_cls, **call):
    original = pipe.scheduler
    pipe.scheduler = scheduler_cls.from_config(original.config)
    seen, handle = record_denoiser_timesteps(pipe.unet)
    try:
        with nw_processor(pipe, layers=["mid_block"], nulls=False) as rec:
            pipe(
                "a cat",
                ip_adapter_image=random_image(1),
                num_inference_steps=STEPS,
                output_type="latent",
                generator=torch.Generator().manual_seed(0),
                **call,
            )
        check_recorded_levels(rec.to_records(), pipe.scheduler, seen)
    finally:
        handle.remove()
        pipe.scheduler = original
    return rec, seen


@pytest.mark.parametrize("scheduler_cls", SCHEDULERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("strength", [0.3, 0.5, 1.0])
def test_img2img_records_the_scheduler_level_at_each_step(img2img, scheduler_cls, strength):
    rec, seen = _run_and_check(img2img, scheduler_cls, image=random_image(7), strength=strength)
    steps = sorted({r["step"] for r in rec.to_records()})
    if scheduler_cls is not PNDMScheduler:  # PNDM repeats a timestep: its index there is ambiguous
        assert steps == list(range(STEPS - int(STEPS * strength), STEPS))


@pytest.mark.parametrize("scheduler_cls", [DDIMScheduler, EulerDiscreteScheduler])
def test_inpainting_records_the_scheduler_level_at_each_step(img2img, scheduler_cls):
    pipe = StableDiffusionInpaintPipeline.from_pipe(img2img)
    mask = np.zeros((SIZE, SIZE), dtype="uint8")
    mask[:, SIZE // 2 :] = 255
    rec, _ = _run_and_check(
        pipe, scheduler_cls, image=random_image(7), mask_image=Image.fromarray(mask), strength=0.5
    )
    assert min(r["step"] for r in rec.to_records()) == STEPS // 2


@pytest.mark.parametrize(
    "scheduler_cls", [DDIMScheduler, EulerDiscreteScheduler, DPMSolverMultistepScheduler]
)
def test_sdxl_base_then_refiner_split(sdxl_base, scheduler_cls):
    rec_base, seen_base = _run_and_check(sdxl_base, scheduler_cls, denoising_end=0.5)
    refiner = StableDiffusionXLImg2ImgPipeline.from_pipe(sdxl_base)
    refiner.set_progress_bar_config(disable=True)
    latents = torch.randn(1, 4, SIZE // 2, SIZE // 2, generator=torch.Generator().manual_seed(3))
    rec_ref, seen_ref = _run_and_check(refiner, scheduler_cls, image=latents, denoising_start=0.5)
    base_steps = sorted({r["step"] for r in rec_base.to_records()})
    ref_steps = sorted({r["step"] for r in rec_ref.to_records()})
    assert base_steps[0] == 0 and ref_steps[0] > 0
    assert base_steps + ref_steps == list(range(STEPS))  # the two halves tile the schedule
