"""The side computation shared by every NW processor family (UNet today; SD3 and Flux next).

Given the queries and the image keys of ONE softmax of an IP-Adapter image branch, exactly as
the stock processor forms them, this module computes the attention weights
A = softmax(q k^T * s), the Nadaraya-Watson weights W = softmax(-||q - k||^2 / 2h^2) at the
configured bandwidth h, and reduces their comparison over query rows to one statistics tensor
``[S, halves, H]`` (S = ``len(STAT_NAMES)``, CFG halves, H heads). Everything is computed from
one stacked tensor of logits with one rank pass (:func:`layer_statistics`), optionally as one
``torch.compile``'d graph per layer shape (``compile=True``). The family modules only find q,
k and an optional valid-key mask in their layer (hooks, head split, masks, adapters) and hand
the result to the recorder.

Imports: torch, the math layer (:mod:`nw_adapter.core`) and the integration's config/recorder
state; nothing of diffusers, so one implementation serves every model family.
"""

from __future__ import annotations

import logging
import math
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from nw_adapter.core import bandwidth as bw
from nw_adapter.core import metrics
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.recorder import NWRecorder, StepState

_LOG = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class NullDraws:
    """The random numbers of the nulls of one softmax, drawn in eager mode from the seeded generator.

    Attributes:
        rows: ``[n0]`` int64 query rows the nulls are estimated on.
        noise: ``[B, H, n0, M]`` i.i.d. normal values: one key permutation per row (their argsort).
        directions: ``[B, H, n0, d]`` standard normal values: the norm-matched queries' directions.
    """

    rows: torch.Tensor
    noise: torch.Tensor
    directions: torch.Tensor


def draw_nulls(
    q: torch.Tensor, num_keys: int, null_rows: int | None, generator: torch.Generator
) -> NullDraws:
    """Draw the nulls' random numbers for queries ``q`` ``[B, H, N, d]`` and ``num_keys`` keys.

    ``null_rows`` rows out of N are drawn without replacement (all N, in random order, when
    None or >= N), then one normal tensor ``[B, H, n0, M + d]`` gives the permutation noise
    (the argsort of i.i.d. continuous values is a uniform permutation) and the directions:
    2 random-number ops per softmax, outside any compiled region.
    """
    b, nh, n, d = q.shape
    n0 = n if null_rows is None else min(n, null_rows)
    rows = torch.randperm(n, generator=generator, device=q.device)[:n0]
    gauss = torch.randn((b, nh, n0, num_keys + d), generator=generator, device=q.device)
    return NullDraws(rows, gauss[..., :num_keys], gauss[..., num_keys:])


