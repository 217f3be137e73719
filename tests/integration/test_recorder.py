"""NWRecorder: statistics against captured maps in a real pipeline run, exports, bounded maps."""

from __future__ import annotations

import csv
import json
import math
import warnings

import numpy as np
import pytest
import torch
from diffusers.models.attention_processor import Attention, IPAdapterAttnProcessor2_0
from safetensors import safe_open
from scipy.stats import rankdata
from tiny_helpers import generate

from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.processors import nw_processor_for
from nw_adapter.integration.recorder import STAT_NAMES, NWRecorder, block_of
from nw_adapter.integration.schema import NULL_STATS, READING_STATS
from nw_adapter.models.tiny import ip_adapter_weight_name
from nw_adapter.pipelines.pipeline_stable_diffusion_nw import StableDiffusionNWPipeline


@pytest.fixture(scope="module")
def pipe(tiny_sd15_dir, tiny_ip_adapter_dir):
    p = StableDiffusionNWPipeline.from_pretrained(tiny_sd15_dir)
    p.set_progress_bar_config(disable=True)
    p.load_ip_adapter(tiny_ip_adapter_dir, subfolder="models", weight_name=ip_adapter_weight_name("base"))
    return p


def _run(pipe, steps=2):
    generate(pipe, steps=steps, output_type="latent")


def _row_pearson(a, b):
    a = a - a.mean(-1, keepdims=True)
    b = b - b.mean(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1))


