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


class FileWorker:
    """Fake work that writes ``generated.png`` (content = run label + key), optionally ``maps``."""

    def __init__(
        self, out_dir: Path, label: str, *, maps: bool = False, stop_after_write: bool = False, sha=None
    ) -> None:
        self.out_dir, self.label, self.maps, self.stop = out_dir, label, maps, stop_after_write
        self.sha = sha or {}
        self.calls: list[str] = []

    def __call__(self, key: str) -> tuple[dict, list[dict]]:
        from nw_adapter.atomic import atomic_write_text
        from nw_adapter.correlate.sweep import image_dir

        self.calls.append(key)
        atomic_write_text(image_dir(self.out_dir, key) / "generated.png", f"{self.label}:{key}")
        if self.stop:
            raise KeyboardInterrupt  # killed after the image was rewritten, before its result file
        if self.maps:
            atomic_write_text(image_dir(self.out_dir, key) / "maps.safetensors", "maps")
        return {"key": key, "sha256": self.sha.get(key, f"sha-{key}")}, [
            {"reference": key, "step": 0, "rho": 0.5}
        ]


def generated(out: Path, key: str) -> str:
    from nw_adapter.correlate.sweep import image_dir

    return (image_dir(out, key) / "generated.png").read_text()


def test_interrupted_run_with_other_options_never_mixes_with_a_finished_one(tmp_path: Path) -> None:
    run_sweep(
        KEYS, FileWorker(tmp_path, "seed0"), out_dir=tmp_path, expected_fingerprint="s0", progress=False
    )
    with pytest.raises(KeyboardInterrupt):
        run_sweep(
            KEYS, FileWorker(tmp_path, "seed7", stop_after_write=True), out_dir=tmp_path,
            expected_fingerprint="s7", progress=False,
        )  # fmt: skip
    assert generated(tmp_path, "a-1") == "seed7:a-1"
    rerun = FileWorker(tmp_path, "seed0")
    outcome = run_sweep(KEYS, rerun, out_dir=tmp_path, expected_fingerprint="s0", progress=False)
    assert rerun.calls == ["a-1"] and outcome.reused == KEYS[1:]
    assert all(generated(tmp_path, k) == f"seed0:{k}" for k in KEYS)


def test_a_changed_output_file_is_recomputed(tmp_path: Path) -> None:
    from nw_adapter.correlate.sweep import image_dir

    run_sweep(KEYS, FileWorker(tmp_path, "x"), out_dir=tmp_path, expected_fingerprint="f", progress=False)
    assert json.loads(result_path(tmp_path, "bb-2").read_text())["files"]["generated.png"]
    (image_dir(tmp_path, "bb-2") / "generated.png").write_text("edited by hand")
    (image_dir(tmp_path, "ccc-3") / "generated.png").unlink()
    again = FileWorker(tmp_path, "x")
    run_sweep(KEYS, again, out_dir=tmp_path, expected_fingerprint="f", progress=False)
    assert again.calls == ["bb-2", "ccc-3"] and generated(tmp_path, "bb-2") == "x:bb-2"


def test_a_result_of_another_reference_file_is_not_reused(tmp_path: Path) -> None:
    hashes = {k: f"sha-{k}" for k in KEYS}
    run_sweep(KEYS, FileWorker(tmp_path, "x"), out_dir=tmp_path, expected_fingerprint="f", progress=False)
    other = {**hashes, "a-1": "sha-of-another-file"}
    work = FileWorker(tmp_path, "x", sha=other)
    run_sweep(KEYS, work, out_dir=tmp_path, expected_fingerprint="f", progress=False, image_hashes=other)
    assert work.calls == ["a-1"]


def test_stale_files_of_another_option_set_are_removed(tmp_path: Path) -> None:
    from nw_adapter.correlate.sweep import image_dir

    run_sweep(KEYS, FileWorker(tmp_path, "m", maps=True), out_dir=tmp_path, expected_fingerprint="with-maps",
              progress=False)  # fmt: skip
    assert (image_dir(tmp_path, "a-1") / "maps.safetensors").is_file()
    run_sweep(
        KEYS, FileWorker(tmp_path, "n"), out_dir=tmp_path, expected_fingerprint="no-maps", progress=False
    )
    assert not any((image_dir(tmp_path, k) / "maps.safetensors").exists() for k in KEYS)
    names = sorted(p.name for p in image_dir(tmp_path, "a-1").iterdir())
    assert names == [".nw-adapter-files.json", "generated.png", "result.json"]  # manifest + the run's


@pytest.mark.parametrize("content", ["null", "[1, 2]", '"done"', "3"])
def test_result_file_that_is_json_but_not_an_object_counts_as_unfinished(
    content: str, tmp_path: Path
) -> None:
    run_sweep(KEYS, Worker(), out_dir=tmp_path, expected_fingerprint="f1", progress=False)
    result_path(tmp_path, "bb-2").write_text(content)
    assert load_result(tmp_path, "bb-2", "f1") is None
    work = Worker()
    run_sweep(KEYS, work, out_dir=tmp_path, expected_fingerprint="f1", progress=False)
    assert work.calls == ["bb-2"]


def test_the_previous_report_is_removed_before_any_image_changes(tmp_path: Path) -> None:
    calls: list[str] = []

    def before() -> None:
        calls.append("removed")

    run_sweep(
        KEYS, Worker(), out_dir=tmp_path, expected_fingerprint="f1", progress=False, before_changes=before
    )
    assert calls == ["removed"]
    run_sweep(
        KEYS, Worker(), out_dir=tmp_path, expected_fingerprint="f1", progress=False, before_changes=before
    )
    assert calls == ["removed"]  # everything reused: the report stays

    class Recorded(Worker):
        def __call__(self, key: str):
            assert calls == ["removed", "removed"], "an image changed before the report was removed"
            return super().__call__(key)

    run_sweep(
        KEYS, Recorded(), out_dir=tmp_path, expected_fingerprint="f2", progress=False, before_changes=before
    )
