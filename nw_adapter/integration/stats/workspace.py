"""Where the fast path's intermediate tensors live: one writer object per call, eager or compiled.

Eager, the fast path writes its intermediate results with ``out=`` into per-thread workspace
buffers (one set per layer shape) and reads constants from a cache: no allocation and no
concatenation per layer call. Under :func:`torch.compile` none of that applies (dynamo does not
trace ``out=`` into views, and inductor plans its own buffers), so the same calls become plain
operations whose results are copied into fresh tensors (inductor fuses the copies). The choice
is made once per call (:func:`writer`), not inside every helper.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from nw_adapter.core.metrics import SORT_RANKS_ABOVE, rank_sign_sums

_CONSTANTS: dict[tuple, torch.Tensor] = {}
#: Eager on a CPU, a product summed over at most this many entries is accumulated entry by entry
#: (:meth:`EagerWriter.vecdot`); past it the loop's ops cost more than the product's memory.
ACCUMULATE_UP_TO = 16
_BUFFERS = threading.local()


def f32(values: Any, device: torch.device | None) -> torch.Tensor:
    """A float32 constant (never the default dtype, which a user may have changed)."""
    return torch.tensor(values, dtype=torch.float32, device=device)


class EagerWriter:
    """Eager mode: results written with ``out=``, workspaces and constants cached."""

    #: whether ops run one at a time (eager: each op's cost is its own, so the statistics may pick
    #: the cheaper of two equal computations at run time); False under the compiler, which fuses
    eager = True

    def write(
        self, out: torch.Tensor, op: Callable[..., torch.Tensor], *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """``op(*args, **kwargs)`` written into ``out`` (a slice of a workspace); returns ``out``."""
        return op(*args, **kwargs, out=out)

    def products(self, out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``out = x y^T`` for ``x [..., P, K]``, ``y [..., Q, K]`` (``out [..., P, Q]``): one product."""
        return torch.matmul(x, y.transpose(-1, -2), out=out)

    def biased_products(
        self, out: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """``out = bias + x y^T`` for ``x [..., P, K]``, ``y [..., Q, K]``, ``bias`` broadcastable to
        ``out [..., P, Q]``: one ``baddbmm`` over the flattened leading dims (``out`` must allow a view)."""
        p, q = x.shape[-2], y.shape[-2]
        flat_bias = bias.expand(*out.shape).reshape(-1, p, q)
        flat_y = y.reshape(-1, q, y.shape[-1]).transpose(-1, -2)
        return torch.baddbmm(flat_bias, x.reshape(-1, p, x.shape[-1]), flat_y, out=out.view(-1, p, q))

    def ranks(
        self, scores: torch.Tensor, valid: torch.Tensor | None, out: torch.Tensor, dim: int = -1
    ) -> torch.Tensor:
        """Rank sign sums of ``scores`` along ``dim`` (:func:`~nw_adapter.core.metrics.rank_sign_sums`),
        written into ``out``; ``valid`` is the key mask, broadcastable to ``scores``.

        Without a key mask and up to :data:`~nw_adapter.core.metrics.SORT_RANKS_ABOVE` keys, the
        same sums one shift at a time: for each shift t the signs ``d_i = sign(x_i - x_{i+t})`` of
        every pair (i, i + t) are added to key i's sums and subtracted from key i + t's (4 ops per
        shift, m - 1 shifts, every pair compared once): the same
        values as the pairwise ``[..., m, m]`` comparison without materialising it. With the keys
        on a leading dimension (``dim`` not last) each op runs along a long contiguous inner
        dimension (a subtraction broadcast over a last dimension of 4 keys is several times slower
        on a CPU)."""
        m = scores.shape[dim]
        if valid is not None or m > SORT_RANKS_ABOVE:
            return out.copy_(_ranks_along(scores, valid, dim))
        out.zero_()
        for shift in range(1, m):  # the pairs (i, i + shift) of every i at once: each pair once
            low, high = scores.narrow(dim, 0, m - shift), scores.narrow(dim, shift, m - shift)
            sign = torch.sub(low, high).sign_()  # sign(x_j - x_i) = -sign(x_i - x_j), exactly
            out.narrow(dim, 0, m - shift).add_(sign)
            out.narrow(dim, shift, m - shift).sub_(sign)
        return out

    def workspace(
        self, name: str, shape: tuple[int, ...], device: torch.device, zero: bool = False
    ) -> torch.Tensor:
        """A float32 scratch tensor of ``shape``, reused by every call with that shape on this thread.

        ``zero``: filled with zeros when made (columns never written stay 0). Whatever a call
        writes into it, the next call of the same shape overwrites: never return a view of it.
        """
        buffers = _BUFFERS.__dict__.setdefault("buffers", {})
        key = (name, shape, device)
        if key not in buffers:
            if len(buffers) > 64:
                buffers.clear()
            buffers[key] = (torch.zeros if zero else torch.empty)(shape, dtype=torch.float32, device=device)
        return buffers[key]

    def vecdot(self, out: torch.Tensor, x: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
        """``out = sum_dim x y`` (``torch.linalg.vecdot`` of real tensors of equal rank, broadcast).

        On a CPU, over at most :data:`ACCUMULATE_UP_TO` entries (the keys), accumulated one entry
        at a time into ``out`` (one ``mul``, then an ``addcmul_`` per entry): ``vecdot``
        materialises the whole product, several MB at the proxy's largest group, and with cold
        caches cost ~3x the CPU time of the accumulation (1.18 against 0.41 ms for 4 products of
        ``[100, 8, 4, 64]``). Elsewhere (a GPU: fewer launches) one ``vecdot``."""
        size = max(x.shape[dim], y.shape[dim])
        if not self.accumulates(x, size):
            return torch.linalg.vecdot(x, y, dim=dim, out=out)
        xs, ys = x.unbind(dim), y.unbind(dim)
        torch.mul(xs[0], ys[0], out=out)
        for i in range(1, size):
            out.addcmul_(xs[i if len(xs) > 1 else 0], ys[i if len(ys) > 1 else 0])
        return out

    def on_cpu(self, x: torch.Tensor) -> bool:
        """Whether the CPU's choices apply to ``x``: more, cheaper ops where a GPU, launch-bound,
        takes fewer (:meth:`vecdot`, the permutation null's key shuffle)."""
        return x.device.type == "cpu"

    def accumulates(self, x: torch.Tensor, size: int) -> bool:
        """Whether :meth:`vecdot` accumulates a sum over ``size`` entries of ``x`` entry by entry: on
        a CPU, up to :data:`ACCUMULATE_UP_TO` entries (a GPU is launch-bound: one ``vecdot``)."""
        return self.on_cpu(x) and size <= ACCUMULATE_UP_TO

    def settled(self, new: torch.Tensor, old: torch.Tensor, tolerance: float) -> bool:
        """Whether every element of an iteration moved by at most ``tolerance`` relative,
        ``|new - old| <= tolerance |old|`` (NaN: not settled), so that the caller may stop early.

        A host read, so answered only where it costs nothing: eager on the CPU, where there is no
        device to wait for. On any other device it is False without reading (the iteration runs
        its fixed number of steps and the call makes no host synchronisation)."""
        if new.device.type != "cpu":
            return False
        return bool(torch.le(torch.sub(new, old).abs_(), old.abs().mul_(tolerance)).all())

    def constant(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A constant tensor made once per key (no host-to-device copy after the first call)."""
        if key not in _CONSTANTS:
            if len(_CONSTANTS) > 256:
                _CONSTANTS.clear()
            _CONSTANTS[key] = make()
        return _CONSTANTS[key]


class CompiledWriter(EagerWriter):
    """Under :func:`torch.compile`: plain operations, fresh tensors, constants made in the graph."""

    eager = False

    def write(
        self, out: torch.Tensor, op: Callable[..., torch.Tensor], *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """``out.copy_(op(*args, **kwargs))`` (inductor fuses the copy into the producing kernel)."""
        return out.copy_(op(*args, **kwargs))

    def products(self, out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The broadcast product summed over K: fuses with the kernels around it (a matrix product
        is an extern kernel inductor cannot fuse, one more launch per call)."""
        return out.copy_((x[..., :, None, :] * y[..., None, :, :]).sum(-1))

    def vecdot(self, out: torch.Tensor, x: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
        """``out.copy_(torch.linalg.vecdot(x, y, dim=dim))`` (inductor fuses the product and the sum)."""
        return out.copy_(torch.linalg.vecdot(x, y, dim=dim))

    def biased_products(
        self, out: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """``bias +`` the broadcast product summed over K (see :meth:`products`)."""
        return out.copy_(bias + (x[..., :, None, :] * y[..., None, :, :]).sum(-1))

    def ranks(
        self, scores: torch.Tensor, valid: torch.Tensor | None, out: torch.Tensor, dim: int = -1
    ) -> torch.Tensor:
        """Rank sign sums along ``dim`` as a fresh tensor (``out`` is not used)."""
        return _ranks_along(scores, valid, dim)

    def workspace(
        self, name: str, shape: tuple[int, ...], device: torch.device, zero: bool = False
    ) -> torch.Tensor:
        """A fresh tensor (the compiler plans its own buffers)."""
        return (torch.zeros if zero else torch.empty)(shape, dtype=torch.float32, device=device)

    def settled(self, new: torch.Tensor, old: torch.Tensor, tolerance: float) -> bool:
        """Never (a data-dependent stop would break the graph): the fixed number of steps runs."""
        return False

    def constant(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The constant made in the graph (the compiler folds it)."""
        return make()


def _ranks_along(scores: torch.Tensor, valid: torch.Tensor | None, dim: int) -> torch.Tensor:
    """:func:`~nw_adapter.core.metrics.rank_sign_sums` along ``dim`` (a fresh tensor)."""
    if valid is not None:
        valid = valid.expand_as(scores).movedim(dim, -1)
    return rank_sign_sums(scores.movedim(dim, -1), valid).movedim(-1, dim)


def writer() -> EagerWriter:
    """The writer of this call: :class:`CompiledWriter` while dynamo traces, else :class:`EagerWriter`."""
    return CompiledWriter() if torch.compiler.is_compiling() else EagerWriter()
