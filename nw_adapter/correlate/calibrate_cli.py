"""The command line's ``--calibrate`` option, as self-contained functions for ``correlate.py``.

``--calibrate`` generates every reference a second time with the exact NW head at the schedule's
bandwidth ``h = c sigma_t / alpha_t`` swapped into every recorded layer (same seed, prompt and
noise) and records it as the verdict's measured anchor: the verdict places the trained adapter
between the control (the same algebra, no learning) and the exact head (the theory), judges the
exact head itself (the instrument must recognise it), and prints the calibrated table (adapter,
exact head and control side by side, one row per reading); ``rho.json`` / ``rho.csv`` carry the
exact head's columns ``{stat}_exact`` and the figures its measured line
(:mod:`nw_adapter.integration.calibration`, docs/verdict.md). It costs one more generation per
reference (the measured ratio is in docs/verdict.md).

Wiring (in :mod:`nw_adapter.correlate.cli`): :func:`add_calibrate_arguments` in ``build_parser``;
:func:`calibrate_error` after parsing, printed as the one-line error of exit status 2;
:func:`calibrate_meta` as rho.json's ``config["calibration"]`` (fingerprinted: a resumed run never
mixes calibrated and uncalibrated images); and in the image worker, instead of the one observed
call, :func:`run_calibrated`.

Like the rest of the command line's argument handling, this module imports neither torch nor
diffusers: only :func:`run_calibrated` imports the integration layer, when it runs.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["add_calibrate_arguments", "calibrate_error", "calibrate_meta", "run_calibrated"]


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--calibrate-c must be a number, got '{text}'") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"--calibrate-c must be a finite number > 0, got {text}")
    return value


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``calibration`` argument group: ``--calibrate`` (off by default) and
    ``--calibrate-c C`` (the exact head's ``h = C sigma_t / alpha_t``, default 1).

    Returns:
        ``parser``.
    """
    group = parser.add_argument_group("calibration")
    group.add_argument(
        "--calibrate",
        action="store_true",
        help="generate every reference again with the exact NW head at the schedule's h swapped in (same "
        "seed and noise) and measure it as the verdict's anchor beside the adapter and the control: "
        "the calibrated table, the exact head's own verdict, its line in bandwidth.png (one more "
        "generation per image)",
    )
    group.add_argument(
        "--calibrate-c",
        type=_positive,
        default=None,
        metavar="C",
        help="the exact head's bandwidth h = C sigma_t / alpha_t (default 1; needs --calibrate)",
    )
    return parser


def calibrate_error(args: argparse.Namespace) -> str | None:
    """The one-line error for a calibration option that cannot run, or None.

    Refused: ``--calibrate-c`` without ``--calibrate``; ``--calibrate`` with ``--mode swap`` (the
    second pass swaps the exact head in itself), with ``--end-to-end-control`` or ``--store-maps``
    (they run or keep other passes: run them separately), and with a run that does not generate
    the rho run's references (``--compare-swap``, ``--support-set`` / ``--support-dir``,
    ``--replot``).
    """
    if not getattr(args, "calibrate", False):
        if getattr(args, "calibrate_c", None) is not None:
            return "--calibrate-c sets the exact head's bandwidth of --calibrate; add --calibrate or drop it"
        return None
    others = (
        ("compare_swap", "--compare-swap"),
        ("support_set", "--support-set"),
        ("support_dir", "--support-dir"),
        ("replot", "--replot"),
    )
    for dest, option in others:
        value = getattr(args, dest, None)
        if value not in (None, False, [], ()):
            return f"--calibrate applies to the rho run (--image / --image-dir); drop it or drop {option}"
    if getattr(args, "mode", "observe") != "observe":
        return (
            "--calibrate needs --mode observe: its second pass swaps the exact NW head in itself; drop "
            "--mode swap"
        )
    if getattr(args, "end_to_end_control", False):
        return "--calibrate does not combine with --end-to-end-control (both add passes); run them separately"
    if getattr(args, "store_maps", False):
        return "--calibrate does not combine with --store-maps; run them separately"
    return None


def calibrate_meta(args: argparse.Namespace) -> dict[str, Any] | None:
    """rho.json's ``config["calibration"]`` entry, or None when ``--calibrate`` is off."""
    if not getattr(args, "calibrate", False):
        return None
    c = args.calibrate_c if args.calibrate_c is not None else 1.0
    return {"kind": "exact NW head", "mode": "swap", "bandwidth": "schedule", "schedule_c": c}


def run_calibrated(
    args: argparse.Namespace,
    pipe: Any,
    config: Any,
    call_kwargs: Mapping[str, Any],
    *,
    key_set: str | None = "ip",
) -> tuple[Any, list[dict[str, Any]]]:
    """Run one reference's observed call and its exact-head pass.

    Args:
        args: Parsed arguments (``calibrate_c``).
        pipe: The loaded pipeline, no NW processors installed.
        config: The run's ``NWProcessorConfig`` (observe).
        call_kwargs: The pipeline call's keyword arguments, ``generator`` included.
        key_set: Keep the records of this key set (None: all).

    Returns:
        ``(the adapter's pipeline output, its records with the exact head's columns)``.

    Raises:
        NWConfigError / NWInstallError: from :func:`~nw_adapter.integration.calibration.observe_call`.
    """
    from nw_adapter.integration.calibration import observe_call

    c = args.calibrate_c if args.calibrate_c is not None else 1.0
    result = observe_call(pipe, call_kwargs, config=config, calibrate=True, schedule_c=c)
    records = [r for r in result.records if key_set is None or r.get("key_set", "ip") == key_set]
    return result.output, records
