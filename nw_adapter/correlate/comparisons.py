"""Verdict records from :func:`nw_adapter.compare_attention` results: judge any attention head.

A pipeline run records one row per (step, layer, head, CFG half) with the trained adapter's
statistics and, per control draw ``k``, the same statistics of the same queries against the
scale-matched untrained keys (``{stat}_control_{k}``) and the change of scale (``key_scale_{k}``).
:func:`comparison_records` writes the same rows for heads of your own: per reference and step,
the comparison of the trained head, one comparison per control draw (the same queries against
that draw's keys, scale-matched with :func:`scale_matched_keys`) and the schedule's ``h``.
:func:`nw_adapter.verdict` judges them exactly as a pipeline run's records (docs/verdict.md).

Example:
    >>> import torch
    >>> from nw_adapter import compare_attention, comparison_records, scale_matched_keys, verdict
    >>> records = []
    >>> for reference in range(3):  # doctest: +SKIP
    ...     for step, h in enumerate([4.0, 2.0, 1.0, 0.5]):
    ...         q, k = ..., ...  # [B, H, N, d] queries, [B, H, M, d] keys of the trained head
    ...         controls, scales = [], []
    ...         for k0 in control_keys:  # one untrained draw per seed, [B, H, M, d]
    ...             k0m, ratio = scale_matched_keys(k, k0)
    ...             controls.append(compare_attention(q, k0m, scale=d**-0.5))
    ...             scales.append(ratio)
    ...         records += comparison_records(compare_attention(q, k, scale=d**-0.5), controls,
    ...                                       reference=f"ref{reference}", step=step, h_schedule=h,
    ...                                       key_scales=scales)
    >>> verdict(records)["conclusion"]  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from nw_adapter.integration.schema import CONTROL_OF  # re-exported: the statistics of every draw

__all__ = ["CONTROL_OF", "comparison_records", "scale_matched_keys"]


HALVES: tuple[str, ...] = ("cond", "uncond", "all")
"""The CFG halves a batch row may be (the verdict judges ``cond``, else ``all``)."""

MULTIPLE_REASONS = "one of: "
"""Prefix of ``h_eff_reason`` when the comparison counts several reasons for NaN ``h_eff`` values."""


def scale_matched_keys(k: Any, k0: Any, valid: Any = None) -> tuple[Any, Any]:
    """The scale-matched control keys and the change of scale, per (batch row, head).

    ``k0m = k0 * key_rms(k) / key_rms(k0)`` and ``key_scale = key_rms(k) / key_rms(k0)``, with
    ``key_rms = sqrt(mean_{valid i} ||k_i||^2)`` (:func:`nw_adapter.core.readings.key_rms`): the
    control has the trained keys' RMS norm (same algebra, same scale, no learning), and a gain
    ``c`` on the trained keys gives ``key_scale = c`` and a control equal to the trained keys.

    Args:
        k: ``[B, H, M, d]`` trained keys.
        k0: ``[B, H, M', d]`` untrained keys of one control draw (same B, H, d).
        valid: optional bool key mask ``[B, H, M]`` (or broadcastable) for ``k``; ``k0`` has all valid.

    Returns:
        ``(k0m [B, H, M', d], key_scale [B, H])``.

    Raises:
        ValueError: shapes that do not match, or a draw whose keys are all zero.
    """
    import torch

    from nw_adapter.core.readings import key_rms

    for name, x in (("k", k), ("k0", k0)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor [B, H, M, d]; got {type(x).__name__}")
    if k.shape[:2] != k0.shape[:2] or k.shape[-1] != k0.shape[-1]:
        raise ValueError(
            f"k {tuple(k.shape)} and k0 {tuple(k0.shape)} must share B, H and d; pass the control draw's "
            "keys of the same head"
        )
    trained, untrained = key_rms(k, valid), key_rms(k0)
    if bool((untrained == 0).any()):
        raise ValueError("k0 has a (batch row, head) whose keys are all zero; its scale cannot be matched")
    ratio = trained / untrained
    return k0 * ratio[..., None, None].to(k0.dtype), ratio


def _cells(name: str, value: Any, shape: tuple[int, int] | None) -> list[list[float]]:
    """``value`` ``[B, H]`` as nested floats (a tensor, array or nested list); checks the shape."""
    rows = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
        raise ValueError(f"{name}: expected a [B, H] value of compare_attention, got {type(value).__name__}")
    got = (len(rows), len(rows[0]))
    if shape is not None and got != shape:
        raise ValueError(f"{name}: shape {got} differs from the trained comparison's [B, H] = {shape}")
    return [[math.nan if x is None else float(x) for x in row] for row in rows]


def _check_range(where: str, stat: str, cells: list[list[float]]) -> None:
    """ValueError when a cell of a statistic the verdict reads lies outside its range
    (:data:`nw_adapter.correlate.verdict.VALUE_RANGES`): rho = 5, an infinite rho, a key scale of 0."""
    from nw_adapter.correlate.verdict import VALUE_RANGES

    if stat not in VALUE_RANGES:
        return
    low, high, closed, what = VALUE_RANGES[stat]
    for row in cells:
        for x in row:
            if math.isnan(x):
                continue
            inside = math.isfinite(x) and low - 1e-4 <= x <= high + 1e-4 and (closed or x > low)  # rounding
            if not inside:
                span = (
                    f"[{low:g}, {high:g}]"
                    if math.isfinite(low) and math.isfinite(high)
                    else (
                        f"{'[' if closed else '('}{low:g}, inf)" if math.isfinite(low) else "finite numbers"
                    )
                )
                raise ValueError(
                    f"{where}: {x:g} is outside {span} ({what}); pass the values compare_attention returns"
                )


def _reason(comparison: Mapping[str, Any], stat: str) -> str | None:
    """The reason the comparison counts for NaN values of ``stat`` (several: ``one of: a; b``)."""
    counted = (getattr(comparison, "nan_reasons", None) or {}).get(stat) or {}
    if not counted:
        return None
    return next(iter(counted)) if len(counted) == 1 else MULTIPLE_REASONS + "; ".join(counted)


def _check_arguments(
    trained: Any, controls: Any, key_scales: Any, reference: Any, step: Any, h_schedule: Any
) -> None:
    if not isinstance(trained, Mapping) or "rho" not in trained:
        raise ValueError("trained: expected the dict compare_attention returns (with 'rho' [B, H])")
    if isinstance(controls, Mapping) or not isinstance(controls, Sequence):
        raise ValueError("controls: expected a list of compare_attention results, one per control draw")
    for index, control in enumerate(controls):
        if not isinstance(control, Mapping) or "rho" not in control:
            raise ValueError(f"controls[{index}]: expected the dict compare_attention returns")
    if key_scales is not None and len(key_scales) != len(controls):
        raise ValueError(
            f"key_scales: {len(key_scales)} values for {len(controls)} control draws; pass one per draw "
            "(the ratio scale_matched_keys returns) or None"
        )
    if not isinstance(reference, str) or not reference:
        raise ValueError(f"reference must be a non-empty string naming the reference, got {reference!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a whole number >= 0 (the denoising step index), got {step!r}")
    if (
        isinstance(h_schedule, bool)
        or not isinstance(h_schedule, int | float)
        or not (math.isfinite(h_schedule) and h_schedule > 0)
    ):
        raise ValueError(f"h_schedule must be a finite number > 0 (sigma_t / alpha_t), got {h_schedule!r}")


def comparison_records(
    trained: Mapping[str, Any],
    controls: Sequence[Mapping[str, Any]] = (),
    *,
    reference: str,
    step: int,
    h_schedule: float,
    key_scales: Sequence[Any] | None = None,
    halves: Sequence[str] | None = None,
    layer: str = "attention",
    timestep: float | None = None,
) -> list[dict[str, Any]]:
    """Verdict records of one reference and step: one per (batch row, head) of the comparisons.

    Args:
        trained: :func:`nw_adapter.compare_attention` of the trained head (``{name: [B, H]}``).
        controls: per control draw ``k``, ``compare_attention`` of the same queries against that
            draw's keys (scale-matched: :func:`scale_matched_keys`); its statistics of
            :data:`CONTROL_OF` become ``{stat}_control_{k}``.
        reference: the reference (the verdict's unit); records of one reference share it.
        step: the denoising step index.
        h_schedule: the schedule's bandwidth ``sigma_t / alpha_t`` at this step.
        key_scales: per draw, ``key_rms(trained keys) / key_rms(draw's unmatched keys)`` (``[B, H]``
            or a number; the ratio :func:`scale_matched_keys` returns), recorded as
            ``key_scale_{k}``; None: the scale ratio is not reported.
        halves: the CFG half of each batch row (:data:`HALVES`); default ``"all"`` for every row.
        layer: a name for the head's layer (records of several layers are averaged per step).
        timestep: the model's timestep, if any.

    Returns:
        Record dicts with ``reference``, ``call`` 0, ``step``, ``timestep``, ``h_schedule``,
        ``layer``, ``head``, ``half``, ``adapter`` 0, ``image`` (the batch row), ``key_set``
        ``"ip"``, every statistic of the comparison, ``h_eff_reason`` (the comparison's reason
        where ``h_eff`` is NaN, None where it is a number) and the control's columns.

    Raises:
        ValueError: a comparison that is not one, shapes that differ, a key-scale count that is
            not one per draw, a value out of its range (rho = 5, an infinite rho, a key scale of
            0: :data:`nw_adapter.correlate.verdict.VALUE_RANGES`), a bad reference, step, h or half;
            one line naming it.
    """
    _check_arguments(trained, controls, key_scales, reference, step, h_schedule)
    rho = _cells("trained['rho']", trained["rho"], None)
    shape = (len(rho), len(rho[0]))
    halves = list(halves) if halves is not None else ["all"] * shape[0]
    if len(halves) != shape[0] or any(h not in HALVES for h in halves):
        raise ValueError(f"halves: expected {shape[0]} of {HALVES} (one per batch row), got {halves!r}")
    columns: dict[str, list[list[float]]] = {
        name: _cells(f"trained[{name!r}]", value, shape) for name, value in trained.items()
    }
    for name, cells in columns.items():
        _check_range(f"trained[{name!r}]", name, cells)
    for draw, control in enumerate(controls):
        for stat in (s for s in CONTROL_OF if s in control):
            cells = _cells(f"controls[{draw}][{stat!r}]", control[stat], shape)
            _check_range(f"controls[{draw}][{stat!r}]", stat, cells)
            columns[f"{stat}_control_{draw}"] = cells
        if key_scales is not None:
            ratio = key_scales[draw]
            if isinstance(ratio, int | float) and not isinstance(ratio, bool):  # one ratio for every cell
                ratio = [[float(ratio)] * shape[1] for _ in range(shape[0])]
            columns[f"key_scale_{draw}"] = _cells(f"key_scales[{draw}]", ratio, shape)
            _check_range(f"key_scales[{draw}]", "key_scale", columns[f"key_scale_{draw}"])
    h_reason = _reason(trained, "h_eff")
    records = []
    for row in range(shape[0]):
        for head in range(shape[1]):
            record: dict[str, Any] = {
                "reference": reference, "call": 0, "step": step, "timestep": timestep,
                "h_schedule": float(h_schedule), "layer": layer, "head": head, "half": halves[row],
                "adapter": 0, "image": row, "key_set": "ip",
            }  # fmt: skip
            record.update({name: cells[row][head] for name, cells in columns.items()})
            if "h_eff" in record:
                record["h_eff_reason"] = h_reason if math.isnan(record["h_eff"]) else None
            records.append(record)
    return records
