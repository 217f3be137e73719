"""correlate.py --support-set / --support-dir: option errors, and a tiny end-to-end run's files."""

from __future__ import annotations

import csv
import io
import json
import math
import shutil

import pytest
import torch
from cli_errors import one_line_error

from nw_adapter.analysis.support_sets import decided_step, support_steps
from nw_adapter.correlate.cli import main
from nw_adapter.correlate.support_report import concentration, format_document, group_summary
from nw_adapter.models.tiny_digits import example_image_path


def run(argv: list, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def digit(d: int) -> str:
    return str(example_image_path(d))


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--support-set", f"{digit(3)},,{digit(7)}"], ("empty entry", "comma-separated")),
        (["--support-set", ",".join([digit(1)] * 17)], ("at most 16",)),
        (["--support-set", f"{digit(3)},{digit(7)}", "--image", digit(3)], ("drop --image",)),
        (["--support-set", f"{digit(3)},{digit(7)}", "--compare-swap"], ("--compare-swap",)),
        (["--support-set", f"{digit(3)},{digit(7)}", "--store-maps"], ("--store-maps",)),
        (["--support-set", f"{digit(3)},{digit(7)}", "--mode", "swap"], ("--mode is not read",)),
        (["--support-set", f"{digit(3)},missing.png"], ("missing.png",)),
    ],
)
def test_bad_support_set_options_exit_2_with_one_line(extra, words, capsys, tmp_path):
    out = tmp_path / "out"
    code, stdout, err = run(["--model", "tiny", "--out", out, *extra], capsys)
    one_line_error(code, err, *words)
    assert stdout == "" and not out.exists()


def test_support_dir_errors_name_the_folder(capsys, tmp_path):
    empty = tmp_path / "sets"
    empty.mkdir()
    (empty / "nothing").mkdir()
    code, _, err = run(["--model", "tiny", "--support-dir", empty, "--out", tmp_path / "o"], capsys)
    one_line_error(code, err, str(empty), "subfolder")
    code, _, err = run(
        ["--model", "tiny", "--support-dir", tmp_path / "nope", "--out", tmp_path / "o"], capsys
    )
    one_line_error(code, err, "not a folder")


def test_sd3_is_refused_before_loading(capsys, tmp_path):
    argv = ["--model", "tiny-sd3", "--support-set", f"{digit(3)},{digit(7)}", "--out", tmp_path / "o"]
    code, _, err = run(argv, capsys)
    one_line_error(code, err, "SD 3.5", "Flux")


def test_an_out_folder_of_a_rho_run_is_refused(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "rho.json").write_text("{}")
    code, _, err = run(["--model", "tiny", "--support-set", f"{digit(3)},{digit(7)}", "--out", out], capsys)
    one_line_error(code, err, "rho.json", "another --out")


def test_winner_and_decided_step_of_constructed_steps():
    steps = [
        {"step": s, "mass": mass} for s, mass in enumerate([[0.6, 0.4], [0.45, 0.55], [0.3, 0.7], [0.2, 0.8]])
    ]
    assert decided_step(steps) == (1, 1)
    assert decided_step([{"step": 0, "mass": [0.5, 0.5]}]) == (None, None)  # a tie wins nothing
    assert concentration([0.2, 0.8], 2) == pytest.approx(0.6) and math.isnan(concentration([1.0], 1))


def test_support_steps_average_layers_and_heads_of_one_half():
    base = {"num_refs": 2, "timestep": 1.0, "h_schedule": 2.0}
    records = [
        {**base, "step": 0, "half": "cond", "ref_mass_0": 0.2, "ref_mass_1": 0.8, "ref_entropy": 0.5},
        {**base, "step": 0, "half": "cond", "ref_mass_0": 0.4, "ref_mass_1": 0.6, "ref_entropy": 0.7},
        {**base, "step": 0, "half": "uncond", "ref_mass_0": 0.5, "ref_mass_1": 0.5, "ref_entropy": 0.69},
    ]
    (row,) = support_steps(records)
    assert row["mass"] == pytest.approx([0.3, 0.7]) and row["ref_entropy"] == pytest.approx(0.6)
    assert row["cells"] == 2
    with pytest.raises(ValueError, match="support sets of"):
        support_steps([*records, {**records[0], "num_refs": 3}])


def test_group_summary_intervals_are_over_sets():
    common = {
        "num_refs": 2,
        "classes": "mixed",
        "final_posterior_concentration": None,
        "final_row_entropy_share": 1.0,
    }
    common.update(final_posterior_entropy_share=0.0, class_of_winner=None, class_of_a_reference=True)
    common.update(decided_progress=0.5, posterior_decided_progress=0.4, final_nearest_is_winner=True)
    sets = [
        {**common, "final_concentration": c, "clip_nearest_is_winner": flag}
        for c, flag in ((0.1, True), (0.3, False))
    ]
    (row,) = group_summary(sets)
    assert row["sets"] == 2 and row["final_concentration"]["mean"] == pytest.approx(0.2)
    assert row["final_concentration"]["low"] < 0.1 and row["final_concentration"]["high"] > 0.3
    assert row["clip_nearest_is_winner"]["count"] == 1 and row["clip_nearest_is_winner"]["n"] == 2
    assert row["class_of_winner"]["n"] == 0


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Two sets on the trained tiny model, 2 steps: mixed digits 3 and 7, and digit 4 twice."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("support")
    sets = root / "sets"
    for name, digits in (("mixed", (3, 7)), ("twice", (4, 4))):
        (sets / name).mkdir(parents=True)
        for i, d in enumerate(digits):
            shutil.copy(example_image_path(d), sets / name / f"{i}_digit{d}.png")
    out = root / "out"
    code = main(["--model", "tiny", "--steps", "2", "--support-dir", str(sets), "--out", str(out), "-qq"])
    assert code == 0
    return out


