"""Probability paths ``X_t = a_t X_1 + b_t Z`` and their exact fields given the NW mean (THEORY.md 1-2).

With an empirical target on a support set S, the posterior over support points at ``X_t = x``
is the NW weight vector with query ``x / a_t`` and bandwidth ``h = b_t / a_t``, and
``m = E[X_1 | X_t = x]`` is the NW mean. Every model output (velocity, epsilon, x0, v) is an
affine function of ``x`` and ``m``; ``path.field(x, t, mean)`` implements it.

Time arguments ``t`` are a Python number, a 0-dim tensor, or a tensor of per-sample times of
shape ``x.shape[:-1]`` (coefficients are applied as ``t[..., None]``). Methods return floats for
float input and tensors for tensor input. ``validate=True`` checks the range of ``t`` (a device
sync for tensors); pass ``validate=False`` in hot loops.

:class:`NWVelocityField` bundles a support set and a path into a callable ``(x, t) -> output``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nw_adapter.core.kernels import (
    ELEMENT_BUDGET,
    _check_finite,
    _pad_last,
    _rows_per_chunk,
    _sdpa_by_rows,
    compute_dtype,
    no_autocast,
    nw_mean,
)

__all__ = [
    "ConstantNoisePath",
    "NWVelocityField",
    "OTPath",
    "ProbabilityPath",
    "RectifiedFlowPath",
    "SigmaFlowPath",
    "VPPath",
]

TimeLike = float | int | Tensor


def _col(c: TimeLike) -> TimeLike:
    """Per-sample coefficients ``[...]`` -> ``[..., 1]`` to broadcast against ``x [..., d]``."""
    return c[..., None] if isinstance(c, Tensor) and c.dim() > 0 else c


class ProbabilityPath:
    """Base class: a path with ``t`` in ``[t_min, t_max]`` (ends open where the field is singular).

    Subclasses define ``alpha``, ``sigma`` and ``field``; ``bandwidth = sigma / alpha``.
    """

    t_min: float = 0.0
    t_max: float = 1.0
    min_open: bool = False
    max_open: bool = False

    def range_str(self) -> str:
        """The allowed range of ``t`` in interval notation."""
        left = "(" if self.min_open else "["
        right = ")" if self.max_open else "]"
        return f"{left}{self.t_min:g}, {self.t_max:g}{right}"

    def contains(self, t: TimeLike) -> bool:
        """Whether every entry of ``t`` lies in the allowed range (syncs for tensors)."""
        if isinstance(t, Tensor):
            tt = t.detach().to(torch.float64)
            lo_ok = tt > self.t_min if self.min_open else tt >= self.t_min
            hi_ok = tt < self.t_max if self.max_open else tt <= self.t_max
            return bool((lo_ok & hi_ok).all())
        if isinstance(t, bool) or not isinstance(t, int | float):
            raise ValueError(f"t must be a number or a tensor, got {type(t).__name__}")
        lo_ok = t > self.t_min if self.min_open else t >= self.t_min
        hi_ok = t < self.t_max if self.max_open else t <= self.t_max
        return bool(lo_ok and hi_ok)

    def check_t(self, t: TimeLike, validate: bool = True) -> TimeLike:
        """Return ``t`` unchanged, raising ValueError if it is outside the range (when validating)."""
        if validate and not self.contains(t):
            shown = t if not isinstance(t, Tensor) or t.numel() <= 8 else f"tensor of shape {tuple(t.shape)}"
            raise ValueError(f"t must lie in {self.range_str()} for {type(self).__name__}, got t = {shown}")
        return t

    def alpha(self, t: TimeLike, *, validate: bool = True) -> TimeLike:
        """``a_t``, the coefficient of the data ``X_1``."""
        raise NotImplementedError

    def sigma(self, t: TimeLike, *, validate: bool = True) -> TimeLike:
        """``b_t``, the coefficient of the Gaussian noise."""
        raise NotImplementedError

    def bandwidth(self, t: TimeLike, *, validate: bool = True) -> TimeLike:
        """NW bandwidth ``h = b_t / a_t`` (``inf`` where ``a_t = 0``)."""
        a = self.alpha(t, validate=validate)
        b = self.sigma(t, validate=False)
        if isinstance(a, Tensor) or isinstance(b, Tensor):
            return torch.as_tensor(b) / torch.as_tensor(a)
        return math.inf if a == 0 else b / a

    def field(self, x: Tensor, t: TimeLike, mean: Tensor, *, validate: bool = True) -> Tensor:
        """The exact model output at ``x`` given the NW mean ``m = E[X_1 | X_t = x]``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class OTPath(ProbabilityPath):
    """Conditional OT path with ``sigma_min`` (the paper's): ``a = t``, ``b = 1 - (1 - sigma_min) t``.

    Regression target ``x1 - (1 - sigma_min) x0``; exact velocity
    ``u(x, t) = (m - (1 - sigma_min) x) / b_t``. ``t`` in ``[0, 1]`` (``[0, 1)`` if sigma_min = 0).

    Args:
        sigma_min: noise left at ``t = 1``, in ``[0, 1)``.
    """

    def __init__(self, sigma_min: float = 0.0) -> None:
        if isinstance(sigma_min, bool) or not isinstance(sigma_min, int | float) or not 0 <= sigma_min < 1:
            raise ValueError(f"sigma_min must be a float in [0, 1), got {sigma_min!r}")
        self.sigma_min = float(sigma_min)
        self.max_open = self.sigma_min == 0.0

    def alpha(self, t: TimeLike, *, validate: bool = True) -> TimeLike:
        """``a_t = t``."""
        return self.check_t(t, validate) * 1.0

    def sigma(self, t: TimeLike, *, validate: bool = True) -> TimeLike:
        """``b_t = 1 - (1 - sigma_min) t``."""
        return 1.0 - (1.0 - self.sigma_min) * self.check_t(t, validate)

    def field(self, x: Tensor, t: TimeLike, mean: Tensor, *, validate: bool = True) -> Tensor:
        """Velocity ``u = (m - (1 - sigma_min) x) / b_t``; ``x``, ``mean`` are ``[..., d]``."""
        b = _col(self.sigma(t, validate=validate))
        return (mean - (1.0 - self.sigma_min) * x) / b

    def __repr__(self) -> str:
        return f"OTPath(sigma_min={self.sigma_min:g})"


