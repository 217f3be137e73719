"""Record files read back: a malformed file is one ValueError line naming file, record and field.

The promise checked for every corruption (type, null, missing, extra, wrong nesting) of every
field: ``NWRecorder.from_json`` either raises ``ValueError`` with one line naming the file, the
record and the field, or returns a recorder whose ``summary``, ``plot`` and ``to_records`` all
work (nothing fails later, e.g. a ``KeyError`` in ``summary``).
"""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path

import pytest

from nw_adapter.analysis.validation import (
    FIELD_KINDS,
    RecordError,
    check_image_result,
    check_records_file,
    check_report,
)
from nw_adapter.integration.recorder import NWRecorder
from nw_adapter.integration.schema import STAT_NAMES

LAYERS = ("down_blocks.0.attentions.0.transformer_blocks.0.attn2.processor", "up_blocks.1.attn2.processor")


def make_records(reference: str | None = "ref-1") -> list[dict]:
    """Records of two steps x two layers x two heads x two halves, every field filled."""
    records = []
    for step, timestep in ((0, 981.0), (1, 1.0)):
        for layer in LAYERS:
            for head in (0, 1):
                for half in ("uncond", "cond"):
                    record = {
                        "call": 0, "step": step, "timestep": timestep, "alpha": 0.5, "sigma": 0.8,
                        "h_schedule": 1.6, "layer": layer, "block": layer.split("_")[0], "head": head,
                        "half": half, "adapter": 0, "image": 0, "scale": 1.0, "num_keys": 4, "key_set": "ip",
                    }  # fmt: skip
                    record.update({name: 0.1 * (i + 1) + 0.01 * step for i, name in enumerate(STAT_NAMES)})
                    if reference is not None:
                        record = {"reference": reference, **record}
                    records.append(record)
    return records


def records_file(records: list) -> dict:
    return {
        "schema": "nw-adapter/records",
        "schema_version": 1,
        "config": {"mode": "observe"},
        "records": records,
    }


def write(path: Path, document) -> Path:
    path.write_text(json.dumps(document))
    return path


def assert_one_line_naming(message: str, *parts: str) -> None:
    assert "\n" not in message, message
    for part in parts:
        assert part in message, (part, message)


def loads_cleanly_or_fails_in_one_line(path: Path, where: str | None, field: str | None) -> bool:
    """The promise; returns True when the file was refused."""
    try:
        recorder = NWRecorder.from_json(path)
    except ValueError as exc:
        assert_one_line_naming(str(exc), str(path), *(p for p in (where, field) if p))
        return True
    rows = recorder.summary()
    assert rows and all(isinstance(r["count"], int) for r in rows)
    recorder.to_records()
    recorder.plot()
    return False


# ------------------------------------------------------------------ the examples


@pytest.mark.parametrize(
    ("records", "where", "field"),
    [
        ([1, 2], "records[0]", None),
        ([None], "records[0]", None),
        ([[{"call": 0}]], "records[0]", None),
        ("records", "records", None),
        (
            [{"step": 0, "half": "cond", "rho": 0.5}],
            "records[0]",
            "call",
        ),  # was KeyError: 'call' in summary()
        ([{"call": 0, "step": 0, "half": "cond"}], "records[0]", "rho"),
    ],
)
def test_from_json_refuses_malformed_records_in_one_line(tmp_path, records, where, field):
    path = write(tmp_path / "records.json", records_file(records))
    with pytest.raises(ValueError) as info:
        NWRecorder.from_json(path)
    assert_one_line_naming(str(info.value), str(path), where, *([field] if field else []))


def test_from_json_refuses_a_config_the_config_class_refuses(tmp_path):
    document = records_file(make_records())
    document["config"] = {"mode": "sideways"}
    path = write(tmp_path / "records.json", document)
    with pytest.raises(ValueError, match=r"records.json': config: NWProcessorConfig: `mode`"):
        NWRecorder.from_json(path)
    document["config"] = ["observe"]
    with pytest.raises(ValueError, match="config: is a list, not an object"):
        NWRecorder.from_json(write(path, document))


def test_valid_files_load_with_nulls_legacy_names_and_extra_scalar_fields(tmp_path):
    records = make_records()
    records[0]["rho"] = None  # NaN is written as null
    records[1]["rho_norm_null"] = records[1].pop("rho_norm_matched_null")  # schema version 1
    records[2]["a_field_of_a_later_version"] = "kept"
    recorder = NWRecorder.from_json(write(tmp_path / "records.json", records_file(records)))
    loaded = recorder.to_records()
    assert math.isnan(loaded[0]["rho"]) and loaded[2]["a_field_of_a_later_version"] == "kept"
    assert "rho_norm_matched_null" in loaded[1]


# ------------------------------------------------------------------ every field, every corruption

CORRUPTIONS = {
    "text": lambda v: "not a number",
    "number": lambda v: 3.5,
    "negative": lambda v: -1,
    "null": lambda v: None,
    "bool": lambda v: True,
    "list": lambda v: [v],
    "object": lambda v: {"value": v},
}


@pytest.mark.parametrize("corruption", [*CORRUPTIONS, "missing"])
@pytest.mark.parametrize("field", sorted(FIELD_KINDS.keys() - {"rho_norm_null"}))
def test_every_field_corrupted_is_refused_in_one_line_or_loads_cleanly(tmp_path, field, corruption):
    records = make_records()
    target = records[5]
    if corruption == "missing":
        target.pop(field, None)
    else:
        target[field] = CORRUPTIONS[corruption](target.get(field))
    refused = loads_cleanly_or_fails_in_one_line(
        write(tmp_path / "records.json", records_file(records)), "records[5]", field
    )
    kind = FIELD_KINDS[field]
    if corruption in ("list", "object", "bool"):
        assert refused  # no record field is nested or true/false
    if kind == "index" and corruption in ("text", "null", "negative", "number"):
        assert refused
    if kind == "number" and corruption == "text":
        assert refused


