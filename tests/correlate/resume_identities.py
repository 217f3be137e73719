"""The options a resumed run is matched by, captured from real command-line runs.

A run of ``correlate.py`` reuses finished work only when the fingerprint of its options (the
SHA-256 of a JSON object, :func:`nw_adapter.correlate.sweep.fingerprint`) equals the one saved
with that work. :func:`captured_identities` runs the command line in-process on the tiny models
and records every object it fingerprints; ``data/identities_f073761.json`` holds what the version
at commit f073761 fingerprinted for :data:`CASES` and :data:`CHANGED` (written by running this file
at that commit: ``python tests/correlate/resume_identities.py``), so a test can check that the
current version fingerprints the same objects for :data:`CASES`, i.e. that a run begun by that
version still resumes, and exactly what changed for :data:`CHANGED`.

Machine-specific paths are written as placeholders (:func:`portable`): the repository as
``<repo>``, the tiny-model cache as ``<cache>``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data" / "identities_f073761.json"
DIGITS = REPO / "nw_adapter" / "models" / "weights" / "tiny_digits" / "examples"


def _digit(d: int) -> str:
    return str(DIGITS / f"digit_{d}.png")


CASES: dict[str, list[str]] = {
    "rho-defaults": ["--image", _digit(3), "--model", "tiny", "--steps", "1"],
    "rho-no-control": [
        "--image", _digit(3), "--model", "tiny", "--steps", "1", "--no-untrained-control",
        "--bandwidth", "fitted", "--layers", "up", "--seed", "3", "--prompt", "",
    ],
    "rho-control-options": [
        "--image", _digit(3), "--model", "tiny", "--steps", "1", "--control-draws", "2",
        "--untrained-seed", "5", "--scheduler", "ddim", "--guidance-scale", "3", "--ip-scale", "0.5",
        "--negative-prompt", "blurry", "--height", "32", "--width", "32",
    ],
    "rho-swap-maps": [
        "--image", _digit(3), "--model", "tiny", "--steps", "1", "--mode", "swap", "--bandwidth", "0.5",
        "--store-maps",
    ],
    "end-to-end": [
        "--image", _digit(3), "--model", "tiny", "--steps", "1", "--end-to-end-control",
        "--end-to-end-draws", "2", "--end-to-end-seed", "4", "--no-end-to-end-scale-match",
    ],
    "rho-tiny-flux": [
        "--image", _digit(3), "--model", "tiny-flux", "--steps", "1", "--true-cfg-scale", "2",
        "--negative-prompt", "", "--no-untrained-control",
    ],
    "compare-swap-bundled": [
        "--compare-swap", "--image", _digit(3), "--image", _digit(7), "--model", "tiny", "--steps", "1",
        "--swap-rules", "matched",
    ],
    "compare-swap-labels": [
        "--compare-swap", "--image", _digit(3), "--model", "tiny", "--steps", "1", "--swap-rules", "0.5",
        "--labels", "3", "--seed", "2", "--scheduler", "euler",
    ],
    "rho-tiny-flux-digits": ["--image", _digit(3), "--model", "tiny-flux-digits", "--steps", "1"],
}  # fmt: skip
"""Command lines (``--out`` added per run) covering every option that enters a fingerprint."""

CHANGED: dict[str, list[str]] = {
    "compare-swap-tiny-flux-digits": [
        "--compare-swap", "--image", _digit(3), "--model", "tiny-flux-digits", "--steps", "1",
        "--swap-rules", "matched",
    ],
}  # fmt: skip
"""Command lines whose fingerprinted objects changed since f073761, so a run begun by that version is
computed again (with a note naming what changed): f073761's compare-swap run recorded the shipped
``tiny-flux-digits``' image encoder by its install path (its ``families.shown_spec`` named only the
tiny models built into the cache ``tiny``), where its rho run and this version record ``"tiny"``."""


def _strings_mapped(value: Any, change: Callable[[str], str]) -> Any:
    """``value`` (JSON-like) with ``change`` applied to every string in it."""
    if isinstance(value, dict):
        return {key: _strings_mapped(item, change) for key, item in value.items()}
    if isinstance(value, list):
        return [_strings_mapped(item, change) for item in value]
    return change(value) if isinstance(value, str) else value


def portable(value: Any, cache: Path) -> Any:
    """``value`` with the repository and cache paths in its strings replaced by placeholders."""
    return _strings_mapped(
        value, lambda text: text.replace(str(cache), "<cache>").replace(str(REPO), "<repo>")
    )


def unportable(value: Any, cache: Path) -> Any:
    """The inverse of :func:`portable`: the placeholders back to this machine's paths."""
    return _strings_mapped(
        value, lambda text: text.replace("<cache>", str(cache)).replace("<repo>", str(REPO))
    )


def captured_identities(argv: list[str], out: Path, cache: Path) -> list[dict]:
    """Run ``correlate.py argv --out out`` in-process; every object it fingerprinted, portable."""
    from nw_adapter.correlate import cli, sweep

    captured: list[dict] = []
    original = sweep.fingerprint

    def spy(options: dict) -> str:
        captured.append(json.loads(json.dumps(options, default=str)))
        return original(options)

    sweep.fingerprint = spy
    previous = os.environ.get("NW_ADAPTER_CACHE")
    os.environ["NW_ADAPTER_CACHE"] = str(cache)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            code = cli.main([*argv, "--out", str(out), "-qq"])
    finally:
        sweep.fingerprint = original
        if previous is None:
            os.environ.pop("NW_ADAPTER_CACHE", None)
        else:
            os.environ["NW_ADAPTER_CACHE"] = previous
    if code != 0:
        raise AssertionError(f"{argv}: exit {code}: {err.getvalue()}")
    unique = [json.loads(text) for text in dict.fromkeys(json.dumps(c, sort_keys=True) for c in captured)]
    return [portable(identity, cache) for identity in unique]


def main() -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO))
    found = {}
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder) / "cache"
        for name, argv in {**CASES, **CHANGED}.items():
            found[name] = captured_identities(argv, Path(folder) / name, cache)
            print(name, len(found[name]), file=sys.stderr)
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
