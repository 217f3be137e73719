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
