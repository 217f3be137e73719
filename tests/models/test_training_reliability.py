"""Issue 20 for train_tiny.py: stage records name the CPU (informational: the shipped records without
it are still reused), a malformed stage.json is one line naming the field, and a killed run's
staging folders are removed by the next run, never a user's folder."""

from __future__ import annotations

import copy
import fcntl
import json
from pathlib import Path

import pytest

from nw_adapter.models.training import run as training
from nw_adapter.models.training.run import (
    INFORMATIONAL,
    STAGE_RECORD,
    StageMismatchError,
    TrainingConfig,
    _checked_stage,
    _record_problem,
    _stage_record,
    cpu_model,
    remove_interrupted_stages,
)

SHIPPED = Path(training.__file__).resolve().parents[1] / "weights" / "tiny_digits" / STAGE_RECORD


def never_built(path: Path) -> None:
    raise AssertionError("an existing stage folder must not be rebuilt")


def stage_folder(tmp_path: Path, record: dict) -> Path:
    folder = tmp_path / "stage"
    folder.mkdir(exist_ok=True)
    (folder / STAGE_RECORD).write_text(json.dumps(record))
    return folder


def with_cpu(record: dict, cpu: str) -> dict:
    """``record`` with ``environment.cpu`` set at every nesting level."""
    record = copy.deepcopy(record)
    record["environment"]["cpu"] = cpu
    for entry in record["inputs"].values():
        entry["record"] = with_cpu(entry["record"], cpu)
    return record


def test_records_name_the_cpu_model():
    record = _stage_record("vae", TrainingConfig.quick(), {})
    assert record["environment"]["cpu"] == cpu_model() and cpu_model() not in ("", "unknown")
    assert INFORMATIONAL == ("cpu",)


def test_the_shipped_record_without_a_cpu_field_is_still_reused(tmp_path):
    shipped = json.loads(SHIPPED.read_text())
    assert "cpu" not in shipped["environment"] and _record_problem(shipped) is None
    folder = stage_folder(tmp_path, shipped)
    assert _checked_stage(folder, with_cpu(shipped, cpu_model()), never_built) == folder
    assert _checked_stage(folder, with_cpu(shipped, "another CPU"), never_built) == folder
    other = with_cpu(shipped, cpu_model())
    other["inputs"]["unet"]["record"]["environment"]["threads"] = 2  # a deciding field still decides
    with pytest.raises(StageMismatchError, match=r"inputs\.unet\.record\.environment\.threads"):
        _checked_stage(folder, other, never_built)


