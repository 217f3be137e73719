"""Streaming recorder of the NW-versus-attention statistics, step by step.

The NW processors hand the recorder per-layer statistics as device tensors of shape
``[num_stats, num_halves, num_heads]`` (no host sync during the run); everything is converted to
Python once, at export (:meth:`NWRecorder.to_records`, one transfer). The recorder only records:

- which step a denoiser forward belongs to is tracked by its
  :class:`~nw_adapter.integration.steps.StepTracker` (``rec.tracker``: a forward pre-hook on the
  denoiser); the processors read each pass from one
  :class:`~nw_adapter.integration.steps.StepContext` (:attr:`NWRecorder.context`, made once per pass);
- the optional raw maps are kept by a :class:`~nw_adapter.integration.maps.MapStore` (``rec.map_store``);
- the skipped (step, layer) pairs by a :class:`~nw_adapter.integration.skips.SkipLedger` (``rec.skips``);
- what stays here: the entries (:class:`~nw_adapter.integration.entries.Entry`), the nulls' seeded
  generators, the rollback of a failed layer, and the export as plain records
  (:meth:`NWRecorder.to_records`, laid out by :func:`~nw_adapter.integration.entries.flatten`).

Reporting lives in the layer above, :mod:`nw_adapter.analysis`. The recorder's user-facing report
methods (``summary``, ``plot``, ``to_json``, ``from_json``, ``heat_maps`` ...) are those of its base
class :class:`~nw_adapter.integration.reports.RecorderReports`, each of which imports its analysis
function when called: importing this module (or the processors) loads neither the reporting layer
nor matplotlib.
"""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path
from typing import Any

import torch

from nw_adapter.core.specification import STAT_ROWS
from nw_adapter.integration.config import SEED_LIMIT, NWProcessorConfig
from nw_adapter.integration.entries import CONTROL_COLUMNS, CONTROL_ROWS, Entry, flatten
from nw_adapter.integration.maps import MapStore
from nw_adapter.integration.reports import RecorderReports
from nw_adapter.integration.schema import (
    RECORDS_SCHEMA,
    STAT_NAMES,
    block_of,
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


class NWRecorder(RecorderReports):
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
        self._entries: list[Entry] = []
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
    ) -> Entry:
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
        entry = Entry(state.call, state.step, layer, adapter, image, halves, heads, float(scale), num_keys,
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
        return loaded + flatten(entries, self.tracker.step_info, self.run_fields)

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

    def maps(self) -> dict[str, torch.Tensor]:
        """Stored maps as ``{"<name>/attn": A, "<name>/nw": W}`` (device tensors)."""
        return self.map_store.tensors()

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
