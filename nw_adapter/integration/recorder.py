"""Streaming recorder of the NW-versus-attention statistics, step by step.

The NW processors hand the recorder per-layer statistics as device tensors of shape
``[num_stats, num_halves, num_heads]`` (no host sync during the run); everything is converted to
Python once, at export (:meth:`NWRecorder.to_records`, one transfer). The recorder only records:

- which step a denoiser forward belongs to is tracked by its
  :class:`~nw_adapter.integration.steps.StepTracker` (a forward pre-hook on the denoiser); the
  processors read each pass from one :class:`~nw_adapter.integration.steps.StepContext`
  (:attr:`NWRecorder.context`, made once per pass), not from the recorder's pass-throughs;
- the optional raw maps are kept by a :class:`~nw_adapter.integration.maps.MapStore`;
- what stays here: the entries, the nulls' seeded generators, the ledger of skipped
  (step, layer) pairs and their export as plain records (:meth:`NWRecorder.to_records`).

Reporting lives in the layer above, :mod:`nw_adapter.analysis`: summaries, tables, CSV,
dataframes and figures of the records (:class:`~nw_adapter.analysis.records.Records`), the records
file (:mod:`~nw_adapter.analysis.records_file`) and the heat maps
(:mod:`~nw_adapter.analysis.heatmaps`). The recorder's user-facing methods (:meth:`NWRecorder.summary`,
:meth:`~NWRecorder.plot`, :meth:`~NWRecorder.to_json`, ...) are thin: each imports its analysis
function when called, so importing this module (or the processors) loads neither the reporting
layer nor matplotlib.
"""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nw_adapter.core.specification import STAT_ROWS
from nw_adapter.integration.config import SEED_LIMIT, NWProcessorConfig
from nw_adapter.integration.maps import MapStore
from nw_adapter.integration.schema import (
    CONTROL_RECORDED,
    H_EFF_REASON_FIELD,
    H_EFF_REASONS,
    RECORDS_SCHEMA,
    STAT_NAMES,
    SUPPORT_REFERENCES,
    block_of,
    control_column,
    key_scale_column,
    support_columns,
)
from nw_adapter.integration.settings import SETTINGS_FIELD, config_settings, scale_settings, settings_digest
from nw_adapter.integration.skips import SkipLedger, failed_steps_line
from nw_adapter.integration.steps import StepContext, StepState, StepTracker
from nw_adapter.integration.support import support_references

__all__ = [
    "RECORDS_SCHEMA",
    "STAT_NAMES",
    "CONTROL_COLUMNS",
    "CONTROL_ROWS",
    "NWRecorder",
    "StepContext",
    "StepState",
    "block_of",
]


def __getattr__(name: str) -> Any:
    """``Summary``, the summary type, now :class:`nw_adapter.analysis.records.Summary`, imported
    on first access (PEP 562) so that importing the recorder does not load the reporting layer."""
    if name == "Summary":
        from nw_adapter.analysis.records import Summary

        return Summary
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
class _Entry:
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


def _layout(e: _Entry) -> _Layout:
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


def _rows(entries: list[_Entry], layout: _Layout, plan: _RowPlan) -> torch.Tensor:
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


def _flatten(entries: list[_Entry], step_info: Any, run_info: Any) -> list[dict[str, Any]]:
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


