"""The untrained-adapter control wired into the processors (config.untrained_control).

Every family (SD 1.5 base / Plus, SD3, Flux): the keys the control uses are those of
``untrained_keys`` (every draw); observe stays bit-identical to stock with the control on; the
recorded ``{X}_control_{k}`` values are the statistics of the same queries against those keys
rescaled to the trained keys' RMS norm, ``key_scale_{k}`` the ratio of the norms; hooks and
processors are restored after an exception; a failure of the control is skipped, never raised.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline, StableDiffusionPipeline
from flow_helpers import generate as generate_flow
from flow_helpers import load_flux, load_sd3
from tiny_helpers import generate, load_sd15, random_image

from nw_adapter.analysis.validation import check_records
from nw_adapter.core import bandwidth as bw
from nw_adapter.integration import stats
from nw_adapter.integration.control import UntrainedControl, scale_matched
from nw_adapter.integration.errors import NWConfigError, NWInstallError
from nw_adapter.integration.mixin import apply_nw_processor, nw_processor, remove_nw_processor
from nw_adapter.integration.recorder import CONTROL_COLUMNS, NWRecorder
from nw_adapter.integration.schema import (
    CONTROL_OF,
    CONTROL_RECORDED,
    STAT_NAMES,
    control_column,
    control_columns,
    key_scale_column,
)
from nw_adapter.integration.untrained import projection_module, untrained_keys
from nw_adapter.models.tiny import ip_adapter_weight_name

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["base", "plus"])
def sd15(request, tiny_sd15_dir, tiny_ip_adapter_dir):
    return load_sd15(tiny_sd15_dir, tiny_ip_adapter_dir, request.param)


@pytest.fixture(scope="module", params=["sd15-base", "sd15-plus", "sd3", "flux", "flux-2-adapters"])
def any_pipe(request, tiny_sd15_dir, tiny_ip_adapter_dir, tiny_sd3_dir, tiny_sd3_ip_adapter_dir):
    """A tiny pipeline of every family the control supports (built lazily, per parameter)."""
    if request.param.startswith("sd15"):
        pipe = StableDiffusionPipeline.from_pretrained(tiny_sd15_dir)
        variant = request.param.removeprefix("sd15-")
        pipe.load_ip_adapter(
            tiny_ip_adapter_dir, subfolder="models", weight_name=ip_adapter_weight_name(variant)
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe
    if request.param == "sd3":
        return load_sd3(StableDiffusion3Pipeline, tiny_sd3_dir, tiny_sd3_ip_adapter_dir)
    flux_dir = request.getfixturevalue("tiny_flux_dir")
    flux_ip = request.getfixturevalue("tiny_flux_ip_adapter_dir")
    return load_flux(FluxPipeline, flux_dir, flux_ip, adapters=2 if request.param.endswith("adapters") else 1)


def _run(pipe):
    if isinstance(pipe, StableDiffusionPipeline):
        return torch.from_numpy(generate(pipe, steps=2))
    adapters = getattr(getattr(pipe.transformer, "encoder_hid_proj", None), "num_ip_adapters", 1)
    if adapters > 1:  # one reference per adapter
        images = [random_image(i + 1, 32) for i in range(adapters)]
        return generate_flow(pipe, steps=2, ip_adapter_image=images)
    return generate_flow(pipe, steps=2)


def _denoiser(pipe):
    return pipe.unet if hasattr(pipe, "unet") else pipe.transformer


def _hook_counts(pipe) -> tuple[int, int]:
    denoiser = _denoiser(pipe)
    return len(denoiser._forward_pre_hooks), len(projection_module(denoiser)._forward_pre_hooks)


def _spy_keys(control: UntrainedControl, into: list) -> None:
    """Record every (layer, adapter, keys) of draw 0 the control hands a processor."""
    keys = control.keys

    def spy(layer, states, *, adapter=0, draw=0):
        out = keys(layer, states, adapter=adapter, draw=draw)
        if draw == 0:
            into.append((layer, adapter, out.clone()))
        return out

    control.keys = spy


def _first_forward_inputs(pipe, run) -> dict:
    """The raw image embeddings and timestep of the denoiser's first forward."""
    seen: dict = {}

    def hook(module, args, kwargs):
        if "embeds" in seen:
            return
        added = kwargs.get("added_cond_kwargs") or {}
        joint = kwargs.get("joint_attention_kwargs") or {}
        embeds = added.get("image_embeds", joint.get("ip_adapter_image_embeds"))
        seen["embeds"] = [e.clone() for e in embeds] if isinstance(embeds, list) else embeds.clone()
        seen["timestep"] = kwargs.get("timestep", args[1] if len(args) > 1 else None)

    handle = _denoiser(pipe).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = run()
    finally:
        handle.remove()
    seen["out"] = out
    return seen


