"""Words of both command lines: a legend for every column of the rho table, every argument error naming
its own option, and ``--replot`` refusing a ``schema_version`` it does not know."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_report import make_records

from nw_adapter.correlate import cli
from nw_adapter.correlate.report import (
    COLUMN_LEGEND,
    TABLE_COLUMNS,
    build_report,
    format_legend,
    format_report,
    format_table,
    format_verdict,
)
from nw_adapter.correlate.support_cli import SupportSetError
from nw_adapter.experiments import cli as experiments_cli

REPO = Path(__file__).resolve().parents[2]


# --- the legend ---------------------------------------------------------------------------------


def _report(untrained: bool) -> dict:
    records = make_records(references=("ref-a", "ref-b"))
    if untrained:
        for record in records:
            record.update(rho_control_0=0.1, nw_gain_control_0=0.0, key_scale_0=1.0)
    images = [{"key": "ref-a"}, {"key": "ref-b"}]
    return build_report(records, config={"steps": 3, "model": {"model": "tiny"}}, images=images, versions={})


def test_every_table_column_has_words() -> None:
    assert set(COLUMN_LEGEND) == {key for key, _, _ in TABLE_COLUMNS}
    assert all(COLUMN_LEGEND.values()) and not any("|" in text for text in COLUMN_LEGEND.values())


@pytest.mark.parametrize("untrained", [True, False])
def test_the_printed_report_explains_each_column_it_shows_under_the_table(untrained: bool) -> None:
    report = _report(untrained)
    text = format_report(report)
    table, legend, verdict = (
        format_table(report["table"]),
        format_legend(report["table"]),
        format_verdict(report["verdict"]),
    )
    assert f"{table}\n{legend}\n{verdict}" in text  # context line, table, legend, verdict
    headers = table.splitlines()[0].split()
    legend_lines = legend.splitlines()
    assert legend_lines[0] == "legend (means over layers, heads and reference images):"
    assert [line.split()[0] for line in legend_lines[1:]] == headers  # one line per shown column, in order
    by_header = {header: key for key, header, _ in TABLE_COLUMNS}
    for line in legend_lines[1:]:
        header = line.split()[0]
        assert line.endswith(COLUMN_LEGEND[by_header[header]])
    assert ("rho-ctrl" in headers) is untrained and ("gain-ctrl" in legend) is untrained
    assert max(len(line) for line in legend_lines) <= 105  # as wide as the table at most


def test_docs_cli_md_has_the_same_legend() -> None:
    docs = (REPO / "docs" / "cli.md").read_text()
    for key, header, _ in TABLE_COLUMNS:
        assert f"| `{header}` | {COLUMN_LEGEND[key]} |" in docs, header


# --- every argument error names its own option --------------------------------------------------

BAD_VALUES = ("x", ",", "-1", "0", "1e400", "")


def _first_bad_value_error(parse, option: str) -> str | None:
    """The error message of the first value in :data:`BAD_VALUES` that ``parse`` refuses for ``option``."""
    for value in BAD_VALUES:
        try:
            parse([option, value])
        except (cli.CLIError, SupportSetError, experiments_cli.ArgumentError) as exc:
            return str(exc)
    return None


def _options_with_values(parser) -> list[str]:
    return [
        action.option_strings[-1]
        for action in parser._actions
        if action.option_strings
        and action.nargs != 0
        and (action.type not in (None, str, Path) or action.choices)  # paths and text take any value
    ]


def _correlate_parse(argv: list[str]) -> None:
    """Parse ``argv`` (one option and its value) in the smallest command line of a run that reads it."""
    from option_walk import context

    from nw_adapter.correlate.option_table import OPTIONS, RUN_BY_NAME

    option = next(option for option in OPTIONS if argv[0] in option.flags)
    run = RUN_BY_NAME[sorted(option.runs)[0]]
    own = [] if option.dest in run.selectors else context(run)
    cli.parse_args([*own, *argv])


def _experiments_parse(argv: list[str]) -> None:
    experiments_cli.build_parser("", None).parse_args(["--out", "o", *argv])


@pytest.mark.parametrize(
    ("parser", "parse"),
    [
        (cli.build_parser(), _correlate_parse),
        (experiments_cli.build_parser("", None), _experiments_parse),
    ],
    ids=["correlate", "experiments"],
)
def test_each_option_with_a_value_names_itself_first_in_its_error(parser, parse) -> None:
    options = _options_with_values(parser)
    assert len(options) >= 10
    for option in options:
        message = _first_bad_value_error(parse, option)
        assert message is not None, f"{option} accepted every bad value"
        named = re.findall(r"--[a-z][a-z0-9-]*", message)
        assert named and named[0] == option, f"{option}: {message}"
        assert message.count(option) <= 2 and "argument " + option + ": " + option not in message


def test_untrained_seed_errors_say_untrained_seed(capsys) -> None:
    code = cli.main(["--image", "ref.png", "--untrained-seed", "-1"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(
        "correlate.py: error: --untrained-seed must be between 0 and 2**63 - 1"
    )
    assert "--seed " not in err


def test_a_misspelt_option_gets_the_closest_one(capsys) -> None:
    assert cli.main(["--image", "ref.png", "--stpes", "3"]) == 2
    assert "unrecognized arguments: --stpes 3; did you mean --steps?" in capsys.readouterr().err
    assert experiments_cli.main(["--out", "o", "--qiuck"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("run_experiments.py: error: ") and "did you mean --quick?" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([], "the following arguments are required: --out"),
        (["--out", "o", "--labels", "y.npy"], "--labels needs --features"),
        (
            ["--out", "o", "--features", "a.npy"],
            "--features 'a.npy' is a .npy matrix; pass its labels with --labels",
        ),
        (
            ["--out", "o", "--features", "missing.npz"],
            "--features: feature file 'missing.npz' does not exist",
        ),
        (["--out", "o", "--regimes", "dims,sky"], "--regimes 'dims,sky': use a comma-separated subset"),
        (["--out", "o", "--eval-generated", "2"], "--eval-generated 2 must be >= 4"),
    ],
)
def test_experiments_errors_are_one_line_naming_the_option(argv, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.npy").write_bytes(b"")
    assert experiments_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("run_experiments.py: error: "), err
    assert words in err
    assert not (tmp_path / "o" / "results").exists()


# --- --replot and schema_version ----------------------------------------------------------------


@pytest.mark.parametrize("version", [99, 0, "1", None, True])
def test_replot_refuses_a_schema_version_it_does_not_know(version, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    report = _report(untrained=False)
    report["schema_version"] = version
    (out / "rho.json").write_text(json.dumps(report))
    assert cli.main(["--replot", str(out)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "schema_version" in lines[0] and "is not 1, the only version" in lines[0], err
    assert sorted(p.name for p in out.iterdir()) == ["rho.json"]  # nothing redrawn


def test_replot_reads_its_own_schema_version(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "rho.json").write_text(json.dumps(_report(untrained=False)))
    assert cli.main(["--replot", str(out)]) == 0
    printed = capsys.readouterr().out  # the brief text: the table, the verdict, where the details are
    assert "\nverdict: " in printed and printed.splitlines()[-1].startswith("details: -v prints")
    assert "legend (means over layers" not in printed
    assert cli.main(["--replot", str(out), "-v"]) == 0
    assert "legend (means over layers" in capsys.readouterr().out  # -v: the legends too
