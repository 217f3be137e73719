"""What diffusers and transformers print: one mechanism for the command line and the notebook loaders.

The libraries log notes while loading (the image processors' torchvision fallback, diffusers'
float32 cast note), draw progress bars ("Loading pipeline components", "Loading weights") and warn
about deprecations. The command line shows them only with ``-v``; the Python loaders
(:func:`nw_adapter.models.loaders.load_tiny_digits` ...) only with ``verbose=True``. Both use

- :func:`library_output`: within the block, the libraries' loggers at a chosen level (error by
  default), their progress bars off where none is to be shown, their ``FutureWarning`` and
  ``DeprecationWarning`` hidden; the previous levels and bar settings restored afterwards (the
  command line also runs in-process, in tests and notebooks);
- :func:`quiet_library_environment`: the same choice as environment variables, for libraries not
  imported yet (a fresh command-line process; a variable the user has set is kept).

Standard library only at import: the libraries are imported inside :func:`library_output`.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

__all__ = ["library_output", "quiet_library_environment"]

ERROR, CRITICAL = 40, 50
"""The loggers' levels (the ``logging`` module's numbers, which both libraries use)."""


@contextlib.contextmanager
def library_output(*, verbose: bool = False, bars: bool = False, level: int = ERROR) -> Iterator[None]:
    """Within the block, diffusers and transformers print only what is asked for.

    Args:
        verbose: True: their loggers and warnings as they are (the command line's ``-v``, the
            loaders' ``verbose=True``).
        bars: True: their progress bars as they are (shown where the caller draws bars); False: off.
        level: the loggers' level when not ``verbose``: :data:`ERROR` (errors only) or
            :data:`CRITICAL` (not even errors: a loading error that becomes the caller's one line).

    The levels and bar settings are restored on exit, also after an exception.
    """
    if verbose and bars:
        yield
        return
    from transformers.utils import logging as transformers_logging

    # transformers first: importing diffusers' pipelines already logs the image processors' notes
    before = transformers_logging.get_verbosity()
    if not verbose:
        transformers_logging.set_verbosity(level)
    try:
        from diffusers.utils import logging as diffusers_logging
    finally:
        transformers_logging.set_verbosity(before)
    loggers = (diffusers_logging, transformers_logging)
    levels = [log.get_verbosity() for log in loggers]
    enabled = [log.is_progress_bar_enabled() for log in loggers]
    try:
        with warnings.catch_warnings():
            if not verbose:
                warnings.simplefilter("ignore", FutureWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
            for log in loggers:
                if not verbose:
                    log.set_verbosity(level)
                if not bars:
                    log.disable_progress_bar()
            yield
    finally:
        for log, was, was_enabled in zip(loggers, levels, enabled, strict=True):
            log.set_verbosity(was)
            (log.enable_progress_bar if was_enabled else log.disable_progress_bar)()


def quiet_library_environment(*, verbose: bool = False, bars: bool = False) -> None:
    """Set the libraries' environment variables as :func:`library_output` sets their loggers, for
    libraries imported after this call: warnings and notes off unless ``verbose``, the Hub's
    progress bars off unless ``bars``. A variable already set (the user's choice) is kept."""
    if not verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_VERBOSITY", "error")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if not bars:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
