"""Head analysis: ranks taken on logits (no underflow ties), population-std key-norm CV, baseline."""

from __future__ import annotations

import math

import pytest
import torch

from nw_adapter.core.kernels import nw_logits
from nw_adapter.core.paths import OTPath
from nw_adapter.experiments.heads import analyse_heads, head_statistics, key_norm_cv
from nw_adapter.experiments.model import AttentionRecord, ICFMConfig
from nw_adapter.experiments.tasks import GaussianMixtureFamily, TaskBatch
from nw_adapter.experiments.training import build_model


def _record(query: torch.Tensor, key: torch.Tensor, logits: torch.Tensor) -> AttentionRecord:
    return AttentionRecord(query, key, torch.softmax(logits, -1), logits)


def test_head_rho_is_the_same_for_every_bandwidth():
    # head space d_k = 64, 16 keys, attention = softmax(q.k / 8): in exact arithmetic rho does not
    # depend on the NW bandwidth; ranked as float32 weights it fell from 0.80 to 0.36 (issue 10.1)
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 40, 64), torch.randn(2, 3, 16, 64)
    logits = q @ k.transpose(-1, -2) / 8.0
    rec = _record(q, k, logits)
    data = torch.zeros(2, 1, 40, 16)
    rhos = [
        head_statistics(rec, data, head_bandwidth=h, generator=torch.Generator().manual_seed(1))["rho_head"]
        for h in (1e-3, 1e-2, 0.041, 0.3, 2.83, 1e2, 1e3)
    ]
    for r in rhos[1:]:
        assert torch.equal(r, rhos[0])
    assert float(rhos[0].min()) > 0.5  # and it is the well-conditioned value, not the tied one


def test_attention_monotone_in_distance_gives_rho_one_at_every_t():
    # an attention that is exactly monotone in data-space distance (here -||x_t / a - s||, no h)
    # must give rho = 1 and full top-1 agreement, even at t = 0.99 where the posterior weights
    # underflow in float32 (old values 0.99 / 0.74 / 0.49 / 0.30 at t = 0.56 / 0.85 / 0.95 / 0.99)
    tasks = GaussianMixtureFamily(4).sample(3, 30, 50, generator=torch.Generator().manual_seed(2))
    path = OTPath(0.01)
    g = torch.Generator().manual_seed(3)
    for t in (0.05, 0.56, 0.85, 0.95, 0.99):
        a, b = path.alpha(t), path.sigma(t)
        x_t = a * tasks.target + b * torch.randn(tasks.target.shape, generator=g)
        dist = torch.cdist((x_t / a).double(), tasks.support.double())  # [B, n, m]
        logits = (-dist)[:, None].expand(3, 2, 50, 30).float()
        rec = _record(torch.randn(3, 2, 50, 4), torch.randn(3, 2, 30, 4), logits)
        data = nw_logits((x_t / a).double(), tasks.support.double(), b / a)[:, None]
        stats = head_statistics(rec, data, generator=g)
        assert torch.allclose(stats["rho_data"], torch.ones(2, dtype=stats["rho_data"].dtype)), t
        assert torch.equal(stats["top1_data"], torch.ones(2)), t
        assert float(stats["rho_null"].abs().max()) < 0.1, t


def test_key_norm_cv_uses_the_population_std():
    key = torch.zeros(1, 2, 3)
    key[0, :, 0] = torch.tensor([1.0, 3.0])  # norms 1 and 3: mean 2, population std 1 (sample std 1.41)
    assert float(key_norm_cv(key)) == pytest.approx(0.5)


def test_analyse_heads_rows_and_refusals():
    tasks = GaussianMixtureFamily(2).sample(2, 12, 10, generator=torch.Generator().manual_seed(4))
    model = build_model(ICFMConfig(dim=2, d_model=8, num_heads=2, num_layers=2), 0)
    rows = analyse_heads(model, tasks, (0.3, 0.99))
    assert len(rows) == 2 * 2 * 2
    for r in rows:
        for key in ("rho_head", "rho_data", "rho_null", "rho_head_null", "top1_data"):
            assert -1.0 <= r[key] <= 1.0 and math.isfinite(r[key])
    padded = TaskBatch(tasks.support, tasks.target, torch.arange(12)[None].expand(2, 12) < 6)
    with pytest.raises(ValueError, match="full supports"):
        analyse_heads(model, padded, (0.3,))


def _unit_heads(rho_data: float) -> list[dict]:
    """A unit's head rows at two t, 2 layers x 2 heads, every head at ``rho_data``."""
    return [
        {"t": t, "h_data": 1.0, "layer": layer, "head": head, "rho_head": 0.9, "rho_data": rho_data,
         "neff_data_nw": 2.0}
        for t in (0.2, 0.9) for layer in range(2) for head in range(2)
    ]  # fmt: skip


def test_head_intervals_are_over_seeds_not_over_layers_and_heads() -> None:
    from scipy.stats import t as student_t

    from nw_adapter.experiments.aggregate import _heads_of

    units = [{"heads": _unit_heads(v), "heads_untrained": _unit_heads(0.0)} for v in (0.5, 0.7)]
    rows = _heads_of(units)
    half = student_t.ppf(0.975, 1) * 0.1  # s / sqrt(n) of 0.5 and 0.7: 2 seeds, 1 df
    for row in rows:
        assert row["seeds"] == 2 and row["rho_data_per_seed"] == [0.5, 0.7]
        assert row["rho_data_ci"] == pytest.approx([max(0.6 - half, -1), min(0.6 + half, 1)])
        assert row["untrained_rho_data_ci"] == [0.0, 0.0]  # equal seeds: a zero-width interval
    # one seed, however many layers and heads: not identified
    one = _heads_of(units[:1])
    assert all(math.isnan(v) for row in one for v in row["rho_data_ci"])
