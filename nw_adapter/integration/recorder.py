"""Streaming recorder of the NW-versus-attention statistics, step by step.

The recorder learns the denoising step from a forward pre-hook on the denoiser (a UNet or a
transformer; not from ``cross_attention_kwargs``), receives per-layer statistics from the NW
processors as device tensors of shape ``[num_stats, num_halves, num_heads]`` (no host sync
during the run), and converts everything to Python once, at export.

Step tracking (see :meth:`NWRecorder.attach`):

- **Calls.** A new pipeline call is detected when ``pipe.scheduler.timesteps`` is a different
  tensor object than at the previous denoiser forward (``set_timesteps`` creates a new tensor
  at the start of every call). Without a pipeline (a bare UNet) call :meth:`NWRecorder.new_call`
  before each sampling loop; the mixin pipelines also call it.
- **Steps.** The step label is the index ``i`` of the step in ``scheduler.timesteps``, never a
  count of denoiser forwards, so that ``timestep == scheduler.timesteps[i]`` and the noise level
  is row ``i`` of the scheduler's own table, also on truncated schedules (img2img and
  inpainting with ``strength < 1``, SDXL ``denoising_start`` / ``denoising_end``: the first
  recorded step is then not 0). ``i`` is the scheduler's own ``step_index`` when it has one
  (Euler, DPM-Solver, LCM, flow matching ...; before the first ``scheduler.step`` its
  ``begin_index``), else the position of the received timestep in ``scheduler.timesteps``
  (DDIM, DDPM, PNDM: one host read of the timestep per forward), searched after the previous
  step of the call, so PNDM's repeated timestep is a step of its own and the labels equal
  ``scheduler.timesteps`` entry by entry. Without a scheduler (a bare UNet), or for a
  timestep off its table, every forward is the next step and the level is NaN (or
  interpolated from ``alphas_cumprod`` at the timestep).
- **Passes.** A denoiser forward that does not advance the scheduler (same ``step_index`` /
  PNDM ``counter``; for a scheduler without either, the same timestep again with no later
  entry equal to it) is a further pass of the same step: Flux's true CFG runs the transformer
  twice per step (positive, then negative). The step is recorded once and
  :attr:`StepState.pass_index` counts the passes (0, 1, ...), for the processors to label.
- **Timestep conventions.** The timestep is read from the keyword ``timestep`` or the
  forward's positional parameter of that name, times ``timestep_scale`` (1000 for Flux, whose
  pipeline passes ``timestep / 1000``), so labels are in ``scheduler.timesteps`` units.
"""

from __future__ import annotations

import csv
import json
import math
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nw_adapter.atomic import atomic_write, atomic_write_text
from nw_adapter.integration.config import SEED_LIMIT, NWProcessorConfig
from nw_adapter.integration.schedules import noise_level, schedule_table
from nw_adapter.integration.schema import (
    LEGACY_NAMES,
    NULL_STATS,
    OPTIONAL_STATS,
    RECORD_KEYS,
    SKIPPED_FIELD,
    STAT_NAMES,
    SUMMARY_STATS,
    finite_mean,
)
from nw_adapter.integration.validation import check_records_file


def block_of(layer: str) -> str:
    """``"down"``, ``"mid"`` or ``"up"`` from an attention-processor name (else ``"other"``)."""
    for prefix, block in (("down_blocks", "down"), ("mid_block", "mid"), ("up_blocks", "up")):
        if layer.startswith(prefix):
            return block
    return "other"


@dataclass
class StepState:
    """Where the current denoiser forward sits: call, step, pass within the step, noise level.

    Attributes:
        call: index of the pipeline call (0-based).
        step: index of the step in ``scheduler.timesteps`` (or a forward count without a
            scheduler / off its table).
        timestep: the step's timestep, in ``scheduler.timesteps`` units.
        alpha, sigma, h: the noise level x_t = alpha x_0 + sigma eps, h = sigma / alpha.
        cfg: whether the batch is [uncond; cond].
        perturbed: whether the batch ends with perturbed-attention-guidance rows (PAG:
            [uncond; cond; perturbed] with CFG, [cond; perturbed] without).
        latent_hw: spatial size of the denoiser input.
        pass_index: 0 for the first denoiser forward of the step, 1 for the second (Flux's
            true-CFG negative pass) ...
    """

    call: int = 0
    step: int = 0
    timestep: Any = math.nan
    alpha: float = math.nan
    sigma: float = math.nan
    h: float = math.nan
    cfg: bool = False
    latent_hw: tuple[int, int] | None = None
    pass_index: int = 0
    perturbed: bool = False


