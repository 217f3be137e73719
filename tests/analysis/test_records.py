"""records.py: the one aggregation / summary / CSV / figure of records (recorder and report share it)."""

from __future__ import annotations

import csv
import io
import math

import pytest

from nw_adapter.analysis.records import (
    CSV_COLUMNS,
    Records,
    aggregate,
    block_of,
    csv_text,
    nan_reasons,
)
from nw_adapter.integration.schema import RECORD_KEYS, RUN_KEYS, STAT_NAMES, SUMMARY_STATS


def _record(step: int, half: str, layer: str, rho: float, **extra) -> dict:
    base = {
        "call": 0, "step": step, "timestep": 900.0 - 300 * step, "alpha": 0.5, "sigma": 0.8,
        "h_schedule": 1.6, "layer": layer, "block": block_of(layer), "head": 0, "half": half,
        "adapter": 0, "image": 0, "scale": 1.0, "num_keys": 4, "key_set": "ip",
    }  # fmt: skip
    stats = {name: 0.1 * (i + 1) for i, name in enumerate(STAT_NAMES)}
    return {**base, **stats, "rho": rho, **extra}


def _records() -> list[dict]:
    layers = ("down_blocks.0.a", "up_blocks.1.a")
    return [
        _record(step, half, layer, rho=0.2 * step + 0.1 * j + (0.05 if half == "cond" else 0.0))
        for step in range(3)
        for half in ("uncond", "cond")
        for j, layer in enumerate(layers)
    ]


def test_aggregate_means_per_group_and_half():
    rows = aggregate(_records(), ("step",), half="cond")
    assert [r["step"] for r in rows] == [0, 1, 2] and {r["half"] for r in rows} == {"cond"}
    for r in rows:
        expected = [0.2 * r["step"] + 0.1 * j + 0.05 for j in range(2)]
        assert r["rho"] == pytest.approx(sum(expected) / 2)
        assert r["count"] == 2 and r["nonfinite"] == {}
        assert r["timestep"] == 900.0 - 300 * r["step"]
        assert r["frac_rho_gt_0_9"] == sum(v > 0.9 for v in expected) / 2
    blocks = aggregate(_records(), ("block", "step"), half="uncond")
    assert [(r["block"], r["step"]) for r in blocks] == [(b, s) for b in ("down", "up") for s in range(3)]


def test_nonfinite_values_are_counted_not_dropped_silently():
    records = _records()
    records[2]["kl"] = math.nan  # step 0, cond, first layer
    records[2]["rho"] = math.nan
    row = aggregate(records, ("step", "half"))[0]  # step 0, cond (sorted: "cond" < "uncond")
    assert row["half"] == "cond" and row["nonfinite"] == {"rho": 1, "kl": 1}
    assert row["kl"] == pytest.approx(records[3]["kl"])
    all_nan = [{**r, "pearson": math.nan} for r in records]
    assert math.isnan(aggregate(all_nan, ("step",), half="cond")[0]["pearson"])


def test_step_columns_keep_the_common_value_even_when_infinite():
    records = [{**r, "h_schedule": math.inf, "alpha": 0.0} for r in _records()]
    row = Records(records).summary()[0]
    assert row["h_schedule"] == math.inf and row["alpha"] == 0.0
    disagree = [{**r, "timestep": 100.0 + i} for i, r in enumerate(_records()[:2])]
    assert aggregate(disagree, ("step",))[0]["timestep"] == pytest.approx(100.5)


def test_summary_rows_match_a_direct_computation():
    records = [{**_records()[0], "ip_mass": 0.25}, *_records()]
    summary = Records(records).summary()
    assert [(r["call"], r["step"], r["half"]) for r in summary] == [
        (0, s, h) for s in range(3) for h in ("cond", "uncond")
    ]
    first = summary[1]  # step 0, uncond: three records, one with ip_mass
    members = [r for r in records if r["step"] == 0 and r["half"] == "uncond"]
    assert first["count"] == 3
    assert first["rho"] == pytest.approx(sum(r["rho"] for r in members) / 3)
    assert first["ip_mass"] == pytest.approx(0.25) and first["nonfinite"] == {"ip_mass": 2}
    assert list(first)[:7] == ["call", "step", "half", "timestep", "alpha", "sigma", "h_schedule"]
    assert "ip_mass" not in summary[0]  # the optional statistic only where the group's first record has it
    assert "rho" in repr(summary).splitlines()[2].split()  # the header, under what the table shows


def test_summary_counts_the_nan_reasons_of_h_eff():
    reason = "query-blind attention (1 - r2_key < 1e-6): no bandwidth of a query smoother is identified"
    records = _records()
    for r in records[:2]:
        r.update(h_eff=math.nan, h_eff_reason=reason)
    rows = aggregate(records, ("call", "step", "half"))
    assert sum(row["nan_reasons"].get("h_eff", {}).get(reason, 0) for row in rows) == 2
    assert all(set(row["nan_reasons"]) <= {"h_eff"} for row in rows)
    assert nan_reasons(records) == {"h_eff": {reason: 2}} and nan_reasons(records[2:]) == {}


def test_legacy_names_are_read_as_their_current_names():
    rename = {"rho_norm_matched_null": "rho_norm_null"}
    old = [{rename.get(k, k): v for k, v in r.items()} for r in _records()]
    assert aggregate(old, ("step",), half="cond")[0]["rho_norm_matched_null"] == pytest.approx(
        aggregate(_records(), ("step",), half="cond")[0]["rho_norm_matched_null"]
    )


