"""Atomic writes: durable (fsync before and after the rename), typed failures, nothing half-written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from subprocess_limits import SUBPROCESS_TIMEOUT_S

from nw_adapter import atomic
from nw_adapter.atomic import WriteError, atomic_write, atomic_write_text


def test_file_and_folder_are_flushed_around_the_rename(tmp_path: Path, monkeypatch) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    target = tmp_path / "out.txt"
    atomic_write_text(target, "data")
    kinds = [kind for kind, _ in events]
    assert kinds == ["fsync", "replace", "fsync"], events
    assert Path(events[0][1]).parent == tmp_path and Path(events[0][1]).name.startswith(".out.")
    assert events[2][1] == str(tmp_path)
    assert target.read_text() == "data"


def test_a_safetensors_error_becomes_a_write_error_and_leaves_nothing(tmp_path: Path) -> None:
    from safetensors import SafetensorError

    def failing(tmp: Path) -> None:
        tmp.write_bytes(b"partial")
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    target = tmp_path / "maps.safetensors"
    target.write_text("old")
    with pytest.raises(WriteError, match="cannot write .*maps.safetensors.*StorageFull"):
        atomic_write(target, failing)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["maps.safetensors"]


def test_writer_bugs_are_not_disguised_as_write_errors(tmp_path: Path) -> None:
    def buggy(tmp: Path) -> None:
        raise TypeError("a bug in the writer")

    with pytest.raises(TypeError):
        atomic_write(tmp_path / "x.txt", buggy)
    assert list(tmp_path.iterdir()) == []


def test_file_size_limit_is_a_write_error(tmp_path: Path) -> None:
    """RLIMIT_FSIZE in a child process (SIGXFSZ ignored, so the write fails with EFBIG)."""
    import subprocess
    import sys

    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))\n"
        "from nw_adapter.atomic import WriteError, atomic_write_text\n"
        "try:\n"
        f"    atomic_write_text({str(tmp_path / 'big.txt')!r}, 'x' * 5000)\n"
        "except WriteError as exc:\n"
        "    print(exc); sys.exit(3)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=SUBPROCESS_TIMEOUT_S
    )
    assert proc.returncode == 3, proc.stderr
    assert "File too large" in proc.stdout
    assert list(tmp_path.iterdir()) == []
