"""correlate.py --compare-swap end to end on the trained tiny model (2 bundled digits, 2 steps).

The real command line runs in-process (``nw_adapter.correlate.cli.main``); the files it writes are
read back and compared with a direct :func:`compare_swap` call on the same model, and with the
printed table. Resume tests spy on (never replace) :func:`compare_swap` to see whether anything was
generated.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

import nw_adapter.analysis.consequence as consequence
from nw_adapter import load_tiny_digits, tiny_digit_image
from nw_adapter.correlate.cli import main
from nw_adapter.correlate.swap_files import CSV_NAME, JSON_NAME, SCHEMA, comparison_of, format_document
from nw_adapter.correlate.sweep import content_digest
from nw_adapter.models.digits_quality import digit_judge
from nw_adapter.models.tiny_digits import example_image_path

DIGITS = (3, 7)
RULES = ("matched", "median")
BASE = ["--compare-swap", "--model", "tiny", "--steps", "2", "--swap-rules", ",".join(RULES)]


def run(argv: list, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def images_args(digits=DIGITS) -> list[str]:
    return [part for digit in digits for part in ("--image", str(example_image_path(digit)))]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> dict:
    """The two bundled digits 3 and 7, rules matched and median, 2 steps: the run most tests read."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("swap") / "out"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([*BASE, *images_args(), "--out", str(out)])
    return {"code": code, "out": out, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


@pytest.fixture(scope="module")
def direct():
    """The same comparison as a direct Python call on the same model."""
    pipe = load_tiny_digits()
    return consequence.compare_swap(
        pipe,
        [tiny_digit_image(digit) for digit in DIGITS],
        rules=RULES,
        num_inference_steps=2,
        seed=0,
        judge=digit_judge(),
        labels=list(DIGITS),
    )


def test_writes_parseable_files_and_prints_the_table(finished):
    assert finished["code"] == 0, finished["stderr"]
    document = json.loads((finished["out"] / JSON_NAME).read_text())
    assert document["schema"] == SCHEMA and document["rules"] == list(RULES)
    assert document["digest"] == content_digest(document)
    assert [image["label"] for image in document["images"]] == list(DIGITS)
    assert document["config"]["labels"] == "bundled" and document["config"]["steps"] == 2
    assert {"torch", "diffusers"} <= set(document["versions"])
    with (finished["out"] / CSV_NAME).open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(DIGITS) * len(RULES) == len(document["per_reference"])
    for row, saved in zip(rows, document["per_reference"], strict=True):
        assert row["key"] == saved["key"] and row["rule"] == saved["rule"]
        assert float(row["abs_diff"]) == saved["abs_diff"] and row["swap_keeps"] == str(saved["swap_keeps"])
    printed = finished["stdout"]
    assert comparison_of(document).table(legend=False) in printed  # the printed table is the file's
    assert "stock keeps class" in printed and "bundled held-out digits" in printed
    assert printed.strip().splitlines()[-1] == (  # the brief text (no -v): where the legend and rows are
        "details: -v prints the legend of every column and the methods; open "
        f"{finished['out'] / 'report.html'} in a browser (offline: the images side by side); every "
        "reference's row in compare_swap.json / compare_swap.csv"
    )


def test_a_log_gets_a_plain_progress_line_per_reference(finished):
    """stderr is no terminal here (a log): no bar, one line per reference, in order."""
    progress = [line for line in finished["stderr"].splitlines() if line.startswith("progress: ")]
    assert [line.split(" done in ")[0] for line in progress] == [
        "progress: reference 1 of 2",
        "progress: reference 2 of 2",
    ]
    keys = [line.rsplit(": ", 1)[1] for line in progress]
    assert [key.split("-")[0] for key in keys] == ["digit_3", "digit_7"]  # <stem>-<digest>: the reference
    assert "\r" not in finished["stderr"] and "%|" not in finished["stderr"]


def test_printed_table_has_bounded_intervals_units_a_legend_and_a_conclusion(finished):
    document = json.loads((finished["out"] / JSON_NAME).read_text())
    printed = finished["stdout"]
    assert " px" not in printed and "|swap-stock| (0-1)" in printed and "columns:" not in printed
    (conclusion,) = [line for line in printed.splitlines() if line.startswith("conclusion")]
    assert conclusion == comparison_of(document).conclusion() + "."
    detailed = format_document(document, detail=True)  # what -v prints: the legend of every column too
    assert "columns:" in detailed and "  |swap-stock| (0-1): mean absolute difference" in detailed
    brief = printed.strip().splitlines()
    assert brief[-1].startswith("details: ") and set(brief[:-1]) <= set(detailed.splitlines())
    for row in document["summary"]:
        for column, (low, high) in consequence.RANGES.items():
            assert low <= row[f"{column}_low"] <= row[f"{column}_high"] <= high, column
        assert row["change_vs_seed"] in {"less", "more", "unclear"}


def test_the_context_line_names_the_guidance_that_guided_the_calls(finished):
    """SD's guidance scale, or Flux's true CFG where it guided the calls (its guidance_scale then
    guides nothing in a transformer without a guidance embedding)."""
    document = json.loads((finished["out"] / JSON_NAME).read_text())
    first = format_document(document).splitlines()[0]
    assert ", guidance 7.5, " in first and "true CFG" not in first  # the run's defaults, true CFG 1
    document["config"]["true_cfg_scale"] = 5.0
    first = format_document(document).splitlines()[0]
    assert ", true CFG 5, " in first and "guidance 7.5" not in first


def test_json_values_equal_the_functions(finished, direct):
    document = json.loads((finished["out"] / JSON_NAME).read_text())
    assert len(document["per_reference"]) == len(direct.per_reference)
    for saved, own in zip(document["per_reference"], direct.per_reference, strict=True):
        assert {k: v for k, v in saved.items() if k != "key"} == own
    for saved, own in zip(document["summary"], direct.summary(), strict=True):
        assert saved.keys() == own.keys()
        for column, value in own.items():
            if isinstance(value, float) and math.isnan(value):
                assert saved[column] is None
            else:
                assert saved[column] == value, column
    assert document["embedding"] == direct.embedding


def test_resume_reuses_without_generating(finished, capsys, monkeypatch, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished["out"], out)
    before, rows = (out / JSON_NAME).read_text(), (out / CSV_NAME).read_text()
    (out / CSV_NAME).unlink()  # the rows file is written again from the JSON
    (out / ".compare_swap.abcd1234.tmp.json").write_text("{")  # a killed write's leftover
    (out / ".report.abcd1234.tmp.html").write_text("<!DOCTYPE html>")  # a killed report's
    calls = []
    monkeypatch.setattr(consequence, "compare_swap", lambda *a, **k: calls.append(a))
    code, printed, err = run([*BASE, *images_args(), "--out", out, "-v"], capsys)  # -v: the whole table
    assert code == 0 and not calls and "resumed" in err
    assert (out / JSON_NAME).read_text() == before and (out / CSV_NAME).read_text() == rows
    assert not (out / ".compare_swap.abcd1234.tmp.json").exists()
    assert not (out / ".report.abcd1234.tmp.html").exists()
    assert comparison_of(json.loads(before)).table() in printed


def _spy(monkeypatch) -> list:
    calls = []
    real = consequence.compare_swap

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(consequence, "compare_swap", spy)
    return calls


def _flip_corner(path: Path) -> None:
    """Change one pixel of an image file (its SHA-256 changes, its name does not)."""
    image = Image.open(path).convert("RGB")
    image.putpixel((0, 0), tuple(255 - value for value in image.getpixel((0, 0))))
    image.save(path)


def _edit_value(out: Path) -> None:
    document = json.loads((out / JSON_NAME).read_text())
    document["per_reference"][0]["abs_diff"] = 0.0
    (out / JSON_NAME).write_text(json.dumps(document))


def _truncate(out: Path) -> None:
    text = (out / JSON_NAME).read_text()
    (out / JSON_NAME).write_text(text[: len(text) // 2])


@pytest.mark.parametrize(
    ("change", "extra", "reason"),
    [
        (None, ["--seed", "1"], "other options"),
        (None, ["--swap-rules", "matched"], "other options"),
        (_edit_value, [], "content digest"),
        (_truncate, [], "not valid JSON"),
    ],
    ids=["seed", "rules", "edited", "truncated"],
)
def test_resume_refuses_what_is_not_this_run(finished, capsys, monkeypatch, tmp_path, change, extra, reason):
    out = tmp_path / "out"
    shutil.copytree(finished["out"], out)
    if change is not None:
        change(out)
    calls = _spy(monkeypatch)
    base = BASE if "--swap-rules" not in extra else BASE[:-2]  # each option given once
    argv = [*base, *images_args(DIGITS[:1]), "--out", out, *extra]  # one reference keeps it short
    code, printed, err = run(argv, capsys)
    assert code == 0 and len(calls) == 1 and reason in err and "computing it again" in err
    document = json.loads((out / JSON_NAME).read_text())
    assert len(document["images"]) == 1 and document["digest"] == content_digest(document)
    if "--seed" in extra:
        assert document["config"]["seed"] == 1


def test_another_reference_file_under_the_same_name_is_recomputed(finished, capsys, monkeypatch, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished["out"], out)
    folder = tmp_path / "refs"
    folder.mkdir()
    for digit in DIGITS:
        shutil.copy(example_image_path(digit), folder / f"digit_{digit}.png")
    argv = [*BASE, "--image-dir", folder, "--out", out]
    calls = _spy(monkeypatch)
    code, _, err = run(argv, capsys)  # same bytes, other paths: the same references, reused
    assert code == 0 and not calls and "resumed" in err
    code, printed, err = run([*argv, "--labels", "3,7"], capsys)  # labels are part of the fingerprint
    assert code == 0 and len(calls) == 1 and "other options" in err and "as given with --labels" in printed
    _flip_corner(folder / "digit_7.png")
    code, printed, err = run([*argv, "--labels", "3,7"], capsys)
    assert code == 0 and len(calls) == 2 and "belongs to other reference files" in err
    document = json.loads((out / JSON_NAME).read_text())
    assert document["config"]["labels"] == "--labels" and [i["label"] for i in document["images"]] == [3, 7]
    assert (
        document["images"][1]["key"]
        != json.loads((finished["out"] / JSON_NAME).read_text())["images"][1]["key"]
    )


def test_unknown_reference_without_labels_has_no_agreement(capsys, tmp_path):
    reference = tmp_path / "other.png"
    shutil.copy(example_image_path(5), reference)
    _flip_corner(reference)
    base = ["--compare-swap", "--model", "tiny"]  # BASE with one rule and one step (each option given once)
    argv = [*base, "--image", reference, "--swap-rules", "fitted", "--steps", "1", "--out", tmp_path / "out"]
    code, printed, _ = run(argv, capsys)
    assert code == 0
    document = json.loads((tmp_path / "out" / JSON_NAME).read_text())
    assert document["images"][0]["label"] is None and "swap_keeps" not in document["per_reference"][0]
    assert "keeps class" not in printed and "other.png is not one of the bundled held-out digits" in printed
    assert "[too few]" in printed and "nan" not in printed  # n = 1: no interval
    assert "conclusion: too few references for intervals" in printed


IMAGE = str(example_image_path(3))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*BASE, "--image", IMAGE, "--swap-rules", "matched,fited"], "'fited' is not a rule"),
        ([*BASE, "--image", IMAGE, "--swap-rules", "matched,matched"], "repeats a rule"),
        ([*BASE, "--image", IMAGE, "--swap-rules", "1e9"], "outside the usable range"),
        ([*BASE, "--image", IMAGE, "--mode", "swap"], "--mode is not read by the compare-swap run"),
        ([*BASE, "--image", IMAGE, "--bandwidth", "matched"], "--swap-rules"),
        ([*BASE, "--image", IMAGE, "--layers", "up"], "drop --layers"),
        ([*BASE, "--image", IMAGE, "--store-maps"], "--store-maps is not read by the compare-swap run"),
        ([*BASE, "--image", IMAGE, "--all-steps"], "--all-steps is not read by the compare-swap run"),
        ([*BASE, "--replot", "somewhere"], "--compare-swap and --replot start two different runs"),
        (["--image", IMAGE, "--model", "tiny", "--swap-rules", "matched"], "use it with --compare-swap"),
        (["--image", IMAGE, "--model", "tiny", "--labels", "3"], "use it with --compare-swap"),
        ([*BASE, "--image", IMAGE, "--labels", "3,7"], "1 distinct reference image"),
        ([*BASE, "--image", IMAGE, "--labels", "12"], "digit classes are 0-9"),
        ([*BASE, "--image", IMAGE, "--labels", "\uff13"], "--labels must be comma-separated ASCII digits"),
        ([*BASE, "--image", IMAGE, "--labels", "\u0663"], "--labels must be comma-separated ASCII digits"),
        ([*BASE, "--image", IMAGE, "--labels", "0_3"], "--labels must be comma-separated ASCII digits"),
        ([*BASE, "--image", IMAGE, "--labels", "+3"], "--labels must be comma-separated ASCII digits"),
        ([*BASE, "--image", IMAGE, "--swap-rules", "1_0"], "'1_0' is not a rule"),
        ([*BASE, "--image", IMAGE, "--swap-rules", "\uff11"], "is not a rule"),
        ([*BASE, "--image", IMAGE, "--labels", "3", "--height", "64"], "reads 32 x 32 images"),
        (
            ["--compare-swap", "--image", IMAGE, "--model", "some-org/some-model", "--labels", "3"],
            "only the digits models",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, argv, message):
    out = tmp_path / "out"
    code, printed, err = run([*argv, "--out", out], capsys)
    assert code == 2 and not printed
    assert err.startswith("correlate.py: error: ") and err.count("\n") == 1 and message in err
    assert not out.exists()


def test_the_readme_command_is_a_valid_compare_swap_run():
    from nw_adapter.correlate.cli import parse_args
    from tests.test_readme import README, correlate_argv, shell_commands

    (command,) = [c for c in shell_commands(README) if "--compare-swap" in c]
    args = parse_args(correlate_argv(command))  # every option given is one the run reads
    assert (
        args.run.name == "compare-swap"
        and args.compare_swap
        and args.model == "tiny"
        and args.steps == 25
        and args.swap_rules is None
    )
    assert [Path(folder).resolve() for folder in args.image_dir] == [example_image_path(0).parent]


def test_flux_runs_without_a_judge_and_checks_true_cfg(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("NW_ADAPTER_CACHE", str(tmp_path / "cache"))
    argv = ["--compare-swap", "--model", "tiny-flux", "--steps", "1", "--swap-rules", "0.5", *images_args()]
    code, _, err = run([*argv, "--true-cfg-scale", "2", "--out", tmp_path / "bad"], capsys)
    assert code == 2 and "needs --negative-prompt" in err and err.count("\n") == 1
    code, printed, err = run([*argv, "--out", tmp_path / "out"], capsys)
    assert code == 0, err
    document = json.loads((tmp_path / "out" / JSON_NAME).read_text())
    assert document["config"]["model"]["model"] == "tiny-flux" and document["rules"] == [0.5]
    assert [row["rule"] for row in document["per_reference"]] == [0.5, 0.5]
    assert "swap_keeps" not in document["per_reference"][0] and document["config"]["judge"] is None
    assert printed.startswith("WARNING: tiny-flux has random weights") and "only the digits models" in printed


def test_an_interrupted_comparison_leaves_nothing_finished_looking(finished, capsys, monkeypatch, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished["out"], out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(consequence, "compare_swap", interrupted)
    code, printed, err = run([*BASE, *images_args(), "--seed", "3", "--out", out], capsys)
    assert code == 130 and not printed and "an unfinished comparison is not kept" in err
    assert not (out / JSON_NAME).exists() and not (out / CSV_NAME).exists()  # the old run's files are gone


def _without_config(document: dict) -> None:
    del document["config"]


def _without_a_row(document: dict) -> None:
    document["per_reference"].pop()


def _text_value(document: dict) -> None:
    document["per_reference"][1]["clip_i_swap"] = "0.9"


def _other_schema(document: dict) -> None:
    document["schema"] = "nw-adapter/rho"


def _first_schema_version(document: dict) -> None:
    document["schema_version"] = 1  # plain t intervals, no conclusion: its summary is not today's


def test_a_document_of_other_options_names_the_entries_that_changed(finished):
    """With the run's fingerprinted options, the note names each recorded entry that changed (nested
    ones by their path); the same recorded options under another fingerprint are the model's files."""
    from nw_adapter.correlate.images import validate_images
    from nw_adapter.correlate.swap_files import document_problem

    document = json.loads((finished["out"] / JSON_NAME).read_text())
    infos = validate_images([(example_image_path(digit), "--image") for digit in DIGITS])
    config = document["config"]
    options = {"steps": config["steps"] + 1, "model": {**config["model"], "weight_name": "other.bin"}}
    why = document_problem(document, "0" * 64, infos, options=options)
    assert why == (
        f"{JSON_NAME} was made with other options (steps: {config['steps']!r} then, {config['steps'] + 1!r} "
        f"now; model.weight_name: {config['model']['weight_name']!r} then, 'other.bin' now)"
    )
    same = {"steps": config["steps"], "model": config["model"]}
    assert "same recorded options but another model's files" in document_problem(
        document, "0" * 64, infos, options=same
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (_without_config, "lacks its config"),
        (_without_a_row, "one row per (reference, rule)"),
        (_text_value, "non-numeric value"),
        (_other_schema, "another schema"),
        (_first_schema_version, "schema version 1, not 2"),
    ],
)
def test_a_resealed_but_malformed_document_is_not_reused(finished, change, reason):
    """Documents whose digest was recomputed after the change (so only the structure checks can
    catch them) are refused with a reason; the untouched one is accepted."""
    from nw_adapter.correlate.images import validate_images
    from nw_adapter.correlate.swap_files import document_problem

    document = json.loads((finished["out"] / JSON_NAME).read_text())
    infos = validate_images([(example_image_path(digit), "--image") for digit in DIGITS])
    assert document_problem(document, document["fingerprint"], infos) is None
    assert "other options" in document_problem(document, "0" * 64, infos)
    assert "reference list was reordered" in document_problem(document, document["fingerprint"], infos[::-1])
    assert "other reference files" in document_problem(document, document["fingerprint"], infos[:1])
    change(document)
    unsealed = document_problem(document, document["fingerprint"], infos)
    assert "content digest" in unsealed or reason in unsealed  # the schema is checked before the digest
    document["digest"] = content_digest(document)
    assert reason in document_problem(document, document["fingerprint"], infos)