class RectifiedFlowPath(OTPath):
    """Rectified flow ``x_t = t x1 + (1 - t) x0``: ``a = t``, ``b = 1 - t``, ``u = (m - x) / (1 - t)``.

    ``t`` in ``[0, 1)``.
    """

    def __init__(self) -> None:
        super().__init__(0.0)

    def __repr__(self) -> str:
        return "RectifiedFlowPath()"


class ConstantNoisePath(ProbabilityPath):
    """torchcfm-style path ``x_t = t x1 + (1 - t) x0 + c eps`` with regression target ``x1 - x0``.

    ``a = t``, ``b = s_t = sqrt((1 - t)^2 + c^2)``. Since ``E[x0 | x, x1] = (1 - t)(x - t x1)/s^2``,
    the exact field is ``u = m - (1 - t)(x - t m) / s_t^2`` (the OT formula is wrong here).
    ``t`` in ``[0, 1]`` (``[0, 1)`` if c = 0).

    Args:
        c: constant noise level, >= 0.
    """

    def __init__(self, c: float) -> None:
        if isinstance(c, bool) or not isinstance(c, int | float) or not (math.isfinite(c) and c >= 0):
            raise ValueError(f"c must be a finite float >= 0, got {c!r}")
        self.c = float(c)
        self.max_open = self.c == 0.0

    def alpha(self, t: TimeLike, *, validate: bool = True) -> TimeLike:
        """``a_t = t``."""
        return self.check_t(t, validate) * 1.0

    def sigma(self, t: TimeLike, *, validate: bool = True) -> TimeLike:
        """``s_t = sqrt((1 - t)^2 + c^2)``."""
        t = self.check_t(t, validate)
        return ((1.0 - t) ** 2 + self.c**2) ** 0.5

    def field(self, x: Tensor, t: TimeLike, mean: Tensor, *, validate: bool = True) -> Tensor:
        """Velocity ``u = m - (1 - t)(x - t m) / s_t^2``."""
        t = self.check_t(t, validate)
        s2 = _col((1.0 - t) ** 2 + self.c**2)
        tc = _col(t)
        return mean - (1.0 - tc) * (x - tc * mean) / s2

    def __repr__(self) -> str:
        return f"ConstantNoisePath(c={self.c:g})"


