"""Support sets (nw_adapter.core.support): per-reference mass and entropy against own computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nw_adapter.core.support import (
    attention_log_mass,
    nw_log_mass,
    reference_log_mass,
    support_statistics,
)

LOG2 = math.log(2.0)


def _h(p: list[float]) -> float:
    return -sum(x * math.log(x) for x in p if x > 0)


def _known_case() -> tuple[torch.Tensor, torch.Tensor]:
    """Two references of two tokens each; keys = the unit vectors and scale 1, so logits = q.

    Row 0 weights are proportional to (1, 3 | 1, 1): mass (2/3, 1/3); row 1 to (2, 1 | 1, 5): mass
    (1/3, 2/3). The query-averaged mass is (1/2, 1/2) although each row leans to one reference.
    """
    q = torch.tensor(
        [[0.0, math.log(3), 0.0, 0.0], [math.log(2), 0.0, 0.0, math.log(5)]], dtype=torch.float64
    )
    k = torch.eye(4, dtype=torch.float64)
    return q[None, None], k[None, None]


def test_mass_and_entropies_of_two_references_match_a_hand_computation():
    q, k = _known_case()
    out = support_statistics(q, k, scale=1.0, h=1.0, references=2)
    assert out.mass[0, 0].tolist() == pytest.approx([0.5, 0.5], abs=1e-12)
    assert out.entropy[0, 0].item() == pytest.approx(LOG2, abs=1e-12)
    assert out.row_entropy[0, 0].item() == pytest.approx(_h([2 / 3, 1 / 3]), abs=1e-12)
    assert out.row_entropy[0, 0].item() < LOG2 - 0.05  # each row leans to one reference


def test_equal_logits_spread_the_mass_evenly_so_the_row_entropy_is_maximal():
    q, k = torch.zeros(1, 1, 2, 4, dtype=torch.float64), torch.eye(4, dtype=torch.float64)[None, None]
    out = support_statistics(q, k, scale=1.0, h=1.0, references=2)
    assert out.mass[0, 0].tolist() == pytest.approx([0.5, 0.5], abs=1e-12)
    assert out.row_entropy[0, 0].item() == pytest.approx(LOG2, abs=1e-12)


def test_a_mass_on_one_reference_has_zero_entropy_where_the_weights_underflow():
    """Logits 1000 apart in float32: the losing reference's weights underflow to 0; the mass from
    the logits is exactly (1, 0) and both entropies 0, with no NaN."""
    q = torch.tensor([[[[1000.0, 999.0, 0.0, -5.0]]]])
    out = support_statistics(q, torch.eye(4)[None, None], scale=1.0, h=1.0, references=2)
    assert out.mass[0, 0].tolist() == [1.0, 0.0]
    assert out.entropy.item() == 0.0 and out.row_entropy.item() == 0.0
    assert torch.isfinite(reference_log_mass(q, 2)).all()


def test_attention_mass_matches_an_explicit_softmax_over_random_keys():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 7, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, 12, 8, generator=gen, dtype=torch.float64)
    scale = 8**-0.5
    weights = np.exp(scale * (q @ k.transpose(-1, -2)).numpy())
    weights /= weights.sum(-1, keepdims=True)
    expected = weights.reshape(2, 3, 7, 3, 4).sum(-1)  # 3 references of 4 tokens
    got = attention_log_mass(q, k, scale, 3).exp().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-12)


@pytest.mark.parametrize("h", [0.3, 1.0, 4.0])
def test_nw_mass_matches_the_closed_form_of_the_nw_weights(h):
    """THEORY.md section 1: w_i = softmax_i(-||x - s_i||^2 / 2h^2), summed over each reference's tokens."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 5, 6, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, 6, 6, generator=gen, dtype=torch.float64)
    dist2 = ((q.numpy()[..., :, None, :] - k.numpy()[..., None, :, :]) ** 2).sum(-1)
    w = np.exp(-dist2 / (2 * h * h))
    w /= w.sum(-1, keepdims=True)
    expected = w.reshape(1, 2, 5, 2, 3).sum(-1)
    np.testing.assert_allclose(nw_log_mass(q, k, h, 2).exp().numpy(), expected, rtol=1e-10)
    out = support_statistics(q, k, scale=1.0, h=h, references=2)
    np.testing.assert_allclose(out.mass_nw.numpy(), expected.mean(-2), rtol=1e-10)
    assert out.entropy_nw.numpy() == pytest.approx(-(expected.mean(-2) * np.log(expected.mean(-2))).sum(-1))


def test_nw_mass_is_uniform_at_infinite_h_and_picks_the_nearest_reference_as_h_vanishes():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, 6, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 1, 8, 4, generator=gen, dtype=torch.float64)
    uniform = support_statistics(q, k, scale=1.0, h=math.inf, references=4)
    assert uniform.mass_nw[0, 0].tolist() == [0.25] * 4
    assert uniform.entropy_nw.item() == pytest.approx(math.log(4)) == uniform.row_entropy_nw.item()
    sharp = nw_log_mass(q, k, 1e-3, 4).exp()[0, 0]
    nearest_reference = torch.cdist(q, k)[0, 0].argmin(-1) // 2  # 4 references of 2 tokens
    assert torch.equal(sharp.argmax(-1), nearest_reference)
    assert sharp.max(-1).values.min().item() == pytest.approx(1.0, abs=1e-9)
    blurred = support_statistics(q, k, scale=1.0, h=1e-3, references=4)
    assert blurred.row_entropy_nw.item() == pytest.approx(0.0, abs=1e-9)


def test_nan_bandwidth_gives_nan_nw_columns_and_keeps_the_attention_ones():
    q, k = _known_case()
    out = support_statistics(q, k, scale=1.0, h=math.nan, references=2)
    assert torch.isnan(out.mass_nw).all() and torch.isnan(out.entropy_nw).all()
    assert torch.isfinite(out.mass).all()


@pytest.mark.parametrize("references", [3, 0, True])
def test_references_that_do_not_split_the_keys_are_refused(references):
    q, k = _known_case()
    with pytest.raises(ValueError, match="references|do not split"):
        support_statistics(q, k, scale=1.0, h=1.0, references=references)
