"""The verdict over reference images on synthetic records with every column.

Records are built per (image, step, layer, head) with chosen effects: rho above its nulls,
trained minus untrained readings, a bandwidth that follows the schedule, a rise over steps. Each
clause is checked against scipy's one-sided t test of the per-image values computed independently
(pandas), and the verdict is run on data built to have no effect (trained and untrained values
drawn from one distribution) to count how often it says "evidence".
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from nw_adapter.correlate.report import build_report, format_report
from nw_adapter.correlate.verdict import CLAUSES, format_verdict, image_step_means, verdict
from nw_adapter.integration.schema import NULL_STATS, UNTRAINED_STATS

LAYERS = ("down_blocks.0.attn2", "up_blocks.1.attn2")


def make_records(
    images: int = 6,
    steps: int = 5,
    *,
    seed: int = 0,
    beyond_nulls: float = 0.3,
    training: float = 0.1,
    bandwidth_slope: float = 1.0,
    rise: float = 0.2,
    image_sd: float = 0.05,
    noise: float = 0.05,
    untrained: bool = True,
    heads: int = 2,
) -> list[dict]:
    """Records of ``images`` reference images with the given effects (0 = none).

    Every image has its own random level (sd ``image_sd``) shared by its trained and untrained
    values, as a real image's difficulty would be; records add noise (sd ``noise``). With
    ``training=0`` trained and untrained values are exchangeable: drawn from one distribution.
    """
    rng = np.random.default_rng(seed)
    records = []
    for image in range(images):
        level = rng.normal(0.0, image_sd)
        gain_level = rng.normal(0.0, image_sd)
        for step in range(steps):
            h = 10.0 * 0.5**step
            progress = step / max(1, steps - 1)
            for layer in LAYERS:
                for head in range(heads):
                    for half in ("uncond", "cond"):
                        null = 0.3 + level + rng.normal(0, noise)
                        rho = null + beyond_nulls + rise * progress + rng.normal(0, noise)
                        record = {
                            "reference": f"img{image}", "call": 0, "step": step,
                            "timestep": 981.0 - 200 * step, "alpha": 0.5, "sigma": 0.5, "h_schedule": h,
                            "layer": layer, "block": layer.split("_")[0], "head": head, "half": half,
                            "adapter": 0, "image": 0,
                            "scale": 1.0, "num_keys": 4, "rho": rho, "kl": 0.1,
                            "rho_perm_null": rng.normal(0, noise),
                            "rho_norm_matched_null": null + rng.normal(0, noise),
                            "rho_spread_null": null + rng.normal(0, noise),
                            "nw_gain": gain_level + training + rng.normal(0, noise),
                            "h_eff": h**bandwidth_slope * math.exp(rng.normal(0, 0.1)),
                        }  # fmt: skip
                        if untrained:
                            record["rho_untrained"] = rho - training + rng.normal(0, noise)
                            record["nw_gain_untrained"] = gain_level + rng.normal(0, noise)
                            record["h_eff_untrained"] = 2.0 * math.exp(rng.normal(0, 0.1))
                        records.append(record)
    return records


def test_a_clear_effect_is_evidence_and_every_clause_holds() -> None:
    result = verdict(make_records())
    assert result["evidence"] is True and result["images"] == 6 and result["half"] == "cond"
    assert {key: c["holds"] for key, c in result["clauses"].items()} == dict.fromkeys(
        ("beyond_nulls", "training", "bandwidth", "rise"), True
    )
    text = format_verdict(result)
    assert text.startswith("verdict: evidence of learned kernel smoothing (6 reference images)")
    assert all(line.startswith("  ") and len(line) <= 110 for line in text.splitlines()[1:])
    bandwidth = result["clauses"]["bandwidth"]["parts"][0]
    assert bandwidth["mean"] == pytest.approx(1.0, abs=0.05)  # log h_eff follows log h, untrained flat


def test_per_image_values_and_tests_match_an_independent_computation() -> None:
    """Per image: mean over steps of the (layer, head) means; over images: scipy's t test and interval."""
    records = make_records(images=5, seed=4, beyond_nulls=0.02, training=0.01)
    result = verdict(records)
    frame = pd.DataFrame(records)
    frame = frame[frame["half"] == "cond"]
    steps = frame.groupby(["reference", "step"])[["rho", *NULL_STATS, "nw_gain", "nw_gain_untrained"]].mean()
    per_image = {
        "rho_minus_rho_spread_null": (steps["rho"] - steps["rho_spread_null"]),
        "nw_gain_minus_untrained": (steps["nw_gain"] - steps["nw_gain_untrained"]),
    }
    per_image = {key: diff.groupby("reference").mean() for key, diff in per_image.items()}
    parts = {p["key"]: p for c in result["clauses"].values() for p in c["parts"]}
    for key, expected in per_image.items():
        mine = {v["reference"]: v[key] for v in result["per_image"]}
        assert [mine[ref] for ref in expected.index] == pytest.approx(list(expected))
        test = stats.ttest_1samp(expected, 0.0, alternative="greater")
        interval = stats.t.interval(0.95, len(expected) - 1, loc=expected.mean(), scale=stats.sem(expected))
        assert parts[key]["p"] == pytest.approx(test.pvalue) and parts[key]["n"] == 5
        assert (parts[key]["low"], parts[key]["high"]) == pytest.approx(interval)
        assert parts[key]["significant"] is bool(test.pvalue < 0.05)


