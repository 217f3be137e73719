"""The verdict's units: one reference content counts once, one run at a time, and clear errors.

Issue 30: a reference given twice (two calls of one image, one file under two names) inflated n
and every interval; records of two runs sharing a reference key or call index were pooled; a
malformed record or result raised a raw KeyError / TypeError / AttributeError; and the wording
("training failed") read as if the model's training had failed.
"""

from __future__ import annotations

import copy

import pytest

from nw_adapter.analysis.validation import RecordError
from nw_adapter.correlate.report import build_report
from nw_adapter.correlate.verdict import CLAUSES, LEGEND, format_verdict, verdict
from tests.correlate.test_verdict import make_records


def _as_calls(records: list[dict], digests: dict[str, str], **fields) -> list[dict]:
    """The records of a notebook loop: no ``reference``, one ``call`` per image, its content digest."""
    calls = {name: index for index, name in enumerate(dict.fromkeys(r["reference"] for r in records))}
    out = []
    for record in records:
        record = dict(record)
        name = record.pop("reference")
        out.append({**record, "call": calls[name], "input_digest": digests[name], **fields})
    return out


def test_two_calls_of_one_reference_content_are_one_unit() -> None:
    records = make_records(images=4)
    digests = {"img0": "aaaa", "img1": "bbbb", "img2": "aaaa", "img3": "cccc"}  # img2 repeats img0
    result = verdict(_as_calls(records, digests, run="r1", model="m", mode="observe"))
    assert result["images"] == 3 and result["duplicates_merged"] == 1
    assert result["merged"] == {"call 0": ["call 2"]}
    assert [v["reference"] for v in result["per_image"]] == ["call 0", "call 1", "call 3"]
    assert all(p["n"] == 3 for c in result["clauses"].values() for p in c["parts"])
    assert "n 3 (1 of the same content merged: counted once)" in format_verdict(result)
    distinct = verdict(_as_calls(records, {f"img{i}": f"d{i}" for i in range(4)}))
    assert distinct["images"] == 4 and distinct["duplicates_merged"] == 0


def test_files_merged_before_the_run_are_stated_in_the_verdict() -> None:
    """correlate.py keeps one file per content; its images entries count the merged ones."""
    images = [{"key": "img0", "duplicates": 1}, {"key": "img1"}, {"key": "img2"}]
    report = build_report(make_records(images=3), config={"steps": 5}, images=images, versions={}, targets=())
    assert report["verdict"]["images"] == 3 and report["verdict"]["duplicates_merged"] == 1
    assert "(1 of the same content merged: counted once)" in format_verdict(report["verdict"])


@pytest.mark.parametrize(
    ("field", "values", "words"),
    [
        ("run", ("r1", "r2"), "'img0' has records of 2 different runs ('r1', 'r2')"),
        ("model", ("sd15", "sdxl"), "records of 2 different models ('sd15', 'sdxl')"),
        ("mode", ("observe", "swap"), "records of 2 different modes ('observe', 'swap')"),
    ],
)
def test_records_of_different_runs_models_or_modes_are_refused_by_name(field, values, words) -> None:
    first = [{**r, "run": "r1", "model": "sd15", "mode": "observe"} for r in make_records(images=3)]
    second = [{**r, field: values[1]} for r in copy.deepcopy(first)]  # the same reference keys
    with pytest.raises(RecordError) as error:
        verdict(first + second)
    message = str(error.value)
    assert "\n" not in message and words in message, message
    assert f"r.get({field!r}) == {values[0]!r}" in message  # the fix: keep one
    assert verdict(first)["images"] == 3


def test_two_recorders_call_0_is_refused_but_their_named_references_are_two_images() -> None:
    """A notebook's per-image recorders: without a reference both are "call 0" (one unit of two
    runs: refused); labelled with their reference they are two reference images of one sample."""
    records = make_records(images=2)
    runs = {"img0": "r1", "img1": "r2"}
    unnamed = [
        {k: v for k, v in r.items() if k != "reference"} | {"run": runs[r["reference"]]} for r in records
    ]
    with pytest.raises(RecordError, match="'call 0' has records of 2 different runs"):
        verdict(unnamed)
    named = [{**r, "run": runs[r["reference"]]} for r in records]
    assert verdict(named)["images"] == 2


def test_records_without_run_fields_pool_as_before() -> None:
    """Files of older versions carry no run fields: their records are judged as before."""
    assert verdict(make_records(images=3))["images"] == 3


BAD_RECORDS = [
    ("not a list", {"step": 0}, "records: is an object, not a list of record objects"),
    ("text", "records.json", "records: is 'records.json' (text), not a list"),
    ("a number", 3, "records: is 3 (number), not a list"),
    ("None record", [None], "records[0]: is null, not a record object"),
    ("list record", [[1, 2]], "records[0]: is a list, not a record object"),
    ("no step", [{"half": "cond", "rho": 0.5}], "records[0]: field 'step' is missing"),
    ("text step", [{"step": "x", "half": "cond"}], "field 'step' must be a whole number >= 0"),
    ("null step", [{"step": None, "half": "cond"}], "field 'step' must be a whole number >= 0"),
    ("bad half", [{"step": 0, "half": 3}], "field 'half' must be one of cond"),
    (
        "list reference",
        [{"step": 0, "half": "cond", "reference": [1]}],
        "field 'reference' must be non-empty",
    ),
    ("float call", [{"step": 0, "half": "cond", "call": 0.5}], "field 'call' must be a whole number"),
    # a statistic of the wrong kind read as missing ("not measured: no rho") before
    ("text rho", [{"step": 0, "half": "cond", "rho": "0.5"}], "field 'rho' must be a number or null"),
    ("list control", [{"step": 0, "rho_control_0": [0.5]}], "field 'rho_control_0' must be a number"),
    ("bool scale", [{"step": 0, "logit_scale": True}], "field 'logit_scale' must be a number or null"),
    ("nested extra", [{"step": 0, "notes": {"a": 1}}], "field 'notes' holds an object"),
]