class VPPath(ProbabilityPath):
    """VP / DDPM path of diffusers' SD 1.x / SDXL schedulers: ``a = sqrt(abar_t)``, ``b = sqrt(1 - abar_t)``.

    ``t`` is an integer timestep index into ``alphas_cumprod`` (``0 .. T-1``; integer-valued
    floats are accepted, no interpolation). Outputs given ``m = x0_hat``:
    ``"epsilon"``: ``(x - a m) / b``; ``"sample"``: ``m``; ``"v_prediction"``: ``a eps_hat - b m``.

    Args:
        alphas_cumprod: ``[T]`` cumulative products ``abar_t`` in ``(0, 1]`` (e.g.
            ``scheduler.alphas_cumprod``).
        prediction_type: ``"epsilon"``, ``"sample"`` or ``"v_prediction"``.
    """

    PREDICTION_TYPES = ("epsilon", "sample", "v_prediction")

    def __init__(self, alphas_cumprod: Tensor, prediction_type: str = "epsilon") -> None:
        ac = torch.as_tensor(alphas_cumprod, dtype=torch.float64).detach().cpu()
        if ac.dim() != 1 or ac.numel() == 0:
            raise ValueError(f"alphas_cumprod must be a non-empty 1-D tensor [T], got {tuple(ac.shape)}")
        if not bool(((ac > 0) & (ac <= 1)).all()):
            raise ValueError("alphas_cumprod must lie in (0, 1] (and be finite)")
        if prediction_type not in self.PREDICTION_TYPES:
            raise ValueError(f"prediction_type must be in {self.PREDICTION_TYPES}, got {prediction_type!r}")
        self.alphas_cumprod = ac
        self.prediction_type = prediction_type
        self.t_max = float(ac.numel() - 1)
        self._cache: dict[torch.device, Tensor] = {}

    def _abar(self, t: TimeLike, validate: bool) -> TimeLike:
        self.check_t(t, validate)
        if isinstance(t, Tensor):
            if validate and t.is_floating_point() and not bool((t == t.round()).all()):
                raise ValueError("t must hold integer timestep indices for VPPath (no interpolation)")
            table = self._cache.get(t.device)
            if table is None:
                table = self._cache.setdefault(t.device, self.alphas_cumprod.to(t.device))
            return table[t.long()]
        if t != int(t):
            raise ValueError(f"t must be an integer timestep index for VPPath, got t = {t}")
        return float(self.alphas_cumprod[int(t)])

    def alpha(self, t: TimeLike, *, validate: bool = True) -> TimeLike:
        """``a_t = sqrt(abar_t)``."""
        return self._abar(t, validate) ** 0.5

    def sigma(self, t: TimeLike, *, validate: bool = True) -> TimeLike:
        """``b_t = sqrt(1 - abar_t)``."""
        return (1.0 - self._abar(t, validate)) ** 0.5

    def field(self, x: Tensor, t: TimeLike, mean: Tensor, *, validate: bool = True) -> Tensor:
        """Model output for ``prediction_type`` given ``m = E[X_0 | X_t = x]``."""
        if self.prediction_type == "sample":
            self.check_t(t, validate)
            return mean
        abar = self._abar(t, validate)
        a, b = _col(abar**0.5), _col((1.0 - abar) ** 0.5)
        if isinstance(a, Tensor):
            a, b = a.to(mean.dtype), b.to(mean.dtype)
        eps = (x - a * mean) / b
        if self.prediction_type == "epsilon":
            return eps
        return a * eps - b * mean

    def __repr__(self) -> str:
        return f"VPPath(T={self.alphas_cumprod.numel()}, prediction_type={self.prediction_type!r})"