def test_bandwidths_are_averaged_as_logarithms() -> None:
    """One query-blind head with a huge h_eff does not dominate its step's bandwidth."""
    records = make_records(images=2, steps=2, heads=2, training=0.0)
    for record in records:
        record["h_eff"] = 1e6 if record["head"] == 0 else 1.0
    rows = image_step_means(records, "cond")["img0"]
    assert rows[0]["log_h_eff"] == pytest.approx(math.log(1e6) / 2)


def test_one_image_is_undecided_and_names_the_clauses_that_need_several() -> None:
    result = verdict(make_records(images=1))
    assert result["evidence"] is None and result["images"] == 1
    assert result["conclusion"] == "undecided: 1 reference image; pass several (--image-dir)"
    assert all(c["holds"] is None for c in result["clauses"].values())
    assert result["per_image"][0]["rho_minus_rho_spread_null"] > 0.2  # the image's values are kept
    text = format_verdict(result)
    assert text.count(": needs several reference images") == len(CLAUSES)
    value = result["per_image"][0]["rho_minus_rho_spread_null"]
    assert f"rho - qk-spread null: {value:+.3f} [n/a], p n/a, n 1" in text


def test_one_image_without_the_control_says_what_is_missing() -> None:
    result = verdict(make_records(images=1, untrained=False))
    assert result["evidence"] is None
    lines = format_verdict(result).splitlines()
    assert f"  {CLAUSES[0].label}: needs several reference images" in lines
    assert f"  {CLAUSES[1].label}: not measured: no nw_gain_untrained, rho_untrained" in lines
    assert f"  {CLAUSES[2].label}: not measured: no h_eff_untrained" in lines


def test_missing_untrained_columns_are_not_measured_never_evidence() -> None:
    """The control off (or an old rho.json): the training and bandwidth clauses say "not measured"."""
    result = verdict(make_records(untrained=False))
    assert result["evidence"] is False
    assert result["clauses"]["beyond_nulls"]["holds"] is True
    for key in ("training", "bandwidth"):
        clause = result["clauses"][key]
        assert clause["holds"] is None and clause["reason"].startswith("no ")
        assert "_untrained" in clause["reason"]
        assert all(p["measured"] is False and p["significant"] is None for p in clause["parts"])
    assert result["conclusion"].endswith("(6 reference images): adapter-vs-control clause not measured")
    line = f"{CLAUSES[1].label}: not measured: no nw_gain_untrained, rho_untrained"
    assert f"  {line}" in format_verdict(result).splitlines()


def test_old_records_without_readings_or_nulls_give_no_crash_and_no_evidence() -> None:
    records = make_records(images=3)
    for record in records:
        for name in ("nw_gain", "h_eff", "rho_spread_null", *UNTRAINED_STATS):
            record.pop(name, None)
        record["rho_norm_matched_null"] = math.nan  # nulls off
    result = verdict(records)
    assert result["evidence"] is False
    assert result["clauses"]["beyond_nulls"]["holds"] is None  # perm null passes, two not measured
    assert result["clauses"]["beyond_nulls"]["reason"] == "no rho_norm_matched_null, rho_spread_null"
    assert result["clauses"]["rise"]["holds"] is True
    format_verdict(result)


def test_a_clause_holds_only_when_every_part_is_significant() -> None:
    """Intersection-union: rho above the untrained control but nw_gain not -> the clause fails."""
    records = make_records(images=8, training=0.0)
    for record in records:
        record["rho_untrained"] = record["rho"] - 0.1
    result = verdict(records)
    parts = {p["key"]: p for p in result["clauses"]["training"]["parts"]}
    assert parts["rho_minus_untrained"]["significant"] is True
    assert parts["nw_gain_minus_untrained"]["significant"] is False
    assert result["clauses"]["training"]["holds"] is False and result["evidence"] is False
    assert result["conclusion"].endswith("adapter-vs-control clause not met")


