"""The one time limit of every child process a test starts.

A limit on a child process exists only to stop a test that hangs; it measures no speed (speed
is measured in benchmarks/, as ratios or counts). On a 2-core machine shared with other jobs
(load average 10) a child that takes 20 s of CPU on idle cores can take several minutes of
wall time, so the limit is generous. ``NW_ADAPTER_TEST_TIMEOUT`` (seconds) overrides it.
"""

from __future__ import annotations

import os

DEFAULT_SUBPROCESS_TIMEOUT_S = 1200.0
TIMEOUT_VARIABLE = "NW_ADAPTER_TEST_TIMEOUT"


def subprocess_timeout() -> float:
    """Seconds a test waits for a child process: ``$NW_ADAPTER_TEST_TIMEOUT``, else 1200.

    Raises:
        ValueError: the variable is set but is not a positive number of seconds.
    """
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_SUBPROCESS_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{TIMEOUT_VARIABLE}={text!r} must be a positive number of seconds, e.g. 1200")
    return seconds


SUBPROCESS_TIMEOUT_S = subprocess_timeout()