class SigmaFlowPath(ProbabilityPath):
    """Rectified flow in the sigma convention of SD3 / Flux: ``x_s = (1 - s) x0 + s eps``, s in (0, 1].

    ``a = 1 - s``, ``b = s``, ``h = s / (1 - s)``; model target ``eps - x0`` (so sampling runs
    ``s`` from 1 down to 0); exact output ``v = (x - m) / s``.
    """

    min_open = True

    def alpha(self, t: TimeLike, *, validate: bool = True) -> TimeLike:
        """``a_s = 1 - s``."""
        return 1.0 - self.check_t(t, validate)

    def sigma(self, t: TimeLike, *, validate: bool = True) -> TimeLike:
        """``b_s = s``."""
        return self.check_t(t, validate) * 1.0

    def field(self, x: Tensor, t: TimeLike, mean: Tensor, *, validate: bool = True) -> Tensor:
        """Velocity ``v = dx/ds = (x - m) / s``."""
        return (x - mean) / _col(self.sigma(t, validate=validate))


def _per_sample_nw_mean(
    x: Tensor,
    a: Tensor,
    b: Tensor,
    support: Tensor,
    support_mask: Tensor | None,
    *,
    chunk_size: int | None = None,
    validate: bool = True,
) -> Tensor:
    """NW mean with one ``(a_n, b_n)`` per query and one shared key set, by chunked SDPA.

    With ``c`` the (masked) support mean, ``s~_i = s_i - c`` and ``x~_n = x_n - a_n c`` (so that
    ``x_n - a_n s_i = x~_n - a_n s~_i``; ``x_t ~ a s + b z`` keeps ``x~`` of the size of the noise):

        -||x_n - a_n s_i||^2 / (2 b_n^2)
            = (a_n / b_n^2) x~_n.s~_i - (a_n^2 / (2 b_n^2)) ||s~_i||^2 + (const in i),

    i.e. ``softmax(q_n.k_i)`` with ``q_n = [a_n x~_n / b_n^2, -a_n^2 / (2 b_n^2)]`` and
    ``k_i = [s~_i, ||s~_i||^2]`` (zero-padded to a multiple of 8 features), and the values
    ``s~`` (``c`` is added back). No division by ``a`` (``a = 0`` gives uniform weights); the
    absolute logit error is ``~eps (||x~_n||^2 + a_n^2 ||s~_i||^2) / (2 b_n^2)`` as for the
    scalar-``t`` SDPA forms. Peak extra memory ``O(chunk_size * m)`` plus ``O(n d)`` for ``q``.

    Args:
        x: ``[..., n, d]`` query points, float32 or float64.
        a: ``[..., n]`` data coefficients ``a_t`` per query (same dtype as ``x``).
        b: ``[..., n]`` noise coefficients ``b_t > 0`` per query.
        support: ``[..., m, d]`` support points (same dtype as ``x``).
        support_mask: optional bool ``[..., m]``, True = valid.
        chunk_size: query rows per SDPA call (``None``: ``ELEMENT_BUDGET / (prod(L) * m)``).
        validate: check the support for NaN/inf and empty mask rows (syncs with the device).

    Returns:
        ``[L..., n, d]`` NW means, ``L`` the broadcast leading dims; NaN rows where the mask has
        no valid point (only reachable with ``validate=False``).
    """
    bad_chunk = isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    if chunk_size is not None and bad_chunk:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    mask = None if support_mask is None else support_mask.to(x.device)
    if validate:
        _check_finite("support", support, mask)
        if mask is not None and not bool(mask.any(-1).all()):
            raise ValueError("support_mask has a row with no valid support point (all False)")
    n, d = x.shape[-2], x.shape[-1]
    m = support.shape[-2]
    shapes = [x.shape[:-2], support.shape[:-2]] + ([] if mask is None else [mask.shape[:-1]])
    lead = torch.broadcast_shapes(*shapes)
    with no_autocast(x.device):
        s = support
        if mask is None:
            c = s.mean(dim=-2, keepdim=True)
        else:
            s = torch.where(mask[..., None], s, torch.zeros((), dtype=s.dtype, device=s.device))
            count = mask[..., None].sum(dim=-2, keepdim=True).clamp_min(1).to(s.dtype)
            c = s.sum(dim=-2, keepdim=True) / count
        sc = s - c  # [..., m, d]
        coef = a / (b * b)  # [..., n]
        width = d + 2 + (-(d + 2)) % 8
        q = x.new_zeros((*lead, n, width))
        q[..., :d] = (x - a[..., None] * c) * coef[..., None]
        q[..., d] = -0.5 * a * coef
        k = _pad_last(torch.cat([sc, sc.square().sum(-1, keepdim=True)], dim=-1), width)
        v = _pad_last(sc, width)
        k = k.expand(*lead, m, width).reshape(-1, lead[-1] if len(lead) else 1, m, width)
        v = v.expand(*lead, m, width).reshape(k.shape)
        q = q.reshape(k.shape[0], k.shape[1], n, width)
        attn_mask = None
        if mask is not None:
            attn_mask = mask[..., None, :].expand(*lead, 1, m).reshape(k.shape[0], k.shape[1], 1, m)
        rows = chunk_size or _rows_per_chunk(lead, m, ELEMENT_BUDGET)
        out = _sdpa_by_rows(q, k, v, attn_mask, rows)[..., :d].reshape(*lead, n, d)
        out = out + c
        if mask is not None:
            any_valid = mask.any(dim=-1).expand(lead)
            out = torch.where(any_valid[..., None, None], out, torch.full((), math.nan, dtype=out.dtype))
    return out


