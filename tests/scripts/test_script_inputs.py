"""Bad input to the scripts in ``scripts/``: one line naming the problem and the fix, exit status 2,
no traceback, nothing written and nothing run.

Each script runs in-process (loaded from its file, ``sys.argv`` set as a shell would) in an empty
current folder, with the work it would start replaced by a spy: a bad input must stop it before.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load(name: str) -> ModuleType:
    """The script ``scripts/<name>.py`` as a module (its ``__main__`` block not run)."""
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call(module: ModuleType, argv: list[str], monkeypatch, capsys) -> tuple[object, str]:
    """``module.main()`` with ``sys.argv`` as the shell gives it: (exit status, stderr)."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__.removeprefix('script_')}.py", *argv])
    try:
        code = module.main()
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def one_line(code: object, err: str, *words: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """An empty current folder holding one file, ``taken``."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    (folder / "taken").write_text("x")
    monkeypatch.chdir(folder)
    return folder


def _unchanged(folder: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == ["taken"]


def _spy(monkeypatch, target: object, name: str) -> list:
    calls: list = []
    monkeypatch.setattr(target, name, lambda *a, **k: calls.append((a, k)) or 0)
    return calls


def _refused(module, argv, words, spied, workdir, monkeypatch, capsys) -> None:
    """``module`` (a loaded script) refuses ``argv`` in one line naming ``words`` (exit 2), before any
    of ``spied`` (``(object, function name)`` pairs: what it would run) is called, and writes nothing."""
    calls = [_spy(monkeypatch, target, name) for target, name in spied]
    code, err = call(module, argv, monkeypatch, capsys)
    one_line(code, err, *words)
    assert not any(calls)
    _unchanged(workdir)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--out", ""], ["--out is empty", "pass a folder"]),
        (["--out", "taken"], ["--out 'taken' is a file"]),
        (["--out", "run", "--seed", str(10**23)], ["--seed", "from 0 to"]),
        (["--out", "run", "--seed", "-1"], ["--seed"]),
        (["--out", "run", "--threads", "0"], ["--threads"]),
    ],
    ids=["empty-out", "file-out", "seed-10**23", "negative-seed", "threads-0"],
)
def test_train_tiny(argv, words, workdir, monkeypatch, capsys):
    import nw_adapter.models.training.run as training

    _refused(load("train_tiny"), argv, words, [(training, "run_training")], workdir, monkeypatch, capsys)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--out", ""], ["--out is empty"]),
        (["--out", "run", "--adapter-lr", "inf"], ["--adapter-lr", "finite"]),
        (["--out", "run", "--image-dropout", "nan"], ["--image-dropout", "probability"]),
    ],
    ids=["empty-out", "infinite-lr", "nan-dropout"],
)
def test_train_tiny_flow(argv, words, workdir, monkeypatch, capsys):
    import nw_adapter.models.training.flux_run as training

    spied = [(training, "run_flux_training")]
    _refused(load("train_tiny_flow"), argv, words, spied, workdir, monkeypatch, capsys)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["", "--sizes", "1", "--per-group", "1"], ["folder is empty"]),
        (["taken"], ["folder 'taken' is a file"]),
        (["taken/sets"], ["lies inside the file"]),
        (["sets", "--sizes", "a"], ["--sizes", "1 to 10", "e.g. --sizes 1,2,4"]),
        (["sets", "--sizes", "1,11"], ["--sizes"]),
        (["sets", "--per-group", "0"], ["--per-group"]),
        (["sets", "--seed", "-1"], ["--seed"]),
    ],
    ids=["empty", "a-file", "inside-a-file", "sizes-a", "size-11", "per-group-0", "negative-seed"],
)
def test_digit_support_sets(argv, words, workdir, monkeypatch, capsys):
    code, err = call(load("digit_support_sets"), argv, monkeypatch, capsys)
    one_line(code, err, *words)
    _unchanged(workdir)


def _rho_json(folder: Path, text: str) -> Path:
    path = folder / "rho.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda d: d / "missing.json", ["does not exist"]),
        (lambda d: _rho_json(d, '{"records": [{"refer'), ["not valid JSON"]),
        (lambda d: _rho_json(d, ""), ["is empty"]),
        (lambda d: d, ["is a folder"]),
        (lambda d: _rho_json(d, "[1, 2]"), ["JSON list, not a report object"]),
        (lambda d: _rho_json(d, '{"records": []}'), ["no verdict"]),
        (
            lambda d: _rho_json(
                d,
                json.dumps(
                    {
                        "verdict": {"half": "cond"},
                        "records": [{"reference": "a", "half": "cond", "rho": "high", "rho_control_0": 0.1}],
                    }
                ),
            ),
            ["records[0]", "not a number"],
        ),
    ],
    ids=["missing", "truncated", "empty", "folder", "non-object", "no-verdict", "text-value"],
)
def test_readings_table(make, words, tmp_path, monkeypatch, capsys):
    path = make(tmp_path)
    code, err = call(load("readings_table"), [str(path)], monkeypatch, capsys)
    one_line(code, err, str(path), "pass the rho.json", *words)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["rho", "--out", ""], ["--out is empty"]),
        (["rho", "--steps", "0"], ["--steps"]),
        (["rho", "--card", "missing.md"], ["--card 'missing.md' cannot be read"]),
        (["training", "--run-dir", "nowhere"], ["--run-dir 'nowhere' has no stages/log.json"]),
    ],
    ids=["empty-out", "steps-0", "missing-card", "missing-run"],
)
def test_evaluate_tiny(argv, words, workdir, monkeypatch, capsys):
    module = load("evaluate_tiny")
    _refused(module, argv, words, [(module, "rho"), (module, "training")], workdir, monkeypatch, capsys)


@pytest.mark.parametrize(
    ("script", "argv", "words"),
    [
        ("evaluate_tiny", ["quality", "--run-dir", "runs/tiny"], "--run-dir is not read by 'quality'"),
        ("evaluate_tiny", ["captions", "--steps", "25"], "--steps is not read by 'captions'"),
        ("evaluate_tiny", ["training", "--out", "o"], "--out is not read by 'training'"),
        ("evaluate_tiny_flow", ["losses", "--card", "card.md"], "--card is not read by 'losses'"),
        ("evaluate_tiny_flow", ["pilot", "--limit", "2"], "--limit is not read by 'pilot'"),
        ("evaluate_tiny_flow", ["quality", "--ip-scales", "1", "2"], "--ip-scales is not read by 'quality'"),
    ],
)
def test_an_option_the_evaluation_does_not_read_is_refused(script, argv, words, workdir, monkeypatch, capsys):
    """Given to an evaluation that does not read it, an option was dropped without a word."""
    module = load(script)
    spied = [(module, name) for name in ("quality", "captions", "training", "pilot") if hasattr(module, name)]
    _refused(module, argv, [words, "drop it"], spied, workdir, monkeypatch, capsys)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--out", ""], ["--out is empty", "JSON-lines file"]),
        (["--out", "."], ["is a folder"]),
        (["--out", "taken/rows.jsonl"], ["lies inside the file"]),
        (["--out", "rows.jsonl", "--tasks", "1"], ["--tasks"]),
        (["--out", "rows.jsonl", "--checkpoints", ""], ["--checkpoints is empty"]),
        (["--out", "taken"], ["--out 'taken': line 1 is not a row of this script"]),  # was a traceback
        (
            ["--out", "../loop"],
            ["--out '../loop': '../loop' is a symbolic link that leads nowhere"],
        ),  # ran, then failed
    ],
    ids=[
        "empty-out",
        "folder-out",
        "inside-a-file",
        "tasks-1",
        "empty-checkpoints",
        "not-its-rows",
        "link-loop",
    ],
)
def test_fair_baseline_search(argv, words, workdir, monkeypatch, capsys):
    if "../loop" in argv:  # beside the current folder, which stays as it was
        (workdir.parent / "loop").symlink_to("loop")
    module = load("run_fair_baseline_search")
    _refused(module, argv, words, [(module, "train_scale")], workdir, monkeypatch, capsys)


def test_paper_subset_refuses_an_empty_out(workdir, monkeypatch, capsys):
    module = load("run_paper_subset")
    _refused(
        module, ["--out", ""], ["--out is empty"], [(module, "run_experiments")], workdir, monkeypatch, capsys
    )


@pytest.mark.parametrize(
    ("script", "argv", "words"),
    [
        ("what_rho_shows", ["--seeds", "1"], ["--seeds", ">= 2"]),
        ("head_space_limits", ["--draws", "x"], ["--draws"]),
    ],
)
def test_draw_counts_are_one_line(script, argv, words, monkeypatch, capsys):
    code, err = call(load(script), argv, monkeypatch, capsys)
    one_line(code, err, *words)


def test_evaluate_tiny_refuses_a_model_folder_with_damaged_weights(workdir, monkeypatch, capsys):
    """A truncated weight file of --model-dir is one line naming it, before anything loads (before,
    diffusers' traceback after --out was created)."""
    import shutil

    from nw_adapter.models.tiny_digits import SHIPPED_DIR

    model = workdir.parent / "model"
    shutil.copytree(SHIPPED_DIR, model, ignore=shutil.ignore_patterns("examples"))
    unet = model / "unet" / "diffusion_pytorch_model.safetensors"
    unet.write_bytes(unet.read_bytes()[:1000])
    module = load("evaluate_tiny")
    argv = ["quality", "--model-dir", str(model), "--out", "e"]
    words = ["unet/diffusion_pytorch_model.safetensors is not a complete safetensors file"]
    _refused(module, argv, words, [(module, "quality")], workdir, monkeypatch, capsys)


STUDIES = {"plug_in_field_study": "exact_field_errors", "verdict_false_positives": "count_verdicts"}
"""The two study scripts and the function each runs first (spied: it must not run on bad input)."""


@pytest.mark.parametrize(
    ("script", "argv", "words"),
    [
        *((script, ["--out", ""], ["--out is empty"]) for script in STUDIES),
        *((script, ["--out", "taken"], ["--out 'taken' is a file"]) for script in STUDIES),
        ("plug_in_field_study", ["--out", "run", "--seeds", "x"], ["--seeds must be a whole number"]),
        ("verdict_false_positives", ["--out", "run", "--steps", "0"], ["--steps"]),
    ],
    ids=["study-empty-out", "fp-empty-out", "study-file-out", "fp-file-out", "study-seeds-x", "fp-steps-0"],
)
def test_the_study_scripts_check_their_options_before_running(
    script, argv, words, workdir, monkeypatch, capsys
):
    """Before, plug_in_field_study.py's --out '' was the current folder ('exists and is not an empty
    folder') after argparse's usage block: six lines; verdict_false_positives.py's --out '' ran every
    model in the current folder (104 s, its models/ written there)."""
    module = load(script)
    _refused(module, argv, words, [(module, STUDIES[script])], workdir, monkeypatch, capsys)


@pytest.mark.parametrize("script", ["train_tiny", "train_tiny_flow"])
@pytest.mark.parametrize(
    ("content", "words"),
    [("", "it is empty"), ('{"config": ', "is not valid JSON"), ("[1]", "holds a JSON list")],
    ids=["empty", "truncated", "list"],
)
def test_a_damaged_training_log_is_one_line(script, content, words, workdir, monkeypatch, capsys):
    """A resumed run's stages/log.json that is not a JSON object: one line naming it and the fix,
    before any stage trains (before, json's traceback, exit 1)."""
    stages = workdir / "run" / "stages"
    stages.mkdir(parents=True)
    (stages / "log.json").write_text(content)
    code, err = call(load(script), ["--out", "run", "--quick", "--no-progress"], monkeypatch, capsys)
    one_line(code, err, "cannot continue the training log", words, "pass a new --out")
    assert sorted(p.name for p in stages.iterdir()) == ["log.json"]
    assert (stages / "log.json").read_text() == content


def test_every_script_parses_with_a_one_line_parser():
    """No script builds a plain argparse parser (its errors are a usage block, and an --out of its own
    is not checked): plug_in_field_study.py and verdict_false_positives.py did."""
    plain = [
        path.name for path in sorted(SCRIPTS.glob("*.py")) if "argparse.ArgumentParser(" in path.read_text()
    ]
    assert plain == []


@pytest.mark.parametrize(
    "script, training, function",
    [("train_tiny", "run", "run_training"), ("train_tiny_flow", "flux_run", "run_flux_training")],
)
def test_an_option_given_twice_with_different_values_is_one_line(
    script, training, function, workdir, monkeypatch, capsys
):
    """argparse would keep the last --seed and drop the first without a word."""
    module = importlib.import_module(f"nw_adapter.models.training.{training}")
    argv = ["--out", "run", "--seed", "1", "--seed", "2"]
    words = ["--seed given twice with different values (1, then 2)", "give it once"]
    _refused(load(script), argv, words, [(module, function)], workdir, monkeypatch, capsys)


@pytest.mark.parametrize("link", ["loop", "dangling/run"])
def test_an_out_through_a_link_that_leads_nowhere_is_one_line(link, workdir, monkeypatch, capsys):
    """A symbolic-link loop or a dangling link as --out (or on its path) passed the check and ended in
    a traceback when the script made the folder, after its work had started."""
    import nw_adapter.models.training.run as training

    (workdir / "loop").symlink_to("loop")
    (workdir / "dangling").symlink_to(workdir / "moved")
    runs = _spy(monkeypatch, training, "run_training")
    code, err = call(load("train_tiny"), ["--out", link], monkeypatch, capsys)
    one_line(code, err, f"--out '{link}'", "symbolic link that leads nowhere")
    assert sorted(p.name for p in workdir.iterdir()) == ["dangling", "loop", "taken"] and not runs
