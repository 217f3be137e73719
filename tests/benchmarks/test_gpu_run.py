"""The GPU run's code paths, on the CPU: device/dtype plumbing, the CUDA-event timer (with fake
events), the CLI's refusal of an absent CUDA, the SDXL builder, the roofline arithmetic and the
width of the printed tables. No timing is asserted.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import benchmarks.run as run  # noqa: E402
from benchmarks.attention import bench_attention_layer, bench_unet_step, missing_option  # noqa: E402
from benchmarks.models import (  # noqa: E402
    SDXL_POOLED_DIM,
    SDXL_TIME_IDS,
    SDXL_UNET_CONFIG,
    TOY_UNET_CONFIG,
    build_unet,
    unet_inputs,
)
from benchmarks.nw_field import add_roofline, gemm_flop, nw_flop  # noqa: E402
from benchmarks.timing import CudaEventTimer, WallTimer, time_interleaved, timer_for  # noqa: E402
from nw_adapter.integration.config import NWProcessorConfig  # noqa: E402

#: A toy UNet with SDXL's extra structure: added text/time conditioning, 2 transformer layers.
TOY_SDXL_CONFIG = {
    **TOY_UNET_CONFIG,
    "transformer_layers_per_block": (1, 2),
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 8,
    "projection_class_embeddings_input_dim": SDXL_POOLED_DIM + SDXL_TIME_IDS * 8,
}


class FakeClock:
    """Fake CUDA events and synchronize that log the order of calls and tick a clock."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.now = 0.0

    def event(self) -> FakeClock.Event:
        return FakeClock.Event(self)

    def synchronize(self) -> None:
        self.log.append("sync")

    class Event:
        def __init__(self, clock: FakeClock) -> None:
            self.clock, self.at = clock, None

        def record(self) -> None:
            self.clock.log.append("record")
            self.at = self.clock.now

        def elapsed_time(self, end: FakeClock.Event) -> float:  # milliseconds, as torch.cuda.Event
            return end.at - self.at


def test_cuda_event_timer_syncs_only_outside_the_timed_region() -> None:
    clock = FakeClock()
    timer = CudaEventTimer(event_factory=clock.event, synchronize=clock.synchronize)

    def work() -> None:
        clock.log.append("work")
        clock.now += 25.0  # 25 ms of "device time"

    seconds = timer.time(work)
    assert seconds == pytest.approx(0.025)
    assert clock.log == ["sync", "record", "work", "record", "sync"]
    # through the interleaved harness: every timed call is bracketed the same way
    clock.log.clear()
    res = time_interleaved({"a": work, "b": work}, repeats=2, warmup=1, timer=timer)
    calls = [clock.log[i : i + 5] for i in range(0, len(clock.log), 5)]
    assert len(calls) == 6 and all(c == ["sync", "record", "work", "record", "sync"] for c in calls)
    assert res["a"]["median"] == pytest.approx(0.025) and res["a"]["first_call_s"] >= 0


def test_timer_for_picks_events_on_cuda_and_the_wall_clock_elsewhere() -> None:
    assert isinstance(timer_for("cuda"), CudaEventTimer)  # constructing it needs no GPU
    assert isinstance(timer_for(torch.device("cpu")), WallTimer)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is absent")
