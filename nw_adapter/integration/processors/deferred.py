"""Deferred statistics: an observed layer captures its softmax, the statistics run later, in bulk.

On a GPU the stock step is launch- and host-bound, so what observe adds per layer is paid one
aten op and one Python call at a time. An observed layer therefore only *queues* its call
(:meth:`DeferredStatistics.queue`: the pass's context, the call's image inputs and what its taps
captured, by reference; one append). At the flush each queued call is recorded in queue order, as
the layer would have: its softmaxes are found, their records reserved
(:meth:`~nw_adapter.integration.recorder.NWRecorder.reserve`, at the call's own step) and
*captured*: references to the float32 queries ``q [B, H, N, d]`` and image keys ``k [B, H, M,
d]`` (the tensors diffusers computed anyway: no copy, no aten op), with the bandwidth of the step.
Python run there, in one loop, costs a fraction of the same run between the denoiser's layers.
Layers whose maps are stored and installations with the untrained control record (capture) in
the layer instead.

:meth:`DeferredStatistics.flush` then computes every captured softmax's statistics at once,
**grouped by shape**: the captures of one group (same shapes, CFG halves, scale and bandwidth)
are concatenated along the batch, ``q = [q_1; q_2; ...]`` (one ``cat``), and one call of
:func:`~nw_adapter.integration.stats.softmax_statistics` with ``halves = sum_i halves_i`` gives
every statistic per (capture, half, head): the fast path reduces per (batch row, head) and
pools per CFG half, each half being a contiguous block of batch rows, so the stacked call
computes exactly what one call per capture computes (tests/integration/test_deferred.py). The
nulls' random numbers are drawn once per group from the call's seeded generator: the null rows
(``randperm``) are shared by the captures of a group, the permutation noise and the directions
are per batch row. The untrained-adapter control runs the same way, one call per draw and group.

When the flush runs:

- when the captured tensors exceed ``config.deferred_mb`` MiB (checked before the next capture),
- when a capture belongs to a new pipeline call (the previous call's are flushed first),
- before the recorder reports anything (:meth:`~nw_adapter.integration.recorder.NWRecorder.settle`).

Memory bound: at most ``deferred_mb`` MiB of captured tensors plus one capture (the references
keep diffusers' query tensors alive until the flush). ``deferred_mb=0`` computes each softmax
in its layer (the per-layer path); so do layers whose maps are stored. With ``compile=True``
each group's call is the compiled function (one graph per group shape; on CUDA under CUDA
graphs, :mod:`~nw_adapter.integration.stats.compiled`).

Failures: a group that raises is retried capture by capture; a capture that still raises drops
every entry of its (call, step, layer) and is counted as a skipped pair
(:meth:`~nw_adapter.integration.recorder.NWRecorder.skip`), as the per-layer path does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nw_adapter.integration import stats
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.control import scale_matched
from nw_adapter.integration.processors.selection import resolve_bandwidth
from nw_adapter.integration.recorder import CONTROL_COLUMNS

MIB = 2**20


@dataclass(eq=False)
class Capture:
    """One softmax of one observed layer call, its statistics pending.

    ``q`` [B, H, N, d] and ``k`` [B, H, M, d] float32; ``scale`` the stock softmax scale s (the
    bandwidth rules and the control read it); ``h`` the step's bandwidth (a float) or None for the
    data-dependent rules (resolved on the group); ``halves`` the number of CFG halves of the batch;
    ``control_keys`` the untrained control's keys per draw ``[B, H, M0, d]``; ``entry`` the
    recorder's reserved entry. ``swap_h``: in swap, the bandwidth of the swapped branch (a float or
    ``[B, H]``); the recorded softmax is then that branch's own, the exact NW head
    ``softmax((q.k_i - ||k_i||^2 / 2) / swap_h^2)`` (:func:`recorded_head`); None: the stock
    dot-product softmax ``softmax(s q.k_i)``."""

    entry: Any
    q: torch.Tensor
    k: torch.Tensor
    scale: float
    h: float | None
    halves: int
    control_keys: tuple[torch.Tensor, ...] = ()
    swap_h: float | torch.Tensor | None = None

    def group_key(self) -> tuple:
        """Captures with equal keys are computed in one call. A float bandwidth ``h`` and a float
        swap bandwidth are not part of the key: captures of different steps (the schedule rule, a
        swapped head's 1/h^2) are stacked with a per-row ``[B, H]`` h and softmax scale
        (:func:`stacked_bandwidths`); a per-head swap bandwidth is computed alone."""
        controls = tuple(k0.shape for k0 in self.control_keys)
        swap = ("tensor", id(self)) if isinstance(self.swap_h, torch.Tensor) else self.swap_h is not None
        rule = "data" if self.h is None else "given"
        return (self.q.shape, self.k.shape, self.q.device, self.scale, rule, self.halves, controls, swap)

    @property
    def nbytes(self) -> int:
        q, k = self.q, self.k
        size = q.numel() * q.element_size() + k.numel() * k.element_size()
        if self.control_keys:
            size += sum(k0.numel() * k0.element_size() for k0 in self.control_keys)
        return size


@dataclass(eq=False)
class LayerCall:
    """One observed layer call whose recording itself is deferred (:meth:`DeferredStatistics.queue`):
    the processor, the pass's context, the attention module, the call's image inputs and what its
    taps captured (the tensors diffusers computed; kept by reference)."""

    processor: Any
    ctx: Any
    attn: Any
    inputs: Any
    captured: dict


@dataclass
class DeferredStatistics:
    """The pending captures and queued layer calls of one recorder (see the module docstring)."""

    config: NWProcessorConfig
    captures: list[Capture] = field(default_factory=list)
    layers: list[LayerCall] = field(default_factory=list)
    nbytes: int = 0
    call: int | None = None

    def __len__(self) -> int:
        return len(self.captures) + len(self.layers)

    def add(self, capture: Capture) -> None:
        """Keep ``capture`` until the next flush."""
        self.captures.append(capture)
        self.nbytes += capture.nbytes
        self.call = capture.entry.call

    def queue(self, processor: Any, ctx: Any, attn: Any, inputs: Any, captured: dict) -> None:
        """Keep one layer call to record at the next flush: in the layer only one append (its
        softmaxes are found, reserved and captured at the flush, in queue order, from the pass's
        context; Python run there in one loop costs a fraction of the same run between a UNet's
        layers, measured 216 against 226 ms per proxy call)."""
        size = 0
        for outputs in captured.values():  # what the taps captured (not swap's groups and keys)
            if isinstance(outputs, list):
                for t in outputs:
                    if isinstance(t, torch.Tensor):
                        size += t.numel() * t.element_size()
        self.layers.append(LayerCall(processor, ctx, attn, inputs, captured))
        self.nbytes += size
        self.call = ctx.state.call

    def due(self, call: int) -> bool:
        """Whether to flush before a capture of ``call``: over the memory bound, or a new call."""
        return bool(self.captures or self.layers) and (
            self.nbytes > self.config.deferred_mb * MIB or call != self.call
        )

    def clear(self) -> None:
        """Drop every pending capture and queued layer call (their entries are dropped by the recorder)."""
        self.captures, self.layers, self.nbytes = [], [], 0

    def flush(self, recorder: Any) -> None:
        """Record the queued layer calls (their captures join the pending ones), then compute every
        pending capture's statistics into its entry, grouped by shape."""
        layers, self.layers = self.layers, []
        with torch.no_grad():
            for layer in layers:  # reserves entries in queue order and adds their captures
                layer.processor._record_queued(layer)
        captures, live = self.captures, {id(e) for e in recorder._entries}
        self.clear()
        groups: dict[tuple, list[Capture]] = {}
        for capture in captures:
            if id(capture.entry) in live:  # entries rolled back or discarded since are not computed
                groups.setdefault(capture.group_key(), []).append(capture)
        failed: dict[tuple[int, int, str], BaseException] = {}
        with torch.no_grad():
            for group in groups.values():
                try:
                    self._compute(recorder, group)
                except Exception:  # noqa: BLE001 - retried one by one to isolate the failing pair
                    for capture in group:
                        try:
                            self._compute(recorder, [capture])
                        except Exception as error:  # noqa: BLE001 - counted, never raised
                            e = capture.entry
                            failed.setdefault((e.call, e.step, e.layer), error)
        if failed:
            recorder._entries = [e for e in recorder._entries if (e.call, e.step, e.layer) not in failed]
            for (call, step, layer), error in failed.items():
                recorder.skip(layer, error, call=call, step=step)

    def _compute(self, recorder: Any, group: list[Capture]) -> None:
        """One call of the statistics for the captures of ``group`` (equal group keys)."""
        cfg, first = self.config, group[0]
        q = torch.cat([c.q for c in group]) if len(group) > 1 else first.q
        k = torch.cat([c.k for c in group]) if len(group) > 1 else first.k
        halves = first.halves * len(group)
        draws = None
        if cfg.nulls:
            generator = recorder.generator(q.device, call=first.entry.call)
            draws = stats.draw_nulls(q, k.shape[-2], cfg.null_rows, generator)
        common = statistics_options(cfg, first.scale, halves)
        if first.h is None:
            h: torch.Tensor | float = group_bandwidth(cfg, q, k, first.scale)
        else:
            h = stacked_bandwidths([c.h for c in group], group, q)
        swap_h = first.swap_h
        if swap_h is not None and not isinstance(swap_h, torch.Tensor):
            swap_h = stacked_bandwidths([c.swap_h for c in group], group, q)
        values, _, _ = stats.softmax_statistics(q, k, h=h, draws=draws, **recorded_head(common, swap_h))
        control = None
        if first.control_keys:
            per_draw = []
            for d, single in enumerate(first.control_keys):
                k0 = torch.cat([c.control_keys[d] for c in group]) if len(group) > 1 else single
                per_draw.append(control_statistics(cfg, q, k, k0, h, common))
            control = torch.stack(per_draw)  # [draws, CONTROL_ROWS, halves, H]
        n = first.halves
        for i, capture in enumerate(group):
            capture.entry.stats = values[:, i * n : (i + 1) * n]
            if control is not None:
                capture.entry.control = control[:, :, i * n : (i + 1) * n]


def statistics_options(config: NWProcessorConfig, scale: float, halves: int) -> dict[str, Any]:
    """The keyword arguments of :func:`~nw_adapter.integration.stats.softmax_statistics` that come from
    the configuration, the softmax scale and the CFG halves (the deferred and per-layer paths alike)."""
    return {
        "scale": scale, "halves": halves, "compile": config.compile, "readings": config.readings,
        "fit_rows": config.fit_rows,
    }  # fmt: skip


def stacked_bandwidths(values: list[Any], group: list[Capture], like: torch.Tensor) -> torch.Tensor | float:
    """The float bandwidths of a group's captures, one per capture: the float itself when they are
    all equal (one graph, no tensor), else ``[B_total, H]`` with each capture's value on its batch
    rows (the stacked captures' order)."""
    first = values[0]
    if all(v == first for v in values):
        return float(first)
    heads = like.shape[1]
    rows = [
        torch.full((c.q.shape[0], heads), float(v), dtype=torch.float32)
        for c, v in zip(group, values, strict=True)
    ]
    return torch.cat(rows).to(like.device)


def recorded_head(common: dict[str, Any], swap_h: float | torch.Tensor | None) -> dict[str, Any]:
    """The options of the recorded softmax: the stock dot-product one (``common``) in observe; in
    swap (``swap_h``, the swapped branch's bandwidth) the branch's own head, ``scale = 1/swap_h^2``
    with the key-norm term (``key_norm_weight=1``): A = softmax(-||q - k_i||^2 / 2 swap_h^2), the
    weights that produce the output. The control keeps ``common`` (the stock algebra)."""
    if swap_h is None:
        return common
    inv = swap_h.float().reciprocal().square() if isinstance(swap_h, torch.Tensor) else float(swap_h) ** -2
    return {**common, "scale": inv, "key_norm_weight": 1.0}


def group_bandwidth(
    config: NWProcessorConfig, q: torch.Tensor, k: torch.Tensor, scale: float
) -> torch.Tensor:
    """h ``[B, H]`` of a data-dependent rule (median, fitted) on stacked captures: per (batch row,
    head), so stacking changes nothing."""
    return resolve_bandwidth(config, None, q, k, scale)  # type: ignore[arg-type]


def control_statistics(
    config: NWProcessorConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    k0: torch.Tensor,
    h: torch.Tensor | float,
    common: dict[str, Any],
) -> torch.Tensor:
    """One control draw's rows ``[CONTROL_ROWS, halves, H]``: the statistics of :data:`CONTROL_COLUMNS`
    of ``q`` against the scale-matched keys ``k0m = k0 key_rms(k) / key_rms(k0)`` (no nulls, the
    same bandwidth rule applied to ``k0m``), the key scale ``key_rms(k) / key_rms(k0)`` averaged
    over each half's rows, then the control's h_eff reason code (the last row of the statistics).

    ``h``: the trained keys' bandwidth; the rules that read no keys (fixed, matched, schedule)
    give the control the same value (a float, or ``[B, H]`` for captures of several steps stacked),
    the data-dependent ones are applied to ``k0m``."""
    halves, scale = common["halves"], common["scale"]
    matched, ratio = scale_matched(k, k0)  # [B, H, M0, d], [B, H]
    data_dependent = config.bandwidth in ("median", "fitted")
    h0 = group_bandwidth(config, q, matched, scale) if data_dependent else h
    values0, _, _ = stats.softmax_statistics(q, matched, h=h0, draws=None, **common)
    picked = values0.index_select(0, _control_index(values0.device))
    key_scale = ratio.float().view(halves, ratio.shape[0] // halves, ratio.shape[1]).mean(dim=1)
    return torch.cat([picked, key_scale.to(picked.device)[None], values0[-1:]], dim=0)


_CONTROL_INDEX: dict[torch.device, torch.Tensor] = {}


def _control_index(device: torch.device) -> torch.Tensor:
    """:data:`CONTROL_COLUMNS` as an index tensor on ``device`` (made once per device)."""
    index = _CONTROL_INDEX.get(device)
    if index is None:
        index = _CONTROL_INDEX[device] = torch.tensor(CONTROL_COLUMNS, device=device)
    return index
