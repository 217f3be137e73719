"""The one time limit of every child process a test starts, and the runner of the project's scripts.

A limit on a child process exists only to stop a test that hangs; it measures no speed (speed
is measured in benchmarks/, as ratios or counts). On a 2-core machine shared with other jobs
(load average 10) a child that takes 20 s of CPU on idle cores can take several minutes of
wall time, so the limit is generous. ``NW_ADAPTER_TEST_TIMEOUT`` (seconds) overrides it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


REPOSITORY_ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, *arguments: str) -> subprocess.CompletedProcess:
    """Run ``python scripts/<script> <arguments>`` from the repository root, as a user would.

    Returns:
        The finished process, its stdout and stderr captured as text; the call fails with
        ``subprocess.TimeoutExpired`` after :data:`SUBPROCESS_TIMEOUT_S`.
    """
    return subprocess.run(
        [sys.executable, str(REPOSITORY_ROOT / "scripts" / script), *arguments],
        capture_output=True,
        text=True,
        cwd=REPOSITORY_ROOT,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
