"""What the NW processor families still share besides the statistics: bandwidth rules and maps.

The statistics of one softmax live in :mod:`nw_adapter.integration.stats`; this module keeps
the bandwidth resolution (:func:`resolve_bandwidth`), the bounded attention maps
(:func:`store_maps`, :func:`pool_query_rows`) and a compatibility wrapper
(:func:`softmax_statistics`, config + generator in, :mod:`~nw_adapter.integration.stats` called)
until the processors call the statistics directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nw_adapter.core import bandwidth as bw
from nw_adapter.integration import stats
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.recorder import NWRecorder, StepState
from nw_adapter.integration.stats.workspace import EagerWriter


def resolve_bandwidth(
    config: NWProcessorConfig,
    state: StepState,
    q: torch.Tensor,
    k: torch.Tensor,
    attn_weights: torch.Tensor | None,
    s: float,
) -> torch.Tensor | float:
    """h per (batch, head) ``[B, H]`` (or a float) under ``config.bandwidth``.

    Only the data-dependent rules (median, fitted) read ``q`` [B, H, N, d] and ``k`` [B, H, M, d];
    they upcast to float32 themselves, so the other rules never copy a half-precision query.

    Args:
        config: the processor configuration (``bandwidth``, ``schedule_c``).
        state: the recorder's step state (``alpha``, ``sigma`` of the step for ``"schedule"``).
        q: queries ``[B, H, N, d]``.
        k: image keys ``[B, H, M, d]``.
        attn_weights: A ``[B, H, N, M]`` if already computed (used by ``"fitted"``).
        s: the softmax scale of the stock attention (1/sqrt(d) for SDPA).
    """
    rule = config.bandwidth
    if isinstance(rule, float):
        return rule
    if rule == "matched":
        return bw.matched_bandwidth(scale=s)
    if rule == "schedule":
        if not (math.isfinite(state.sigma) and math.isfinite(state.alpha) and state.alpha > 0):
            raise RuntimeError(
                "bandwidth='schedule' needs the scheduler's sigma_t/alpha_t of the current "
                "step; run the processor inside a pipeline call (or call "
                "recorder.begin_step(alpha=..., sigma=...)), or pick another bandwidth"
            )
        return float(bw.schedule_bandwidth(state.sigma, state.alpha, config.schedule_c))
    q, k = q.float(), k.float()
    if rule == "median":
        return bw.median_bandwidth(q, k)
    if attn_weights is None:
        attn_weights = torch.softmax((q @ k.transpose(-1, -2)) * s, dim=-1)
    return bw.fitted_bandwidth(attn_weights, q, k)[0]



def softmax_statistics(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    bandwidth: Callable[[torch.Tensor | None], torch.Tensor | float],
    config: NWProcessorConfig,
    generator: torch.Generator | None,
    valid: torch.Tensor | None = None,
    halves: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compatibility wrapper of :func:`nw_adapter.integration.stats.softmax_statistics` (until the
    processors call it directly): resolves h and draws the nulls from the configuration.

    Args:
        q: queries ``[B, H, N, d]``.
        k: image keys ``[B, H, M, d]`` of one softmax.
        scale: s, the stock softmax scale.
        bandwidth: ``A or None -> h`` (a float or ``[B, H]``), see :func:`resolve_bandwidth`
            (called with None: the data-dependent rules form A themselves).
        config: ``nulls``, ``null_rows`` and ``compile`` are read.
        generator: the seeded generator of the nulls (``None`` when ``config.nulls`` is off).
        valid: optional bool ``[B, M]`` mask of the keys that take part.
        halves: 2 when the batch is [uncond; cond].

    Returns:
        ``(stats [S, halves, H], A [B, H, N, M], W [B, H, N, M])`` (rows of ``stats`` in STAT_NAMES order).
    """
    h = bandwidth(None)
    draws = None
    if config.nulls and generator is not None:
        draws = stats.draw_nulls(q, k.shape[-2], config.null_rows, generator)
    return stats.softmax_statistics(
        q, k, scale=scale, h=h, draws=draws, valid=valid, halves=halves, compile=config.compile
    )


def store_maps(
    recorder: NWRecorder,
    config: NWProcessorConfig,
    *,
    layer: str,
    heads: tuple[int, ...],
    adapter: int,
    image: int,
    attn_w: torch.Tensor,
    nw_w: torch.Tensor,
) -> None:
    """Hand A and W ``[B, H, N, M]`` of one softmax to the recorder as bounded maps.

    Keeps the heads of ``config.map_heads`` (positions in ``heads``, the recorded head indices),
    averages them with ``map_head_mean``, pools the query rows by ``map_downsample`` over the
    latent grid (:func:`pool_query_rows`) and casts to ``map_dtype``, every processor family alike.
    """
    keep = heads if config.map_heads is None else tuple(h for h in heads if h in config.map_heads)
    if not keep:
        return
    positions = tuple(heads.index(h) for h in keep)
    device = attn_w.device
    pos = EagerWriter().constant(
        ("map heads", positions, device), lambda: torch.tensor(positions, device=device)
    )
    pair, grid = [], None
    for m in (attn_w.index_select(1, pos), nw_w.index_select(1, pos)):
        if config.map_head_mean:
            m = m.mean(dim=1, keepdim=True)
        if config.map_downsample > 1:
            m, grid = pool_query_rows(m, config.map_downsample, recorder.state.latent_hw)
        pair.append(m.to(getattr(torch, config.map_dtype)))
    meta = {
        "heads": "mean" if config.map_head_mean else ",".join(map(str, keep)),
        "downsample": str(config.map_downsample),
        "grid": "" if grid is None else f"{grid[0]}x{grid[1]}",
    }
    recorder.add_maps(layer=layer, adapter=adapter, image=image, attn=pair[0], nw=pair[1], meta=meta)


def pool_query_rows(
    m: torch.Tensor, factor: int, latent_hw: tuple[int, int] | None
) -> tuple[torch.Tensor, tuple[int, int]]:
    """Average-pool the query rows of maps [B, H, N, M] over the (h, w) grid by ``factor``."""
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
