"""The verdict end to end: ``correlate.py`` on the trained tiny model with 3 reference digits.

The real command line (``nw_adapter.correlate.cli.main``, 2 DDIM steps) prints the verdict over
reference images and writes its fields into ``rho.json``; ``--replot`` of a file written before the
verdict changed (old verdict fields, no readings or control columns) rebuilds it from the records.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nw_adapter.correlate.cli import main
from nw_adapter.correlate.report import details_line
from nw_adapter.correlate.verdict import CLAUSES, LEGACY_REASON, control_column, format_verdict
from nw_adapter.integration.schema import READING_STATS, UNTRAINED_STATS, is_control_column

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "nw_adapter" / "models" / "weights" / "tiny_digits" / "examples"


@pytest.fixture(scope="module")
def three_digits(tmp_path_factory) -> dict:
    import contextlib
    import io

    out = tmp_path_factory.mktemp("verdict") / "out"
    argv = ["--model", "tiny", "--steps", "2", "--scheduler", "ddim", "--seed", "0", "--quiet", "--out", out]
    for digit in (1, 4, 7):
        argv += ["--image", EXAMPLES / f"digit_{digit}.png"]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main([str(a) for a in argv])
    assert code == 0
    return {"out": out, "stdout": stdout.getvalue(), "argv": argv}


def test_three_images_print_the_verdict_over_images_and_write_its_fields(three_digits) -> None:
    report = json.loads((three_digits["out"] / "rho.json").read_text())
    result = report["verdict"]
    assert result["unit"] == "reference image" and result["images"] == 3 and result["half"] == "cond"
    assert sorted(v["reference"] for v in result["per_image"]) == sorted(i["key"] for i in report["images"])
    # one run: the images' recorders share its run, model, mode and settings digest
    assert len({(r["run"], r["model"], r["mode"], r["settings"]) for r in report["records"]}) == 1
    assert len({r["input_digest"] for r in report["records"]}) == 3  # three contents
    assert list(result["clauses"]) == [c.key for c in CLAUSES]
    for clause in result["clauses"].values():
        assert clause["holds"] in (True, False, None)
    nulls = result["clauses"]["beyond_nulls"]
    assert all(p["measured"] and p["n"] == 3 and 0 <= p["p"] <= 1 for p in nulls["parts"])
    assert nulls["holds"] is all(p["p"] < 0.05 for p in nulls["parts"])
    control = any(control_column("rho", 0) in r for r in report["records"])
    assert (result["clauses"]["training"]["holds"] is not None) is control  # not measured without it
    if not control:  # a recorder of the one raw *_untrained draw: "not measured", with the reason
        assert result["evidence"] is False and "not measured" in result["conclusion"]
        legacy = any("rho_untrained" in r for r in report["records"])
        assert (LEGACY_REASON in (result["clauses"]["training"]["reason"] or "")) is legacy
    assert result["draws"] == sum(control_column("rho", k) in report["records"][0] for k in range(8))
    lines = three_digits["stdout"].splitlines()  # the brief text: the verdict, then where the details are
    start = next(i for i, line in enumerate(lines) if line.startswith("verdict: "))
    assert "\n".join(lines[start:-1]) == format_verdict(result, detail=False)
    assert lines[-1] == details_line(result, three_digits["out"])
    assert lines[start] == f"verdict: {result['conclusion']}"
    heads = [line.split(":")[0].strip().removesuffix(" [reported]") for line in lines[start + 1 : -1]
             if not line.startswith("    ")]  # fmt: skip
    assert heads[: len(CLAUSES)] == [c.short for c in CLAUSES]  # one line per clause (wrapped: indented)
    drawn = any(r.get("logit_scale") for r in report["records"])  # the bandwidth path's reading
    assert (three_digits["out"] / "bandwidth.png").is_file() is drawn


def test_verbose_prints_the_full_verdict(three_digits, tmp_path, capsys) -> None:
    """``-v`` (here on a redraw of the same run) prints the verdict with every part and the legend."""
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(three_digits["out"], out)
    assert main(["--replot", str(out), "-v"]) == 0
    lines = capsys.readouterr().out.splitlines()
    result = json.loads((out / "rho.json").read_text())["verdict"]
    start = next(i for i, line in enumerate(lines) if line.startswith("verdict: "))
    assert "\n".join(lines[start:]) == format_verdict(result)
    assert "  legend:" in lines and lines[start + 1].startswith(f"  {CLAUSES[0].label}: ")


def test_replot_of_an_old_file_recomputes_the_verdict_from_its_records(three_digits, tmp_path, capsys):
    """A rho.json of the fixed-margin verdict, without readings or control columns: replot works and
    the training clause is "not measured", never "evidence"."""
    import shutil

    out = tmp_path / "old"
    shutil.copytree(three_digits["out"], out)
    path = out / "rho.json"
    report = json.loads(path.read_text())
    report["verdict"] = {"rho_last": 0.7, "clears_nulls": True, "monotonic": True, "margin": 0.3}
    for record in report["records"]:
        for name in (*READING_STATS, *UNTRAINED_STATS, "logit_scale", "key_rms"):
            record.pop(name, None)
        for name in [n for n in record if is_control_column(n) or n.endswith("_reason")]:
            record.pop(name)
    path.write_text(json.dumps(report))
    assert main(["--replot", str(out)]) == 0
    printed = capsys.readouterr().out
    rebuilt = json.loads(path.read_text())["verdict"]
    assert rebuilt["images"] == 3 and rebuilt["evidence"] is False
    assert rebuilt["clauses"]["training"]["holds"] is None
    assert f"  {CLAUSES[1].short}: not measured: " in printed  # the brief text's clause line
    assert main(["--replot", str(out), "-v"]) == 0
    assert f"{CLAUSES[1].label}: not measured" in capsys.readouterr().out
    assert not (out / "bandwidth.png").exists()  # no h_eff in the records: no stale figure
