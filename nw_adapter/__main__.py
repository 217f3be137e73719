"""``python -m nw_adapter COMMAND ...``: the package's command lines (:data:`.commands.SUBCOMMANDS`).

``python -m nw_adapter correlate --image ref.png --model tiny`` is ``nw-correlate --image ref.png
--model tiny``; ``python -m nw_adapter experiments --out runs --quick`` is ``nw-experiments --out
runs --quick``. Without a command, or with ``--help``, it lists them; an unknown one is one line on
stderr, exit status 2.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Sequence

from nw_adapter.commands import SUBCOMMANDS, invoked_as


def _overview(prog: str) -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    rows = "\n".join(f"  {name:<{width}}  {summary}" for name, (_, summary) in SUBCOMMANDS.items())
    return (
        f"usage: {prog} COMMAND [options]\n\ncommands:\n{rows}\n\n"
        f"'{prog} COMMAND --help' lists the options of COMMAND."
    )


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Dispatch to the command's ``main``; return its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    prog = prog or (invoked_as("nw_adapter") if argv is None else "python -m nw_adapter")
    if not args or args[0] in ("-h", "--help"):
        print(_overview(prog), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        close = difflib.get_close_matches(name, SUBCOMMANDS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(
            f"{prog}: error: unknown command '{name}'; {hint}use one of {', '.join(SUBCOMMANDS)} "
            f"(see {prog} --help)",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return module.main(rest, prog=f"{prog} {name}")


if __name__ == "__main__":
    sys.exit(main())