@pytest.mark.parametrize(("case", "records", "words"), BAD_RECORDS, ids=[c[0] for c in BAD_RECORDS])
def test_malformed_records_raise_one_line_naming_the_field_and_the_fix(case, records, words) -> None:
    with pytest.raises(RecordError) as error:
        verdict(records)
    message = str(error.value)
    assert "\n" not in message and words in message, message
    assert "pass the records of NWRecorder.to_records()" in message


def _result() -> dict:
    return verdict(make_records(images=3))


BAD_RESULTS = [
    ("None", lambda r: None, "verdict: is null, not an object"),
    (
        "no conclusion",
        lambda r: {k: v for k, v in r.items() if k != "conclusion"},
        "field 'conclusion' is missing",
    ),
    ("images text", lambda r: {**r, "images": "3"}, "field 'images' is '3' (text), of the wrong kind"),
    ("clauses list", lambda r: {**r, "clauses": []}, "field 'clauses' is a list, of the wrong kind"),
    (
        "clause None",
        lambda r: {**r, "clauses": {"rise": None}},
        "verdict.clauses.rise: is null, not an object",
    ),
    (
        "clause without reason",
        lambda r: {
            **r,
            "clauses": {"rise": {k: v for k, v in r["clauses"]["rise"].items() if k != "reason"}},
        },
        "verdict.clauses.rise: field 'reason' is missing",
    ),
    ("nonfinite list", lambda r: {**r, "nonfinite": ["rho"]}, "field 'nonfinite' is a list, not an object"),
    ("skipped list", lambda r: {**r, "skipped": ["h_eff"]}, "field 'skipped' is a list, not an object"),
    (
        "skipped count text",
        lambda r: {**r, "skipped": {"h_eff": {"count": "3", "reasons": {}}}},
        "verdict.skipped.h_eff: is an object, not {count, reasons}",
    ),
    (
        "reported text",
        lambda r: {**r, "clauses": {"rise": {**r["clauses"]["rise"], "reported": "x"}}},
        "verdict.clauses.rise: field 'reported' is 'x' (text), not a list",
    ),
    (
        "part without n",
        lambda r: {
            **r,
            "clauses": {"rise": {**r["clauses"]["rise"], "parts": [{"label": "x", "measured": True}]}},
        },
        "verdict.clauses.rise.parts[0]: field 'n' is missing",
    ),
    (
        "mean text",
        lambda r: {
            **r,
            "clauses": {
                "rise": {**r["clauses"]["rise"], "parts": [{**r["clauses"]["rise"]["parts"][0], "mean": "1"}]}
            },
        },
        "verdict.clauses.rise.parts[0]: field 'mean' is '1' (text)",
    ),
]


@pytest.mark.parametrize(("case", "change", "words"), BAD_RESULTS, ids=[c[0] for c in BAD_RESULTS])
def test_format_verdict_of_a_malformed_result_raises_one_line(case, change, words) -> None:
    with pytest.raises(RecordError) as error:
        format_verdict(change(_result()))
    message = str(error.value)
    assert "\n" not in message and words in message, message
    assert "pass the dict verdict() returns" in message


def test_the_words_read_right_and_the_legend_defines_every_term() -> None:
    failing = verdict(make_records(training=-0.1, beyond_nulls=0.0, rise=0.0, seed=2, exponent=0.0, form=0.7))
    text = format_verdict(failing)
    assert "failed" not in text.split("  legend:")[0]  # the legend alone says what "not met" is not
    words = (
        "smoothing on the schedule (6 reference images): bandwidth clause not met, NW-form clause not met; "
    )
    assert words + "nearer the control" in failing["conclusion"]
    lines = text.splitlines()
    legend = "\n".join(lines[lines.index("  legend:") + 1 :])
    terms = (
        "met:", "not met:", "not measured:", "too few references to tell:", "scale-matched control:",
        "perm =", "norm-matched =", "qk-spread =", "nw_gain =", "logit_scale:", "exponent =", "r2_nw =",
        "scale ratio =", "h:", "n:", "two-level test:", "margin", "not that training failed", "Anchors:",
        "position =", "mde",
    )  # fmt: skip
    for term in terms:
        assert term in " ".join(legend.split()), term
    assert all(line.startswith("    ") and len(line) <= 105 for line in legend.splitlines())
    assert sum(not line.startswith("      ") for line in legend.splitlines()) == len(LEGEND)
    for clause in CLAUSES:
        assert clause.short.endswith("clause") and clause.label.startswith(clause.short)
        assert any(line.startswith(f"  {clause.label}: ") for line in lines)
