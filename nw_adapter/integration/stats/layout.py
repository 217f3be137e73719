"""Named columns and the kinds of producer of the fast path (pure Python, no torch).

The fast path (:mod:`.fast`) keeps its intermediate results in a few stacked tensors whose
last axis is a list of named columns (:class:`Columns`). Every statistic of
:data:`~nw_adapter.core.specification.STAT_NAMES` has exactly one producer, one of:

- :class:`RowMean`: the mean over query rows of a linear combination of per-row features
  (one matrix product computes all of them at once);
- :class:`RankPool`: rho or one of its nulls, pooled over the query rows of one segment of
  the rank pass (observed rows or one null);
- :class:`PerHead`: a function of the per-(batch row, head) values (other columns, key norms);
- :class:`Bandwidth`: the bandwidth h itself;
- :class:`Reading`: one reading of the readings pass (:mod:`.readings`), per (batch row, head),
  NaN when the readings are off.

The fast path derives its column layout, its row-mean matrix and its final gains and offsets
from that table, so a column is never addressed by a hand-written number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from nw_adapter.core.specification import fit_row_indices

__all__ = ["Bandwidth", "Columns", "PerHead", "Producer", "RankPool", "Reading", "RowMean", "fit_row_indices"]


class Columns:
    """A fixed, ordered list of column names of one tensor axis, addressed by name.

    Example:
        >>> cols = Columns(["a", "b", "c", "d"])
        >>> cols["c"], cols.slice("a", "c"), cols.slice("b", "c", "d")
        (2, slice(0, 3, 2), slice(1, 4, 1))
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.names: tuple[str, ...] = tuple(names)
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"duplicate column names in {self.names}")
        self._index = {name: i for i, name in enumerate(self.names)}

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __getitem__(self, name: str) -> int:
        """The position of column ``name`` (KeyError naming the known columns otherwise)."""
        if name not in self._index:
            raise KeyError(f"no column {name!r}; the columns are {self.names}")
        return self._index[name]

    def slice(self, *names: str) -> slice:
        """The slice that selects ``names``, in that order: equally spaced, ascending columns."""
        positions = [self[name] for name in names]
        step = positions[1] - positions[0] if len(positions) > 1 else 1
        if step <= 0 or any(b - a != step for a, b in zip(positions, positions[1:], strict=False)):
            raise ValueError(f"columns {names} are not equally spaced and ascending in {self.names}")
        return slice(positions[0], positions[-1] + 1, step)


@dataclass(frozen=True)
class RowMean:
    """``offset + mean over query rows of sum_f terms[f] * feature_f`` (per-row feature names)."""

    terms: dict[str, float]
    offset: float = 0.0


@dataclass(frozen=True)
class RankPool:
    """rho over the query rows of one segment of the rank pass, pooled per CFG half."""

    segment: str


@dataclass(frozen=True)
class PerHead:
    """``offset + gain * value`` (times the softmax scale s when ``scaled``), where
    ``write(writer, out, head, keys)`` writes the value into ``out``."""

    write: Callable[..., Any]
    gain: float = 1.0
    offset: float = 0.0
    scaled: bool = False


@dataclass(frozen=True)
class Bandwidth:
    """The bandwidth h: a column written from a tensor h, or the offset of a float h."""


@dataclass(frozen=True)
class Reading:
    """A reading of the readings pass (:mod:`.readings`); ``constant``: the value is the same for
    every head of a call (the number of fit rows), written as the column's offset."""

    constant: bool = False


Producer = RowMean | RankPool | PerHead | Bandwidth | Reading
