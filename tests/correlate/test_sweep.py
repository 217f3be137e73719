"""Sweep bookkeeping: per-image result files, resume, fingerprints, merge order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nw_adapter.correlate.sweep import (
    SingleProcessState,
    fingerprint,
    is_distributed_launch,
    load_result,
    process_state,
    result_path,
    run_sweep,
)


class Worker:
    """Fake per-image work that records which keys it computed."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail_on = fail_on

    def __call__(self, key: str) -> tuple[dict, list[dict]]:
        if key == self.fail_on:
            raise KeyboardInterrupt  # an interruption in the middle of the sweep
        self.calls.append(key)
        return {"key": key}, [{"reference": key, "step": 0, "rho": float(len(key))}]


KEYS = ["a-1", "bb-2", "ccc-3"]


def test_runs_every_image_and_merges_in_input_order(tmp_path: Path) -> None:
    work = Worker()
    outcome = run_sweep(KEYS, work, out_dir=tmp_path, expected_fingerprint="f1", progress=False)
    assert work.calls == KEYS and outcome.computed == KEYS and outcome.reused == []
    assert [r["image"]["key"] for r in outcome.results] == KEYS
    assert all(result_path(tmp_path, k).is_file() for k in KEYS)


def test_resume_after_interruption_skips_finished_images(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        run_sweep(KEYS, Worker(fail_on="ccc-3"), out_dir=tmp_path, expected_fingerprint="f1", progress=False)
    assert result_path(tmp_path, "bb-2").is_file() and not result_path(tmp_path, "ccc-3").exists()
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "result.json"]
    assert leftovers == []  # no half-written temporary files
    before = {k: result_path(tmp_path, k).stat().st_mtime_ns for k in KEYS[:2]}
    work = Worker()
    outcome = run_sweep(KEYS, work, out_dir=tmp_path, expected_fingerprint="f1", progress=False)
    assert work.calls == ["ccc-3"] and outcome.reused == KEYS[:2]
    assert {k: result_path(tmp_path, k).stat().st_mtime_ns for k in KEYS[:2]} == before
    assert [r["records"][0]["rho"] for r in outcome.results] == [3.0, 4.0, 5.0]


def test_changed_options_recompute(tmp_path: Path) -> None:
    run_sweep(KEYS, Worker(), out_dir=tmp_path, expected_fingerprint="f1", progress=False)
    work = Worker()
    run_sweep(KEYS, work, out_dir=tmp_path, expected_fingerprint="f2", progress=False)
    assert work.calls == KEYS


def test_corrupt_result_file_is_recomputed(tmp_path: Path) -> None:
    run_sweep(KEYS, Worker(), out_dir=tmp_path, expected_fingerprint="f1", progress=False)
    result_path(tmp_path, "a-1").write_text('{"schema": "nw-adapter/rho-image", "fingerp')
    assert load_result(tmp_path, "a-1", "f1") is None
    work = Worker()
    run_sweep(KEYS, work, out_dir=tmp_path, expected_fingerprint="f1", progress=False)
    assert work.calls == ["a-1"]
    assert json.loads(result_path(tmp_path, "a-1").read_text())["fingerprint"] == "f1"


def test_fingerprint_is_order_independent_and_value_sensitive() -> None:
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})


def test_single_process_state_outside_a_launcher(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not is_distributed_launch()
    state = process_state(cpu=True)
    assert isinstance(state, SingleProcessState) and state.is_main_process
    with state.split_between_processes([1, 2]) as mine:
        assert mine == [1, 2]
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert is_distributed_launch()
