"""The brief verdict (``format_verdict(result, detail=False)``, what ``correlate.py`` prints without
``-v``): the conclusion, one line per clause with its status and, unless met, the parts that decide it
with their smallest detectable effect, and the adapter beside its anchors.

Each status is checked on a case built to have it: the exact NW head (met), a fixed temperature (not
met), three references scattered around the theory's exponent (too few references to tell), records
without the control (not measured), one reference (undecided).
"""

from __future__ import annotations

import math

import numpy as np

from nw_adapter import format_verdict, verdict
from nw_adapter.correlate.verdict import CLAUSES, LINE_WIDTH
from tests.correlate.test_verdict import make_records
from tests.correlate.test_verdict_acceptance import bias_form_records, flow_schedule


def clause_lines(brief: str) -> dict[str, str]:
    """Each clause's line (a wrapped line joined back), by the clause's short name."""
    joined: list[str] = []
    for line in brief.splitlines()[1:]:
        if line.startswith("      "):  # a wrapped line's continuation
            joined[-1] += " " + line.strip()
        else:
            joined.append(line.strip())
    out = {}
    for clause in CLAUSES:
        (line,) = [text for text in joined if text.startswith(f"{clause.short}")]
        out[clause.key] = line
    return out


def test_the_exact_head_reads_met_with_its_parts_values_and_no_legend() -> None:
    schedule = flow_schedule()
    result = verdict(bias_form_records([h**-2 for h in schedule], schedule))
    brief = format_verdict(result, detail=False)
    lines = brief.splitlines()
    assert lines[0] == f"verdict: {result['conclusion']}" and result["evidence"] is True
    clauses = clause_lines(brief)
    assert clauses["bandwidth"] == "bandwidth clause: met: exponent +2.000; exponent - control's +2.000"
    assert clauses["nw_form"] == "NW-form clause: met: r2_nw +1.000"
    assert clauses["training"].startswith("adapter-vs-control clause [reported]: ")
    control = result["anchors"]["control"]
    assert (
        f"anchors (exponent / r2_nw): control {control['exponent']:+.3f} / {control['r2_nw']:.3f}, adapter "
        "+2.000 / 1.000, exact NW head +2.000 / 1.000 (the theory's)"
    ) in " ".join(line.strip() for line in lines)
    assert "legend" not in brief and "p " not in brief  # intervals, p and the legend: detail=True
    full = format_verdict(result)  # the default: everything, as correlate.py -v prints it
    assert full.splitlines()[0] == lines[0] and "  legend:" in full and len(full) > 3 * len(brief)
    assert all(len(line) <= LINE_WIDTH for line in lines[1:])


def test_a_fixed_temperature_reads_not_met_with_its_band_and_what_the_run_could_establish() -> None:
    schedule = flow_schedule()
    result = verdict(bias_form_records([1.0 for _ in schedule], schedule))
    part = next(p for p in result["clauses"]["bandwidth"]["parts"] if p["key"] == "exponent_theory")
    assert part["status"] == "not met"
    line = clause_lines(format_verdict(result, detail=False))["bandwidth"]
    assert line.startswith("bandwidth clause: not met: exponent +0.000 (band [1.5, 2.5], narrowest margin ")
    assert f"narrowest margin {part['mde']:.3f})" in line
    control = next(p for p in result["clauses"]["bandwidth"]["parts"] if p["key"] == "exponent_minus_control")
    expected = f"exponent - control's {control['mean']:+.3f} (smallest detectable {control['mde']:+.3f}, "
    assert expected + f"sought {control['compared_with']:+.3f})" in line
    assert "NW-form clause: met" in format_verdict(result, detail=False)  # the form holds: not listed


def test_too_few_references_to_tell_is_named_with_its_smallest_detectable_effect() -> None:
    records = make_records(images=3, steps=5, exponent=2.0, seed=3)
    wobble = dict(zip([f"img{i}" for i in range(3)], np.random.default_rng(0).normal(0, 1.0, 3), strict=True))
    for r in records:  # per image its own path: a wide scatter around 2
        r["logit_scale"] *= math.exp(-wobble[r["reference"]] * math.log(r["h_schedule"]))
    result = verdict(records)
    part = next(p for p in result["clauses"]["bandwidth"]["parts"] if p["key"] == "exponent_theory")
    assert part["status"] == "too few references to tell"
    line = clause_lines(format_verdict(result, detail=False))["bandwidth"]
    status = result["clauses"]["bandwidth"]["status"]
    assert line.startswith(f"bandwidth clause: {status}: exponent {part['mean']:+.3f} ")
    shown = f"narrowest margin {part['mde']:.3f})"
    assert shown in line and (status == part["status"] or shown + ": too few references to tell" in line)


def test_a_clause_whose_columns_were_not_recorded_reads_not_measured_with_its_reason() -> None:
    result = verdict(make_records(images=4, draws=0))
    clause = result["clauses"]["training"]
    assert clause["holds"] is None
    line = clause_lines(format_verdict(result, detail=False))["training"]
    assert line == f"adapter-vs-control clause [reported]: not measured: {clause['reason']}"


def test_one_reference_is_the_undecided_conclusion_alone() -> None:
    result = verdict(make_records(images=1))
    brief = format_verdict(result, detail=False)
    assert brief == f"verdict: {result['conclusion']}" and result["conclusion"].startswith("undecided")