def layer_statistics(
    q: torch.Tensor,
    k: torch.Tensor,
    h: torch.Tensor | float,
    scale: float,
    valid: torch.Tensor | None = None,
    draws: NullDraws | None = None,
    halves: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All statistics of one softmax of the image branch, from one stacked tensor of logits.

    With ``G = q k^T`` (the attention's ranks) and ``G - ||k||^2 / 2`` (the NW weights' ranks at
    any h; THEORY.md section 4), the pairs (attention, NW) of the observed rows and of the three
    nulls are concatenated along the rows and ranked once (:func:`~nw_adapter.core.metrics.centered_ranks`):

    - observed: ``(q.k_i, q.k_i - ||k_i||^2/2)`` on all N rows;
    - permutation null: ``(q.k_pi(i), q.k_i - ||k_i||^2/2)`` on the n0 null rows;
    - norm-matched null: ``(q'.k_i, q'.k_i - ||k_i||^2/2)``, ``q' = ||q|| z / ||z||``;
    - q.k-spread null: ``(q.k_i, q.k_i - ||k_pi(i)||^2/2)`` (spreads kept, pairing broken).

    Divergences, n_eff and the raveled Pearson come from ``log_softmax`` of the stacked logits
    ``[s G, (G - ||k||^2/2) / h^2]``; top-1 from the unscaled logits. Pure torch, no random
    numbers and no host reads, so :func:`torch.compile` can fuse it per layer shape.

    Args:
        q: queries ``[B, H, N, d]`` (any float dtype; upcast to float32).
        k: image keys ``[B, H, M, d]``.
        h: NW bandwidth, a float or a ``[B, H]`` tensor.
        scale: the stock softmax scale s.
        valid: optional bool ``[B, M]`` mask of the keys that take part (padding keys: False).
        draws: the nulls' random numbers (:func:`draw_nulls`); None = nulls recorded as NaN.
        halves: 2 when the batch is [uncond; cond]: rho and its nulls are pooled over the query
            rows of each half's batch rows (constant rows left out), the other statistics
            averaged over them.

    Returns:
        ``(stats [S, halves, H], weights [2, B, H, N, M])``: the statistics in the order of
        :data:`~nw_adapter.integration.schema.STAT_NAMES`, and A, W.
    """
    q, k = q.float(), k.float()
    n = q.shape[-2]
    key_norm = torch.linalg.vector_norm(k, dim=-1)  # [B, H, M]
    sq_norm = key_norm.square()
    qk = q @ k.transpose(-1, -2)  # [B, H, N, M]
    g = torch.sub(qk, sq_norm[..., None, :], alpha=0.5)  # h^2 x NW logits (up to a row constant)
    key_valid = None if valid is None else valid[:, None, None, :]  # [B, 1, 1, M]
    q_norm = torch.linalg.vector_norm(q, dim=-1)  # [B, H, N]
    if draws is None:
        pairs = torch.stack([qk, g])  # [2, B, H, N, M]
        segments = 1
    else:
        qk_rows, g_rows = qk.index_select(-2, draws.rows), g.index_select(-2, draws.rows)
        perm = metrics.valid_permutation(draws.noise, key_valid)
        norm_ratio = q_norm.index_select(-1, draws.rows) / torch.linalg.vector_norm(draws.directions, dim=-1)
        qk_matched = (draws.directions * norm_ratio[..., None]) @ k.transpose(-1, -2)
        shuffled_sq = torch.gather(sq_norm[..., None, :].expand_as(qk_rows), -1, perm)
        left = torch.cat([qk, torch.gather(qk_rows, -1, perm), qk_matched, qk_rows], -2)
        right = [g, g_rows, torch.sub(qk_matched, sq_norm[..., None, :], alpha=0.5)]
        right = torch.cat([*right, torch.sub(qk_rows, shuffled_sq, alpha=0.5)], -2)
        pairs = torch.stack([left, right])  # [2, B, H, N + 3 n0, M]
        segments = 4
    ranks = metrics.rank_sign_sums(pairs, key_valid)  # 2 x centred ranks
    gram = (ranks[:, None] * ranks[None, :]).sum(-1)  # [2, 2, B, H, rows]
    den = gram[0, 0] * gram[1, 1]
    # per-row Spearman; a constant row (den = 0, num = 0) gives 0 and is left out of the count
    rho_rows = torch.stack([gram[0, 1] / den.sqrt().clamp_min(1e-30), den.sign()])  # [2, B, H, rows]
    sums = rho_rows @ _segment_matrix(n, pairs.shape[-2], segments, q.device)  # [2, B, H, segments]
    sums = sums.unflatten(1, (halves, -1)).sum(2)  # pooled over the batch rows of each CFG half
    rho_and_nulls = (sums[0] / sums[1]).movedim(-1, 0)  # [segments, halves, H]; NaN: every row constant
    if draws is None:
        rho_and_nulls = torch.cat([rho_and_nulls, _nan_like(rho_and_nulls, 3)])
    observed = pairs[..., :n, :]  # [2, B, H, N, M]
    if key_valid is not None:
        observed = observed.masked_fill(~key_valid, _MASKED_LOGIT)
    top1 = observed.argmax(-1)  # [2, B, H, N]
    log_w = torch.log_softmax(observed * _logit_coefficients(scale, h, q.device), -1)
    w = log_w.exp()  # [2, B, H, N, M]: A, W
    kl = (w[0] * (log_w[0] - log_w[1])).sum(-1)
    js_sum = (w * (log_w - torch.logaddexp(log_w[0], log_w[1]))).sum((0, -1))  # JS = js_sum / 2 + log 2
    neff = w.square().sum(-1).reciprocal()  # [2, B, H, N]
    qk_std = metrics.masked_std(qk, key_valid)
    rows = [kl[None], js_sum[None], neff, (top1[0] == top1[1])[None], q_norm[None], qk_std[None]]
    kl, js_sum, neff_a, neff_w, top1_rate, q_norm_mean, qk_spread = torch.cat(rows).mean(-1).unbind(0)
    sq_std, _ = _masked_std_mean(sq_norm, valid)
    norm_std, norm_mean = _masked_std_mean(key_norm, valid)
    if isinstance(h, torch.Tensor):
        h_t = h.float().expand(kl.shape)
    else:
        value = float(h)
        shape = kl.shape
        h_t = _cached(("h_t", value, *shape, q.device), lambda: torch.full(shape, value, device=q.device))
    per_row = [h_t, _raveled_pearson(w, key_valid), kl, js_sum, neff_a, neff_w, top1_rate, q_norm_mean]
    per_row += [norm_std / norm_mean, qk_spread / sq_std]
    others = torch.stack(per_row).unflatten(1, (halves, -1)).mean(2)  # [S - 4, halves, H]
    gain, offset = _affine_fix(q.device)
    others = torch.addcmul(offset, others, gain)  # JS = js_sum / 2 + log 2; ratio = qk std / (sq std / 2)
    return torch.cat([others[:1], rho_and_nulls, others[1:]]), w


def _affine_fix(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gain, offset)`` ``[S - 4, 1, 1]`` of the statistics besides rho and its nulls (one addcmul)."""

    def make() -> torch.Tensor:
        gain = torch.ones(_OTHERS, 1, 1, device=device)
        offset = torch.zeros(_OTHERS, 1, 1, device=device)
        gain[3], offset[3] = 0.5, math.log(2.0)  # js
        gain[-1] = 2.0  # qk_spread_ratio: std(q.k) / std(||k||^2 / 2)
        return torch.stack([gain, offset])

    return _cached(("affine", device), make).unbind(0)


_OTHERS = 10
"""Statistics besides rho and its three nulls, in STAT_NAMES order (bandwidth first)."""


_MASKED_LOGIT = -1e20
"""Finite logit of a padding key: weight exactly 0, log-weight differences stay finite."""

_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _cached(key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A constant tensor made once per key (no host-to-device copy after the first layer call)."""
    if torch.compiler.is_compiling():
        return make()
    if key not in _CONSTANTS:
        if len(_CONSTANTS) > 256:
            _CONSTANTS.clear()
        _CONSTANTS[key] = make()
    return _CONSTANTS[key]


def _segment_matrix(n: int, rows: int, segments: int, device: torch.device) -> torch.Tensor:
    """``[rows, segments]`` indicator: row < n -> segment 0, then equal blocks of the null rows."""

    def make() -> torch.Tensor:
        index = torch.arange(rows, device=device)
        block = max((rows - n) // max(segments - 1, 1), 1)
        seg = torch.where(index < n, 0, 1 + torch.div(index - n, block, rounding_mode="floor"))
        return (seg[:, None] == torch.arange(segments, device=device)).float()

    return _cached(("segments", n, rows, segments, device), make)


def _nan_like(x: torch.Tensor, count: int) -> torch.Tensor:
    shape = (count, *x.shape[1:])
    return _cached(("nan", *shape, x.device), lambda: torch.full(shape, math.nan, device=x.device))


def _logit_coefficients(scale: float, h: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """``[2, ..., 1, 1]`` multipliers of the stacked (q.k, q.k - ||k||^2/2): s and 1/h^2."""
    if isinstance(h, torch.Tensor):
        inv_h2 = h.float().reciprocal().square()  # [] or [B, H]
        coef = torch.stack([torch.full_like(inv_h2, scale), inv_h2])
        return coef.view(2, *([1, 1] if inv_h2.dim() == 0 else inv_h2.shape), 1, 1)
    return _cached(
        ("coef", scale, float(h), device), lambda: torch.tensor([scale, float(h) ** -2], device=device)
    ).view(2, 1, 1, 1, 1)


def _masked_std_mean(x: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Population std and mean over the last dim of ``x`` ``[B, H, M]`` (valid keys ``[B, M]`` only)."""
    if valid is None:
        return torch.std_mean(x, dim=-1, correction=0)
    weight = valid[:, None, :].to(x.dtype)
    mean = (x * weight).sum(-1) / weight.sum(-1)
    return metrics.masked_std(x, valid[:, None, :]), mean


def _raveled_pearson(w: torch.Tensor, key_valid: torch.Tensor | None) -> torch.Tensor:
    """Pearson r of A and W flattened over (rows, valid keys): ``w`` ``[2, B, H, N, M]`` -> ``[B, H]``."""
    if key_valid is None:
        centred = w - w.mean((-2, -1), keepdim=True)
    else:
        weight = key_valid.to(w.dtype)
        count = weight.sum(-1, keepdim=True)[..., None] * w.shape[-2]
        centred = (w - (w * weight).sum((-2, -1), keepdim=True) / count) * weight
    gram = (centred[:, None] * centred[None, :]).sum((-2, -1))  # [2, 2, B, H]
    return gram[0, 1] / (gram[0, 0] * gram[1, 1]).sqrt()


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
    """Statistics of A = softmax(q k^T * s) against the NW weights W, per (batch row, head).

    Resolves h, draws the nulls' random numbers (eager) and runs :func:`layer_statistics`,
    compiled per layer shape when ``config.compile`` is set (see :func:`compiled_statistics`).

    Args:
        q: queries ``[B, H, N, d]``.
        k: image keys ``[B, H, M, d]`` of one softmax.
        scale: s, the stock softmax scale.
        bandwidth: ``A or None -> h`` (a float or ``[B, H]``), see :func:`resolve_bandwidth`
            (called with None: the data-dependent rules form A themselves).
        config: ``nulls``, ``null_rows`` and ``compile`` are read.
        generator: the seeded generator of the nulls (``None`` when ``config.nulls`` is off).
        valid: optional bool ``[B, M]`` mask of the keys that take part.
        halves: 2 when the batch is [uncond; cond] (statistics averaged within each half).

    Returns:
        ``(stats [S, halves, H], A [B, H, N, M], W [B, H, N, M])`` with the rows of ``stats``
        in the order of :data:`~nw_adapter.integration.schema.STAT_NAMES`.
    """
    h = bandwidth(None)
    draws = None
    if config.nulls and generator is not None:
        draws = draw_nulls(q, k.shape[-2], config.null_rows, generator)
    function = compiled_statistics() if config.compile else layer_statistics
    if function is not layer_statistics and not isinstance(h, torch.Tensor):
        value = float(h)  # a 0-d tensor: one graph for every value of h (made once per value)
        h = _cached(("h", value, q.device), lambda: torch.full((), value, device=q.device))
    stats, weights = function(q, k, h, scale, valid, draws, halves)
    return stats, weights[0], weights[1]


_COMPILED: dict[str, Any] = {}


def compiled_statistics() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """:func:`layer_statistics` under :func:`torch.compile` (one graph per layer shape), or eager.

    Compiled once per process (``dynamic=False``: dynamo specialises one graph per layer shape on
    first use). If compilation is unavailable (no C++/Triton toolchain, unsupported platform), one
    warning line says so and the eager function is used; the results are the same within float32
    tolerance either way. The compile time of each new shape is logged (logger
    ``nw_adapter.integration.processors.side``) and summed in :data:`COMPILE_SECONDS`.
    """
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = _CompiledStatistics()
    return _COMPILED["fn"]


COMPILE_SECONDS: dict[str, float] = {}
"""Seconds spent in the first call of each compiled layer shape (compilation + one run)."""


class _CompiledStatistics:
    """Callable wrapper: torch.compile'd :func:`layer_statistics` with timing and an eager fallback.

    ``launches[shape key]`` holds the kernels one call of that shape's graph launches (fused
    kernels plus extern calls such as ``bmm`` and ``sort``), read from the generated code.
    """

    def __init__(self) -> None:
        self.function: Callable[..., Any] | None = torch.compile(layer_statistics, dynamic=False)
        self.seen: set[tuple] = set()
        self.launches: dict[tuple, int] = {}

    def __call__(self, q, k, h, scale, valid, draws, halves):  # noqa: ANN001, ANN204 - as layer_statistics
        if self.function is None:
            return layer_statistics(q, k, h, scale, valid, draws, halves)
        key = (tuple(q.shape), tuple(k.shape), q.dtype, q.device, valid is None, draws is None, halves)
        first = key not in self.seen
        start = time.perf_counter()
        try:
            if first:
                out, launches = _run_and_count_launches(self.function, q, k, h, scale, valid, draws, halves)
                self.launches[key] = launches
            else:
                out = self.function(q, k, h, scale, valid, draws, halves)
        except Exception as err:  # noqa: BLE001 - a backend failure falls back to eager
            out = layer_statistics(q, k, h, scale, valid, draws, halves)  # a genuine error raises here
            message = str(err).splitlines()[0][:120] if str(err) else ""
            warnings.warn(
                f"NWProcessorConfig(compile=True): torch.compile is unavailable here ({type(err).__name__}: "
                f"{message}); the side computation runs eagerly (same statistics, more operations)",
                stacklevel=3,
            )
            self.function = None
            return out
        if first:
            self.seen.add(key)
            seconds = time.perf_counter() - start
            COMPILE_SECONDS[str(key[:2])] = seconds
            _LOG.info("compiled the NW side computation for q %s, k %s in %.1f s", key[0], key[1], seconds)
        return out


_LAUNCH = re.compile(
    r"^\s+(?:\w+ = )?(cpp_fused_\w+\(|triton_\w+\.run\(|extern_kernels\.\w+\(|aten\.|torch\.ops\.)"
)
"""A line of inductor's wrapper ``call`` that launches a kernel (fused, extern or aten fallback)."""


def _run_and_count_launches(function: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """Run a compiled function for the first time and count the kernel launches in its generated code."""
    try:
        from torch._inductor.utils import run_and_get_code
    except ImportError:  # pragma: no cover - older torch: no count
        return function(*args), -1
    out, codes = run_and_get_code(function, *args)
    launches = 0
    for code in codes:
        body = code.split("def call(", 1)[-1].split("\ndef ", 1)[0]
        launches += sum(1 for line in body.splitlines() if _LAUNCH.match(line))
    return out, launches


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
    pos = _cached(("map heads", positions, device), lambda: torch.tensor(positions, device=device))
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
