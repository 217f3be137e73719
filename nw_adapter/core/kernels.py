"""Nadaraya-Watson (Gaussian-kernel) weights, means and attention (THEORY.md sections 1 and 3).

All functions are batched over leading dimensions and pure torch:

* ``query`` ``[..., n, d]`` and ``support`` ``[..., m, d]``; their leading dimensions broadcast.
* ``support_mask`` (optional) bool ``[..., m]``, ``True`` = valid support point (ragged ``m``).
* ``bandwidth`` is a positive ``float`` or a tensor whose shape broadcasts with the leading
  dimensions. It is applied as ``bandwidth[..., None, None]`` against the ``[..., n, m]`` logits,
  so a ``[B, H]`` (or ``[H]``) tensor gives one bandwidth per (batch, head) for ``[B, H, n, d]``
  queries. Extra leading dimensions of ``bandwidth`` are allowed and appear in the output
  (e.g. a ``[T]`` bandwidth with ``[n, d]`` queries gives ``[T, n, m]`` weights).

The shape of every result is ``L + (n, m)`` or ``L + (n, d_v)`` where ``L`` is the broadcast of
``query.shape[:-2]``, ``support.shape[:-2]``, ``support_mask.shape[:-1]`` and ``bandwidth.shape``.

Numerics: inputs are upcast to float32 (float64 stays float64) and never run under autocast.
:func:`gaussian_kernel_attention` centres query and key on the (masked) key mean before the
expanded form is used, so data far from the origin loses nothing beyond the rounding of the
inputs themselves; the direct differences of :func:`nw_logits` need no centring.
:func:`gaussian_kernel_head` (the swap processor's hot path) centres only the keys, on their
first row, and passes the queries to SDPA untouched: one SDPA call plus five small operations on
the keys (see its docstring for the error bound).
:func:`nw_logits` / :func:`nw_weights` use direct differences ``x - s_i`` (fused, ``torch.cdist``);
:func:`gaussian_kernel_attention` uses the expanded dot-product form required by SDPA, whose
absolute logit error is of order ``eps * (||x - c||^2 + ||s_i - c||^2) / (2 h^2)`` with ``c`` the
support mean. On CUDA, enabling TF32 matmuls (``torch.backends.cuda.matmul.allow_tf32``) lowers
``eps`` of that form to ~1e-3; keep it off when float32 accuracy matters.

A support row whose mask is all ``False`` has no NW weights: with ``validate=True`` this raises
``ValueError``; with ``validate=False`` its logits are ``-inf`` and its weights and means ``NaN``.

``validate=True`` (default) additionally checks values (NaN/inf inputs, bandwidth > 0 for tensor
bandwidths, empty mask rows); these checks synchronise with the device. Shape checks are always
done and cost nothing. Hot paths (the attention processor) pass ``validate=False``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ELEMENT_BUDGET",
    "compute_dtype",
    "effective_sample_size",
    "gaussian_kernel_attention",
    "gaussian_kernel_head",
    "no_autocast",
    "nw_logits",
    "nw_mean",
    "nw_weights",
]

#: Default number of elements of the largest intermediate tensor; chunk sizes derive from it.
ELEMENT_BUDGET = 2**24

BandwidthLike = float | Tensor


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """The dtype used for the math: float64 if any given tensor is float64, else float32."""
    any64 = any(t is not None and t.dtype == torch.float64 for t in tensors)
    return torch.float64 if any64 else torch.float32


@contextlib.contextmanager
def no_autocast(device: torch.device) -> Iterator[None]:
    """Context in which autocast is disabled for ``device``'s type (no-op where unsupported)."""
    if torch.amp.is_autocast_available(device.type):
        with torch.autocast(device_type=device.type, enabled=False):
            yield
    else:
        yield


def _check_points(name: str, x: object, what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {what}, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{name} must have shape {what} (at least 2 dims), got shape {tuple(x.shape)}")
    if not (x.is_floating_point()):
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}; cast it with .float()")
    return x


def _check_finite(name: str, x: Tensor, valid: Tensor | None = None) -> None:
    ok = torch.isfinite(x)
    if valid is not None:
        ok = ok | ~valid[..., None]
    if not bool(ok.all()):
        raise ValueError(f"{name} contains NaN or inf values; remove or mask them")