_NO_MARKER = object()


def _progress_marker(scheduler: Any) -> Any:
    """What changes when ``scheduler.step`` runs: ``step_index``, PNDM's ``counter``, or nothing."""
    if scheduler is None:
        return _NO_MARKER
    if hasattr(type(scheduler), "step_index") or hasattr(scheduler, "_step_index"):
        return getattr(scheduler, "step_index", None)
    counter = getattr(scheduler, "counter", None)
    return counter if isinstance(counter, int) else _NO_MARKER


def _scheduler_index(scheduler: Any, size: int) -> int | None:
    """The scheduler's own index of the step being denoised, if it keeps one (no host sync)."""
    for name in ("step_index", "begin_index"):  # begin_index: before the first scheduler.step
        index = getattr(scheduler, name, None)
        if isinstance(index, int) and 0 <= index < size:
            return index
    return None


def _nearest_index(timesteps: list[float], t: float, start: int) -> int | None:
    """Index of the entry of ``timesteps`` nearest to ``t``, searched from ``start`` first.

    Ties go to the first entry (PNDM's repeat). None when the nearest entry is further than
    1% of the schedule's range from ``t`` (a timestep off the table, e.g. a custom loop).
    """
    if not timesteps:
        return None
    tolerance = 0.01 * max(1.0, max(abs(v) for v in timesteps))
    for lo in (min(start, len(timesteps)), 0):
        window = range(lo, len(timesteps))
        if not window:
            continue
        best = min(window, key=lambda i: (abs(timesteps[i] - t), i))
        if abs(timesteps[best] - t) <= tolerance:
            return best
    return None


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
    stats: torch.Tensor  # [num_stats, num_halves, num_heads], float32, on the model's device
    key_set: str = "ip"  # "ip": the IP-Adapter keys; "joint": SD3's image + IP keys
    ip_mass: torch.Tensor | None = None  # [num_halves, num_heads]: SD3's attention mass on the IP keys


