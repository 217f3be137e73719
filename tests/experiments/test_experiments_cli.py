"""End-to-end CLI on a drastically reduced config: report files, resume, bad input -> exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nw_adapter.experiments.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--quick",
    "--workers",
    "1",
    "--no-progress",
    "--steps",
    "3",
    "--digits-steps",
    "3",
    "--eval-tasks",
    "2",
    "--eval-generated",
    "8",
    "--eval-targets",
    "8",
    "--digits-targets",
    "8",
    "--digits-tasks-per-class",
    "1",
    "--grid-points",
    "4",
    "--d-model",
    "8",
    "--tasks-per-batch",
    "2",
    "--targets-per-task",
    "4",
    "--head-tasks",
    "1",
    "--head-targets",
    "4",
    "--dims",
    "2,3",
    "--shell-dims",
    "4",
    "--support-sizes",
    "1,3",
]


def test_quick_path_end_to_end_and_resume(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--out", str(out), *TINY]) == 0
    for name in (
        "report.md",
        "report.json",
        "dims.png",
        "shells.png",
        "digits.png",
        "heads.png",
        "config.json",
        "matrix.md",
    ):
        assert (out / name).is_file(), name
    results = sorted(p.name for p in (out / "results").glob("*.json"))
    assert len(results) == 4 * 2 + 4 + 4  # (plugin, fields, off, on): dims x 2 d, shells x 1 d, digits
    printed = capsys.readouterr().out
    assert "fix x regime matrix" in printed and "amortised tau" in printed  # the CLI prints the matrix
    report = (out / "report.md").read_text()
    for heading in ("Nearest-neighbour collapse", "Geometry mismatch", "Support scarcity", "heads as NW"):
        assert heading in report
    assert "+28%" in report and "11.2" in report  # the paper's numbers beside ours
    summary = json.loads((out / "report.json").read_text())
    assert [r["d"] for r in summary["dims"]["rows"]] == [2, 3]
    assert [r["m"] for r in summary["digits"]["rows"]] == [1, 3]
    assert all("appeared" in v for v in summary["dims"]["verdicts"])
    # digits evaluation: exactly --digits-tasks-per-class tasks from each test class, tested per class
    digits = json.loads((out / "results" / "digits-plugin.json").read_text())
    assert digits["task_classes"] == sorted(digits["test_classes"])
    assert all(r["test_classes"]["n"] == len(digits["test_classes"]) for r in summary["digits"]["rows"])
    assert "test_tasks" not in summary["digits"]["rows"][0]  # no pseudo-replicated test over tasks
    matrix = summary["matrix"]
    assert [(c["regime"], c["setting"]) for c in matrix["columns"]] == [
        ("dims", "d=2"),
        ("dims", "d=3"),
        ("shells", "d=4"),
        ("digits", "m=1"),
    ]
    assert set(matrix["cells"]) == {"smoothed", "local_cov", "projected", "amortised", "learned_on"}
    assert len(matrix["verdicts"]) == 4 and "fix x regime matrix" in report
    assert any(p["where"].startswith("matrix ") for p in summary["p_values"])  # in the Holm family
    assert {r["variant"] for r in summary["baseline"]} == {"OFF", "ON"}
    # the amortised tau is fitted on TRAINING tasks of the family, never on the test tasks
    from nw_adapter.core.smoothed_fields import fit_shared_tau
    from nw_adapter.experiments.tasks import GaussianMixtureFamily, split_generator
    from nw_adapter.experiments.units import AMORTISE_HELDOUT, AMORTISE_TASKS

    train = GaussianMixtureFamily(2).sample(
        AMORTISE_TASKS, 50, AMORTISE_HELDOUT, generator=split_generator(0, "train")
    )
    fields = json.loads((out / "results" / "dims-d2-fields.json").read_text())
    assert fields["amortised_tau"] == fit_shared_tau(train.support, train.target)
    assert len(summary["p_values"]) >= 1 and "Multiple comparisons" in report
    off = json.loads((out / "results" / "dims-d2-s0-off.json").read_text())
    assert len(off["heads_untrained"]) == len(off["heads"]) > 0
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "results").glob("*.json")}
    # rerun: finished units are skipped, the report is rewritten
    assert main(["--out", str(out), *TINY]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in (out / "results").glob("*.json")} == stamps
    assert len(json.loads((out / "timing.json").read_text())["invocations"]) == 2
    # a different configuration in the same folder is refused
    assert main(["--out", str(out), *TINY[:-2], "--support-sizes", "1,4"]) == 2
    assert "different configuration" in capsys.readouterr().err
    assert not list(out.glob(".*.tmp"))


@pytest.mark.parametrize(
    "args",
    [
        ["--dims", "0"],
        ["--regimes", "dims,foo"],
        ["--workers", "0"],
        ["--steps", "x"],
        ["--labels", "y.npy"],
        ["--features", "missing.npz"],
    ],
)
def test_bad_input_exits_2(tmp_path, args, capsys):
    try:
        code = main(["--out", str(tmp_path / "o"), *args])
    except SystemExit as exc:  # argparse errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err and "Traceback" not in err
    assert not (tmp_path / "o" / "results").exists()


def test_script_bad_input_one_line_exit_2(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "run_experiments.py"),
            "--out",
            str(tmp_path / "o"),
            "--features",
            "missing.npz",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "does not exist" in proc.stderr


def test_per_regime_script_help():
    for name in ("run_dimension_sweep", "run_shells", "run_support_sweep"):
        text = (ROOT / "scripts" / f"{name}.py").read_text()
        assert "regimes=(" in text
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run_shells.py"), "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "--out" in proc.stdout and "--steps" not in proc.stdout
    assert "--regimes" not in proc.stdout