def test_rho_at_its_nulls_fails_the_first_clause() -> None:
    result = verdict(make_records(beyond_nulls=0.0, rise=0.0, seed=2))
    assert result["clauses"]["beyond_nulls"]["holds"] is False and result["evidence"] is False
    assert "beyond-nulls clause not met" in result["conclusion"]


def test_a_falling_rho_does_not_rise() -> None:
    result = verdict(make_records(rise=-0.2))
    assert result["clauses"]["rise"]["holds"] is False
    assert result["clauses"]["rise"]["parts"][0]["mean"] == pytest.approx(-0.2, abs=0.05)


def test_no_records_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        verdict([])


def test_exchangeable_trained_and_untrained_say_evidence_at_most_alpha() -> None:
    """Data built to have no training effect: 200 data sets of 5-10 images, rho far above its nulls
    (the first clause holds), trained and untrained readings drawn from one distribution.

    Measured: "evidence" in 3 of 200 (its parts alone: 19 and 18 of 200; over 3000 other data sets
    of 6 images each part rejects in 5.1% and 5.9%, its size). The intersection-union bound is
    alpha = 10 of 200; the parts are independent here, so the rate is nearer alpha^2.
    """
    rng = np.random.default_rng(19)
    evidence = 0
    for dataset in range(200):
        images = int(rng.integers(5, 11))
        result = verdict(make_records(images, steps=3, seed=1000 + dataset, training=0.0, heads=1))
        assert result["clauses"]["beyond_nulls"]["holds"] is True
        evidence += result["evidence"] is True
    assert evidence <= 6, evidence  # well under alpha = 10 / 200


def test_each_part_rejects_at_about_alpha_under_no_effect() -> None:
    """The one-sided test of nw_gain - untrained alone: about 5% of 200 exchangeable data sets."""
    rejections = 0
    for dataset in range(200):
        result = verdict(make_records(6, steps=3, seed=5000 + dataset, training=0.0, heads=1))
        part = result["clauses"]["training"]["parts"][0]
        rejections += part["significant"] is True
    assert 2 <= rejections <= 20, rejections  # binomial(200, 0.05): 10 +- 3


def test_report_carries_the_verdict_and_prints_it() -> None:
    records = make_records(images=3)
    report = build_report(records, config={"steps": 5}, images=[], versions={}, targets=())
    assert report["verdict"]["images"] == 3 and report["verdict"]["evidence"] is True
    assert report["verdict"]["per_image"][0]["reference"] == "img0"
    assert format_verdict(report["verdict"]) in format_report(report)


def test_bandwidth_figure_draws_the_mean_log_h_eff_per_step_and_the_slope_one_line(tmp_path) -> None:
    from PIL import Image

    from nw_adapter.correlate.plotting import bandwidth_figure, plot_bandwidth

    records = make_records(images=3, steps=4)
    fig = bandwidth_figure(records, "cond")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    lines = {line.get_label(): line for line in ax.get_lines()}
    trained = lines["trained adapter (mean of 3 image(s))"]
    per_image = image_step_means(records, "cond")
    expected = [np.exp(np.mean([rows[s]["log_h_eff"] for rows in per_image.values()])) for s in range(4)]
    order = np.argsort(trained.get_xdata())
    np.testing.assert_allclose(np.asarray(trained.get_ydata())[order], sorted(expected))
    assert "untrained adapter (mean of 3 image(s))" in lines
    slope_one = lines["slope 1: h_eff = c h"]
    x, y = np.log(slope_one.get_xdata()), np.log(slope_one.get_ydata())
    assert np.polyfit(x, y, 1)[0] == pytest.approx(1.0)
    path = plot_bandwidth(records, "cond", tmp_path / "bandwidth.png")
    with Image.open(path) as img:
        assert img.format == "PNG"
    for record in records:
        record.pop("h_eff")
    assert plot_bandwidth(records, "cond", tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_records_without_a_reference_take_their_call_as_the_image() -> None:
    """A notebook loop (one pipeline call per reference, no ``reference`` key) gives one unit per call."""
    from nw_adapter import verdict as top_level_verdict

    records = []
    for call in range(3):
        for step in range(2):
            nulls = {"rho_perm_null": 0.0, "rho_norm_matched_null": 0.1, "rho_spread_null": 0.2}
            records.append({"call": call, "step": step, "half": "cond", "rho": 0.5 + 0.1 * call, **nulls})
    result = top_level_verdict(records)
    assert result["images"] == 3
    assert [image["reference"] for image in result["per_image"]] == ["call 0", "call 1", "call 2"]
