"""Smoke tests of the benchmark harness (toy sizes, no timed assertions) and the no-host-sync test.

The benchmark numbers themselves live in ``benchmarks/README.md``; these tests only check that
the harness runs end to end, measures what it claims (the compared implementations agree, the
streaming recorder's memory does not grow with the number of query tokens) and that the observe
path makes no host synchronisation per layer.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:  # `benchmarks/` is not installed: make it importable under plain `pytest` too
    sys.path.insert(0, ROOT)

from benchmarks.attention import DEFAULT_VARIANTS, bench_attention_layer, bench_unet_step  # noqa: E402
from benchmarks.models import TOY_UNET_CONFIG, build_unet, unet_inputs  # noqa: E402
from benchmarks.nw_field import IMPLEMENTATIONS, SMOOTHED, bench_nw_field, measure_peak_here  # noqa: E402
from benchmarks.recorder_memory import bench_recorder_memory, tensor_bytes  # noqa: E402
from benchmarks.run import main, table  # noqa: E402
from benchmarks.timing import add_ratios, quantiles, time_interleaved  # noqa: E402

NW_ADAPTER_DIR = str(Path(__import__("nw_adapter").__file__).resolve().parent)

#: Python-level points where a CUDA tensor would make the host wait for the device.
SYNC_METHODS = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "nonzero",
    "masked_select",
    "unique",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
)


def test_quantiles_and_ratios() -> None:
    q = quantiles([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (q["median"], q["min"], q["max"], q["q1"], q["q3"]) == (3.0, 1.0, 5.0, 2.0, 4.0)
    res = add_ratios({"a": {"median": 2.0}, "b": {"median": 3.0}}, "a")
    assert res["a"]["ratio"] == 1.0 and res["b"]["ratio"] == 1.5


def test_time_interleaved_rotates_order_and_runs_setup() -> None:
    calls: list[str] = []
    variants = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    setups = {"b": lambda: calls.append("setup-b")}
    res = time_interleaved(variants, repeats=3, warmup=0, setup=setups)
    assert [c for c in calls if c != "setup-b"] == list("abcbcacab")
    assert calls.count("setup-b") == 3
    assert all(len(r["times"]) == 3 and r["min"] <= r["median"] <= r["max"] for r in res.values())
    with pytest.raises(ValueError, match="repeats"):
        time_interleaved(variants, repeats=0)


def test_attention_layer_bench_toy() -> None:
    res = bench_attention_layer(32, 16, image_tokens=4, repeats=1, heads=2, cross=24, text_tokens=5)
    assert set(res["results"]) == {"stock", *DEFAULT_VARIANTS}
    assert res["results"]["stock"]["ratio"] == 1.0
    assert all(r["median"] > 0 and math.isfinite(r["ratio"]) for r in res["results"].values())


def test_unet_bench_toy_restores_stock_processors() -> None:
    unet = build_unet(TOY_UNET_CONFIG)
    before = dict(unet.attn_processors)
    res = bench_unet_step(latent_size=8, repeats=1, config=TOY_UNET_CONFIG, unet=unet, variants=("observe",))
    assert set(res["results"]) == {"stock", "observe"}
    assert res["results"]["observe"]["side_computation_s"] > 0
    assert all(unet.attn_processors[k] is v for k, v in before.items())


def test_nw_field_implementations_agree_and_memory_is_measured() -> None:
    rows = bench_nw_field([(64, 8, 4)], repeats=1, threads=1, memory=False, log=lambda _: None, gemm_size=32)
    results = rows[0]["results"]
    assert set(results) == set(IMPLEMENTATIONS)
    for name, r in results.items():
        if name in SMOOTHED:  # a smoothed target's field: checked against itself in float64
            assert r["max_abs_diff_vs_float64"] < 1e-4, name
            continue
        assert r["max_abs_diff_vs_naive"] < 1e-4, name
        assert r["x_floor"] == pytest.approx(r["median"] / rows[0]["floor_s"])
    assert rows[0]["gemm"]["size"] == 32 and rows[0]["gemm"]["gflops"] > 0
    peak = measure_peak_here("nw_mean", 256, 16, 4)
    assert peak["peak_mib"] >= 0 and peak["method"]


def test_streaming_recorder_memory_is_independent_of_query_count() -> None:
    rows = bench_recorder_memory([16, 64], steps=2, hidden=32)
    streaming = {r["queries"]: r["bytes"]["streaming"] for r in rows}
    maps = {r["queries"]: r["bytes"]["maps_fp16"] for r in rows}
    assert streaming[16] == streaming[64] > 0
    assert maps[64] > maps[16] > streaming[16]


def test_tensor_bytes_counts_each_storage_once() -> None:
    x = torch.zeros(10)
    holder = {"a": [x, x[2:]], "b": (torch.zeros(3, dtype=torch.float64),), "m": torch.nn.Linear(100, 100)}
    assert tensor_bytes(holder) == 10 * 4 + 3 * 8


def test_run_quick_cli_writes_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks.run as run

    plan = {**run.PLANS["quick"], "recorder_queries": [16]}
    monkeypatch.setitem(run.PLANS, "quick", plan)
    out = tmp_path / "r.json"
    res = main(["--quick", "--sections", "recorder", "--threads", "1", "--out", str(out)])
    assert out.exists() and res["sections"]["recorder"][0]["queries"] == 16
    assert "streaming bytes" in table(["streaming bytes"], [["1"]])


@contextlib.contextmanager
def count_host_syncs() -> Iterator[list[tuple[str, str]]]:
    """Patch the Python-level sync points of torch.Tensor; yield the calls made from nw_adapter.

    Each entry is ``(method, "file:line")`` of the innermost nw_adapter frame on the stack.
    """
    hits: list[tuple[str, str]] = []
    saved = {}
    for name in SYNC_METHODS:
        saved[name] = (name in vars(torch.Tensor), getattr(torch.Tensor, name))

        def wrapper(self, *args, __name=name, __orig=saved[name][1], **kwargs):
            frame = sys._getframe(1)
            while frame is not None:
                if frame.f_code.co_filename.startswith(NW_ADAPTER_DIR):
                    hits.append((__name, f"{frame.f_code.co_filename}:{frame.f_lineno}"))
                    break
                frame = frame.f_back
            return __orig(self, *args, **kwargs)

        setattr(torch.Tensor, name, wrapper)
    try:
        yield hits
    finally:
        for name, (own, orig) in saved.items():
            if own:
                setattr(torch.Tensor, name, orig)
            else:
                delattr(torch.Tensor, name)


def test_sync_counter_detects_a_sync_in_nw_adapter() -> None:
    from nw_adapter.core.kernels import nw_weights

    with count_host_syncs() as hits:
        nw_weights(torch.randn(4, 3), torch.randn(5, 3), 1.0, validate=True)  # value checks sync
    assert hits and all(path.startswith(NW_ADAPTER_DIR) for _, path in hits)


@pytest.mark.parametrize("mode", ["observe", "swap"])
def test_nw_processor_makes_no_host_sync_per_layer(mode: str) -> None:
    from nw_adapter.integration.mixin import apply_nw_processor, remove_nw_processor

    unet = build_unet(TOY_UNET_CONFIG)
    kwargs = unet_inputs(unet, latent_size=8, image_embed_dim=1024)
    recorder = apply_nw_processor(unet, mode=mode, cfg=True, statistics=True)
    try:
        with torch.no_grad():
            unet(**kwargs)  # warm-up: lazy imports and one-time set-up are allowed to sync
            with count_host_syncs() as hits:
                for _ in range(2):
                    unet(**kwargs)
    finally:
        remove_nw_processor(unet)
    assert len(recorder) > 0, "the NW processors did not record anything"
    assert hits == [], f"host syncs in the {mode} path: {hits[:5]}"
