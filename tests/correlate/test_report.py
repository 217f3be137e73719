"""Report logic on synthetic record lists: aggregation, step choice, table, verdict, files, plots."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from nw_adapter.atomic import atomic_write
from nw_adapter.correlate.plotting import panels_from_maps, plot_attention_maps, plot_rho
from nw_adapter.correlate.report import (
    PAPER_TIMESTEPS,
    STAT_FIELDS,
    aggregate,
    analysis_half,
    build_report,
    control_meta,
    format_report,
    format_table,
    format_verdict,
    parse_table,
    records_csv,
    select_steps,
    write_report_files,
)
from nw_adapter.integration.recorder import NWRecorder
from nw_adapter.integration.schema import NULL_STATS, control_column, key_scale_column

DDIM_50 = [981 - 20 * i for i in range(50)]  # SD 1.5, 50 DDIM steps, steps_offset=1


def make_records(
    timesteps=(981, 501, 1),
    layers=("down_blocks.0.a", "mid_block.a", "up_blocks.1.a"),
    heads=2,
    seed=0,
    references=("ref-a",),
    halves=("uncond", "cond"),
) -> list[dict]:
    """Records in the recorder's schema with rho rising over the steps, plus a ``reference`` key."""
    rng = random.Random(seed)
    records = []
    for reference in references:
        for step, t in enumerate(timesteps):
            for layer in layers:
                for head in range(heads):
                    for half in halves:
                        rho = 0.3 + 0.6 * step / max(1, len(timesteps) - 1) + rng.uniform(-0.05, 0.05)
                        record = {
                            "reference": reference,
                            "call": 0,
                            "step": step,
                            "timestep": float(t),
                            "alpha": 0.5,
                            "sigma": 0.5,
                            "h_schedule": 1.0,
                            "layer": layer,
                            "block": layer.split("_")[0],
                            "head": head,
                            "half": half,
                            "adapter": 0,
                            "image": 0,
                            "scale": 1.0,
                            "num_keys": 4,
                        }
                        for name in STAT_FIELDS:  # each in its range (the verdict refuses others)
                            u = rng.uniform(0, 1)
                            record[name] = (
                                1 + 3 * u if name.startswith("neff") else (0.69 * u if name == "js" else u)
                            )
                        record["rho"] = rho if half == "cond" else math.nan
                        records.append(record)
    return records


def test_aggregate_means_over_layers_heads_and_references() -> None:
    records = make_records(references=("a", "b"))
    rows = aggregate(records)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        members = [r for r in records if r["step"] == row["step"] and r["half"] == "cond"]
        assert row["count"] == len(members) == 2 * 3 * 2
        for name in STAT_FIELDS:
            assert row[name] == pytest.approx(sum(m[name] for m in members) / len(members))
        assert row["frac_rho_gt_0_9"] == sum(m["rho"] > 0.9 for m in members) / len(members)


def test_aggregate_matches_the_recorders_summary() -> None:
    records = make_records(seed=3)
    for r in records:
        r.pop("reference")
    ours = aggregate(records, half="cond")
    theirs = [s for s in NWRecorder().summary(records) if s["half"] == "cond"]
    assert len(ours) == len(theirs)
    for mine, other in zip(ours, theirs, strict=True):
        for name in STAT_FIELDS:
            assert mine[name] == pytest.approx(other[name])
        assert mine["frac_rho_gt_0_9"] == pytest.approx(other["frac_rho_gt_0_9"])
        assert mine["count"] == other["count"]


def test_nan_values_are_left_out_of_means_and_all_nan_gives_none() -> None:
    records = make_records(halves=("cond",))
    records[0]["pearson"] = math.nan
    row = aggregate(records)[0]
    kept = [r["pearson"] for r in records if r["step"] == 0 and not math.isnan(r["pearson"])]
    assert row["pearson"] == pytest.approx(sum(kept) / len(kept))
    assert aggregate(make_records(), half="uncond")[0]["rho"] is None


def test_analysis_half_prefers_cond_then_all() -> None:
    assert analysis_half(make_records()) == "cond"
    assert analysis_half(make_records(halves=("all",))) == "all"
    with pytest.raises(ValueError, match="nothing to report"):
        analysis_half([])


def test_select_steps_picks_the_papers_timesteps_from_50_ddim_steps() -> None:
    rows = [{"step": i, "timestep": float(t)} for i, t in enumerate(DDIM_50)]
    chosen = select_steps(rows)
    assert [r["timestep"] for r in chosen] == [981, 761, 501, 261, 1]
    assert [r["step"] for r in chosen] == [0, 11, 24, 36, 49]
    assert select_steps(rows, ()) == rows


def test_select_steps_with_few_steps_keeps_each_step_once() -> None:
    rows = [{"step": i, "timestep": float(t)} for i, t in enumerate((667, 334, 334, 1))]
    assert [r["step"] for r in select_steps(rows)] == [0, 1, 3]


