"""A recorder's entries and their export as plain records (one host transfer for all of them).

The NW processors reserve one :class:`Entry` per recorded softmax (:meth:`NWRecorder.reserve
<nw_adapter.integration.recorder.NWRecorder.reserve>`) and fill its statistics, device tensors of
shape ``[num_stats, num_halves, num_heads]``; :func:`flatten` turns a list of entries into one dict
per (entry, half, head), every tensor moved to the host in one transfer. The record's keys and
their order: ``README.md``'s schema (:mod:`~nw_adapter.integration.schema` names the fields).

Nothing here reads the recorder: :func:`flatten` takes the step and run columns as functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nw_adapter.integration.schema import (
    CONTROL_RECORDED,
    H_EFF_REASON_FIELD,
    H_EFF_REASONS,
    STAT_NAMES,
    SUPPORT_REFERENCES,
    block_of,
    control_column,
    key_scale_column,
    support_columns,
)
from nw_adapter.integration.support import support_references

__all__ = ["CONTROL_COLUMNS", "CONTROL_ROWS", "Entry", "control_reason_field", "flatten"]


CONTROL_COLUMNS: tuple[int, ...] = tuple(STAT_NAMES.index(n) for n in CONTROL_RECORDED)
"""Rows of the stats tensor (:data:`STAT_NAMES` order) recorded for the scale-matched control: the
statistics of :data:`~nw_adapter.integration.schema.CONTROL_OF` this version computes."""

CONTROL_ROWS: int = len(CONTROL_COLUMNS) + 2
"""Rows of one draw's control tensor: the statistics of :data:`CONTROL_COLUMNS`, the key scale, then
the control's h_eff reason code (written as the text field ``h_eff_control_{k}_reason``)."""


def control_reason_field(draw: int) -> str:
    """``h_eff_control_{draw}_reason``: why draw ``draw``'s ``h_eff`` is NaN (None when identified)."""
    return f"{control_column('h_eff', draw)}_reason"


def _control_names(draws: int) -> list[list[str]]:
    """Per draw k, the record names of its :data:`CONTROL_ROWS` rows (``rho_control_k``, ...,
    ``key_scale_k``)."""
    return [[*(control_column(n, k) for n in CONTROL_RECORDED), key_scale_column(k)] for k in range(draws)]


@dataclass
class Entry:
    """One recorded softmax: where it was recorded and its statistics (device tensors)."""

    call: int
    step: int
    layer: str
    adapter: int
    image: int
    halves: tuple[str, ...]
    heads: tuple[int, ...]
    scale: float
    num_keys: int
    stats: torch.Tensor | None  # [num_stats, num_halves, num_heads], float32, on the model's device
    # (None while the statistics are pending: :attr:`NWRecorder.pending` fills it)
    key_set: str = "ip"  # "ip": the IP-Adapter keys; "joint": SD3's image + IP keys
    ip_mass: torch.Tensor | None = None  # [num_halves, num_heads]: SD3's attention mass on the IP keys
    control: torch.Tensor | None = None  # [draws, CONTROL_ROWS, num_halves, num_heads]: the control's
    support: torch.Tensor | None = None  # [support_rows(m), num_halves, num_heads]: a support set's


def _reason(code: float) -> str | None:
    """The text of h_eff's reason code (:data:`~nw_adapter.core.specification.H_EFF_REASONS`;
    None for 0: identified, or the readings off)."""
    return H_EFF_REASONS[int(code) - 1] if code >= 1 else None


def _support_names(rows: int) -> tuple[str, ...]:
    """The record names of a support tensor's ``rows`` rows
    (:func:`~nw_adapter.integration.support.support_values`)."""
    return support_columns(support_references(rows))[1:]


_Layout = tuple[int, int, bool, int, int]
"""An entry's layout: (halves, heads, with ip_mass, control draws, support rows) (:func:`_layout`)."""


def _layout(e: Entry) -> _Layout:
    """The entry's :data:`_Layout`: entries of one layout share their records' keys and rows' shape."""
    draws = 0 if e.control is None else e.control.shape[0]
    support = 0 if e.support is None else e.support.shape[0]
    return len(e.halves), len(e.heads), e.ip_mass is not None, draws, support


@dataclass(frozen=True)
class _RowPlan:
    """How the records of one :data:`_Layout` read their rows (:func:`_row_plan`).

    The entry's tensors, concatenated, have these rows per (half, head) cell: the statistics then
    h_eff's reason code (:data:`STAT_ROWS`), the ip_mass, per control draw its :data:`CONTROL_ROWS`
    rows (the last its reason code), then the support rows. A record's row is these reordered by
    ``order``: the values first, in record order, then the reason codes.
    """

    order: tuple[int, ...]  # the concatenated rows, in the record row's order
    keys: dict[str, int | None]  # the record's keys after the entry's fields, in record order: None,
    # but the support set's number of references
    values: tuple[str, ...]  # the names of the row's values (its first len(values) items)
    reasons: tuple[tuple[str, int], ...]  # each reason field and the place of its code in the row


