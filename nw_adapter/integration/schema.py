"""Names of the recorded fields, shared by the recorder and the reports (no torch import).

One record is one (call, step, layer, head, CFG half, adapter, image): the identifying keys of
:data:`RECORD_KEYS` followed by the statistics of :data:`STAT_NAMES`.
"""

from __future__ import annotations

import math
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
#: pipeline's ``name_or_path``), ``mode`` (observe / swap) and ``input_digest`` (SHA-256, 16 hex,
#: of the call's IP-Adapter image embeddings: the reference's content). The verdict refuses
#: records of several models or modes, or a reference of several runs, and counts one reference
#: content once.
RUN_KEYS: tuple[str, ...] = ("run", "model", "mode", "input_digest")

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

#: Suffix of a statistic computed for the untrained-adapter control (THEORY.md section 4): the
#: same queries against the keys of the IP-Adapter training recipe's initialisation.
UNTRAINED_SUFFIX = "_untrained"

#: The statistics recorded for the untrained-adapter control too (as ``name + UNTRAINED_SUFFIX``).
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

#: The untrained-adapter control's columns, in :data:`UNTRAINED_OF` order.
UNTRAINED_STATS: tuple[str, ...] = tuple(name + UNTRAINED_SUFFIX for name in UNTRAINED_OF)

#: Statistics recorded by some runs only (SD3: the joint softmax's mass on the IP keys; the
#: untrained-adapter control's columns when the control is on).
OPTIONAL_STATS: tuple[str, ...] = ("ip_mass", *UNTRAINED_STATS)

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
