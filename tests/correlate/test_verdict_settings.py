"""The verdict pools runs only when their settings agree (issue 30, item 2).

Records of two runs with different settings (number of steps, bandwidth rule, ...) and disjoint
references were pooled silently as one sample. Every record now carries the digest of the settings
that change what a reading means (``settings``): records of different digests are refused in one
line naming the settings that differ; runs of the same settings over different references still
pool; files without the field (older versions) pass as before.
"""

from __future__ import annotations

import pytest

from nw_adapter.analysis.validation import RecordError
from nw_adapter.correlate.verdict import verdict
from nw_adapter.integration.settings import (
    DIGEST_LENGTH,
    SETTINGS,
    SETTINGS_FIELD,
    differing_settings,
    settings_digest,
)


@pytest.fixture(scope="module")
def pipe():
    from nw_adapter import load_tiny_digits

    return load_tiny_digits()


def _run(pipe, digits: tuple[int, ...], *, steps: int = 2, **options) -> list[dict]:
    """One recorder (one run) over the references ``digits`` (one call each), labelled by digit."""
    import torch

    from nw_adapter import tiny_digit_image
    from nw_adapter.integration.mixin import nw_processor

    records = []
    with nw_processor(pipe, mode="observe", **options) as rec:
        for call, digit in enumerate(digits):
            seeded = torch.Generator().manual_seed(digit)
            pipe(
                prompt="",
                ip_adapter_image=tiny_digit_image(digit),
                num_inference_steps=steps,
                generator=seeded,
            )
            records += [{**r, "reference": f"digit {digit}"} for r in rec.to_records() if r["call"] == call]
    return records


def _refusal(records: list[dict]) -> str:
    with pytest.raises(RecordError) as error:
        verdict(records)
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_runs_of_different_steps_are_refused_naming_the_steps(pipe) -> None:
    first, second = _run(pipe, (3, 5), steps=2), _run(pipe, (7,), steps=3)  # disjoint references
    assert len({r[SETTINGS_FIELD] for r in first}) == 1  # one digest per run
    message = _refusal(first + second)
    assert "records of 2 different settings" in message
    assert ": num_inference_steps differs;" in message  # named, and nothing else
    assert f"r.get('settings') == {first[0][SETTINGS_FIELD]!r}" in message  # how to keep one
    kept = [r for r in first + second if r.get("settings") == first[0][SETTINGS_FIELD]]
    assert verdict(kept)["images"] == 2


def test_runs_of_different_bandwidth_rules_are_refused_naming_the_rule(pipe) -> None:
    matched, schedule = _run(pipe, (3,), bandwidth="matched"), _run(pipe, (5,), bandwidth="schedule")
    message = _refusal(matched + schedule)
    assert ": bandwidth differs;" in message, message
    assert f"(runs {matched[0]['run']!r} and {schedule[0]['run']!r})" in message


def test_two_settings_are_named_together(pipe) -> None:
    message = _refusal(_run(pipe, (3,)) + _run(pipe, (5,), steps=3, heads=[0]))
    assert ": heads, num_inference_steps differ;" in message, message


def test_runs_of_the_same_settings_over_different_references_pool(pipe) -> None:
    """Several runs over different references are one sample: the same digest, no refusal."""
    first, second = _run(pipe, (3, 5)), _run(pipe, (7,))
    assert first[0]["run"] != second[0]["run"]
    assert {r[SETTINGS_FIELD] for r in first + second} == {first[0][SETTINGS_FIELD]}
    assert verdict(first + second)["images"] == 3


def test_files_without_the_settings_field_pool_as_before(pipe) -> None:
    """Records of older versions carry no digest: the runs of different steps are judged as before."""
    records = _run(pipe, (3,), steps=2) + _run(pipe, (5,), steps=3)
    older = [{k: v for k, v in r.items() if k != SETTINGS_FIELD} for r in records]
    assert verdict(older)["images"] == 2


def test_the_digest_has_one_chunk_per_setting() -> None:
    base = {"bandwidth": ["matched", 1.0], "num_inference_steps": 25, "scheduler": ["DDIMScheduler", {}]}
    digest = settings_digest(base)
    assert len(digest) == DIGEST_LENGTH and settings_digest(dict(base)) == digest
    assert differing_settings([digest, settings_digest({**base, "num_inference_steps": 30})]) == [
        "num_inference_steps"
    ]
    every = [settings_digest({**base, name: "other"}) for name in SETTINGS]
    assert [differing_settings([digest, d]) for d in every] == [[name] for name in SETTINGS]
    assert differing_settings([digest, digest[:-4]]) == [
        "the list of settings (recorded by different versions)"
    ]