class NWRecorder:
    """Accumulates per (call, step, layer, head, CFG half, adapter, image) statistics.

    Args:
        config: the processor configuration (selection of steps, heads, maps, nulls, seed).
        pipe: the pipeline whose ``scheduler`` gives the noise level and whose
            ``do_classifier_free_guidance`` tells whether the batch is [uncond; cond].
            Optional: without it, drive the recorder with :meth:`begin_step`.

    Attributes:
        run_id: this recorder's run, written in every record's ``run`` (random; the command line
            sets its own, one per run): the verdict never averages one reference (or call) over
            records of several runs. Set it before recording to name a run.
        tracker: the :class:`~nw_adapter.integration.steps.StepTracker` (``state`` is its state).
        map_store: the :class:`~nw_adapter.integration.maps.MapStore` of the optional maps.
        skips: the :class:`~nw_adapter.integration.skips.SkipLedger` of observe's failures.

    Example:
        >>> rec = pipe.set_ip_adapter_nw_processor(mode="observe")
        >>> pipe(prompt="a cat", ip_adapter_image=image, num_inference_steps=10)
        >>> rec.summary()            # a table at the REPL; a list of dicts in code
        >>> rec.to_json("records.json"); NWRecorder.from_json("records.json").plot()
    """

    def __init__(self, config: NWProcessorConfig | None = None, pipe: Any = None) -> None:
        self.config = config if config is not None else NWProcessorConfig()
        self.pipe = pipe
        self.tracker = StepTracker(pipe, cfg=self.config.cfg, on_error=self.skip)
        self.map_store = MapStore(self.config)
        self._entries: list[_Entry] = []
        self.skips = SkipLedger()
        self._generators: dict[torch.device, torch.Generator] = {}
        self._generators_serial = -1  # the tracker's call_serial the generators were seeded for
        self._past_generators: dict[tuple[int, torch.device], torch.Generator] = {}
        self._loaded: list[dict[str, Any]] = []  # records read by from_json
        self.source: dict[str, Any] | None = None
        self.run_id = uuid.uuid4().hex[:12]
        #: The processors' pending statistics (captured softmaxes whose statistics are computed
        #: together later, :mod:`~nw_adapter.integration.processors.deferred`); None until the
        #: first capture. Anything with ``__len__`` and ``flush(recorder)``.
        self.pending: Any = None
        #: The processors' taps (:class:`~nw_adapter.integration.processors.base.Taps`): hooks kept on
        #: the attention modules while the processors serve them, removed by :meth:`detach`.
        self.taps: list[Any] = []
        self._context: StepContext | None = None

    # ------------------------------------------------------------------ steps (the tracker's)
    @property
    def state(self) -> StepState:
        """Where the current denoiser forward sits (:class:`~nw_adapter.integration.steps.StepState`)."""
        return self.tracker.state

    @property
    def context(self) -> StepContext:
        """The current denoiser pass as the processors read it: its state, CFG layout and step
        selection, and a memo shared by its layers (:class:`~nw_adapter.integration.steps.StepContext`),
        made once per pass (when the tracker's state is a new one)."""
        ctx, state = self._context, self.tracker.state
        if ctx is None or ctx.state is not state:
            config = self.config
            cfg = state.cfg if config.cfg is None else config.cfg
            selected = config.steps is None or state.step in config.steps
            ctx = self._context = StepContext(state, cfg, selected)
        return ctx

    @property
    def _steps(self) -> dict[tuple[int, int], StepState]:
        return self.tracker.steps

    def attach(self, denoiser: torch.nn.Module, *, timestep_scale: float = 1.0) -> None:
        """Track the steps of ``denoiser`` (see :meth:`~nw_adapter.integration.steps.StepTracker.attach`)."""
        self.tracker.attach(denoiser, timestep_scale=timestep_scale)

    def detach(self) -> None:
        """Remove the denoiser forward pre-hook and the processors' taps (their hooks on the
        attention modules, :attr:`taps`), after computing the statistics still pending (so a
        failure among them is counted, and warned about, before the installation ends)."""
        self.settle()
        self.tracker.detach()
        for taps in self.taps:
            taps.remove()
        self.taps.clear()

    def new_call(self) -> None:
        """Mark the next denoiser forward as the start of a new call (needed only without a pipeline)."""
        self.tracker.new_call()

    def begin_step(
        self,
        *,
        call: int = 0,
        step: int = 0,
        timestep: Any = math.nan,
        alpha: float = math.nan,
        sigma: float = math.nan,
        cfg: bool = False,
        latent_hw: tuple[int, int] | None = None,
        pass_index: int = 0,
        perturbed: bool = False,
    ) -> None:
        """Set the current step by hand (the denoiser pre-hook does it for you); the arguments are
        :meth:`~nw_adapter.integration.steps.StepTracker.begin_step`'s (a new ``call`` reseeds the nulls)."""
        self.tracker.begin_step(
            call=call, step=step, timestep=timestep, alpha=alpha, sigma=sigma, cfg=cfg,
            latent_hw=latent_hw, pass_index=pass_index, perturbed=perturbed,
        )  # fmt: skip

    @property
    def cfg(self) -> bool:
        """Whether the current batch is [uncond; cond]: ``config.cfg`` if set, else the step's value."""
        return self.context.cfg

    def generator(self, device: torch.device, call: int | None = None) -> torch.Generator:
        """The seeded generator of the nulls on ``device`` (reseeded at every new call).

        Call ``c`` uses seed ``(seed + 1_000_003 c) mod 2**63``, inside the generator's range for
        every valid seed and any number of calls. ``call``: the generator of that call (the
        deferred statistics of a finished call), kept apart from the current call's.
        """
        if call is not None and call != self.state.call:
            key = (call, device)
            past = self._past_generators.get(key)
            if past is None:
                past = torch.Generator(device=device)
                past.manual_seed((self.config.seed + 1_000_003 * call) % SEED_LIMIT)
                self._past_generators = {key: past}  # one finished call at a time
            return past
        if self._generators_serial != self.tracker.call_serial:
            self._generators.clear()
            self._generators_serial = self.tracker.call_serial
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed((self.config.seed + 1_000_003 * self.state.call) % SEED_LIMIT)
            self._generators[device] = gen
        return gen

    # ------------------------------------------------------------------ accumulation
    def wants_step(self) -> bool:
        """Whether the current step is selected by ``config.steps``."""
        return self.context.selected

    def add(
        self,
        *,
        layer: str,
        adapter: int,
        image: int,
        halves: tuple[str, ...],
        heads: tuple[int, ...],
        scale: float,
        num_keys: int,
        stats: torch.Tensor,
        key_set: str = "ip",
        ip_mass: torch.Tensor | None = None,
        control: torch.Tensor | None = None,
        support: torch.Tensor | None = None,
    ) -> None:
        """Store one layer's statistics, ``stats`` of shape [len(STAT_ROWS), len(halves), len(heads)]
        (:data:`~nw_adapter.core.specification.STAT_ROWS`: the statistics, then h_eff's reason code,
        written as the record's text column ``h_eff_reason``).

        ``key_set`` names the keys of the compared softmax (:data:`~nw_adapter.integration.schema.KEY_SETS`);
        ``ip_mass`` [len(halves), len(heads)] is the joint softmax's mass on the IP keys (SD3 only);
        ``control`` [draws, CONTROL_ROWS, len(halves), len(heads)] the scale-matched control's
        statistics per draw (:data:`CONTROL_COLUMNS`, then the key scale; recorded as
        ``{X}_control_{k}`` and ``key_scale_{k}``), when the control is on; ``support``
        [support_rows(m), len(halves), len(heads)] a support set's per-reference masses and entropies
        (:func:`~nw_adapter.integration.support.support_values`; recorded as the columns of
        :func:`~nw_adapter.integration.schema.support_columns`) when the softmax spans m > 1 references.
        """
        if stats.shape != (len(STAT_ROWS), len(halves), len(heads)):
            raise ValueError(
                f"stats must have shape {(len(STAT_ROWS), len(halves), len(heads))}, got {tuple(stats.shape)}"
            )
        expected = (CONTROL_ROWS, len(halves), len(heads))
        if control is not None and (control.dim() != 4 or tuple(control.shape[1:]) != expected):
            raise ValueError(f"control must have shape (draws, *{expected}), got {tuple(control.shape)}")
        entry = self.reserve(
            layer=layer, adapter=adapter, image=image, halves=halves, heads=heads, scale=scale,
            num_keys=num_keys, key_set=key_set, ip_mass=ip_mass, support=support,
        )  # fmt: skip
        entry.stats = stats.detach()
        entry.control = None if control is None else control.detach()

    def reserve(
        self,
        *,
        layer: str,
        adapter: int,
        image: int,
        halves: tuple[str, ...],
        heads: tuple[int, ...],
        scale: float,
        num_keys: int,
        key_set: str = "ip",
        ip_mass: torch.Tensor | None = None,
        support: torch.Tensor | None = None,
        state: StepState | None = None,
    ) -> _Entry:
        """The entry of one softmax at the (call, step) of ``state`` (default: the current one), in
        recording order, its statistics still to come (``stats`` None): whoever computes them
        (:meth:`add`, or the processors' deferred statistics through :attr:`pending`) sets
        ``entry.stats`` and ``entry.control``. ``support`` (see :meth:`add`) is stored as given: a
        support set's columns are not deferred."""
        mass = None if ip_mass is None else ip_mass.detach()
        state = self.tracker.state if state is None else state
        if support is not None and (
            support.dim() != 3
            or tuple(support.shape[1:]) != (len(halves), len(heads))
            or support_references(support.shape[0]) < 2
        ):
            shape = tuple(support.shape)
            raise ValueError(f"support must have shape (m + 2, {len(halves)}, {len(heads)}), m > 1: {shape}")
        support = None if support is None else support.detach()
        entry = _Entry(state.call, state.step, layer, adapter, image, halves, heads, float(scale), num_keys,
                       None, key_set, mass, support=support)  # fmt: skip
        self._entries.append(entry)
        return entry

    def settle(self) -> None:
        """Compute the statistics still pending (:attr:`pending`) into their entries; every export
        and count calls it first. Failures there are counted as skipped pairs (:meth:`skip`)."""
        if self.pending is not None and len(self.pending):
            self.pending.flush(self)

    def wants_maps(self, layer: str) -> bool:
        """Whether maps of ``layer`` at the current step are to be stored."""
        return self.map_store.wants(layer, self.state.step)

    def add_maps(
        self,
        *,
        layer: str,
        adapter: int,
        image: int,
        attn: torch.Tensor,
        nw: torch.Tensor,
        meta: dict[str, str],
    ) -> None:
        """Keep one pair of maps (already reduced) unless the ``map_max_mb`` cap is reached."""
        name = f"call{self.state.call}/step{self.state.step}/{layer}/adapter{adapter}/image{image}"
        self.map_store.add(name, attn, nw, meta)

    # ------------------------------------------------------------------ failures (observe)
    def mark(self) -> tuple[int, int]:
        """A position in the stored entries and maps, for :meth:`skip` to roll back to."""
        return len(self._entries), len(self.map_store)

    def skip(
        self,
        layer: str,
        error: BaseException,
        *,
        rollback: tuple[int, int] | None = None,
        call: int | None = None,
        step: int | None = None,
    ) -> None:
        """Count a (step, layer) pair whose side computation failed (the layer kept its output).

        Warns once per recorder (``warnings.warn``, RuntimeWarning); every pair is counted in
        :meth:`skipped` and exported by :meth:`to_json`.

        Args:
            layer: the attention-processor name.
            error: the exception raised by the side computation.
            rollback: a :meth:`mark` taken before the layer's side computation: what the layer
                stored after it is dropped, so a pair is either fully recorded or skipped.
            call, step: the pair's call and step (default: the current ones; deferred statistics
                fail after their step).
        """
        if rollback is not None:
            n_entries, n_maps = rollback
            del self._entries[n_entries:]
            self.map_store.truncate(n_maps)
        swap = self.config.mode == "swap"
        call = self.state.call if call is None else call
        step = self.state.step if step is None else step
        self.skips.add(call=call, step=step, layer=layer, error=error, swap=swap)

    def skipped(self) -> dict[str, Any]:
        """The skipped (call, step, layer) pairs: ``{"count", "by_reason", "pairs"}``
        (:meth:`~nw_adapter.integration.skips.SkipLedger.summary`)."""
        self.settle()
        return self.skips.summary()

    def failed_steps(self) -> list[dict[str, Any]]:
        """The steps whose side computation failed in every layer that ran it (no statistics at
        all): ``{"call", "step", "layers", "reason"}`` each
        (:meth:`~nw_adapter.integration.skips.SkipLedger.failed_steps`)."""
        self.settle()
        return self.skips.failed_steps({(e.call, e.step) for e in self._entries})

    def failed_steps_line(self, *, see: str | None = "recorder.skipped()") -> str | None:
        """:meth:`failed_steps` in one line (None when no step failed in every layer); ``see``:
        where the skipped pairs are listed (None: not said)."""
        return failed_steps_line(self.failed_steps(), see=see)

    def discard_call(self, call: int | None = None) -> int:
        """Drop the statistics and maps of pipeline call ``call`` (default: the current one).

        The companion pipelines call it when a call raises or is interrupted (Ctrl-C): a partial
        call's records are dropped, not mixed with complete ones. Returns the number of records
        dropped (one per head and half, as :meth:`to_records` counts them).
        """
        self.settle()
        call = self.state.call if call is None else call
        kept = [e for e in self._entries if e.call != call]
        dropped = sum(len(e.halves) * len(e.heads) for e in self._entries if e.call == call)
        self._entries = kept
        self.map_store.drop_call(call)
        return dropped

    def clear(self) -> None:
        """Drop all recorded statistics, maps and skipped pairs (step tracking continues)."""
        if self.pending is not None:
            self.pending.clear()
        self._entries.clear()
        self.map_store.truncate(0)
        self._loaded.clear()
        self.skips.clear()

    # ------------------------------------------------------------------ export
    def to_records(self, key_set: str | None = "ip") -> list[dict[str, Any]]:
        """One dict per (call, step, layer, head, half, adapter, image); see the README schema.

        All statistic tensors are concatenated and moved to the host in one transfer.

        Args:
            key_set: keep the records of this key set only: ``"ip"`` (default: the softmax over
                the IP-Adapter keys, every family), ``"joint"`` (SD3: its image branch's softmax
                over the image's own keys and the IP keys), or None for all.
        """
        self.settle()
        loaded = [dict(r) for r in self._loaded if key_set is None or r.get("key_set", "ip") == key_set]
        entries = [e for e in self._entries if key_set is None or e.key_set == key_set]
        if not entries:
            return loaded
        return loaded + _flatten(entries, self.tracker.step_info, self.run_fields)

    def run_fields(self, call: int) -> dict[str, str]:
        """The fields of :data:`~nw_adapter.integration.schema.RUN_KEYS` of ``call``'s records:
        ``run`` (:attr:`run_id`), ``model`` (the pipeline's ``name_or_path``, else its class;
        absent without a pipeline), ``mode``, ``settings`` (the digest of the settings that change
        what a reading means, :mod:`~nw_adapter.integration.settings`: this config's, the call's
        steps / scheduler / guidance / latent size, the distinct IP-Adapter scales of its recorded
        layers) and ``input_digest`` (the call's IP-Adapter image embeddings,
        :func:`~nw_adapter.integration.steps.input_digest`; absent when unknown)."""
        fields = {"run": self.run_id}
        if self.pipe is not None:
            fields["model"] = str(getattr(self.pipe, "name_or_path", None) or type(self.pipe).__name__)
        fields["mode"] = self.config.mode
        settings = {
            **config_settings(self.config),
            **self.tracker.call_settings_of(call),
            **scale_settings(e.scale for e in self._entries if e.call == call),
        }
        fields[SETTINGS_FIELD] = settings_digest(settings)
        digest = self.tracker.input_digest_of(call)
        if digest is not None:
            fields["input_digest"] = digest
        return fields

    @property
    def loaded_records(self) -> list[dict[str, Any]]:
        """The records read by :meth:`from_json` (empty for a recorder that records)."""
        return self._loaded

    # ------------------------------------------------------------------ reports (the analysis layer's)
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
    def from_json(cls, path: str | os.PathLike) -> NWRecorder:
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

    def maps(self) -> dict[str, torch.Tensor]:
        """Stored maps as ``{"<name>/attn": A, "<name>/nw": W}`` (device tensors)."""
        return self.map_store.tensors()

    def heat_maps(self, kind: str = "attn", **selection: Any):
        """Heat maps per image token of the stored maps, in memory (needs ``store_maps=True``).

        ``kind``: ``"attn"`` (A), ``"nw"`` (W) or ``"diff"`` (A - W); ``selection``: ``steps``,
        ``layers``, ``heads``, ``batch_row``, ``adapter``, ``image``, ``image_hw`` (see
        :func:`~nw_adapter.analysis.heatmaps.heat_maps`). Returns a
        :class:`~nw_adapter.analysis.heatmaps.TokenHeatMaps`; ``.plot_overlay(image)`` draws it.
        """
        from nw_adapter.analysis.heatmaps import heat_maps

        return heat_maps(self, kind, **selection)

    def save_maps(self, path: str | os.PathLike) -> Path:
        """Save the stored maps with safetensors (atomic), metadata = config and per-map layout.

        Each map is ``[batch, heads (or 1 with head-mean), rows, keys]``; rows are query tokens
        (row-major over the downsampled latent grid).
        """
        return self.map_store.save(path)

    def __len__(self) -> int:
        self.settle()
        return len(self._loaded) + sum(len(e.halves) * len(e.heads) for e in self._entries)

    def __repr__(self) -> str:
        return (
            f"NWRecorder(mode={self.config.mode!r}, bandwidth={self.config.bandwidth!r}, "
            f"records={len(self)}, maps={len(self.map_store)})"
        )