def _brute(A, W):
    """Per (batch, head) statistics of maps [B, H, N, M] in float64 numpy."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = (A + W) / 2
        kl = np.where(A > 0, A * np.log(A / W), 0.0).sum(-1)
        js = 0.5 * np.where(A > 0, A * np.log(A / r), 0).sum(-1)
        js = js + 0.5 * np.where(W > 0, W * np.log(W / r), 0).sum(-1)
    return {
        "rho": np.nanmean(_row_pearson(rankdata(A, axis=-1), rankdata(W, axis=-1)), -1),
        "pearson": _row_pearson(A.reshape(*A.shape[:2], -1), W.reshape(*W.shape[:2], -1)),
        "kl": kl.mean(-1),
        "js": js.mean(-1),
        "neff_attn": (1 / (A**2).sum(-1)).mean(-1),
        "neff_nw": (1 / (W**2).sum(-1)).mean(-1),
        "top1": (A.argmax(-1) == W.argmax(-1)).mean(-1),
    }


@pytest.fixture(scope="module")
def observed(pipe):
    rec = pipe.set_ip_adapter_nw_processor(store_maps=True, map_dtype="float32")
    try:
        _run(pipe)
        _run(pipe, steps=1)
    finally:
        pipe.unset_ip_adapter_nw_processor()
    return rec


def test_every_record_matches_brute_force_from_maps(observed, pipe):
    maps = {k: v.double().numpy() for k, v in observed.maps().items()}
    records = observed.to_records()
    assert {r["call"] for r in records} == {0, 1}
    steps = {(r["call"], r["step"]) for r in records}
    assert len(steps) == 3 + 1  # PNDM: 2 steps -> 3 UNet calls (PLMS repeat), then 1 step
    assert len(records) == len(steps) * 4 * 2 * 2  # steps x layers x heads x halves
    cache = {}
    for r in records:
        name = f"call{r['call']}/step{r['step']}/{r['layer']}/adapter{r['adapter']}/image{r['image']}"
        if name not in cache:
            A, W = maps[f"{name}/attn"], maps[f"{name}/nw"]
            assert np.allclose(A.sum(-1), 1) and np.allclose(W.sum(-1), 1)
            with warnings.catch_warnings():  # all-NaN rows of the uncond half
                warnings.simplefilter("ignore", RuntimeWarning)
                stats = _brute(A, W)
                cache[name] = {k: np.nanmean(v.reshape(2, -1, v.shape[-1]), axis=1) for k, v in stats.items()}
        half = {"uncond": 0, "cond": 1}[r["half"]]
        for stat, value in cache[name].items():
            assert r[stat] == pytest.approx(value[half, r["head"]], rel=1e-4, abs=1e-5, nan_ok=True), (
                stat,
                r,
            )
        attn = pipe.unet.get_submodule(r["layer"].removesuffix(".processor"))
        d_k = attn.to_q.out_features // attn.heads
        assert r["bandwidth"] == pytest.approx(d_k**0.25)  # matched: h^2 = sqrt(d_k)
        assert r["block"] == block_of(r["layer"]) and r["num_keys"] == 4 and r["scale"] == 1.0
        if r["half"] == "cond":  # the uncond image tokens of the tiny adapter are identical: constant rows
            assert all(math.isfinite(r[k]) for k in ("rho", *NULL_STATS))


def test_exports(observed, tmp_path):
    records = observed.to_records()
    path = observed.to_json(tmp_path / "out" / "records.json")
    data = json.loads(path.read_text())
    assert data["schema"] == "nw-adapter/records" and data["schema_version"] == 1
    assert data["config"]["mode"] == "observe"
    assert len(data["records"]) == len(records)
    assert data["records"][0].keys() == records[0].keys()
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["records.json"]  # no temp file left
    csv_path = observed.to_csv(tmp_path / "rho.csv")
    with open(csv_path) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(records) and float(rows[3]["rho"]) == pytest.approx(records[3]["rho"])
    summary = observed.summary()
    assert len(summary) == 4 * 2  # (call, step) x half
    s0 = next(s for s in summary if (s["call"], s["step"], s["half"]) == (0, 1, "cond"))
    group = [r for r in records if (r["call"], r["step"], r["half"]) == (0, 1, "cond")]
    assert s0["rho"] == pytest.approx(np.nanmean([r["rho"] for r in group]))
    assert s0["frac_rho_gt_0_9"] == pytest.approx(np.mean([r["rho"] > 0.9 for r in group]))
    assert s0["count"] == len(group) and s0["timestep"] == group[0]["timestep"]
    assert data["summary"][0]["count"] == summary[0]["count"]


def test_summary_prints_as_a_table(observed):
    summary = observed.summary()
    text = repr(summary)
    lines = text.splitlines()
    assert lines[0].startswith("cond half: mean over layers, heads, adapters and images per step")
    assert lines[1].startswith("control: ")  # which control ran, as the command line says it
    notes = 3 if lines[2].startswith("note: ") else 2  # PNDM's shared timestep, as the command line
    header = lines[notes].split()
    assert header[:5] == ["call", "step", "timestep", "rho", "perm-null"]
    cond = [r for r in summary if r["half"] == "cond"]
    legend = lines[notes + 1 + len(cond) :]
    assert legend[0].startswith("legend") and len(legend) == 1 + len(header)  # every column shown, defined
    first = cond[0]
    row = lines[notes + 1].split()
    assert row[:3] == [str(first["call"]), str(first["step"]), f"{first['timestep']:.0f}"]
    assert str(summary) == text and isinstance(summary, list)
    assert all("frac_rho_gt_0_9" in row for row in summary)  # the rows keep every statistic


def test_from_json_round_trips_records_summary_and_config(observed, tmp_path):
    path = observed.to_json(tmp_path / "records.json")
    loaded = NWRecorder.from_json(path)
    assert loaded.config == observed.config and len(loaded) == len(observed)
    original, again = observed.to_records(), loaded.to_records()
    assert [r.keys() for r in again] == [r.keys() for r in original]
    for a, b in zip(original, again, strict=True):
        for key, value in a.items():
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(b[key])
            else:
                assert b[key] == value
    assert repr(loaded.summary()) == repr(observed.summary())


def test_from_json_reads_the_cli_report_and_refuses_other_files(tmp_path):
    records = [
        {"reference": "ref-1", "call": 0, "step": s, "timestep": t, "half": "cond", "rho": r,
         "rho_perm_null": 0.0, "rho_norm_null": 0.1, "layer": "up_blocks.1.a", "head": 0}
        for s, t, r in ((0, 981.0, 0.2), (1, 1.0, None))
    ]  # fmt: skip
    report = tmp_path / "rho.json"
    report.write_text(json.dumps({"schema": "nw-adapter/rho", "config": {"steps": 2}, "records": records}))
    loaded = NWRecorder.from_json(report)
    assert [r["reference"] for r in loaded.to_records()] == ["ref-1", "ref-1"]
    assert math.isnan(loaded.to_records()[1]["rho"])
    assert [row["rho"] for row in loaded.summary()][0] == pytest.approx(0.2)
    other = tmp_path / "other.json"
    other.write_text("null")
    with pytest.raises(ValueError, match="is not an nw-adapter records file"):
        NWRecorder.from_json(other)


def test_tidy_exports_dataframe_or_csv(observed, tmp_path, monkeypatch):
    import sys
    import types

    fake = types.ModuleType("pandas")

    class DataFrame:
        @classmethod
        def from_records(cls, records, columns):
            frame = cls()
            frame.records, frame.columns = records, columns
            return frame

    fake.DataFrame = DataFrame
    monkeypatch.setitem(sys.modules, "pandas", fake)
    frame = observed.to_dataframe()
    assert frame.records == observed.to_records() and frame.columns[:3] == ["call", "step", "timestep"]
    monkeypatch.setitem(sys.modules, "pandas", None)  # not installed
    with pytest.raises(ImportError, match="use rec.to_csv"):
        observed.to_dataframe()


def test_plot_draws_rho_beside_each_null(observed, tmp_path):
    from PIL import Image

    from nw_adapter.analysis.records import aggregate

    fig = observed.plot(path=tmp_path / "rho.png")
    rows = aggregate(observed.records(), ("block", "step"), half="cond")
    blocks = [b for b in ("down", "mid", "up") if any(r["block"] == b for r in rows)]
    assert len(fig.axes) == len(blocks)  # one panel per UNet block, as the command line draws
    for ax, block in zip(fig.axes, blocks, strict=True):
        expected = sorted((r for r in rows if r["block"] == block), key=lambda r: -float(r["timestep"]))
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert list(lines["rho (attention vs NW)"].get_ydata()) == pytest.approx([r["rho"] for r in expected])
        spread = lines["q.k-spread null (key norms shuffled)"]
        assert list(spread.get_ydata()) == pytest.approx([r["rho_spread_null"] for r in expected])
    with Image.open(tmp_path / "rho.png") as img:
        assert img.format == "PNG"
    with pytest.raises(ValueError, match="nothing recorded"):
        NWRecorder().plot()


def test_save_maps_roundtrip(observed, tmp_path):
    path = observed.save_maps(tmp_path / "maps.safetensors")
    with safe_open(str(path), framework="pt") as fh:
        keys = set(fh.keys())
        meta = fh.metadata()
        some = next(iter(sorted(keys)))
        assert torch.equal(fh.get_tensor(some), observed.maps()[some].cpu())
    assert keys == set(observed.maps())
    assert json.loads(meta["config"])["store_maps"] is True


def _layer():
    torch.manual_seed(0)
    attn = Attention(32, cross_attention_dim=24, heads=2, dim_head=16).eval()
    stock = IPAdapterAttnProcessor2_0(32, 24, num_tokens=[4], scale=[1.0])
    torch.nn.init.normal_(stock.to_k_ip[0].weight)
    torch.nn.init.normal_(stock.to_v_ip[0].weight)
    gen = torch.Generator().manual_seed(1)
    args = (
        torch.randn(2, 8 * 12, 32, generator=gen),
        (torch.randn(2, 5, 24, generator=gen), [torch.randn(2, 1, 4, 24, generator=gen)]),
    )
    return attn, stock, args


def _observe(steps=1, layer="up_blocks.0.attn2.processor", **options):
    attn, stock, args = _layer()
    cfg = NWProcessorConfig(store_maps=True, **options)
    rec = NWRecorder(cfg)
    attn.set_processor(nw_processor_for(stock, layer_name=layer, config=cfg, recorder=rec))
    for step in range(steps):
        rec.begin_step(step=step, latent_hw=(16, 24))
        attn(*args)
    return rec


def test_map_options():
    full = _observe(map_dtype="float32")
    (name,) = {k.rsplit("/", 1)[0] for k in full.maps()}
    A = full.maps()[f"{name}/attn"]
    assert A.shape == (2, 2, 96, 4) and A.dtype == torch.float32
    assert _observe().maps()[f"{name}/attn"].dtype == torch.float16
    heads = _observe(map_heads=[1], map_dtype="float32").maps()[f"{name}/attn"]
    assert torch.equal(heads, A[:, 1:2])
    mean = _observe(map_head_mean=True, map_dtype="float32").maps()[f"{name}/nw"]
    assert torch.allclose(mean, full.maps()[f"{name}/nw"].mean(1, keepdim=True))
    down = _observe(map_downsample=2, map_dtype="float32").maps()[f"{name}/attn"]
    grid = A.permute(0, 1, 3, 2).reshape(2, 2, 4, 8, 12)
    pooled = grid.reshape(2, 2, 4, 4, 2, 6, 2).mean((-1, -3)).reshape(2, 2, 4, 24).permute(0, 1, 3, 2)
    assert down.shape == (2, 2, 24, 4) and torch.allclose(down, pooled, atol=1e-6)
    steps = _observe(steps=3, map_steps=[2])
    assert {k.split("/")[1] for k in steps.maps()} == {"step2"}
    assert _observe(map_layers=["down"]).maps() == {}
    assert len(_observe(map_layers=["up_blocks.0"]).maps()) == 2


def test_map_max_mb_bounds_memory():
    with pytest.warns(UserWarning, match="map_max_mb"):
        rec = _observe(steps=3, map_dtype="float32", map_max_mb=2 * 2 * 96 * 4 * 4 * 2 / 2**20 * 1.5)
    assert {k.split("/")[1] for k in rec.maps()} == {"step0"}
    assert len(rec.to_records()) == 3 * 2  # statistics keep streaming


def test_clear_and_errors(tmp_path):
    rec = _observe()
    assert len(rec) == 2 and "records=2" in repr(rec)
    rec.clear()
    assert rec.to_records() == [] and rec.maps() == {}
    assert rec.to_csv(tmp_path / "empty.csv").read_text().startswith("call,step,timestep")
    with pytest.raises(ValueError, match="store_maps=True"):
        NWRecorder(NWProcessorConfig()).save_maps(tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="stats must have shape"):
        rec.add(
            layer="l",
            adapter=0,
            image=0,
            halves=("all",),
            heads=(0,),
            scale=1.0,
            num_keys=4,
            stats=torch.zeros(3),
        )


def test_records_have_schema_keys(observed):
    required = {
        "call",
        "step",
        "timestep",
        "alpha",
        "sigma",
        "h_schedule",
        "layer",
        "block",
        "head",
        "half",
        "adapter",
        *STAT_NAMES,
    }
    assert required <= set(observed.to_records()[0])


def test_a_records_file_written_before_the_readings_still_loads(observed, tmp_path):
    """Files of the schema before issue 19 have no readings: they load, rho and the rest unchanged,
    and the readings average to NaN (counted as missing), never a rejection."""
    path = observed.to_json(tmp_path / "records.json")
    document = json.loads(path.read_text())
    for record in document["records"]:
        for name in READING_STATS:
            record.pop(name)
    document["config"].pop("readings")
    document["config"].pop("fit_rows")
    old = tmp_path / "old.json"
    old.write_text(json.dumps(document))
    loaded = NWRecorder.from_json(old)
    assert len(loaded) == len(observed) and loaded.config.readings  # the current default
    now, before = observed.summary()[0], loaded.summary()[0]
    assert before["rho"] == now["rho"] and math.isfinite(now["r2_key"])
    assert math.isnan(before["r2_key"]) and before["nonfinite"]["r2_key"] == now["count"]


def _record_with_zero_ip_keys(pipe, **config) -> NWRecorder:
    """One observed step with every ``to_k_ip`` weight zeroed (image keys 0: uniform attention, the
    same for every query), the weights restored afterwards; the recorder of that step."""
    saved = [
        (linear.weight, linear.weight.detach().clone())
        for proc in pipe.unet.attn_processors.values()
        if isinstance(proc, IPAdapterAttnProcessor2_0)
        for linear in proc.to_k_ip
    ]
    assert saved
    try:
        with torch.no_grad():
            for weight, _ in saved:
                weight.zero_()
        rec = pipe.set_ip_adapter_nw_processor(**config)
        try:
            _run(pipe, steps=1)
        finally:
            pipe.unset_ip_adapter_nw_processor()
    finally:
        with torch.no_grad():
            for weight, value in saved:
                weight.copy_(value)
    return rec


def test_query_blind_heads_record_h_eff_nan_with_its_reason_and_the_summary_counts_them(
    pipe, observed, tmp_path
):
    """Zero-initialised IP key projections (the degenerate recipe of issue 26: every image key is
    0) give uniform attention, the same for every query: no bandwidth is identified. Every record
    has h_eff NaN with the query-blind reason; the summary and the records file count them; the
    trained adapter's records keep their numbers (reason None)."""
    from nw_adapter.core.specification import H_EFF_REASONS

    rec = _record_with_zero_ip_keys(pipe)
    records = rec.to_records()
    blind = H_EFF_REASONS[1]
    assert records and all(math.isnan(r["h_eff"]) and r["h_eff_reason"] == blind for r in records)
    for row in rec.summary():
        assert row["nan_reasons"] == {"h_eff": {blind: row["count"]}}
    document = json.loads(rec.to_json(tmp_path / "records.json").read_text())
    assert document["summary"][0]["nan_reasons"] == {"h_eff": {blind: document["summary"][0]["count"]}}
    assert NWRecorder.from_json(tmp_path / "records.json").summary() == rec.summary()
    csv_rows = list(csv.DictReader(open(rec.to_csv(tmp_path / "records.csv"), newline="")))
    assert {row["h_eff_reason"] for row in csv_rows} == {blind}
    assert all(r["h_eff_reason"] is None and math.isfinite(r["h_eff"]) for r in observed.to_records())
    assert all(row["nan_reasons"] == {} for row in observed.summary())