def test_control_keys_are_untrained_keys_and_observe_is_bit_identical(any_pipe) -> None:
    pipe = any_pipe
    stock = _run(pipe)
    hooks = _hook_counts(pipe)
    recorder = apply_nw_processor(pipe, untrained_control=True, untrained_seed=3)
    control = recorder_control(pipe)
    assert control.attached and control.adapter.seed == 3
    handed: list = []
    _spy_keys(control, handed)
    try:
        seen = _first_forward_inputs(pipe, lambda: _run(pipe))
    finally:
        remove_nw_processor(pipe)
    assert torch.equal(seen["out"], stock)  # observe with the control on: bit-identical
    assert _hook_counts(pipe) == hooks
    adapters = len(next(iter(control.adapter.key_projections.values())))
    layers = len(control.adapter.key_projections)
    first_forward = handed[: layers * adapters]
    assert {layer for layer, _, _ in first_forward} == set(control.adapter.key_projections)
    for layer, adapter, keys in first_forward:
        expected = untrained_keys(
            control.adapter, layer, seen["embeds"], adapter=adapter, timestep=seen["timestep"]
        )
        torch.testing.assert_close(keys, expected, rtol=0, atol=0)
    records = [r for r in recorder.to_records() if r["key_set"] == "ip"]
    assert records and all(name in r for r in records for name in control_columns(control.draws))
    assert sum(math.isfinite(r["rho_control_0"]) for r in records) > 0.9 * len(records)
    check_records(records, source="test", fix="none")


def recorder_control(pipe) -> UntrainedControl:
    """The control handed to the installed processors (all share one)."""
    controls = {id(p.untrained_control) for p in _denoiser(pipe).attn_processors.values()
                if hasattr(p, "untrained_control") and p.untrained_control is not None}  # fmt: skip
    assert len(controls) == 1
    return next(p.untrained_control for p in _denoiser(pipe).attn_processors.values()
                if getattr(p, "untrained_control", None) is not None)  # fmt: skip


def _check_control_values(records: list[dict], q, k, keys0: list, halves: tuple[str, ...]) -> None:
    """Every draw's recorded control values equal the statistics of ``q`` [B, H, N, d] against that
    draw's keys rescaled per (row, head) to the RMS norm of the trained keys ``k``, at the matched
    bandwidth without nulls; ``key_scale_k`` the ratio of the norms averaged over each half."""
    scale = q.shape[-1] ** -0.5
    for draw, k0 in enumerate(keys0):
        matched, ratio = scale_matched(k, k0)
        values, _, _ = stats.softmax_statistics(
            q, matched, scale=scale, h=bw.matched_bandwidth(scale=scale), draws=None, halves=len(halves)
        )
        ratio = ratio.view(len(halves), -1, ratio.shape[-1]).mean(dim=1)
        for r in records:
            half = halves.index(r["half"])
            for column, name in zip(CONTROL_COLUMNS, CONTROL_RECORDED, strict=True):
                expected = float(values[column, half, r["head"]])
                got = r[control_column(name, draw)]
                assert got == pytest.approx(expected, rel=1e-4, abs=1e-5, nan_ok=True), (name, draw)
            assert r[key_scale_column(draw)] == pytest.approx(float(ratio[half, r["head"]]), rel=1e-5)


