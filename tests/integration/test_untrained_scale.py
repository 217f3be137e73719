"""The scale-matched untrained-adapter control with several draws (issue 26, items 1 and 3).

- ``untrained_draws=K`` builds K untrained adapters seeded ``untrained_seed + k`` (they differ) and
  records K sets of ``{X}_control_{k}`` columns with ``key_scale_{k}``; K = 1 works.
- An adapter that is, by construction, the control's own draw-0 initialisation with a scalar gain
  c on its projected image tokens (``to_k_ip = to_k``, the fresh projection's LayerNorm gain c)
  differs from the control in scale only: ``key_scale_0`` is c and every ``{X}_control_0`` equals
  the trained X (shape effect 0), while the unmatched control (the old ``*_untrained`` reading)
  gives a large rho difference.
- SD3 and Flux builds still record K draws.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline
from flow_helpers import generate as generate_flow
from flow_helpers import load_flux, load_sd3
from tiny_helpers import generate, load_sd15

from nw_adapter.analysis.validation import check_records
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.control import UntrainedControl, scale_matched
from nw_adapter.integration.errors import NWConfigError
from nw_adapter.integration.mixin import apply_nw_processor, remove_nw_processor
from nw_adapter.integration.schema import (
    CONTROL_RECORDED,
    control_column,
    control_columns,
    control_draws,
    key_scale_column,
)
from nw_adapter.integration.untrained import build_untrained_adapter

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def sd15(tiny_sd15_dir, tiny_ip_adapter_dir):
    return load_sd15(tiny_sd15_dir, tiny_ip_adapter_dir, "base")


def _observe(pipe, **options) -> list[dict]:
    """Two denoising steps with the control on (``options``: NWProcessorConfig fields)."""
    recorder = apply_nw_processor(pipe, untrained_control=True, **options)
    try:
        if isinstance(pipe, StableDiffusion3Pipeline | FluxPipeline):
            generate_flow(pipe, steps=2)
        else:
            generate(pipe, steps=2)
    finally:
        remove_nw_processor(pipe)
    return recorder.to_records()


def _installed_control(pipe) -> UntrainedControl:
    denoiser = pipe.unet if hasattr(pipe, "unet") else pipe.transformer
    return next(p.untrained_control for p in denoiser.attn_processors.values()
                if getattr(p, "untrained_control", None) is not None)  # fmt: skip


def test_draws_are_seeded_apart_and_every_draw_is_recorded(sd15) -> None:
    recorder = apply_nw_processor(sd15, untrained_control=True, untrained_seed=5, steps=[0])
    control = _installed_control(sd15)
    try:
        generate(sd15, steps=2)
    finally:
        remove_nw_processor(sd15)
    assert control.draws == 3 and control.seeds == [5, 6, 7]  # the default K = 3, seeds s + k
    layer = next(iter(control.adapter.key_projections))
    weights = [a.image_projection.image_projection_layers[0].image_embeds.weight for a in control.adapters]
    assert not torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], weights[2])
    first = control.adapter.key_projections[layer][0].weight
    assert all(torch.equal(a.key_projections[layer][0].weight, first) for a in control.adapters)  # = to_k
    records = recorder.to_records()
    assert records and all(name in r for r in records for name in control_columns(3))
    assert control_draws(records[0]) == 3
    check_records(records, source="test", fix="none")
    assert not any(name.endswith("_untrained") for r in records for name in r)  # the old columns are gone
    # the draws give different control values (another fresh projection each)
    rho = [[r[control_column("rho", k)] for r in records] for k in range(3)]
    assert rho[0] != rho[1] and rho[1] != rho[2]
    assert all(math.isfinite(v) for draw in rho for v in draw)
    assert all(r[key_scale_column(k)] > 0 for r in records for k in range(3))


def test_one_draw_works(sd15) -> None:
    records = _observe(sd15, untrained_draws=1, steps=[0])
    assert records and control_draws(records[0]) == 1
    assert all(control_column("rho", 0) in r and key_scale_column(0) in r for r in records)
    assert not any(control_column("rho", 1) in r for r in records)


@pytest.mark.parametrize("draws", [0, -1, 1.5, True, 65, "3"])
def test_untrained_draws_is_validated(draws) -> None:
    with pytest.raises(NWConfigError, match="untrained_draws"):
        NWProcessorConfig(untrained_control=True, untrained_draws=draws)


def test_default_draws_is_three() -> None:
    assert NWProcessorConfig().untrained_draws == 3


def test_scale_matched_rescales_each_row_and_head_to_the_trained_rms() -> None:
    generator = torch.Generator().manual_seed(0)
    trained = torch.randn(2, 3, 5, 4, generator=generator) * torch.tensor([1.0, 2.0, 3.0])[:, None, None]
    untrained = torch.randn(2, 3, 7, 4, generator=generator)
    matched, ratio = scale_matched(trained, untrained)
    rms = trained.square().sum(-1).mean(-1).sqrt()
    torch.testing.assert_close(matched.square().sum(-1).mean(-1).sqrt(), rms)
    torch.testing.assert_close(ratio, rms / untrained.square().sum(-1).mean(-1).sqrt())
    torch.testing.assert_close(matched / untrained, ratio[..., None, None].expand_as(matched))


def _load_gain_adapter(pipe, seed: int, gain: float) -> None:
    """Make the loaded adapter the control's draw-0 initialisation with a gain ``gain`` on its
    projected image tokens: the fresh projection copied in with its LayerNorm gain set to ``gain``
    (the fresh LayerNorm is the identity, so its output is multiplied by ``gain``), and every
    ``to_k_ip`` (``to_v_ip``) copied from the layer's text ``to_k`` (``to_v``)."""
    untrained = build_untrained_adapter(pipe, seed=seed)
    projection = pipe.unet.encoder_hid_proj.image_projection_layers[0]
    fresh = untrained.image_projection.image_projection_layers[0]
    with torch.no_grad():
        projection.load_state_dict(fresh.state_dict())
        assert torch.equal(projection.norm.weight, torch.ones_like(projection.norm.weight))
        assert torch.equal(projection.norm.bias, torch.zeros_like(projection.norm.bias))
        projection.norm.weight.fill_(gain)
        for name, processor in pipe.unet.attn_processors.items():
            if hasattr(processor, "to_k_ip"):
                attn = pipe.unet.get_submodule(name.removesuffix(".processor"))
                processor.to_k_ip[0].weight.copy_(attn.to_k.weight)
                processor.to_v_ip[0].weight.copy_(attn.to_v.weight)


