"""Atomic file writes: every output of nw-adapter is complete or absent, never half-written.

A writer fills a temporary file in the destination folder (same file system, so the final
``os.replace`` is atomic); on any exception the temporary file is removed and the destination
is left as it was. Files get the usual ``0666 & ~umask`` mode (``mkstemp`` alone gives 0600).

A write killed outright (SIGKILL, power loss) cannot remove its temporary file
``.<stem>.<8 random characters>.tmp<suffix>``; :func:`remove_interrupted_writes` removes such
files of the given destination names, and the command line calls it on the next run in the folder.

Durability: the temporary file is flushed to disk (``fsync``) before the rename and the folder
after it, so a power loss leaves the old file or the new one, never an empty one. A failure to
write (full disk, file-size limit, read-only folder, also a safetensors ``SafetensorError``,
which is not an ``OSError``) is raised as :class:`WriteError` naming the file.

Knowing what was written: inside :func:`journal_writes` ``(folder, record)``, every
:func:`atomic_write` into ``folder`` first calls ``record(name)``, before its temporary file is
created, so a caller can keep a manifest of its own files that is complete even when the process
is killed halfway (and later remove those files, and only those).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "WriteError",
    "atomic_write",
    "atomic_write_json",
    "atomic_write_text",
    "fsync_folder",
    "journal_writes",
    "remove_interrupted_writes",
    "remove_regular_file",
    "temporary_target",
]

TEMPORARY_NAME = re.compile(r"^\.(?P<stem>.+)\.[a-z0-9_]{8}\.tmp(?P<suffix>\.[^.]+)?$")
"""Names of :func:`atomic_write`'s temporary files: ``tempfile.mkstemp`` with prefix ``.<stem>.``
and suffix ``.tmp<suffix>``, whose random part is 8 characters of ``[a-z0-9_]``."""


class WriteError(OSError):
    """A file could not be written (disk full, size limit, permissions...); the message names it."""


_JOURNAL: contextvars.ContextVar[tuple[str, Callable[[str], None]] | None] = contextvars.ContextVar(
    "nw_adapter_write_journal", default=None
)


@contextlib.contextmanager
def journal_writes(folder: str | os.PathLike, record: Callable[[str], None]) -> Iterator[None]:
    """Within the block, call ``record(name)`` before every :func:`atomic_write` into ``folder``.

    ``record`` runs before the temporary file is created (a write-ahead record: a name is recorded
    even if the write is then killed) and outside the journal (its own writes are not recorded).
    Folders are compared by their absolute path as written, no link followed.

    Args:
        folder: The folder whose writes are recorded (not its sub-folders).
        record: Called with the destination's file name; an exception there stops the write.
    """
    token = _JOURNAL.set((os.path.abspath(folder), record))
    try:
        yield
    finally:
        _JOURNAL.reset(token)


def _record_write(path: Path) -> None:
    """Tell the active :func:`journal_writes` (if it watches ``path``'s folder) about ``path``."""
    journal = _JOURNAL.get()
    if journal is None or os.path.abspath(path.parent) != journal[0]:
        return
    token = _JOURNAL.set(None)
    try:
        journal[1](path.name)
    finally:
        _JOURNAL.reset(token)


def _is_io_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure of the file system rather than of the writer's logic."""
    return isinstance(exc, OSError) or type(exc).__module__.startswith("safetensors")


def describe_failure(exc: BaseException) -> str:
    """A short reason for a failed write: ``strerror`` of an ``OSError``, else the exception text."""
    reason = getattr(exc, "strerror", None) or " ".join(str(exc).split()) or type(exc).__name__
    return reason if len(reason) <= 160 else reason[:157] + "..."


def fsync_folder(folder: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename in it) to disk; a no-op where folders cannot be opened."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass  # some file systems do not support fsync on folders
    finally:
        os.close(handle)


def _fsync_file(path: Path) -> None:
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary file next to ``path``, then rename it to ``path``.

    The temporary file keeps ``path``'s suffix (so writers that pick the format from the
    name, like matplotlib, Pillow and safetensors, work) and is removed if ``write`` fails.

    Args:
        path: Destination file; missing parent folders are created.
        write: Callable that writes the whole content to the path it is given.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        WriteError: The file system refused (an ``OSError`` or a safetensors error from
            ``write``, the rename, or creating the folder); ``path`` is left as it was.

    Example:
        >>> atomic_write("plot.png", lambda tmp: fig.savefig(tmp))  # doctest: +SKIP
    """
    path = Path(path)
    tmp: Path | None = None
    try:
        _record_write(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}", dir=path.parent)
        os.close(handle)
        tmp = Path(name)
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        _fsync_file(tmp)
        os.replace(tmp, path)
        tmp = None
        fsync_folder(path.parent)
    except BaseException as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if isinstance(exc, Exception) and not isinstance(exc, WriteError) and _is_io_failure(exc):
            raise WriteError(f"cannot write '{path}' ({describe_failure(exc)})") from exc
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8, newlines as given) to ``path`` atomically."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8", newline=""))


def atomic_write_json(path: str | os.PathLike, payload: Any, *, allow_nan: bool = False) -> Path:
    """Write ``payload`` as indented JSON to ``path`` atomically.

    Args:
        path: Destination file.
        payload: JSON-serialisable object.
        allow_nan: Whether NaN/Infinity may be written (not strict JSON); off by default.
    """
    return atomic_write_text(path, json.dumps(payload, indent=1, allow_nan=allow_nan) + "\n")


def remove_regular_file(path: str | os.PathLike) -> bool:
    """Remove ``path`` if it is a regular file; never a symbolic link, a folder or a link's target.

    Returns:
        Whether a file was removed (False when nothing, or something other than a file, is there).
    """
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        os.unlink(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def temporary_target(name: str) -> str | None:
    """The file name an :func:`atomic_write` temporary file called ``name`` was to become, else None.

    Example:
        >>> temporary_target(".rho.k2x_9abq.tmp.json"), temporary_target("rho.json")
        ('rho.json', None)
    """
    match = TEMPORARY_NAME.match(name)
    return None if match is None else match["stem"] + (match["suffix"] or "")


def remove_interrupted_writes(folder: str | os.PathLike, is_own: Callable[[str], bool]) -> list[Path]:
    """Remove the temporary files that killed :func:`atomic_write` calls left in ``folder``.

    Only regular files (not links or folders) whose name is an atomic write's temporary name for
    a destination ``is_own(destination)`` accepts: a user's file never matches both. Call it only
    when no other process writes in ``folder`` (e.g. under the command line's lock), since a
    running write's temporary file has the same name.

    Args:
        folder: The folder (nothing happens when it does not exist).
        is_own: Whether a destination file name is one the caller writes there.

    Returns:
        The removed files.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for path in sorted(folder.iterdir()):
        target = temporary_target(path.name)
        if target is None or not is_own(target) or path.is_symlink() or not path.is_file():
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed
