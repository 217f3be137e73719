"""Deferred statistics (issue 27): observed layers capture, the statistics run later, grouped by shape.

- Stacking captures along the batch, with ``halves`` = the sum of their halves, gives each
  capture exactly what one call per capture gives (same draws: the null rows shared, the
  permutation noise and directions per batch row); pooling the stacked rows as one capture's
  halves does not (the control).
- A UNet's records are the same deferred and per layer (``deferred_mb=0``); the layers dispatch
  no aten op of their own while deferred (the per-layer path does).
- The memory bound and a new call flush; a failing group is retried capture by capture and only
  the failing (step, layer) pairs are skipped.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from nw_adapter.integration import stats
from nw_adapter.integration.mixin import apply_nw_processor, remove_nw_processor
from nw_adapter.integration.stats import NullDraws, draw_nulls, softmax_statistics

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:  # `benchmarks/` is not installed
    sys.path.insert(0, ROOT)

from benchmarks.models import TOY_UNET_CONFIG, build_unet, unet_inputs  # noqa: E402
from benchmarks.op_count import OpCounter  # noqa: E402

NULL_COLUMNS = ("rho_perm_null", "rho_norm_matched_null", "rho_spread_null")


def _captures(count: int = 3, batch: int = 2, heads: int = 2, n: int = 12, d: int = 8, m: int = 4):
    gen = torch.Generator().manual_seed(11)
    qs = [torch.randn(batch, heads, n, d, generator=gen) * (1 + i) for i in range(count)]
    ks = [torch.randn(batch, heads, m, d, generator=gen) for _ in range(count)]
    return qs, ks


def _slice(draws: NullDraws, rows: slice) -> NullDraws:
    return NullDraws(draws.rows, draws.noise[rows], draws.directions[rows])


def test_stacked_captures_equal_one_call_per_capture():
    qs, ks = _captures()
    q, k = torch.cat(qs), torch.cat(ks)
    draws = draw_nulls(q, k.shape[-2], 8, torch.Generator().manual_seed(0))
    stacked, _, _ = softmax_statistics(q, k, scale=8**-0.5, h=1.5, draws=draws, halves=2 * len(qs))
    for i, (qi, ki) in enumerate(zip(qs, ks, strict=True)):
        rows = slice(2 * i, 2 * i + 2)
        alone, _, _ = softmax_statistics(qi, ki, scale=8**-0.5, h=1.5, draws=_slice(draws, rows), halves=2)
        torch.testing.assert_close(stacked[:, 2 * i : 2 * i + 2], alone, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_stacked_captures_pooled_as_one_capture_differ():
    """The control: the same stacked call pooling all rows into one capture's two halves is not
    what the captures are, so the equality above is not a property of any stacking."""
    qs, ks = _captures()
    q, k = torch.cat(qs), torch.cat(ks)
    pooled, _, _ = softmax_statistics(q, k, scale=8**-0.5, h=1.5, halves=2)
    first, _, _ = softmax_statistics(qs[0], ks[0], scale=8**-0.5, h=1.5, halves=2)
    assert not torch.allclose(pooled, first, rtol=1e-3, atol=1e-4, equal_nan=True)


def _unet():
    torch.manual_seed(0)
    unet = build_unet(TOY_UNET_CONFIG)
    return unet, unet_inputs(unet, latent_size=8, image_embed_dim=1024)


def _observe(unet, kwargs, forwards: int = 3, **options):
    recorder = apply_nw_processor(unet, mode="observe", cfg=True, **options)
    try:
        with torch.no_grad():
            for t in range(forwards):
                unet(**{**kwargs, "timestep": torch.tensor(900 - 200 * t)})
        records = recorder.to_records()
    finally:
        remove_nw_processor(unet)
    return recorder, records


def test_deferred_records_equal_per_layer_records():
    unet, kwargs = _unet()
    _, deferred = _observe(unet, kwargs, nulls=False)
    _, per_layer = _observe(unet, kwargs, nulls=False, deferred_mb=0)
    assert len(deferred) == len(per_layer) > 0
    for a, b in zip(deferred, per_layer, strict=True):
        assert {key: a[key] for key in ("step", "layer", "half", "head")} == {
            key: b[key] for key in ("step", "layer", "half", "head")
        }
        for name in ("rho", "pearson", "kl", "js", "neff_attn", "r2_key", "h_eff", "kl_key_prior"):
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-5, nan_ok=True), name
    # with the nulls: one draw per group, not per layer, so the nulls differ, but they are there
    _, with_nulls = _observe(unet, kwargs)
    assert all(math.isfinite(r[name]) for r in with_nulls for name in NULL_COLUMNS)


def test_observed_layers_dispatch_no_op_while_deferred():
    unet, kwargs = _unet()

    def forward_ops() -> int:
        with torch.no_grad():
            unet(**kwargs)  # warm-up
            with OpCounter() as counter:
                unet(**kwargs)
        return counter.total

    stock = forward_ops()
    counts = {}
    for name, options in {"deferred": {}, "per_layer": {"deferred_mb": 0}}.items():
        recorder = apply_nw_processor(unet, mode="observe", cfg=True, **options)
        try:
            counts[name] = forward_ops()
            assert all(e.stats is None for e in recorder._entries) == (name == "deferred")
        finally:
            remove_nw_processor(unet)
    assert counts["deferred"] == stock
    assert counts["per_layer"] > stock + 4 * 200  # 4 IP layers, ~300 ops each


def test_the_memory_bound_flushes_during_the_call():
    unet, kwargs = _unet()
    recorder = apply_nw_processor(unet, mode="observe", cfg=True, deferred_mb=1e-6)
    try:
        with torch.no_grad():
            for _ in range(2):
                unet(**kwargs)
                assert len(recorder.pending) <= 1  # every capture is over the bound: flushed at the next
    finally:
        remove_nw_processor(unet)
    assert len(recorder.to_records()) == 2 * 4 * 2 * 2  # forwards x layers x halves x heads


def test_a_new_call_flushes_the_previous_one_with_its_own_seed():
    unet, kwargs = _unet()
    recorder = apply_nw_processor(unet, mode="observe", cfg=True)
    try:
        with torch.no_grad():
            unet(**kwargs)
            first_call = recorder.to_records()  # call 0 flushed at once
            recorder.clear()
            recorder.new_call()
            unet(**kwargs)
            recorder.new_call()
            unet(**kwargs)  # call 2: its first capture flushes call 1
            pending = recorder.pending  # call 2's layer calls, queued to be recorded at the flush
            assert {layer.ctx.state.call for layer in pending.layers} == {2} and not pending.captures
        records = recorder.to_records()
    finally:
        remove_nw_processor(unet)
    # the nulls' generator is seeded per call: call 1's nulls are not call 0's, but both are drawn
    # from their own call's seed whenever they are computed
    call1 = [r for r in records if r["call"] == 1]
    assert len(call1) == len(first_call)
    assert [r["rho"] for r in call1] == pytest.approx([r["rho"] for r in first_call], rel=1e-5)
    assert [r["rho_perm_null"] for r in call1] != [r["rho_perm_null"] for r in first_call]


def test_a_failing_group_skips_only_its_failing_pairs(monkeypatch):
    unet, kwargs = _unet()
    real = stats.softmax_statistics
    layers = [n for n in unet.attn_processors if "attn2" in n]
    recorder = apply_nw_processor(unet, mode="observe", cfg=True, nulls=False)
    try:
        with torch.no_grad():
            unet(**kwargs)

        failed_alone = []

        def fails_on_long_queries(q, k, **options):
            # the group of the 8 x 8 layers fails, then, retried alone, only its first capture
            if q.shape[-2] == 64 and (q.shape[0] > 2 or not failed_alone):
                if q.shape[0] == 2:
                    failed_alone.append(True)
                raise FloatingPointError("injected")
            return real(q, k, **options)

        monkeypatch.setattr(stats, "softmax_statistics", fails_on_long_queries)
        with pytest.warns(RuntimeWarning, match="injected"):
            records = recorder.to_records()
    finally:
        remove_nw_processor(unet)
    recorded = {r["layer"] for r in records}
    skipped = {p["layer"] for p in recorder.skipped()["pairs"]}
    assert len(skipped) == 1 and not skipped & recorded
    assert skipped | recorded == set(layers)
    assert recorder.skipped()["by_reason"] == {"FloatingPointError: injected": len(skipped)}


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, True, "512"])
def test_deferred_mb_is_validated(bad):
    from nw_adapter.integration.config import NWProcessorConfig
    from nw_adapter.integration.errors import NWConfigError

    with pytest.raises(NWConfigError, match="deferred_mb"):
        NWProcessorConfig(deferred_mb=bad)
    assert NWProcessorConfig(deferred_mb=0).deferred_mb == 0


def test_queued_layer_calls_are_recorded_at_the_flush_for_their_own_step(monkeypatch):
    """An observed layer call is only queued; recorded at the flush, a call that fails there is
    skipped for its own (call, step), its layer's other steps recorded; the control: with maps
    stored the same layers record (capture) in the layer and queue nothing."""
    unet, kwargs = _unet()
    layers = [n for n in unet.attn_processors if "attn2" in n]
    recorder = apply_nw_processor(unet, mode="observe", cfg=True, nulls=False)
    processor = unet.attn_processors[layers[0]]
    family_softmaxes = type(processor)._softmaxes
    try:
        with torch.no_grad():
            for t in range(3):
                unet(**{**kwargs, "timestep": torch.tensor(900 - 200 * t)})
                assert not recorder.pending.captures  # nothing captured yet: only queued
        queued = [c for c in recorder.pending.layers if c.processor is processor]
        assert len(recorder.pending.layers) == 3 * len(layers) and len(queued) == 3
        steps = [c.ctx.state.step for c in queued]
        failing = queued[1].captured  # the first layer's call at the second step

        def fails_once(self, attn, inputs, captured, heads):
            if captured is failing:
                raise FloatingPointError("injected")
            return family_softmaxes(self, attn, inputs, captured, heads)

        monkeypatch.setattr(type(processor), "_softmaxes", fails_once)
        with pytest.warns(RuntimeWarning, match="injected"):
            records = recorder.to_records()
    finally:
        remove_nw_processor(unet)
    pairs = recorder.skipped()["pairs"]
    assert [(p["layer"], p["step"]) for p in pairs] == [(layers[0], steps[1])]
    assert sorted({r["step"] for r in records if r["layer"] == layers[0]}) == [steps[0], steps[2]]
    assert {r["layer"] for r in records} == set(layers)
    unet, kwargs = _unet()
    recorder = apply_nw_processor(unet, mode="observe", cfg=True, nulls=False, store_maps=True)
    try:
        with torch.no_grad():
            unet(**kwargs)
        assert recorder.pending is None or not recorder.pending.layers  # recorded in the layer
        assert {r["layer"] for r in recorder.to_records()} == set(layers)
    finally:
        remove_nw_processor(unet)
