"""What every run of ``correlate.py`` shows on the terminal: progress bars and the libraries' output.

Progress bars only without ``-q`` and when stderr is a terminal; the libraries' own warnings and
notes only with ``-v`` (:func:`quiet_libraries` before they are imported, :func:`library_output`
around the work). Importing this module imports no library.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

__all__ = ["library_output", "quiet_libraries", "show_progress_bars"]


def show_progress_bars(args: argparse.Namespace) -> bool:
    """Progress bars only without ``-q`` and when stderr is a terminal.

    Captured or piped output (a log file, ``2>&1`` into a file) gets no bars, so their carriage
    returns never share a line with the table printed on stdout.
    """
    isatty = getattr(sys.stderr, "isatty", None)
    return args.quiet == 0 and bool(isatty and isatty())


def quiet_libraries(args: argparse.Namespace) -> None:
    """Keep library warnings (and, without bars, their progress bars) off stderr, before importing them.

    Set only where the user has not chosen: an environment variable already set is kept.
    """
    if not args.verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_VERBOSITY", "error")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if not show_progress_bars(args):
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@contextlib.contextmanager
def library_output(args: argparse.Namespace) -> Iterator[None]:
    """Within the block: libraries' loggers at error level (unless ``-v``), their bars off (unless shown).

    Restores the previous levels and bar settings afterwards (the command line also runs in-process
    in tests and notebooks).
    """
    import diffusers
    import transformers

    verbose, bars = args.verbose, show_progress_bars(args)
    loggers = (diffusers.utils.logging, transformers.utils.logging)
    levels = [log.get_verbosity() for log in loggers]
    enabled = [log.is_progress_bar_enabled() for log in loggers]
    try:
        for log in loggers:
            if not verbose:
                log.set_verbosity_error()
            if not bars:
                log.disable_progress_bar()
        yield
    finally:
        for log, level, was_enabled in zip(loggers, levels, enabled, strict=True):
            log.set_verbosity(level)
            (log.enable_progress_bar if was_enabled else log.disable_progress_bar)()
