"""``python scripts/correlate.py``: rho between IP-Adapter attention and NW weights, per timestep.

A reference image (or many) in; out come a terminal table per reported timestep, a one-line
verdict, and in ``--out``: ``rho.json`` (schema in docs/rho_json_schema.md), ``rho.csv``,
``rho.png`` and per image ``images/<key>/generated.png`` (plus, with ``--store-maps``,
``maps.safetensors``, the x0 estimates ``x0_step<s>.png`` and ``attention_maps.png``).
``--replot OUT`` redraws all of it from a finished run's files without loading a model;
``--compare-swap`` and ``--support-set`` are runs of their own.

This module parses the options (:func:`nw_adapter.correlate.options.parse_args`: the option
table chooses the run and refuses every option it does not read), starts the run of the run
table (:data:`nw_adapter.correlate.options.RUNS`: the rho run and its end-to-end control in
:mod:`~nw_adapter.correlate.rho_cli`, :mod:`~nw_adapter.correlate.swap_cli`,
:mod:`~nw_adapter.correlate.support_cli`, ``--replot`` in :mod:`~nw_adapter.correlate.outputs`),
and turns every bad input into one line on stderr and exit status 2. A failed write or an
interruption says what the run keeps (its row's ``kept``).

This module imports neither torch nor diffusers (nor transformers, accelerate, huggingface_hub):
``--help``, ``--example-dir`` and every argument error answer before any of them is loaded
(tests/correlate/test_cli_imports.py; the numbers in benchmarks/cli_startup.py). The usage line and
the error prefix name the command as it was invoked (``nw-correlate``, ``correlate.py``,
``python -m nw_adapter.correlate``; :func:`nw_adapter.commands.invoked_as`).

Example:
    $ python scripts/correlate.py --image ref.png --model tiny --steps 3
    $ python scripts/correlate.py --image ref.png            # SD 1.5 + h94/IP-Adapter
    $ accelerate launch --multi_gpu --num_processes 2 scripts/correlate.py --image-dir refs/
    $ python scripts/correlate.py --replot correlate_out
    $ python scripts/correlate.py --compare-swap --image-dir refs/ --model tiny   # stock vs NW head
    $ nw-correlate --image-dir "$(nw-correlate --example-dir)" --model tiny   # the bundled digits
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from nw_adapter.atomic import WriteError
from nw_adapter.commands import invoked_as
from nw_adapter.correlate.images import ImageInputError
from nw_adapter.correlate.options import PROG, CLIError, Run, build_parser, parse_args
from nw_adapter.correlate.out_paths import OutputError
from nw_adapter.correlate.spec import ModelLoadError
from nw_adapter.correlate.support_cli import SupportSetError
from nw_adapter.correlate.swap_cli import CompareSwapError
from nw_adapter.integration.errors import NWConfigError, NWInstallError

__all__ = ["CLIError", "build_parser", "main", "parse_args"]

ONE_LINE_ERRORS = (
    CLIError,
    OutputError,
    ImageInputError,
    ModelLoadError,
    CompareSwapError,
    SupportSetError,
    NWConfigError,
    NWInstallError,
)
"""Bad input of every run: one line on stderr, exit status 2."""


def _kept(run: Run | None) -> str:
    return run.kept if run is not None else "rerun the same command"


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Run the command line; return the exit status (0 ok, 2 bad input, 130 interrupted).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        prog: the command's name in the usage line and the messages (default: as invoked,
            :func:`nw_adapter.commands.invoked_as`, for the real command line; ``correlate.py`` for
            an ``argv`` passed in).
    """
    if prog is None:
        prog = invoked_as(PROG) if argv is None else PROG
    run: Run | None = None
    try:
        args = parse_args(argv, prog=prog)
        run = args.run
        return importlib.import_module(run.module).run(args)
    except ONE_LINE_ERRORS as exc:
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except WriteError as exc:
        print(
            f"{prog}: error: {' '.join(str(exc).split())}; free space or fix the permissions of --out and "
            f"rerun the same command ({_kept(run)})",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; {_kept(run)}", file=sys.stderr)
        return 130
