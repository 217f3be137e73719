"""Streaming recorder of the NW-versus-attention statistics, step by step.

The recorder learns the denoising step from a UNet forward pre-hook (not from
``cross_attention_kwargs``), receives per-layer statistics from the NW processors as
device tensors of shape ``[num_stats, num_halves, num_heads]`` (no host sync during the run),
and converts everything to Python once, at export.

Call and step tracking: every UNet forward is one step. A new pipeline call is detected when
``pipe.scheduler.timesteps`` is a different tensor object than at the previous UNet forward
(``set_timesteps`` creates a new tensor at the start of every call); the step counter then
restarts at 0 and the call index increments. Without a pipeline (a bare UNet) call
:meth:`NWRecorder.new_call` before each sampling loop; the mixin pipelines also call it.
PNDM's repeated timestep is a step of its own, so the step labels equal
``scheduler.timesteps`` entry by entry.
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
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.schedules import noise_level, schedule_table
from nw_adapter.integration.schema import RECORD_KEYS, STAT_NAMES, SUMMARY_STATS, finite_mean


def block_of(layer: str) -> str:
    """``"down"``, ``"mid"`` or ``"up"`` from an attention-processor name (else ``"other"``)."""
    for prefix, block in (("down_blocks", "down"), ("mid_block", "mid"), ("up_blocks", "up")):
        if layer.startswith(prefix):
            return block
    return "other"


@dataclass
class StepState:
    """Where the current UNet forward sits: call index, step index and noise level."""

    call: int = 0
    step: int = 0
    timestep: Any = math.nan
    alpha: float = math.nan
    sigma: float = math.nan
    h: float = math.nan
    cfg: bool = False
    latent_hw: tuple[int, int] | None = None


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
        >>> rec.summary()[0]["rho"]
    """

    def __init__(self, config: NWProcessorConfig | None = None, pipe: Any = None) -> None:
        self.config = config if config is not None else NWProcessorConfig()
        self.pipe = pipe
        self.state = StepState()
        self._entries: list[_Entry] = []
        self._maps: list[_MapEntry] = []
        self._map_bytes = 0
        self._map_warned = False
        self._steps: dict[tuple[int, int], StepState] = {}
        self._last_timesteps: Any = None
        self._table: list[dict[str, float]] = []
        self._started = False
        self._generators: dict[torch.device, torch.Generator] = {}
        self._hook: Any = None
        self._pending_call = False

    # ------------------------------------------------------------------ step tracking
    def attach(self, unet: torch.nn.Module) -> None:
        """Register the UNet forward pre-hook that tracks the step (idempotent)."""
        self.detach()
        self._hook = unet.register_forward_pre_hook(self._pre_hook, with_kwargs=True)

    def detach(self) -> None:
        """Remove the UNet forward pre-hook."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _pre_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        timestep = kwargs["timestep"] if "timestep" in kwargs else (args[1] if len(args) > 1 else math.nan)
        sample = kwargs["sample"] if "sample" in kwargs else (args[0] if args else None)
        hw = tuple(sample.shape[-2:]) if isinstance(sample, torch.Tensor) and sample.ndim == 4 else None
        scheduler = getattr(self.pipe, "scheduler", None)
        timesteps = getattr(scheduler, "timesteps", None)
        new_call = (
            not self._started
            or self._pending_call
            or (timesteps is not None and timesteps is not self._last_timesteps)
        )
        self._pending_call = False
        if new_call and timesteps is not None:
            self._last_timesteps = timesteps
            self._table = schedule_table(scheduler)
        if new_call:
            call = self.state.call + 1 if self._started else 0
            step = 0
        else:
            call, step = self.state.call, self.state.step + 1
        if step < len(self._table):
            row = self._table[step]
            alpha, sigma, h = row["alpha"], row["sigma"], row["h"]
        elif scheduler is not None:
            alpha, sigma, h = noise_level(scheduler, float(_first(timestep)))
        else:
            alpha = sigma = math.nan
        cfg = self.config.cfg
        if cfg is None:
            cfg = bool(getattr(self.pipe, "do_classifier_free_guidance", False)) if self.pipe else False
        self.begin_step(
            call=call, step=step, timestep=_first(timestep), alpha=alpha, sigma=sigma, cfg=cfg, latent_hw=hw
        )

    def new_call(self) -> None:
        """Mark the next UNet forward as step 0 of a new call (needed only without a pipeline)."""
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
    ) -> None:
        """Set the current step by hand (the UNet pre-hook calls this for you).

        Args:
            call: index of the pipeline call (a new index reseeds the nulls' generator).
            step: 0-based step index within the call.
            timestep: the UNet's timestep (a 0-d tensor is kept as is until export).
            alpha: alpha_t (VP convention), sigma: sigma_t; h = sigma / alpha.
            cfg: whether the batch is [uncond; cond].
            latent_hw: spatial size of the UNet input, used to downsample stored maps.
        """
        if not self._started or call != self.state.call:
            self._generators.clear()
        self._started = True
        h = sigma / alpha if alpha and math.isfinite(alpha) and alpha > 0 else math.nan
        self.state = StepState(
            call=call,
            step=step,
            timestep=timestep,
            alpha=alpha,
            sigma=sigma,
            h=h,
            cfg=bool(cfg),
            latent_hw=latent_hw,
        )
        self._steps[(call, step)] = self.state

    @property
    def cfg(self) -> bool:
        """Whether the current batch is [uncond; cond]: ``config.cfg`` if set, else the step's value."""
        return self.state.cfg if self.config.cfg is None else self.config.cfg

    def generator(self, device: torch.device) -> torch.Generator:
        """The seeded generator of the nulls on ``device`` (reseeded at every new call)."""
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.config.seed + 1_000_003 * self.state.call)
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
    ) -> None:
        """Store one layer's statistics, ``stats`` of shape [len(STAT_NAMES), len(halves), len(heads)]."""
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

    def clear(self) -> None:
        """Drop all recorded statistics and maps (step tracking continues)."""
        self._entries.clear()
        self._maps.clear()
        self._map_bytes = 0

    # ------------------------------------------------------------------ export
    def _step_info(self, call: int, step: int) -> dict[str, float]:
        st = self._steps.get((call, step), StepState())
        return {
            "timestep": float(_first(st.timestep)),
            "alpha": float(st.alpha),
            "sigma": float(st.sigma),
            "h_schedule": float(st.h),
        }

    def to_records(self) -> list[dict[str, Any]]:
        """One dict per (call, step, layer, head, half, adapter, image); see the README schema.

        All statistic tensors are concatenated and moved to the host in one transfer.
        """
        if not self._entries:
            return []
        flat = torch.cat([e.stats.reshape(-1).float().cpu() for e in self._entries]).tolist()
        info_cache: dict[tuple[int, int], dict[str, float]] = {}
        records: list[dict[str, Any]] = []
        offset = 0
        for e in self._entries:
            n_h, n_k = len(e.halves), len(e.heads)
            size = len(STAT_NAMES) * n_h * n_k
            vals = flat[offset : offset + size]
            offset += size
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
                    }
                    for si, name in enumerate(STAT_NAMES):
                        rec[name] = vals[(si * n_h + hi) * n_k + ki]
                    records.append(rec)
        return records

    def summary(self, records: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """One dict per (call, step, half): NaN-ignoring means over layers, heads, adapters, images.

        Means are over finite values; ``nonfinite`` maps each statistic to the number of NaN/inf
        values its mean left out (never dropped silently). Adds ``frac_heads_rho_gt_0_9``
        (fraction of records with rho > 0.9, NaN rho counted as not)
        and ``n`` (number of records averaged).
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
                **{k: rows[0][k] for k in ("timestep", "alpha", "sigma", "h_schedule")},
            }
            nonfinite: dict[str, int] = {}
            for name in SUMMARY_STATS:
                row[name], dropped = finite_mean(r[name] for r in rows)
                if dropped:
                    nonfinite[name] = dropped
            row["nonfinite"] = nonfinite
            row["frac_heads_rho_gt_0_9"] = sum(1 for r in rows if r["rho"] > 0.9) / len(rows)
            row["n"] = len(rows)
            out.append(row)
        return out

    def to_json(self, path: str | os.PathLike) -> Path:
        """Write ``{"version", "config", "records", "summary"}`` atomically (NaN -> null)."""
        records = self.to_records()
        payload = {
            "version": 1,
            "config": self.config.to_dict(),
            "records": [{k: _json_safe(v) for k, v in r.items()} for r in records],
            "summary": [{k: _json_safe(v) for k, v in r.items()} for r in self.summary(records)],
        }
        return atomic_write_text(path, json.dumps(payload, indent=1, allow_nan=False))

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
        return sum(len(e.halves) * len(e.heads) for e in self._entries)

    def __repr__(self) -> str:
        return (
            f"NWRecorder(mode={self.config.mode!r}, bandwidth={self.config.bandwidth!r}, "
            f"records={len(self)}, maps={len(self._maps)})"
        )


def _record_fields() -> list[str]:
    return [*RECORD_KEYS, *STAT_NAMES]


def _first(value: Any) -> Any:
    """First element of a (possibly batched) timestep, kept as a tensor (no host sync)."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1)[0] if value.numel() else math.nan
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return next(iter(value))
    return value
