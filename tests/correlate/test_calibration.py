"""Issue 42, items 2 and 6: the exact NW head read in the same pipeline, and the acceptance cases.

On the two trained tiny models (SD 1.5 digits, Flux digits), through the public route
(``nw_adapter.observe_call`` / the processors, the records, ``nw_adapter.verdict``):

- the exact head swapped in at the schedule's h reads an exponent within [1.5, 2.5] and gets the
  positive conclusion (main at f073761 recorded the stock softmax in swap: -0.049 / -0.450, "no
  evidence"); a fixed h and a 1/h path do not;
- ``calibrate=True`` merges the exact head's statistics into the adapter's records, the verdict
  places the adapter between its anchors and judges the exact head itself; the two passes share
  the seed and noise, and the processors and random state are as after one call;
- the trained adapter's own conclusion on each model, with the smallest effects the run could
  detect beside every "not met".

Small: 4 - 6 bundled digits, 8 - 10 steps (about 1 s per generation on one core).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from nw_adapter import observe_call, verdict
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.mixin import active_recorder, nw_processor
from nw_adapter.models.loaders import load_tiny_digits, load_tiny_flux_digits, tiny_digit_image

STEPS = 10


@pytest.fixture(scope="module")
def sd15():
    pipe = load_tiny_digits()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def flux():
    pipe = load_tiny_flux_digits()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(digit: int, steps: int = STEPS) -> dict:
    return {
        "prompt": "a photograph",
        "ip_adapter_image": tiny_digit_image(digit),
        "num_inference_steps": steps,
        "generator": torch.Generator().manual_seed(0),
    }


def _swap_records(pipe, digits, **options) -> list[dict]:
    """Swap with statistics over ``digits`` (one reference each), the per-layer control on."""
    records = []
    for digit in digits:
        with warnings.catch_warnings():  # flow matching's pure-noise step is not recorded (h infinite)
            warnings.simplefilter("ignore", RuntimeWarning)
            with nw_processor(pipe, mode="swap", statistics=True, untrained_control=True, **options) as rec:
                pipe(**_call(digit))
        records += [{"reference": f"digit{digit}", **r} for r in rec.to_records()]
    return records


def _exponent(result: dict) -> dict:
    return next(p for p in result["clauses"]["bandwidth"]["parts"] if p["key"] == "exponent_theory")


@pytest.mark.parametrize("model", ["sd15", "flux"])
def test_the_exact_head_at_the_schedules_h_gets_the_positive_conclusion(request, model) -> None:
    """Measured (4 digits, 10 steps): exponent 1.97 (SD 1.5), 1.78 (Flux), r2_nw 1.000."""
    result = verdict(_swap_records(request.getfixturevalue(model), range(4), bandwidth="schedule"))
    exponent = _exponent(result)
    assert 1.5 < exponent["low"] and exponent["high"] < 2.5 and exponent["status"] == "met", exponent
    assert result["evidence"] is True, result["conclusion"]
    assert result["clauses"]["nw_form"]["parts"][0]["mean"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("model", ["sd15", "flux"])
def test_a_fixed_h_does_not(request, model) -> None:
    """Measured: exponent -0.02 (SD 1.5), -0.20 (Flux): far outside the band, "not met"."""
    result = verdict(_swap_records(request.getfixturevalue(model), range(4), bandwidth=1.0))
    exponent = _exponent(result)
    assert exponent["high"] < 1.5 and exponent["status"] == "not met", exponent
    assert result["evidence"] is False


@pytest.mark.parametrize("model", ["sd15", "flux"])
def test_a_1_over_h_path_does_not(request, model, monkeypatch) -> None:
    """The exact head at ``h' = sqrt(h)``: its logit scale follows 1/h (exponent 1, measured ~0.98 /
    ~0.9): the NW form holds, the path is not the theory's."""
    from nw_adapter.integration.processors import base

    schedule_h = base.resolve_bandwidth

    def sqrt_h(config, state, q, k, s):
        h = schedule_h(config, state, q, k, s)
        return math.sqrt(h) if isinstance(h, float) and math.isfinite(h) else h

    monkeypatch.setattr(base, "resolve_bandwidth", sqrt_h)
    result = verdict(_swap_records(request.getfixturevalue(model), range(4), bandwidth="schedule"))
    exponent = _exponent(result)
    assert 0.6 < exponent["mean"] < 1.3 and exponent["status"] == "not met", exponent
    assert result["clauses"]["nw_form"]["holds"] is True and result["evidence"] is False