def _row_plan(layout: _Layout) -> _RowPlan:
    """The :class:`_RowPlan` of ``layout``'s records."""
    _, _, mass, draws, support_rows = layout
    names = [*STAT_NAMES, H_EFF_REASON_FIELD]  # the concatenated rows' names
    codes = [len(STAT_NAMES)]  # the concatenated rows that hold a reason code
    if mass:
        names.append("ip_mass")
    for di, row_names in enumerate(_control_names(draws)):
        names += row_names
        codes.append(len(names))
        names.append(control_reason_field(di))
    keys = dict.fromkeys(names)
    if support_rows:  # the number of references (no row of its own), then the support rows
        support_names = _support_names(support_rows)
        names += support_names
        keys[SUPPORT_REFERENCES] = support_references(len(support_names))
        keys.update(dict.fromkeys(support_names))
    values = [i for i in range(len(names)) if i not in codes]
    return _RowPlan(
        order=(*values, *codes),
        keys=keys,
        values=tuple(names[i] for i in values),
        reasons=tuple((names[c], len(values) + j) for j, c in enumerate(codes)),
    )


def _rows(entries: list[Entry], layout: _Layout, plan: _RowPlan) -> torch.Tensor:
    """The rows of entries of one layout as ``[entries, cells, row]`` float32: cell ``h * heads + k``
    is the (half h, head k) record, its row ordered as ``plan`` says. One stack per tensor kind, not
    one op per entry."""
    n_h, n_k, mass, draws, support_rows = layout
    shape = (len(entries), -1, n_h * n_k)
    parts = [torch.stack([e.stats for e in entries]).float().reshape(shape)]
    if mass:
        parts.append(torch.stack([e.ip_mass for e in entries]).float().reshape(shape))
    if draws:
        parts.append(torch.stack([e.control for e in entries]).float().reshape(shape))
    if support_rows:
        parts.append(torch.stack([e.support for e in entries]).float().reshape(shape))
    rows = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    if plan.order != tuple(range(len(plan.order))):
        rows = rows.index_select(1, torch.tensor(plan.order, device=rows.device))
    return rows.transpose(1, 2)


def flatten(entries: list[Entry], step_info: Any, run_info: Any) -> list[dict[str, Any]]:
    """One record dict per (entry, half, head), in entry order, then half-major, head-minor; every
    tensor moved to the host in one transfer.

    ``step_info(call, step)`` gives the step's timestep and noise level columns, ``run_info(call)``
    the run's fields (:data:`~nw_adapter.integration.schema.RUN_KEYS`). A record's keys, in order:
    the entry's fields (call, step, the step's columns, layer, block), ``head``, ``half``, the
    entry's other fields (adapter ... key_set, the run's fields), then the statistics,
    ``h_eff_reason``, ``ip_mass``, per control draw its columns and reason, the support set's number
    of references and its columns (:attr:`_RowPlan.keys`).

    The entries are grouped by layout (:func:`_layout`); each group is one ``[entries, cells, row]``
    tensor (:func:`_rows`), whose ``tolist()`` gives each record's row as one list. A record is its
    entry's template (every key in order, the entry's fields filled in) copied, with the head, the
    half and the row's values written in; a reason field stays None unless its code is nonzero
    (:func:`_reason`).
    """
    layouts = [_layout(e) for e in entries]
    groups: dict[_Layout, list[int]] = {}
    for i, layout in enumerate(layouts):
        groups.setdefault(layout, []).append(i)
    plans = {layout: _row_plan(layout) for layout in groups}
    tensors = [
        _rows([entries[i] for i in members], layout, plans[layout]) for layout, members in groups.items()
    ]
    host = torch.cat([t.reshape(-1) for t in tensors]).cpu().split([t.numel() for t in tensors])
    rows_of: list[Any] = [None] * len(entries)
    for members, t, values in zip(groups.values(), tensors, host, strict=True):
        for i, rows in zip(members, values.reshape(t.shape).tolist(), strict=True):
            rows_of[i] = rows
    info_cache: dict[tuple[int, int], dict[str, float]] = {}
    run_cache: dict[int, dict[str, str]] = {}
    records: list[dict[str, Any]] = []
    append = records.append
    for e, layout, rows in zip(entries, layouts, rows_of, strict=True):
        plan = plans[layout]
        key = (e.call, e.step)
        if key not in info_cache:
            info_cache[key] = step_info(*key)
        if e.call not in run_cache:
            run_cache[e.call] = run_info(e.call)
        template = {
            "call": e.call, "step": e.step, **info_cache[key], "layer": e.layer, "block": block_of(e.layer),
            "head": None, "half": None,
            "adapter": e.adapter, "image": e.image, "scale": e.scale, "num_keys": e.num_keys,
            "key_set": e.key_set, **run_cache[e.call], **plan.keys,
        }  # fmt: skip
        names, reasons = plan.values, plan.reasons
        cells = iter(rows)
        for half in e.halves:
            of_half = template.copy()
            of_half["half"] = half
            for head, row in zip(e.heads, cells, strict=False):  # this half's heads only
                rec = of_half.copy()
                rec["head"] = head
                # the values (the reason codes follow them); zip without a keyword: one with costs
                # ~0.14 us a record (no vectorcall), and the plan fixes both lengths
                rec.update(zip(names, row))  # noqa: B905
                for field, at in reasons:
                    code = row[at]
                    if code:  # else None: identified, or the readings off
                        rec[field] = _reason(code)
                append(rec)
    return records
