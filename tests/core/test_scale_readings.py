"""The scale readings: logit_scale (RMS of the row-centred logits) and key_rms, against own sums."""

from __future__ import annotations

import math

import pytest
import torch

from nw_adapter.core.compare import compare_attention
from nw_adapter.core.kernels import nw_logits
from nw_adapter.core.readings import key_rms, logit_scale


def _own_logit_scale(logits: torch.Tensor, keep: list[int]) -> torch.Tensor:
    part = logits[..., keep]
    centred = part - part.mean(-1, keepdim=True)
    return centred.square().mean((-1, -2)).sqrt()


@pytest.mark.parametrize("masked", [False, True])
def test_scale_readings_match_own_sums(masked: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 17, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, 6, 8, generator=gen, dtype=torch.float64) * torch.linspace(0.5, 2, 6)[:, None]
    keep = [0, 2, 3, 5] if masked else list(range(6))
    valid = torch.zeros(6, dtype=torch.bool)
    valid[keep] = True
    out = compare_attention(q, k, scale=8**-0.5, valid=valid if masked else None)
    logits = q @ k.transpose(-1, -2) * 8**-0.5
    torch.testing.assert_close(out["logit_scale"], _own_logit_scale(logits, keep), rtol=1e-12, atol=0)
    own_rms = k[..., keep, :].square().sum(-1).mean(-1).sqrt()
    torch.testing.assert_close(out["key_rms"], own_rms, rtol=1e-12, atol=0)


def test_gains_multiply_the_scale_readings() -> None:
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 9, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, 5, 4, generator=gen, dtype=torch.float64)
    base = compare_attention(q, k, scale=0.5)
    gained = compare_attention(2.5 * q, 0.4 * k, scale=0.5)
    torch.testing.assert_close(gained["logit_scale"], base["logit_scale"], rtol=1e-12, atol=0)
    torch.testing.assert_close(gained["key_rms"], 0.4 * base["key_rms"], rtol=1e-12, atol=0)


def test_nw_head_logit_scale_is_inverse_square_bandwidth() -> None:
    """Theorem 3's head over a fixed support and queries: log logit_scale falls with slope -2 in log h."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 1, 12, 3, generator=gen, dtype=torch.float64)
    norms = torch.tensor([0.3, 1, 2, 3.0], dtype=torch.float64)[:, None]
    support = torch.randn(1, 1, 4, 3, generator=gen, dtype=torch.float64) * norms  # unequal norms
    hs = torch.tensor([4.0, 2.0, 1.0, 0.5], dtype=torch.float64)
    scales = torch.stack([logit_scale(nw_logits(x, support, h)) for h in hs]).flatten()
    slope = torch.diff(scales.log()) / torch.diff(hs.log())
    torch.testing.assert_close(slope, torch.full_like(slope, -2.0), rtol=1e-10, atol=1e-10)


def test_constant_rows_have_zero_scale() -> None:
    assert logit_scale(torch.zeros(1, 3, 4)).item() == 0.0
    assert math.isclose(key_rms(torch.tensor([[3.0, 4.0], [0.0, 0.0]])).item(), math.sqrt(12.5))
