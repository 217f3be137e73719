"""Checks of the record files nw-adapter reads back, record by record and field by field.

Pure functions over parsed JSON (dicts, lists, numbers, text, null; no torch). Each check
returns the document it was given, unchanged, or raises :class:`RecordError` whose message is
one line: the file, the record (``records[12]``, ``images[0]``), the field, what was found,
and the fix. Readers call them before using anything, so a malformed file is refused whole,
never half-read:

- :func:`check_records_file`: what :meth:`NWRecorder.from_json
  <nw_adapter.integration.recorder.NWRecorder.from_json>` reads (a ``records.json`` of
  ``NWRecorder.to_json`` or the command line's ``rho.json``);
- :func:`check_report`: a ``rho.json`` that ``correlate.py --replot`` redraws;
- :func:`check_image_result`: one image's ``result.json`` of a sweep (a malformed one is
  recomputed by the command line, with the message as the reason).

What a record may hold (:data:`FIELD_KINDS`): whole numbers >= 0 for the indices, a number or
null (NaN and infinities are written as null) for the noise level, scale and statistics, text
for names, a known value for ``half`` and ``key_set``. A field of another version (not in the
table) is kept if its value is a number, text, true/false or null; nested lists or objects
are refused everywhere in a record, since no record field has them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

from nw_adapter.integration.schema import (
    KEY_SETS,
    LEGACY_NAMES,
    OPTIONAL_STATS,
    RECORDS_SCHEMA,
    REPORT_SCHEMA,
    REPORT_SCHEMA_VERSION,
    RUN_KEYS,
    STAT_NAMES,
    is_control_column,
)

__all__ = [
    "RECORDS_SCHEMA",
    "REPORT_SCHEMA",
    "REPORT_SCHEMA_VERSION",
    "FIELD_KINDS",
    "HALVES",
    "RecordError",
    "check_image_result",
    "check_record",
    "check_records",
    "check_records_file",
    "check_report",
]


HALVES: tuple[str, ...] = ("cond", "uncond", "all", "perturbed")
"""Values of a record's ``half`` (docs/rho_json_schema.md)."""

FIELD_KINDS: dict[str, str] = {
    "reference": "text",
    "call": "index",
    "step": "index",
    "timestep": "number",
    "alpha": "number",
    "sigma": "number",
    "h_schedule": "number",
    "layer": "text",
    "block": "text",
    "head": "index",
    "half": "half",
    "adapter": "index",
    "image": "index",
    "scale": "number",
    "num_keys": "index",
    "key_set": "key_set",
    **{name: "text" for name in RUN_KEYS},
    **{name: "number" for name in (*STAT_NAMES, *OPTIONAL_STATS, *LEGACY_NAMES)},
}
"""Kind of every known record field: ``index`` (whole number >= 0), ``number`` (a number or null),
``text`` (non-empty text), ``half`` (one of :data:`HALVES`), ``key_set`` (one of ``KEY_SETS``).
The scale-matched control's columns (``{X}_control_{k}``, ``key_scale_{k}``; their number follows
the draws) are numbers too (:func:`~nw_adapter.integration.schema.is_control_column`); the old
control's ``*_untrained`` columns of earlier files are among :data:`OPTIONAL_STATS`."""

RECORDS_FILE_FIELDS: tuple[str, ...] = ("call", "step", "half", "rho")
"""Fields every record of a file for ``NWRecorder.from_json`` must have (its summary groups by
(call, step, half) and counts rho)."""

REPORT_FIELDS: tuple[str, ...] = ("reference", "call", "step", "timestep", "layer", "block", "head", "half")
"""Fields every record of a ``rho.json`` must have (the report groups by step and block, per
reference image, and places steps by timestep)."""

_EXPECTED = {
    "index": "a whole number >= 0",
    "number": "a number or null",
    "text": "non-empty text",
    "half": f"one of {', '.join(HALVES)}",
    "key_set": f"one of {', '.join(KEY_SETS)}",
}

_SCALARS = (str, int, float, bool, type(None))


class RecordError(ValueError):
    """A file read back is malformed; the message is one line naming the file, record and field."""


