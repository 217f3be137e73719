"""The end-to-end control run of ``correlate.py`` (``--end-to-end-control``): its record and its calls.

Its options (``--end-to-end-control``, ``--end-to-end-draws``, ``--end-to-end-seed``,
``--no-end-to-end-scale-match``) and what it refuses (SD 3.5, ``--mode``, ``--store-maps``, the
per-layer control's options) are rows of the option and run tables
(:mod:`nw_adapter.correlate.options`). Here: :func:`end_to_end_meta`, rho.json's ``control``
entry; and, in the rho run's image worker instead of the one observed call,
:func:`run_end_to_end` (the trained call observed, then K control calls with the untrained
adapter in every layer; its records carry the ``{X}_control_{k}`` and ``key_scale_{k}``
columns). The cost is K + 1 generations per reference image (docs/controls_end_to_end.md).

Like the rest of the command line's argument handling, this module imports neither torch nor
diffusers: only :func:`run_end_to_end` imports the integration layer, when it runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

__all__ = ["MATCHED", "MAX_DRAWS", "end_to_end_meta", "run_end_to_end"]

MAX_DRAWS = 16
"""Most control draws the option accepts (each is one more generation per reference image)."""

MATCHED = (
    "to_k_ip (to_v_ip) rows rescaled per layer and head so the untrained keys (values) have the trained "
    "keys' (values') RMS norm on this call's image embeddings"
)
"""The ``matched`` text of the meta (:data:`nw_adapter.integration.end_to_end.MATCHED`, kept here
without the torch import; a test checks that the two agree)."""


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


def run_end_to_end(args: argparse.Namespace, pipe: Any, config: Any, call_kwargs: Mapping[str, Any]) -> Any:
    """Run one reference's trained call and its end-to-end control passes.

    Args:
        args: Parsed arguments (``end_to_end_draws``, ``end_to_end_seed``,
            ``end_to_end_scale_match``).
        pipe: The loaded pipeline, no NW processors installed.
        config: The run's ``NWProcessorConfig`` (observe).
        call_kwargs: The pipeline call's keyword arguments, ``generator`` included.

    Returns:
        The :class:`~nw_adapter.integration.end_to_end.EndToEndResult`: the trained output, its
        pass's recorder, its records of every key set with the control columns, the control meta.

    Raises:
        NWConfigError / NWInstallError: from
            :func:`~nw_adapter.integration.end_to_end.end_to_end_control` (``ValueError``s).
    """
    from nw_adapter.integration.end_to_end import end_to_end_control

    return end_to_end_control(
        pipe,
        call_kwargs,
        draws=args.end_to_end_draws,
        seed=args.end_to_end_seed,
        scale_match=args.end_to_end_scale_match,
        recorder_config=config,
    )