def test_table_round_trips_and_shows_nan() -> None:
    rows = aggregate(make_records())
    rows[1]["kl"] = None
    text = format_table(rows)
    header = "step timestep rho perm-null norm-null spread-null KL nw-gain rho>0.9"
    assert text.splitlines()[0].split() == header.split()  # no untrained control: its columns are left out
    parsed = parse_table(text)
    assert parsed[1]["kl"] is None  # NaN prints as nan and reads back as None
    assert parsed[0]["nw_gain"] == pytest.approx(rows[0]["nw_gain"], abs=5e-5)
    for row, back in zip(rows, parsed, strict=True):
        assert back["step"] == row["step"] and back["timestep"] == round(row["timestep"])
        assert back["rho"] == pytest.approx(row["rho"], abs=5e-4)
        assert back["rho_spread_null"] == pytest.approx(row["rho_spread_null"], abs=5e-4)


def _with_control(records: list[dict], draws: int = 3) -> list[dict]:
    """The records with a scale-matched control of ``draws`` draws: draw k's rho -0.5 + 0.1 k,
    nw_gain -0.0123, key scale 2^(k - 1) (geometric mean 1 over three draws)."""
    for record in records:
        for k in range(draws):
            record.update({
                control_column("rho", k): -0.5 + 0.1 * k,
                control_column("nw_gain", k): -0.0123,
                key_scale_column(k): 2.0 ** (k - 1),
            })  # fmt: skip
    return records


def test_table_shows_the_readings_and_the_scale_matched_control_within_110_columns() -> None:
    records = make_records()
    for i, record in enumerate(records):
        record.update(nw_gain=0.01 * i)
    rows = aggregate(_with_control(records))
    text = format_table(rows)
    assert text.splitlines()[0].split()[-4:] == ["nw-gain", "rho-ctrl", "gain-ctrl", "rho>0.9"]
    assert max(len(line) for line in text.splitlines()) <= 110
    for row, back in zip(rows, parse_table(text), strict=True):
        assert back["nw_gain"] == pytest.approx(row["nw_gain"], abs=5e-5)
        assert back["rho_control"] == pytest.approx(-0.4)  # the draws' mean
        assert back["nw_gain_control"] == pytest.approx(-0.0123)
        assert row["key_scale"] == pytest.approx(1.0)  # the draws' geometric mean, in the rows
        assert row["control_draws"] == 3


def test_old_untrained_columns_are_no_control_of_the_table_but_still_averaged() -> None:
    """Files of earlier versions (one unmatched draw, ``*_untrained``) load: their columns are
    averaged into the rows as before, but the table's control columns are the scale-matched ones."""
    records = make_records()
    for record in records:
        record.update(rho_untrained=-0.5, nw_gain_untrained=-0.0123)
    rows = aggregate(records)
    assert all(row["rho_untrained"] == -0.5 and "rho_control" not in row for row in rows)
    assert "rho-ctrl" not in format_table(rows).splitlines()[0]


def test_the_report_carries_the_control_meta() -> None:
    records = _with_control(make_records(references=("ref-a",)), draws=2)
    config = {"untrained_control": True, "untrained_draws": 2, "untrained_seed": 5}
    report = build_report(records, config=config, images=[{"key": "ref-a"}], versions={})
    assert report["control"] == {
        "kind": "per-layer",
        "draws": 2,
        "seeds": [5, 6],
        "matched": "keys rescaled per layer and head to the trained keys' RMS norm",
    }
    off = build_report(records, config={"untrained_control": False}, images=[{"key": "ref-a"}], versions={})
    assert "control" not in off
    old = build_report(records, config={"untrained_control": True}, images=[{"key": "ref-a"}], versions={})
    assert "control" not in old  # an earlier version's one unmatched draw is not this control
    with pytest.raises(ValueError, match="kind"):
        control_meta(draws=1, seed=0, kind="both")


def test_non_finite_values_are_counted_not_silently_dropped() -> None:
    """[0.1, inf] does not aggregate to a bare 0.1: the row says one value was left out."""
    base = {"half": "cond", "timestep": 1, "step": 0, "rho": 0.5}
    rows = aggregate([{**base, "kl": 0.1}, {**base, "kl": math.inf}])
    assert rows[0]["kl"] == pytest.approx(0.1) and rows[0]["nonfinite"]["kl"] == 1
    summary = NWRecorder().summary(
        [
            {
                **base,
                "call": 0,
                "alpha": 1.0,
                "sigma": 0.0,
                "h_schedule": 0.0,
                **dict.fromkeys(STAT_FIELDS, 0.2),
                "kl": k,
            }
            for k in (0.1, math.inf)
        ]
    )
    assert summary[0]["kl"] == pytest.approx(0.1) and summary[0]["nonfinite"] == {"kl": 1}


