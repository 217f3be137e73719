"""Step tracking of NWRecorder: step labels and noise levels from the scheduler, passes within a step.

Driven by small sampling loops written like diffusers' pipelines (Flux, SD3, img2img, PNDM)
around a stand-in denoiser, so each scheduler convention is checked without a model: every
forward must carry the scheduler's own step index i, the timestep ``scheduler.timesteps[i]`` and
the scheduler's own noise level at that step (``sigmas[i]``, or ``alphas_cumprod[t]``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    PNDMScheduler,
)

from nw_adapter.integration.recorder import NWRecorder

SD15 = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}


class KeywordDenoiser(torch.nn.Module):
    """Transformer-like forward: ``timestep`` is a keyword after other inputs."""

    def forward(self, hidden_states, encoder_hidden_states=None, pooled_projections=None, timestep=None):
        return 0.9 * hidden_states


class PositionalDenoiser(torch.nn.Module):
    """UNet-like forward ``(sample, timestep, encoder_hidden_states)``, called positionally."""

    def forward(self, sample, timestep, encoder_hidden_states=None):
        return 0.9 * sample


def _attach(scheduler, denoiser, **kwargs) -> tuple[NWRecorder, list]:
    """A recorder on ``denoiser`` with ``scheduler``; returns it and the list of states seen."""
    rec = NWRecorder(pipe=SimpleNamespace(scheduler=scheduler))
    rec.tracker.attach(denoiser, **kwargs)
    seen: list = []
    denoiser.register_forward_hook(lambda *_: seen.append(replace(rec.state)))
    return rec, seen


def _flow_level(scheduler, i: int) -> tuple[float, float, float, float]:
    s = float(scheduler.sigmas[i])
    return float(scheduler.timesteps[i]), 1 - s, s, (s / (1 - s) if s < 1 else math.inf)


def _vp_level(scheduler, t: float) -> tuple[float, float]:
    abar = float(scheduler.alphas_cumprod[int(t)])
    return math.sqrt(abar), math.sqrt(1 - abar)


@pytest.mark.parametrize(
    ("scheduler_kwargs", "set_kwargs"),
    [({"shift": 3.0}, {}), ({"use_dynamic_shifting": True}, {"mu": 1.15})],
    ids=["shifted", "dynamic_shifting"],
)
def test_flux_true_cfg_is_one_step_with_two_passes(scheduler_kwargs, set_kwargs):
    scheduler = FlowMatchEulerDiscreteScheduler(**scheduler_kwargs)
    scheduler.set_timesteps(4, **set_kwargs)
    denoiser = KeywordDenoiser()
    rec, seen = _attach(scheduler, denoiser, timestep_scale=1000)
    latents = torch.randn(1, 4, 2, 2)
    scheduler.set_begin_index(0)  # as FluxPipeline does
    for t in scheduler.timesteps:
        timestep = t.expand(1).to(torch.bfloat16)  # Flux: latents' dtype, then / 1000
        pos = denoiser(hidden_states=latents, timestep=timestep / 1000)
        neg = denoiser(hidden_states=latents, timestep=timestep / 1000)
        latents = scheduler.step(neg + 2.0 * (pos - neg), t, latents).prev_sample
    assert [(s.step, s.pass_index) for s in seen] == [(i, p) for i in range(4) for p in (0, 1)]
    for s in seen:
        assert s.call == 0
        assert (s.timestep, s.alpha, s.sigma, s.h) == pytest.approx(_flow_level(scheduler, s.step))
    assert sorted(rec.tracker.steps) == [(0, i) for i in range(4)]


@pytest.mark.parametrize("begin", [0, 3])
def test_sd3_style_loop_without_begin_index(begin):
    """SD3 passes ``timestep`` in [0, 1000] as a keyword, in the latents' dtype; img2img starts late."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(6)
    denoiser = KeywordDenoiser()
    rec, seen = _attach(scheduler, denoiser)
    latents = torch.randn(1, 4, 2, 2)
    if begin:
        scheduler.set_begin_index(begin)  # as StableDiffusion3Img2ImgPipeline does
    for t in scheduler.timesteps[begin:]:
        out = denoiser(hidden_states=latents, encoder_hidden_states=None, timestep=t.expand(1).half())
        latents = scheduler.step(out, t, latents).prev_sample
    assert [s.step for s in seen] == list(range(begin, 6))
    assert all(s.pass_index == 0 for s in seen)
    for s in seen:
        assert (s.timestep, s.alpha, s.sigma, s.h) == pytest.approx(_flow_level(scheduler, s.step))


@pytest.mark.parametrize("cls", [DDIMScheduler, EulerDiscreteScheduler, DPMSolverMultistepScheduler])
@pytest.mark.parametrize("strength", [0.3, 0.5, 1.0])
def test_img2img_loop_gets_the_row_of_its_timestep(cls, strength):
    """The issue's case: 10 steps, strength < 1, the loop starts at step 10 - int(10 * strength)."""
    scheduler = cls(**SD15)
    scheduler.set_timesteps(10)
    t_start = 10 - int(10 * strength)
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(t_start)
    denoiser = PositionalDenoiser()
    rec, seen = _attach(scheduler, denoiser)
    latents = torch.randn(2, 4, 2, 2)
    for t in scheduler.timesteps[t_start:]:
        x = scheduler.scale_model_input(latents, t)
        latents = scheduler.step(denoiser(x, t), t, latents).prev_sample
    assert [s.step for s in seen] == list(range(t_start, 10))
    for s in seen:
        assert s.timestep == float(scheduler.timesteps[s.step])
        if cls is DDIMScheduler:
            assert (s.alpha, s.sigma) == pytest.approx(_vp_level(scheduler, s.timestep))
        else:
            sig = float(scheduler.sigmas[s.step])
            assert s.h == pytest.approx(sig)
            assert s.alpha == pytest.approx(1 / math.sqrt(1 + sig**2))


