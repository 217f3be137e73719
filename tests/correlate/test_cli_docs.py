"""docs/cli.md's tables of runs and options are the option table's (nw_adapter.correlate.options_docs)."""

from __future__ import annotations

from nw_adapter.correlate import options_docs
from nw_adapter.correlate.option_table import OPTIONS, RUNS


def test_the_docs_tables_are_generated_from_the_current_table() -> None:
    text = options_docs.DOCS.read_text(encoding="utf-8")
    assert options_docs.updated(text) == text, "run python -m nw_adapter.correlate.options_docs"


def test_the_tables_have_one_row_per_run_and_per_option() -> None:
    lines = options_docs.markdown().splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| run |")]
    rows = [line for line in rows if not line.startswith("| option |")]
    assert len(rows) == len(RUNS) + len(OPTIONS)
    for option in OPTIONS:
        assert sum(line.startswith(f"| `{option.flags[0]}`") for line in rows) == 1, option.name


def test_check_mode_says_current(capsys) -> None:
    assert options_docs.main(["--check"]) == 0
    assert capsys.readouterr().out.strip() == "current"


def test_help_opens_with_the_runs_not_every_option(capsys) -> None:
    """--help's usage is the runs' few lines (argparse listed all 45 options in 22 lines first); the
    options follow in their groups, and each one's runs are in docs/cli.md."""
    import pytest

    from nw_adapter.correlate.cli import main
    from nw_adapter.correlate.option_table import OPTIONS

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    printed = capsys.readouterr().out
    usage = printed.split("\n\n")[0].splitlines()
    assert len(usage) <= 5 and usage[0].startswith("usage: ")
    assert all(
        words in printed.split("\n\n")[0]
        for words in ("--image-dir DIR", "--support-dir DIR", "--replot OUT")
    )
    assert "report.html" in printed and "verdict" in printed
    for option in OPTIONS:  # every option still shown, in its group
        assert option.name in printed.split("\n\n", 2)[2]
