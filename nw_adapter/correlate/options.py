"""``correlate.py`` as two tables: the runs (:data:`RUNS`) and the options (:data:`OPTIONS`).

A run is one kind of job the command line does (the rho run, its end-to-end control, the
compare-swap run, the support-set run, the redraw of a finished run); an option is one row
naming its flags, value parser, default, help, the runs that read it, the model families that
read it, and what it writes into the options record of the run's result file and, of those
entries, which enter the fingerprint a resumed run is matched by. Everything else derives
from the two tables:

- :func:`build_parser`: the ``argparse`` parser (its groups in table order);
- :func:`check_options`: which run the options choose, and the refusal of every option given
  that this run does not read (exit status 2, one line naming the option and the run), of an
  option whose condition is off (:class:`Needs`), of a run under ``accelerate launch`` that runs
  in one process;
- :func:`family_problem`: an option given that the model's family does not read;
- :func:`options_record` and :func:`fingerprint`: the ``config`` of ``rho.json``,
  ``compare_swap.json`` and ``support.json``, and the resume fingerprint, from the rows'
  :class:`Record` entries (the fingerprint hashes canonical JSON with sorted keys, so the order
  of the rows does not enter it);
- :mod:`~nw_adapter.correlate.options_docs`: the option and run tables of docs/cli.md.

A new option is one row here and the code of the run that reads it; an entry it adds to the
record with ``omit_default=True`` leaves every earlier fingerprint as it was. Standard library
only (no torch): ``--help`` and every argument error answer before torch is imported.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from nw_adapter.commands import OneLineParser
from nw_adapter.correlate.option_rows import (
    COMPARE_SWAP,
    END_TO_END,
    OMIT,
    REPLOT,
    RHO,
    SUPPORT_SETS,
    Needs,
    Option,
    Record,
    Resolved,
    Run,
)
from nw_adapter.correlate.option_table import (
    MODEL_RUNS,
    OPTION_BY_DEST,
    OPTIONS,
    RUN_BY_NAME,
    RUNS,
    ExampleDir,
)

__all__ = [
    "COMPARE_SWAP",
    "END_TO_END",
    "OPTIONS",
    "REPLOT",
    "RHO",
    "RUNS",
    "SUPPORT_SETS",
    "MODEL_RUNS",
    "CLIError",
    "Needs",
    "Option",
    "Record",
    "Resolved",
    "Run",
    "build_parser",
    "check_options",
    "family_problem",
    "fingerprint",
    "given_options",
    "options_record",
    "parse_args",
]

PROG = "correlate.py"


class CLIError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


# --- parsing and checking ------------------------------------------------------------------------


USAGE = (
    "%(prog)s (--image FILE | --image-dir DIR) [--model MODEL] [--steps N] [--out OUT]\n"
    "                    [--calibrate | --compare-swap | --end-to-end-control] [options]\n"
    "       %(prog)s (--support-set FILES | --support-dir DIR) [--out OUT] [options]\n"
    "       %(prog)s --replot OUT"
)
"""The runs' usage lines (every option, and which runs read it, below and in docs/cli.md)."""


class _Parser(OneLineParser):
    """ArgumentParser whose errors are one line (no usage block) and raise :class:`CLIError`."""

    error_class = CLIError


def build_parser(prog: str = PROG, *, defaults: bool = True) -> argparse.ArgumentParser:
    """The parser of :data:`OPTIONS` (``defaults=False``: every default suppressed, so the parsed
    namespace holds the options given, see :func:`given_options`)."""
    parser = _Parser(
        prog=prog,
        usage=USAGE,
        description=(
            "Generate with IP-Adapter and read, at every denoising step, whether the image branch's "
            "cross-attention is the Nadaraya-Watson (Gaussian-kernel) smoother the theory predicts: rho "
            "with its three nulls beside a scale-matched untrained control, the bandwidth path against "
            "the theory's exponent 2, and a verdict (with --calibrate, beside the exact NW head run in the "
            "same pipeline); writes rho.json / rho.csv, figures and report.html (one interactive page) "
            "into --out."
        ),
        epilog=(
            "Quick offline run: --model tiny --steps 3. Several processes: accelerate launch --multi_gpu "
            "--num_processes N correlate.py ... (on CPU-only machines too; see the README). Which option "
            "each run reads: docs/cli.md."
        ),
    )
    groups: dict[str, Any] = {}
    for option in OPTIONS:
        group = groups.get(option.group)
        if group is None:
            group = groups[option.group] = parser.add_argument_group(option.group)
        kwargs = option.argparse_kwargs()
        if not defaults and option.action is not ExampleDir:
            kwargs["default"] = argparse.SUPPRESS
        group.add_argument(*option.flags, **kwargs)
    return parser


def given_options(argv: Sequence[str] | None, prog: str = PROG) -> set[str]:
    """The destinations of the options given on the command line, also those given at their default."""
    return set(vars(build_parser(prog, defaults=False).parse_args(argv)))


def _where(run: Run) -> str:
    if not run.selectors:
        return "in the rho run"
    return "with " + "/".join(OPTION_BY_DEST[dest].name for dest in run.selectors)