def _broadcast(names: tuple[str, ...], shapes: tuple[torch.Size | tuple[int, ...], ...]) -> torch.Size:
    try:
        return torch.broadcast_shapes(*shapes)
    except RuntimeError as err:
        desc = ", ".join(f"{n} {tuple(s)}" for n, s in zip(names, shapes, strict=True))
        raise ValueError(f"leading dimensions do not broadcast: {desc}") from err


def _bandwidth(
    bandwidth: BandwidthLike, dtype: torch.dtype, device: torch.device, validate: bool
) -> Tensor | float:
    """Validate a bandwidth and return it as a float or a tensor of ``dtype`` on ``device``."""
    if isinstance(bandwidth, Tensor):
        if bandwidth.is_complex() or bandwidth.dtype == torch.bool:
            raise ValueError(f"bandwidth must be a real tensor, got dtype {bandwidth.dtype}")
        h = bandwidth.to(device=device, dtype=dtype)
        if validate and not bool(((h > 0) & torch.isfinite(h)).all()):
            raise ValueError("bandwidth must be finite and > 0 everywhere, got a value <= 0 or non-finite")
        return h
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, int | float):
        raise ValueError(f"bandwidth must be a float or a Tensor, got {type(bandwidth).__name__}")
    if not (math.isfinite(bandwidth) and bandwidth > 0):
        raise ValueError(f"bandwidth must be finite and > 0, got {bandwidth}")
    return float(bandwidth)


def _expand_h(h: Tensor | float) -> Tensor | float:
    return h[..., None, None] if isinstance(h, Tensor) else h


def _prepare(
    query: Tensor,
    support: Tensor,
    bandwidth: BandwidthLike,
    support_mask: Tensor | None,
    validate: bool,
    names: tuple[str, str, str] = ("query", "support", "support_mask"),
    extra: tuple[Tensor, ...] = (),
    centre: bool = True,
) -> tuple[Tensor, Tensor, Tensor | float, Tensor | None, torch.Size]:
    """Validate, upcast and (optionally) centre. Returns (q - c, s - c, h, mask, leading shape L).

    Masked support rows are zeroed so garbage (NaN) there cannot leak into any result.
    """
    qn, sn, mn = names
    _check_points(qn, query, "[..., n, d]")
    _check_points(sn, support, "[..., m, d]")
    if query.shape[-1] != support.shape[-1]:
        raise ValueError(
            f"{qn} and {sn} must have the same feature dim d, got {query.shape[-1]} and {support.shape[-1]}"
        )
    m = support.shape[-2]
    if m == 0:
        raise ValueError(f"{sn} is empty (m = 0 points); at least one support point is required")
    dtype = compute_dtype(query, support, *extra)
    q = query.to(dtype)
    s = support.to(device=q.device, dtype=dtype)
    h = _bandwidth(bandwidth, dtype, q.device, validate)
    shapes: list[tuple[str, torch.Size]] = [(qn, query.shape[:-2]), (sn, support.shape[:-2])]
    mask = None
    if support_mask is not None:
        if not isinstance(support_mask, Tensor) or support_mask.dtype != torch.bool:
            raise ValueError(f"{mn} must be a bool tensor [..., m] (True = valid)")
        if support_mask.dim() < 1 or support_mask.shape[-1] != m:
            raise ValueError(
                f"{mn} must have shape [..., m] with m = {m}, got shape {tuple(support_mask.shape)}"
            )
        mask = support_mask.to(q.device)
        shapes.append((mn, support_mask.shape[:-1]))
    if isinstance(h, Tensor):
        shapes.append(("bandwidth", h.shape))
    lead = _broadcast(tuple(n for n, _ in shapes), tuple(s_ for _, s_ in shapes))
    if validate:
        _check_finite(qn, q)
        _check_finite(sn, s, mask)
        if mask is not None and not bool(mask.any(-1).all()):
            raise ValueError(f"{mn} has a row with no valid support point (all False); every row needs one")
    if mask is not None:
        s = torch.where(mask[..., None], s, torch.zeros((), dtype=dtype, device=s.device))
    if not centre:
        return q, s, h, mask, lead
    if mask is None:
        c = s.mean(dim=-2, keepdim=True)
    else:
        count = mask[..., None].sum(dim=-2, keepdim=True).clamp_min(1).to(dtype)
        c = s.sum(dim=-2, keepdim=True) / count
    return q - c, s - c, h, mask, lead


