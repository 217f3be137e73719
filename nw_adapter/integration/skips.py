"""The ledger of skipped (call, step, layer) pairs: observe mode's failures, counted, never silent.

A side computation that raises never fails the generation: the layer keeps its output
(diffusers' in observe mode, the NW head's in swap), the recorder rolls back what the layer
stored and the pair goes into this ledger (one warning per recorder, then counted silently;
exported as ``skipped`` by ``NWRecorder.to_json``).
"""

from __future__ import annotations

import warnings
from typing import Any

from nw_adapter.integration.schema import SKIPPED_FIELD


class SkipLedger:
    """The skipped pairs of one recorder, in the order they happened."""

    def __init__(self) -> None:
        self._pairs: list[tuple[int, int, str, str]] = []  # (call, step, layer, reason)
        self._warned = False

    def add(self, *, call: int, step: int, layer: str, error: BaseException, swap: bool = False) -> None:
        """Count one pair; the first one of the ledger warns (RuntimeWarning) with its reason.

        ``swap``: the layer ran the NW head (swap mode), so its output is the NW head's, not
        diffusers' (the warning says which)."""
        reason = f"{type(error).__name__}: {error}"[:300]
        self._pairs.append((call, step, layer, reason))
        if not self._warned:
            self._warned = True
            output = "kept the NW head's output" if swap else "kept diffusers' output"
            warnings.warn(
                f"NWRecorder: the NW side computation failed in layer {layer!r} at step "
                f"{step} ({reason}); that layer {output} and its statistics "
                "were skipped. Further failures are counted silently: see recorder.skipped() and "
                f"the {SKIPPED_FIELD!r} field of to_json().",
                RuntimeWarning,
                stacklevel=4,
            )

    def summary(self) -> dict[str, Any]:
        """``{"count", "by_reason", "pairs"}``: ``by_reason`` maps each failure message to its number
        of pairs; ``pairs`` lists ``{"call", "step", "layer", "reason"}`` in the order they happened."""
        by_reason: dict[str, int] = {}
        for *_, reason in self._pairs:
            by_reason[reason] = by_reason.get(reason, 0) + 1
        pairs = [{"call": c, "step": s, "layer": layer, "reason": r} for c, s, layer, r in self._pairs]
        return {"count": len(self._pairs), "by_reason": by_reason, "pairs": pairs}

    def clear(self) -> None:
        """Forget every pair (the one warning stays given)."""
        self._pairs.clear()