def refusal(option: Option, run: Run) -> str:
    """The one line refusing ``option`` in ``run``, with the fix."""
    fix = option.hints.get(run.name)
    if fix is None:
        readers = [RUN_BY_NAME[name] for name in sorted(option.runs)]
        fix = f"drop {option.name}"
        if len(readers) <= 2:
            fix += ", or use it " + " or ".join(_where(reader) for reader in readers)
    return f"{option.name} is not read by {run.title}; {fix}"


def check_options(args: argparse.Namespace, given: set[str]) -> Run:
    """The run the options choose; every option given is read by it, or this raises.

    Raises:
        CLIError: two runs chosen; an option given that the run does not read (:func:`refusal`); an
            option whose condition is off (:class:`Needs`); none of the run's inputs; a run that
            runs in one process under a multi-process launch.
    """
    chosen = [run for run in RUNS if any(dest in given for dest in run.selectors)]
    if len(chosen) > 1:
        first, second = (
            OPTION_BY_DEST[next(d for d in run.selectors if d in given)].name for run in chosen[:2]
        )
        raise CLIError(
            f"{first} and {second} start two different runs ({chosen[0].title}, {chosen[1].title}); run them "
            "one at a time"
        )
    run = chosen[0] if chosen else RUN_BY_NAME[RHO]
    for option in OPTIONS:
        if option.dest in given and run.name not in option.runs:
            raise CLIError(refusal(option, run))
    for option in OPTIONS:
        if option.dest in given:
            for condition in option.conditions:
                if not condition.met(args):
                    raise CLIError(condition.message)
    if run.inputs and not any(getattr(args, dest) for dest in run.inputs):
        raise CLIError(run.no_input)
    from nw_adapter.correlate.sweep import is_distributed_launch

    if run.one_process and is_distributed_launch():
        raise CLIError(
            f"{run.title} runs in one process ({run.one_process}); run it without accelerate launch / "
            "torchrun"
        )
    return run


def parse_args(argv: Sequence[str] | None = None, *, prog: str = PROG) -> argparse.Namespace:
    """Parse and check the options (the file system only to tell a local ``--model`` folder from a name).

    The namespace also holds ``prog``, ``given`` (the destinations given) and ``run`` (the
    :class:`Run` chosen).

    Raises:
        CLIError: unknown options, bad values, an option the run does not read, nothing to do.
    """
    args = build_parser(prog).parse_args(argv)
    args.prog = prog
    args.given = given_options(argv, prog)
    args.run = check_options(args, args.given)
    return args


def family_problem(args: argparse.Namespace, family: str) -> str | None:
    """The one line refusing the model family for this run or an option given for it, or None.

    Both read the family's row of the registry (:mod:`nw_adapter.integration.families`): the run's
    :attr:`~nw_adapter.correlate.option_rows.Run.family_limit` field of it (why the run cannot run on
    the family), and whether the family is among an option's
    :attr:`~nw_adapter.correlate.option_rows.Option.families` (derived from the rows in the option table).
    """
    from nw_adapter.integration.families import family_named

    run: Run = args.run
    row = family_named(family)
    why = getattr(row, run.family_limit) if run.family_limit else None
    if why is not None:
        return f"{run.title} cannot run on {row.label}: {why}; {run.family_fix}"
    for option in OPTIONS:
        if option.families is not None and option.dest in args.given and family not in option.families:
            return f"{option.name} is not read by {row.label} pipelines; {option.family_fix}"
    return None


# --- the options record and the fingerprint ------------------------------------------------------


def _entries(run: str, *, fingerprinted: bool):
    """``(option or None, record)`` of the run's record: the options' rows, then the run's own."""
    rows = [(option, record) for option in OPTIONS for record in option.records]
    rows += [(None, record) for record in RUN_BY_NAME[run].records]
    for option, record in rows:
        if run not in record.runs:
            continue
        if fingerprinted and record.fingerprinted is not None and run not in record.fingerprinted:
            continue
        yield option, record


def options_record(
    run: str, args: argparse.Namespace, resolved: Resolved, *, fingerprinted: bool = False
) -> dict:
    """The options record of ``run`` (``config`` of its result file), in table order.

    Args:
        run: The run's name.
        args: The parsed options.
        resolved: What the run resolved (model, device, dtype, ...).
        fingerprinted: Only the entries that enter the fingerprint.
    """
    record: dict[str, Any] = {}
    for option, entry in _entries(run, fingerprinted=fingerprinted):
        own = getattr(args, option.dest, option.default) if option is not None else None
        if option is not None and entry.omit_default and own == option.default:
            continue
        value = own if entry.value is None else entry.value(args, resolved)
        if value is not OMIT:
            record[entry.key] = value
    return record


def fingerprint(run: str, args: argparse.Namespace, resolved: Resolved) -> str:
    """The resume fingerprint of ``run``: its fingerprinted record and the resolved model
    (:func:`nw_adapter.correlate.sweep.fingerprint`: SHA-256 of canonical JSON, keys sorted)."""
    from nw_adapter.correlate import sweep

    if not RUN_BY_NAME[run].resumes:
        raise ValueError(f"the {run} run does not resume; it has no fingerprint")
    identity = {
        **options_record(run, args, resolved, fingerprinted=True),
        "resolved_model": resolved.resolved_model,
    }
    return sweep.fingerprint(identity)