def test_calibrate_merges_the_exact_head_and_keeps_the_pipeline_as_after_one_call(sd15) -> None:
    seed_before = torch.random.initial_seed()
    plain = observe_call(sd15, _call(3, steps=4), config=NWProcessorConfig(untrained_control=True))
    calibrated = observe_call(sd15, _call(3, steps=4), config=NWProcessorConfig(untrained_control=True),
                              calibrate=True)  # fmt: skip
    assert active_recorder(sd15) is None and torch.random.initial_seed() == seed_before
    # the adapter's pass is the plain call's (same generation, same records but the new columns)
    assert calibrated.output.images[0].tobytes() == plain.output.images[0].tobytes()
    assert [r["rho"] for r in calibrated.records] == [r["rho"] for r in plain.records]
    assert calibrated.unmatched == 0 and calibrated.meta["bandwidth"] == "schedule"
    assert calibrated.exact_output.images[0].tobytes() != plain.output.images[0].tobytes()  # the NW head's
    exact = {(r["step"], r["layer"], r["head"], r["half"]): r for r in calibrated.exact_records}
    assert len(exact) == len(calibrated.records)
    for record in calibrated.records:
        twin = exact[record["step"], record["layer"], record["head"], record["half"]]
        assert record["logit_scale_exact"] == twin["logit_scale"] and record["r2_nw_exact"] == twin["r2_nw"]
        assert record["logit_scale_exact_control_0"] == twin["logit_scale_control_0"]
        assert record["key_scale_exact_2"] == twin["key_scale_2"]
        assert record["exact_schedule_c"] == 1.0  # the exact head's C: the verdict pools one C only
    assert all("exact_schedule_c" not in r for r in plain.records)
    with pytest.raises(ValueError, match="config.mode must be 'observe'"):
        observe_call(sd15, _call(3), config=NWProcessorConfig(mode="swap"), calibrate=True)
    assert active_recorder(sd15) is None


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"calibrate": True, "schedule_c": 0}, "schedule_c"),
        ({"calibrate": True, "schedule_c": "1"}, "schedule_c"),
        ({"calibrate": True, "schedule_c": math.inf}, "schedule_c"),
        ({"schedule_c": 2.0}, "which is off; pass calibrate=True"),
    ],
)
def test_observe_call_refuses_a_schedule_c_it_cannot_use(sd15, options, words) -> None:
    """schedule_c is checked by the configuration's own rule (one check, not a copy of it), before
    anything runs, and refused without calibrate=True, where it would be ignored."""
    from nw_adapter.integration.errors import NWConfigError

    with pytest.raises(NWConfigError, match=words):
        observe_call(sd15, _call(3, steps=1), **options)
    assert active_recorder(sd15) is None


@pytest.mark.parametrize("steps", [0, -1, 2.5, True])
def test_observe_call_refuses_a_step_count_below_one_before_the_call(sd15, steps) -> None:
    """num_inference_steps=0 was diffusers' ZeroDivisionError from inside the scheduler."""
    from nw_adapter.integration.errors import NWConfigError

    with pytest.raises(NWConfigError, match="observe_call: num_inference_steps must be a whole number >= 1"):
        observe_call(sd15, {**_call(3, steps=1), "num_inference_steps": steps}, calibrate=True)
    assert active_recorder(sd15) is None