def test_extra_nested_field_and_wrong_nesting_are_refused(tmp_path):
    records = make_records()
    records[3]["extra"] = {"nested": [1, 2]}
    path = write(tmp_path / "records.json", records_file(records))
    with pytest.raises(ValueError) as info:
        NWRecorder.from_json(path)
    assert_one_line_naming(str(info.value), "records[3]", "'extra'")
    nested = records_file([make_records()])  # a list of lists
    with pytest.raises(ValueError, match=r"records\[0\]: is a list"):
        NWRecorder.from_json(write(path, nested))


def random_json(rng: random.Random, depth: int = 0):
    """A random JSON value: null, true/false, integers (negative too), floats (NaN, inf too), text,
    and lists / objects of those (two levels at most)."""
    kinds = ["null", "bool", "int", "float", "text"] + (["list", "object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, -1, 7, 10**9])
    if kind == "float":
        return rng.choice([0.5, -2.25, math.nan, math.inf, 1e300])
    if kind == "text":
        return rng.choice(["", "cond", "ip", "0", "abc", "up_blocks.1"])
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 2))]
    return {rng.choice(["a", "step", "rho"]): random_json(rng, depth + 1) for _ in range(rng.randint(0, 2))}


@pytest.mark.parametrize("seed", range(40))
def test_random_values_in_random_fields_keep_the_promise(tmp_path, seed):
    """Seeded fuzzing (deterministic): three random fields of random records get random values."""
    rng = random.Random(seed)
    records = make_records()
    for _ in range(3):
        field = rng.choice(sorted(FIELD_KINDS) + ["unknown_field"])
        records[rng.randrange(len(records))][field] = random_json(rng)
    loads_cleanly_or_fails_in_one_line(
        write(tmp_path / "records.json", records_file(records)), "records[", None
    )


# ------------------------------------------------------------------ rho.json (--replot) and result.json


def report_document() -> dict:
    images = [{"key": "ref-1", "path": "/x/ref.png", "sha256": "ab", "mode": "RGB", "width": 48, "height": 48,
               "notes": [], "generated": "images/ref-1/generated.png"}]  # fmt: skip
    return {"schema": "nw-adapter/rho", "schema_version": 1, "config": {"model": {"model": "tiny"}},
            "versions": {"torch": "2"}, "images": images, "records": make_records()}  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda d: d.update(images="ref-1"), "images"),
        (lambda d: d.update(config=[1]), "config"),
        (lambda d: d["config"].update(model="tiny"), "config.model"),
        (lambda d: d.update(versions=["2"]), "versions"),
        (lambda d: d["versions"].update(torch=2), "versions.torch"),
        (lambda d: d["images"][0].update(maps="../../elsewhere/maps.safetensors"), "images[0]"),
        (lambda d: d["images"][0].update(maps="/abs/maps.safetensors"), "images[0]"),
        (lambda d: d["images"][0].update(notes="one note"), "images[0]"),
        (lambda d: d["images"].append(dict(d["images"][0])), "images[1]"),
        (lambda d: d["images"][0].pop("key"), "images[0]"),
        (lambda d: d["records"][4].update(reference="another"), "records[4]"),
        (lambda d: d["records"][4].update(timestep=None), "records[4]"),
        (lambda d: d["records"][4].pop("block"), "records[4]"),
        (lambda d: d.update(records=[]), "records"),
        (lambda d: d.update(records={"0": {}}), "records"),
    ],
)
def test_report_check_names_the_entry(edit, where):
    document = report_document()
    check_report(copy.deepcopy(document), source="rho.json")
    edit(document)
    with pytest.raises(RecordError) as info:
        check_report(document, source="out/rho.json")
    assert_one_line_naming(str(info.value), "out/rho.json", f"{where}:", "rerun the original command")


def test_image_result_check():
    records = make_records()
    image = {"key": "ref-1", "sha256": "ab", "generated": "images/ref-1/generated.png"}
    result = {"schema": "s", "image": image, "files": {"generated.png": "00"}, "records": records}
    check_image_result(result, source="r.json", schema="s", key="ref-1")
    for edit, where in [
        (lambda r: r["image"].update(key="ref-2"), "image"),
        (lambda r: r["files"].update({"../x": "00"}), "files"),
        (lambda r: r["files"].update({"a.png": 1}), "files.a.png"),
        (lambda r: r["records"][2].update(step="2"), "records[2]"),
        (lambda r: r["records"][2].update(reference="ref-2"), "records[2]"),
    ]:
        broken = copy.deepcopy(result)
        edit(broken)
        with pytest.raises(RecordError) as info:
            check_image_result(broken, source="r.json", schema="s", key="ref-1")
        assert_one_line_naming(str(info.value), "r.json", f"{where}:")


def test_check_records_file_accepts_what_to_json_writes(tmp_path):
    document = records_file(make_records(reference=None))
    assert check_records_file(document, source="x") is document


def test_a_field_name_with_a_line_break_still_gives_one_line(tmp_path):
    records = make_records()
    records[2]["two\nlines"] = [1]
    path = write(tmp_path / "records.json", records_file(records))
    with pytest.raises(ValueError) as info:
        NWRecorder.from_json(path)
    assert_one_line_naming(str(info.value), "records[2]", "two\\nlines")
