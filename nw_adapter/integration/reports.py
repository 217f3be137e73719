"""The recorder's reports: ``rec.summary()``, ``rec.plot()``, ``rec.to_json(...)`` ... (the facade).

:class:`RecorderReports` is the base class of :class:`~nw_adapter.integration.recorder.NWRecorder`
that holds its user-facing report methods. Each is thin: it imports its function of the analysis
layer (:mod:`nw_adapter.analysis`) inside the method, when called, so that importing the
integration (the recorder, the processors) loads neither the reporting layer nor matplotlib. That
in-method import is the one upward edge the layering allows (``FACADE`` in
``tests/test_layering.py``: from this module only, inside a function only). The recorder itself
(:mod:`~nw_adapter.integration.recorder`) records and imports nothing of the analysis layer.

The methods read only what the recorder records: :meth:`to_records`, ``config``,
``loaded_records``, :meth:`failed_steps_line` and the stored maps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["RecorderReports"]


_Recorder = TypeVar("_Recorder", bound="RecorderReports")


class RecorderReports:
    """The report methods of :class:`~nw_adapter.integration.recorder.NWRecorder` (a base class:
    use them on a recorder)."""

    def records(self, key_set: str | None = "ip") -> list[dict[str, Any]]:
        """:meth:`to_records` as :class:`~nw_adapter.analysis.records.Records` (summary, CSV, plot);
        see :func:`~nw_adapter.analysis.records.recorder_records`."""
        from nw_adapter.analysis.records import recorder_records

        return recorder_records(self, key_set)

    def summary(self, records: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """One dict per (call, step, half): NaN-ignoring means over layers, heads, adapters, images.

        See :meth:`~nw_adapter.analysis.records.Records.summary` (``nonfinite`` counts the
        values each mean left out, ``nan_reasons`` the NaN h_eff values per reason;
        ``frac_rho_gt_0_9`` and ``count`` as in the command line's report).
        Of the recorder's own records, ``error`` holds :meth:`failed_steps_line` (steps whose side
        computation failed in every layer), printed above the table.
        """
        from nw_adapter.analysis.records import recorder_summary

        return recorder_summary(self, records)

    def to_csv(self, path: str | os.PathLike) -> Path:
        """Write the records as a CSV table (one row per record, header = record keys), atomically."""
        return self.records().to_csv(path)

    def to_dataframe(self):
        """The records as a tidy :class:`pandas.DataFrame` (one row per record, columns = keys)."""
        return self.records().to_dataframe()

    def plot(self, *, half: str | None = None, path: str | os.PathLike | None = None):
        """Figure of the mean rho per step against the timestep, with the band of its nulls.

        Args:
            half: CFG half to draw (default ``cond`` if recorded, else ``all``).
            path: Also save the figure there (PNG, atomically).
        """
        return self.records().plot(half=half, path=path)

    def to_json(self, path: str | os.PathLike) -> Path:
        """Write the records file atomically (NaN -> null); read it back with :meth:`from_json`
        (the layout: :func:`~nw_adapter.analysis.records_file.records_document`)."""
        from nw_adapter.analysis.records_file import write_records_file

        return write_records_file(self, path)

    @classmethod
    def from_json(cls: type[_Recorder], path: str | os.PathLike) -> _Recorder:
        """A recorder holding the records of a saved run (a :meth:`to_json` file or the command
        line's ``rho.json``), for summaries, tables and plots. Nothing is recomputed; the loaded
        recorder has no maps and records nothing new until it is attached to a pipeline.

        Raises:
            ValueError: not a records file or a ``rho.json``, or a malformed record (one line
                naming the file, the record and the field).
        """
        from nw_adapter.analysis.records_file import read_records_file

        saved = read_records_file(path)
        recorder = cls(saved.config)
        recorder._loaded = saved.records
        recorder.source = saved.source
        return recorder

    def heat_maps(self, kind: str = "attn", **selection: Any):
        """Heat maps per image token of the stored maps, in memory (needs ``store_maps=True``).

        ``kind``: ``"attn"`` (A), ``"nw"`` (W) or ``"diff"`` (A - W); ``selection``: ``steps``,
        ``layers``, ``heads``, ``batch_row``, ``adapter``, ``image``, ``image_hw`` (see
        :func:`~nw_adapter.analysis.heatmaps.heat_maps`). Returns a
        :class:`~nw_adapter.analysis.heatmaps.TokenHeatMaps`; ``.plot_overlay(image)`` draws it.
        """
        from nw_adapter.analysis.heatmaps import heat_maps

        return heat_maps(self, kind, **selection)
