"""Companion SD3 / Flux pipelines: from_pretrained, from_pipe both ways, custom_pipeline files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline, FluxPipeline, StableDiffusion3Pipeline
from flow_helpers import generate, load_flux, load_sd3

from nw_adapter.integration.processors import is_nw_processor
from nw_adapter.pipelines.pipeline_flux_nw import FluxNWPipeline
from nw_adapter.pipelines.pipeline_stable_diffusion_3_nw import StableDiffusion3NWPipeline

ROOT = Path(__file__).resolve().parents[2]

FAMILIES = {
    "sd3": (
        StableDiffusion3Pipeline,
        StableDiffusion3NWPipeline,
        load_sd3,
        "pipeline_stable_diffusion_3_nw.py",
    ),
    "flux": (FluxPipeline, FluxNWPipeline, load_flux, "pipeline_flux_nw.py"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_from_pipe_both_ways(request, family):
    stock_cls, nw_cls, load, _ = FAMILIES[family]
    stock = load(stock_cls, request.getfixturevalue(f"tiny_{family}_dir"),
                 request.getfixturevalue(f"tiny_{family}_ip_adapter_dir"))  # fmt: skip
    assert not hasattr(stock, "set_ip_adapter_nw_processor")
    reference = generate(stock)
    nw = nw_cls.from_pipe(stock)
    rec = nw.set_ip_adapter_nw_processor(mode="observe")
    try:
        observed = generate(nw)
    finally:
        nw.unset_ip_adapter_nw_processor()
    assert torch.equal(reference, observed) and len(rec.to_records()) > 0
    back = stock_cls.from_pipe(nw)
    assert type(back) is stock_cls and not any(
        is_nw_processor(p) for p in back.transformer.attn_processors.values()
    )
    assert torch.equal(reference, generate(back))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_custom_pipeline_file(request, family, tmp_path, monkeypatch):
    import diffusers.utils.dynamic_modules_utils as dyn

    _, nw_cls, _, file = FAMILIES[family]
    monkeypatch.setattr(dyn, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    pipe = DiffusionPipeline.from_pretrained(
        request.getfixturevalue(f"tiny_{family}_dir"),
        custom_pipeline=str(ROOT / "pipelines" / file),
        trust_remote_code=True,
    )
    assert type(pipe).__name__ == nw_cls.__name__
    assert hasattr(pipe, "set_ip_adapter_nw_processor")