def test_recorded_control_values_are_the_statistics_of_the_untrained_keys(sd15) -> None:
    """Independent recomputation for one layer at step 0: q from the layer's to_q, the trained keys
    from its to_k_ip, every draw's untrained keys from the raw embeddings, rescaled to the trained
    keys' RMS norm; the statistics at the matched bandwidth without nulls."""
    layer = next(n for n, p in sd15.unet.attn_processors.items() if hasattr(p, "to_k_ip"))
    attn = sd15.unet.get_submodule(layer.removesuffix(".processor"))
    captured: dict = {}

    def grab(name):
        def hook(module, args, output):
            captured.setdefault(name, output.clone())

        return hook

    recorder = apply_nw_processor(sd15, untrained_control=True, steps=[0], layers=[layer.split(".attn")[0]])
    control = recorder_control(sd15)
    handles = [
        attn.to_q.register_forward_hook(grab("q")),
        sd15.unet.attn_processors[layer].to_k_ip[0].register_forward_hook(grab("k")),
    ]
    try:
        seen = _first_forward_inputs(sd15, lambda: _run(sd15))
    finally:
        for handle in handles:
            handle.remove()
        remove_nw_processor(sd15)
    heads = attn.heads

    def split(x):
        return x.view(x.shape[0], -1, heads, x.shape[-1] // heads).transpose(1, 2).float()

    q, k = split(captured["q"]), split(captured["k"])
    keys0 = [untrained_keys(a, layer, seen["embeds"]).float() for a in control.adapters]
    records = [r for r in recorder.to_records() if r["layer"] == layer and r["step"] == 0]
    assert len(records) == 2 * heads and control.draws == 3
    _check_control_values(records, q, k, keys0, ("uncond", "cond"))
    # the trained and control values differ (the control is another adapter)
    assert any(abs(r["rho"] - r["rho_control_0"]) > 1e-3 for r in records)


def test_columns_follow_the_schema() -> None:
    assert CONTROL_RECORDED == tuple(n for n in CONTROL_OF if n in STAT_NAMES)
    assert CONTROL_COLUMNS == tuple(STAT_NAMES.index(n) for n in CONTROL_RECORDED)
    assert control_columns(2)[: len(CONTROL_RECORDED) + 1] == (
        *(f"{n}_control_0" for n in CONTROL_RECORDED),
        "key_scale_0",
    )
    assert {"rho_control_1", "kl_control_1", "key_scale_1"} <= set(control_columns(2))


def test_off_by_default_and_removal_drops_the_control(sd15, tmp_path) -> None:
    recorder = apply_nw_processor(sd15, steps=[0])
    try:
        _run(sd15)
    finally:
        remove_nw_processor(sd15)
    assert not any("rho_control_0" in r for r in recorder.to_records())
    hooks = _hook_counts(sd15)
    recorder = apply_nw_processor(sd15, untrained_control=True, steps=[0])
    assert _hook_counts(sd15) == (hooks[0] + 2, hooks[1] + 1)  # step tracker + control; projection
    installed = [p for p in sd15.unet.attn_processors.values() if hasattr(p, "untrained_control")]
    _run(sd15)
    remove_nw_processor(sd15)
    assert _hook_counts(sd15) == hooks
    assert all(p.untrained_control is None for p in installed)
    # the columns survive summary, CSV and the records file
    summary = recorder.summary()
    assert all(math.isfinite(row["rho_control"]) and row["control_draws"] == 3 for row in summary)
    assert all(math.isfinite(row["key_scale"]) and row["key_scale"] > 0 for row in summary)
    assert "rho_control_2" in recorder.records().csv_text().splitlines()[0].split(",")
    path = tmp_path / "records.json"
    recorder.to_json(path)
    loaded = NWRecorder.from_json(path)
    assert loaded.config.untrained_control is True and loaded.config.untrained_draws == 3
    first, again = recorder.to_records()[0], loaded.to_records()[0]
    assert all(first[n] == pytest.approx(again[n], nan_ok=True) for n in control_columns(3))
    document = json.loads(path.read_text())
    assert "kl_control_0" in document["records"][0]


def test_hooks_and_processors_restored_after_an_exception(sd15, monkeypatch) -> None:
    before = dict(sd15.unet.attn_processors)
    hooks = _hook_counts(sd15)
    with pytest.raises(RuntimeError, match="boom"):
        with nw_processor(sd15, untrained_control=True):
            assert _hook_counts(sd15) != hooks
            raise RuntimeError("boom")
    assert _hook_counts(sd15) == hooks
    assert all(sd15.unet.attn_processors[n] is p for n, p in before.items())

    def failing_attach(self, denoiser):
        raise RuntimeError("attach failed")

    monkeypatch.setattr(UntrainedControl, "attach", failing_attach)
    with pytest.raises(RuntimeError, match="attach failed"):
        apply_nw_processor(sd15, untrained_control=True)
    assert _hook_counts(sd15) == hooks
    assert all(sd15.unet.attn_processors[n] is p for n, p in before.items())


def test_a_failing_control_is_skipped_and_the_generation_completes(sd15) -> None:
    stock = _run(sd15)
    recorder = apply_nw_processor(sd15, untrained_control=True)

    def broken(*args, **kwargs):
        raise RuntimeError("control broke")

    recorder_control(sd15).keys = broken
    try:
        with pytest.warns(RuntimeWarning, match="control broke"):  # one warning, then counted silently
            out = _run(sd15)
    finally:
        remove_nw_processor(sd15)
    assert torch.equal(out, stock)
    skipped = recorder.skipped()
    assert skipped["count"] > 0 and len(recorder.to_records()) == 0


def test_an_unsupported_adapter_is_one_clear_install_error(sd15, monkeypatch) -> None:
    from nw_adapter.integration import control as control_module

    def unsupported(denoiser, *, seed=0):
        raise ValueError("the pipeline has no IP-Adapter loaded; call pipe.load_ip_adapter(...) first")

    monkeypatch.setattr(control_module, "build_untrained_adapter", unsupported)
    before = dict(sd15.unet.attn_processors)
    with pytest.raises(NWInstallError, match="untrained_control: .*untrained_control=False"):
        apply_nw_processor(sd15, untrained_control=True)
    assert all(sd15.unet.attn_processors[n] is p for n, p in before.items())


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"untrained_control": "yes"}, "untrained_control"),
        ({"untrained_seed": -1}, "untrained_seed"),
        ({"untrained_seed": 1.5}, "untrained_seed"),
        ({"untrained_control": True, "mode": "swap"}, "needs statistics"),
    ],
)
def test_config_validation(options, match) -> None:
    from nw_adapter.integration.config import NWProcessorConfig

    with pytest.raises(NWConfigError, match=match):
        NWProcessorConfig(**options)
    assert NWProcessorConfig(untrained_control=True, mode="swap", statistics=True).untrained_control