def test_issue_numbers_ddim_strength_half():
    """DDIM, 10 steps, strength 0.5: at t = 401 the level is alpha 0.65 (h 1.16), not step 0's."""
    scheduler = DDIMScheduler(**SD15, steps_offset=1, set_alpha_to_one=False)
    scheduler.set_timesteps(10)
    denoiser = PositionalDenoiser()
    rec, seen = _attach(scheduler, denoiser)
    for t in scheduler.timesteps[5:]:
        denoiser(torch.zeros(1, 4, 2, 2), t)
    first = seen[0]
    assert (first.step, first.timestep) == (5, 401.0)
    assert first.alpha == pytest.approx(0.652, abs=2e-3)
    assert first.h == pytest.approx(1.16, abs=0.01)


def test_pndm_repeated_timestep_is_a_step_of_its_own():
    scheduler = PNDMScheduler(**SD15, skip_prk_steps=True)
    scheduler.set_timesteps(3)
    denoiser = PositionalDenoiser()
    rec, seen = _attach(scheduler, denoiser)
    latents = torch.randn(1, 4, 2, 2)
    for t in scheduler.timesteps:
        latents = scheduler.step(denoiser(latents, t), t, latents).prev_sample
    timesteps = scheduler.timesteps.tolist()
    assert len(set(timesteps)) < len(timesteps)  # the repeat is there
    assert [s.step for s in seen] == list(range(len(timesteps)))
    assert [s.timestep for s in seen] == [float(t) for t in timesteps]
    assert all(s.pass_index == 0 for s in seen)


def test_second_forward_at_the_same_timestep_is_a_second_pass():
    """A scheduler without a step index (DDIM): the timestep repeats only within a step."""
    scheduler = DDIMScheduler(**SD15)
    scheduler.set_timesteps(3)
    denoiser = PositionalDenoiser()
    rec, seen = _attach(scheduler, denoiser)
    x = torch.zeros(1, 4, 2, 2)
    for t in scheduler.timesteps:
        denoiser(x, t)
        denoiser(x, t)
    assert [(s.step, s.pass_index) for s in seen] == [(i, p) for i in range(3) for p in (0, 1)]


def test_new_call_restarts_and_off_table_timesteps_count_forwards():
    scheduler = DDIMScheduler(**SD15)
    denoiser = PositionalDenoiser()
    rec, seen = _attach(scheduler, denoiser)
    x = torch.zeros(1, 4, 2, 2)
    for n in (3, 2):
        scheduler.set_timesteps(n)  # a new tensor: a new call
        for t in scheduler.timesteps:
            denoiser(x, t)
    assert [(s.call, s.step) for s in seen] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    denoiser(x, torch.tensor(123))  # off the table: next forward count, level from alphas_cumprod
    assert (seen[-1].call, seen[-1].step) == (1, 2)
    assert (seen[-1].alpha, seen[-1].sigma) == pytest.approx(_vp_level(scheduler, 123))


def test_bare_denoiser_without_scheduler_counts_forwards():
    denoiser = PositionalDenoiser()
    rec = NWRecorder()
    rec.tracker.attach(denoiser)
    seen = []
    denoiser.register_forward_hook(lambda *_: seen.append(replace(rec.state)))
    for t in (900, 500):
        denoiser(torch.zeros(1, 4, 2, 2), torch.tensor(t))
    rec.new_call()
    denoiser(torch.zeros(1, 4, 2, 2), torch.tensor(900))
    assert [(s.call, s.step) for s in seen] == [(0, 0), (0, 1), (1, 0)]
    assert all(math.isnan(s.alpha) for s in seen)


def test_attach_rejects_bad_timestep_scale():
    with pytest.raises(ValueError, match="timestep_scale"):
        NWRecorder().tracker.attach(PositionalDenoiser(), timestep_scale=0)


def _host_reads_from_recorder(monkeypatch) -> list[str]:
    """Count Tensor -> host conversions whose caller is the recorder module."""
    import sys

    from nw_adapter.integration import recorder as recorder_module

    reads: list[str] = []
    for name in ("__float__", "__int__", "__bool__", "item", "tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, __name=name, __original=original, **kwargs):
            if sys._getframe(1).f_code.co_filename == recorder_module.__file__:
                reads.append(__name)
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return reads


@pytest.mark.parametrize("cls", [EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler])
def test_no_host_read_per_step_with_a_scheduler_step_index(cls, monkeypatch):
    """With the scheduler's own step index the pre-hook reads no timestep (no GPU sync per step)."""
    scheduler = cls(**SD15) if cls is EulerDiscreteScheduler else cls(shift=3.0)
    scheduler.set_timesteps(4)
    denoiser = KeywordDenoiser()
    rec, seen = _attach(scheduler, denoiser)
    latents = torch.randn(1, 4, 2, 2)
    reads = _host_reads_from_recorder(monkeypatch)
    for i, t in enumerate(scheduler.timesteps):
        x = scheduler.scale_model_input(latents, t) if cls is EulerDiscreteScheduler else latents
        if i == 1:
            reads.clear()  # the first forward may read (new call: the table, the first index)
        latents = scheduler.step(denoiser(hidden_states=x, timestep=t.expand(1)), t, latents).prev_sample
    assert [s.step for s in seen] == [0, 1, 2, 3]
    assert reads == []
