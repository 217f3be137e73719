"""``gaussian_kernel_head``: swap's lean NW head against an explicit float64 softmax, and its cost.

The head centres the keys on their first row and leaves the queries untouched, so its error
bound (derived in :func:`head_tolerances`) grows with ``|q| |k - k_0|``, not with ``|k|^2``.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nw_adapter.core import kernels
from nw_adapter.core.kernels import gaussian_kernel_attention, gaussian_kernel_head

EPS32 = torch.finfo(torch.float32).eps


def reference_mean(query, key, value, h) -> torch.Tensor:
    """Float64 ``softmax(-||q - k||^2 / 2h^2) @ v`` by direct differences (no algebraic tricks)."""
    q, k, v = query.double(), key.double(), value.double()
    h = torch.as_tensor(h, dtype=torch.float64)
    logits = -((q[..., :, None, :] - k[..., None, :, :]) ** 2).sum(-1) / (2 * h[..., None, None] ** 2)
    return torch.softmax(logits, dim=-1) @ v


def head_tolerances(query, key, value, h, eps: float = EPS32) -> float:
    """Error bound of the head's output (float32 math) from the same rounded inputs.

    The logit is ``sum_l q_l k'_l / h^2 - sum_l k'_l u_l / 2h^2`` with ``k' = k - k_0`` and
    ``u = k + k_0``; every product term is rounded once and a sum of d terms accumulates at most
    ``(d + 4) eps`` of the sum of the absolute terms, so the absolute logit error is at most
    ``(d + 4) eps L`` with ``L = max (sum_l |q_l k'_l| + sum_l |k'_l u_l| / 2) / h^2 + 1``. A
    softmax perturbation moves the weights by ``sum_i |dw_i| <= 2 max |dl|``; since
    ``sum_i dw_i = 0`` the mean moves by at most that times ``max |v - mean(v)|``, plus the rounding
    of the normalisation and the output, ``(m + 4) eps max |v|``.
    """
    q, k, v = query.double(), key.double(), value.double()
    h = torch.as_tensor(h, dtype=torch.float64)
    d, m = q.shape[-1], k.shape[-2]
    k_0 = k[..., :1, :]
    centred, summed = (k - k_0).abs(), (k + k_0).abs()
    dot = (q.abs() @ centred.transpose(-1, -2)).amax((-1, -2))
    bias = (centred * summed).sum(-1).amax(-1) / 2
    big = float(((dot + bias) / h**2).max())
    tol_w = 2 * (d + 4) * eps * (big + 1.0)
    spread = float((v - v.mean(-2, keepdim=True)).abs().max())
    return tol_w * spread + (m + 4) * eps * float(v.abs().max())


def make_case(name: str, seed: int = 0):
    """(query [2, 3, n, d], key [2, 3, m, d], value [2, 3, m, 5], per-head bandwidth [3])."""
    g = torch.Generator().manual_seed(seed)
    d, n, m = 8, 37, 11
    q = 2 * torch.randn(2, 3, n, d, generator=g, dtype=torch.float64)
    k = 2 * torch.randn(2, 3, m, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, m, 5, generator=g, dtype=torch.float64)
    h = 1.5 * (0.5 + torch.rand(3, generator=g, dtype=torch.float64))
    if name == "far_keys":
        # keys share a large component (1e3 along one axis, spread 0.01 along it): ||k||^2 ~ 1e6
        k[..., 0] = 1e3 + 0.01 * torch.randn(2, 3, m, generator=g, dtype=torch.float64)
    dtype = torch.float64 if name == "float64" else torch.float32
    return q.to(dtype), k.to(dtype), v.to(dtype), h


@pytest.mark.parametrize("name", ["standard", "far_keys", "float64"])
@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("per_head", [True, False])
def test_head_matches_float64_formula(name: str, chunk: int | None, per_head: bool) -> None:
    q, k, v, h = make_case(name)
    bandwidth = h if per_head else float(h[1])
    ref = reference_mean(q, k, v, bandwidth)
    eps = torch.finfo(torch.float64).eps if q.dtype == torch.float64 else EPS32
    out = gaussian_kernel_head(q, k, v, bandwidth, chunk_size=chunk)
    assert out.shape == (2, 3, 37, 5) and out.dtype == q.dtype
    assert (out.double() - ref).abs().max() <= head_tolerances(q, k, v, bandwidth, eps)


def test_tolerance_catches_an_uncentred_key_bias() -> None:
    # The expanded form with raw keys rounds ||k||^2 ~ 1e6 and fails the same bound by far.
    q, k, v, h = make_case("far_keys")
    hh = h[:, None, None].float()
    naive = torch.softmax((q @ k.transpose(-1, -2) - 0.5 * k.square().sum(-1)[..., None, :]) / hh**2, -1) @ v
    assert (naive.double() - reference_mean(q, k, v, h)).abs().max() > 10 * head_tolerances(q, k, v, h)


def test_head_agrees_with_the_general_attention_and_broadcasts() -> None:
    q, k, v, h = make_case("standard")
    torch.testing.assert_close(gaussian_kernel_head(q, k, v, h), gaussian_kernel_attention(q, k, v, h))
    # shared keys [m, d] against [B, H, n, d] queries; bandwidth per (batch, head)
    h_bh = torch.rand(2, 3, generator=torch.Generator().manual_seed(0)) + 0.5
    out = gaussian_kernel_head(q, k[0, 0], v[0, 0], h_bh)
    # a tensor h and a float h take float32 paths of different op order: over 300 draws of h_bh the
    # difference reached 2.7e-5 at values up to 3 (the default atol 1e-5 failed for some global seeds)
    single = gaussian_kernel_head(q[1, 2], k[0, 0], v[0, 0], float(h_bh[1, 2]))
    torch.testing.assert_close(out[1, 2], single, rtol=1.3e-6, atol=5e-5)
    # 2-D inputs, half-precision queries are upcast and the result is float32
    out = gaussian_kernel_head(q[0, 0].half(), k[0, 0], v[0, 0], 1.0)
    assert out.shape == (37, 5) and out.dtype == torch.float32


class _OpLog(TorchDispatchMode):
    """Every dispatched aten op that is not a view: name and number of output elements."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            first = out[0] if isinstance(out, tuple) else out
            self.ops.append((func.overloadpacket.__name__, first.numel() if torch.is_tensor(first) else 0))
        return out