def _half_masks(size: int) -> list[torch.Tensor]:
    """Adapter 0: one image on the left half; adapter 1: two images, right and left halves."""
    from diffusers.image_processor import IPAdapterMaskProcessor
    from PIL import Image

    left = torch.zeros(size, size, dtype=torch.uint8)
    left[:, : size // 2] = 255
    proc = IPAdapterMaskProcessor()
    pictures = [Image.fromarray(left.numpy()), Image.fromarray((255 - left).numpy())]
    m0 = proc.preprocess(pictures[:1], height=size, width=size)
    m1 = proc.preprocess(pictures[::-1], height=size, width=size)
    return [m.reshape(1, m.shape[0], size, size) for m in (m0, m1)]


@pytest.fixture(scope="module")
def sdxl(tiny_sdxl_dir, tiny_ip_adapter_dir):
    """The SDXL companion pipeline with a base and a Plus adapter."""
    from nw_adapter.pipelines import StableDiffusionXLNWPipeline

    pipe = StableDiffusionXLNWPipeline.from_pretrained(tiny_sdxl_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_ip_adapter(
        tiny_ip_adapter_dir,
        subfolder="sdxl_models",
        weight_name=[ip_adapter_weight_name("base", sdxl=True), ip_adapter_weight_name("plus", sdxl=True)],
    )
    return pipe


@pytest.mark.parametrize("masks", [False, True], ids=["images-pooled", "ip-masks"])
def test_sdxl_two_adapters_several_images(sdxl, masks) -> None:
    """SDXL, base + Plus adapters, two images for the second: bit-identical observe with the control,
    and the keys handed per softmax group are untrained_keys' (per image, with IP masks)."""
    from tiny_helpers import SIZE

    kwargs = {"ip_adapter_image": [[random_image(1)], [random_image(2), random_image(3)]]}
    if masks:
        kwargs["cross_attention_kwargs"] = {"ip_adapter_masks": _half_masks(SIZE)}
    sdxl.set_ip_adapter_scale([0.7, [0.5, 0.9]] if masks else [0.7, 0.6])
    try:
        stock = generate(sdxl, steps=2, **kwargs)
        recorder = sdxl.set_ip_adapter_nw_processor(untrained_control=True)
        control = recorder_control(sdxl)
        handed: list = []
        _spy_keys(control, handed)
        try:
            seen = _first_forward_inputs(sdxl, lambda: generate(sdxl, steps=2, **kwargs))
        finally:
            sdxl.unset_ip_adapter_nw_processor()
    finally:
        sdxl.set_ip_adapter_scale([1.0, 1.0])
    assert torch.equal(torch.from_numpy(seen["out"]), torch.from_numpy(stock))
    layer = next(iter(control.adapter.key_projections))
    groups = [(0, 0), (1, 0), (1, 1)] if masks else [(0, 0), (1, 0)]
    mine = [(adapter, keys) for name, adapter, keys in handed if name == layer][: len(groups)]
    for (adapter, image), (handed_adapter, keys) in zip(groups, mine, strict=True):
        assert handed_adapter == adapter
        expected = untrained_keys(control.adapter, layer, seen["embeds"], adapter=adapter)
        if masks:  # one image's tokens: M = images x tokens, ordered by image
            tokens = expected.shape[2] // len(kwargs["ip_adapter_image"][adapter])
            expected = expected[:, :, image * tokens : (image + 1) * tokens]
        torch.testing.assert_close(keys, expected, rtol=0, atol=0)
    records = recorder.to_records()
    assert {(r["adapter"], r["image"]) for r in records} == set(groups)
    assert all(math.isfinite(r[control_column("rho", k)]) for r in records for k in range(3))


@pytest.fixture(scope="module", params=["sd3", "flux"])
def flow_pipe(request, tiny_sd3_dir, tiny_sd3_ip_adapter_dir, tiny_flux_dir, tiny_flux_ip_adapter_dir):
    if request.param == "sd3":
        return load_sd3(StableDiffusion3Pipeline, tiny_sd3_dir, tiny_sd3_ip_adapter_dir)
    return load_flux(FluxPipeline, tiny_flux_dir, tiny_flux_ip_adapter_dir)


def test_flow_recorded_control_values_are_recomputed_from_q_and_untrained_keys(flow_pipe) -> None:
    """SD3 / Flux, one layer, step 0: q as the stock branch normalises it (hooked norm_q), the
    trained keys as it forms them (SD3: the key RMSNorm's output; Flux: to_k_ip's, split into
    heads), every draw's untrained keys from the raw embeddings and timestep, rescaled to the
    trained keys' RMS norm; statistics at the matched bandwidth."""
    transformer = flow_pipe.transformer
    layer = next(n for n, p in transformer.attn_processors.items() if hasattr(p, "to_k_ip"))
    attn = transformer.get_submodule(layer.removesuffix(".processor"))
    processor = transformer.attn_processors[layer]
    sd3 = isinstance(flow_pipe, StableDiffusion3Pipeline)
    norm_q = processor.norm_q if sd3 else attn.norm_q
    key_module = processor.norm_ip_k if sd3 else processor.to_k_ip[0]
    captured: dict = {}

    def grab(name):
        def hook(module, args, output):
            captured.setdefault(name, output.clone())

        return hook

    recorder = apply_nw_processor(
        flow_pipe, untrained_control=True, untrained_draws=2, steps=[0], layers=[layer.split(".attn")[0]]
    )
    control = recorder_control(flow_pipe)
    handles = [norm_q.register_forward_hook(grab("q")), key_module.register_forward_hook(grab("k"))]
    try:
        seen = _first_forward_inputs(flow_pipe, lambda: _run(flow_pipe))
    finally:
        for handle in handles:
            handle.remove()
        remove_nw_processor(flow_pipe)
    q = (captured["q"] if sd3 else captured["q"].transpose(1, 2)).float()  # [B, H, N, d]
    k = captured["k"]
    if not sd3:
        k = k.view(k.shape[0], -1, attn.heads, k.shape[-1] // attn.heads).transpose(1, 2)
    keys0 = [
        untrained_keys(a, layer, seen["embeds"], timestep=seen["timestep"]).float() for a in control.adapters
    ]
    halves = ("uncond", "cond") if sd3 else ("cond",)
    records = [
        r for r in recorder.to_records() if r["layer"] == layer and r["step"] == 0 and r["key_set"] == "ip"
    ]
    assert len(records) == len(halves) * attn.heads
    _check_control_values(records, q, k.float(), keys0, halves)
