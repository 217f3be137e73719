"""The command line's refusals as the tests check them: one line, exit 2, no traceback."""

from __future__ import annotations


def one_line_error(code: int, err: str, *words: str, after_progress: bool = False) -> str:
    """The one line of a refused ``correlate.py`` run: exit 2, one non-blank line on stderr starting
    ``correlate.py: error: `` and holding every one of ``words``, no traceback; returns it.

    ``after_progress``: the plain progress lines of references finished before the error (stderr is
    no terminal in a test) are not counted.
    """
    lines = [line for line in err.splitlines() if line.strip()]
    if after_progress:
        lines = [line for line in lines if not line.startswith("progress: ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("correlate.py: error: "), err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]
