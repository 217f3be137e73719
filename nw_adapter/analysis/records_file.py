"""The records file of :meth:`NWRecorder.to_json` / :meth:`NWRecorder.from_json`.

``to_json`` writes ``{"schema": "nw-adapter/records", "schema_version": 1, "config", "records",
"summary", "skipped", "context"}`` (strict JSON: NaN is ``null``; ``context``: what the records do
not say of their run, its bandwidth rule, scheduler class and control kind,
:attr:`~nw_adapter.analysis.records.Records.context`); suggested name ``records.json``. The
command line's report ``rho.json`` (schema ``nw-adapter/rho``) holds the same ``records`` and
is read back the same way. Every record is checked on reading
(:func:`~nw_adapter.analysis.validation.check_records_file`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nw_adapter.analysis.validation import check_records_file
from nw_adapter.atomic import atomic_write_text
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.schema import (
    LEGACY_NAMES,
    OPTIONAL_STATS,
    RECORDS_SCHEMA,
    REPORT_SCHEMA,
    SKIPPED_FIELD,
    STAT_NAMES,
)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_records_file(recorder: Any, path: str | os.PathLike) -> Path:
    """Write :func:`records_document` of ``recorder`` to ``path`` atomically as strict JSON (NaN -> null)."""
    return atomic_write_text(path, json.dumps(records_document(recorder), indent=1, allow_nan=False))


def records_document(recorder: Any) -> dict[str, Any]:
    """The JSON document of ``recorder`` (an :class:`NWRecorder`): options, records, summary, skips."""
    records = recorder.records()
    return {
        "schema": RECORDS_SCHEMA,
        "schema_version": 1,
        "config": recorder.config.to_dict(),
        "records": [{k: _json_safe(v) for k, v in r.items()} for r in records],
        "summary": [{k: _json_safe(v) for k, v in r.items()} for r in records.summary()],
        SKIPPED_FIELD: recorder.skipped(),
        "context": dict(records.context),
    }


@dataclass(frozen=True)
class SavedRecords:
    """What a records file holds: the options (those this version knows), the records (legacy
    names renamed, ``null`` statistics as NaN) and where they came from."""

    config: NWProcessorConfig
    records: list[dict[str, Any]]
    source: dict[str, Any]


def _report_context(document: dict[str, Any]) -> dict[str, Any]:
    """The :attr:`~nw_adapter.analysis.records.Records.context` of a ``rho.json``: its bandwidth
    rule, scheduler class and control kind."""
    config = document.get("config") if isinstance(document.get("config"), dict) else {}
    control = document.get("control") if isinstance(document.get("control"), dict) else {}
    return {
        "bandwidth": config.get("bandwidth"),
        "scheduler": config.get("scheduler_class"),
        "control": control.get("kind"),
    }


def read_records_file(path: str | os.PathLike) -> SavedRecords:
    """Read and check a records file or a ``rho.json``.

    Raises:
        ValueError: unreadable, not one of the two schemas, or a malformed record (one line
            naming the file, the record and the field).
    """
    path = Path(path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"NWRecorder.from_json: cannot read '{path}' ({exc}); pass a records file") from None
    check_records_file(document, source=f"NWRecorder.from_json: '{path}'")
    schema = document.get("schema") if isinstance(document, dict) else None
    if schema not in (RECORDS_SCHEMA, REPORT_SCHEMA) or not isinstance(document.get("records"), list):
        raise ValueError(
            f"NWRecorder.from_json: '{path}' is not an nw-adapter records file (schema {schema!r}); "
            "pass a file written by NWRecorder.to_json or correlate.py's rho.json"
        )
    config = NWProcessorConfig()
    if schema == RECORDS_SCHEMA and isinstance(document.get("config"), dict):
        known = NWProcessorConfig.field_names()  # options of another version are left out
        config = NWProcessorConfig(**{k: v for k, v in document["config"].items() if k in known})
    renamed = ({LEGACY_NAMES.get(k, k): v for k, v in r.items()} for r in document["records"])
    numbers = {*STAT_NAMES, *OPTIONAL_STATS}
    records = [{k: (math.nan if v is None and k in numbers else v) for k, v in r.items()} for r in renamed]
    source = {"path": str(path), "schema": schema, "config": document.get("config")}
    context = document.get("context") if schema == RECORDS_SCHEMA else _report_context(document)
    if isinstance(context, dict):  # what the records do not say of their run (Records.context)
        source["context"] = {k: context.get(k) for k in ("bandwidth", "scheduler", "control")}
    return SavedRecords(config, records, source)
