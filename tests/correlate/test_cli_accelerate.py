"""Two processes under ``accelerate launch`` on the CPU give the same merged report as one.

``accelerate launch --cpu`` starts a single process (accelerate runs several CPU processes
only through MPI), so the test launches with ``--multi_gpu --num_processes 2``: accelerate
then starts the processes with torch.distributed.run, and on a machine without GPUs
``PartialState(cpu=True)`` joins them with the gloo backend. Both runs use one thread per
process (``OMP_NUM_THREADS=1``, the launcher's default too) so that every number is
bit-identical.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from sklearn.datasets import load_sample_image
from subprocess_limits import SUBPROCESS_TIMEOUT_S

from nw_adapter.correlate.cli import main

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def reference_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "refs"
    folder.mkdir()
    Image.fromarray(load_sample_image("china.jpg")).save(folder / "china.png")
    Image.fromarray(load_sample_image("flower.jpg")).save(folder / "flower.jpg", quality=90)
    return folder


def test_two_processes_match_one(
    tmp_path, reference_dir, tiny_sd15_dir, tiny_ip_adapter_dir, monkeypatch
) -> None:
    common = [
        "--image-dir", str(reference_dir), "--model", str(tiny_sd15_dir),
        "--ip-adapter", str(tiny_ip_adapter_dir), "--steps", "2", "--scheduler", "ddim",
    ]  # fmt: skip
    two = tmp_path / "two"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), str(REPO / "scripts" / "correlate.py"),
    ]  # fmt: skip
    proc = subprocess.run(
        [*launch, *common, "--out", str(two)],
        capture_output=True,
        text=True,
        env=env,
        timeout=SUBPROCESS_TIMEOUT_S,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: process 0/2 computed 1 image(s)" in proc.stderr
    assert "note: process 1/2 computed 1 image(s)" in proc.stderr
    assert proc.stdout.count("verdict: ") == 1  # only the main process reports

    one = tmp_path / "one"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main([*common, "--out", str(one), "--quiet"]) == 0

    merged_two = json.loads((two / "rho.json").read_text())
    merged_one = json.loads((one / "rho.json").read_text())
    assert len(merged_one["images"]) == 2
    # each process records its own images: every record of the run carries one settings digest
    assert len({(r["run"], r["settings"]) for r in merged_two["records"]}) == 1
    assert merged_two == merged_one
    assert (two / "rho.csv").read_bytes() == (one / "rho.csv").read_bytes()
    for info in merged_one["images"]:
        assert (two / info["generated"]).read_bytes() == (one / info["generated"]).read_bytes()


def test_support_sets_split_over_two_processes_match_one(tmp_path, monkeypatch) -> None:
    """``--support-set`` under ``accelerate launch``: both processes took the same --out and the lock
    fired (a ChildFailedError); now each process generates its share of the sets and the main one
    writes the report, the same files as one process."""
    from nw_adapter.models.tiny_digits import example_image_path

    pairs = [f"{example_image_path(a)},{example_image_path(b)}" for a, b in ((3, 7), (1, 2))]
    common = ["--model", "tiny", "--steps", "1", "--support-set", pairs[0], "--support-set", pairs[1], "-q"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), str(REPO / "scripts" / "correlate.py"),
    ]  # fmt: skip
    two, one = tmp_path / "two", tmp_path / "one"
    proc = subprocess.run(
        [*launch, *common, "--out", str(two)], capture_output=True, text=True, env=env,
        timeout=SUBPROCESS_TIMEOUT_S, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("support sets (") == 1  # only the main process reports
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main([*common, "--out", str(one)]) == 0
    for name in ("support.json", "support.csv", "sets/set00/generated.png", "sets/set01/generated.png"):
        assert (two / name).read_bytes() == (one / name).read_bytes(), name
