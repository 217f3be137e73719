"""``compile=True``: the compiled side computation equals eager, reports its compile time and kernel
launches, and falls back to eager with one warning line when compilation is unavailable.

Compiling one small layer shape takes tens of seconds on 2 CPU cores, so this module compiles
exactly one graph (module-scoped fixture) and checks everything on it.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.models.attention_processor import Attention, IPAdapterAttnProcessor2_0

from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.processors import nw_processor_for
from nw_adapter.integration.recorder import NWRecorder
from nw_adapter.integration.schema import STAT_NAMES
from nw_adapter.integration.stats import compiled

C, HEADS, DIM, ROWS, TOKENS = 32, 2, 16, 36, 4


def _observed_layer(**options) -> tuple[Attention, NWRecorder, tuple]:
    """One IP-Adapter attention layer with an NW processor, its recorder and its inputs."""
    torch.manual_seed(0)
    attn = Attention(C, cross_attention_dim=24, heads=HEADS, dim_head=DIM).eval()
    stock = IPAdapterAttnProcessor2_0(C, 24, num_tokens=(TOKENS,), scale=0.8)
    gen = torch.Generator().manual_seed(1)
    x, text = torch.randn(2, ROWS, C, generator=gen), torch.randn(2, 5, 24, generator=gen)
    ip = [torch.randn(2, 1, TOKENS, 24, generator=gen)]
    rec = NWRecorder(NWProcessorConfig(cfg=True, seed=4, **options))
    attn.set_processor(
        nw_processor_for(stock, layer_name="up_blocks.1.attn2.processor", config=rec.config, recorder=rec)
    )
    return attn, rec, (x, (text, ip))


def _run(**options) -> list[dict]:
    attn, rec, inputs = _observed_layer(**options)
    with torch.no_grad():
        attn(*inputs)
    return rec.to_records()


@pytest.fixture(scope="module")
def compiled_records():
    compiled._COMPILED.clear()
    compiled.COMPILE_SECONDS.clear()
    records = _run(compile=True)
    return records, dict(compiled.COMPILE_SECONDS), dict(compiled.compiled_statistics().launches)


def test_compiled_statistics_equal_eager(compiled_records):
    records, _, _ = compiled_records
    eager = _run(compile=False)
    assert len(records) == len(eager) == 2 * HEADS
    for got, ref in zip(records, eager, strict=True):
        for name in STAT_NAMES:
            assert got[name] == pytest.approx(ref[name], rel=1e-4, abs=1e-5, nan_ok=True), name
            assert math.isfinite(got[name]) or name in ("pearson", "qk_spread_ratio")


def test_compile_time_and_launches_are_reported(compiled_records):
    _, seconds, launches = compiled_records
    assert len(seconds) == 1 and next(iter(seconds.values())) > 0
    (count,) = launches.values()
    # the whole side computation of a layer: fused kernels plus the extern matmul / sort calls (7 on
    # torch 2.13 CPU; the small per-row products are broadcast sums under compile, so they fuse)
    assert 0 < count <= 7, launches


def test_compile_falls_back_to_eager_with_one_warning(monkeypatch):
    def broken(*args, **kwargs):
        def run(*a, **k):
            raise RuntimeError("no C++ compiler found\nlong details")

        return run

    monkeypatch.setattr(compiled, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(
        UserWarning, match=r"torch.compile is unavailable here \(RuntimeError: no C\+\+ compiler"
    ):
        records = _run(compile=True)
    assert [r["rho"] for r in records] == pytest.approx([r["rho"] for r in _run(compile=False)])


def test_compile_option_is_validated():
    with pytest.raises(ValueError, match="`compile` must be True or False"):
        NWProcessorConfig(compile="yes")


def test_compiled_statistics_are_deferred_like_eager():
    """compile=True no longer forces the per-layer path: the layer only captures, the group's
    compiled call runs when the records are read (nothing is compiled here)."""
    attn, rec, inputs = _observed_layer(compile=True)
    with torch.no_grad():
        attn(*inputs)
    assert rec.pending is not None and len(rec.pending) == 1
    assert all(entry.stats is None for entry in rec._entries)


def test_cuda_inputs_get_cuda_graphs_and_cloned_outputs(monkeypatch):
    """On CUDA the compiled function runs under CUDA graphs (mode="reduce-overhead"): each call
    marks a step and clones the outputs a replay would overwrite (checked without a GPU)."""
    modes = []

    def fake_compile(function, **kwargs):
        modes.append(kwargs.get("mode"))
        return function

    monkeypatch.setattr(torch, "compile", fake_compile)
    statistics = compiled.CompiledStatistics()
    assert statistics.function_for(torch.device("cpu")) is statistics.function
    assert statistics.function_for(torch.device("cuda")) is statistics.graphed
    assert modes == [None, "reduce-overhead"]

    buffers = (torch.zeros(3), torch.zeros(2))
    marks = []
    statistics.graphed = lambda *args: buffers
    monkeypatch.setattr(statistics, "function_for", lambda device: statistics.graphed)
    monkeypatch.setattr(compiled, "_run_and_count_launches", lambda function, *args: (function(*args), 1))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    q, k = torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 3, 4)
    for _ in range(2):
        out = statistics(q, k, 1.0, 0.5, None, None, 1)
        assert all(got is not buffer for got, buffer in zip(out, buffers, strict=True))
        assert all(torch.equal(got, buffer) for got, buffer in zip(out, buffers, strict=True))
    assert len(marks) == 2
