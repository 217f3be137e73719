"""StepTracker on its own (the recorder's step tracking, tests/integration/test_step_tracking.py,
drives it through NWRecorder): host reads, the call serial that reseeds the nulls, failures."""

from __future__ import annotations

import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

from nw_adapter.integration import steps as steps_module
from nw_adapter.integration.recorder import NWRecorder
from nw_adapter.integration.steps import StepTracker

torch.set_num_threads(1)
SD15 = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}


class Denoiser(torch.nn.Module):
    def forward(self, hidden_states, timestep=None):
        return 0.9 * hidden_states


def _host_reads_from_steps(monkeypatch) -> list[str]:
    """Tensor -> host conversions whose caller is the steps module (where tracking now lives)."""
    reads: list[str] = []
    for name in ("__float__", "__int__", "__bool__", "item", "tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, __name=name, __original=original, **kwargs):
            if sys._getframe(1).f_code.co_filename == steps_module.__file__:
                reads.append(__name)
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return reads


def _loop(scheduler, tracker: StepTracker, denoiser: torch.nn.Module, reads: list[str]) -> list:
    seen: list = []
    handle = denoiser.register_forward_hook(lambda *_: seen.append(replace(tracker.state)))
    latents = torch.randn(1, 4, 2, 2)
    for i, t in enumerate(scheduler.timesteps):
        if i == 1:
            reads.clear()  # the first forward of a call may read (the table, the first index)
        out = denoiser(hidden_states=latents, timestep=t.expand(1))
        latents = scheduler.step(out, t, latents).prev_sample
    handle.remove()
    return seen


@pytest.mark.parametrize("cls", [EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler])
def test_no_host_read_in_the_tracker_with_a_scheduler_step_index(cls, monkeypatch):
    scheduler = cls(**SD15) if cls is EulerDiscreteScheduler else cls(shift=3.0)
    scheduler.set_timesteps(4)
    tracker = StepTracker(SimpleNamespace(scheduler=scheduler))
    denoiser = Denoiser()
    tracker.attach(denoiser)
    reads = _host_reads_from_steps(monkeypatch)
    seen = _loop(scheduler, tracker, denoiser, reads)
    assert [s.step for s in seen] == [0, 1, 2, 3]
    assert reads == []


def test_the_spy_sees_the_reads_of_a_scheduler_without_step_index(monkeypatch):
    """DDIM has no step index: the timestep is read once per forward, in the steps module."""
    scheduler = DDIMScheduler(**SD15)
    scheduler.set_timesteps(4)
    tracker = StepTracker(SimpleNamespace(scheduler=scheduler))
    denoiser = Denoiser()
    tracker.attach(denoiser)
    reads = _host_reads_from_steps(monkeypatch)
    seen = _loop(scheduler, tracker, denoiser, reads)
    assert [s.step for s in seen] == [0, 1, 2, 3]
    assert len(reads) == 3  # one per forward after the first


def test_call_serial_advances_once_per_call_and_reseeds_the_nulls():
    rec = NWRecorder()
    rec.begin_step(call=0, step=0)
    serial = rec.tracker.call_serial
    first = rec.generator(torch.device("cpu")).initial_seed()
    rec.begin_step(call=0, step=1)
    assert rec.tracker.call_serial == serial
    assert rec.generator(torch.device("cpu")).initial_seed() == first
    rec.begin_step(call=1, step=0)
    assert rec.tracker.call_serial == serial + 1
    assert rec.generator(torch.device("cpu")).initial_seed() == (first + 1_000_003) % 2**63


def _broken_table(scheduler):
    raise KeyError("schedule table")


FORWARD = {"hidden_states": torch.zeros(1, 4, 2, 2), "timestep": torch.tensor([999])}


def test_a_failing_forward_is_the_next_step_and_reported(monkeypatch):
    monkeypatch.setattr(steps_module, "schedule_table", _broken_table)
    errors: list[tuple[str, str]] = []
    pipe = SimpleNamespace(scheduler=SimpleNamespace(timesteps=torch.tensor([999, 500])))
    tracker = StepTracker(pipe, on_error=lambda where, error: errors.append((where, str(error))))
    tracker.begin_step(call=0, step=4, cfg=True)
    tracker._pre_hook(Denoiser(), (), FORWARD)
    assert (tracker.state.call, tracker.state.step, tracker.state.cfg) == (0, 5, True)
    assert errors == [("step tracking", "'schedule table'")]


def test_without_on_error_a_tracking_failure_raises(monkeypatch):
    monkeypatch.setattr(steps_module, "schedule_table", _broken_table)
    tracker = StepTracker(SimpleNamespace(scheduler=SimpleNamespace(timesteps=torch.tensor([999]))))
    with pytest.raises(KeyError, match="schedule table"):
        tracker._pre_hook(Denoiser(), (), FORWARD)
