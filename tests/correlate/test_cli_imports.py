"""Both command lines answer ``--help`` and every argument error before torch, diffusers or transformers load.

Deterministic: one subprocess runs each case through the real entry functions and reports which of
the heavy libraries are in ``sys.modules`` afterwards (no timing). The numbers behind it (modules
imported, CPU time against ``python -c pass``) are in benchmarks/cli_startup.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_limits import SUBPROCESS_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "diffusers", "transformers", "accelerate", "huggingface_hub")

_RUNNER = r"""
import contextlib, io, json, sys
heavy = {heavy!r}
cases = json.loads(sys.argv[1])
results = []
for module, argv in cases:
    main = __import__(module, fromlist=["main"]).main
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    loaded = [name for name in heavy if name in sys.modules]
    results.append({{"argv": argv, "code": code, "stderr": err.getvalue(), "loaded": loaded}})
    if loaded:
        break  # later cases would inherit the import
print(json.dumps(results))
"""


def run_cases(cases: list[tuple[str, list[str]]], cwd: Path) -> list[dict]:
    """Run ``main(argv)`` of each (module, argv) in one fresh interpreter; what each left behind."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER.format(heavy=HEAVY), json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=SUBPROCESS_TIMEOUT_S,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


CORRELATE = "nw_adapter.correlate.cli"
EXPERIMENTS = "nw_adapter.experiments.cli"


def _correlate_cases(image: str) -> list[list[str]]:
    base = ["--image", image, "--out", "out"]
    return [
        ["--help"],
        ["--example-dir"],
        [],
        ["--stpes", "3", *base],
        ["--steps", "0", *base],
        ["--seed", "x", *base],
        ["--untrained-seed", "-1", *base],
        ["--bandwidth", "wide", *base],
        ["--height", "30", *base],
        ["--layers", "up,,mid", *base],
        ["--mode", "replace", *base],
        ["--model", "tiny-sd15", *base],
        ["--model", " ", *base],
        ["--replot", "old", *base],
        ["--swap-rules", "matched", *base],
        ["--compare-swap", "--swap-rules", "wide", *base],
        ["--compare-swap", "--bandwidth", "fitted", *base],
        ["--compare-swap", "--mode", "swap", *base],
        ["--labels", "x", "--compare-swap", *base],
        ["--image", "missing.png", "--out", "out"],
        ["--image", image, "--out", image],
        ["--device", "meta", *base],
        ["--support-set", f"{image},{image}", "--bandwidth", "fitted", "--out", "out"],
        ["--compare-swap", "--no-untrained-control", *base],
        ["--no-untrained-control", "--control-draws", "2", *base],
        ["--end-to-end-seed", "2", *base],
        ["--image-dir", ".", "--out", "."],
        ["--replot", "old", "--steps", "3"],
    ]


def _experiments_cases() -> list[list[str]]:
    return [
        ["--help"],
        [],
        ["--out", "o", "--workers", "0"],
        ["--out", "o", "--regimes", "dims,sky"],
        ["--out", "o", "--labels", "l.npy"],
        ["--out", "o", "--qiuck"],
    ]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    from PIL import Image

    folder = tmp_path_factory.mktemp("light")
    Image.new("RGB", (48, 48), (120, 30, 200)).save(folder / "ref.png")
    cases = [(CORRELATE, argv) for argv in _correlate_cases("ref.png")]
    cases += [(EXPERIMENTS, argv) for argv in _experiments_cases()]
    return run_cases(cases, folder)


def test_every_case_ran_and_none_imported_a_heavy_library(results: list[dict]) -> None:
    offender = next((r for r in results if r["loaded"]), None)
    assert offender is None, f"{offender['argv']} imported {offender['loaded']}"
    assert len(results) == len(_correlate_cases("ref.png")) + len(_experiments_cases())


def test_help_and_example_dir_exit_zero_the_errors_exit_two_in_one_line(results: list[dict]) -> None:
    for result in results:
        argv = result["argv"]
        if argv in (["--help"], ["--example-dir"]):
            assert result["code"] == 0, result
            continue
        lines = [line for line in result["stderr"].splitlines() if line.strip()]
        assert result["code"] == 2, result
        assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in result["stderr"], result


def test_the_real_script_answers_help_without_torch(tmp_path: Path) -> None:
    """``python scripts/correlate.py --help``, as a user runs it, with ``-X importtime``'s list of modules."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", str(REPO / "scripts" / "correlate.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert proc.returncode == 0 and "--bandwidth" in proc.stdout
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
