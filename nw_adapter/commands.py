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
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = [
    "SEED_LIMIT",
    "SUBCOMMANDS",
    "OneLineParser",
    "ScriptParser",
    "dead_link_on",
    "invoked_as",
    "note",
    "one_line_argument_error",
    "output_folder",
    "output_folder_problem",
    "seed_number",
    "whole_number",
]

SEED_LIMIT = 2**63
"""Seeds of the command lines are whole numbers in ``[0, SEED_LIMIT)``: torch's generators take
seeds below 2**64, and the scripts derive further seeds by adding small offsets."""

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


class _StoreOnce(argparse._StoreAction):
    """argparse's ``store``, except that a second, different value of the same option is an error:
    argparse keeps the last one and drops the first without a word (``--steps 3 ... --steps 50``)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values, option_string=None
    ):
        given = getattr(parser, "_values_given", None)
        if given is not None:
            if self.dest in given and given[self.dest][0] != values:
                first, flag = given[self.dest]
                raise argparse.ArgumentError(
                    self,
                    f"{flag} given twice with different values ({first}, then {values}); a run reads one: "
                    "give it once",
                )
            given.setdefault(self.dest, (values, option_string))
        super().__call__(parser, namespace, values, option_string)


_NEGATIVE_NUMBER = re.compile(r"^-(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.I)
"""A command-line word that is a negative number, also in scientific notation or infinite: a value."""


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose errors raise :attr:`error_class` with one line (no usage block).

    The line is argparse's message (:func:`one_line_argument_error`), for an unrecognised option
    close to a known one ``; did you mean --steps?``, then ``(see --help)``. The command line
    prints it after its ``prog: error:`` and exits with status 2. An option that stores one value
    given twice with different values is such an error too (argparse would keep the last one
    silently); repeated with the same value, or an ``append`` option, it is not.
    """

    error_class: type[Exception] = ValueError

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)
        # argparse reads "-1e3", "-inf" and "-nan" as unknown options ("expected one argument");
        # as values, the option's own check names the range (no option here looks like a number)
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102 (argparse's)
        self._values_given: dict[str, tuple[Any, str]] | None = {}
        try:
            return super().parse_known_args(args, namespace)
        finally:
            self._values_given = None

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


class ScriptParser(OneLineParser):
    """ArgumentParser of the scripts in ``scripts/``: a bad option is one line on stderr,
    ``prog: error: message (see --help)``, and exit status 2 (no usage block, no traceback)."""

    def refuse_unread(
        self, argv: Sequence[str] | None, choice: str, reads: Mapping[str, Iterable[str]]
    ) -> None:
        """Refuse an option given that the script's ``choice`` (its first argument) does not read.

        ``reads`` maps an option's flag to the choices that read it; an option given (also at its
        default value) with another choice is one line, exit status 2, never ignored.
        """
        saved = [(action, action.default) for action in self._actions if action.option_strings]
        try:
            for action, _ in saved:
                action.default = argparse.SUPPRESS
            given = set(vars(self.parse_args(argv)))
        finally:
            for action, default in saved:
                action.default = default
        for flag, readers in reads.items():
            dest = next(action.dest for action, _ in saved if flag in action.option_strings)
            readers = sorted(readers)
            if dest in given and choice not in readers:
                self.error(f"{flag} is not read by '{choice}'; drop it (it is read by {', '.join(readers)})")

    def error(self, message: str) -> NoReturn:
        text = f"{one_line_argument_error(message)}{self._guess(message)} (see --help)"
        self.exit(2, f"{self.prog}: error: {text}\n")


def dead_link_on(path: Path) -> Path | None:
    """The first of ``path`` and the folders above it that is a symbolic link leading nowhere (a loop
    or a missing target), or None: nothing could be made or written below it."""
    return next((p for p in (path, *path.parents) if p.is_symlink() and not p.exists()), None)


def output_folder_problem(path: str | os.PathLike, option: str = "--out") -> str | None:
    """Why ``path`` cannot be a command's output folder (None: it can): an empty path (it would be
    the current folder), a symbolic link that leads nowhere (on the path), an existing file, or a
    path below a file."""
    text = os.fspath(path)
    if not text.strip():
        example = f"{option} runs/out" if option.startswith("-") else "runs/out"
        return f"{option} is empty (that would be the current folder); pass a folder, e.g. {example}"
    folder = Path(text).expanduser()
    broken = dead_link_on(folder)
    if broken is not None:  # a loop or a missing target: the folder could be neither made nor used
        where = "" if broken == folder else f" (its folder '{broken}')"
        return (
            f"{option} '{text}'{where} is a symbolic link that leads nowhere (a loop or a missing target); "
            "remove the link or pass another folder"
        )
    if folder.exists() and not folder.is_dir():
        return f"{option} '{text}' is a file; pass a folder (new or existing)"
    parent = next((p for p in folder.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        return f"{option} '{text}' lies inside the file '{parent}'; pass a folder"
    return None


def output_folder(option: str = "--out") -> Callable[[str], Path]:
    """argparse ``type=`` of an output folder option: the path, or argparse's error naming
    ``option`` (:func:`output_folder_problem`)."""

    def parse(text: str) -> Path:
        problem = output_folder_problem(text, option)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return Path(text).expanduser()

    return parse


def whole_number(option: str, minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """argparse ``type=`` of a whole number in ``[minimum, maximum]`` (either end open when None),
    with an error naming ``option``, the range and the value given."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if (
            value is None
            or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)
        ):
            if minimum is not None and maximum is not None:
                wanted = f"a whole number from {minimum} to {maximum}"
            elif minimum is not None:
                wanted = f"a whole number >= {minimum}"
            else:
                wanted = "a whole number" if maximum is None else f"a whole number <= {maximum}"
            raise argparse.ArgumentTypeError(f"{option} must be {wanted}, got {text!r}")
        return value

    return parse


def seed_number(option: str = "--seed") -> Callable[[str], int]:
    """argparse ``type=`` of a seed: a whole number in ``[0, 2**63)`` (:data:`SEED_LIMIT`)."""
    return whole_number(option, 0, SEED_LIMIT - 1)