def check_points(x: Tensor, support: Tensor, validate: bool) -> None:
    """Check the points ``x`` ``[..., n, d]`` a field of ``support`` ``[..., m, d]`` is evaluated at
    (a tensor, the support's d; finite when ``validate``), with one-line ValueErrors."""
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise ValueError("x must be a tensor [..., n, d]")
    if x.shape[-1] != support.shape[-1]:
        raise ValueError(f"x must have d = {support.shape[-1]} features, got shape {tuple(x.shape)}")
    if validate and not bool(torch.isfinite(x).all()):
        raise ValueError("x contains NaN or inf values")


class NWVelocityField:
    """The exact field of ``path`` for the empirical target on a support set (plug-in NW field).

    ``__call__(x, t) = path.field(x, t, m)`` with ``m`` the NW mean of ``support`` at ``x``,
    computed as ``softmax_i(-||x - a_t s_i||^2 / (2 b_t^2))`` (no division by ``a_t``, stable as
    ``a_t -> 0``). For flow paths this is the velocity; for :class:`VPPath` the eps/x0/v output.

    Args:
        support: ``[..., m, d]`` support points.
        path: a :class:`ProbabilityPath`.
        support_mask: optional bool ``[..., m]`` (True = valid) for ragged support sets.
        form: NW mean backend. ``"bias"`` (default) / ``"augmented"``: chunked SDPA, peak extra
            memory ``O(chunk_size * m)`` (never ``n * m``). A scalar ``t`` runs
            :func:`nw_adapter.core.kernels.nw_mean` with that form on the scaled support ``a_t s``;
            per-sample times run the shared-key augmented form of :func:`_per_sample_nw_mean`
            for both. ``"direct"``: explicit ``[..., n, m]`` weights from direct differences
            (``torch.cdist``), the slow reference, materialising ``n * m`` (per-sample times
            even ``n * m * d``).
        chunk_size: query rows per SDPA call (``None``: ``2**24 / (prod(L) * m)``).
        validate: default for value checks in ``__call__`` (range of t, NaN inputs).

    Example:
        >>> field = NWVelocityField(torch.randn(50, 2), OTPath(sigma_min=0.01))
        >>> v = field(torch.randn(500, 2), 0.5)  # [500, 2]
    """

    def __init__(
        self,
        support: Tensor,
        path: ProbabilityPath,
        *,
        support_mask: Tensor | None = None,
        form: str = "bias",
        chunk_size: int | None = None,
        validate: bool = True,
    ) -> None:
        if not isinstance(support, Tensor) or support.dim() < 2 or not support.is_floating_point():
            raise ValueError("support must be a floating-point tensor [..., m, d]")
        if support.shape[-2] == 0:
            raise ValueError("support is empty (m = 0); at least one support point is required")
        if not isinstance(path, ProbabilityPath):
            raise ValueError(f"path must be a ProbabilityPath, got {type(path).__name__}")
        if form not in ("direct", "bias", "augmented"):
            raise ValueError(f"form must be 'direct', 'bias' or 'augmented', got {form!r}")
        if support_mask is not None and (
            not isinstance(support_mask, Tensor)
            or support_mask.dtype != torch.bool
            or support_mask.shape[-1] != support.shape[-2]
        ):
            raise ValueError("support_mask must be a bool tensor [..., m] matching support [..., m, d]")
        self.support = support
        self.path = path
        self.support_mask = support_mask
        self.form = form
        self.chunk_size = chunk_size
        self.validate = validate

    def defined_at(self, t: TimeLike) -> bool:
        """Whether the field is defined at time ``t`` (used by samplers at grid ends)."""
        return self.path.contains(t)

    def mean(self, x: Tensor, t: TimeLike, *, validate: bool | None = None) -> Tensor:
        """NW mean ``m = E[X_1 | X_t = x]``: ``[..., n, d]`` (same leading dims as the output)."""
        validate = self.validate if validate is None else validate
        check_points(x, self.support, validate)
        dtype = compute_dtype(x, self.support)
        a = self.path.alpha(t, validate=validate)
        b = self.path.sigma(t, validate=False)
        s = self.support.to(device=x.device, dtype=dtype)
        per_sample = isinstance(t, Tensor) and t.dim() > 0
        if isinstance(a, Tensor):
            a = a.to(device=x.device, dtype=dtype)
            b = torch.as_tensor(b).to(device=x.device, dtype=dtype)
        if per_sample and self.form != "direct":
            if t.shape != x.shape[:-1]:
                try:
                    a, b = a.expand(x.shape[:-1]), b.expand(x.shape[:-1])
                except RuntimeError as err:
                    raise ValueError(
                        f"per-sample t must have shape x.shape[:-1] = {tuple(x.shape[:-1])}, "
                        f"got {tuple(t.shape)}"
                    ) from err
            return _per_sample_nw_mean(
                x.to(dtype), a, b, s, self.support_mask, chunk_size=self.chunk_size, validate=validate
            )
        if not per_sample:
            return nw_mean(
                x,
                a * s,
                b,
                values=s,
                support_mask=self.support_mask,
                form=self.form,
                chunk_size=self.chunk_size,
                validate=validate,
            )
        if t.shape != x.shape[:-1]:
            try:
                a = a.expand(x.shape[:-1])
                b = b.expand(x.shape[:-1])
            except RuntimeError as err:
                raise ValueError(
                    f"per-sample t must have shape x.shape[:-1] = {tuple(x.shape[:-1])}, got {tuple(t.shape)}"
                ) from err
        sup = a[..., None, None] * s[..., None, :, :]  # [..., n, m, d]
        mask = None if self.support_mask is None else self.support_mask[..., None, :]
        out = nw_mean(
            x[..., None, :],
            sup,
            b,
            values=s[..., None, :, :],
            support_mask=mask,
            form=self.form,
            chunk_size=self.chunk_size,
            validate=validate,
        )
        return out[..., 0, :]

    def __call__(self, x: Tensor, t: TimeLike, *, validate: bool | None = None) -> Tensor:
        """Exact field at ``x`` ``[..., n, d]`` and time ``t`` (scalar or per-sample ``[..., n]``)."""
        validate = self.validate if validate is None else validate
        m = self.mean(x, t, validate=validate)
        return self.path.field(x.to(m.dtype), t, m, validate=False)

    def __repr__(self) -> str:
        return f"NWVelocityField(support={tuple(self.support.shape)}, path={self.path!r}, form={self.form!r})"