@dataclass
class _MapEntry:
    name: str
    attn: torch.Tensor
    nw: torch.Tensor
    meta: dict[str, str] = field(default_factory=dict)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class NWRecorder:
    """Accumulates per (call, step, layer, head, CFG half, adapter, image) statistics.

    Args:
        config: the processor configuration (selection of steps, heads, maps, nulls, seed).
        pipe: the pipeline whose ``scheduler`` gives the noise level and whose
            ``do_classifier_free_guidance`` tells whether the batch is [uncond; cond].
            Optional: without it, drive the recorder with :meth:`begin_step`.

    Example:
        >>> rec = pipe.set_ip_adapter_nw_processor(mode="observe")
        >>> pipe(prompt="a cat", ip_adapter_image=image, num_inference_steps=10)
        >>> rec.summary()            # a table at the REPL; a list of dicts in code
        >>> rec.to_json("records.json"); NWRecorder.from_json("records.json").plot()
    """

    def __init__(self, config: NWProcessorConfig | None = None, pipe: Any = None) -> None:
        self.config = config if config is not None else NWProcessorConfig()
        self.pipe = pipe
        self.state = StepState()
        self._entries: list[_Entry] = []
        self._maps: list[_MapEntry] = []
        self._map_bytes = 0
        self._map_warned = False
        self._skipped: list[tuple[int, int, str, str]] = []  # (call, step, layer, reason)
        self._skip_warned = False
        self._steps: dict[tuple[int, int], StepState] = {}
        self._last_timesteps: Any = None
        self._table: list[dict[str, float]] = []
        self._table_timesteps: list[float] = []
        self._started = False
        self._generators: dict[torch.device, torch.Generator] = {}
        self._hook: Any = None
        self._pending_call = False
        self._timestep_scale = 1.0
        self._positions: dict[str, int] = {}
        self._marker: Any = _NO_MARKER
        self._host_t: float | None = None
        self._on_table = False
        self._loaded: list[dict[str, Any]] = []  # records read by from_json
        self.source: dict[str, Any] | None = None

    # ------------------------------------------------------------------ step tracking
    def attach(self, denoiser: torch.nn.Module, *, timestep_scale: float = 1.0) -> None:
        """Register the denoiser forward pre-hook that tracks the step (idempotent).

        Args:
            denoiser: the UNet or transformer whose forward receives ``timestep``.
            timestep_scale: factor from the received timestep to ``scheduler.timesteps`` units:
                1 for UNets and SD3 (timestep in [0, 1000]), 1000 for Flux (its pipeline passes
                ``timestep / 1000``).
        """
        self.detach()
        valid = isinstance(timestep_scale, (int, float)) and math.isfinite(timestep_scale)
        if not (valid and timestep_scale > 0):
            raise ValueError(f"timestep_scale must be a positive number, got {timestep_scale!r}")
        self._timestep_scale = float(timestep_scale)
        self._positions = _positional_indices(denoiser, ("sample", "hidden_states", "timestep"))
        self._hook = denoiser.register_forward_pre_hook(self._pre_hook, with_kwargs=True)

    def detach(self) -> None:
        """Remove the denoiser forward pre-hook."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _argument(self, names: tuple[str, ...], args: tuple, kwargs: dict) -> Any:
        for name in names:
            if name in kwargs:
                return kwargs[name]
            pos = self._positions.get(name)
            if pos is not None and pos < len(args):
                return args[pos]
        return None

    def _pre_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        try:
            self._track(args, kwargs)
        except Exception as error:  # never fail a generation: next step, unknown noise level
            self.begin_step(call=self.state.call, step=self.state.step + 1, cfg=self.state.cfg)
            self.skip("step tracking", error)

    def _track(self, args: tuple, kwargs: dict) -> None:
        """Set :attr:`state` for the denoiser forward called with ``args`` / ``kwargs``."""
        timestep = self._argument(("timestep",), args, kwargs)
        timestep = math.nan if timestep is None else _first(timestep)
        if self._timestep_scale != 1.0 and not _is_nan(timestep):
            timestep = timestep * self._timestep_scale
        sample = self._argument(("sample", "hidden_states"), args, kwargs)
        hw = tuple(sample.shape[-2:]) if isinstance(sample, torch.Tensor) and sample.ndim in (4, 5) else None
        scheduler = getattr(self.pipe, "scheduler", None)
        timesteps = getattr(scheduler, "timesteps", None)
        new_call = (
            not self._started
            or self._pending_call
            or (timesteps is not None and timesteps is not self._last_timesteps)
        )
        self._pending_call = False
        if new_call:
            self._last_timesteps = timesteps
            self._table = schedule_table(scheduler) if isinstance(timesteps, torch.Tensor) else []
            self._table_timesteps = [row["timestep"] for row in self._table]
        cfg = self.config.cfg
        if cfg is None:
            cfg = bool(getattr(self.pipe, "do_classifier_free_guidance", False)) if self.pipe else False
        perturbed = bool(getattr(self.pipe, "do_perturbed_attention_guidance", False)) if self.pipe else False
        marker = _progress_marker(scheduler)
        index = _scheduler_index(scheduler, len(self._table))
        # Without the scheduler's own index, the timestep itself decides (one host read); without
        # a scheduler nothing is looked up, so nothing is read (no host sync: bare UNets, benchmarks).
        reads_t = (
            scheduler is not None
            and (marker is _NO_MARKER or marker is None or index is None)
            and not _is_nan(timestep)
        )
        host_t = float(timestep) if reads_t else None
        st = self.state
        if not new_call and scheduler is not None and self._is_same_step(marker, host_t):
            self.begin_step(
                call=st.call,
                step=st.step,
                timestep=st.timestep,
                alpha=st.alpha,
                sigma=st.sigma,
                cfg=cfg,
                latent_hw=hw,
                pass_index=st.pass_index + 1,
                perturbed=perturbed,
            )
            return
        if index is None and self._table and host_t is not None:
            start = 0 if new_call or not self._on_table else st.step + 1
            index = _nearest_index(self._table_timesteps, host_t, start)
        self._marker, self._host_t, self._on_table = marker, host_t, index is not None
        if index is not None:
            row = self._table[index]
            step, label, alpha, sigma = index, row["timestep"], row["alpha"], row["sigma"]
        else:  # no scheduler, or a timestep off its table: count forwards, level from t
            step = 0 if new_call else st.step + 1
            label = timestep
            alpha = sigma = math.nan
            if scheduler is not None and host_t is not None:
                alpha, sigma, _ = noise_level(scheduler, host_t)
        self.begin_step(
            call=st.call + 1 if (new_call and self._started) else st.call,
            step=step,
            timestep=label,
            alpha=alpha,
            sigma=sigma,
            cfg=cfg,
            latent_hw=hw,
            perturbed=perturbed,
        )

    def _is_same_step(self, marker: Any, host_t: float | None) -> bool:
        """Whether this forward is a further pass of the current step (the scheduler did not move).

        ``marker`` is the scheduler's progress (``step_index`` / PNDM ``counter``), ``host_t`` the
        received timestep when it was read.
        """
        if marker is _NO_MARKER:  # the same timestep, and no later table entry equal to it
            later = self._table_timesteps[self.state.step + 1 :] if self._on_table else []
            return host_t is not None and host_t == self._host_t and host_t not in later
        if marker is None:  # before the scheduler's first step: the timestep decides
            return host_t is not None and host_t == self._host_t
        return marker == self._marker

    def new_call(self) -> None:
        """Mark the next denoiser forward as the start of a new call (needed only without a pipeline)."""
        self._pending_call = True

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
        """Set the current step by hand (the denoiser pre-hook calls this for you).

        Args:
            call: index of the pipeline call (a new index reseeds the nulls' generator).
            step: index of the step in ``scheduler.timesteps``.
            timestep: the step's timestep (a 0-d tensor is kept as is until export).
            alpha: alpha_t (VP convention), sigma: sigma_t; h = sigma / alpha.
            cfg: whether the batch is [uncond; cond].
            latent_hw: spatial size of the denoiser input, used to downsample stored maps.
            pass_index: which denoiser forward within the step this is (0 = the first).
            perturbed: whether the batch ends with PAG's perturbed rows.
        """
        if not self._started or call != self.state.call:
            self._generators.clear()
        self._started = True
        if math.isfinite(alpha) and alpha > 0:
            h = sigma / alpha
        else:  # alpha = 0 (pure noise, e.g. flow matching's s = 1): h = inf
            h = math.inf if alpha == 0 and sigma > 0 else math.nan
        self.state = StepState(
            call=call,
            step=step,
            timestep=timestep,
            alpha=alpha,
            sigma=sigma,
            h=h,
            cfg=bool(cfg),
            latent_hw=latent_hw,
            pass_index=pass_index,
            perturbed=bool(perturbed),
        )
        self._steps[(call, step)] = self.state

    @property
    def cfg(self) -> bool:
        """Whether the current batch is [uncond; cond]: ``config.cfg`` if set, else the step's value."""
        return self.state.cfg if self.config.cfg is None else self.config.cfg

    def halves(self, batch: int) -> tuple[str, ...]:
        """Labels of the equal blocks of rows of a batch of ``batch`` rows, in batch order.

        ``("uncond", "cond")`` under classifier-free guidance (:attr:`cfg`), with PAG
        ``("uncond", "cond", "perturbed")`` or ``("cond", "perturbed")``; ``("all",)`` otherwise
        or when ``batch`` does not split into that many blocks.
        """
        labels = ("uncond",) if self.cfg else ()
        labels = (*labels, "cond", *(("perturbed",) if self.state.perturbed else ()))
        return labels if len(labels) > 1 and batch % len(labels) == 0 else ("all",)

    def generator(self, device: torch.device) -> torch.Generator:
        """The seeded generator of the nulls on ``device`` (reseeded at every new call).

        Call ``c`` uses seed ``(seed + 1_000_003 c) mod 2**63``, inside the generator's range for
        every valid seed and any number of calls.
        """
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed((self.config.seed + 1_000_003 * self.state.call) % SEED_LIMIT)
            self._generators[device] = gen
        return gen

    # ------------------------------------------------------------------ accumulation
    def wants_step(self) -> bool:
        """Whether the current step is selected by ``config.steps``."""
        return self.config.steps is None or self.state.step in self.config.steps

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
    ) -> None:
        """Store one layer's statistics, ``stats`` of shape [len(STAT_NAMES), len(halves), len(heads)].

        ``key_set`` names the keys of the compared softmax (:data:`~nw_adapter.integration.schema.KEY_SETS`);
        ``ip_mass`` [len(halves), len(heads)] is the joint softmax's mass on the IP keys (SD3 only).
        """
        if stats.shape != (len(STAT_NAMES), len(halves), len(heads)):
            raise ValueError(
                f"stats must have shape {(len(STAT_NAMES), len(halves), len(heads))}, "
                f"got {tuple(stats.shape)}"
            )
        self._entries.append(
            _Entry(
                self.state.call,
                self.state.step,
                layer,
                adapter,
                image,
                halves,
                heads,
                float(scale),
                num_keys,
                stats.detach(),
                key_set,
                None if ip_mass is None else ip_mass.detach(),
            )
        )

    def wants_maps(self, layer: str) -> bool:
        """Whether maps of ``layer`` at the current step are to be stored."""
        cfg = self.config
        if not cfg.store_maps:
            return False
        if cfg.map_steps is not None and self.state.step not in cfg.map_steps:
            return False
        return cfg.map_layers is None or any(layer.startswith(p) for p in cfg.map_layers)

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
        nbytes = attn.numel() * attn.element_size() + nw.numel() * nw.element_size()
        if self._map_bytes + nbytes > self.config.map_max_mb * 2**20:
            if not self._map_warned:
                warnings.warn(
                    f"NWRecorder: map_max_mb={self.config.map_max_mb} reached; further maps are "
                    "dropped. Select fewer layers/steps/heads or raise map_max_mb.",
                    stacklevel=2,
                )
                self._map_warned = True
            return
        self._map_bytes += nbytes
        name = f"call{self.state.call}/step{self.state.step}/{layer}/adapter{adapter}/image{image}"
        self._maps.append(_MapEntry(name, attn.detach(), nw.detach(), meta))

    # ------------------------------------------------------------------ failures (observe)
    def mark(self) -> tuple[int, int]:
        """A position in the stored entries and maps, for :meth:`skip` to roll back to."""
        return len(self._entries), len(self._maps)

    def skip(self, layer: str, error: BaseException, *, rollback: tuple[int, int] | None = None) -> None:
        """Count a (step, layer) pair whose side computation failed (the layer kept the stock output).

        Warns once per recorder (``warnings.warn``, RuntimeWarning); every pair is counted in
        :meth:`skipped` and exported by :meth:`to_json`.

        Args:
            layer: the attention-processor name.
            error: the exception raised by the side computation.
            rollback: a :meth:`mark` taken before the layer's side computation: what the layer
                stored after it is dropped, so a pair is either fully recorded or skipped.
        """
        if rollback is not None:
            n_entries, n_maps = rollback
            del self._entries[n_entries:]
            for m in self._maps[n_maps:]:
                self._map_bytes -= m.attn.numel() * m.attn.element_size() + m.nw.numel() * m.nw.element_size()
            del self._maps[n_maps:]
        reason = f"{type(error).__name__}: {error}"[:300]
        self._skipped.append((self.state.call, self.state.step, layer, reason))
        if not self._skip_warned:
            self._skip_warned = True
            output = "kept the NW head's output" if self.config.mode == "swap" else "kept diffusers' output"
            warnings.warn(
                f"NWRecorder: the NW side computation failed in layer {layer!r} at step "
                f"{self.state.step} ({reason}); that layer {output} and its statistics "
                "were skipped. Further failures are counted silently: see recorder.skipped() and "
                f"the {SKIPPED_FIELD!r} field of to_json().",
                RuntimeWarning,
                stacklevel=3,
            )

    def skipped(self) -> dict[str, Any]:
        """The skipped (call, step, layer) pairs: ``{"count", "by_reason", "pairs"}``.

        ``by_reason`` maps each failure message to its number of pairs; ``pairs`` lists
        ``{"call", "step", "layer", "reason"}`` in the order they happened.
        """
        by_reason: dict[str, int] = {}
        for *_, reason in self._skipped:
            by_reason[reason] = by_reason.get(reason, 0) + 1
        pairs = [{"call": c, "step": s, "layer": layer, "reason": r} for c, s, layer, r in self._skipped]
        return {"count": len(self._skipped), "by_reason": by_reason, "pairs": pairs}

    def clear(self) -> None:
        """Drop all recorded statistics, maps and skipped pairs (step tracking continues)."""
        self._entries.clear()
        self._maps.clear()
        self._loaded.clear()
        self._map_bytes = 0
        self._skipped.clear()

    # ------------------------------------------------------------------ export
    def _step_info(self, call: int, step: int) -> dict[str, float]:
        st = self._steps.get((call, step), StepState())
        return {
            "timestep": float(_first(st.timestep)),
            "alpha": float(st.alpha),
            "sigma": float(st.sigma),
            "h_schedule": float(st.h),
        }

    def to_records(self, key_set: str | None = "ip") -> list[dict[str, Any]]:
        """One dict per (call, step, layer, head, half, adapter, image); see the README schema.

        All statistic tensors are concatenated and moved to the host in one transfer.

        Args:
            key_set: keep the records of this key set only: ``"ip"`` (default: the softmax over
                the IP-Adapter keys, every family), ``"joint"`` (SD3: its image branch's softmax
                over the image's own keys and the IP keys), or None for all.
        """
        loaded = [dict(r) for r in self._loaded if key_set is None or r.get("key_set", "ip") == key_set]
        entries = [e for e in self._entries if key_set is None or e.key_set == key_set]
        if not entries:
            return loaded
        parts = []
        for e in entries:
            parts.append(e.stats.reshape(-1).float())
            if e.ip_mass is not None:
                parts.append(e.ip_mass.reshape(-1).float())
        flat = torch.cat(parts).cpu().tolist()
        info_cache: dict[tuple[int, int], dict[str, float]] = {}
        records: list[dict[str, Any]] = loaded
        offset = 0
        for e in entries:
            n_h, n_k = len(e.halves), len(e.heads)
            size = len(STAT_NAMES) * n_h * n_k
            vals = flat[offset : offset + size]
            offset += size
            mass = None
            if e.ip_mass is not None:
                mass = flat[offset : offset + n_h * n_k]
                offset += n_h * n_k
            key = (e.call, e.step)
            if key not in info_cache:
                info_cache[key] = self._step_info(*key)
            for hi, half in enumerate(e.halves):
                for ki, head in enumerate(e.heads):
                    rec: dict[str, Any] = {
                        "call": e.call,
                        "step": e.step,
                        **info_cache[key],
                        "layer": e.layer,
                        "block": block_of(e.layer),
                        "head": head,
                        "half": half,
                        "adapter": e.adapter,
                        "image": e.image,
                        "scale": e.scale,
                        "num_keys": e.num_keys,
                        "key_set": e.key_set,
                    }
                    for si, name in enumerate(STAT_NAMES):
                        rec[name] = vals[(si * n_h + hi) * n_k + ki]
                    if mass is not None:
                        rec["ip_mass"] = mass[hi * n_k + ki]
                    records.append(rec)
        return records

    def summary(self, records: list[dict[str, Any]] | None = None) -> Summary:
        """One dict per (call, step, half): NaN-ignoring means over layers, heads, adapters, images.

        Means are over finite values; ``nonfinite`` maps each statistic to the number of NaN/inf
        values its mean left out (never dropped silently). Adds ``frac_rho_gt_0_9`` (fraction of
        records with rho > 0.9, NaN rho counted as not) and ``count`` (number of records
        averaged): the names of the command line's report rows.

        Returns:
            A :class:`Summary`: a list of dicts that prints as a table at the REPL.
        """
        records = self.to_records() if records is None else records
        groups: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
        for r in records:
            groups.setdefault((r["call"], r["step"], r["half"]), []).append(r)
        out = []
        for (call, step, half), rows in sorted(groups.items()):
            row: dict[str, Any] = {
                "call": call,
                "step": step,
                "half": half,
                **{k: rows[0].get(k, math.nan) for k in ("timestep", "alpha", "sigma", "h_schedule")},
            }
            nonfinite: dict[str, int] = {}
            for name in (*SUMMARY_STATS, *(n for n in OPTIONAL_STATS if n in rows[0])):
                row[name], dropped = finite_mean(r.get(name) for r in rows)
                if dropped:
                    nonfinite[name] = dropped
            row["nonfinite"] = nonfinite
            rhos = [r["rho"] for r in rows]
            row["frac_rho_gt_0_9"] = sum(1 for v in rhos if v is not None and v > 0.9) / len(rows)
            row["count"] = len(rows)
            out.append(row)
        return Summary(out)

    def to_json(self, path: str | os.PathLike) -> Path:
        """Write the records file atomically (NaN -> null); read it back with :meth:`from_json`.

        The document is ``{"schema": "nw-adapter/records", "schema_version": 1, "config",
        "records", "summary", "skipped"}``; suggested name ``records.json`` (the command line's
        report is ``rho.json``, schema ``nw-adapter/rho``, and holds the same ``records``).
        """
        records = self.to_records()
        payload = {
            "schema": RECORDS_SCHEMA,
            "schema_version": 1,
            "config": self.config.to_dict(),
            "records": [{k: _json_safe(v) for k, v in r.items()} for r in records],
            "summary": [{k: _json_safe(v) for k, v in r.items()} for r in self.summary(records)],
            SKIPPED_FIELD: self.skipped(),
        }
        return atomic_write_text(path, json.dumps(payload, indent=1, allow_nan=False))

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> NWRecorder:
        """A recorder holding the records of a saved run, for summaries, tables and plots.

        Reads a :meth:`to_json` file or the command line's ``rho.json`` (its ``records``; the
        ``reference`` key of each record is kept). Nothing is recomputed; the loaded recorder has
        no maps and records nothing new until it is attached to a pipeline.

        Raises:
            ValueError: Not a records file or a ``rho.json`` (the message names the file).
        """
        path = Path(path)
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"NWRecorder.from_json: cannot read '{path}' ({exc}); pass a records file"
            ) from None
        check_records_file(document, source=f"NWRecorder.from_json: '{path}'")  # one line per malformed field
        schema = document.get("schema") if isinstance(document, dict) else None
        if schema not in (RECORDS_SCHEMA, "nw-adapter/rho") or not isinstance(document.get("records"), list):
            raise ValueError(
                f"NWRecorder.from_json: '{path}' is not an nw-adapter records file (schema {schema!r}); "
                "pass a file written by NWRecorder.to_json or correlate.py's rho.json"
            )
        config = NWProcessorConfig()
        if schema == RECORDS_SCHEMA and isinstance(document.get("config"), dict):
            known = NWProcessorConfig.field_names()  # options of another version are left out
            config = NWProcessorConfig(**{k: v for k, v in document["config"].items() if k in known})
        recorder = cls(config)
        renamed = ({LEGACY_NAMES.get(k, k): v for k, v in r.items()} for r in document["records"])
        recorder._loaded = [
            {k: (math.nan if v is None and k in STAT_NAMES else v) for k, v in r.items()} for r in renamed
        ]
        recorder.source = {"path": str(path), "schema": schema, "config": document.get("config")}
        return recorder

    def to_dataframe(self):
        """The records as a tidy :class:`pandas.DataFrame` (one row per record, columns = keys).

        Raises:
            ImportError: pandas is not installed (use :meth:`to_csv`, which needs nothing).
        """
        try:
            import pandas
        except ImportError:
            raise ImportError(
                "NWRecorder.to_dataframe needs pandas (pip install pandas); without it use rec.to_csv(path)"
            ) from None
        records = self.to_records()
        return pandas.DataFrame.from_records(
            records, columns=list(records[0]) if records else _record_fields()
        )

    def plot(self, *, half: str | None = None, path: str | os.PathLike | None = None):
        """Figure of the mean rho per step against the timestep, with the band of its nulls.

        Args:
            half: CFG half to draw (default ``cond`` if recorded, else ``all``).
            path: Also save the figure there (PNG, atomically).

        Returns:
            A :class:`matplotlib.figure.Figure` (shown inline in notebooks).
        """
        from matplotlib.figure import Figure

        rows = self.summary()
        halves = {r["half"] for r in rows}
        half = half or next((h for h in ("cond", "all", "uncond") if h in halves), None)
        rows = sorted((r for r in rows if r["half"] == half), key=lambda r: (r["call"], r["step"]))
        if not rows:
            raise ValueError("NWRecorder.plot: nothing recorded (run the pipeline first, or load a file)")
        t = [r["timestep"] for r in rows]
        fig = Figure(figsize=(4.8, 3.2))
        ax = fig.subplots()
        nulls = [[v for v in (r.get(name) for name in NULL_STATS) if v is not None and math.isfinite(v)]
                 for r in rows]  # fmt: skip
        low, high = [min(v, default=math.nan) for v in nulls], [max(v, default=math.nan) for v in nulls]
        ax.fill_between(t, low, high, color="0.6", alpha=0.35, linewidth=0, label="null band")
        ax.plot(t, [r["rho"] for r in rows], marker="o", markersize=3, label=f"rho ({half})")
        ax.set_xlim(max(t + [1000.0]), min(t + [0.0]))
        ax.set_xlabel("timestep (denoising ->)")
        ax.set_ylabel("Spearman rho (attention vs NW)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=7)
        fig.tight_layout()
        if path is not None:
            atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110))
        return fig

    def to_csv(self, path: str | os.PathLike) -> Path:
        """Write the records as a CSV table (one row per record, header = record keys), atomically."""
        records = self.to_records()
        fields = list(records[0]) if records else _record_fields()
        import io

        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(records)
        return atomic_write_text(path, buf.getvalue())

    def maps(self) -> dict[str, torch.Tensor]:
        """Stored maps as ``{"<name>/attn": A, "<name>/nw": W}`` (device tensors)."""
        out: dict[str, torch.Tensor] = {}
        for m in self._maps:
            out[f"{m.name}/attn"] = m.attn
            out[f"{m.name}/nw"] = m.nw
        return out

    def save_maps(self, path: str | os.PathLike) -> Path:
        """Save the stored maps with safetensors (atomic), metadata = config and per-map layout.

        Each map is ``[batch, heads (or 1 with head-mean), rows, keys]``; rows are query tokens
        (row-major over the downsampled latent grid).
        """
        from safetensors.torch import save_file

        if not self.config.store_maps:
            raise ValueError(
                "NWRecorder.save_maps: no maps were stored; pass store_maps=True when setting the processor"
            )
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.maps().items()}
        meta = {"config": json.dumps(self.config.to_dict())}
        for m in self._maps:
            meta[m.name] = json.dumps(m.meta)
        return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))

    def __len__(self) -> int:
        return len(self._loaded) + sum(len(e.halves) * len(e.heads) for e in self._entries)

    def __repr__(self) -> str:
        return (
            f"NWRecorder(mode={self.config.mode!r}, bandwidth={self.config.bandwidth!r}, "
            f"records={len(self)}, maps={len(self._maps)})"
        )


