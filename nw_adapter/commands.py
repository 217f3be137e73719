"""The package's command lines: their names, and the name a user invoked one by.

Stdlib only, so that answering ``--help`` or a bad option never waits for torch or diffusers.
Every way in reaches the same ``main`` functions:

=======================================  ==========================================
invocation                               runs
=======================================  ==========================================
``nw-correlate``, ``scripts/correlate.py``,
``python -m nw_adapter.correlate``,
``python -m nw_adapter correlate``       :func:`nw_adapter.correlate.cli.main`
``nw-experiments``,
``scripts/run_experiments.py``,
``python -m nw_adapter.experiments.cli``,
``python -m nw_adapter experiments``     :func:`nw_adapter.experiments.cli.main`
=======================================  ==========================================
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import NoReturn

__all__ = ["SUBCOMMANDS", "OneLineParser", "invoked_as", "note", "one_line_argument_error"]

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "correlate": (
        "nw_adapter.correlate.cli",
        "rho between IP-Adapter attention and NW weights per timestep; --compare-swap; --replot",
    ),
    "experiments": ("nw_adapter.experiments.cli", "reproduce the paper's three failure regimes"),
}
"""``python -m nw_adapter NAME``: NAME -> (module with ``main(argv, prog=...)``, one-line summary)."""


def invoked_as(default: str) -> str:
    """The command as the user typed it, for usage lines and error prefixes.

    ``python -m package.module`` gives ``python -m package.module`` (a package's ``__main__``
    module counts as the package); a script or an installed entry point gives its file name
    (``correlate.py``, ``nw-correlate``); ``default`` when there is no command line (embedded
    interpreters, ``python -c``).
    """
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return f"python -m {spec.name.removesuffix('.__main__')}"
    argv0 = sys.argv[0] if sys.argv else ""
    name = os.path.basename(argv0)
    return name if name and name != "-c" else default


def note(quiet: int, text: str, *, shown: bool = True) -> None:
    """Print ``note: text`` on stderr unless ``-qq`` (``quiet >= 2``) or not ``shown`` (e.g. a
    process other than the main one of a multi-process run)."""
    if quiet < 2 and shown:
        print(f"note: {text}", file=sys.stderr)


def progress_line(quiet: int, bars: bool, text: str) -> None:
    """Print ``progress: text`` on stderr where no progress bar is drawn (stderr not a terminal: a
    log file), unless ``-q``: a long run is never silent for minutes in a log."""
    if quiet == 0 and not bars:
        print(f"progress: {text}", file=sys.stderr, flush=True)


def one_line_argument_error(message: str) -> str:
    """argparse's message in one line, without its ``argument --x:`` prefix where the rest names ``--x``.

    The command lines' option checks word their own messages (``--steps must be ...``); argparse
    puts ``argument --steps: `` in front of each, which would name the option twice.
    """
    text = " ".join(message.split())
    prefix, _, rest = text.partition(": ")
    option = prefix.removeprefix("argument ")
    if prefix.startswith("argument ") and any(rest.startswith(name) for name in option.split("/")):
        return rest
    return text


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose errors raise :attr:`error_class` with one line (no usage block).

    The line is argparse's message (:func:`one_line_argument_error`), for an unrecognised option
    close to a known one ``; did you mean --steps?``, then ``(see --help)``. The command line
    prints it after its ``prog: error:`` and exits with status 2.
    """

    error_class: type[Exception] = ValueError

    def error(self, message: str) -> NoReturn:
        raise self.error_class(f"{one_line_argument_error(message)}{self._guess(message)} (see --help)")

    def _guess(self, message: str) -> str:
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [name for action in self._actions for name in action.option_strings if name.startswith("--")]
        for word in message.removeprefix("unrecognized arguments:").split():
            close = difflib.get_close_matches(word.split("=")[0], known, n=1) if word.startswith("--") else []
            if close:
                return f"; did you mean {close[0]}?"
        return ""
