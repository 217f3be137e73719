"""The files of ``correlate.py --compare-swap``: ``compare_swap.json`` and ``compare_swap.csv``.

- :func:`build_document` turns a :class:`~nw_adapter.analysis.consequence.SwapComparison` into
  the ``compare_swap.json`` document (schema :data:`SCHEMA`): ``config`` (the options),
  ``versions``, ``images`` (each reference's key, file, SHA-256 and class label or null),
  ``embedding``, ``settings``, ``rules``, ``per_reference`` (one row per (reference, rule): the values
  :func:`~nw_adapter.analysis.consequence.compare_swap` returned, with the reference's ``key``),
  ``summary`` (per rule: means with 95% intervals over references inside the quantities' ranges,
  the conclusion's ``change_vs_seed`` / ``clip_i_effect``, kept-class counts with Clopper-Pearson
  95% intervals: :meth:`~nw_adapter.analysis.consequence.SwapComparison.summary`),
  ``fingerprint`` (of the options) and ``digest`` (SHA-256 of the rest of the content,
  :func:`nw_adapter.correlate.sweep.content_digest`);
- :func:`reusable_document` / :func:`document_problem` decide whether a saved document belongs to
  a run (resuming);
- :func:`comparison_of` and :func:`format_document` rebuild the printed table from a document;
  :func:`rows_csv` is ``compare_swap.csv`` (the rows).

Non-finite values are written as null (strict JSON) and read back as NaN.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nw_adapter.correlate.images import ReferenceImage

__all__ = [
    "CSV_NAME",
    "JSON_NAME",
    "SCHEMA",
    "SWAP_FILES",
    "build_document",
    "comparison_of",
    "document_problem",
    "format_document",
    "read_text",
    "remove_outputs",
    "reusable_document",
    "rows_csv",
]

SCHEMA = "nw-adapter/compare-swap"
SCHEMA_VERSION = 2
"""2: the summary's intervals stay in range and carry the conclusion (1: plain Student t)."""
JSON_NAME = "compare_swap.json"
CSV_NAME = "compare_swap.csv"
SWAP_FILES = (JSON_NAME, CSV_NAME)
ROW_COLUMNS = (
    "key",
    "reference",
    "rule",
    "abs_diff",
    "abs_diff_other_seed",
    "clip_i_stock",
    "clip_i_swap",
    "clip_i_change",
    "label",
    "stock_label",
    "swap_label",
    "stock_keeps",
    "swap_keeps",
)
_CONFIG_KEYS = {"model", "steps", "seed", "guidance_scale", "labels"}  # what the printed table reads


def build_document(
    result: Any, *, config: dict, infos: Sequence[ReferenceImage], labels: list[int] | None, fingerprint: str
) -> dict:
    """The ``compare_swap.json`` document of a comparison (layout: the module docstring).

    Args:
        result: The :class:`~nw_adapter.analysis.consequence.SwapComparison`.
        config: The run's options (recorded as they are).
        infos: The references, in the order they were compared (row ``reference`` ``i`` is ``infos[i]``).
        labels: Their classes, or None when class agreement was not measured.
        fingerprint: The options' fingerprint (:func:`nw_adapter.correlate.sweep.fingerprint`).

    Returns:
        The JSON-ready document, its ``digest`` set.
    """
    from nw_adapter.correlate.report import json_ready, package_versions
    from nw_adapter.correlate.sweep import DIGEST_FIELD, content_digest

    images = [
        {**info.to_dict(), "label": None if labels is None else labels[i]} for i, info in enumerate(infos)
    ]
    document = json_ready(
        {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "fingerprint": fingerprint,
            "config": config,
            "versions": package_versions(),
            "images": images,
            "embedding": result.embedding,
            "settings": result.settings,
            "rules": list(result.rules),
            "per_reference": [{"key": infos[row["reference"]].key, **row} for row in result.per_reference],
            "summary": result.summary(),
        }
    )
    document[DIGEST_FIELD] = content_digest(document)
    return document