def _paths(record: dict, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a nested record."""
    out = []
    for key, value in record.items():
        out.append((*prefix, key))
        if isinstance(value, dict):
            out += _paths(value, (*prefix, key))
    return out


CORRUPTIONS = {
    "null": lambda: None,
    "text": lambda: "x",
    "number": lambda: 7,
    "list": lambda: [1],
    "object": lambda: {"nested": [1]},
}


def test_every_field_of_stage_json_corrupted_is_one_line_or_reused(tmp_path):
    """Each corruption (type, null, missing, wrong nesting) of each field: the folder is refused
    with one line naming stage.json (and the field, when the record is malformed), or reused when
    only an informational field changed; never another exception."""
    config = TrainingConfig.quick()
    vae = _stage_record("vae", config, {})
    text = _stage_record("text_encoder", config, {})
    record = _stage_record(
        "unet", config, {"vae": vae, "text_encoder": text}, {"vae": "a", "text_encoder": "b"}
    )
    outcomes = {}
    for path in _paths(record):
        for name, make in [*CORRUPTIONS.items(), ("missing", None)]:
            broken = copy.deepcopy(record)
            parent = broken
            for key in path[:-1]:
                parent = parent[key]
            if make is None:
                del parent[path[-1]]
            else:
                parent[path[-1]] = make()
            folder = stage_folder(tmp_path, broken)
            try:
                _checked_stage(folder, record, never_built)
                outcomes[path, name] = "reused"
            except StageMismatchError as exc:
                message = str(exc)
                assert "\n" not in message and str(folder) in message, message
                outcomes[path, name] = message
    reused = {key for key, outcome in outcomes.items() if outcome == "reused"}
    scalar = ("null", "text", "number", "missing")  # an informational value of any scalar kind, or none
    assert reused == {(path, name) for path, name in outcomes if path[-1] == "cpu" and name in scalar}
    assert "field 'environment' must be an object, got null" in outcomes[("environment",), "null"]
    assert "field 'inputs.vae.files' must be a SHA-256" in outcomes[("inputs", "vae", "files"), "list"]
    assert (
        "field 'inputs.vae.record.settings' is missing"
        in outcomes[("inputs", "vae", "record", "settings"), "missing"]
    )
    assert "field 'settings.seed' must be a number" in outcomes[("settings", "seed"), "object"]
    assert "stage.json is malformed" in outcomes[("inputs",), "list"]


def test_killed_runs_staging_folders_are_removed_and_users_folders_kept(tmp_path):
    stages = tmp_path / "stages"
    ours = [stages / ".image_encoder-abcd1234", stages / ".vae-zz_9x8y7", tmp_path / ".tiny_digits-k2x_9abq"]
    users = [
        stages / ".image_encoder-notes",
        stages / ".mine-abcd1234",
        stages / "image_encoder-abcd1234",
        tmp_path / ".vae-abcd1234",
    ]  # fmt: skip  (a stage's staging folder lives in stages/, not out/)
    for folder in ours + users:
        (folder / "out").mkdir(parents=True)
        (folder / "out" / "weights.safetensors").write_text("x")
    (stages / ".log.ab12cd34.tmp.json").write_text("{")
    (stages / ".unet-abcd1234").write_text("a file, not a staging folder")
    removed = remove_interrupted_stages(tmp_path)
    assert sorted(removed) == sorted([*ours, stages / ".log.ab12cd34.tmp.json"])
    assert all(folder.is_dir() for folder in users) and (stages / ".unet-abcd1234").is_file()


def test_cleaning_up_never_reaches_through_a_linked_stages_folder(tmp_path):
    # A user's folder reached through a linked stages/ holds names of the tool's staging pattern;
    # the cleanup of a real stages/ removes them (the test above), through the link nothing.
    precious = tmp_path / "precious"
    leftovers = [precious / ".vae-abcd1234", precious / ".log.ab12cd34.tmp.json"]
    leftovers[0].mkdir(parents=True)
    leftovers[1].write_text("{")
    out = tmp_path / "run"
    out.mkdir()
    (out / "stages").symlink_to(precious, target_is_directory=True)
    assert remove_interrupted_stages(out) == []
    assert leftovers[0].is_dir() and leftovers[1].is_file()


def test_an_out_folder_that_is_a_link_is_cleaned_like_a_folder(tmp_path):
    real = tmp_path / "disk" / "run"
    leftover = real / "stages" / ".vae-abcd1234"
    leftover.mkdir(parents=True)
    out = tmp_path / "run"
    out.symlink_to(real, target_is_directory=True)  # the user named this folder
    assert remove_interrupted_stages(out) == [out / "stages" / ".vae-abcd1234"]
    assert not leftover.exists()


def test_run_training_cleans_up_first_unless_another_run_trains(tmp_path, monkeypatch):
    class Stop(Exception):
        pass

    def stop():
        raise Stop

    monkeypatch.setattr(training, "load_digit_splits", stop)  # the first thing a run does after cleaning
    leftover = tmp_path / "stages" / ".unet-abcd1234" / "out"
    leftover.mkdir(parents=True)
    with open(tmp_path / training.LOCK_NAME, "a+") as other_run:
        fcntl.flock(other_run, fcntl.LOCK_SH)  # another run is training in this folder
        with pytest.raises(Stop):
            training.run_training(tmp_path, TrainingConfig.quick(), progress=False)
        assert leftover.is_dir()  # its staging folder may be alive
    with pytest.raises(Stop):
        training.run_training(tmp_path, TrainingConfig.quick(), progress=False)
    assert not leftover.parent.exists()


def test_a_key_with_a_line_break_in_stage_json_still_gives_one_line(tmp_path):
    record = _stage_record("vae", TrainingConfig.quick(), {})
    broken = copy.deepcopy(record)
    broken["settings"]["two\nlines"] = [1]
    folder = stage_folder(tmp_path, broken)
    with pytest.raises(StageMismatchError) as info:
        _checked_stage(folder, record, never_built)
    assert "\n" not in str(info.value) and "settings.'two\\nlines'" in str(info.value)