def _as_4d(x: Tensor, heads: int) -> Tensor:
    """``[L..., r, c]`` -> ``[prod(L[:-1]), L[-1], r, c]`` (a view when the layout allows)."""
    return x.reshape(-1, heads, x.shape[-2], x.shape[-1])


def _pad_last(x: Tensor, width: int) -> Tensor:
    """Zero-pad the last dim of ``x`` to ``width`` (no copy when already that wide)."""
    extra = width - x.shape[-1]
    return x if extra == 0 else torch.cat([x, x.new_zeros((*x.shape[:-1], extra))], dim=-1)


def _rows_per_chunk(lead: torch.Size, per_row: int, budget: int) -> int:
    return max(1, budget // max(1, math.prod(lead) * per_row))


def _sdpa_by_rows(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, rows: int, scale: float = 1.0
) -> Tensor:
    """``SDPA(q, k, v, attn_mask, scale)`` over chunks of ``rows`` query rows.

    Each chunk is written into one preallocated output (no list of chunks and ``torch.cat``), so
    the peak extra memory is the output plus one chunk's ``[B, H, rows, m]`` intermediates.

    Args:
        q: ``[B, H, n, w]`` queries.
        k: ``[B, H, m, w]`` keys.
        v: ``[B, H, m, w_v]`` values.
        attn_mask: ``None`` or a mask broadcastable to ``[B, H, n or 1, m]`` (bool or additive);
            a mask with one row is shared by every chunk, else it is sliced with the queries.
        rows: query rows per SDPA call (>= 1).
        scale: SDPA's factor on ``q k^T`` (any real number; 1 by default).

    Returns:
        ``[B, H, n, w_v]`` in the dtype of ``q``.
    """
    n = q.shape[-2]
    if n <= rows:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    out = q.new_empty((*torch.broadcast_shapes(q.shape[:-2], v.shape[:-2]), n, v.shape[-1]))
    per_row = attn_mask is not None and attn_mask.shape[-2] != 1
    for i in range(0, n, rows):
        mask_i = attn_mask[..., i : i + rows, :] if per_row and attn_mask is not None else attn_mask
        out[..., i : i + rows, :] = F.scaled_dot_product_attention(
            q[..., i : i + rows, :], k, v, attn_mask=mask_i, scale=scale
        )
    return out


def nw_logits(
    query: Tensor,
    support: Tensor,
    bandwidth: BandwidthLike,
    *,
    support_mask: Tensor | None = None,
    validate: bool = True,
) -> Tensor:
    """Gaussian-kernel logits ``l_ij = -||x_j - s_i||^2 / (2 h^2)``.

    Args:
        query: ``[..., n, d]`` query points x.
        support: ``[..., m, d]`` support points s.
        bandwidth: ``h > 0``, float or tensor broadcastable as ``bandwidth[..., None, None]``.
        support_mask: optional bool ``[..., m]``, True = valid; invalid entries get ``-inf``.
        validate: check values (NaN, h > 0, empty mask rows); synchronises with the device.

    Returns:
        ``[L..., n, m]`` float32 (float64 for float64 inputs). Direct differences of centred
        points are used (``torch.cdist`` without the matmul form), so the result is accurate to
        a few ulps of ``||x - s||^2 / 2h^2``.
    """
    return _logits(query, support, bandwidth, support_mask, validate)


def _logits(
    query: Tensor,
    support: Tensor,
    bandwidth: BandwidthLike,
    support_mask: Tensor | None,
    validate: bool,
    names: tuple[str, str, str] = ("query", "support", "support_mask"),
) -> Tensor:
    """:func:`nw_logits` with the argument names used in error messages as a parameter."""
    # direct differences need no centring: x - s is exact up to one rounding wherever x ~ s
    q, s, h, mask, lead = _prepare(query, support, bandwidth, support_mask, validate, names, centre=False)
    n, m = q.shape[-2], s.shape[-2]
    with no_autocast(q.device):
        inv = _expand_h(h)
        # fused direct differences (no [n, m, d] intermediate, no expanded-form cancellation)
        dist = torch.cdist(q, s, compute_mode="donot_use_mm_for_euclid_dist")
        logits = (dist.square() * (-0.5 / (inv * inv))).expand(*lead, n, m)
        if mask is not None:
            logits = torch.where(mask[..., None, :], logits, torch.full((), -math.inf, dtype=logits.dtype))
    return logits


def nw_weights(
    query: Tensor,
    support: Tensor,
    bandwidth: BandwidthLike,
    *,
    support_mask: Tensor | None = None,
    validate: bool = True,
) -> Tensor:
    """NW weights ``w_ij = softmax_i(-||x_j - s_i||^2 / (2 h^2))`` (rows sum to 1).

    Args: as :func:`nw_logits`.

    Returns:
        ``[L..., n, m]`` float32 (float64 for float64 inputs); masked entries are 0, rows of an
        all-masked support are NaN (only reachable with ``validate=False``).

    Example:
        >>> q, k = torch.randn(2, 8, 64, 40), torch.randn(2, 8, 4, 40)  # [B, H, n, d], [B, H, m, d]
        >>> w = nw_weights(q, k, torch.full((8,), 40**0.25), validate=False)  # h per head
        >>> w.shape
        torch.Size([2, 8, 64, 4])
    """
    logits = nw_logits(query, support, bandwidth, support_mask=support_mask, validate=validate)
    with no_autocast(logits.device):
        return torch.softmax(logits, dim=-1)


def gaussian_kernel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bandwidth: BandwidthLike,
    *,
    key_mask: Tensor | None = None,
    form: str = "bias",
    chunk_size: int | None = None,
    out_dtype: torch.dtype | None = None,
    validate: bool = True,
) -> Tensor:
    """Gaussian-kernel attention ``out_j = sum_i softmax_i(-||q_j - k_i||^2 / 2h^2) v_i`` via SDPA.

    THEORY.md section 3: with ``c`` the (masked) key mean, ``q' = q - c`` and
    ``k'_i = (k_i - c)/h^2``, ``-||q - k_i||^2 / 2h^2 = q'.k'_i + b_i + (const in i)`` with the
    bias ``b_i = -||k_i - c||^2 / 2h^2``. The whole ``1/h^2`` is carried by the ``m`` keys and
    the bias, so the ``n`` queries are copied once (centring, needed for float32 accuracy far
    from the origin) and never rescaled.

    * ``form="bias"``: ``SDPA(q', k', v, attn_mask = b (-inf if masked), scale=1)``.
    * ``form="augmented"``: ``q'' = [q', 1, 0...]``, ``k''_i = [k'_i, b_i, 0...]`` zero-
      padded to a multiple of 8 features, ``SDPA(q'', k'', v, scale=1)`` (bool mask if masked).

    Args:
        query: ``[..., n, d]``.
        key: ``[..., m, d]``.
        value: ``[..., m, d_v]``.
        bandwidth: ``h > 0``, float or tensor broadcastable as ``bandwidth[..., None, None]``.
        key_mask: optional bool ``[..., m]``, True = valid key.
        form: ``"bias"`` or ``"augmented"``.
        chunk_size: queries per SDPA call; ``None`` chooses ``ELEMENT_BUDGET // (prod(L) * m)``,
            so the peak extra memory is ``O(chunk_size * m)`` per leading index, never ``n * m``.
        out_dtype: dtype of the result; ``None`` = ``value.dtype`` (as SDPA itself). The math is
            always float32 or better.
        validate: check values (NaN, h > 0, empty mask rows); synchronises with the device.

    Returns:
        ``[L..., n, d_v]``. Rows with no valid key are NaN (only reachable with validate=False).

    Example:
        >>> x, s = torch.randn(65536, 64), torch.randn(1024, 64)
        >>> m = gaussian_kernel_attention(x, s, s, 3.0, form="augmented", chunk_size=8192)
        >>> m.shape
        torch.Size([65536, 64])
    """
    if form not in ("bias", "augmented"):
        raise ValueError(f"form must be 'bias' or 'augmented', got {form!r}")
    bad_chunk = isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    if chunk_size is not None and bad_chunk:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    _check_points("value", value, "[..., m, d_v]")
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(
            f"value must have as many rows as key (m), got value {tuple(value.shape)}, key {tuple(key.shape)}"
        )
    out_dtype = value.dtype if out_dtype is None else out_dtype
    q, k, h, mask, lead = _prepare(
        query, key, bandwidth, key_mask, validate, names=("query", "key", "key_mask"), extra=(value,)
    )
    if validate:
        _check_finite("value", value, mask)
    lead = _broadcast(("query/key/bandwidth", "value"), (lead, value.shape[:-2]))
    n, m, d = q.shape[-2], k.shape[-2], q.shape[-1]
    with no_autocast(q.device):
        v = value.to(device=q.device, dtype=q.dtype)
        if mask is not None:
            v = torch.where(mask[..., None], v, torch.zeros((), dtype=v.dtype, device=v.device))
        # 1/h^2 goes into the m keys and the bias; the n queries (the big tensor) are only centred
        if isinstance(h, Tensor):
            inv_h2 = h.reciprocal().square()
            k_scale: Tensor | float = inv_h2[..., None, None]
            b_scale: Tensor | float = inv_h2[..., None]
        else:
            k_scale = b_scale = 1.0 / (h * h)
        bias = (-0.5 * k.square().sum(dim=-1)) * b_scale  # -||k_i - c||^2 / 2h^2, [.., m]
        k = k * k_scale
        q = q.expand(*lead, n, d)
        k = k.expand(*lead, m, d)
        v = v.expand(*lead, m, v.shape[-1])
        bias = bias.expand(*lead, m)
        d_v = v.shape[-1]
        if form == "bias":
            if mask is not None:
                neg_inf = torch.full((), -math.inf, dtype=bias.dtype, device=bias.device)
                bias = torch.where(mask, bias, neg_inf)
            attn_mask: Tensor | None = bias[..., None, :]
            width = max(d, d_v)
            q, k_in = _pad_last(q, width), _pad_last(k, width)
        else:
            width = max(d + 1 + (-(d + 1)) % 8, d_v)
            k_in = _pad_last(torch.cat([k, bias[..., None]], dim=-1), width)
            q = _pad_last(torch.cat([q, q.new_ones((*lead, n, 1))], dim=-1), width)
            attn_mask = None if mask is None else mask.expand(*lead, m)[..., None, :]
        # Fused kernels need one common head dim for q, k and v: zero-pad v (sliced off below).
        v = _pad_last(v, width)
        # SDPA's fused CPU/GPU kernels need 4-D [batch, heads, rows, features] inputs
        # (3-D inputs fall back to the slow math path): fold the leading dims into two.
        heads = lead[-1] if len(lead) else 1
        q, k_in, v = (_as_4d(t, heads) for t in (q, k_in, v))
        attn_mask = None if attn_mask is None else _as_4d(attn_mask, heads)
        rows = chunk_size or _rows_per_chunk(lead, m, ELEMENT_BUDGET)
        out = _sdpa_by_rows(q, k_in, v, attn_mask, rows)[..., :d_v].reshape(*lead, n, d_v)
        if mask is not None:
            any_valid = mask.any(dim=-1).expand(lead)
            out = torch.where(any_valid[..., None, None], out, torch.full((), math.nan, dtype=out.dtype))
    return out.to(out_dtype)


