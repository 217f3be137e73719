"""Verdicts decided from intervals: each passes on a table with the effect and fails without it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nw_adapter.experiments.inference import bootstrap_means, cluster_means, gain_interval, holm
from nw_adapter.experiments.verdicts import (
    benefit_vanishes,
    learned_wins_small_m,
    neff_falls,
    plugin_catches_up,
    plugin_worse,
)


def _dims(*entries):
    return [{"d": d, "benefit": b, "benefit_ci": ci} for d, b, ci in entries]


def test_benefit_vanishes_passes_only_with_a_clear_fall_to_zero():
    real = _dims((2, 0.50, (0.35, 0.62)), (4, 0.20, (0.05, 0.3)), (16, 0.01, (-0.06, 0.08)))
    assert benefit_vanishes(real)["appeared"]
    # issue 10.9: a flat +9% -> +8% used to pass as "about 0 at the largest d"
    flat = _dims((2, 0.09, (0.06, 0.12)), (16, 0.08, (0.05, 0.11)))
    v = benefit_vanishes(flat)
    assert not v["appeared"] and "excludes 0" in v["evidence"]
    # compatible with 0 but so uncertain that it is not clearly below the small-d benefit
    vague = _dims((2, 0.30, (0.10, 0.50)), (16, 0.05, (-0.3, 0.4)))
    assert not benefit_vanishes(vague)["appeared"]
    # no benefit anywhere: nothing to vanish
    none = _dims((2, 0.01, (-0.05, 0.06)), (16, 0.0, (-0.05, 0.05)))
    assert not benefit_vanishes(none)["appeared"]


def _digits(*entries):
    return [{"m": m, "advantage": a, "advantage_ci": ci} for m, a, ci in entries]


def test_learned_wins_needs_an_interval_above_zero():
    assert learned_wins_small_m(_digits((1, 0.8, (0.6, 0.9)), (10, 0.2, (0.05, 0.3))))["appeared"]
    noisy = _digits((1, 0.3, (-0.2, 0.6)), (10, 0.1, (-0.1, 0.3)), (25, 0.4, (0.2, 0.5)))
    assert not learned_wins_small_m(noisy)["appeared"]  # the only clear win is at m = 25 > 10


def test_catches_up_means_an_advantage_at_or_below_zero():
    real = _digits((1, 0.8, (0.6, 0.9)), (10, 0.3, (0.1, 0.4)), (25, -0.3, (-0.6, 0.1)))
    v = plugin_catches_up(real, 25)
    assert v["appeared"] and "m=25" in v["evidence"]
    # issue 10.9: +50% falling to +49% used to pass as "plug-in catches up"
    flat = _digits((1, 0.50, (0.40, 0.6)), (10, 0.495, (0.40, 0.6)), (50, 0.49, (0.39, 0.59)))
    assert not plugin_catches_up(flat)["appeared"]
    # an advantage that is <= 0 everywhere never was a win to catch up with
    never = _digits((1, -0.1, (-0.3, 0.1)), (50, -0.5, (-0.8, -0.2)))
    assert not plugin_catches_up(never)["appeared"]


def test_plugin_worse_needs_the_ratio_interval_above_the_threshold():
    assert plugin_worse([{"d": 8, "ratio": 7.0, "ratio_ci": (5.0, 9.0)}])["appeared"]
    assert not plugin_worse([{"d": 8, "ratio": 2.5, "ratio_ci": (1.1, 4.0)}])["appeared"]
    assert not plugin_worse([{"d": 8, "ratio": 1.0, "ratio_ci": (0.9, 1.1)}])["appeared"]


def test_neff_falls_both_ways():
    assert neff_falls([{"d": 2, "neff": 9.0}, {"d": 16, "neff": 1.2}])["appeared"]
    assert not neff_falls([{"d": 2, "neff": 5.0}, {"d": 16, "neff": 4.9}])["appeared"]


def test_bootstrap_interval_covers_zero_without_an_effect_and_excludes_it_with_one():
    rng = np.random.default_rng(0)
    base = 1.0 + 0.2 * rng.standard_normal((3, 32))
    same = base + 0.05 * rng.standard_normal((3, 32))
    lo, hi = gain_interval(base, same)
    assert lo < 0 < hi
    lo, hi = gain_interval(base, 0.5 * base)
    assert lo == pytest.approx(0.5) and hi == pytest.approx(0.5)
    # clusters are the resampled units: with 3 clusters the interval spans their spread
    tasks = np.repeat([1.0, 2.0, 3.0], 10)
    clusters = np.repeat([7, 8, 9], 10)
    mb, mn = bootstrap_means(tasks, tasks * 0.5, clusters=clusters, resamples=500)
    assert mb.min() >= 1.0 and mb.max() <= 3.0 and np.allclose(mn, 0.5 * mb)
    assert len(np.unique(np.round(mb, 9))) <= 10  # 10 distinct multisets of 3 clusters
    assert np.allclose(cluster_means(tasks, clusters), [1.0, 2.0, 3.0])


def test_holm():
    adj = holm([0.01, 0.04, math.nan, 0.03])
    assert adj[0] == pytest.approx(0.03) and adj[3] == pytest.approx(0.06) and adj[1] == pytest.approx(0.06)
    assert math.isnan(adj[2])
