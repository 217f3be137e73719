"""The verdict over reference images x control draws on synthetic records with every column.

Records are built per (image, step, layer, head) with chosen effects: rho above its nulls,
trained minus scale-matched control readings (K control draws, each with an offset shared by every
image), a logit scale that follows the schedule's 1/h^2, a rise of rho with -log h. Each clause is
checked against an independent computation of the per-image values (pandas) and of the tests
(scipy), and the verdict is run on data built to have no effect (trained and control values drawn
from one distribution) to count how often it says "evidence".
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from nw_adapter.correlate.report import build_report, format_report
from nw_adapter.correlate.verdict import (
    CLAUSES,
    LEGACY_REASON,
    MARGINS,
    control_column,
    format_verdict,
    image_step_means,
    key_scale_column,
    verdict,
)
from nw_adapter.integration.schema import NULL_STATS, UNTRAINED_STATS

LAYERS = ("down_blocks.0.attn2", "up_blocks.1.attn2")


def _rho(x: float) -> float:
    """A correlation stays in [-1, 1] (the verdict refuses one outside)."""
    return max(-1.0, min(1.0, x))


def make_records(
    images: int = 6,
    steps: int = 5,
    *,
    seed: int = 0,
    beyond_nulls: float = 0.3,
    training: float = 0.1,
    exponent: float = 2.0,
    rise: float = 0.2,
    image_sd: float = 0.05,
    noise: float = 0.05,
    draws: int = 3,
    draw_sd: float = 0.0,
    scale_ratio: float = 1.3,
    legacy: bool = False,
    heads: int = 2,
    form: float = 0.99,
    control_exponent: float = 0.0,
) -> list[dict]:
    """Records of ``images`` reference images with the given effects (0 = none).

    Every image has its own random level (sd ``image_sd``) shared by its trained and control
    values, as a real image's difficulty would be; records add noise (sd ``noise``); control draw
    ``k`` adds an offset (sd ``draw_sd``) shared by every image. The trained values exceed the
    control's by ``training`` (nw_gain and rho), by ``exponent`` in ``-d log logit_scale / d log h``
    (the control's is ``control_exponent``, 0 by default) and by ``rise`` in the slope of rho on
    ``-log h`` (the control's is 0); ``r2_nw`` is ``form`` (the NW form: 0.99 by default; a dot
    product reads less), the control's 0.7.
    ``draws=0`` records no control; ``legacy=True`` the one raw ``*_untrained`` draw of older files.
    """
    rng = np.random.default_rng(seed)
    offsets = rng.normal(0.0, draw_sd, size=(max(draws, 1), 2))
    records = []
    for image in range(images):
        level = rng.normal(0.0, image_sd)
        gain_level = rng.normal(0.0, image_sd)
        log_scale = rng.normal(0.0, 0.3)
        for step in range(steps):
            h = 10.0 * 0.5**step
            up = (step - (steps - 1) / 2) * math.log(2.0)  # -log h, centred over the steps
            for layer in LAYERS:
                for head in range(heads):
                    for half in ("uncond", "cond"):
                        null = 0.3 + level + rng.normal(0, noise)
                        base = null + beyond_nulls
                        rho = _rho(base + rise * up + rng.normal(0, noise))
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
                            "h_eff": h * math.exp(rng.normal(0, 0.1)),
                            "logit_scale": math.exp(log_scale - exponent * math.log(h) + rng.normal(0, 0.1)),
                            "r2_nw": min(1.0, form + rng.normal(0, 0.002)),
                        }  # fmt: skip
                        for k in range(draws):
                            rho_k = _rho(base - training + offsets[k, 0] + rng.normal(0, noise))
                            gain_k = gain_level + offsets[k, 1] + rng.normal(0, noise)
                            record[control_column("rho", k)] = rho_k
                            record[control_column("nw_gain", k)] = gain_k
                            flat = log_scale - control_exponent * math.log(h) + rng.normal(0, 0.1)
                            record[control_column("logit_scale", k)] = math.exp(flat)
                            record[control_column("r2_nw", k)] = 0.7 + rng.normal(0, 0.01)
                            record[control_column("h_eff", k)] = 2.0 * math.exp(rng.normal(0, 0.1))
                            record[key_scale_column(k)] = scale_ratio * math.exp(rng.normal(0, 0.01))
                        if legacy:
                            record["rho_untrained"] = base - training + rng.normal(0, noise)
                            record["nw_gain_untrained"] = gain_level + rng.normal(0, noise)
                            record["h_eff_untrained"] = 2.0 * math.exp(rng.normal(0, 0.1))
                        records.append(record)
    return records


def test_a_clear_effect_is_evidence_and_every_clause_holds() -> None:
    result = verdict(make_records())
    assert result["evidence"] is True and result["images"] == 6 and result["half"] == "cond"
    assert result["draws"] == 3
    assert {key: c["holds"] for key, c in result["clauses"].items()} == dict.fromkeys(
        ("bandwidth", "nw_form", "training", "beyond_nulls", "rise"), True
    )
    text = format_verdict(result)
    assert text.startswith("verdict: evidence of kernel smoothing on the schedule (6 reference images)")
    assert "bandwidth clause and NW-form clause met; nearer the exact head" in result["conclusion"]
    assert all(line.startswith("  ") and len(line) <= 110 for line in text.splitlines()[1:])
    parts = {p["key"]: p for p in result["clauses"]["bandwidth"]["parts"]}
    bandwidth = parts["exponent_minus_control"]
    assert bandwidth["mean"] == pytest.approx(2.0, abs=0.1)  # logit scale ~ 1/h^2, the control's flat
    assert bandwidth["test"] == "two-level" and bandwidth["n"] == 6 and bandwidth["draws"] == 3
    theory = parts["exponent_theory"]
    assert theory["test"] == "equivalence (TOST)" and theory["significant"] and theory["target"] == 2.0
    assert all(p["status"] == "met" for c in result["clauses"].values() for p in c["parts"])
    assert result["anchors"]["exact"]["source"] == "theory" and result["position"]["nearer"] == "exact head"
    reported = {r["key"]: r for c in result["clauses"].values() for r in c["reported"]}
    assert reported["scale_ratio"]["mean"] == pytest.approx(1.3, rel=1e-2)  # reported, not tested
    assert reported["exponent"]["mean"] == pytest.approx(2.0, abs=0.1) and reported["exponent"]["theory"] == 2
    ratio = reported["scale_ratio"]["mean"]
    assert f"reported (not tested): scale ratio (key RMS trained / untrained): {ratio:.3f} [" in text


def _banerjee(matrix: np.ndarray, margin: float, alpha: float) -> tuple[bool, float]:
    """The two-level rule written out: significant, and the critical value at alpha."""
    r, k = matrix.shape
    a = matrix.mean(1).var(ddof=1) / r
    b = (1 + 1 / k) * matrix.mean(0).var(ddof=1)
    critical = math.sqrt(stats.t.isf(alpha, r - 1) ** 2 * a + stats.t.isf(alpha, k - 1) ** 2 * b)
    return bool(matrix.mean() - margin > critical), critical


def test_per_image_values_and_tests_match_an_independent_computation() -> None:
    """Per image: mean over steps of the (layer, head) means (the control's paired per record); over
    images: scipy's t test for the nulls, the two-level rule written out for the control's parts."""
    records = make_records(images=5, seed=4, beyond_nulls=0.02, training=0.01, draw_sd=0.01)
    result = verdict(records)
    frame = pd.DataFrame(records)
    frame = frame[frame["half"] == "cond"]
    steps = frame.groupby(["reference", "step"])[["rho", *NULL_STATS]].mean()
    spread = (steps["rho"] - steps["rho_spread_null"]).groupby("reference").mean()
    parts = {p["key"]: p for c in result["clauses"].values() for p in c["parts"]}
    mine = {v["reference"]: v for v in result["per_image"]}
    assert [mine[ref]["rho_minus_rho_spread_null"] for ref in spread.index] == pytest.approx(list(spread))
    test = stats.ttest_1samp(spread, 0.0, alternative="greater")
    interval = stats.t.interval(0.95, len(spread) - 1, loc=spread.mean(), scale=stats.sem(spread))
    assert parts["rho_minus_rho_spread_null"]["p"] == pytest.approx(test.pvalue)
    assert (parts["rho_minus_rho_spread_null"]["low"], parts["rho_minus_rho_spread_null"]["high"]) == (
        pytest.approx(interval)
    )
    gains = np.array([
        [(frame["nw_gain"] - frame[control_column("nw_gain", k)])[frame["reference"] == ref]
         .groupby(frame["step"]).mean().mean() for k in range(3)]
        for ref in spread.index
    ])  # fmt: skip
    np.testing.assert_allclose([mine[ref]["nw_gain_minus_control_draws"] for ref in spread.index], gains)
    part = parts["nw_gain_minus_control"]
    significant, _ = _banerjee(gains, MARGINS["nw_gain_minus_control"], 0.05)
    assert part["significant"] is significant and part["mean"] == pytest.approx(gains.mean())
    _, critical = _banerjee(gains, MARGINS["nw_gain_minus_control"], part["p"])  # p: where it just rejects
    assert gains.mean() - MARGINS["nw_gain_minus_control"] == pytest.approx(critical, rel=1e-6)
    _, half = _banerjee(gains, 0.0, 0.025)
    assert (part["low"], part["high"]) == pytest.approx((gains.mean() - half, gains.mean() + half))


def test_the_exponent_and_the_rise_are_ols_slopes_on_log_h_minus_the_controls() -> None:
    records = make_records(images=3, seed=7)
    result = verdict(records)
    frame = pd.DataFrame(records)
    frame = frame[(frame["half"] == "cond") & (frame["reference"] == "img1")]
    x = np.log(frame.groupby("step")["h_schedule"].mean())
    control_path = np.log(frame[control_column("logit_scale", 1)]) - np.log(frame[key_scale_column(1)])
    log_scale = np.log(frame["logit_scale"]) - control_path  # the control's scale matched once per run
    rise = frame["rho"] - frame[control_column("rho", 1)]
    image = next(v for v in result["per_image"] if v["reference"] == "img1")
    exponent = -np.polyfit(x, log_scale.groupby(frame["step"]).mean(), 1)[0]
    assert image["exponent_minus_control_draws"][1] == pytest.approx(exponent)
    slope = -np.polyfit(x, rise.groupby(frame["step"]).mean(), 1)[0]
    assert image["rise_minus_control_draws"][1] == pytest.approx(slope)
    assert image["exponent"] == pytest.approx(
        -np.polyfit(x, np.log(frame["logit_scale"]).groupby(frame["step"]).mean(), 1)[0]
    )


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
    assert " ".join(text.split()).count(": needs several reference images") == len(CLAUSES)
    value = result["per_image"][0]["rho_minus_rho_spread_null"]
    assert f"rho - qk-spread null: {value:+.3f} [n/a], p n/a, n 1" in text


def test_one_image_without_the_control_says_what_is_missing() -> None:
    result = verdict(make_records(images=1, draws=0))
    assert result["evidence"] is None
    lines = format_verdict(result).splitlines()
    clauses = {c.key: c for c in CLAUSES}
    assert f"  {clauses['beyond_nulls'].label}: needs several reference images [reported question]" in lines
    text = " ".join(" ".join(lines).split())
    assert f"{clauses['training'].label}: not measured: no nw_gain_control_<k>, rho_control_<k>" in text
    assert f"{clauses['bandwidth'].label}: not measured: no logit_scale_control_<k>" in text


def test_missing_control_columns_are_not_measured_never_evidence() -> None:
    """The control off: the training, bandwidth and rise clauses say "not measured"."""
    result = verdict(make_records(draws=0))
    assert result["evidence"] is False and result["draws"] == 0
    assert (
        result["clauses"]["beyond_nulls"]["holds"] is True and result["clauses"]["nw_form"]["holds"] is True
    )
    for key in ("training", "bandwidth", "rise"):
        clause = result["clauses"][key]
        assert clause["holds"] is None and clause["reason"].startswith("no ")
        assert "_control_<k>" in clause["reason"]
        against = [
            p for p in clause["parts"] if p["key"] != "exponent_theory"
        ]  # the theory's part needs none
        assert all(p["measured"] is False and p["significant"] is None for p in against)
    assert result["conclusion"].startswith(
        "no evidence of kernel smoothing on the schedule (6 reference images): "
        "bandwidth clause not measured, NW-form clause met"
    )


def test_an_old_file_with_the_one_raw_untrained_draw_is_not_measured_with_its_reason() -> None:
    """Files of c4889a3 and before: ``*_untrained`` columns (one unmatched draw), no logit_scale."""
    records = make_records(draws=0, legacy=True)
    for record in records:
        record.pop("logit_scale")
    result = verdict(records)
    assert result["evidence"] is False and result["clauses"]["beyond_nulls"]["holds"] is True
    for key in ("training", "bandwidth", "rise"):
        clause = result["clauses"][key]
        assert clause["holds"] is None and LEGACY_REASON in clause["reason"], clause["reason"]
    assert result["clauses"]["bandwidth"]["reason"].startswith("no logit_scale")
    text = " ".join(format_verdict(result).split())
    assert f"{CLAUSES[2].label}: not measured: {LEGACY_REASON}" in text


def test_old_records_without_readings_or_nulls_give_no_crash_and_no_evidence() -> None:
    records = make_records(images=3, draws=0, legacy=True)
    for record in records:
        for name in ("nw_gain", "h_eff", "logit_scale", "r2_nw", "rho_spread_null", *UNTRAINED_STATS):
            record.pop(name, None)
        record["rho_norm_matched_null"] = math.nan  # nulls off
    result = verdict(records)
    assert result["evidence"] is False
    assert result["clauses"]["beyond_nulls"]["holds"] is None  # perm null passes, two not measured
    assert result["clauses"]["beyond_nulls"]["reason"] == "no rho_norm_matched_null, rho_spread_null"
    assert result["clauses"]["rise"]["holds"] is None
    assert result["skipped"]["rho_norm_matched_null"]["count"] == 3 * 5 * 2 * 2  # every cond record
    format_verdict(result)


def test_a_clause_holds_only_when_every_part_is_significant() -> None:
    """Intersection-union: rho above the control but nw_gain not -> the clause fails."""
    records = make_records(images=8, training=0.0)
    for record in records:
        for k in range(3):
            record[control_column("rho", k)] = record["rho"] - 0.1 - 0.01 * k
            record[control_column("nw_gain", k)] = record["nw_gain"] + 0.01 * (k - 1)  # the same on average
    result = verdict(records)
    parts = {p["key"]: p for p in result["clauses"]["training"]["parts"]}
    assert parts["rho_minus_control"]["significant"] is True
    assert parts["nw_gain_minus_control"]["significant"] is False
    assert result["clauses"]["training"]["holds"] is False
    # what training changed is its own question, not a condition of the conclusion
    assert result["evidence"] is True and "adapter-vs-control" not in result["conclusion"]


def test_rho_at_its_nulls_fails_the_first_clause() -> None:
    result = verdict(make_records(beyond_nulls=0.0, rise=0.0, seed=2))
    assert result["clauses"]["beyond_nulls"]["holds"] is False
    assert result["clauses"]["beyond_nulls"]["status"] == "not met"  # it could have seen 0.03: not met
    assert "beyond-nulls" not in result["conclusion"]  # a reported question


def test_a_falling_rho_does_not_rise() -> None:
    result = verdict(make_records(rise=-0.2))
    assert result["clauses"]["rise"]["holds"] is False
    assert result["clauses"]["rise"]["parts"][0]["mean"] == pytest.approx(-0.2, abs=0.05)


def test_a_rise_shared_with_the_control_is_not_a_rise() -> None:
    """The same rise of rho in the trained values and in every draw (e.g. query norms growing)."""
    records = make_records(rise=0.2)
    for record in records:
        up = (record["step"] - 2) * math.log(2.0)
        for k in range(3):
            record[control_column("rho", k)] += 0.2 * up
    result = verdict(records)
    assert result["clauses"]["rise"]["reported"][0]["mean"] == pytest.approx(0.2, abs=0.03)  # rho rises
    assert result["clauses"]["rise"]["holds"] is False


def test_no_records_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        verdict([])


def test_a_path_shared_with_the_control_says_evidence_at_most_alpha() -> None:
    """Data built to have no path of its own: 200 data sets of 5-10 images whose trained logit scale
    follows 1/h^2 (the exponent is 2, equivalent to the theory's) as every control draw's does (the
    path carried by the queries alone), 3 draws each with an offset shared by every image, the NW
    form met: the full conclusion. Measured: "evidence" in 2 of 200."""
    rng = np.random.default_rng(19)
    evidence = 0
    for dataset in range(200):
        images = int(rng.integers(5, 11))
        records = make_records(
            images, steps=3, seed=1000 + dataset, training=0.0, heads=1, draw_sd=0.05, control_exponent=2.0
        )
        result = verdict(records)
        assert result["clauses"]["nw_form"]["holds"] is True
        evidence += result["evidence"] is True
    assert evidence <= 6, evidence  # well under alpha = 10 / 200


def test_each_part_rejects_at_most_at_alpha_under_no_effect_with_draw_offsets() -> None:
    """nw_gain - control alone, draws with offsets (sd 0.05, the images' own sd): measured 3 of 200
    (the two-level test is conservative here: tests/core/test_intervals.py)."""
    rejections = 0
    for dataset in range(200):
        records = make_records(6, steps=3, seed=5000 + dataset, training=0.0, heads=1, draw_sd=0.05)
        rejections += verdict(records)["clauses"]["training"]["parts"][0]["significant"] is True
    assert rejections <= 16, rejections  # binomial(200, 0.05): 10 +- 3


def test_report_carries_the_verdict_and_prints_it() -> None:
    records = make_records(images=3)
    report = build_report(records, config={"steps": 5}, images=[], versions={}, targets=())
    assert report["verdict"]["images"] == 3 and report["verdict"]["evidence"] is True
    assert report["verdict"]["per_image"][0]["reference"] == "img0"
    assert format_verdict(report["verdict"]) in format_report(report)


@pytest.mark.parametrize("exponent", [0.0, 0.2, 2.0, 6.0])  # y over ~0.1 (flat) to ~12 decades
@pytest.mark.parametrize("steps", [3, 6, 40])
def test_bandwidth_figure_tick_labels_never_overlap(steps, exponent) -> None:
    """A run of few steps spans a decade or two of h: matplotlib's default labelled every minor tick
    in scientific notation there, at a larger size than the decades, and the labels ran together."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from nw_adapter.correlate.plotting import bandwidth_figure

    fig = bandwidth_figure(make_records(images=3, steps=steps, exponent=exponent), "cond")
    ax = fig.axes[0]
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    for axis in (ax.xaxis, ax.yaxis):
        ticks = [t for t in axis.get_major_ticks() + axis.get_minor_ticks() if t.label1.get_visible()]
        boxes = [t.label1.get_window_extent(renderer) for t in ticks if t.label1.get_text()]
        inside = [b for b in boxes if ax.bbox.x0 - 40 <= b.x0 and b.x1 <= ax.bbox.x1 + 40]
        assert len(inside) >= 2  # at least two labelled values to read the scale by
        assert {t.label1.get_fontsize() for t in ticks} == {7.0}
        for i, first in enumerate(inside):
            assert not any(first.overlaps(second) for second in inside[i + 1 :])


def test_bandwidth_figure_draws_the_logit_scale_path_per_step_and_the_exponent_2_line(tmp_path) -> None:
    from PIL import Image

    from nw_adapter.correlate.plotting import bandwidth_figure, plot_bandwidth

    records = make_records(images=3, steps=4)  # trained exponent 2, the control's 0
    fig = bandwidth_figure(records, "cond")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    handles = dict(zip(*reversed(ax.get_legend_handles_labels()), strict=True))  # {label: artist}
    trained_label = next(label for label in handles if label.startswith("trained adapter: 3 images"))
    control_label = next(label for label in handles if label.startswith("scale-matched control (3 draws)"))
    trained = handles[trained_label].lines[0]  # the errorbar container's data line
    lines = {line.get_label(): line for line in ax.get_lines()}
    expected = []  # per step: the geometric mean over images of each image's geometric mean
    for step in range(4):
        per_image = [
            np.mean([math.log(r["logit_scale"]) for r in records if r["half"] == "cond" and r["step"] == step
                     and r["reference"] == f"img{i}"])
            for i in range(3)
        ]  # fmt: skip
        expected.append(math.exp(np.mean(per_image)))
    order = np.argsort(trained.get_xdata())
    np.testing.assert_allclose(np.asarray(trained.get_ydata())[order], np.asarray(expected)[::-1], rtol=1e-9)
    exponent = float(trained_label.split("exponent ")[1].rstrip(")"))
    assert exponent == pytest.approx(2.0, abs=0.2)  # the verdict's convention: -slope of log logit_scale
    assert float(control_label.split("exponent ")[1].rstrip(")")) == pytest.approx(0.0, abs=0.2)
    assert not any(label.startswith("exact NW head") for label in handles)  # not calibrated: no line
    guide = lines["exponent 2 (the theory): logit_scale = c / h^2"]
    x, y = np.log(guide.get_xdata()), np.log(guide.get_ydata())
    assert np.polyfit(x, y, 1)[0] == pytest.approx(-2.0)
    path = plot_bandwidth(records, "cond", tmp_path / "bandwidth.png")
    with Image.open(path) as img:
        assert img.format == "PNG"
    for record in records:
        record.pop("logit_scale")
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


def test_one_control_draw_is_the_one_sample_t_test_with_its_caveat_printed() -> None:
    result = verdict(make_records(draws=1))
    assert result["draws"] == 1
    part = result["clauses"]["training"]["parts"][0]
    assert part["test"] == "one-sample t (one draw)" and "one control draw" in part["caveat"]
    values = [v["nw_gain_minus_control"] - MARGINS["nw_gain_minus_control"] for v in result["per_image"]]
    assert part["p"] == pytest.approx(stats.ttest_1samp(values, 0.0, alternative="greater").pvalue)
    text = " ".join(format_verdict(result).split())
    assert "caveat: one control draw: the variance between draws is not estimated" in text


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("r2_nw", {"mean": 0.821, "low": 0.594, "high": 1.047}, "0.821 [0.594, 1.000]"),  # a t end past 1
        ("kl", {"mean": 2e-9, "low": -3e-7, "high": 4e-7}, "0.000 [0.000, 0.000]"),  # no "-0.000"
        ("rho", {"mean": 0.9, "low": 0.7, "high": 1.2}, "0.900 [0.700, 1.000]"),
        ("nw_gain", {"mean": -0.016, "low": -0.036, "high": 0.004}, "-0.016 [-0.036, 0.004]"),  # unbounded
        ("r2_nw", {"mean": 0.762, "low": 0.728, "high": 0.796}, "0.762 [0.728, 0.796]"),  # inside: as is
        ("exponent", {"mean": -0.0000004, "low": -0.2, "high": 0.2}, "0.000 [-0.200, 0.200]"),
        ("rho", None, "-"),
    ],
)
def test_calibrated_cells_keep_a_reading_in_its_range(key, value, shown) -> None:
    from nw_adapter.correlate.html_report.verdict_html import _anchors_html
    from nw_adapter.correlate.verdict import format_readings, reading_cell

    assert reading_cell(value, key) == shown
    result = {"readings": [{"key": key, "label": key, "adapter": value, "exact": value, "control": None}]}
    if value is not None:
        assert shown in format_readings(result) and shown in _anchors_html(result, 3)
