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

Wiring: the options ``--calibrate`` and ``--calibrate-c`` are rows of
:mod:`nw_adapter.correlate.option_table` (read by the rho run only; its refusals, with
``--mode swap`` and ``--store-maps`` too, come from the table); :func:`calibrate_meta` is rho.json's
``config["calibration"]`` (fingerprinted: a resumed run never mixes calibrated and uncalibrated
images; left out when off, so earlier runs' fingerprints hold); the rho run's image worker
(:mod:`nw_adapter.correlate.rho_cli`) calls :func:`run_calibrated` instead of the one observed call.

Like the rest of the command line's argument handling, this module imports neither torch nor
diffusers: only :func:`run_calibrated` imports the integration layer, when it runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

__all__ = ["calibrate_meta", "run_calibrated"]


def calibrate_meta(args: argparse.Namespace) -> dict[str, Any] | None:
    """rho.json's ``config["calibration"]`` entry, or None when ``--calibrate`` is off."""
    if not getattr(args, "calibrate", False):
        return None
    c = args.calibrate_c if args.calibrate_c is not None else 1.0
    return {"kind": "exact NW head", "mode": "swap", "bandwidth": "schedule", "schedule_c": c}


def run_calibrated(args: argparse.Namespace, pipe: Any, config: Any, call_kwargs: Mapping[str, Any]) -> Any:
    """Run one reference's observed call and its exact-head pass.

    Args:
        args: Parsed arguments (``calibrate_c``).
        pipe: The loaded pipeline, no NW processors installed.
        config: The run's ``NWProcessorConfig`` (observe).
        call_kwargs: The pipeline call's keyword arguments, ``generator`` included.

    Returns:
        The :class:`~nw_adapter.integration.calibration.CalibratedCall`: the adapter's output, its
        pass's recorder, its records of every key set with the exact head's columns.

    Raises:
        NWConfigError / NWInstallError: from :func:`~nw_adapter.integration.calibration.observe_call`.
    """
    from nw_adapter.integration.calibration import observe_call

    c = args.calibrate_c if args.calibrate_c is not None else 1.0
    return observe_call(pipe, call_kwargs, config=config, calibrate=True, schedule_c=c)