def test_the_controls_unidentified_h_eff_is_nan_with_its_reason_per_draw(pipe) -> None:
    """Zero trained keys give scale-matched control keys of RMS 0 too (k0 * 0 / rms(k0)): every
    draw's attention is uniform, so each draw's h_eff is NaN with the query-blind reason in
    ``h_eff_control_{k}_reason``, which the verdict counts as skipped."""
    from nw_adapter.core.specification import H_EFF_REASONS
    from nw_adapter.correlate.verdict import skipped_values

    rec = _record_with_zero_ip_keys(pipe, untrained_control=True, untrained_draws=2)
    records = rec.to_records()
    blind = H_EFF_REASONS[1]
    for k in range(2):
        assert records and all(
            math.isnan(r[f"h_eff_control_{k}"]) and r[f"h_eff_control_{k}_reason"] == blind for r in records
        )
    half = records[0]["half"]
    skipped = skipped_values(records, half, ["h_eff_control_0"])
    assert skipped["h_eff_control_0"]["reasons"] == {blind: sum(r["half"] == half for r in records)}


def test_the_controls_identified_h_eff_has_no_reason(pipe) -> None:
    rec = pipe.set_ip_adapter_nw_processor(untrained_control=True, untrained_draws=1)
    try:
        _run(pipe, steps=1)
    finally:
        pipe.unset_ip_adapter_nw_processor()
    records = rec.to_records()
    assert records and all(
        (r["h_eff_control_0_reason"] is None) == math.isfinite(r["h_eff_control_0"]) for r in records
    )
    assert any(r["h_eff_control_0_reason"] is None for r in records)