@pytest.mark.parametrize(("model", "exact_low"), [("sd15", 1.9), ("flux", 1.6)])
def test_the_trained_adapter_between_its_anchors(request, model, exact_low) -> None:
    """The trained tiny adapters, calibrated (6 digits, 8 steps): no evidence, nearer the control
    on the path; every failed condition part is "not met" (the run could have detected the exact
    head's effect: its smallest detectable effect is below it), never "too few references to
    tell"; the exact head in the same run gets the positive conclusion."""
    pipe = request.getfixturevalue(model)
    records = []
    for digit in range(6):
        result = observe_call(pipe, _call(digit, steps=8), config=NWProcessorConfig(untrained_control=True),
                              calibrate=True)  # fmt: skip
        records += [{"reference": f"digit{digit}", **r} for r in result.records]
    outcome = verdict(records)
    assert outcome["evidence"] is False and outcome["anchors"]["exact"]["source"] == "measured"
    assert outcome["anchors"]["exact"]["exponent"] > exact_low
    assert outcome["anchors"]["exact"]["verdict"]["evidence"] is True
    assert outcome["position"]["nearer"] == "control" and outcome["position"]["path"] < 0.1
    for key in ("bandwidth", "nw_form"):
        for part in outcome["clauses"][key]["parts"]:
            if not part["significant"]:
                assert part["status"] == "not met" and part["mde"] is not None, part
    rows = {row["key"]: row for row in outcome["readings"]}
    assert rows["exponent"]["exact"]["mean"] > exact_low and abs(rows["exponent"]["adapter"]["mean"]) < 0.6
    assert rows["r2_nw"]["exact"]["mean"] == pytest.approx(1.0, abs=1e-4)


def test_one_step_leaves_the_exact_heads_path_not_measured(sd15) -> None:
    """One denoising step: no slope on log h, so the bandwidth clause is "not measured" with its
    reason, for the adapter and for the exact head, which gets neither the positive conclusion nor
    "not met" (main at 7b2f1f0: "bandwidth clause not met" for both); its NW form is still read
    (r2_nw 1.000, met)."""
    from nw_adapter.correlate.verdict import SINGLE_H_REASON

    records = []
    config = NWProcessorConfig(untrained_control=True)
    for digit in range(3):
        result = observe_call(sd15, _call(digit, steps=1), config=config, calibrate=True)
        records += [{"reference": f"digit{digit}", **r} for r in result.records]
    assert {r["step"] for r in records} == {0}
    outcome = verdict(records)
    own = outcome["anchors"]["exact"]["verdict"]
    for clauses in (outcome["clauses"], own["clauses"]):
        bandwidth = clauses["bandwidth"]
        assert bandwidth["status"] == "not measured" and bandwidth["reason"] == SINGLE_H_REASON, bandwidth
    assert own["evidence"] is False and own["clauses"]["nw_form"]["status"] == "met"
    assert own["conclusion"] == (
        "no evidence of kernel smoothing on the schedule (3 reference images): bandwidth clause not "
        "measured, NW-form clause met"
    )
    assert outcome["clauses"]["rise"]["status"] == "not measured"
    assert outcome["anchors"]["exact"]["exponent"] is None and outcome["position"]["path"] is None