def test_end_to_end_run_writes_the_support_columns_and_the_report(finished):
    document = json.loads((finished / "support.json").read_text())
    assert document["schema"] == "nw-adapter/support-sets"
    by_key = {e["key"]: e for e in document["sets"]}
    assert set(by_key) == {"mixed", "twice"}
    mixed, twice = by_key["mixed"], by_key["twice"]
    assert mixed["classes"] == "mixed" and twice["classes"] == "same"
    assert mixed["class_source"] == "known"  # held-out digits: classes by pixel content, not the judge
    assert [r["label"] for r in mixed["references"]] == [3, 7]
    assert len(mixed["references"]) == 2 and all(-1 <= r["clip_cosine"] <= 1 for r in mixed["references"])
    # identical references: equal CLIP-I, exactly shared mass, no winner
    assert twice["references"][0]["clip_cosine"] == pytest.approx(twice["references"][1]["clip_cosine"])
    assert twice["winner"] is None and all(s["mass"] == pytest.approx([0.5, 0.5]) for s in twice["steps"])
    steps = [s["step"] for s in mixed["steps"]]  # PNDM: 2 steps are 3 denoiser calls
    assert steps == list(range(len(steps))) and len(steps) >= 2
    rows = list(csv.DictReader(io.StringIO((finished / "support.csv").read_text())))
    assert {r["set"] for r in rows} == {"mixed", "twice"}
    assert {
        "ref_mass_0",
        "posterior_1",
        "ref_entropy",
        "ref_row_entropy",
        "layer",
        "head",
        "half",
    } <= set(rows[0])
    for name in ("support_mass.png", "sets/mixed/generated.png", "sets/mixed/mass.png"):
        assert (finished / name).stat().st_size > 0
    groups = {(g["num_refs"], g["classes"]) for g in document["summary"]}
    assert groups == {(2, "mixed"), (2, "same")}


def test_the_next_run_removes_a_killed_runs_temporary_files(finished, tmp_path, capsys, monkeypatch):
    """A killed run leaves its atomic writes' temporary files (report.html's, a set's image); the next
    run removes them under its lock before it generates (interrupted here at once), and no user's
    file."""
    import nw_adapter.correlate.support_cli as support_cli

    out = tmp_path / "out"
    shutil.copytree(finished, out)
    mixed, twice = out / "sets" / "mixed", out / "sets" / "twice"
    ours = [out / ".report.ab12cd34.tmp.html", out / ".support.ab12cd34.tmp.json",
            mixed / ".generated.ab12cd34.tmp.png", twice / ".mass.zz12cd34.tmp.png"]  # fmt: skip
    users = [out / ".report.notes.tmp.html", mixed / ".sketch.ab12cd34.tmp.png"]
    for path in ours + users:
        path.write_text("x")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(support_cli, "_generate", interrupted)
    sets = finished.parent / "sets"
    code, _, err = run(["--model", "tiny", "--steps", "2", "--support-dir", sets, "--out", out, "-q"], capsys)
    assert code == 130, err
    assert not any(path.exists() for path in ours)
    assert all(path.read_text() == "x" for path in users)
    assert not (out / "support.json").exists() and not (out / "report.html").exists()


def test_digit_support_sets_have_the_asked_sizes_and_classes(tmp_path):
    import re

    from nw_adapter.correlate.digit_sets import write_digit_support_sets

    folders = write_digit_support_sets(tmp_path, sizes=(1, 3), per_group=2, seed=0)
    assert [f.name for f in folders] == ["m1-same-00", "m1-same-01", "m3-mixed-00", "m3-mixed-01",
                                         "m3-same-00", "m3-same-01"]  # fmt: skip
    for folder in folders:
        classes = [int(re.search(r"digit(\d)", p.name)[1]) for p in sorted(folder.iterdir())]
        m = int(folder.name[1])
        assert len(classes) == m
        assert len(set(classes)) == (1 if "same" in folder.name else m)
    with pytest.raises(ValueError, match="sizes"):
        write_digit_support_sets(tmp_path, sizes=(11,))


def test_the_digit_models_are_the_trained_digits_models():
    from nw_adapter.correlate.spec import DIGIT_MODELS
    from nw_adapter.integration.families import TINY_MODELS

    assert set(DIGIT_MODELS) == {model.name for model in TINY_MODELS if model.trained}


def test_a_flux_digits_support_set_run_judges_classes(capsys, tmp_path):
    """The trained Flux digits model: its references' known classes and the judge's class of the image."""
    argv = ["--model", "tiny-flux-digits", "--steps", "2", "--support-set", f"{digit(3)},{digit(7)}", "-qq"]
    code, printed, err = run([*argv, "-v", "--out", tmp_path / "out"], capsys)  # -v: the per-set lines too
    assert code == 0, err
    document = json.loads((tmp_path / "out" / "support.json").read_text())
    (entry,) = document["sets"]
    assert entry["classes"] == "mixed" and entry["class_source"] == "known"
    assert isinstance(entry["judged_generated"], int)
    first = entry["steps"][0]  # flow matching's pure-noise step: the latent posterior is exactly 1/m
    assert first["posterior"] == [0.5, 0.5]
    assert "set00 (m=2, mixed)" in printed and printed.strip() == format_document(document)
    brief = format_document(document, detail=False, out_dir=tmp_path / "out")  # without -v: one screen
    assert "set00 (m=2, mixed)" not in brief and " 2 mixed " in brief and "counts over sets:" in brief
    assert brief.splitlines()[-1].startswith("details: -v prints every set's readings (1 set(s))")