RECORDS_SCHEMA = "nw-adapter/records"
"""``schema`` of :meth:`NWRecorder.to_json` files."""

_SUMMARY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("call", "{:d}"),
    ("step", "{:d}"),
    ("half", "{}"),
    ("timestep", "{:.0f}"),
    ("rho", "{:.3f}"),
    ("rho_perm_null", "{:.3f}"),
    ("rho_norm_matched_null", "{:.3f}"),
    ("rho_spread_null", "{:.3f}"),
    ("pearson", "{:.3f}"),
    ("kl", "{:.4f}"),
    ("neff_attn", "{:.2f}"),
    ("neff_nw", "{:.2f}"),
    ("frac_rho_gt_0_9", "{:.3f}"),
    ("count", "{:d}"),
)


class Summary(list):
    """The rows of :meth:`NWRecorder.summary`: a plain list of dicts that prints as a table."""

    def table(self) -> str:
        """The rows as an aligned text table (NaN as ``nan``); the main statistics only."""
        if not self:
            return "(no records)"
        columns = [(key, fmt) for key, fmt in _SUMMARY_COLUMNS if key in self[0]]
        cells = [[key for key, _ in columns]]
        for row in self:
            line = []
            for key, fmt in columns:
                value = row.get(key)
                is_nan = value is None or (isinstance(value, float) and not math.isfinite(value))
                line.append("nan" if is_nan else fmt.format(value))
            cells.append(line)
        widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)

    def __repr__(self) -> str:
        return self.table()

    __str__ = __repr__


def _record_fields() -> list[str]:
    return [*RECORD_KEYS, *STAT_NAMES]


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _positional_indices(module: torch.nn.Module, names: tuple[str, ...]) -> dict[str, int]:
    """Positions of the named parameters of ``module.forward`` (for positional calls)."""
    import inspect

    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return {"sample": 0, "timestep": 1}
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {n: positional.index(n) for n in names if n in positional}


def _first(value: Any) -> Any:
    """First element of a (possibly batched) timestep, kept as a tensor (no host sync)."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1)[0] if value.numel() else math.nan
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return next(iter(value))
    return value
