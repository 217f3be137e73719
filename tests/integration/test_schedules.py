"""Noise levels of diffusers schedulers in VP terms (alpha_t, sigma_t, h_t = sigma_t / alpha_t)."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EDMEulerScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    PNDMScheduler,
    UniPCMultistepScheduler,
)

from nw_adapter.integration.schedules import noise_level, schedule_table

SD15 = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
}


@pytest.mark.parametrize("cls", [DDIMScheduler, PNDMScheduler])
def test_vp_from_alphas_cumprod(cls):
    s = cls(**SD15)
    s.set_timesteps(4)
    for row in schedule_table(s):
        abar = float(s.alphas_cumprod[int(row["timestep"])])
        assert row["alpha"] == pytest.approx(math.sqrt(abar))
        assert row["sigma"] == pytest.approx(math.sqrt(1 - abar))
        assert row["h"] == pytest.approx(math.sqrt((1 - abar) / abar))


def test_paper_bandwidths_sd15():
    s = DDIMScheduler(**SD15)
    hs = [noise_level(s, t)[2] for t in (981, 761, 501, 261, 1)]
    assert hs == pytest.approx([13.1, 4.30, 1.62, 0.725, 0.041], rel=0.02)


def test_fractional_timestep_interpolates():
    s = DDIMScheduler(**SD15)
    a0, a1, mid = (noise_level(s, t)[0] ** 2 for t in (10, 11, 10.5))
    assert mid == pytest.approx((a0 + a1) / 2)


@pytest.mark.parametrize("karras", [False, True])
@pytest.mark.parametrize("cls", [EulerDiscreteScheduler, DPMSolverMultistepScheduler])
def test_sigma_schedulers_use_their_sigmas(cls, karras):
    s = cls(**SD15, use_karras_sigmas=karras)
    s.set_timesteps(5)
    rows = schedule_table(s)
    assert [r["timestep"] for r in rows] == s.timesteps.double().tolist()
    for i, row in enumerate(rows):
        sig = float(s.sigmas[i])
        assert row["h"] == pytest.approx(sig)
        assert row["alpha"] == pytest.approx(1 / math.sqrt(1 + sig**2))
        assert row["alpha"] ** 2 + row["sigma"] ** 2 == pytest.approx(1.0)
    # without a step index the timestep is looked up
    assert noise_level(s, float(s.timesteps[2]))[2] == pytest.approx(float(s.sigmas[2]))


def test_euler_matches_vp_alphas_cumprod():
    s = EulerDiscreteScheduler(**SD15, timestep_spacing="leading", steps_offset=1)
    s.set_timesteps(5)
    for i, t in enumerate(s.timesteps.tolist()):
        abar = float(s.alphas_cumprod[int(round(t))])
        assert noise_level(s, t, i)[0] == pytest.approx(math.sqrt(abar), rel=1e-4)


def test_flow_matching_convention():
    s = FlowMatchEulerDiscreteScheduler()
    s.set_timesteps(4)
    alpha, sigma, h = noise_level(s, float(s.timesteps[1]), 1)
    sig = float(s.sigmas[1])
    assert (alpha, sigma) == pytest.approx((1 - sig, sig))
    assert h == pytest.approx(sig / (1 - sig))


@pytest.mark.parametrize(
    "make",
    [
        lambda: FlowMatchEulerDiscreteScheduler(shift=3.0),
        lambda: UniPCMultistepScheduler(
            use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0
        ),
        lambda: DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction"),
    ],
    ids=["flow_match_shifted", "unipc_flow_sigmas", "dpm_flow_sigmas"],
)
def test_flow_sigmas_are_flow_matching_even_with_alphas_cumprod(make):
    s = make()
    s.set_timesteps(4)
    for row in schedule_table(s)[1:]:
        sig = float(s.sigmas[row["step"]])
        assert (row["alpha"], row["sigma"], row["h"]) == pytest.approx((1 - sig, sig, sig / (1 - sig)))


def test_edm_sigmas_are_variance_exploding():
    s = EDMEulerScheduler()
    s.set_timesteps(4)
    for row in schedule_table(s):
        sig = float(s.sigmas[row["step"]])
        assert row["h"] == pytest.approx(sig)
        assert row["alpha"] == pytest.approx(1 / math.sqrt(1 + sig**2))


def test_unknown_scheduler_gives_nan():
    class Bare:
        timesteps = torch.tensor([3, 2])

    assert all(math.isnan(v) for v in noise_level(Bare(), 3))