def _is_number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _reference_problem(images: list, infos: Sequence[ReferenceImage], labels: list[int] | None) -> str | None:
    """How the saved ``images`` differ from this run's references and classes (None: they do not).

    Names the change: the same files in another order (reference ``i`` is generated with seed
    ``--seed + i``, so the order changes every row), files added or no longer listed, or other classes.
    """
    then = [(image.get("key"), image.get("sha256")) if isinstance(image, dict) else None for image in images]
    now = [(info.key, info.sha256) for info in infos]
    if then != now:
        if sorted(map(str, then)) == sorted(map(str, now)):
            return (
                f"the reference list was reordered since {JSON_NAME} was made (reference i is generated "
                "with seed --seed + i, so the order changes every row)"
            )
        added = [info.path.name for info in infos if (info.key, info.sha256) not in then]
        gone = [
            Path(str(image.get("path", image.get("key")))).name
            for image, pair in zip(images, then, strict=True)
            if pair not in now and isinstance(image, dict)
        ]
        parts = [f"{what}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                 for what, names in (("new", added), ("no longer listed", gone)) if names]  # fmt: skip
        detail = f": {'; '.join(parts)}" if parts else ""
        return (
            f"{JSON_NAME} belongs to other reference files (the reference list changed since it was made"
            f"{detail})"
        )
    if labels is not None and [image.get("label") for image in images] != list(labels):
        return f"the references' classes differ from those {JSON_NAME} was made with (--labels)"
    return None


def _changed_entries(recorded: Any, current: dict, prefix: str = "") -> list[str]:
    """``key: <recorded> then, <current> now`` for each entry of ``current`` (the options that enter the
    fingerprint) whose recorded value differs; nested records (``model``) entry by entry."""
    if not isinstance(recorded, dict):
        return [f"{prefix.rstrip('.') or 'config'} is not a record"]
    changed = []
    for key, value in current.items():
        then = recorded.get(key, "(not recorded)")
        if isinstance(value, dict) and isinstance(then, dict):
            changed += _changed_entries(then, value, f"{prefix}{key}.")
        elif json.dumps(then, sort_keys=True, default=str) != json.dumps(value, sort_keys=True, default=str):
            changed.append(f"{prefix}{key}: {then!r} then, {value!r} now")
    return changed


def _options_problem(document: dict, options: dict | None) -> str:
    """Why the fingerprints differ, named: the recorded options that changed (at most three), else
    the model's files (the fingerprint also holds the resolved model, which the record does not)."""
    changed = _changed_entries(document.get("config"), options) if options is not None else []
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return f"{JSON_NAME} was made with other options ({'; '.join(changed[:3])}{more})"
    if options is not None:
        return (
            f"{JSON_NAME} was made with the same recorded options but another model's files or by a version "
            "that fingerprinted them otherwise"
        )
    return f"{JSON_NAME} was made with other options, rules, labels or another model"


def document_problem(
    document: Any,
    fingerprint: str,
    infos: Sequence[ReferenceImage],
    labels: list[int] | None = None,
    options: dict | None = None,
) -> str | None:
    """Why a parsed ``compare_swap.json`` cannot be reused for this run (None: it can).

    Checks: a JSON object of :data:`SCHEMA` and :data:`SCHEMA_VERSION` whose content still has its
    digest, with the fields the printed table reads, for the same references (keys and SHA-256, in
    order) and classes (``labels``, when given), made with the same fingerprint (the options), with
    exactly one row per (reference, rule) whose metrics are numbers. A changed reference list and
    changed options are both named (the reference list as reordered or changed, with the files; the
    options, given ``options``, the run's options that enter the fingerprint, by the entries that
    changed), not one as the other.
    """
    from nw_adapter.correlate.sweep import DIGEST_FIELD, content_digest

    if not isinstance(document, dict):
        return f"{JSON_NAME} is not a JSON object"
    if document.get("schema") != SCHEMA:
        return f"{JSON_NAME} is of another schema ({document.get('schema')!r})"
    if document.get("schema_version") != SCHEMA_VERSION:
        return f"{JSON_NAME} is of schema version {document.get('schema_version')!r}, not {SCHEMA_VERSION}"
    if document.get(DIGEST_FIELD) != content_digest(document):
        return f"{JSON_NAME} was changed after it was written (its content digest does not match)"
    config = document.get("config")
    if (
        not isinstance(config, dict)
        or not _CONFIG_KEYS <= set(config)
        or not isinstance(config.get("model"), dict)
        or not isinstance(document.get("embedding"), str)
        or not isinstance(document.get("settings"), dict)
    ):
        return f"{JSON_NAME} lacks its config, embedding or settings"
    images = document.get("images")
    if not isinstance(images, list):
        return f"{JSON_NAME} has no valid list of references"
    reasons = [_reference_problem(images, infos, labels)]
    if document.get("fingerprint") != fingerprint:
        reasons.append(_options_problem(document, options))
    if any(reasons):
        return "; ".join(reason for reason in reasons if reason)
    rows, rules = document.get("per_reference"), document.get("rules")
    if (
        not isinstance(rows, list)
        or not isinstance(rules, list)
        or not all(isinstance(r, dict) for r in rows)
    ):
        return f"{JSON_NAME} has no valid rows"
    expected = [(index, rule) for index in range(len(infos)) for rule in rules]
    if [(row.get("reference"), row.get("rule")) for row in rows] != expected:
        return f"{JSON_NAME} does not have one row per (reference, rule)"
    from nw_adapter.analysis.consequence import MEAN_COLUMNS

    if not all(_is_number(row.get(column, "missing")) for row in rows for column in MEAN_COLUMNS):
        return f"{JSON_NAME} has a row with a missing or non-numeric value"
    return None


def reusable_document(
    out_dir: Path,
    fingerprint: str,
    infos: Sequence[ReferenceImage],
    labels: list[int] | None = None,
    options: dict | None = None,
) -> tuple[dict | None, str | None]:
    """``(document, None)`` when ``out_dir``'s ``compare_swap.json`` belongs to this run, else
    ``(None, why)`` (``why`` is None when there is no such file; see :func:`document_problem`).

    The file is read only when it is a regular file inside ``out_dir`` (never through a link).
    """
    path = Path(out_dir) / JSON_NAME
    if path.is_symlink():
        return None, f"{JSON_NAME} is a symbolic link, not a file of this tool"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{JSON_NAME} is unreadable ({exc.strerror or type(exc).__name__})"
    except ValueError:
        return None, f"{JSON_NAME} is not valid JSON (an interrupted or damaged file)"
    why = document_problem(document, fingerprint, infos, labels, options)
    return (None, why) if why else (document, None)


def comparison_of(document: dict) -> Any:
    """The :class:`~nw_adapter.analysis.consequence.SwapComparison` of a ``compare_swap.json``
    document (without images; nulls, i.e. non-finite values, back to NaN)."""
    from nw_adapter.analysis.consequence import MEAN_COLUMNS, SwapComparison

    rows = [
        {
            key: (math.nan if key in MEAN_COLUMNS and value is None else value)
            for key, value in row.items()
            if key != "key"
        }
        for row in document["per_reference"]
    ]
    return SwapComparison(
        rules=tuple(document["rules"]),
        per_reference=rows,
        embedding=document["embedding"],
        settings=document["settings"],
    )


def format_document(document: dict, *, detail: bool = True, out_dir: Path | None = None) -> str:
    """What the command prints: a context line, the table with its conclusion, and the notes that qualify
    it; with ``detail`` (``-v``) the legend of every column and the methods under the table, without it a
    last line saying where they are (``out_dir``'s ``report.html``, ``compare_swap.json`` / ``.csv``)."""
    from nw_adapter.correlate.report import random_weights_note

    config = document["config"]
    count = len(document["images"])
    true_cfg = config.get("true_cfg_scale") or 1.0  # > 1 only where Flux's true CFG guided the calls
    guidance = f"true CFG {true_cfg:g}" if true_cfg > 1 else f"guidance {config['guidance_scale']:g}"
    lines = [
        f"swap consequence: stock vs the exact NW head in every IP-Adapter layer, {count} reference "
        f"image(s), {config['model']['model']}, {config['steps']} steps "
        f"({config.get('scheduler_class', 'scheduler')}), {guidance}, "
        f"seed {config['seed']} (reference i: seed + i)",
        comparison_of(document).table(legend=detail),
    ]
    source = config["labels"]
    if source == "bundled":
        lines.append("classes: the bundled held-out digits' own classes (recognised by SHA-256)")
    elif source == "--labels":
        lines.append("classes: as given with --labels")
    else:
        lines.append(f"note: {source}")
    if not detail:
        report = "report.html" if out_dir is None else str(Path(out_dir) / "report.html")
        lines.append(
            "details: -v prints the legend of every column and the methods; open "
            f"{report} in a browser (offline: the images side by side); every reference's row in "
            f"{JSON_NAME} / {CSV_NAME}"
        )
    warning = random_weights_note({"config": config})
    if warning:
        lines.insert(0, f"WARNING: {warning}")
    return "\n".join(lines)


def rows_csv(document: dict) -> str:
    """``compare_swap.csv``: the per-reference rows, columns :data:`ROW_COLUMNS` present in them."""
    from nw_adapter.analysis.records import csv_text

    return csv_text(document["per_reference"], order=ROW_COLUMNS)


def read_text(path: Path) -> str | None:
    """A file's text, or None when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None


def remove_outputs(out_dir: Path) -> None:
    """Remove a previous run's files, the JSON (the marker of a finished run) first.

    Only regular files: a symbolic link or a folder under these names is never removed or
    followed (the command line refuses them before: :func:`nw_adapter.correlate.outputs.check_entry`).
    """
    from nw_adapter.atomic import remove_regular_file

    for name in SWAP_FILES:
        remove_regular_file(Path(out_dir) / name)
