"""The nulls' random numbers: defined once, in :mod:`nw_adapter.core.specification` (re-exported)."""

from __future__ import annotations

from nw_adapter.core.specification import NullDraws, draw_nulls

__all__ = ["NullDraws", "draw_nulls"]
