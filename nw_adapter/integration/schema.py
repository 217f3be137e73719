"""Names of the recorded fields, shared by the recorder and the reports (no torch import).

One record is one (call, step, layer, head, CFG half, adapter, image): the identifying keys of
:data:`RECORD_KEYS` followed by the statistics of :data:`STAT_NAMES`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from nw_adapter.core.specification import H_EFF_REASONS  # noqa: F401 (re-exported)
from nw_adapter.core.specification import READING_STATS as _SPEC_READING_STATS
from nw_adapter.core.specification import STAT_NAMES as _SPEC_STAT_NAMES

#: Keys that identify a record and its noise level, in column order.
RECORD_KEYS: tuple[str, ...] = (
    "call",
    "step",
    "timestep",
    "alpha",
    "sigma",
    "h_schedule",
    "layer",
    "block",
    "head",
    "half",
    "adapter",
    "image",
    "scale",
    "num_keys",
    "key_set",
)

#: Keys naming the run a record belongs to, after :data:`RECORD_KEYS` (absent in files of older
#: versions): ``run`` (one id per recorder; the command line's is one per run), ``model`` (the
#: pipeline's ``name_or_path``), ``mode`` (observe / swap), ``settings`` (digest of the settings
#: that change what a reading means, 4 hex per setting: :mod:`nw_adapter.integration.settings`)
#: and ``input_digest`` (SHA-256, 16 hex, of the call's IP-Adapter image embeddings: the
#: reference's content). The verdict refuses records of several models, modes or settings, or a
#: reference of several runs, and counts one reference content once.
RUN_KEYS: tuple[str, ...] = ("run", "model", "mode", "settings", "input_digest")

#: Key sets a softmax is compared over: "ip" (the IP-Adapter keys; UNet and Flux image branches
#: are a softmax over these alone, and SD3's joint softmax restricted to them and renormalised)
#: and "joint" (SD3: the image's own keys and the IP keys of its one image-branch softmax).
KEY_SETS: tuple[str, ...] = ("ip", "joint")

#: Readings that split the attention into a key prior and an NW smoother of the query
#: (:mod:`nw_adapter.core.readings`, THEORY.md section 4): ``r2_key`` (share of the row-centred
#: logit variance explained by a query-blind key bias), ``r2_nw`` (by one NW term),
#: ``kl_nw_fit`` = KL(A || NW at the fitted bandwidth ``h_eff``), ``kl_key_prior`` = KL(A || the
#: query-averaged attention), ``nw_gain`` = kl_key_prior - kl_nw_fit, ``h_eff`` (NaN when not
#: identified, with its reason in the record's ``h_eff_reason``) with ``h_eff_se`` (its standard
#: error from fitting on ``fit_rows`` query rows, 0 when every row was used). Defined, with every
#: statistic, in :mod:`nw_adapter.core.specification` (re-exported here).
READING_STATS: tuple[str, ...] = _SPEC_READING_STATS

#: Suffix of a statistic of the old untrained-adapter control (one seeded draw, keys not matched
#: in scale): files of earlier versions hold these columns; this version no longer writes them
#: (it writes the scale-matched control of :data:`CONTROL_OF`). They still load and validate.
UNTRAINED_SUFFIX = "_untrained"

#: The statistics the old control recorded (as ``name + UNTRAINED_SUFFIX``).
UNTRAINED_OF: tuple[str, ...] = (
    "rho",
    "kl",
    "key_norm_cv",
    "qk_spread_ratio",
    "r2_key",
    "r2_nw",
    "kl_nw_fit",
    "kl_key_prior",
    "nw_gain",
    "h_eff",
)

#: The old control's columns, in :data:`UNTRAINED_OF` order (read, never written).
UNTRAINED_STATS: tuple[str, ...] = tuple(name + UNTRAINED_SUFFIX for name in UNTRAINED_OF)

#: Statistics of one (layer, head, half, adapter, image), in the order of the processor's stats tensor
#: (the table of :data:`nw_adapter.core.specification.SPECIFICATION`, re-exported here).
#: The three nulls of rho: ``rho_perm_null`` (NW scores shuffled across keys, ~0),
#: ``rho_norm_matched_null`` (queries of the same norms in random directions) and
#: ``rho_spread_null`` (each row's q.k values kept, their pairing with the key norms shuffled).
#: ``key_norm_cv`` = std/mean of ||k_i|| and ``qk_spread_ratio`` = mean over rows of
#: std_i(q.k_i) / std_i(||k_i||^2 / 2), both with population standard deviations;
#: ``logit_scale`` = the RMS of the row-centred logits and ``key_rms`` = the RMS key norm (the scale
#: readings). Then the readings of :data:`READING_STATS` (NaN when
#: ``NWProcessorConfig(readings=False)``; files written before they existed load with them missing).
STAT_NAMES: tuple[str, ...] = _SPEC_STAT_NAMES

#: The per-record text column of why ``h_eff`` is NaN (one of :data:`H_EFF_REASONS`; None when
#: identified), and the summary's / export's field counting them: ``{stat: {reason: count}}``.
H_EFF_REASON_FIELD = "h_eff_reason"
NAN_REASONS_FIELD = "nan_reasons"

#: The record field of a calibrated run's exact-head bandwidth constant C (``h = C sigma_t /
#: alpha_t``, :mod:`nw_adapter.integration.calibration`): its ``{stat}_exact`` columns mean the same
#: only for the same C, so the verdict never pools records of different C.
EXACT_C_FIELD = "exact_schedule_c"

#: The statistics of the scale-matched untrained-adapter control (THEORY.md section 4), per draw
#: k: ``{X}_control_{k}`` is statistic X of the same queries against draw k's untrained keys
#: rescaled per (batch row, head) to the trained keys' RMS norm, ``k0m = k0 key_rms(k) /
#: key_rms(k0)`` ("same algebra, same scale, no learning"). Only the names :data:`STAT_NAMES`
#: holds are recorded (:data:`CONTROL_RECORDED`).
CONTROL_OF: tuple[str, ...] = (
    "rho",
    "kl",
    "key_norm_cv",
    "qk_spread_ratio",
    "logit_scale",
    "r2_key",
    "r2_nw",
    "kl_nw_fit",
    "kl_key_prior",
    "nw_gain",
    "h_eff",
)

#: The statistics of :data:`CONTROL_OF` this version computes (in :data:`CONTROL_OF` order).
CONTROL_RECORDED: tuple[str, ...] = tuple(name for name in CONTROL_OF if name in STAT_NAMES)

KEY_SCALE = "key_scale"
"""Stem of the change-of-scale column: ``key_scale_{k}`` = key_rms(trained keys) / key_rms(draw
k's untrained keys, unmatched), pooled over a CFG half like the statistics."""

CONTROL_MEAN_SUFFIX = "_control"
"""Suffix of a summary field: the draws' mean of ``{X}_control_{k}`` (the scale-matched control,
K draws), e.g. ``rho_control``; ``key_scale`` is the draws' geometric mean of ``key_scale_{k}``."""


def control_label(draws: int) -> str:
    """How reports and figures name the draws' mean of the control: ``"scale-matched control (K
    draws)"`` (``"1 draw"`` for K = 1)."""
    return f"scale-matched control ({draws} draw{'' if draws == 1 else 's'})"


_CONTROL_PATTERN = re.compile(r"^(?:(?P<stat>[a-z0-9_]+?)_control|key_scale)_(?P<draw>\d+)$")


def control_column(stat: str, draw: int) -> str:
    """``{stat}_control_{draw}``: statistic ``stat`` of :data:`CONTROL_OF` under control draw ``draw``.

    Raises:
        ValueError: ``stat`` is not in :data:`CONTROL_OF` or ``draw`` is not an int >= 0.
    """
    if stat not in CONTROL_OF:
        raise ValueError(f"{stat!r} is not a statistic of the control; use one of {CONTROL_OF}")
    return f"{stat}_control_{_draw(draw)}"


def key_scale_column(draw: int) -> str:
    """``key_scale_{draw}``: key_rms(trained) / key_rms(untrained draw ``draw``, unmatched)."""
    return f"{KEY_SCALE}_{_draw(draw)}"


def control_columns(draws: int) -> tuple[str, ...]:
    """Every column the control writes with ``draws`` draws: per draw k, ``{X}_control_{k}`` for X
    in :data:`CONTROL_RECORDED`, then ``key_scale_{k}``."""
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 0:
        raise ValueError(f"draws must be an int >= 0, got {draws!r}")
    return tuple(
        name
        for k in range(draws)
        for name in (*(control_column(x, k) for x in CONTROL_RECORDED), key_scale_column(k))
    )


def control_stat(name: str) -> str | None:
    """The statistic of a control column: X of ``{X}_control_{k}`` (X in :data:`CONTROL_OF`),
    :data:`KEY_SCALE` of ``key_scale_{k}``; None for any other name."""
    match = _CONTROL_PATTERN.match(name)
    if match is None:
        return None
    stat = match["stat"] or KEY_SCALE
    return stat if stat == KEY_SCALE or stat in CONTROL_OF else None


def is_control_column(name: str) -> bool:
    """Whether ``name`` is a column of the scale-matched control (``{X}_control_{k}`` with X in
    :data:`CONTROL_OF`, or ``key_scale_{k}``)."""
    return control_stat(name) is not None


def control_draws(columns: Iterable[str]) -> int:
    """The number of control draws K whose columns appear among ``columns`` (0 when none): one
    more than the largest draw index of a control column."""
    found = [int(m["draw"]) for m in map(_CONTROL_PATTERN.match, columns) if m and is_control_column(m[0])]
    return max(found) + 1 if found else 0


def control_mean(record: dict, stat: str, draws: int | None = None) -> float | None:
    """The draws' mean of the scale-matched control of ``stat`` in one record: the arithmetic mean
    of the finite ``{stat}_control_{k}``, or for ``stat = "key_scale"`` the geometric mean of the
    finite positive ``key_scale_{k}``; NaN when no draw is finite, None when none is recorded.

    ``draws``: the number of draws to look at (default :func:`control_draws` of the record).
    """
    draws = control_draws(record) if draws is None else draws
    return _draws_mean(record, _draw_names(stat, draws), geometric=stat == KEY_SCALE)


def _draw_names(stat: str, draws: int) -> tuple[str, ...]:
    return tuple(key_scale_column(k) if stat == KEY_SCALE else control_column(stat, k) for k in range(draws))


def _draws_mean(record: dict, names: tuple[str, ...], *, geometric: bool) -> float | None:
    values = [record[n] for n in names if n in record]
    if not values:
        return None
    numbers = [math.nan if v is None else float(v) for v in values]
    if geometric:
        logs = [math.log(x) for x in numbers if math.isfinite(x) and x > 0]
        return math.exp(sum(logs) / len(logs)) if logs else math.nan
    kept = [x for x in numbers if math.isfinite(x)]
    return sum(kept) / len(kept) if kept else math.nan


def control_mean_fields(records: Iterable[dict]) -> tuple[int, dict[str, list[float | None]]]:
    """The draws' means of the scale-matched control over ``records``, per summary field.

    Returns:
        ``(K, {field: [value per record]})``: K the most draws any record holds (0: none, and an
        empty dict); the fields ``{X}_control`` for every X of :data:`CONTROL_OF` some record holds
        and ``key_scale`` (:func:`control_mean`; None for a record without the column).
    """
    records = list(records)
    names = set().union(*(r.keys() for r in records)) if records else set()
    draws = control_draws(names)  # the column names of every record, matched once
    if not draws:
        return 0, {}
    held = [x for x in CONTROL_OF if any(control_column(x, k) in names for k in range(draws))]
    fields = {x + CONTROL_MEAN_SUFFIX: (_draw_names(x, draws), False) for x in held}
    fields[KEY_SCALE] = (_draw_names(KEY_SCALE, draws), True)
    means = {
        field: [_draws_mean(r, columns, geometric=geometric) for r in records]
        for field, (columns, geometric) in fields.items()
    }
    return draws, means


def _draw(draw: int) -> int:
    if isinstance(draw, bool) or not isinstance(draw, int) or draw < 0:
        raise ValueError(f"draw must be an int >= 0, got {draw!r}")
    return draw


#: Support sets (several reference images for one adapter, :mod:`nw_adapter.core.support`): a
#: softmax over m > 1 references gets ``num_refs`` (m), per reference r ``ref_mass_{r}`` (attention
#: mass, query-averaged), and the entropies over references of :data:`SUPPORT_SCALARS`. The theory's
#: posterior over the references lives in latent space, not in these columns (THEORY.md 4b).
SUPPORT_REFERENCES = "num_refs"
SUPPORT_MASS_STEM = "ref_mass"
SUPPORT_SCALARS: tuple[str, ...] = ("ref_entropy", "ref_row_entropy")


def support_mass_column(reference: int) -> str:
    """``ref_mass_{r}``: the attention mass on reference ``r``."""
    return f"{SUPPORT_MASS_STEM}_{_draw(reference)}"


def support_columns(references: int) -> tuple[str, ...]:
    """The support-set columns of a softmax over ``references`` images, in record order."""
    return (SUPPORT_REFERENCES, *(support_mass_column(r) for r in range(references)), *SUPPORT_SCALARS)


#: Statistics recorded by some runs only: SD3's joint-softmax mass on the IP keys and the old
#: control's ``*_untrained`` columns (files of earlier versions). The scale-matched control's
#: columns, whose number follows the draws, are recognised by :func:`is_control_column`.
OPTIONAL_STATS: tuple[str, ...] = ("ip_mass", *UNTRAINED_STATS)

#: The statistics in reporting order (rho first, the bandwidth used last).
SUMMARY_STATS: tuple[str, ...] = tuple(s for s in STAT_NAMES if s != "bandwidth") + ("bandwidth",)

#: Top-level export field of the (call, step, layer) pairs whose side computation failed (the
#: layer kept its output: diffusers' in observe, the NW head's in swap): ``{"count", "by_reason",
#: "pairs"}``.
SKIPPED_FIELD = "skipped"

#: The nulls rho must clear to count as evidence (all of them, each present).
NULL_STATS: tuple[str, ...] = ("rho_perm_null", "rho_norm_matched_null", "rho_spread_null")

#: Names of earlier schema versions, read as their current names (``rho.json`` / CSV of version 1).
LEGACY_NAMES: dict[str, str] = {"rho_norm_null": "rho_norm_matched_null"}


def finite_mean(values: Iterable[Any]) -> tuple[float, int]:
    """Mean of the finite values and the number of values left out (NaN, +-inf or None).

    A statistic's average never drops non-finite values silently: callers report the count
    beside the mean (``nonfinite`` of the summary and report rows).

    Args:
        values: numbers (None counts as missing).

    Returns:
        ``(mean, dropped)``; the mean is NaN when no value is finite.
    """
    kept: list[float] = []
    dropped = 0
    for value in values:
        x = math.nan if value is None else float(value)
        if math.isfinite(x):
            kept.append(x)
        else:
            dropped += 1
    return (sum(kept) / len(kept) if kept else math.nan), dropped


def block_of(layer: str) -> str:
    """``"down"``, ``"mid"`` or ``"up"`` from an attention-processor name (else ``"other"``)."""
    for prefix, block in (("down_blocks", "down"), ("mid_block", "mid"), ("up_blocks", "up")):
        if layer.startswith(prefix):
            return block
    return "other"


RECORDS_SCHEMA = "nw-adapter/records"
"""The ``schema`` of a records file (``NWRecorder.to_json``)."""
REPORT_SCHEMA = "nw-adapter/rho"
"""The ``schema`` of the command line's report ``rho.json`` (the same ``records``)."""
REPORT_SCHEMA_VERSION = 1
"""The one ``schema_version`` of ``rho.json`` this version writes and reads (``correlate.py --replot``)."""
