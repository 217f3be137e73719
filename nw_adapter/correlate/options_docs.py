"""docs/cli.md's tables of runs and options, generated from :mod:`~nw_adapter.correlate.option_table`.

``python -m nw_adapter.correlate.options_docs`` rewrites the part of docs/cli.md between
:data:`BEGIN` and :data:`END`; ``--check`` exits 1 when that part differs from the tables
(tests/correlate/test_cli_docs.py runs the same comparison). Standard library only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nw_adapter.correlate.option_rows import Option, Run
from nw_adapter.correlate.option_table import OPTION_BY_DEST, OPTIONS, RUN_BY_NAME, RUNS

__all__ = ["BEGIN", "END", "DOCS", "markdown", "updated"]

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
BEGIN = "<!-- the run and option tables: written by python -m nw_adapter.correlate.options_docs -->"
END = "<!-- end of the generated tables -->"


def _cell(text: str) -> str:
    return text.replace("%(prog)s", "correlate.py").replace("%%", "%").replace("|", "\\|")


def _chosen_by(run: Run) -> str:
    return " / ".join(f"`{OPTION_BY_DEST[dest].name}`" for dest in run.selectors) or "(default)"


def _value(option: Option) -> str:
    if option.action in ("store_true", "store_false"):
        return "flag"
    if option.action == "count":
        return "flag, repeatable"
    if option.dest == "example_dir":
        return "flag (prints, exits)"
    shown = " \\| ".join(f"`{choice}`" for choice in option.choices) if option.choices else None
    shown = shown or f"`{option.metavar or option.dest.upper()}`"
    if option.action == "append":
        shown += ", repeatable"
    if option.default not in (None, [], ()):
        shown += f"; default `{option.default}`"
    return shown


def _runs(names: frozenset[str]) -> str:
    return ", ".join(run.name for run in RUNS if run.name in names)


def _recorded(option: Option) -> str:
    parts = []
    for record in option.records:
        runs = "" if record.runs == option.runs else f" ({_runs(record.runs)})"
        parts.append(f"`{record.key}`{runs}")
    return "; ".join(parts) or "-"


def _fingerprinted(option: Option) -> str:
    runs = set()
    for record in option.records:
        for name in record.fingerprinted if record.fingerprinted is not None else record.runs:
            if RUN_BY_NAME[name].resumes and name in record.runs:
                runs.add(name)
    return _runs(frozenset(runs)) or "-"


def markdown() -> str:
    """The two tables, as Markdown (the part of docs/cli.md between :data:`BEGIN` and :data:`END`)."""
    lines = [
        "| run | chosen by | writes in `--out` | resumes | processes of `accelerate launch` |",
        "|---|---|---|---|---|",
    ]
    for run in RUNS:
        processes = "splits its work over them" if run.one_process is None else f"refused: {run.one_process}"
        resumes = "yes" if run.resumes else "no"
        lines.append(
            f"| {run.name} | {_chosen_by(run)} | {_cell(run.writes)} | {resumes} | {_cell(processes)} |"
        )
    lines += [
        "",
        "| option | value | read by | recorded as | in the fingerprint of | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for option in OPTIONS:
        read = _runs(option.runs) if option.dest != "example_dir" else "any (answers at once)"
        if option.families is not None:
            read += f" (model families: {', '.join(sorted(option.families))})"
        if option.conditions:
            read += f" (only {', '.join(condition.shown for condition in option.conditions)})"
        name = ", ".join(f"`{flag}`" for flag in option.flags)
        lines.append(
            f"| {name} | {_value(option)} | {read} | {_recorded(option)} | {_fingerprinted(option)} | "
            f"{_cell(option.help)} |"
        )
    return "\n".join(lines) + "\n"


def updated(text: str) -> str:
    """``text`` (docs/cli.md) with the part between :data:`BEGIN` and :data:`END` generated anew.

    Raises:
        ValueError: the markers are missing.
    """
    head, found, rest = text.partition(BEGIN)
    _, found_end, tail = rest.partition(END)
    if not found or not found_end:
        raise ValueError(f"docs/cli.md lacks the markers {BEGIN!r} ... {END!r}")
    return f"{head}{BEGIN}\n\n{markdown()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    """Rewrite docs/cli.md's tables (``--check``: only say whether they are current; exit 1 if not)."""
    parser = argparse.ArgumentParser(prog="python -m nw_adapter.correlate.options_docs")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when docs/cli.md's tables are not current"
    )
    args = parser.parse_args(argv)
    text = DOCS.read_text(encoding="utf-8")
    new = updated(text)
    if args.check:
        print("current" if new == text else f"{DOCS} differs from the option table; run without --check")
        return 0 if new == text else 1
    DOCS.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