_IDENTITIES: dict[tuple, Tensor] = {}


def _scaled_identity(d: int, value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``value * I`` as a ``[1, d, d]`` bilinear weight, made once per (d, value, dtype, device)."""
    key = (d, value, dtype, device)
    if key not in _IDENTITIES:
        if len(_IDENTITIES) > 64:
            _IDENTITIES.clear()
        _IDENTITIES[key] = (torch.eye(d, dtype=dtype, device=device) * value)[None]
    return _IDENTITIES[key]


def _bilinear_in_memory_order(x: Tensor, y: Tensor, weight: Tensor) -> Tensor:
    """``F.bilinear(x, y, weight)[..., 0]`` for ``x``, ``y`` ``[..., d]`` of the same strides, computed
    with the leading dims in memory order, so a transposed layout (a processor's head split) is
    flattened as a view instead of copied."""
    lead = sorted(range(x.dim() - 1), key=lambda i: -x.stride(i))
    order = [*lead, x.dim() - 1]
    out = F.bilinear(x.permute(order), y.permute(order), weight)[..., 0]
    return out.permute([lead.index(i) for i in range(x.dim() - 1)])


def gaussian_kernel_head(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bandwidth: BandwidthLike,
    *,
    chunk_size: int | None = None,
) -> Tensor:
    """The exact NW head as one SDPA call with the queries passed through untouched (swap's hot path).

    Computes ``out_j = sum_i softmax_i(-||q_j - k_i||^2 / 2h^2) v_i`` (THEORY.md section 3) as

        SDPA(q, k - k_0, v, attn_mask = b, scale = 1/h^2),   b_i = -(k_i - k_0).(k_i + k_0) / 2h^2,

    because ``-||q - k_i||^2 / 2h^2 = q.(k_i - k_0)/h^2 - (||k_i||^2 - ||k_0||^2)/2h^2 + (terms
    constant in i)`` and ``||k_i||^2 - ||k_0||^2 = (k_i - k_0).(k_i + k_0)``. The keys are centred on
    their first row ``k_0`` (a view: no reduction), so keys far from the origin keep their
    precision; ``1/h^2`` is SDPA's own ``scale``. For a float bandwidth the head dispatches five
    small operations on the ``[..., m, d]`` keys (sub, add, mul, sum, mul) and one SDPA call; the
    ``n`` queries are neither copied nor rescaled (float32/float64 queries). This is what lets
    swap cost what the stock image branch costs (``nw_adapter.integration.processors.unet``).

    Accuracy: the float32 logit error is of order ``eps (||q_j|| + ||k_i + k_0||) ||k_i - k_0|| / h^2``
    per product term. The queries are not centred, so queries that share a large offset with the
    keys (``||q|| >> ||q - k||``) lose precision here: use :func:`gaussian_kernel_attention` for
    those (it centres the queries too, at the cost of one copy of them). Attention queries and
    image keys of a diffusion model live in different projections and share no such offset.

    No value checks are made (nothing synchronises with the device); shapes are checked.

    Args:
        query: ``[..., n, d]`` (float16/bfloat16 queries are upcast: one copy).
        key: ``[..., m, d]``; every key is valid (no mask).
        value: ``[..., m, d_v]``.
        bandwidth: ``h > 0``, float or tensor broadcastable as ``bandwidth[..., None, None]``.
        chunk_size: queries per SDPA call; ``None`` chooses ``ELEMENT_BUDGET // (prod(L) * m)``.

    Returns:
        ``[L..., n, d_v]`` in float32 (float64 if any input is float64), ``L`` the broadcast of
        the leading dimensions of query, key, value and bandwidth.

    Example:
        >>> q, k, v = torch.randn(2, 8, 4096, 40), torch.randn(2, 8, 4, 40), torch.randn(2, 8, 4, 40)
        >>> gaussian_kernel_head(q, k, v, 40**0.25).shape
        torch.Size([2, 8, 4096, 40])
    """
    bad_chunk = isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    if chunk_size is not None and bad_chunk:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    _check_points("query", query, "[..., n, d]")
    _check_points("key", key, "[..., m, d]")
    _check_points("value", value, "[..., m, d_v]")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must have the same feature dim d, got {query.shape[-1]} and {key.shape[-1]}"
        )
    m = key.shape[-2]
    if m == 0 or value.shape[-2] != m:
        raise ValueError(
            f"key and value must have the same number m >= 1 of rows, got key {tuple(key.shape)}, "
            f"value {tuple(value.shape)}"
        )
    dtype = compute_dtype(query, key, value)
    q = query.to(dtype)
    k = key.to(device=q.device, dtype=dtype)
    v = value.to(device=q.device, dtype=dtype)
    h = _bandwidth(bandwidth, dtype, q.device, validate=False)
    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2], *([h.shape] if isinstance(h, Tensor) else [])]
    lead = _broadcast(("query", "key", "value", "bandwidth")[: len(shapes)], tuple(shapes))
    n, d_v = q.shape[-2], v.shape[-1]
    with no_autocast(q.device):
        k_0 = k[..., :1, :]
        centred = k - k_0
        if isinstance(h, Tensor):
            inv_h2 = h.reciprocal().square()[..., None]  # [L..., 1]
            bias = (centred * (k + k_0)).sum(dim=-1) * (-0.5 * inv_h2)  # [L..., m]
            centred = centred * inv_h2[..., None]
            scale = 1.0
        else:
            scale = 1.0 / (h * h)
            # bias_i = -(||k_i||^2 - ||k_0||^2) / 2h^2 = (k_i - k_0)^T W (k_i + k_0), W = -I / 2h^2:
            # one bilinear op instead of a product, a sum and a scale (3 launches on a GPU)
            weight = _scaled_identity(k.shape[-1], -0.5 * scale, dtype, q.device)
            bias = _bilinear_in_memory_order(centred, k + k_0, weight)  # [..., m]
        heads = lead[-1] if len(lead) else 1
        q4, k4, v4 = (_as_4d(t.expand(*lead, *t.shape[-2:]), heads) for t in (q, centred, v))
        mask4 = _as_4d(bias.expand(*lead, m)[..., None, :], heads)
        rows = chunk_size or _rows_per_chunk(lead, m, ELEMENT_BUDGET)
        out = _sdpa_by_rows(q4, k4, v4, mask4, rows, scale)
    return out.reshape(*lead, n, d_v)


def nw_mean(
    query: Tensor,
    support: Tensor,
    bandwidth: BandwidthLike,
    *,
    values: Tensor | None = None,
    support_mask: Tensor | None = None,
    chunk_size: int | None = None,
    form: str = "bias",
    validate: bool = True,
) -> Tensor:
    """NW local mean ``m_h(x_j) = sum_i w_ij v_i`` with ``w`` the NW weights and ``v = s`` by default.

    Args:
        query: ``[..., n, d]``.
        support: ``[..., m, d]``.
        bandwidth: ``h > 0``, float or tensor broadcastable as ``bandwidth[..., None, None]``.
        values: ``[..., m, d_v]`` averaged values (default: ``support``).
        support_mask: optional bool ``[..., m]``, True = valid.
        chunk_size: queries per chunk (see :func:`gaussian_kernel_attention`).
        form: ``"bias"`` / ``"augmented"`` (SDPA, fast) or ``"direct"`` (explicit weights from
            direct differences, :func:`nw_weights`; most accurate for tiny bandwidths).
        validate: value checks, see the module docstring.

    Returns:
        ``[L..., n, d_v]`` in float32 (float64 for float64 inputs).
    """
    values = support if values is None else values
    if form == "direct":
        _check_points("values", values, "[..., m, d_v]")
        if values.shape[-2] != support.shape[-2]:
            raise ValueError(f"values must have m = {support.shape[-2]} rows, got {tuple(values.shape)}")
        w = nw_weights(query, support, bandwidth, support_mask=support_mask, validate=validate)
        v = values.to(device=w.device, dtype=compute_dtype(w, values))
        if support_mask is not None:
            v = torch.where(support_mask[..., None].to(v.device), v, torch.zeros((), dtype=v.dtype))
        with no_autocast(w.device):
            return w.to(v.dtype) @ v
    out_dtype = compute_dtype(query, support, values)
    return gaussian_kernel_attention(
        query,
        support,
        values,
        bandwidth,
        key_mask=support_mask,
        form=form,
        chunk_size=chunk_size,
        out_dtype=out_dtype,
        validate=validate,
    )


def effective_sample_size(weights: Tensor) -> Tensor:
    """Effective sample size ``n_eff = 1 / sum_i w_i^2`` over the last dim.

    Args:
        weights: ``[..., m]`` rows of probability weights (rows summing to 1).

    Returns:
        ``[...]`` in float32 (float64 for float64 input); 1 = one point dominates, m = uniform.
    """
    if not isinstance(weights, Tensor) or weights.dim() < 1:
        raise ValueError("weights must be a tensor [..., m] of probability rows")
    w = weights.to(compute_dtype(weights))
    with no_autocast(w.device):
        return 1.0 / w.square().sum(dim=-1)
