"""The public route from compare_attention to the verdict: records, scale matching, bad input, the doc.

``nw_adapter.comparison_records`` writes the records a pipeline run writes (the trained
statistics, ``{stat}_control_{k}``, ``key_scale_{k}``, ``h_eff_reason``), so ``nw_adapter.verdict``
judges any head the same way; docs/verdict.md's example runs as written.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from nw_adapter import compare_attention, comparison_records, scale_matched_keys, verdict
from nw_adapter.core.compare import AttentionComparison
from nw_adapter.core.readings import key_rms
from nw_adapter.correlate.comparisons import CONTROL_OF, MULTIPLE_REASONS

DOC = Path(__file__).resolve().parents[2] / "docs" / "verdict.md"


def _pair(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 16, 8, generator=gen), torch.randn(2, 3, 4, 8, generator=gen)


def test_scale_matched_keys_have_the_trained_keys_rms_and_the_ratio_is_the_change_of_scale() -> None:
    q, k = _pair()
    _, k0 = _pair(1)
    matched, ratio = scale_matched_keys(k, k0)
    assert ratio.shape == (2, 3) and matched.shape == k0.shape
    torch.testing.assert_close(key_rms(matched), key_rms(k))
    torch.testing.assert_close(ratio, key_rms(k) / key_rms(k0))
    same, gain = scale_matched_keys(1.4 * k0, k0)  # a pure gain: the control is the trained keys
    torch.testing.assert_close(same, 1.4 * k0)
    torch.testing.assert_close(gain, torch.full((2, 3), 1.4))


def test_records_carry_every_statistic_the_controls_and_the_scale_per_batch_row_and_head() -> None:
    q, k = _pair()
    k0m, ratio = scale_matched_keys(k, _pair(1)[1])
    trained, control = compare_attention(q, k, scale=8**-0.5), compare_attention(q, k0m, scale=8**-0.5)
    records = comparison_records(trained, [control, control], reference="ref", step=2, h_schedule=0.5,
                                 key_scales=[ratio, 2.0], halves=["uncond", "cond"], layer="l0")  # fmt: skip
    assert len(records) == 2 * 3
    record = next(r for r in records if r["half"] == "cond" and r["head"] == 1)
    where = (record["reference"], record["step"], record["h_schedule"], record["layer"])
    assert where == ("ref", 2, 0.5, "l0")
    assert record["rho"] == pytest.approx(float(trained["rho"][1, 1]))
    for stat in CONTROL_OF:
        assert record[f"{stat}_control_1"] == pytest.approx(float(control[stat][1, 1]), nan_ok=True)
    assert record["key_scale_0"] == pytest.approx(float(ratio[1, 1])) and record["key_scale_1"] == 2.0
    assert record["h_eff_reason"] is None  # a number: no reason
    assert verdict(records + [{**r, "reference": "other"} for r in records])["draws"] == 2


def test_a_nan_h_eff_takes_the_comparisons_reason() -> None:
    q, k = _pair()
    trained = compare_attention(q, k, scale=8**-0.5)
    values = {**trained, "h_eff": torch.full_like(trained["h_eff"], math.nan)}
    one = AttentionComparison(values, {"h_eff": {"why": 6}})
    reasons = {r["h_eff_reason"] for r in comparison_records(one, reference="r", step=0, h_schedule=1.0)}
    assert reasons == {"why"}
    two = AttentionComparison(values, {"h_eff": {"a": 2, "b": 4}})
    reasons = {r["h_eff_reason"] for r in comparison_records(two, reference="r", step=0, h_schedule=1.0)}
    assert reasons == {MULTIPLE_REASONS + "a; b"}


BAD = [
    ({"trained": {"kl": 1}}, "trained: expected the dict compare_attention returns"),
    ({"controls": {"rho": 1}}, "controls: expected a list of compare_attention results"),
    ({"key_scales": [1.0, 2.0]}, "key_scales: 2 values for 1 control draws"),
    ({"reference": ""}, "reference must be a non-empty string"),
    ({"step": -1}, "step must be a whole number >= 0"),
    ({"h_schedule": math.inf}, "h_schedule must be a finite number > 0"),
    ({"halves": ["cond"]}, "halves: expected 2 of"),
    ({"key_scales": [torch.ones(3, 3)]}, "key_scales[0]: shape (3, 3) differs from the trained comparison's"),
]


@pytest.mark.parametrize(("change", "words"), BAD, ids=[w.split(":")[0].split(" ")[0] for _, w in BAD])
def test_bad_input_is_one_line_naming_it(change, words) -> None:
    q, k = _pair()
    comparison = compare_attention(q, k, scale=8**-0.5)
    arguments = {"trained": comparison, "controls": [comparison], "reference": "r", "step": 0,
                 "h_schedule": 1.0, **change}  # fmt: skip
    trained = arguments.pop("trained")
    controls = arguments.pop("controls")
    with pytest.raises(ValueError) as error:
        comparison_records(trained, controls, **arguments)
    assert "\n" not in str(error.value) and words in str(error.value), str(error.value)


def test_scale_matching_refuses_keys_of_another_head_and_all_zero_keys() -> None:
    _, k = _pair()
    with pytest.raises(ValueError, match="must share B, H and d"):
        scale_matched_keys(k, torch.randn(2, 3, 4, 5))
    with pytest.raises(ValueError, match="all zero"):
        scale_matched_keys(k, torch.zeros(2, 3, 4, 8))


def test_the_docs_example_runs_and_a_random_head_is_no_evidence() -> None:
    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    namespace: dict = {}
    exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - the documented example, as written
    assert namespace["result"]["evidence"] is False and namespace["result"]["images"] == 3
