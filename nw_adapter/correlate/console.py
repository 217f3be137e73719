"""What every run of ``correlate.py`` shows on the terminal: progress bars and the libraries' output.

Progress bars only without ``-q`` and when stderr is a terminal; the libraries' own warnings and
notes only with ``-v`` (:func:`quiet_libraries` before they are imported, :func:`library_output`
around the work; both :mod:`nw_adapter.library_output`'s, which the notebook loaders use too).
Importing this module imports no library.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

__all__ = ["library_output", "quiet_libraries", "show_progress_bars"]


def show_progress_bars(args: argparse.Namespace) -> bool:
    """Progress bars only without ``-q`` and when stderr is a terminal.

    Captured or piped output (a log file, ``2>&1`` into a file) gets no bars, so their carriage
    returns never share a line with the table printed on stdout.
    """
    isatty = getattr(sys.stderr, "isatty", None)
    return args.quiet == 0 and bool(isatty and isatty())


def quiet_libraries(args: argparse.Namespace) -> None:
    """Keep library warnings (and, without bars, their progress bars) off stderr, before importing them
    (:func:`nw_adapter.library_output.quiet_library_environment`; a variable the user set is kept)."""
    from nw_adapter.library_output import quiet_library_environment

    quiet_library_environment(verbose=args.verbose, bars=show_progress_bars(args))


def library_output(args: argparse.Namespace) -> contextlib.AbstractContextManager[None]:
    """Within the block: the libraries' loggers at error level and their warnings hidden (unless
    ``-v``), their bars off (unless shown): :func:`nw_adapter.library_output.library_output`, the
    notebook loaders' mechanism too. Restores the previous levels and bar settings afterwards."""
    from nw_adapter.library_output import library_output as output

    return output(verbose=args.verbose, bars=show_progress_bars(args))