def test_head_leaves_the_queries_untouched_and_dispatches_six_ops() -> None:
    torch.set_num_threads(1)
    q = torch.randn(2, 64, 8 * 40).view(2, 64, 8, 40).transpose(1, 2)  # a processor's query layout
    k, v = torch.randn(2, 8, 4, 40), torch.randn(2, 8, 4, 40)
    with _OpLog() as log:
        gaussian_kernel_head(q, k, v, 40**0.25)
    names = collections.Counter(name for name, _ in log.ops)
    assert sum(names.values()) == 6, log.ops
    assert sum(1 for name in names if "scaled_dot_product" in name) == 1
    # besides SDPA's output, nothing as large as the queries is written: they are not copied
    assert [n for n, size in log.ops if size >= q.numel() and "scaled_dot_product" not in n] == []


def test_head_chunks_bound_each_sdpa_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = kernels.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append(q.shape[-2])
        return real(q, k, v, **kw)

    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", spy)
    q, k, v, h = make_case("standard")
    gaussian_kernel_head(q, k, v, h, chunk_size=8)
    assert max(calls) == 8 and sum(calls) == q.shape[-2]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"key": torch.randn(5, 2)}, "feature dim"),
        ({"key": torch.randn(0, 3), "value": torch.randn(0, 3)}, "rows"),
        ({"value": torch.randn(6, 3)}, "rows"),
        ({"bandwidth": 0.0}, "bandwidth"),
        ({"bandwidth": math.inf}, "bandwidth"),
        ({"query": torch.randn(3)}, "query"),
        ({"query": torch.randn(2, 4, 3), "key": torch.randn(3, 5, 3)}, "do not broadcast"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_head_bad_input_names_the_argument(kwargs: dict, match: str) -> None:
    args = {"query": torch.randn(4, 3), "key": torch.randn(5, 3), "value": None, "bandwidth": 1.0} | kwargs
    if args["value"] is None:
        args["value"] = torch.randn(*args["key"].shape[:-1], 3)
    chunk = args.pop("chunk_size", None)
    with pytest.raises(ValueError, match=match):
        gaussian_kernel_head(args["query"], args["key"], args["value"], args["bandwidth"], chunk_size=chunk)
