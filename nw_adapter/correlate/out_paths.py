"""Entries inside an output folder, checked without following a link: :func:`check_entry`.

Nothing outside ``--out`` may be read as the tool's, written or removed, so every reader, writer
and remover of an output folder checks its path first: no component below the folder may be a
symbolic link (a dangling one or a loop included), and files and folders must be what the tool
expects. A problem is an :class:`OutputError`, one line naming the entry and the fix.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["OutputError", "check_entry"]


class OutputError(ValueError):
    """The output folder cannot be used; the message is one line with the fix (exit status 2)."""


def check_entry(
    out: Path, relative: str | os.PathLike, *, folder: bool = False, option: str = "--out"
) -> Path:
    """``out / relative``, after checking that no link is followed on the way there.

    Every existing component below ``out`` (``out`` itself is the user's path and may be a link) is
    inspected with ``lstat``: none may be a symbolic link (also a dangling one or a loop), each one
    above the last must be a folder, and the last must be a folder when ``folder`` is set, else a
    regular file. A missing component ends the check (the tool creates what follows). This is the
    one check every reader, writer and remover of ``--out`` goes through.

    Args:
        out: The output folder.
        relative: The entry inside it, e.g. ``"rho.json"`` or ``"images/<key>/result.json"``.
        folder: Whether the entry is a folder.
        option: The option that named ``out`` (for the message).

    Raises:
        OutputError: One line naming the entry and the fix.
    """
    out = Path(out)
    parts = Path(relative).parts
    path = out
    for index, part in enumerate(parts):
        path = path / part
        last = index == len(parts) - 1
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            break
        except NotADirectoryError:  # a file on the way: out itself, or an entry above this one
            raise OutputError(
                f"{option} '{out}': '{path.parent}' is a file, not a folder; pass {option} a folder"
            ) from None
        except OSError as exc:
            raise OutputError(
                f"{option} '{out}': cannot inspect '{path}' ({exc.strerror or type(exc).__name__}); fix its "
                f"permissions or pass another {option}"
            ) from None
        if stat.S_ISLNK(mode):
            raise OutputError(
                f"{option} '{out}': '{path}' is a symbolic link (to '{os.readlink(path)}'); nothing inside "
                f"{option} is read, written or removed through a link: remove the link or pass another "
                f"{option}"
            )
        if (folder or not last) and not stat.S_ISDIR(mode):
            raise OutputError(
                f"{option} '{out}': '{path}' is not a folder; remove it or pass another {option}"
            )
        if last and not folder and stat.S_ISDIR(mode):
            raise OutputError(
                f"{option} '{out}': '{path}' is a folder where this tool writes a file; remove it or pass "
                f"another {option}"
            )
        if last and not folder and not stat.S_ISREG(mode):
            raise OutputError(
                f"{option} '{out}': '{path}' is not a regular file; remove it or pass another {option}"
            )
    return out / relative
