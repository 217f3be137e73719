"""Raw attention and NW maps: their reduction (heads, pooling, dtype) and their bounded store.

Storing maps is opt-in (``NWProcessorConfig(store_maps=True)``) and bounded: only the selected
layers, steps and heads are kept, optionally head-averaged and pooled over the latent grid, and
the store refuses maps beyond ``map_max_mb`` (one warning). The default run keeps none.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from nw_adapter.atomic import atomic_write
from nw_adapter.integration.config import NWProcessorConfig


def reduce_maps(
    config: NWProcessorConfig,
    *,
    heads: tuple[int, ...],
    attn_w: torch.Tensor,
    nw_w: torch.Tensor,
    latent_hw: tuple[int, int] | None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, str]] | None:
    """A and W ``[B, H, N, M]`` of one softmax reduced as the configuration asks, or None.

    Keeps the heads of ``config.map_heads`` (positions in ``heads``, the recorded head indices),
    averages them with ``map_head_mean``, pools the query rows by ``map_downsample`` over the
    latent grid (:func:`pool_query_rows`) and casts to ``map_dtype``.

    Returns:
        ``(A, W, meta)`` (new tensors: the inputs may be reused workspaces), or None when no
        recorded head is selected.
    """
    keep = heads if config.map_heads is None else tuple(h for h in heads if h in config.map_heads)
    if not keep:
        return None
    positions = _index(tuple(heads.index(h) for h in keep), attn_w.device)
    pair, grid = [], None
    for m in (attn_w.index_select(1, positions), nw_w.index_select(1, positions)):
        if config.map_head_mean:
            m = m.mean(dim=1, keepdim=True)
        if config.map_downsample > 1:
            m, grid = pool_query_rows(m, config.map_downsample, latent_hw)
        pair.append(m.to(getattr(torch, config.map_dtype)))
    meta = {
        "heads": "mean" if config.map_head_mean else ",".join(map(str, keep)),
        "downsample": str(config.map_downsample),
        "grid": "" if grid is None else f"{grid[0]}x{grid[1]}",
    }
    return pair[0], pair[1], meta


_INDEX_CACHE: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _index(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A cached index tensor on ``device`` (no host-to-device copy after the first step)."""
    key = (values, device)
    if key not in _INDEX_CACHE:
        _INDEX_CACHE[key] = torch.tensor(values, device=device)
    return _INDEX_CACHE[key]


def pool_query_rows(
    m: torch.Tensor, factor: int, latent_hw: tuple[int, int] | None
) -> tuple[torch.Tensor, tuple[int, int]]:
    """Average-pool the query rows of maps ``[B, H, N, M]`` over the (h, w) grid by ``factor``.

    The grid of the N rows has the aspect of ``latent_hw`` (square when unknown).

    Raises:
        ValueError: N rows do not form such a grid.
    """
    b, nh, rows, keys = m.shape
    if latent_hw is not None:
        f = math.sqrt(latent_hw[0] * latent_hw[1] / rows)
        gh, gw = round(latent_hw[0] / f), round(latent_hw[1] / f)
    else:
        gh = gw = math.isqrt(rows)
    if gh * gw != rows:
        raise ValueError(f"map_downsample: cannot infer the query grid of {rows} rows; pass map_downsample=1")
    grid = m.permute(0, 1, 3, 2).reshape(b * nh * keys, 1, gh, gw)
    pooled = F.avg_pool2d(grid, factor, ceil_mode=True)
    ph, pw = pooled.shape[-2:]
    return pooled.reshape(b, nh, keys, ph * pw).permute(0, 1, 3, 2), (ph, pw)


@dataclass
class _MapEntry:
    name: str
    attn: torch.Tensor
    nw: torch.Tensor
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.attn.numel() * self.attn.element_size() + self.nw.numel() * self.nw.element_size()


class MapStore:
    """The stored pairs of maps of a recorder, within the ``map_max_mb`` budget.

    Args:
        config: ``store_maps``, ``map_steps``, ``map_layers``, ``map_max_mb`` are read.
    """

    def __init__(self, config: NWProcessorConfig) -> None:
        self.config = config
        self._entries: list[_MapEntry] = []
        self._bytes = 0
        self._warned = False

    def wants(self, layer: str, step: int) -> bool:
        """Whether maps of ``layer`` at ``step`` are to be stored."""
        cfg = self.config
        if not cfg.store_maps or (cfg.map_steps is not None and step not in cfg.map_steps):
            return False
        return cfg.map_layers is None or any(layer.startswith(p) for p in cfg.map_layers)

    def add(self, name: str, attn: torch.Tensor, nw: torch.Tensor, meta: dict[str, str]) -> None:
        """Keep one pair of (reduced) maps under ``name`` unless the budget is reached (warns once)."""
        entry = _MapEntry(name, attn.detach(), nw.detach(), meta)
        if self._bytes + entry.nbytes > self.config.map_max_mb * 2**20:
            if not self._warned:
                warnings.warn(
                    f"NWRecorder: map_max_mb={self.config.map_max_mb} reached; further maps are "
                    "dropped. Select fewer layers/steps/heads or raise map_max_mb.",
                    stacklevel=3,
                )
                self._warned = True
            return
        self._bytes += entry.nbytes
        self._entries.append(entry)

    def __len__(self) -> int:
        return len(self._entries)

    def truncate(self, size: int) -> None:
        """Drop the maps stored after the first ``size`` (a rollback)."""
        for entry in self._entries[size:]:
            self._bytes -= entry.nbytes
        del self._entries[size:]

    def drop_call(self, call: int) -> int:
        """Drop the maps of pipeline call ``call``; returns how many pairs were dropped."""
        prefix = f"call{call}/"
        kept = [e for e in self._entries if not e.name.startswith(prefix)]
        dropped = len(self._entries) - len(kept)
        self._entries = kept
        self._bytes = sum(e.nbytes for e in kept)
        return dropped

    def tensors(self) -> dict[str, torch.Tensor]:
        """``{"<name>/attn": A, "<name>/nw": W}`` (device tensors)."""
        out: dict[str, torch.Tensor] = {}
        for m in self._entries:
            out[f"{m.name}/attn"] = m.attn
            out[f"{m.name}/nw"] = m.nw
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Save the maps with safetensors (atomically); metadata: the config and each map's layout.

        Raises:
            ValueError: the configuration stored no maps.
        """
        from safetensors.torch import save_file

        if not self.config.store_maps:
            raise ValueError(
                "NWRecorder.save_maps: no maps were stored; pass store_maps=True when setting the processor"
            )
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.tensors().items()}
        meta = {"config": json.dumps(self.config.to_dict())}
        for m in self._entries:
            meta[m.name] = json.dumps(m.meta)
        return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
