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
    "--digits-folds",
    "2",
]


def _with(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value replaced (an option is given once: a second value is refused)."""
    at = argv.index(flag)
    return [*argv[: at + 1], value, *argv[at + 2 :]]


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
    # (plugin, fields, off, on): dims x 2 d, shells x 1 d, digits x 2 class folds
    assert len(results) == 4 * 2 + 4 + 4 * 2
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
    folds = [json.loads((out / "results" / f"digits-f{k}-plugin.json").read_text()) for k in (0, 1)]
    for digits in folds:
        assert digits["task_classes"] == sorted(digits["test_classes"])
        assert not set(digits["train_classes"]) & set(digits["test_classes"])  # fitted on other classes
    # cross-validated class folds: every one of the ten digits is a test class once, a unit of the tests
    assert sorted(c for d in folds for c in d["test_classes"]) == list(range(10))
    assert all(r["test_classes"]["n"] == 10 for r in summary["digits"]["rows"])
    assert report.index("The paper beside this run") < report.index("Nearest-neighbour collapse")
    assert summary["paper_table"] and all(c["n"] >= 2 for c in summary["coverage"])
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
    assert main(["--out", str(out), *_with(TINY, "--support-sizes", "1,4")]) == 2
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
        ["--scale", "huge"],
        ["--quick", "--scale", "paper"],
        ["--device", "cuda:99"],
        ["--device", "toaster"],
        ["--scheduler", "tcp://127.0.0.1:1"],
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


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("empty.npz", b"", "is empty, truncated or not a NumPy file"),
        ("other.npz", b"\x89PNG\r\n\x1a\n" + bytes(40), "is empty, truncated or not a NumPy file"),
        ("truncated.npy", b"\x93NUMPY\x01\x00v\x00{'descr'", "is empty, truncated or not a NumPy file"),
    ],
    ids=["empty-npz", "not-numpy", "truncated-npy"],
)
def test_a_damaged_feature_file_is_one_line_naming_it(tmp_path, name, content, words, capsys):
    """Before, an empty .npz was numpy's EOFError traceback (exit 1) and a truncated .npy numpy's
    header error without the file or a fix."""
    path = tmp_path / name
    path.write_bytes(content)
    labels = ["--labels", str(path)] if name.endswith(".npy") else []
    code = main(["--out", str(tmp_path / "o"), "--quick", "--features", str(path), *labels])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert words in err and str(path) in err and "pass a complete .npz or .npy file" in err
    assert not (tmp_path / "o").exists()


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


def test_scale_presets_include_the_papers_width_steps_and_batch():
    from nw_adapter.experiments.scale import SCALES

    paper = SCALES["paper"]
    assert (paper.d_model, paper.num_heads, paper.num_layers) == (128, 4, 3)
    assert (paper.steps, paper.tasks_per_batch, paper.targets_per_task, paper.lr) == (100_000, 256, 256, 1e-4)
    assert (paper.eval_tasks, paper.eval_generated) == (100, 500)
    assert SCALES["full"].dims == (2, 4, 8, 16)  # the mixtures regime at every d of the paper


def _results_of(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((out / "results").glob("*.json"))}


def test_the_grid_runs_on_a_dask_cluster_with_the_same_results_and_resumes(tmp_path):
    """The unit grid dispatched through Dask's distributed scheduler (a LocalCluster, as a user's
    cluster would be reached by its address) gives the local pool's results unit for unit; a rerun
    skips the finished units whichever engine ran them; a changed configuration is still refused."""
    distributed = pytest.importorskip("distributed", reason="the cluster extra (dask[distributed]) is absent")
    tiny = [*_with(TINY, "--dims", "2"), "--regimes", "dims"]
    local = tmp_path / "local"
    assert main(["--out", str(local), *tiny]) == 0
    with distributed.LocalCluster(
        n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None
    ) as cl:
        cluster = tmp_path / "dask"
        args = [
            "--out",
            str(cluster),
            *_with(tiny, "--workers", "2"),
            "--engine",
            "dask",
            "--scheduler",
            cl.scheduler_address,
        ]
        assert main(args) == 0
        ran, ref = _results_of(cluster), _results_of(local)
        assert (
            sorted(ran)
            == sorted(ref)
            == ["dims-d2-fields", "dims-d2-plugin", "dims-d2-s0-off", "dims-d2-s0-on"]
        )
        for uid in ref:
            if "mmd2_median" in ref[uid]:
                assert ran[uid]["mmd2_median"] == pytest.approx(ref[uid]["mmd2_median"], rel=1e-5)
        stamps = {p.name: p.stat().st_mtime_ns for p in (cluster / "results").glob("*.json")}
        assert main(args) == 0  # resume: nothing left to run
        assert {p.name: p.stat().st_mtime_ns for p in (cluster / "results").glob("*.json")} == stamps
        timing = json.loads((cluster / "timing.json").read_text())["invocations"]
        assert [t["engine"] for t in timing] == ["dask", "dask"] and timing[1]["units_run"] == 0
        changed = ["--out", str(cluster), *TINY, "--regimes", "dims", "--dims", "2,3", "--engine", "dask"]
        assert main([*changed, "--scheduler", cl.scheduler_address]) == 2  # config check unchanged


def test_more_class_folds_than_feature_classes_is_one_line_exit_2(tmp_path, capsys):
    import numpy as np

    rng = np.random.default_rng(0)
    path = tmp_path / "f.npz"
    np.savez(path, features=rng.standard_normal((300, 8)), labels=np.repeat([0, 1, 2], 100))
    code = main(["--out", str(tmp_path / "o"), "--features", str(path), "--digits-folds", "4", "--quick"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--digits-folds 4 exceeds the 3 classes" in err and len(err.splitlines()) == 1


def _free_port() -> int:
    """A local TCP port where nothing listens (bound once, then released)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    ("out", "extra", "words"),
    [
        ("", [], "--out is empty"),
        (" ", [], "--out is empty"),
        ("file", [], "is a file"),
        ("file/run", [], "lies inside the file"),
        ("o", ["--engine", "dask", "--scheduler", "PORT"], "nothing answers there"),
        ("o", ["--engine", "dask", "--scheduler", "tcp://no-port"], "not a scheduler address"),
    ],
    ids=["empty", "blank", "a-file", "inside-a-file", "dead-scheduler", "no-port"],
)
def test_bad_out_and_scheduler_are_one_line_before_anything_runs(
    tmp_path, monkeypatch, capsys, out, extra, words
):
    """``--out ""`` (the current folder), an existing file or a path inside one, and a ``--scheduler``
    where nothing listens: one line naming the option, exit 2, nothing written, nothing run."""
    import nw_adapter.experiments.runner as runner

    if "dask" in extra:
        pytest.importorskip("distributed")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    runs = []
    monkeypatch.setattr(runner, "run_experiments", lambda *a, **k: runs.append(a) or tmp_path / "report.md")
    extra = [f"tcp://127.0.0.1:{_free_port()}" if part == "PORT" else part for part in extra]
    try:
        code = main(["--out", out, *TINY, *extra])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and not runs and len(err.strip().splitlines()) == 1, err
    assert words in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_python_m_experiments_with_a_file_as_out_is_one_line(tmp_path):
    target = tmp_path / "taken"
    target.write_text("x")
    command = [sys.executable, "-m", "nw_adapter", "experiments", "--out", str(target), "--quick"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "is a file" in proc.stderr and target.read_text() == "x"


@pytest.mark.parametrize("option", ["--threads", "--workers"])
def test_parallelism_above_its_limit_is_one_line_before_anything_runs(option, tmp_path, monkeypatch, capsys):
    """100000 torch threads crash the interpreter at the first matrix product; 10**11 workers is no
    machine's: both are refused in one line naming the limit, nothing run."""
    import nw_adapter.experiments.runner as runner

    runs = []
    monkeypatch.setattr(runner, "run_experiments", lambda *a, **k: runs.append(a) or tmp_path / "report.md")
    try:
        code = main(["--out", str(tmp_path / "o"), *TINY[:1], option, "100000"])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and not runs and len(err.strip().splitlines()) == 1, err
    assert f"{option} must be at most 1024, got '100000'" in err
