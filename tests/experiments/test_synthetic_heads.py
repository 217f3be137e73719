"""The synthetic heads of docs/THEORY.md: what the readings say where the answer is known by construction."""

from __future__ import annotations

import torch

from nw_adapter.core.compare import compare_attention
from nw_adapter.experiments.synthetic_heads import (
    HEADS,
    augmented_nw_head,
    measure_heads,
    two_term_share,
)


def test_augmented_head_attention_is_the_data_space_nw_weights():
    q, k, scale = augmented_nw_head(torch.Generator().manual_seed(0), bandwidth=0.7)
    x, support = q[..., :-1], k[..., :-1]
    distances = (x[..., :, None, :] - support[..., None, :, :]).square().sum(-1)
    expected = torch.softmax(-distances / (2 * 0.7**2), dim=-1)
    torch.testing.assert_close(torch.softmax(scale * q @ k.transpose(-1, -2), dim=-1), expected)


def test_query_blind_head_clears_the_nulls_yet_loses_to_its_key_prior():
    """The false positive of rho: a head with no smoothing clears all nulls; nw_gain says no."""
    table = measure_heads(seeds=4)["query-blind (prefers the smallest key)"]
    mean = {name: sum(values) / len(values) for name, values in table.items()}
    assert mean["rho"] > mean["rho_spread_null"] + 0.1 and mean["rho"] > mean["rho_norm_matched_null"] + 0.1
    assert mean["r2_key"] > 0.8
    assert all(gain < 0 for gain in table["nw_gain"])


def test_exact_nw_head_gains_over_its_key_prior():
    gains = []
    for seed in range(6):
        q, k, scale = augmented_nw_head(torch.Generator().manual_seed(seed))
        gains.append(float(compare_attention(q, k, scale=scale)["nw_gain"].mean()))
    assert min(gains) > 0


def test_a_key_bias_plus_one_nw_term_explains_every_dot_product_head():
    for build in HEADS.values():
        q, k, scale = build(torch.Generator().manual_seed(3))
        torch.testing.assert_close(two_term_share(q, k, scale), torch.ones(1, 2, dtype=torch.float64))
    q, k = torch.randn(3, 2, 64, 8, dtype=torch.float64), 3 * torch.randn(3, 2, 16, 8, dtype=torch.float64)
    torch.testing.assert_close(two_term_share(q, k, 0.2), torch.ones(3, 2, dtype=torch.float64))