@pytest.fixture(scope="module")
def gain_pipe(tiny_sd15_dir, tiny_ip_adapter_dir):
    return load_sd15(tiny_sd15_dir, tiny_ip_adapter_dir, "base")


@pytest.mark.parametrize("gain", [0.5, 1.4, 2.0])
def test_a_pure_gain_has_no_shape_effect_and_its_scale_is_the_gain(gain_pipe, gain) -> None:
    seed = 11
    _load_gain_adapter(gain_pipe, seed, gain)
    records = _observe(gain_pipe, untrained_seed=seed, untrained_draws=1, bandwidth="matched")
    assert records
    for r in records:
        assert r[key_scale_column(0)] == pytest.approx(gain, rel=1e-5)
        for stat in CONTROL_RECORDED:
            trained, control = r[stat], r[control_column(stat, 0)]
            if stat == "h_eff" and not (math.isfinite(trained) and math.isfinite(control)):
                assert math.isfinite(trained) == math.isfinite(control), stat
                continue
            assert control == pytest.approx(trained, rel=1e-3, abs=1e-4), stat
    shape_effect = sum(r["rho"] - r[control_column("rho", 0)] for r in records) / len(records)
    assert abs(shape_effect) < 1e-4


def test_without_scale_matching_a_gain_reads_as_a_large_rho_difference(gain_pipe, monkeypatch) -> None:
    """The same run with the rescaling switched off (the old, unmatched control: the
    initialisation's keys as they are): at c = 0.5 the trained rho differs from the control's by
    far more than rounding, though nothing was learned; matched, the difference is 0."""
    from nw_adapter.integration.processors import deferred

    seed = 11
    _load_gain_adapter(gain_pipe, seed, 0.5)
    options = {"untrained_seed": seed, "untrained_draws": 1, "bandwidth": "matched"}
    matched = _observe(gain_pipe, **options)
    # the control's statistics (deferred or per layer) rescale the keys in processors.deferred
    monkeypatch.setattr(deferred, "scale_matched", lambda k, k0: (k0, scale_matched(k, k0)[1]))
    unmatched = _observe(gain_pipe, **options)

    def mean_difference(records: list[dict]) -> float:
        return sum(r["rho"] - r[control_column("rho", 0)] for r in records) / len(records)

    assert abs(mean_difference(matched)) < 1e-4
    assert abs(mean_difference(unmatched)) > 0.05


@pytest.fixture(scope="module", params=["sd3", "flux"])
def flow_pipe(request, tiny_sd3_dir, tiny_sd3_ip_adapter_dir, tiny_flux_dir, tiny_flux_ip_adapter_dir):
    if request.param == "sd3":
        return load_sd3(StableDiffusion3Pipeline, tiny_sd3_dir, tiny_sd3_ip_adapter_dir)
    return load_flux(FluxPipeline, tiny_flux_dir, tiny_flux_ip_adapter_dir)


def test_flow_controls_record_every_draw(flow_pipe) -> None:
    records = _observe(flow_pipe, untrained_draws=2, steps=[1])
    ip = [r for r in records if r["key_set"] == "ip"]  # SD3's joint softmax has no control
    assert ip and all(name in r for r in ip for name in control_columns(2))
    assert all(math.isfinite(r[key_scale_column(k)]) for r in ip for k in range(2))
    assert all(math.isfinite(r[control_column("rho", 1)]) for r in ip)
    # the draws differ (kl: on SD 3.5 every control key has one norm after the key RMSNorm, so the
    # control's rho is 1 in every draw, docs/controls.md)
    assert any(r[control_column("kl", 0)] != r[control_column("kl", 1)] for r in ip)
    check_records(records, source="test", fix="none")


def test_files_with_the_old_untrained_columns_still_load_and_validate(sd15, tmp_path) -> None:
    """A records file of an earlier version: one unmatched draw as ``*_untrained`` columns, no
    ``untrained_draws`` in its config. It validates, loads and summarises; it has no control draws."""
    import json

    from nw_adapter.integration.recorder import NWRecorder

    recorder = apply_nw_processor(sd15, untrained_control=True, untrained_draws=1, steps=[0])
    try:
        generate(sd15, steps=2)
    finally:
        remove_nw_processor(sd15)
    path = tmp_path / "records.json"
    recorder.to_json(path)
    document = json.loads(path.read_text())
    document["config"].pop("untrained_draws")
    for record in document["records"]:  # rewritten as the old control's columns
        for stat in CONTROL_RECORDED:
            record[stat + "_untrained"] = record.pop(control_column(stat, 0))
        record.pop(key_scale_column(0))
    path.write_text(json.dumps(document))
    loaded = NWRecorder.from_json(path)
    records = loaded.to_records()
    check_records(records, source="old file", fix="none")
    assert records and all("rho_untrained" in r and control_draws(r) == 0 for r in records)
    summary = loaded.summary()
    assert all("rho_untrained" in row and "rho_control" not in row for row in summary)
