"""Attention heads built to show what rho and the readings can and cannot tell (docs/THEORY.md).

Each builder draws one head, queries ``q [B, H, N, d]`` and keys ``k [B, H, M, d]`` with the
softmax scale of its attention ``softmax(scale q k^T)``, from a seeded generator:

- :func:`isotropic_head`: q and k i.i.d. standard normal (no structure at all);
- :func:`large_query_head`: random keys, queries of norm 32 in random directions (rho rises with
  ||q|| by algebra);
- :func:`query_blind_head`: every query prefers the smallest-norm key whatever the query (a key
  prior, no smoothing of the query);
- :func:`augmented_nw_head`: the exact NW head of THEORY section 3 in augmented form,
  ``q = [x, 1]``, ``k_i = [s_i, -||s_i||^2 / 2]``, scale ``1/h^2``: its attention IS the NW weights
  of the support ``s_i`` at bandwidth h in data space.

:func:`measure_heads` runs :func:`nw_adapter.core.compare.compare_attention` on ``seeds`` draws of
each (one draw per seed: the independent unit) and :func:`two_term_share` checks the tautology of
head-space comparisons: a per-key bias plus one NW term explains all of the row-centred logits of
any dot-product head (``log A = log NW(h^2 = 1/scale) + scale ||k||^2 / 2 + c``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from nw_adapter.core.compare import compare_attention
from nw_adapter.core.readings import row_centred

__all__ = [
    "HEADS",
    "augmented_nw_head",
    "isotropic_head",
    "large_query_head",
    "measure_heads",
    "query_blind_head",
    "two_term_share",
]

Head = tuple[Tensor, Tensor, float]
"""(q [B, H, N, d], k [B, H, M, d], softmax scale)."""


def _normal(shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def isotropic_head(generator: torch.Generator, *, rows: int = 256, keys: int = 4, dim: int = 16) -> Head:
    """q, k ~ N(0, I_d) i.i.d., scale ``1/sqrt(d)``; one batch row, 2 heads."""
    return _normal((1, 2, rows, dim), generator), _normal((1, 2, keys, dim), generator), dim**-0.5


def large_query_head(
    generator: torch.Generator, *, rows: int = 256, keys: int = 4, dim: int = 40, norm: float = 32.0
) -> Head:
    """Keys ~ N(0, I_d); queries ``norm z / ||z||`` with z ~ N(0, I_d); scale ``1/sqrt(d)``."""
    z = _normal((1, 2, rows, dim), generator)
    return norm * z / z.norm(dim=-1, keepdim=True), _normal((1, 2, keys, dim), generator), dim**-0.5


def query_blind_head(
    generator: torch.Generator, *, rows: int = 256, keys: int = 4, dim: int = 40, strength: float = 8.0
) -> Head:
    """Every query points at the smallest-norm key: ``q_j = strength u + 0.5 e_j``, ``u = k_0 / ||k_0||``.

    Keys ~ N(0, I_d) scaled by norms 0.5, 1, 1.5, 2 (key 0 the smallest); scale ``1/sqrt(d)``. Each
    query's attention prefers key 0 whatever the query's noise ``e_j ~ N(0, I_d)``: a key prior.
    """
    gains = torch.linspace(0.5, 0.5 * keys, keys, dtype=torch.float64).view(1, 1, keys, 1)
    k = _normal((1, 2, keys, dim), generator) * gains
    direction = k[..., :1, :] / k[..., :1, :].norm(dim=-1, keepdim=True)
    return strength * direction + 0.5 * _normal((1, 2, rows, dim), generator), k, dim**-0.5


def augmented_nw_head(
    generator: torch.Generator, *, rows: int = 256, keys: int = 4, dim: int = 8, bandwidth: float = 1.0
) -> Head:
    """The exact NW head (THEORY 3): ``q_j = [x_j, 1]``, ``k_i = [s_i, -||s_i||^2 / 2]``, scale ``1/h^2``.

    ``scale q_j.k_i = -||x_j - s_i||^2 / 2h^2 + ||x_j||^2 / 2h^2``, so ``softmax(scale q k^T)`` is the
    NW weight vector of the support at bandwidth h in data space. Support points ``s_i`` of norms
    spread by gains 0.8 ... 1.6, queries ``x_j ~ N(0, 1.5^2 I_d)``.
    """
    gains = torch.linspace(0.8, 1.6, keys, dtype=torch.float64).view(1, 1, keys, 1)
    support = _normal((1, 2, keys, dim), generator) * gains
    x = 1.5 * _normal((1, 2, rows, dim), generator)
    q = torch.cat([x, torch.ones(1, 2, rows, 1, dtype=torch.float64)], -1)
    k = torch.cat([support, -0.5 * support.square().sum(-1, keepdim=True)], -1)
    return q, k, bandwidth**-2


#: The heads of the table in docs/THEORY.md, in order.
HEADS: dict[str, Callable[[torch.Generator], Head]] = {
    "isotropic random (d 16, 4 keys)": isotropic_head,
    "random, ||q|| = 32 (d 40)": large_query_head,
    "query-blind (prefers the smallest key)": query_blind_head,
    "exact NW, augmented (THEORY 3)": augmented_nw_head,
}


def two_term_share(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Share of the row-centred logits explained by a per-key bias plus one NW term, ``[B, H]``.

    Least squares of ``L~ = row_centred(scale q k^T)`` on a per-key bias and ``beta G~``, with
    ``G = q.k - ||k||^2 / 2``: the key bias is removed by centring each key's column over the query
    rows (``r_L``, ``r_G``), then ``beta = <r_L, r_G> / <r_G, r_G>`` and the share is
    ``1 - ||r_L - beta r_G||^2 / ||L~||^2``. By algebra ``L~ = scale G~ + row_centred(scale ||k||^2 / 2)``,
    so the share is 1 for every dot-product head (up to rounding): comparisons in head space are
    partly tautological.
    """
    qk = q @ k.transpose(-1, -2)
    logits = row_centred(scale * qk)
    scores = row_centred(qk - 0.5 * k.square().sum(-1)[..., None, :])
    r_logits = logits - logits.mean(-2, keepdim=True)
    r_scores = scores - scores.mean(-2, keepdim=True)
    beta = (r_logits * r_scores).sum((-1, -2)) / r_scores.square().sum((-1, -2))
    residual = (r_logits - beta[..., None, None] * r_scores).square().sum((-1, -2))
    return 1.0 - residual / logits.square().sum((-1, -2))


def measure_heads(seeds: int = 10) -> dict[str, dict[str, list[float]]]:
    """Per head of :data:`HEADS`, per reading, one value per seed (mean over the draw's 2 heads).

    Every value comes from :func:`~nw_adapter.core.compare.compare_attention` in float64 (nulls seeded
    by the seed) plus ``two_term_share``.
    """
    table: dict[str, dict[str, list[float]]] = {}
    for name, build in HEADS.items():
        values: dict[str, list[float]] = {}
        for seed in range(seeds):
            q, k, scale = build(torch.Generator().manual_seed(seed))
            readings = compare_attention(q, k, scale=scale, seed=seed)
            readings["two_term_share"] = two_term_share(q, k, scale)
            for key, tensor in readings.items():
                values.setdefault(key, []).append(float(tensor.mean()))
        table[name] = values
    return table
