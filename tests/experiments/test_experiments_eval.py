"""Evaluation: the plug-in reproduces a dense support, MMD/n_eff plumbing, paired tests, heads."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nw_adapter.experiments.evaluation import (
    EvalConfig,
    benefit,
    evaluate_methods,
    neff_on_path,
    paired_tests,
)
from nw_adapter.experiments.fields import model_field, plugin_field
from nw_adapter.experiments.heads import analyse_heads
from nw_adapter.experiments.model import ICFMConfig
from nw_adapter.experiments.tasks import GaussianMixtureFamily, TaskBatch
from nw_adapter.experiments.training import build_model


def test_plugin_reproduces_a_dense_support():
    fam = GaussianMixtureFamily(2)
    tasks = fam.sample(2, 400, 300, generator=torch.Generator().manual_seed(0))
    shifted = TaskBatch(tasks.support, tasks.target + 10.0)
    cfg = EvalConfig(num_generated=300, grid_points=60)
    plug = {"plugin": lambda s, mk: plugin_field(s, mk)}
    good = evaluate_methods(plug, tasks, cfg)
    bad = evaluate_methods(plug, shifted, cfg)
    assert good["plugin"]["mmd2_median"].max() < 0.03  # sampling noise at n = 300 is ~0.005-0.01
    assert bad["plugin"]["mmd2_median"].min() > 20 * good["plugin"]["mmd2_median"].max()
    # the plug-in's samples land on support points (empirical target), up to ~sigma_min
    from nw_adapter.core.sampling import sample_ode, time_grid

    x = sample_ode(plugin_field(tasks.support), torch.randn(2, 100, 2), time_grid(100))
    nearest = torch.cdist(x, tasks.support).min(-1).values
    assert float(nearest.median()) < 0.1


def test_neff_limits():
    tasks = GaussianMixtureFamily(2).sample(3, 20, 50, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    assert torch.allclose(
        neff_on_path(tasks, 1e-4, sigma_min=0.01, generator=g), torch.full((3,), 20.0), atol=0.05
    )
    assert float(neff_on_path(tasks, 1.0, sigma_min=0.01, generator=g).max()) < 1.5
    masked = TaskBatch(tasks.support, tasks.target, torch.arange(20)[None].expand(3, 20) < 5)
    assert torch.allclose(
        neff_on_path(masked, 1e-4, sigma_min=0.01, generator=g), torch.full((3,), 5.0), atol=0.05
    )


def test_evaluate_methods_is_paired_and_deterministic():
    tasks = GaussianMixtureFamily(3).sample(3, 10, 16, generator=torch.Generator().manual_seed(3))
    model = build_model(ICFMConfig(dim=3, d_model=8, num_heads=2, num_layers=1), 0)
    methods = {"a": lambda s, mk: model_field(model, s, mk), "b": lambda s, mk: model_field(model, s, mk)}
    cfg = EvalConfig(num_generated=16, grid_points=5, batch_tasks=2)
    r1, r2 = evaluate_methods(methods, tasks, cfg), evaluate_methods(methods, tasks, cfg)
    assert np.array_equal(r1["a"]["mmd2_median"], r1["b"]["mmd2_median"])  # same noise for every method
    assert np.array_equal(r1["a"]["mmd2_fixed"], r2["a"]["mmd2_fixed"])
    assert r1["neff"].shape == (3,) and r1["sigma_fixed"].shape == (3,)


def test_benefit_and_paired_tests():
    assert benefit(2.0, 1.5) == pytest.approx(0.25)
    assert math.isnan(benefit(0.0, 1.0))
    b = np.arange(10.0)
    a = b + 1.0 + 0.1 * np.sin(b)
    res = paired_tests(a, b)
    assert res["n"] == 10 and res["mean_diff"] == pytest.approx(np.mean(a - b))
    assert res["wilcoxon_p"] < 0.01 and res["t_p"] < 1e-6
    assert paired_tests(b + 1.0, b)["mean_diff"] == 1.0  # constant differences: no warning escapes
    assert math.isnan(paired_tests(np.ones(1), np.zeros(1))["t_p"])
    with pytest.raises(ValueError, match="shape"):
        paired_tests(np.ones(2), np.ones(3))


def test_head_analysis_rows():
    tasks = GaussianMixtureFamily(2).sample(2, 12, 10, generator=torch.Generator().manual_seed(4))
    model = build_model(ICFMConfig(dim=2, d_model=8, num_heads=2, num_layers=2), 0)
    rows = analyse_heads(model, tasks, (0.3, 0.9))
    assert len(rows) == 2 * 2 * 2
    for r in rows:
        for key in ("rho_head", "rho_data", "rho_null"):
            assert -1.0 <= r[key] <= 1.0
        assert 1.0 <= r["neff_attn"] <= 12.0
    assert rows[0]["h_data"] == pytest.approx((1 - 0.99 * 0.3) / 0.3)
    with pytest.raises(ValueError, match="times"):
        analyse_heads(model, tasks, (0.0,))


def test_fixed_sigma_is_the_median_pairwise_distance_of_all_targets():
    from scipy.spatial.distance import pdist

    from nw_adapter.experiments.evaluation import fixed_sigma

    gen = torch.Generator().manual_seed(5)
    target = torch.randn(2, 10, 3, generator=gen, dtype=torch.float64)  # 45 pairs: an odd count, one median
    expected = [np.median(pdist(target[i].numpy())) for i in range(2)]
    assert np.allclose(fixed_sigma(target).numpy(), expected)
