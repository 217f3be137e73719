"""The command line's end-to-end control option, as self-contained functions for ``correlate.py``.

Wiring (in :mod:`nw_adapter.correlate.cli`): :func:`add_end_to_end_arguments` in ``build_parser``;
:func:`end_to_end_error` after parsing, printed as the one-line error of exit status 2;
:func:`end_to_end_meta` as rho.json's ``control`` entry; and in the image worker, instead of the
one observed call, :func:`run_end_to_end` (the trained call observed, then K control calls with
the untrained adapter in every layer; its records carry the ``{X}_control_{k}`` and
``key_scale_{k}`` columns). The cost is K + 1 generations per reference image
(docs/controls_end_to_end.md).

Like the rest of the command line's argument handling, this module imports neither torch nor
diffusers: only :func:`run_end_to_end` imports the integration layer, when it runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_DRAWS",
    "add_end_to_end_arguments",
    "end_to_end_error",
    "end_to_end_meta",
    "run_end_to_end",
]

MAX_DRAWS = 16
"""Most control draws the option accepts (each is one more generation per reference image)."""

MATCHED = (
    "to_k_ip (to_v_ip) rows rescaled per layer and head so the untrained keys (values) have the trained "
    "keys' (values') RMS norm on this call's image embeddings"
)
"""The ``matched`` text of the meta (:data:`nw_adapter.integration.end_to_end.MATCHED`, kept here
without the torch import; a test checks that the two agree)."""


def _draws(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--end-to-end-draws must be a whole number, got '{text}'") from None
    if not 1 <= value <= MAX_DRAWS:
        raise argparse.ArgumentTypeError(f"--end-to-end-draws must be between 1 and {MAX_DRAWS}, got {value}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--end-to-end-seed must be a whole number, got '{text}'") from None
    if not 0 <= value < 2**63 - MAX_DRAWS:
        raise argparse.ArgumentTypeError(
            f"--end-to-end-seed must be between 0 and 2**63 - {MAX_DRAWS + 1}, got {value}"
        )
    return value


def add_end_to_end_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``end-to-end control`` argument group to ``parser``.

    Options: ``--end-to-end-control`` (off by default), ``--end-to-end-draws K`` (default 1),
    ``--end-to-end-seed S`` (draw k uses S + k; default 0) and ``--no-end-to-end-scale-match``.

    Returns:
        ``parser``.
    """
    group = parser.add_argument_group("end-to-end control")
    group.add_argument(
        "--end-to-end-control",
        action="store_true",
        help="generate every reference K more times with the untrained adapter in every layer (same "
        "seed and noise) and record those passes' statistics as {stat}_control_{k} columns; costs K more "
        "generations per image (UNet and Flux)",
    )
    group.add_argument(
        "--end-to-end-draws",
        type=_draws,
        default=1,
        metavar="K",
        help=f"control draws of the end-to-end control, 1 to {MAX_DRAWS} (default 1)",
    )
    group.add_argument(
        "--end-to-end-seed",
        type=_seed,
        default=0,
        metavar="S",
        help="seed of the end-to-end control's draw 0 (draw k: S + k; default 0)",
    )
    group.add_argument(
        "--no-end-to-end-scale-match",
        dest="end_to_end_scale_match",
        action="store_false",
        help="keep the untrained keys and values at their own scale (default: rescaled per layer and "
        "head to the trained RMS norms, so a pure change of scale reads as no effect)",
    )
    return parser


def end_to_end_error(args: argparse.Namespace, family: str) -> str | None:
    """The one-line error for an end-to-end option that cannot run, or None.

    Args:
        args: Parsed arguments (``end_to_end_control``, ``mode``, ``store_maps`` are read).
        family: The model family (``"sd15"``, ``"sdxl"``, ``"sd3"``, ``"flux"``, ...).
    """
    if not getattr(args, "end_to_end_control", False):
        return None
    if family == "sd3":
        return (
            "--end-to-end-control does not support SD 3.5 (its image keys pass a per-head RMSNorm and "
            "change with the timestep, so no weight scale matches them); drop the option and use the "
            "per-layer control"
        )
    if getattr(args, "mode", "observe") != "observe":
        return "--end-to-end-control needs --mode observe (it compares the statistics of two generations)"
    if getattr(args, "store_maps", False):
        return "--end-to-end-control does not combine with --store-maps; run them separately"
    return None


def end_to_end_meta(args: argparse.Namespace) -> dict[str, Any] | None:
    """rho.json's ``control`` entry for the end-to-end control, or None when it is off."""
    if not getattr(args, "end_to_end_control", False):
        return None
    seed, draws = args.end_to_end_seed, args.end_to_end_draws
    return {
        "kind": "end-to-end",
        "draws": draws,
        "seeds": [seed + k for k in range(draws)],
        "matched": MATCHED if args.end_to_end_scale_match else None,
    }


def run_end_to_end(
    args: argparse.Namespace,
    pipe: Any,
    config: Any,
    call_kwargs: Mapping[str, Any],
    *,
    key_set: str | None = "ip",
) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
    """Run one reference's trained call and its end-to-end control passes.

    Args:
        args: Parsed arguments (``end_to_end_draws``, ``end_to_end_seed``,
            ``end_to_end_scale_match``).
        pipe: The loaded pipeline, no NW processors installed.
        config: The run's ``NWProcessorConfig`` (observe).
        call_kwargs: The pipeline call's keyword arguments, ``generator`` included.
        key_set: Keep the records of this key set (None: all).

    Returns:
        ``(trained pipeline output, records with the control columns, control meta)``.

    Raises:
        NWConfigError / NWInstallError: from
            :func:`~nw_adapter.integration.end_to_end.end_to_end_control` (``ValueError``s).
    """
    from nw_adapter.integration.end_to_end import end_to_end_control

    result = end_to_end_control(
        pipe,
        call_kwargs,
        draws=args.end_to_end_draws,
        seed=args.end_to_end_seed,
        scale_match=args.end_to_end_scale_match,
        recorder_config=config,
    )
    records = [r for r in result.records if key_set is None or r.get("key_set", "ip") == key_set]
    return result.trained_output, records, result.control
