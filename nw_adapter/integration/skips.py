"""The ledger of skipped (call, step, layer) pairs: observe mode's failures, counted, never silent.

A side computation that raises never fails the generation: the layer keeps its output
(diffusers' in observe mode, the NW head's in swap), the recorder rolls back what the layer
stored and the pair goes into this ledger (one warning per recorder, then counted silently;
exported as ``skipped`` by ``NWRecorder.to_json``). A step whose side computation failed in
every layer that ran it has no statistics at all: :meth:`SkipLedger.failed_steps` names those
steps and :func:`failed_steps_line` says so in one line (``NWRecorder.summary()`` prints it above
the table, the command line as an error).
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

    def failed_steps(self, recorded: set[tuple[int, int]]) -> list[dict[str, Any]]:
        """The (call, step) pairs with skipped layers and no recorded one: the side computation
        failed in every layer of the step. ``recorded``: the (call, step) pairs with statistics.

        Returns:
            ``{"call", "step", "layers", "reason"}`` per failed step, in order (``layers``: the
            number of failed layers; ``reason``: the first failure's message).
        """
        failed: dict[tuple[int, int], dict[str, Any]] = {}
        for call, step, _, reason in self._pairs:
            if (call, step) in recorded:
                continue
            first = {"call": call, "step": step, "layers": 0, "reason": reason}
            failed.setdefault((call, step), first)["layers"] += 1
        return list(failed.values())

    def clear(self) -> None:
        """Forget every pair (the one warning stays given)."""
        self._pairs.clear()


def failed_steps_line(failed: list[dict[str, Any]], *, see: str | None = "recorder.skipped()") -> str | None:
    """One line on the steps whose side computation failed in every layer, or None when none did.

    Example: ``the NW side computation failed in every layer of 2 step(s) (call 0: steps 0, 1;
    ValueError: ...): those steps have no statistics; see recorder.skipped()`` (``see``: where the
    pairs are listed; None: no pointer).
    """
    if not failed:
        return None
    by_call: dict[int, list[int]] = {}
    for entry in failed:
        by_call.setdefault(entry["call"], []).append(entry["step"])
    where = "; ".join(f"call {call}: steps {', '.join(map(str, steps))}" for call, steps in by_call.items())
    reasons = sorted({entry["reason"] for entry in failed})
    reason = reasons[0] if len(reasons) == 1 else f"{reasons[0]} and {len(reasons) - 1} other reason(s)"
    return (
        f"the NW side computation failed in every layer of {len(failed)} step(s) ({where}; {reason}): "
        "those steps have no statistics" + (f"; see {see}" if see else "")
    )
