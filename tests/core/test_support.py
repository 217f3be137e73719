"""Support sets (nw_adapter.core.support): per-reference mass and entropy against own computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nw_adapter.core.support import (
    attention_log_mass,
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
    out = support_statistics(q, k, scale=1.0, references=2)
    assert out.mass[0, 0].tolist() == pytest.approx([0.5, 0.5], abs=1e-12)
    assert out.entropy[0, 0].item() == pytest.approx(LOG2, abs=1e-12)
    assert out.row_entropy[0, 0].item() == pytest.approx(_h([2 / 3, 1 / 3]), abs=1e-12)
    assert out.row_entropy[0, 0].item() < LOG2 - 0.05  # each row leans to one reference


def test_equal_logits_spread_the_mass_evenly_so_the_row_entropy_is_maximal():
    q, k = torch.zeros(1, 1, 2, 4, dtype=torch.float64), torch.eye(4, dtype=torch.float64)[None, None]
    out = support_statistics(q, k, scale=1.0, references=2)
    assert out.mass[0, 0].tolist() == pytest.approx([0.5, 0.5], abs=1e-12)
    assert out.row_entropy[0, 0].item() == pytest.approx(LOG2, abs=1e-12)


def test_a_mass_on_one_reference_has_zero_entropy_where_the_weights_underflow():
    """Logits 1000 apart in float32: the losing reference's weights underflow to 0; the mass from
    the logits is exactly (1, 0) and both entropies 0, with no NaN."""
    q = torch.tensor([[[[1000.0, 999.0, 0.0, -5.0]]]])
    out = support_statistics(q, torch.eye(4)[None, None], scale=1.0, references=2)
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


@pytest.mark.parametrize("references", [3, 0, True])
def test_references_that_do_not_split_the_keys_are_refused(references):
    q, k = _known_case()
    with pytest.raises(ValueError, match="references|do not split"):
        support_statistics(q, k, scale=1.0, references=references)
