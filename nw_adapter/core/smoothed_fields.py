"""Training-free fields that are exact for a SMOOTHED target: one per lesson of the paper (THEORY.md 5).

The plug-in NW field is the exact field of the empirical target ``(1/m) sum_i delta(s_i)``. Each
field here is the exact field of a Gaussian mixture built from the same support,

    q(x) = (1/m) sum_i N(x; mu_i, C_i),

so it stays a kernel smoother with a closed form. On a path ``X_t = a X_1 + b Z`` the component
``i`` gives ``X_t ~ N(a mu_i, a^2 C_i + b^2 I)``, hence

    w_i(x)  = softmax_i( log N(x; a mu_i, a^2 C_i + b^2 I) ),
    m_i(x)  = E[X_1 | X_t = x, i] = mu_i + a C_i (a^2 C_i + b^2 I)^{-1} (x - a mu_i),
    m(x)    = sum_i w_i(x) m_i(x) = E[X_1 | X_t = x],

and every path output is ``path.field(x, t, m)`` (THEORY.md 2: each output is affine in x and m).

- :class:`SmoothedSupportField` (against support scarcity): ``C_i = tau^2 I``. The weights are NW
  weights at bandwidth ``sqrt(b^2 + a^2 tau^2) / a`` and ``m_i = s_i + a tau^2 (x - a s_i) / v``
  with ``v = b^2 + a^2 tau^2``; tau by leave-one-out likelihood (:func:`loo_tau`), or fitted once
  on training tasks (:func:`fit_shared_tau`, the amortised variant).
- :class:`LocalCovarianceField` (against geometry mismatch; manifold Parzen windows):
  ``C_i = Sigma_i + tau^2 I`` with ``Sigma_i`` the leading principal directions of the ``k``
  nearest support points around ``s_i`` (:func:`local_covariances`); exact by Woodbury.
- :class:`ProjectedField` (against nearest-neighbour collapse): the NW field inside the support's
  leading principal subspace, the complement a fitted Gaussian (:func:`principal_subspace`).

Numerics as the plug-in field's: logits from (centred) distances ``x - a s_i``, never a division
by ``a`` (``a = 0`` gives uniform weights), float32 or float64 never under autocast, the NW parts
through the chunked SDPA of :mod:`nw_adapter.core.paths`, the local-covariance logits chunked over
query rows so that peak extra memory is ``O(rows x m x r)`` (never ``n x m x d``).

Supports are ``[..., m, d]`` without padding (equal ``m`` in a batch); per-task parameters
(tau, subspaces, local covariances) have the leading shape of the support.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nw_adapter.core.kernels import ELEMENT_BUDGET, _check_finite, _rows_per_chunk, compute_dtype, no_autocast
from nw_adapter.core.paths import ProbabilityPath, TimeLike, _per_sample_nw_mean, check_points

__all__ = [
    "EXPLAINED_VARIANCE",
    "LOCAL_NEIGHBOURS",
    "LocalCovarianceField",
    "ProjectedField",
    "SmoothedSupportField",
    "fit_shared_tau",
    "local_covariances",
    "loo_tau",
    "loo_tau_local",
    "principal_subspace",
    "tau_grid",
]

#: Share of variance the projected field's subspace and the local covariances' rank must explain.
EXPLAINED_VARIANCE = 0.9
#: Neighbours of each support point that define its local covariance (capped at m - 1).
LOCAL_NEIGHBOURS = 10
#: tau grid: the median nearest-neighbour distance times 2^(j/4), j = GRID_LOW .. GRID_HIGH.
GRID_LOW, GRID_HIGH = -24, 8


def _check_support(support: object) -> Tensor:
    if not isinstance(support, Tensor) or support.dim() < 2 or not support.is_floating_point():
        raise ValueError("support must be a floating-point tensor [..., m, d]")
    if support.shape[-2] == 0:
        raise ValueError("support is empty (m = 0); at least one support point is required")
    _check_finite("support", support)
    return support.to(compute_dtype(support))


def _pairwise_sq(support: Tensor) -> Tensor:
    """``[..., m, m]`` squared distances from direct differences (``torch.cdist``)."""
    return torch.cdist(support, support).square()


def _median_nn(support: Tensor) -> Tensor:
    """Median nearest-neighbour distance of each support set, ``[...]`` (0 for m = 1)."""
    m = support.shape[-2]
    if m == 1:
        return support.new_zeros(support.shape[:-2])
    d2 = _pairwise_sq(support)
    d2 = d2 + torch.diag(torch.full((m,), math.inf, dtype=d2.dtype, device=d2.device))
    return d2.min(-1).values.sqrt().median(-1).values


def tau_grid(scale: Tensor) -> Tensor:
    """Candidate tau values ``scale[..., None] * 2^(j/4)``, j = -24 .. 8: ``[..., G]``."""
    powers = torch.arange(GRID_LOW, GRID_HIGH + 1, dtype=scale.dtype, device=scale.device) / 4.0
    return scale[..., None] * torch.pow(2.0, powers)


def loo_tau(support: Tensor) -> Tensor:
    """Isotropic smoothing scale by leave-one-out likelihood on the support.

    Rule: ``tau = argmax_tau sum_i log( (1/(m-1)) sum_{j != i} N(s_i; s_j, tau^2 I) )`` over
    :func:`tau_grid` of the median nearest-neighbour distance (33 values, factors 2^-6 .. 2^2).
    With ``m = 1`` nothing is left out: ``tau = 0`` (the field is then the plug-in's).

    Args:
        support: ``[..., m, d]``.

    Returns:
        ``[...]`` tau per support set (same dtype, >= 0).
    """
    s = _check_support(support)
    m, d = s.shape[-2], s.shape[-1]
    if m == 1:
        return s.new_zeros(s.shape[:-2])
    grid = tau_grid(_median_nn(s).clamp_min(torch.finfo(s.dtype).tiny))  # [..., G]
    d2 = _pairwise_sq(s)  # [..., m, m]
    off = ~torch.eye(m, dtype=torch.bool, device=s.device)
    tau2 = grid.square()[..., None, None]  # [..., G, 1, 1]
    logk = torch.where(off, -d2[..., None, :, :] / (2 * tau2), -math.inf)
    ll = torch.logsumexp(logk, -1).sum(-1) - m * 0.5 * d * torch.log(2 * math.pi * grid.square())
    return torch.gather(grid, -1, ll.argmax(-1, keepdim=True))[..., 0]


def fit_shared_tau(support: Tensor, heldout: Tensor) -> float:
    """One tau for a whole task family: held-out likelihood over training tasks (amortised smoothing).

    Rule: ``tau = argmax_tau mean_tasks mean_y log( (1/m) sum_i N(y; s_i, tau^2 I) )`` over held-out
    points ``y`` of each training task, on :func:`tau_grid` of the median over tasks of the
    median nearest-neighbour distance of the held-out points (so it exists for m = 1).

    Args:
        support: ``[T, m, d]`` supports of T training tasks.
        heldout: ``[T, n, d]`` held-out points of the same tasks.

    Returns:
        tau (a float), applied unchanged to new tasks.
    """
    s = _check_support(support)
    y = _check_support(heldout).to(s.dtype)
    if s.dim() != 3 or y.dim() != 3 or s.shape[0] != y.shape[0] or s.shape[-1] != y.shape[-1]:
        raise ValueError(
            f"support [T, m, d] and heldout [T, n, d] must match, got {tuple(s.shape)}, {tuple(y.shape)}"
        )
    grid = tau_grid(_median_nn(y).median())  # [G]
    d2 = torch.cdist(y, s).square()  # [T, n, m]
    tau2 = grid.square()[:, None, None, None]
    ll = torch.logsumexp(-d2 / (2 * tau2), -1) - 0.5 * s.shape[-1] * torch.log(2 * math.pi * tau2[..., 0])
    return float(grid[ll.mean((1, 2)).argmax()])


def local_covariances(
    support: Tensor, neighbours: int | None = None, explained: float = EXPLAINED_VARIANCE
) -> tuple[Tensor, Tensor]:
    """Manifold-Parzen local covariances: leading principal directions of each point's neighbours.

    ``Sigma_i = (1/k) sum_{j in kNN(i)} (s_j - s_i)(s_j - s_i)^T``, truncated to its ``r`` leading
    eigenpairs. Rules: ``k = min(m - 1, neighbours)`` (default :data:`LOCAL_NEIGHBOURS`);
    ``r`` = the smallest number of directions whose eigenvalues, averaged over the support's
    points, explain ``explained`` of the averaged trace (per support set; eigenvalues past ``r``
    are set to 0, so tensors keep ``R = min(k, d)`` columns).

    Args:
        support: ``[..., m, d]``.
        neighbours: k (default 10).
        explained: share of local variance kept, in (0, 1].

    Returns:
        ``(directions [..., m, d, R], eigenvalues [..., m, R])``, orthonormal columns, eigenvalues
        descending (R = 0 when m = 1).
    """
    s = _check_support(support)
    if not 0.0 < explained <= 1.0:
        raise ValueError(f"explained must lie in (0, 1], got {explained!r}")
    m, d = s.shape[-2], s.shape[-1]
    k = min(m - 1, LOCAL_NEIGHBOURS if neighbours is None else int(neighbours))
    if neighbours is not None and neighbours < 1:
        raise ValueError(f"neighbours must be >= 1, got {neighbours!r}")
    r_max = min(k, d)
    if r_max == 0:
        return s.new_zeros((*s.shape[:-1], d, 0)), s.new_zeros((*s.shape[:-1], 0))
    d2 = _pairwise_sq(s) + torch.diag(torch.full((m,), math.inf, dtype=s.dtype, device=s.device))
    idx = d2.topk(k, dim=-1, largest=False).indices  # [..., m, k]
    nbr = torch.gather(
        s[..., None, :, :].expand(*s.shape[:-2], m, m, d), -2, idx[..., None].expand(*idx.shape, d)
    )  # [..., m, k, d]
    diff = nbr - s[..., :, None, :]
    cov = diff.transpose(-1, -2) @ diff / k  # [..., m, d, d]
    evals, evecs = torch.linalg.eigh(cov)  # ascending
    evals = evals.flip(-1)[..., :r_max].clamp_min(0)
    evecs = evecs.flip(-1)[..., :r_max]
    spectrum = evals.mean(-2)  # [..., R] averaged over the points
    total = cov.diagonal(dim1=-2, dim2=-1).sum(-1).mean(-1)  # [...]
    cum = spectrum.cumsum(-1)
    rank = ((cum < explained * total[..., None]).sum(-1) + 1).clamp(max=r_max)  # [...]
    keep = torch.arange(r_max, device=s.device) < rank[..., None]  # [..., R]
    return evecs, evals * keep[..., None, :]


def _local_loo_loglik(s: Tensor, dirs: Tensor, lam: Tensor, tau2: Tensor) -> Tensor:
    """Leave-one-out log-likelihood ``sum_i log((1/(m-1)) sum_{j != i} N(s_i; s_j, Sigma_j + tau^2 I))``.

    ``s [..., m, d]``, ``dirs [..., m, d, R]``, ``lam [..., m, R]``, ``tau2 [..., G]`` (a grid of
    tau^2); returns ``[..., G]``. Woodbury with orthonormal ``U_j``; distances from ``torch.cdist``
    and projections ``U_j^T (s_i - s_j) = U_j^T s_i - U_j^T s_j`` (no ``[m, m, d]`` tensor; one
    ``[..., m, m, R]`` per grid value).
    """
    m, d = s.shape[-2], s.shape[-1]
    d2 = _pairwise_sq(s)  # [..., i, j]
    proj = torch.einsum("...id,...jdr->...ijr", s, dirs)  # U_j^T s_i
    p = proj - torch.diagonal(proj, dim1=-3, dim2=-2).transpose(-1, -2)[..., None, :, :]  # [..., i, j, R]
    p2 = p.square()
    off = ~torch.eye(m, dtype=torch.bool, device=s.device)
    out = []
    for g in range(tau2.shape[-1]):
        t2 = tau2[..., g, None, None]  # [..., 1, 1]
        lam_ = lam[..., None, :, :]  # [..., 1, j, R]
        quad = d2 / t2 - (lam_ / (t2[..., None] * (lam_ + t2[..., None])) * p2).sum(-1)
        logdet = d * torch.log(t2) + torch.log1p(lam_ / t2[..., None]).sum(-1)
        logp = -0.5 * (quad + logdet + d * math.log(2 * math.pi))
        out.append(torch.logsumexp(torch.where(off, logp, -math.inf), -1).sum(-1))
    return torch.stack(out, -1) - m * math.log(m - 1)


def loo_tau_local(support: Tensor, dirs: Tensor, lam: Tensor) -> Tensor:
    """tau of :class:`LocalCovarianceField` by leave-one-out likelihood on the support.

    Rule: ``argmax_tau sum_i log( (1/(m-1)) sum_{j != i} N(s_i; s_j, Sigma_j + tau^2 I) )`` over
    :func:`tau_grid` of the median nearest-neighbour distance; ``tau = 0`` for m = 1.

    Returns:
        ``[...]`` tau per support set.
    """
    s = _check_support(support)
    m = s.shape[-2]
    if m == 1:
        return s.new_zeros(s.shape[:-2])
    grid = tau_grid(_median_nn(s).clamp_min(torch.finfo(s.dtype).tiny))  # [..., G]
    ll = _local_loo_loglik(s, dirs.to(s.dtype), lam.to(s.dtype), grid.square())  # [..., G]
    return torch.gather(grid, -1, ll.argmax(-1, keepdim=True))[..., 0]


def principal_subspace(
    support: Tensor, explained: float = EXPLAINED_VARIANCE
) -> tuple[Tensor, Tensor, Tensor]:
    """The support's principal axes, variances and leading-subspace selector.

    Rule: the covariance ``(1/m) sum_i (s_i - c)(s_i - c)^T`` (maximum likelihood, ``c`` the mean)
    is diagonalised; the subspace is the smallest number ``k >= 1`` of leading axes explaining
    ``explained`` of its trace.

    Args:
        support: ``[..., m, d]``.
        explained: share of variance in the subspace, in (0, 1].

    Returns:
        ``(axes [..., d, d]`` (columns, variances descending), ``variances [..., d]``,
        ``in_subspace`` bool ``[..., d]``).
    """
    s = _check_support(support)
    if not 0.0 < explained <= 1.0:
        raise ValueError(f"explained must lie in (0, 1], got {explained!r}")
    centred = s - s.mean(-2, keepdim=True)
    cov = centred.transpose(-1, -2) @ centred / s.shape[-2]
    evals, evecs = torch.linalg.eigh(cov)
    evals, evecs = evals.flip(-1).clamp_min(0), evecs.flip(-1)
    cum = evals.cumsum(-1)
    k = ((cum < explained * cum[..., -1:]).sum(-1) + 1).clamp(max=s.shape[-1])
    return evecs, evals, torch.arange(s.shape[-1], device=s.device) < k[..., None]


class _MixtureField:
    """Base: support checks, per-query coefficients ``a, b`` and ``path.field(x, t, m)``."""

    def __init__(
        self, support: Tensor, path: ProbabilityPath, *, chunk_size: int | None, validate: bool
    ) -> None:
        self.support = _check_support(support)
        if not isinstance(path, ProbabilityPath):
            raise ValueError(f"path must be a ProbabilityPath, got {type(path).__name__}")
        bad = isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        if chunk_size is not None and bad:
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
        self.path = path
        self.chunk_size = chunk_size
        self.validate = validate

    def defined_at(self, t: TimeLike) -> bool:
        """Whether the field is defined at time ``t``."""
        return self.path.contains(t)

    def _coefficients(self, x: Tensor, t: TimeLike, validate: bool) -> tuple[Tensor, Tensor, Tensor]:
        check_points(x, self.support, validate)
        dtype = compute_dtype(x, self.support)
        # as_tensor with the dtype: a Python float must not pass through float32 on its way to float64
        a = torch.as_tensor(self.path.alpha(t, validate=validate), dtype=dtype, device=x.device)
        b = torch.as_tensor(self.path.sigma(t, validate=False), dtype=dtype, device=x.device)
        try:
            a, b = a.expand(x.shape[:-1]), b.expand(x.shape[:-1])
        except RuntimeError as err:
            raise ValueError(
                f"per-sample t must have shape x.shape[:-1] = {tuple(x.shape[:-1])}, got {tuple(t.shape)}"
            ) from err
        return x.to(dtype), a, b

    def mean(self, x: Tensor, t: TimeLike, *, validate: bool | None = None) -> Tensor:
        """``E[X_1 | X_t = x]`` under the smoothed target: ``[..., n, d]``."""
        validate = self.validate if validate is None else validate
        x, a, b = self._coefficients(x, t, validate)
        with no_autocast(x.device):
            return self._mean(x, a, b)

    def _mean(self, x: Tensor, a: Tensor, b: Tensor) -> Tensor:
        raise NotImplementedError

    def __call__(self, x: Tensor, t: TimeLike, *, validate: bool | None = None) -> Tensor:
        """Exact field of the smoothed target at ``x [..., n, d]`` and ``t`` (scalar or ``[..., n]``)."""
        validate = self.validate if validate is None else validate
        m = self.mean(x, t, validate=validate)
        return self.path.field(x.to(m.dtype), t, m, validate=False)


def _tau_tensor(tau: float | Tensor | None, support: Tensor, name: str = "tau") -> Tensor | None:
    if tau is None:
        return None
    tau_t = torch.as_tensor(tau, dtype=support.dtype, device=support.device)
    if not bool(torch.isfinite(tau_t).all()) or bool((tau_t < 0).any()):
        raise ValueError(f"{name} must be finite and >= 0, got {tau!r}")
    try:
        return tau_t.expand(support.shape[:-2])
    except RuntimeError as err:
        raise ValueError(
            f"{name} must broadcast to the support's leading shape {tuple(support.shape[:-2])}"
        ) from err


class SmoothedSupportField(_MixtureField):
    """Exact field of the smoothed support ``(1/m) sum_i N(s_i, tau^2 I)``.

    With ``v = b^2 + a^2 tau^2`` the posterior weights are NW weights
    ``softmax_i(-||x - a s_i||^2 / 2v)`` and ``m = m' + a tau^2 (x - a m') / v``, ``m' = sum_i w_i s_i``
    (the conditional means ``s_i + a tau^2 (x - a s_i) / v`` averaged). ``tau = 0`` is the plug-in.

    Args:
        support: ``[..., m, d]``.
        path: a :class:`~nw_adapter.core.paths.ProbabilityPath`.
        tau: float or ``[...]`` tensor; ``None``: :func:`loo_tau` per support set.
        chunk_size: query rows per SDPA call (None: from the element budget).
        validate: default for value checks in calls.

    Example:
        >>> field = SmoothedSupportField(torch.randn(5, 2), OTPath(0.01))
        >>> v = field(torch.randn(100, 2), 0.5)  # [100, 2]
    """

    def __init__(
        self,
        support: Tensor,
        path: ProbabilityPath,
        *,
        tau: float | Tensor | None = None,
        chunk_size: int | None = None,
        validate: bool = True,
    ) -> None:
        super().__init__(support, path, chunk_size=chunk_size, validate=validate)
        given = _tau_tensor(tau, self.support)
        self.tau = loo_tau(self.support) if given is None else given

    def _mean(self, x: Tensor, a: Tensor, b: Tensor) -> Tensor:
        tau2 = self.tau.to(x.dtype)[..., None].square()  # [..., 1] against [..., n]
        v = b.square() + a.square() * tau2
        m_w = _per_sample_nw_mean(
            x, a, v.sqrt(), self.support.to(x.dtype), None, chunk_size=self.chunk_size, validate=False
        )
        return m_w + (a * tau2 / v)[..., None] * (x - a[..., None] * m_w)

    def __repr__(self) -> str:
        return f"SmoothedSupportField(support={tuple(self.support.shape)}, path={self.path!r})"


class ProjectedField(_MixtureField):
    """Exact field of ``NW in the leading principal subspace x a Gaussian on its complement``.

    Target: ``mu_i = c + P P^T (s_i - c)`` and one shared ``C = Q diag(lam_perp) Q^T`` (``P`` the
    leading axes of :func:`principal_subspace`, ``Q`` the others, ``lam_perp`` their variances).
    The complement part of ``x - a mu_i`` does not depend on i, so the weights are NW weights of
    the projected support, ``softmax_i(-||P^T(x - a c) - a P^T(s_i - c)||^2 / 2b^2)``, and

        m = c + P sum_i w_i P^T(s_i - c) + Q diag(a lam / (a^2 lam + b^2)) Q^T (x - a c).

    Args:
        support: ``[..., m, d]``.
        path: a :class:`~nw_adapter.core.paths.ProbabilityPath`.
        explained: share of variance of the subspace (default 0.9).
        chunk_size, validate: as :class:`SmoothedSupportField`.
    """

    def __init__(
        self,
        support: Tensor,
        path: ProbabilityPath,
        *,
        explained: float = EXPLAINED_VARIANCE,
        chunk_size: int | None = None,
        validate: bool = True,
    ) -> None:
        super().__init__(support, path, chunk_size=chunk_size, validate=validate)
        self.axes, self.variances, self.in_subspace = principal_subspace(self.support, explained)
        self.centre = self.support.mean(-2, keepdim=True)  # [..., 1, d]

    def _mean(self, x: Tensor, a: Tensor, b: Tensor) -> Tensor:
        axes, c = self.axes.to(x.dtype), self.centre.to(x.dtype)
        sel = self.in_subspace[..., None, :]  # [..., 1, d]
        y = (x - a[..., None] * c) @ axes  # [..., n, d] coordinates of x - a c
        s_rot = ((self.support.to(x.dtype) - c) @ axes) * sel  # projected support, complement zeroed
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        m_sub = _per_sample_nw_mean(
            torch.where(sel, y, zero), a, b, s_rot, None, chunk_size=self.chunk_size, validate=False
        )
        lam = self.variances.to(x.dtype)[..., None, :]
        a_, b_ = a[..., None], b[..., None]
        m_perp = a_ * lam / (a_.square() * lam + b_.square()) * y
        return c + torch.where(sel, m_sub, m_perp) @ axes.transpose(-1, -2)

    def __repr__(self) -> str:
        return f"ProjectedField(support={tuple(self.support.shape)}, path={self.path!r})"


class LocalCovarianceField(_MixtureField):
    """Exact field of manifold Parzen windows ``(1/m) sum_i N(s_i, Sigma_i + tau^2 I)``.

    ``Sigma_i = U_i diag(lam_i) U_i^T`` (:func:`local_covariances`). With ``v = a^2 tau^2 + b^2``,
    ``r_i = x - a s_i``, ``p_i = U_i^T r_i`` and ``A_i = a^2 lam_i`` (Woodbury, orthonormal U_i):

        logit_i = -1/2 [ ||r_i||^2 / v - sum_k A_ik p_ik^2 / (v (A_ik + v)) + sum_k log(1 + A_ik / v) ],
        m_i     = s_i + a [ (tau^2 / v) r_i + sum_k g_ik p_ik U_ik ],
        g_ik    = (lam_ik + tau^2) / (A_ik + v) - tau^2 / v.

    ``||r_i||^2`` uses the expanded form on centred data (as the plug-in's SDPA form), the rest is
    chunked over query rows: ``2**24 / (16 m (R + 2))`` rows by default, so each ``[rows, m, R]``
    temporary holds at most 2**20 elements and the peak does not grow with the number of queries.

    Args:
        support: ``[..., m, d]``.
        path: a :class:`~nw_adapter.core.paths.ProbabilityPath`.
        neighbours: k of :func:`local_covariances` (default 10, capped at m - 1).
        explained: share of local variance kept (rank rule, default 0.9).
        tau: float or ``[...]``; ``None``: :func:`loo_tau_local` per support set.
        chunk_size, validate: as :class:`SmoothedSupportField`.
    """

    def __init__(
        self,
        support: Tensor,
        path: ProbabilityPath,
        *,
        neighbours: int | None = None,
        explained: float = EXPLAINED_VARIANCE,
        tau: float | Tensor | None = None,
        chunk_size: int | None = None,
        validate: bool = True,
    ) -> None:
        super().__init__(support, path, chunk_size=chunk_size, validate=validate)
        self.directions, self.eigenvalues = local_covariances(self.support, neighbours, explained)
        given = _tau_tensor(tau, self.support)
        self.tau = loo_tau_local(self.support, self.directions, self.eigenvalues) if given is None else given

    def _mean(self, x: Tensor, a: Tensor, b: Tensor) -> Tensor:
        dt = x.dtype
        s = self.support.to(dt)
        c = s.mean(-2, keepdim=True)
        sc = s - c  # [..., m, d]
        U, lam = self.directions.to(dt), self.eigenvalues.to(dt)  # [..., m, d, R], [..., m, R]
        m, d, R = s.shape[-2], s.shape[-1], lam.shape[-1]
        tau2 = self.tau.to(dt)[..., None].square()  # [..., 1]
        xc = x - a[..., None] * c  # [..., n, d]
        lead = torch.broadcast_shapes(xc.shape[:-2], sc.shape[:-2])
        n = xc.shape[-2]
        xc, a, b = xc.expand(*lead, n, d), a.expand(*lead, n), b.expand(*lead, n)
        tau2 = tau2.expand(*lead, 1)
        U_flat = U.permute(*range(U.dim() - 3), -3, -1, -2).reshape(*U.shape[:-3], m * R, d)  # [..., mR, d]
        sU = torch.einsum("...md,...mdr->...mr", sc, U)  # [..., m, R]
        s_sq = sc.square().sum(-1)  # [..., m]
        rows = self.chunk_size or _rows_per_chunk(lead, 16 * m * (R + 2), ELEMENT_BUDGET)
        # one time for every row (an ODE step): the per-component coefficients are [..., 1, m, R]
        uniform = bool((a == a[..., :1]).all() and (b == b[..., :1]).all())
        out = torch.empty_like(xc)
        for i in range(0, n, rows):
            xi, ai, bi = xc[..., i : i + rows, :], a[..., i : i + rows], b[..., i : i + rows]
            v = ai.square() * tau2 + bi.square()  # [..., q]
            ai_, v_ = ai[..., None], v[..., None]  # [..., q, 1]
            r2 = (
                xi.square().sum(-1, keepdim=True)
                - 2 * ai_ * (xi @ sc.transpose(-1, -2))
                + ai_.square() * s_sq[..., None, :]
            ).clamp_min(0)  # [..., q, m]
            p = (xi @ U_flat.transpose(-1, -2)).unflatten(-1, (m, R)) - ai_[..., None] * sU[..., None, :, :]
            ac, vc = (ai_[..., :1, :], v_[..., :1, :]) if uniform else (ai_, v_)  # [..., q or 1, 1]
            A = ac[..., None].square() * lam[..., None, :, :]  # [..., q or 1, m, R]
            vv = vc[..., None]
            quad_coef = A / (vv * (A + vv))
            logdet = torch.log1p(A / vv).sum(-1)  # [..., q or 1, m]
            logits = -0.5 * (r2 / v_ - (quad_coef * p.square()).sum(-1) + logdet)
            w = torch.softmax(logits, -1)  # [..., q, m]
            ms = w @ sc  # [..., q, d]
            g = (lam[..., None, :, :] + tau2[..., None, None]) / (A + vv) - tau2[..., None, None] / vv
            corr = ((w[..., None] * g * p).flatten(-2)) @ U_flat  # [..., q, d]
            out[..., i : i + rows, :] = ms + ai_ * ((tau2[..., None] / v_) * (xi - ai_ * ms) + corr)
        return out + c

    def __repr__(self) -> str:
        return f"LocalCovarianceField(support={tuple(self.support.shape)}, path={self.path!r})"
