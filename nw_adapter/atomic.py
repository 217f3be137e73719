"""Atomic file writes: every output of nw-adapter is complete or absent, never half-written.

A writer fills a temporary file in the destination folder (same file system, so the final
``os.replace`` is atomic); on any exception the temporary file is removed and the destination
is left as it was. Files get the usual ``0666 & ~umask`` mode (``mkstemp`` alone gives 0600).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["atomic_write", "atomic_write_json", "atomic_write_text"]


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

    Example:
        >>> atomic_write("plot.png", lambda tmp: fig.savefig(tmp))  # doctest: +SKIP
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(handle)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
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
