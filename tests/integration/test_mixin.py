"""Installing and removing the NW processors: mixin, functional API, context manager."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline
from diffusers.models.attention_processor import AttnProcessor2_0, IPAdapterAttnProcessor2_0
from tiny_helpers import SIZE
from tiny_helpers import generate as _run

from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.errors import NWConfigError, NWInstallError
from nw_adapter.integration.mixin import (
    active_recorder,
    apply_nw_processor,
    ip_adapter_layers,
    nw_processor,
    remove_nw_processor,
)
from nw_adapter.integration.processors import is_nw_processor
from nw_adapter.models.tiny import ip_adapter_weight_name
from nw_adapter.pipelines.pipeline_stable_diffusion_nw import StableDiffusionNWPipeline


@pytest.fixture(scope="module")
def folders(tiny_sd15_dir, tiny_ip_adapter_dir):
    return tiny_sd15_dir, tiny_ip_adapter_dir


def _pipe(folders, cls=StableDiffusionNWPipeline, load=True):
    model_dir, ip_dir = folders
    pipe = cls.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    if load:
        pipe.load_ip_adapter(ip_dir, subfolder="models", weight_name=ip_adapter_weight_name("base"))
    return pipe


@pytest.fixture(scope="module")
def pipe(folders):
    return _pipe(folders)


def test_before_load_ip_adapter_is_clear_error(folders):
    bare = _pipe(folders, load=False)
    with pytest.raises(ValueError, match="load_ip_adapter"):
        bare.set_ip_adapter_nw_processor()
    assert not any(is_nw_processor(p) for p in bare.unet.attn_processors.values())


def test_set_twice_does_not_double_wrap_and_unset_restores_exactly(pipe):
    before = dict(pipe.unet.attn_processors)
    rec1 = pipe.set_ip_adapter_nw_processor(mode="observe")
    rec2 = pipe.set_ip_adapter_nw_processor(mode="swap", bandwidth=2.0)
    assert rec1 is not rec2 and pipe.nw_recorder is rec2
    for name, proc in pipe.unet.attn_processors.items():
        if isinstance(before[name], IPAdapterAttnProcessor2_0):
            assert is_nw_processor(proc) and proc.nw_config.mode == "swap"
            assert proc.to_k_ip is before[name].to_k_ip  # wraps the original, not the first NW processor
        else:
            assert proc is before[name]
    assert len(pipe.unet._forward_pre_hooks) == 1
    assert pipe.unset_ip_adapter_nw_processor() is rec2
    after = pipe.unet.attn_processors
    assert all(after[n] is before[n] for n in before)
    assert not pipe.unet._forward_pre_hooks
    assert pipe.unset_ip_adapter_nw_processor() is None  # idempotent


def test_set_ip_adapter_scale_keeps_working(pipe):
    pipe.set_ip_adapter_scale(0.3)
    stock_03 = _run(pipe)
    pipe.set_ip_adapter_scale(1.0)
    rec = pipe.set_ip_adapter_nw_processor(mode="observe")
    pipe.set_ip_adapter_scale(0.3)
    observed_03 = _run(pipe)
    pipe.unset_ip_adapter_nw_processor()
    assert np.array_equal(stock_03, observed_03)
    assert {r["scale"] for r in rec.to_records()} == {0.3}
    assert all(p.scale == [0.3] for p in pipe.unet.attn_processors.values() if hasattr(p, "scale"))
    pipe.set_ip_adapter_scale(1.0)


def test_unload_ip_adapter_keeps_working(folders):
    p = _pipe(folders)
    p.set_ip_adapter_nw_processor(mode="observe")
    p.unload_ip_adapter()
    assert not any(is_nw_processor(x) for x in p.unet.attn_processors.values())
    assert p.unset_ip_adapter_nw_processor() is not None
    assert all(type(x) is AttnProcessor2_0 for x in p.unet.attn_processors.values())
    out = p("a cat", num_inference_steps=1, height=SIZE, width=SIZE, output_type="np").images
    assert out.shape == (1, SIZE, SIZE, 3)


def test_layers_option_selects_layers(pipe):
    rec = pipe.set_ip_adapter_nw_processor(layers=["mid_block", "up_blocks"])
    _run(pipe)
    pipe.unset_ip_adapter_nw_processor()
    assert {r["block"] for r in rec.to_records()} == {"mid", "up"}
    with pytest.raises(ValueError, match="`layers` entry 'nowhere'"):
        pipe.set_ip_adapter_nw_processor(layers=["nowhere"])
    assert pipe.nw_recorder is None


def test_config_object_and_errors(pipe):
    with pytest.raises(ValueError, match="either `config` or keyword"):
        pipe.set_ip_adapter_nw_processor(NWProcessorConfig(), mode="swap")
    with pytest.raises(ValueError, match="`bandwith`"):
        pipe.set_ip_adapter_nw_processor(bandwith=2.0)
    with pytest.raises(ValueError, match="NWProcessorConfig"):
        pipe.set_ip_adapter_nw_processor({"mode": "swap"})
    rec = pipe.set_ip_adapter_nw_processor(NWProcessorConfig(mode="swap", bandwidth=3.0))
    assert rec.config.bandwidth == 3.0
    pipe.unset_ip_adapter_nw_processor()


def test_functional_api_and_context_manager_on_stock_pipeline(folders):
    stock = _pipe(folders, cls=StableDiffusionPipeline)
    before = dict(stock.unet.attn_processors)
    ref = _run(stock)
    rec = apply_nw_processor(stock, mode="observe", steps=[0])
    assert active_recorder(stock) is rec
    assert np.array_equal(ref, _run(stock))
    assert remove_nw_processor(stock) is rec
    assert {r["step"] for r in rec.to_records()} == {0}
    with nw_processor(stock, mode="swap") as rec2:
        swapped = _run(stock)
        assert active_recorder(stock) is rec2
    assert not np.array_equal(ref, swapped)
    assert all(stock.unet.attn_processors[n] is before[n] for n in before)
    assert ip_adapter_layers(stock) == [n for n in before if n.endswith("attn2.processor")]


def test_apply_on_bare_unet(pipe):
    before = dict(pipe.unet.attn_processors)
    rec = apply_nw_processor(pipe.unet, cfg=True, layers="mid_block")
    _run(pipe)
    rec.new_call()
    _run(pipe)
    remove_nw_processor(pipe.unet)
    records = rec.to_records()
    assert {r["half"] for r in records} == {"uncond", "cond"}
    n_steps = len(pipe.scheduler.timesteps)
    assert {(r["call"], r["step"]) for r in records} == {(c, s) for c in (0, 1) for s in range(n_steps)}
    assert all(pipe.unet.attn_processors[n] is before[n] for n in before)
    with pytest.raises(ValueError, match="no `unet`"):
        apply_nw_processor(object())


def test_the_schedule_rule_on_a_bare_denoiser_is_refused_at_install(pipe):
    """bandwidth="schedule" reads sigma_t / alpha_t from the pipeline's scheduler: on the bare UNet
    (no scheduler) it is one NWInstallError at install naming the fix, and nothing changes (before, it
    was accepted and swap failed at the first forward, observe recorded no step)."""
    before = dict(pipe.unet.attn_processors)
    for mode in ("swap", "observe"):
        with pytest.raises(
            NWInstallError, match=r"bandwidth='schedule' needs the scheduler.*apply_nw_processor\(pipe"
        ):
            apply_nw_processor(pipe.unet, mode=mode, bandwidth="schedule")
        assert all(pipe.unet.attn_processors[n] is before[n] for n in before)
        assert not pipe.unet._forward_pre_hooks
    # on the pipeline it runs: every step has its bandwidth h = sigma_t / alpha_t
    with nw_processor(pipe, bandwidth="schedule", layers="mid_block", nulls=False) as rec:
        _run(pipe)
    assert rec.to_records() and all(np.isfinite(r["bandwidth"]) for r in rec.to_records())


@pytest.mark.parametrize("rule", ["matched", "fitted", "median", 0.5])
def test_the_other_rules_need_no_scheduler(pipe, rule):
    """Every other bandwidth rule runs on the bare UNet, in swap (the image changes) and observe
    (every step recorded)."""
    stock = _run(pipe)
    with nw_processor(pipe.unet, mode="swap", bandwidth=rule, layers="mid_block"):
        swapped = _run(pipe)
    assert not np.array_equal(stock, swapped)
    with nw_processor(pipe.unet, mode="observe", bandwidth=rule, layers="mid_block", nulls=False) as rec:
        _run(pipe)
    assert {r["step"] for r in rec.to_records()} == set(range(len(pipe.scheduler.timesteps)))
    assert rec.failed_steps_line(see=None) is None


def test_schedule_c_without_the_schedule_rule_is_refused():
    """schedule_c is read by bandwidth="schedule" only: with another rule it would be ignored."""
    with pytest.raises(NWConfigError, match="schedule_c.*bandwidth='schedule'"):
        NWProcessorConfig(bandwidth="matched", schedule_c=2.0)
    assert NWProcessorConfig(bandwidth="schedule", schedule_c=2.0).schedule_c == 2.0
    assert NWProcessorConfig(bandwidth="fitted", schedule_c=1.0).bandwidth == "fitted"  # the default


def test_xformers_ip_processors_get_a_clear_error(pipe):
    from diffusers.models.attention_processor import IPAdapterXFormersAttnProcessor

    p = pipe
    before = dict(p.unet.attn_processors)
    procs = {}
    for name, proc in p.unet.attn_processors.items():
        if isinstance(proc, IPAdapterAttnProcessor2_0):
            x = IPAdapterXFormersAttnProcessor.__new__(IPAdapterXFormersAttnProcessor)
            torch.nn.Module.__init__(x)
            procs[name] = x
        else:
            procs[name] = proc
    p.unet.set_attn_processor(procs)
    try:
        with pytest.raises(ValueError, match="xFormers"):
            p.set_ip_adapter_nw_processor()
    finally:
        p.unet.set_attn_processor(dict(before))