# --- the command line: --calibrate ----------------------------------------------------------------


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from nw_adapter.correlate.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--mode", "swap"], "--calibrate needs --mode observe"),
        (["--end-to-end-control"], "--calibrate does not combine with --end-to-end-control"),
        (["--store-maps"], "--calibrate does not combine with --store-maps"),
        (["--compare-swap"], "--calibrate applies to the rho run"),
    ],
)
def test_calibrate_refuses_what_it_cannot_run(tmp_path, capsys, extra, words) -> None:
    image = str(tiny_digit_path(0))
    argv = ["--image", image, "--model", "tiny", "--calibrate", *extra, "--out", str(tmp_path / "o")]
    code, _, err = _cli(argv, capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_calibrate_c_without_calibrate_and_replot_with_it_are_refused(tmp_path, capsys) -> None:
    image = str(tiny_digit_path(0))
    code, _, err = _cli(
        ["--image", image, "--model", "tiny", "--calibrate-c", "2", "--out", str(tmp_path)], capsys
    )
    assert code == 2 and "--calibrate-c sets the exact head's bandwidth of --calibrate" in err
    code, _, err = _cli(["--replot", str(tmp_path), "--calibrate"], capsys)
    assert code == 2 and "a redraw generates nothing; --calibrate applies to the rho run" in err


def tiny_digit_path(digit: int):
    from nw_adapter.models.tiny_digits import example_image_path

    return example_image_path(digit)


def test_a_calibrated_run_writes_its_anchor_table_figure_and_replots_the_same(tmp_path, capsys) -> None:
    import json

    out = tmp_path / "run"
    argv = ["--model", "tiny", "--steps", "4", "--calibrate", "-qq", "--out", str(out)]
    for digit in range(3):
        argv += ["--image", str(tiny_digit_path(digit))]
    code, printed, _ = _cli(argv, capsys)
    assert code == 0
    report = json.loads((out / "rho.json").read_text())
    meta = {"kind": "exact NW head", "mode": "swap", "bandwidth": "schedule", "schedule_c": 1.0}
    assert report["config"]["calibration"] == meta
    records = report["records"]
    assert all("logit_scale_exact" in r and "r2_nw_exact" in r for r in records)
    assert "logit_scale_exact" in (out / "rho.csv").read_text().splitlines()[0]
    result = report["verdict"]
    assert result["anchors"]["exact"]["source"] == "measured"
    assert result["anchors"]["exact"]["verdict"]["evidence"] is True
    flat = " ".join(printed.split())  # the brief text (one screen): the anchors and the exact head's outcome
    assert (
        "; calibrated: each reference run again with the exact NW head at the schedule's h, same seed" in flat
    )
    exact = result["anchors"]["exact"]
    assert f"exact NW head {exact['exponent']:+.3f} / {exact['r2_nw']:.3f} (measured)" in flat
    assert (
        "calibration: the exact NW head in this pipeline: evidence (bandwidth clause and NW-form clause met)"
        in flat
    )
    assert "calibrated readings" not in printed  # the calibrated table: with -v
    assert result == verdict([{**r} for r in records])  # the stored verdict is the records'
    code, replotted, _ = _cli(["--replot", str(out)], capsys)
    assert code == 0 and replotted.strip() == printed.strip()
    code, detailed, _ = _cli(["--replot", str(out), "-v"], capsys)  # -v: everything
    assert (
        code == 0
        and "calibrated readings (mean over reference images [95% interval, cut to the reading's range]):"
        in detailed
    )
    assert "; calibrated: each reference run again with the exact NW head at the schedule's h, same seed" in (
        " ".join(detailed.split())
    )  # -v says what ran as the brief text does
    assert "calibration, the exact head in this pipeline: evidence of kernel smoothing" in " ".join(
        detailed.split()
    )
    from nw_adapter.correlate.plotting import bandwidth_figure

    fig = bandwidth_figure(records, result["half"])
    labels = fig.axes[0].get_legend_handles_labels()[1]
    exact = next(label for label in labels if label.startswith("exact NW head (measured): 3 images"))
    assert float(exact.split("exponent ")[1]) == pytest.approx(
        result["anchors"]["exact"]["exponent"], abs=0.01
    )


def test_sd3_calibrates_its_joint_branch(tiny_sd3_dir, tiny_sd3_ip_adapter_dir) -> None:
    """SD 3.5 swaps the exact head over its joint keys (image + IP): the calibration runs, its
    ``"ip"`` records get their twins, and the exact head's r2_nw over the IP keys is 1 (the joint NW
    head restricted to them and renormalised is the NW head over them)."""
    from diffusers import StableDiffusion3Pipeline
    from flow_helpers import SIZE, load_sd3
    from tiny_helpers import random_image

    pipe = load_sd3(StableDiffusion3Pipeline, tiny_sd3_dir, tiny_sd3_ip_adapter_dir)
    call = {"prompt": "a cat", "ip_adapter_image": random_image(1, SIZE), "num_inference_steps": 3,
            "height": SIZE, "width": SIZE, "generator": torch.Generator().manual_seed(0)}  # fmt: skip
    result = observe_call(pipe, call, config=NWProcessorConfig(untrained_control=True), calibrate=True)
    ip = [r for r in result.records if r.get("key_set", "ip") == "ip"]
    assert ip and result.pure_noise_steps == [0]  # flow matching's first step: h infinite
    twins = [r for r in ip if r["exact_reason"] is None]
    assert twins and all(r["r2_nw_exact"] == pytest.approx(1.0, abs=1e-4) for r in twins)
    assert active_recorder(pipe) is None


def test_the_exact_pass_stacks_its_steps_and_equals_the_per_layer_path(sd15) -> None:
    """The exact pass's softmax scale 1/h^2 and bandwidth change every step; the deferred statistics
    stack the steps into one call per shape (a per-row h and scale) and equal the per-layer path
    (``deferred_mb=0``, one call per layer and step), statistic by statistic."""
    stacked = observe_call(sd15, _call(5, steps=4), config=NWProcessorConfig(nulls=False), calibrate=True)
    per_layer = observe_call(sd15, _call(5, steps=4), config=NWProcessorConfig(nulls=False, deferred_mb=0),
                             calibrate=True)  # fmt: skip
    assert len(stacked.records) == len(per_layer.records) > 0
    names = ("rho", "kl", "r2_nw", "logit_scale", "nw_gain", "h_eff", "bandwidth")
    for a, b in zip(stacked.records, per_layer.records, strict=True):
        assert (a["step"], a["layer"], a["head"], a["half"]) == (b["step"], b["layer"], b["head"], b["half"])
        for name in names:
            assert a[f"{name}_exact"] == pytest.approx(b[f"{name}_exact"], rel=1e-4, abs=1e-5, nan_ok=True), (
                name
            )
    assert len({r["bandwidth_exact"] for r in stacked.records}) > 1  # several steps' h in one stack


def test_a_calibrated_sd3_run_writes_what_the_plain_run_writes(tmp_path, capsys) -> None:
    """The rho run's three kinds share one path from the generation to the files: on tiny-sd3 with
    the schedule's bandwidth (its pure-noise step not recorded), ``--calibrate`` writes the plain
    run's per-image files (``rho_joint.csv``: the joint key set's records, the same as the plain run's
    plus the exact head's columns) and prints its per-image lines, the skipped note and the steps
    without statistics (main at 7b2f1f0: neither the file nor the lines)."""
    import csv

    def run(name: str, *extra: str) -> tuple[Path, list[str]]:
        out = tmp_path / name
        argv = ["--model", "tiny-sd3", "--steps", "2", "--bandwidth", "schedule", "--out", str(out), *extra]
        for digit in (3, 5):
            argv += ["--image", str(tiny_digit_path(digit))]
        code, _, err = _cli(argv, capsys)
        assert code == 0, err
        return out, [
            line for line in err.splitlines() if not line.startswith(("progress:", "WARNING: tiny-sd3"))
        ]

    plain, plain_err = run("plain")
    calibrated, calibrated_err = run("calibrated", "--calibrate")
    assert calibrated_err == plain_err and len(plain_err) == 4  # per image: the skipped note, the failed step
    assert all("Warning" not in line for line in calibrated_err)
    for folder in sorted((plain / "images").iterdir()):
        twin = calibrated / "images" / folder.name
        assert sorted(p.name for p in twin.iterdir()) == sorted(p.name for p in folder.iterdir())
        with open(folder / "rho_joint.csv") as a, open(twin / "rho_joint.csv") as b:
            joint, joint_calibrated = list(csv.DictReader(a)), list(csv.DictReader(b))
        assert {r["key_set"] for r in joint_calibrated} == {"joint"} and len(joint_calibrated) == len(joint)
        assert [r["rho"] for r in joint_calibrated] == [r["rho"] for r in joint]  # the same first pass
        assert all(math.isfinite(float(r["rho_exact"])) for r in joint_calibrated)
    document = json.loads((calibrated / "rho.json").read_text())
    assert all(image["joint_records"].endswith("rho_joint.csv") for image in document["images"])
