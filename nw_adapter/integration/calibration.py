"""Calibration: the exact NW head read in the same pipeline, as the anchor of what the theory predicts.

THEORY.md 4b: "calibrate the instrument with the head it is looking for". :func:`observe_call`
runs one pipeline call observed (the trained adapter, with the run's per-layer control) and, with
``calibrate=True``, the same call a second time with the exact NW head swapped into every recorded
layer at the schedule's bandwidth ``h = schedule_c * sigma_t / alpha_t`` (same prompt, seed,
generator state, latents, scheduler, steps and IP scale: the random state the first pass started
from is replayed, :class:`~nw_adapter.integration.end_to_end.RandomStateReplay`, the mechanism of
the end-to-end control). The second pass records the swapped head's own weights (swap records what
its branch computes: :mod:`nw_adapter.integration.processors.base`), with the same per-layer
control (the stock algebra on its own queries), and its statistics are merged into the first
pass's records, matched by call, step, layer, head, half, adapter, image and key set
(:func:`~nw_adapter.integration.end_to_end.record_key`):

- ``{X}_exact`` for every statistic X of :data:`~nw_adapter.integration.schema.STAT_NAMES`,
  ``h_eff_exact_reason``, and ``exact_reason`` (None, or why the record has no twin);
- ``{X}_exact_control_{k}`` for X in :data:`~nw_adapter.integration.schema.CONTROL_RECORDED` and
  ``key_scale_exact_{k}``: the control on the exact head's queries;
- ``exact_schedule_c`` (:data:`~nw_adapter.integration.schema.EXACT_C_FIELD`): the exact head's
  bandwidth constant; the verdict pools calibrated records only of one C, never with uncalibrated
  records.

The verdict (:func:`nw_adapter.verdict`) then measures the exact head as its anchor: it places the
adapter between the control (the same algebra, no learning) and the exact head (the theory), and
judges the exact head itself as it judges the adapter (the calibration: the instrument must
recognise it). At flow matching's pure-noise step (``sigma = 1``, h infinite) the exact head is
the mean of the values and its statistics are not defined: that step of the second pass is not
recorded (``pure_noise_steps`` counts it) and its ``_exact`` columns are NaN.

Cost: one more generation per call (the second pass swaps, which costs what observe costs); the
ratio measured on the tiny models is in docs/verdict.md.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nw_adapter.integration.config import NWProcessorConfig, step_count_problem
from nw_adapter.integration.end_to_end import RandomStateReplay, observed_call, record_key
from nw_adapter.integration.errors import NWConfigError, NWInstallError
from nw_adapter.integration.mixin import active_recorder
from nw_adapter.integration.schema import (
    CONTROL_RECORDED,
    EXACT_C_FIELD,
    H_EFF_REASON_FIELD,
    STAT_NAMES,
    control_draws,
)

__all__ = [
    "EXACT_REASON_FIELD",
    "EXACT_SUFFIX",
    "NO_EXACT_RECORD",
    "PURE_NOISE_REASON",
    "CalibratedCall",
    "exact_columns",
    "exact_config",
    "merge_exact",
    "observe_call",
]

EXACT_SUFFIX = "_exact"
"""Suffix of the exact head's columns in the adapter's records (the verdict reads them)."""

EXACT_REASON_FIELD = "exact_reason"
"""Why a record's ``_exact`` columns are NaN (None when the exact pass recorded its twin)."""

NO_EXACT_RECORD = (
    "the exact head's pass recorded no twin of this record (flow matching's pure-noise step, h infinite, "
    "or a skipped layer)"
)
"""The :data:`EXACT_REASON_FIELD` of a record without a twin."""

PURE_NOISE_REASON = "bandwidth='schedule' is infinite at s = 1"
"""Part of the skip reason of flow matching's pure-noise step (no statistics of the exact head)."""