def _shown(value: Any) -> str:
    """A short description of a JSON value for a message: ``'abc' (text)``, ``null``, ``a list``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    kind = "text" if isinstance(value, str) else "number"
    return f"{text} ({kind})"


def _name(name: Any) -> str:
    """A field name from a file as it is safe to print on one line (``repr`` when it is not plain)."""
    text = str(name)
    if text.isprintable() and len(text) <= 40:
        return text
    return repr(text)[:40]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _kind_ok(kind: str, value: Any) -> bool:
    if kind == "index":
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if kind == "number":
        return value is None or _is_number(value)
    if kind == "text":
        return isinstance(value, str) and bool(value)
    if kind == "half":
        return value in HALVES
    if kind == "key_set":
        return value in KEY_SETS
    raise ValueError(f"unknown field kind {kind!r}")


def _wrong(name: str, kind: str, value: Any) -> str:
    return f"field '{name}' must be {_EXPECTED[kind]}, got {_shown(value)}"


def _nested(name: str, value: Any) -> str:
    return f"field '{_name(name)}' holds {_shown(value)}, but fields hold a number, text, true/false or null"


def _fail(source: str, where: str, problem: str, fix: str) -> RecordError:
    return RecordError(f"{source}: {where}: {problem}" + (f"; {fix}" if fix else ""))


def check_record(
    record: Any,
    where: str,
    *,
    source: str,
    fix: str,
    required: Collection[str] = (),
    finite: Collection[str] = (),
) -> dict:
    """Check one record: a JSON object whose fields have the kinds of :data:`FIELD_KINDS`.

    Args:
        record: The parsed record.
        where: Its place in the file, e.g. ``"records[3]"``.
        source: The file, as the message should name it.
        fix: What the user should do (the end of the message).
        required: Fields that must be present.
        finite: Fields that must be finite numbers (not null).

    Returns:
        ``record``.

    Raises:
        RecordError: The first problem, in one line.
    """
    if not isinstance(record, Mapping):
        raise _fail(source, where, f"is {_shown(record)}, not an object of record fields", fix)
    for name in required:
        if name not in record:
            raise _fail(source, where, f"field '{name}' is missing", fix)
    for name, value in record.items():
        if not isinstance(name, str):  # not from JSON, but a caller's dict
            raise _fail(source, where, f"field name {_name(repr(name))} is not text", fix)
        kind = FIELD_KINDS.get(name) or ("number" if is_control_column(name) else None)
        if kind is None:
            if not isinstance(value, _SCALARS):
                raise _fail(source, where, _nested(name, value), fix)
            continue
        if not _kind_ok(kind, value):
            raise _fail(source, where, _wrong(name, kind, value), fix)
        if name in finite and not (_is_number(value) and math.isfinite(value)):
            raise _fail(source, where, f"field '{name}' must be a finite number, got {_shown(value)}", fix)
    return record


def check_records(
    records: Any,
    *,
    source: str,
    fix: str,
    required: Collection[str] = (),
    finite: Collection[str] = (),
    allow_empty: bool = True,
) -> list:
    """Check a ``records`` list entry by entry (see :func:`check_record`).

    Raises:
        RecordError: ``records`` is not a list (or is empty when ``allow_empty`` is false), or
            the first malformed record.
    """
    if not isinstance(records, list):
        raise _fail(source, "records", f"is {_shown(records)}, not a list of records", fix)
    if not records and not allow_empty:
        raise _fail(source, "records", "is empty (the run recorded nothing)", fix)
    for index, record in enumerate(records):
        check_record(record, f"records[{index}]", source=source, fix=fix, required=required, finite=finite)
    return records


def _check_object(document: Any, source: str, what: str, fix: str) -> Mapping:
    if not isinstance(document, Mapping):
        raise RecordError(
            f"{source}: is not {what} (it holds {_shown(document)})" + (f"; {fix}" if fix else "")
        )
    return document


def check_records_file(document: Any, *, source: str) -> Mapping:
    """Check what ``NWRecorder.from_json`` reads: the schema, ``config`` and every record.

    A ``records.json`` (schema ``nw-adapter/records``) must have a ``config`` object of
    :class:`~nw_adapter.integration.config.NWProcessorConfig` options (options of another version
    are left out) that the config accepts; a ``rho.json`` (schema ``nw-adapter/rho``) is read for
    its records only. Every record needs :data:`RECORDS_FILE_FIELDS`.

    Raises:
        RecordError: The first problem, in one line.
    """
    fix = "pass a file written by NWRecorder.to_json or correlate.py's rho.json"
    document = _check_object(document, source, "an nw-adapter records file", fix)
    schema = document.get("schema")
    if schema not in (RECORDS_SCHEMA, REPORT_SCHEMA):
        raise RecordError(f"{source}: is not an nw-adapter records file (schema {schema!r}); {fix}")
    if schema == RECORDS_SCHEMA:
        config = document.get("config")
        if not isinstance(config, Mapping):
            problem = f"is {_shown(config)}, not an object of NWProcessorConfig options"
            raise _fail(source, "config", problem, fix)
        from nw_adapter.integration.config import NWProcessorConfig

        known = NWProcessorConfig.field_names()
        try:
            NWProcessorConfig(**{k: v for k, v in config.items() if k in known})
        except (TypeError, ValueError) as exc:
            raise _fail(source, "config", " ".join(str(exc).split()).rstrip("."), fix) from None
    rewrite = "rewrite the file with NWRecorder.to_json (or rerun correlate.py)"
    check_records(document.get("records"), source=source, fix=rewrite, required=RECORDS_FILE_FIELDS)
    return document


def _relative_inside(path: str) -> bool:
    """Whether ``path`` is relative and stays inside the folder it is relative to."""
    for flavour in (PurePosixPath, PureWindowsPath):
        pure = flavour(path)
        if pure.is_absolute() or pure.anchor or ".." in pure.parts:
            return False
    return bool(path)


IMAGE_FIELDS: dict[str, str] = {
    "key": "text",
    "path": "text",
    "sha256": "text",
    "mode": "text",
    "width": "index",
    "height": "index",
    "duplicates": "index",
    "generated": "file",
    "maps": "file",
    "attention_maps": "file",
    "joint_records": "file",
}
"""Fields of a report's ``images[]`` entry: ``file`` is a path relative to ``--out`` that stays
inside it; ``notes`` (a list of text) is checked apart."""


def check_image_entry(entry: Any, where: str, *, source: str, fix: str) -> Mapping:
    """Check one ``images[]`` entry (its ``key`` is required; see :data:`IMAGE_FIELDS`).

    Raises:
        RecordError: The first problem, in one line.
    """
    if not isinstance(entry, Mapping):
        raise _fail(source, where, f"is {_shown(entry)}, not an object describing an image", fix)
    if "key" not in entry:
        raise _fail(source, where, "field 'key' is missing", fix)
    for name, value in entry.items():
        kind = IMAGE_FIELDS.get(name)
        if name == "notes":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise _fail(source, where, f"field 'notes' must be a list of text, got {_shown(value)}", fix)
        elif kind == "file":
            if not isinstance(value, str) or not _relative_inside(value):
                problem = f"field '{name}' must be a path inside the output folder, got {_shown(value)}"
                raise _fail(source, where, problem, fix)
        elif kind is not None:
            if not _kind_ok(kind, value):
                raise _fail(
                    source, where, f"field '{name}' must be {_EXPECTED[kind]}, got {_shown(value)}", fix
                )
        elif not isinstance(value, _SCALARS):
            raise _fail(source, where, _nested(name, value), fix)
    return entry


def check_report(document: Any, *, source: str, fix: str = "rerun the original command") -> Mapping:
    """Check a ``rho.json`` before a report is rebuilt from it (``correlate.py --replot``).

    Checks the schema and its ``schema_version`` (:data:`REPORT_SCHEMA_VERSION`; another is refused,
    not guessed at), ``config`` (an object; its ``model`` an object or null), ``versions``
    (an object of text or null), every ``images[]`` entry (unique keys), and every record
    (:data:`REPORT_FIELDS` present, ``timestep`` finite, ``reference`` naming an image).

    Raises:
        RecordError: The first problem, in one line.
    """
    document = _check_object(document, source, "a correlate.py report", fix)
    if document.get("schema") != REPORT_SCHEMA:
        raise RecordError(
            f"{source}: is not a correlate.py report (schema {document.get('schema')!r}, expected "
            f"{REPORT_SCHEMA!r}); {fix}"
        )
    version = document.get("schema_version")
    if isinstance(version, bool) or version != REPORT_SCHEMA_VERSION:
        raise RecordError(
            f"{source}: schema_version {_shown(version)} is not {REPORT_SCHEMA_VERSION}, the only version "
            f"this nw-adapter reads; {fix} (or read the file with the nw-adapter version that wrote it)"
        )
    config = document.get("config", {})
    if not isinstance(config, Mapping):
        raise _fail(source, "config", f"is {_shown(config)}, not an object of options", fix)
    if not isinstance(config.get("model"), Mapping | None):
        raise _fail(source, "config.model", f"is {_shown(config.get('model'))}, not an object", fix)
    versions = document.get("versions")
    if versions is not None:
        if not isinstance(versions, Mapping):
            raise _fail(source, "versions", f"is {_shown(versions)}, not an object", fix)
        for name, value in versions.items():
            if not isinstance(value, str | None):
                raise _fail(
                    source, f"versions.{_name(name)}", f"must be text or null, got {_shown(value)}", fix
                )
    images = document.get("images")
    if not isinstance(images, list):
        raise _fail(source, "images", f"is {_shown(images)}, not a list of images", fix)
    keys: dict[str, int] = {}
    for index, entry in enumerate(images):
        check_image_entry(entry, f"images[{index}]", source=source, fix=fix)
        key = entry["key"]
        if key in keys:
            raise _fail(source, f"images[{index}]", f"repeats the key {key!r} of images[{keys[key]}]", fix)
        keys[key] = index
    records = check_records(
        document.get("records"),
        source=source,
        fix=fix,
        required=REPORT_FIELDS,
        finite=("timestep",),
        allow_empty=False,
    )
    for index, record in enumerate(records):
        if record["reference"] not in keys:
            reference = _shown(record["reference"])
            raise _fail(
                source, f"records[{index}]", f"field 'reference' {reference} names no entry of images", fix
            )
    return document


def check_image_result(document: Any, *, source: str, schema: str, key: str, fix: str = "") -> Mapping:
    """Check one image's ``result.json`` of a sweep: its ``image`` entry (of ``key``), ``files``
    (``{name: sha256}`` of plain file names) and every record (of reference ``key``).

    Raises:
        RecordError: The first problem, in one line.
    """
    document = _check_object(document, source, "an image result", fix)
    if document.get("schema") != schema:
        raise _fail(source, "schema", f"is {_shown(document.get('schema'))}, expected {schema!r}", fix)
    check_image_entry(document.get("image"), "image", source=source, fix=fix)
    if document["image"]["key"] != key:
        raise _fail(
            source, "image", f"field 'key' is {_shown(document['image']['key'])}, expected {key!r}", fix
        )
    files = document.get("files")
    if not isinstance(files, Mapping):
        raise _fail(source, "files", f"is {_shown(files)}, not an object of file digests", fix)
    for name, digest in files.items():
        plain = isinstance(name, str) and name not in ("", ".", "..") and not {"/", "\\"} & set(name)
        if not plain:
            raise _fail(source, "files", f"name {_name(repr(name))} is not a file of the image's folder", fix)
        if not isinstance(digest, str):
            raise _fail(
                source, f"files.{_name(name)}", f"must be a SHA-256 (text), got {_shown(digest)}", fix
            )
    records = check_records(
        document.get("records"), source=source, fix=fix, required=REPORT_FIELDS, finite=("timestep",)
    )
    for index, record in enumerate(records):
        if record["reference"] != key:
            found = _shown(record["reference"])
            raise _fail(source, f"records[{index}]", f"field 'reference' is {found}, expected {key!r}", fix)
    return document


def first_problem(check: Any, *args: Any, **kwargs: Any) -> str | None:
    """The message of ``check(*args, **kwargs)``'s :class:`RecordError`, or None when it passes."""
    try:
        check(*args, **kwargs)
    except RecordError as exc:
        return str(exc)
    return None