def test_csv_orders_columns_and_keeps_extra_keys():
    records = [{**r, "reference": "img", "zzz": 1, "ip_mass": None, "run": "r1"} for r in _records()]
    header = next(csv.reader(io.StringIO(csv_text(records))))
    absent = (*RUN_KEYS[1:], "h_eff_reason")  # not in these records
    assert header == [c for c in CSV_COLUMNS if c not in absent] + ["ip_mass", "zzz"]
    assert header.index("run") == header.index("key_set") + 1  # the run fields follow the record keys
    report_order = ("reference", *RECORD_KEYS, *RUN_KEYS, *SUMMARY_STATS)
    header = next(csv.reader(io.StringIO(csv_text(records, order=report_order))))
    assert header[-3:] == ["bandwidth", "ip_mass", "zzz"]
    rows = list(csv.DictReader(io.StringIO(csv_text(records))))
    assert rows[0]["ip_mass"] == "" and float(rows[0]["rho"]) == pytest.approx(records[0]["rho"])
    assert Records().csv_text().strip().split(",") == [*RECORD_KEYS, *STAT_NAMES]


def test_plot_draws_one_panel_per_block_as_the_command_line_and_refuses_nothing(tmp_path):
    fig = Records(_records()).plot(path=tmp_path / "rho.png")
    assert (tmp_path / "rho.png").stat().st_size > 0
    assert [ax.get_title() for ax in fig.axes] == ["down block", "up block"]
    assert all(len(ax.lines[0].get_xdata()) == 3 for ax in fig.axes)
    with pytest.raises(ValueError, match="nothing recorded"):
        Records().plot()
    with pytest.raises(ValueError, match="no records of half 'all'"):
        Records(_records()).plot(half="all")


def test_swap_without_statistics_says_why_nothing_was_recorded():
    from nw_adapter.integration.config import NWProcessorConfig
    from nw_adapter.integration.recorder import NWRecorder

    rec = NWRecorder(NWProcessorConfig(mode="swap"))
    assert "swap mode records no statistics unless asked; pass statistics=True" in repr(rec.summary())
    with pytest.raises(ValueError, match="swap mode records no statistics unless asked"):
        rec.plot()
    observe = NWRecorder(NWProcessorConfig(mode="observe"))  # nothing run yet: no such claim
    assert repr(observe.summary()) == "(no records)"
    with pytest.raises(ValueError, match="run the pipeline first"):
        observe.plot()


def test_to_dataframe_without_pandas_names_the_extra(monkeypatch):
    import sys

    from nw_adapter.analysis.records import Records

    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas then raises ImportError
    with pytest.raises(ImportError, match=r"nw-adapter\[dataframe\]"):
        Records([]).to_dataframe()


def test_records_name_their_run_model_mode_and_reference_content():
    """Every record carries its recorder's run, the model, the mode and a digest of the call's
    IP-Adapter image embeddings (hashed once per call): one reference content is one unit of the
    verdict, and two recorders' records are two runs it refuses to pool."""
    import torch

    from nw_adapter import load_tiny_digits, tiny_digit_image, verdict
    from nw_adapter.analysis.validation import RecordError
    from nw_adapter.integration.mixin import nw_processor

    pipe = load_tiny_digits()
    digests = []
    with nw_processor(pipe, mode="observe") as rec:
        for digit in (3, 3, 5):
            seeded = torch.Generator().manual_seed(digit)
            pipe(prompt="", ip_adapter_image=tiny_digit_image(digit), num_inference_steps=2, generator=seeded)
        records = rec.to_records()
    for call in range(3):
        found = {(r["run"], r["model"], r["mode"], r["input_digest"]) for r in records if r["call"] == call}
        assert len(found) == 1, found
        digests.append(found.pop()[3])
    assert digests[0] == digests[1] != digests[2] and len(digests[0]) == 16
    assert {r["mode"] for r in records} == {"observe"} and {r["run"] for r in records} == {rec.run_id}
    assert records[0]["model"] == str(pipe.name_or_path)
    result = verdict(records)
    assert result["images"] == 2 and result["duplicates_merged"] == 1
    with nw_processor(pipe, mode="observe") as other:
        pipe(prompt="", ip_adapter_image=tiny_digit_image(7), num_inference_steps=2)
    with pytest.raises(RecordError, match="2 different runs"):
        verdict(records + other.to_records())


def test_input_digest_reads_the_image_embeddings_of_every_family():
    """UNets pass them in added_cond_kwargs, SD3 and Flux in joint_attention_kwargs."""
    import torch

    from nw_adapter.integration.steps import input_digest

    embeds = torch.arange(12.0).reshape(2, 1, 6)
    unet = input_digest({"added_cond_kwargs": {"image_embeds": [embeds]}})
    flow = input_digest({"joint_attention_kwargs": {"ip_adapter_image_embeds": [embeds.clone()]}})
    assert unet == flow and len(unet) == 16
    assert input_digest({"added_cond_kwargs": {"image_embeds": [embeds + 1]}}) != unet
    assert input_digest({"added_cond_kwargs": {"image_embeds": [embeds.reshape(2, 6, 1)]}}) != unet  # shape
    assert input_digest({"added_cond_kwargs": {"image_embeds": [embeds.half()]}}) == unet  # values, not dtype
    assert input_digest({}) is None and input_digest({"added_cond_kwargs": {"text_embeds": embeds}}) is None