def exact_columns(draws: int) -> tuple[str, ...]:
    """Every column :func:`merge_exact` writes, for a second pass with ``draws`` control draws."""
    own = tuple(f"{stat}{EXACT_SUFFIX}" for stat in STAT_NAMES)
    controls = tuple(
        name
        for k in range(draws)
        for name in (
            *(f"{stat}{EXACT_SUFFIX}_control_{k}" for stat in CONTROL_RECORDED),
            f"key_scale{EXACT_SUFFIX}_{k}",
        )
    )
    return (*own, f"h_eff{EXACT_SUFFIX}_reason", EXACT_REASON_FIELD, EXACT_C_FIELD, *controls)


def exact_config(config: NWProcessorConfig, *, schedule_c: float = 1.0) -> NWProcessorConfig:
    """The second pass's configuration: ``config`` with the exact NW head swapped in at the
    schedule's bandwidth (``mode="swap"``, ``bandwidth="schedule"``, ``schedule_c``), statistics on,
    no maps; the layers, heads, steps, nulls, readings and the per-layer control are the first
    pass's, so the two passes' records match one to one."""
    return dataclasses.replace(
        config, mode="swap", bandwidth="schedule", schedule_c=schedule_c, statistics=True, store_maps=False
    )


def merge_exact(records: list[dict[str, Any]], exact: list[dict[str, Any]], schedule_c: float = 1.0) -> int:
    """Add the exact pass's statistics to ``records`` in place (module docstring), and the exact
    head's bandwidth constant ``schedule_c`` as :data:`~nw_adapter.integration.schema.EXACT_C_FIELD`
    (the verdict pools calibrated records only of one C); returns the number of records left
    without a match (their ``_exact`` columns NaN)."""
    by_key = {record_key(r): r for r in exact}
    draws = control_draws({name for r in exact for name in r})
    missing = 0
    for record in records:
        match = by_key.get(record_key(record))
        missing += match is None
        record[EXACT_REASON_FIELD] = None if match is not None else NO_EXACT_RECORD
        record[EXACT_C_FIELD] = float(schedule_c)
        for stat in STAT_NAMES:
            if stat in record:
                record[f"{stat}{EXACT_SUFFIX}"] = math.nan if match is None else match.get(stat, math.nan)
        if H_EFF_REASON_FIELD in record:
            reason = None if match is None else match.get(H_EFF_REASON_FIELD)
            record[f"h_eff{EXACT_SUFFIX}_reason"] = reason if match is not None else NO_EXACT_RECORD
        for k in range(draws):
            for stat in CONTROL_RECORDED:
                value = math.nan if match is None else match.get(f"{stat}_control_{k}", math.nan)
                record[f"{stat}{EXACT_SUFFIX}_control_{k}"] = value
            value = math.nan if match is None else match.get(f"key_scale_{k}", math.nan)
            record[f"key_scale{EXACT_SUFFIX}_{k}"] = value
            reason = f"h_eff_control_{k}_reason"
            if match is not None and reason in match:
                record[f"h_eff{EXACT_SUFFIX}_control_{k}_reason"] = match[reason]
    return missing


@dataclass
class CalibratedCall:
    """One observed pipeline call and, when calibrated, its exact-head pass.

    Attributes:
        records: the first pass's records (every key set), with the exact head's columns merged
            in when calibrated (:func:`merge_exact`).
        output: the first pass's pipeline output (the trained adapter's generation).
        exact_output: the exact head's generation (None without calibration).
        exact_records: the exact head's own records (mode ``"swap"``; [] without calibration).
        unmatched: first-pass records without an exact record (the pure-noise step's included).
        pure_noise_steps: steps of the exact pass not recorded because h is infinite there.
        meta: ``{"kind": "exact NW head", "mode": "swap", "bandwidth": "schedule", "schedule_c"}``
            (None without calibration): rho.json's ``calibration`` entry.
        recorder: the first pass's :class:`~nw_adapter.integration.recorder.NWRecorder` (its
            skipped pairs, failed steps and context; its own records lack the exact columns).
    """

    records: list[dict[str, Any]]
    output: Any
    exact_output: Any = None
    exact_records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    unmatched: int = 0
    pure_noise_steps: list[int] = dataclasses.field(default_factory=list)
    meta: dict[str, Any] | None = None
    recorder: Any = None