def test_old_files_with_the_norm_equalised_name_are_read() -> None:
    rows = aggregate([{"half": "cond", "timestep": 1, "step": 0, "rho": 0.5, "rho_norm_null": 0.3}])
    assert rows[0]["rho_norm_matched_null"] == pytest.approx(0.3)


def test_build_report_schema_is_strict_json(tmp_path: Path) -> None:
    records = make_records(timesteps=DDIM_50)
    report = build_report(records, config={"steps": 50}, images=[{"key": "ref-a"}], versions={"torch": "x"})
    keys = "schema schema_version config versions images half table steps blocks verdict records"
    assert set(keys.split()) <= set(report)
    assert [r["timestep"] for r in report["table"]] == [981, 761, 501, 261, 1]
    assert {r["block"] for r in report["blocks"]} == {"down", "mid", "up"}
    paths = write_report_files(report, tmp_path)
    loaded = json.loads(paths["json"].read_text())  # strict: NaN became null
    assert loaded["records"][0]["rho"] is None and loaded["half"] == "cond"
    assert "NaN" not in paths["json"].read_text()
    rows = list(csv.DictReader(io.StringIO(paths["csv"].read_text())))
    assert len(rows) == len(records)
    assert list(rows[0])[:3] == ["reference", "call", "step"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rho.csv", "rho.json"]
    mask = os.umask(0o022)
    os.umask(mask)
    assert paths["json"].stat().st_mode & 0o777 == 0o666 & ~mask  # not mkstemp's 0600
    text = format_report(loaded)
    assert format_table(loaded["table"]) in text and format_verdict(loaded["verdict"]) in text


def test_records_csv_keeps_extra_keys() -> None:
    text = records_csv([{"step": 0, "rho": 0.5, "zzz": 1}])
    assert text.splitlines()[0] == "step,rho,zzz"


def test_atomic_write_leaves_nothing_when_the_writer_fails(tmp_path: Path) -> None:
    target = tmp_path / "rho.json"
    target.write_text("old")

    def fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(target, fail)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["rho.json"]


def test_plot_rho_writes_a_png(tmp_path: Path) -> None:
    report = build_report(make_records(), config={}, images=[], versions={})
    path = plot_rho(report["blocks"], tmp_path / "rho.png", title="synthetic")
    with Image.open(path) as img:
        assert img.format == "PNG" and img.width > 300
    assert [p.name for p in tmp_path.iterdir()] == ["rho.png"]
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_rho([], tmp_path / "empty.png")


def test_panels_average_layers_on_the_finest_grid_cond_row_and_top_tokens(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    fine = torch.zeros(2, 2, 32, 6)  # [batch, heads, rows = 8 x 4 grid, keys]
    fine[1, :, :, 5] = 1.0  # conditional row attends to token 5
    fine[1, :, :, 2] = 0.5
    fine[1, :, 3, 2] = 0.9
    coarse = torch.full((2, 2, 8, 6), 1 / 6)  # a 4 x 2 grid, upsampled x2 onto the 8 x 4 one
    coarse[1, :, 0, 2] = 0.4  # top-left cell of the coarse grid: fine rows (0,0),(0,1),(1,0),(1,1)
    maps = {
        "call0/step0/up_blocks.1.x/adapter0/image0/attn": fine,
        "call0/step0/up_blocks.1.x/adapter0/image0/nw": fine * 2,
        "call0/step0/mid_block.x/adapter0/image0/attn": coarse,
        "call0/step0/mid_block.x/adapter0/image0/nw": coarse,
    }
    panels = panels_from_maps(maps, timesteps={0: 981.0}, image_hw=(64, 32), cfg=True, max_tokens=2)
    assert [p.token for p in panels] == [2, 5]
    assert all(p.layers == ("mid_block.x", "up_blocks.1.x") and p.attn.shape == (8, 4) for p in panels)
    assert panels[0].attn[0, 3] == pytest.approx((0.9 + 1 / 6) / 2)  # fine row 3 = grid cell (0, 3)
    assert panels[0].attn[1, 1] == pytest.approx((0.5 + 0.4) / 2)  # coarse cell (0, 0) covers (1, 1)
    assert panels[0].nw[0, 3] == pytest.approx((1.8 + 1 / 6) / 2)
    generated = Image.fromarray(np.full((64, 32, 3), 128, dtype=np.uint8))
    path = plot_attention_maps(generated, panels, tmp_path / "maps.png")
    with Image.open(path) as img:
        assert img.format == "PNG"


def test_token_maps_select_steps_layers_heads_and_rows() -> None:
    from nw_adapter.correlate.maps import token_maps, upsample

    rng = np.random.default_rng(0)
    a0 = rng.random((2, 3, 16, 4))  # step 0, 4 x 4 grid, 3 heads
    a1 = rng.random((2, 3, 16, 4))  # step 1
    coarse = rng.random((2, 3, 4, 4))  # step 1, another layer, 2 x 2 grid
    maps = {
        "call0/step0/up_blocks.1/adapter0/image0/attn": a0,
        "call0/step1/up_blocks.1/adapter0/image0/attn": a1,
        "call0/step1/mid_block/adapter0/image0/attn": coarse,
        "call0/step1/mid_block/adapter0/image0/nw": coarse * 0,
    }

    def grid(m, row=-1, heads=slice(None)):
        return m[row][heads].mean(0).T.reshape(4, *((4, 4) if m.shape[2] == 16 else (2, 2)))

    out = token_maps(maps, "attn", image_hw=(32, 32))
    expected = (grid(a0) + grid(a1) + upsample(grid(coarse), (4, 4))) / 3
    np.testing.assert_allclose(out, expected)
    one = token_maps(maps, "attn", image_hw=(32, 32), steps=[0], heads=[1], batch_row=0)
    np.testing.assert_allclose(one, grid(a0, row=0, heads=[1]))
    up = token_maps(maps, "attn", image_hw=(32, 32), layers=["up_blocks"])
    np.testing.assert_allclose(up, (grid(a0) + grid(a1)) / 2)
    with pytest.raises(ValueError, match="no stored nw maps match"):
        token_maps(maps, "nw", image_hw=(32, 32), steps=[0])


def test_report_constants_match_the_paper() -> None:
    assert PAPER_TIMESTEPS == (981, 761, 501, 261, 1)


def test_pndm_repeated_timestep_is_explained_in_the_header() -> None:
    records = make_records(timesteps=(667, 334, 334, 1))
    config = {"steps": 3, "scheduler_class": "PNDMScheduler"}
    report = build_report(records, config=config, images=[], versions={}, targets=())
    header = format_report(report).splitlines()[0]
    assert "note: PNDMScheduler calls the denoiser twice at one timestep" in header
    assert "steps 1 and 2 share t=334" in header and "4 denoiser calls for 3 steps" in header
    plain = build_report(make_records(timesteps=(667, 334, 1)), config=config, images=[], versions={})
    assert "note:" not in format_report(plain).splitlines()[0]


def test_rho_plot_carries_the_repeated_timestep_note() -> None:
    from nw_adapter.correlate.plotting import rho_figure
    from nw_adapter.correlate.report import repeated_timestep_note

    config = {"steps": 3, "scheduler_class": "PNDMScheduler"}
    report = build_report(make_records(timesteps=(667, 334, 334, 1)), config=config, images=[], versions={})
    note = repeated_timestep_note(report)
    fig = rho_figure(report["blocks"], title="run", note=note)
    title = " ".join(fig._suptitle.get_text().split())  # wrapped to the figure's width
    assert title.startswith(f"run {note} control: ")


def test_rho_figure_draws_each_null_as_its_own_named_line() -> None:
    """Each null is a line of its own, named in the legend (not one min-max band that hides which
    null matters), and its values are the report's."""
    import numpy as np

    from nw_adapter.correlate.plotting import rho_figure

    report = build_report(make_records(timesteps=(981, 501, 1)), config={"steps": 3}, images=[], versions={})
    fig = rho_figure(report["blocks"], title="run")
    legend = [text.get_text() for text in fig.legends[0].get_texts()]
    assert legend[0].startswith("rho") and len(legend) == 4
    assert {"permutation", "norm-matched", "q.k-spread"} == {s.split(" null")[0] for s in legend[1:]}
    assert not any(type(c).__name__ == "PolyCollection" for ax in fig.axes for c in ax.collections)  # no band
    ax = fig.axes[0]
    block = ax.get_title().split(" ")[0]
    rows = sorted((r for r in report["blocks"] if r["block"] == block), key=lambda r: -r["timestep"])
    by_label = {line.get_label(): line for line in ax.get_lines()}
    for stat, label in zip(NULL_STATS, legend[1:], strict=True):
        np.testing.assert_allclose(by_label[label].get_ydata(), [r[stat] for r in rows])


@pytest.mark.parametrize(("model", "warned"), [("tiny-sd3", True), ("tiny-flux", True), ("tiny", False)])
def test_random_weight_models_say_their_numbers_mean_nothing(model, warned) -> None:
    from nw_adapter.correlate.report import format_report

    config = {"steps": 3, "model": {"model": model}}
    report = build_report(make_records(timesteps=(981, 1)), config=config, images=[], versions={})
    text = format_report(report)
    assert (report["warning"] is not None) is warned
    assert text.startswith(f"WARNING: {model} has random weights") is warned
    if warned:
        assert "say nothing about any trained model" in report["warning"]
