"""The random numbers of rho's nulls, drawn once per softmax and shared by every writing of it.

The reference (:mod:`.reference`) and the fast path (:mod:`.fast`) take the same
:class:`NullDraws`, so they see the same rows, permutations and directions and must agree to
rounding. Drawing happens in eager mode, outside any compiled region.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    2 random-number ops per softmax.

    Args:
        q: queries ``[B, H, N, d]`` (only the shape and device are read).
        num_keys: M, the keys of the softmax.
        null_rows: n0, the rows the nulls are estimated on (None = all N).
        generator: the seeded generator on ``q``'s device.

    Returns:
        The draws; float32 whatever the default dtype.
    """
    b, nh, n, d = q.shape
    n0 = n if null_rows is None else min(n, null_rows)
    rows = torch.randperm(n, generator=generator, device=q.device)[:n0]
    gauss = torch.randn(
        (b, nh, n0, num_keys + d), generator=generator, device=q.device, dtype=torch.float32
    )
    return NullDraws(rows, gauss[..., :num_keys], gauss[..., num_keys:])