def _config(config: NWProcessorConfig | Mapping[str, Any] | None) -> NWProcessorConfig:
    if config is None:
        return NWProcessorConfig(mode="observe")
    config = config if isinstance(config, NWProcessorConfig) else NWProcessorConfig(**dict(config))
    if config.mode != "observe":
        raise NWConfigError(
            f"observe_call: config.mode must be 'observe', got {config.mode!r}; calibrate=True swaps the "
            "exact head in for the second pass itself"
        )
    return config


def observe_call(
    pipe: Any,
    call_kwargs: Mapping[str, Any],
    *,
    config: NWProcessorConfig | Mapping[str, Any] | None = None,
    calibrate: bool = False,
    schedule_c: float = 1.0,
) -> CalibratedCall:
    """Run ``pipe(**call_kwargs)`` observed; with ``calibrate=True`` also the exact NW head's pass.

    Args:
        pipe: a UNet, SD 3.5 or Flux IP-Adapter pipeline without NW processors installed.
        call_kwargs: the call's keyword arguments (``prompt``, ``ip_adapter_image``, ``generator``,
            ...); pass ``generator`` (or ``latents``) for the two passes to share their noise.
        config: the observe configuration (``NWProcessorConfig`` or its fields; default observe).
        calibrate: run the second pass with the exact NW head at the schedule's h and merge its
            statistics (module docstring).
        schedule_c: the constant of the exact head's bandwidth ``h = c sigma_t / alpha_t``.

    Returns:
        :class:`CalibratedCall`. After it the random states are those the first pass left (as after
        one plain call); the processors are removed, also after an exception.

    Raises:
        NWConfigError: a configuration that is not observe, a bad ``schedule_c`` (the configuration's
            own rule), ``schedule_c`` other than 1 without ``calibrate`` (it would be ignored), or
            ``num_inference_steps`` below 1.
        NWInstallError: NW processors already installed.

    Example:
        >>> result = observe_call(pipe, {"prompt": "a photograph", "ip_adapter_image": ref,
        ...                              "generator": torch.Generator().manual_seed(0)},
        ...                       calibrate=True)  # doctest: +SKIP
        >>> verdict([{"reference": "ref0", **r} for r in result.records])["anchors"]  # doctest: +SKIP
    """
    config = _config(config)
    if isinstance(calibrate, bool) is False:
        raise NWConfigError(f"observe_call: calibrate must be True or False, got {calibrate!r}")
    exact = exact_config(config, schedule_c=schedule_c)  # schedule_c checked by the config's rule, now
    if not calibrate:
        if exact.schedule_c != 1.0:
            raise NWConfigError(
                f"observe_call: schedule_c={schedule_c!r} sets the exact head's bandwidth of calibrate=True, "
                "which is off; pass calibrate=True or leave schedule_c at 1.0"
            )
        exact = None
    if active_recorder(pipe) is not None:
        raise NWInstallError("observe_call: remove the installed NW processors first (it installs its own)")
    problem = step_count_problem(call_kwargs)
    if problem:
        raise NWConfigError(f"observe_call: {problem}")
    replay = RandomStateReplay(call_kwargs)
    output, records, first = observed_call(pipe, config, call_kwargs)
    if exact is None:
        return CalibratedCall(records, output, recorder=first)
    with replay.replay(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exact_output, exact_records, recorder = observed_call(pipe, exact, call_kwargs)
    skipped = recorder.skipped()
    pure_noise = sorted({p["step"] for p in skipped["pairs"] if PURE_NOISE_REASON in p["reason"]})
    others = {why: n for why, n in skipped["by_reason"].items() if PURE_NOISE_REASON not in why}
    for warning in caught:  # the pure-noise step is expected; anything else is said again
        if others or "the NW side computation failed" not in str(warning.message):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    unmatched = merge_exact(records, exact_records, exact.schedule_c)
    meta = {"kind": "exact NW head", "mode": "swap", "bandwidth": "schedule", "schedule_c": exact.schedule_c}
    return CalibratedCall(records, output, exact_output, exact_records, unmatched, pure_noise, meta, first)