def test_cuda_without_cuda_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run.main(["--device", "cuda", "--dtype", "float16"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "CUDA is not available" in err and "--device cpu" in err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--device", "tpu0"], "not a torch device"),
        (["--dtype", "float8"], "--dtype"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, match, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run.main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and match in err


def test_compiled_variant_is_skipped_with_a_note_without_the_option() -> None:
    has_compile = "compile" in {f.name for f in dataclasses.fields(NWProcessorConfig)}
    note = missing_option("observe_compiled")
    assert (note is None) == has_compile
    assert missing_option("swap") is None
    if not has_compile:
        assert "compile" in note
        res = bench_attention_layer(
            32, 8, image_tokens=4, repeats=1, heads=2, cross=24, text_tokens=5, variants=("observe_compiled",)
        )
        assert set(res["results"]) == {"stock"} and "compile" in res["skipped"]["observe_compiled"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_plumbing_on_cpu(dtype: torch.dtype) -> None:
    torch.set_num_threads(1)
    res = bench_attention_layer(
        32, 16, image_tokens=4, repeats=1, heads=2, cross=24, text_tokens=5, dtype=dtype, variants=("swap",)
    )
    assert res["shape"]["dtype"] == str(dtype).removeprefix("torch.")
    unet = build_unet(TOY_UNET_CONFIG, dtype=dtype)
    assert {p.dtype for p in unet.parameters()} == {dtype}
    kwargs = unet_inputs(unet, latent_size=8, image_embed_dim=1024)
    assert kwargs["sample"].dtype == dtype and kwargs["added_cond_kwargs"]["image_embeds"][0].dtype == dtype
    res = bench_unet_step(latent_size=8, repeats=1, unet=unet, dtype=dtype, variants=("swap",))
    assert res["dtype"] == str(dtype).removeprefix("torch.") and res["results"]["swap"]["median"] > 0


def test_sdxl_builder_covers_every_transformer_layer_and_adds_text_time_inputs() -> None:
    torch.set_num_threads(1)
    unet = build_unet(TOY_SDXL_CONFIG, image_embed_dim=1280)
    attn2 = [n for n in unet.attn_processors if n.endswith("attn2.processor")]
    # down 1, up 2 (1 transformer layer each), mid 2 transformer layers: a one-layer-per-block
    # assumption (nw_adapter.models.tiny's SD 1.5 numbering) would give 4
    assert len(attn2) == 5 and sum(n.startswith("mid_block") for n in attn2) == 2
    assert all(type(unet.attn_processors[n]).__name__ == "IPAdapterAttnProcessor2_0" for n in attn2)
    kwargs = unet_inputs(unet, latent_size=8, image_embed_dim=1280)
    added = kwargs["added_cond_kwargs"]
    assert added["text_embeds"].shape == (2, SDXL_POOLED_DIM) and added["time_ids"].shape == (
        2,
        SDXL_TIME_IDS,
    )
    with torch.no_grad():
        assert unet(**kwargs).sample.shape == kwargs["sample"].shape


def test_sdxl_config_is_the_real_architecture() -> None:
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**SDXL_UNET_CONFIG)
    assert sum(p.numel() for p in unet.parameters()) == 2_567_463_684  # SDXL base 1.0's UNet
    assert sum(n.endswith("attn2.processor") for n in unet.attn_processors) == 70


def test_roofline_arithmetic() -> None:
    assert nw_flop(65536, 1024, 64) == 4 * 65536 * 1024 * 64  # the 17.2 GFLOP
    assert nw_flop(10, 20, 3, d_v=5) == 2 * 10 * 20 * 3 + 2 * 10 * 20 * 5
    assert gemm_flop(2048) == 2 * 2048**3
    entry = {
        "gemm": {"size": 1000, "median": 0.5},  # 2e9 FLOP in 0.5 s: 4 GFLOP/s
        "results": {"naive": {"median": 2.0}, "nw_mean": {"median": 0.25}},
    }
    add_roofline(entry, n=1000, m=100, d=5)  # 2e6 FLOP: floor 0.5 ms
    assert entry["gemm"]["gflops"] == pytest.approx(4.0)
    assert entry["flop"] == 2_000_000 and entry["floor_s"] == pytest.approx(5e-4)
    assert entry["results"]["nw_mean"]["x_floor"] == pytest.approx(500.0)


def test_floor_line_states_the_target_and_the_measured_sizes_above_it() -> None:
    def case(n: int, x: float, cpu: float | None = None) -> dict:
        result = {"x_floor": x} | ({} if cpu is None else {"x_floor_cpu": cpu})
        return {"n": n, "m": 8, "d": 4, "results": {"nw_mean": result}}

    met = run.floor_verdict([case(1, 1.1), case(2, 1.25)], 1.25)
    assert met.endswith("measured: within it at every size")
    line = run.floor_verdict([case(1, 1.1), case(2, 3.0)], 1.25)
    assert line.startswith("target: nw_mean <= 1.25x") and "missed" not in line
    assert "measured above it at" in line and "n=2" in line and "n=1 " not in line
    # CPU-time ratios, where every case has them, decide (a loaded machine inflates the wall clock)
    line = run.floor_verdict([case(1, 2.0, 1.1), case(2, 3.0, 1.3)], 1.25)
    assert "CPU time" in line and "n=2" in line and "n=1 " not in line


def test_roofline_from_cpu_times_only_on_the_cpu() -> None:
    def entry() -> dict:
        timing = {"median": 0.5, "cpu": {"median": 0.25}}
        return {"gemm": {"size": 1000, **timing}, "results": {"nw_mean": dict(timing)}}

    on_cpu = add_roofline(entry(), n=1000, m=100, d=5)
    assert on_cpu["gemm"]["cpu_gflops"] == pytest.approx(8.0)
    assert on_cpu["results"]["nw_mean"]["x_floor_cpu"] == pytest.approx(0.25 / on_cpu["cpu_floor_s"])
    on_gpu = add_roofline(entry(), n=1000, m=100, d=5, cpu=False)
    assert "x_floor_cpu" not in on_gpu["results"]["nw_mean"] and "x_floor" in on_gpu["results"]["nw_mean"]


def test_printed_tables_stay_under_120_characters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    plan = {
        **run.PLANS["quick"],
        "attention": [((32, 16), 4)],
        "attention_repeats": 1,
        "field": [(64, 8, 4)],
        "field_repeats": 1,
        "field_direct_max": 2**12,
    }
    monkeypatch.setitem(run.PLANS, "quick", plan)
    monkeypatch.setattr("benchmarks.nw_field.GEMM_SIZE", 64)
    monkeypatch.setattr("benchmarks.nw_field.measure_peak", lambda *a: {"peak_mib": 12345.6, "method": "x"})
    out, tables = tmp_path / "r.json", tmp_path / "t.txt"
    res = run.main(
        ["--quick", "--sections", "attention", "field", "--out", str(out), "--tables", str(tables)]
    )
    text = tables.read_text()
    assert "x floor" in text and "GF/s" in text and "roofline floor" in text
    assert max(len(line) for t in res["tables"].values() for line in t.splitlines()) <= 120


def test_unet_section_checkpoints_after_every_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The files are written after each model (torch.compile replaced by the identity: what is
    checked is the checkpointing, and inductor's C++ build of the side computation took ~140 s of
    the suite on an AMD EPYC of the pool)."""
    import benchmarks.attention as attention

    torch.set_num_threads(1)
    monkeypatch.setattr(torch, "compile", lambda function, **kwargs: function)
    monkeypatch.setitem(attention.UNET_MODELS, "toy", (TOY_UNET_CONFIG, 1024))
    plan = {"unet": [("toy", 8, 1, ("swap",)), ("toy", 4, 1, ("observe_compiled", "swap"))], "warmup": 1}
    saved: list[tuple[int, str]] = []
    out, text = run.run_unet(plan, torch.device("cpu"), torch.float32, lambda d, t: saved.append((len(d), t)))
    assert [n for n, _ in saved] == [1, 2] and all("partial" in t for _, t in saved)
    assert [entry["model"] for entry in out] == ["toy", "toy"]
    assert "partial" not in text and "8x8 (64 px)" in text and "4x4 (32 px)" in text
    if missing_option("observe_compiled") is not None:
        assert "observe_compiled: skipped: NWProcessorConfig has no compile option" in text
    assert max(len(line) for line in text.splitlines()) <= 120


def test_gpu_profile_runs_whole_calls_on_the_cpu(tmp_path) -> None:
    """benchmarks/gpu_run.sh's script on a toy UNet: every variant timed per step and profiled."""
    from benchmarks import gpu_profile

    args = ["--device", "cpu", "--dtype", "float32", "--models", "toy", "--forwards", "2", "--repeats", "1"]
    assert gpu_profile.main([*args, "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "profile.json").read_text())
    toy = result["models"]["toy"]
    assert set(toy) == {"stock", "observe", "swap"}
    assert toy["stock"]["ratio"] == 1.0 and all(v["step_ms"] > 0 for v in toy.values())
    assert toy["observe"]["aten_events_per_forward"] > toy["stock"]["aten_events_per_forward"]
    text = (tmp_path / "profile.txt").read_text()
    assert "| toy | observe |" in text and "top kernels" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_gpu_profile_refuses_cuda_without_cuda(capsys) -> None:
    from benchmarks import gpu_profile

    assert gpu_profile.main(["--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_gpu_profile_runs_observe_compiled_for_the_compiled_models(tmp_path, monkeypatch) -> None:
    """--compiled-models adds observe with compile=True to those models only, and the files are
    written after each model (torch.compile replaced by the identity: nothing is compiled here)."""
    from benchmarks import gpu_profile
    from nw_adapter.integration.stats import compiled

    monkeypatch.setattr(torch, "compile", lambda function, **kwargs: function)
    monkeypatch.setattr(compiled, "_COMPILED", {})
    written = []
    result = gpu_profile.run(
        ["toy"], torch.device("cpu"), torch.float32, forwards=2, repeats=1, compiled_models=["toy"],
        on_model=lambda out: written.append(sorted(out["models"])),
    )  # fmt: skip
    assert set(result["models"]["toy"]) == {"stock", "observe", "swap", "observe_compiled"}
    assert written == [["toy"]]
    assert compiled._COMPILED["fn"].seen  # the compiled function served the observed call


def test_gpu_run_script_runs_the_profile_under_its_cap() -> None:
    script = (Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_run.sh").read_text()
    assert "benchmarks/gpu_profile.py" in script and "--compiled-models sd15_512" in script
    assert "timeout --signal=INT --kill-after=10 290" in script
