"""What a head-space reading can and cannot establish (nw_adapter.experiments.head_space_limits)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from nw_adapter.core.compare import compare_attention
from nw_adapter.core.kernels import nw_logits, nw_weights
from nw_adapter.experiments.head_space_limits import (
    BANDWIDTHS,
    HEAD_FORMS,
    SUPPORT_GAINS,
    augmented_space,
    augmented_space_gap,
    bandwidth_path_slopes,
    exact_nw_head,
    log_log_slope,
    measure_bandwidth_sweep,
)

EPS = torch.finfo(torch.float64).eps


def _random_head(seed: int, dim: int = 16, keys: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = 3.0 * torch.randn(2, 3, 40, dim, generator=generator, dtype=torch.float64)
    norms = 0.1 + 4.0 * torch.rand(2, 3, keys, 1, generator=generator, dtype=torch.float64)
    return q, norms * torch.randn(2, 3, keys, dim, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scale", [0.05, 16**-0.5, 1.0])
@pytest.mark.parametrize("c_factor", [None, 1.0, 2.5])
def test_any_dot_product_head_is_an_nw_smoother_in_the_augmented_space(seed, scale, c_factor):
    q, k = _random_head(seed)
    c = None if c_factor is None else c_factor * float(k.square().sum(-1).max())
    u, v = augmented_space(q, k, c)
    assert u.shape[-1] == v.shape[-1] == q.shape[-1] + 1
    norms = v.square().sum(-1)
    assert torch.allclose(norms, norms[..., :1].expand_as(norms), rtol=1e-12)  # every key has norm C
    # logits of size scale (||q||^2 + C) / 2: the gap is float64 rounding of those
    size = scale * float((q.square().sum(-1).max() + norms.max()) / 2)
    assert augmented_space_gap(q, k, scale, c) <= 64 * EPS * max(size, 1.0)


@pytest.mark.parametrize("seed", range(4))
def test_without_the_augmentation_the_head_space_nw_weights_differ(seed):
    q, k = _random_head(seed)  # unequal key norms
    scale = 16**-0.5
    attention = torch.log_softmax(scale * q @ k.transpose(-1, -2), -1)
    head_space = torch.log_softmax(nw_logits(q, k, scale**-0.5, validate=False), -1)
    assert float((attention - head_space).abs().max()) > 1.0


def test_a_constant_below_the_largest_key_norm_is_refused():
    q, k = _random_head(0)
    with pytest.raises(ValueError, match="below the largest squared key norm"):
        augmented_space(q, k, 0.5 * float(k.square().sum(-1).max()))


@pytest.mark.parametrize("form", HEAD_FORMS)
@pytest.mark.parametrize("bandwidth", [0.25, 1.0, 4.0])
def test_both_forms_of_theorem_3s_head_are_the_data_space_nw_weights(form, bandwidth):
    q, k, scale = exact_nw_head(torch.Generator().manual_seed(3), bandwidth, form=form)
    generator = torch.Generator().manual_seed(3)  # the same draws as the head's
    support = torch.randn((1, 2, 4, 8), generator=generator, dtype=torch.float64)
    support = support * torch.tensor(SUPPORT_GAINS, dtype=torch.float64).view(1, 1, -1, 1)
    x = 1.5 * torch.randn((1, 2, 256, 8), generator=generator, dtype=torch.float64)
    attention = torch.softmax(scale * q @ k.transpose(-1, -2), -1)
    torch.testing.assert_close(attention, nw_weights(x, support, bandwidth), rtol=1e-9, atol=1e-12)


def test_an_unknown_form_or_bandwidth_is_refused():
    with pytest.raises(ValueError, match="form must be one of"):
        exact_nw_head(torch.Generator().manual_seed(0), 1.0, form="data")
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        exact_nw_head(torch.Generator().manual_seed(0), 0.0)


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folded_sweep():
    return measure_bandwidth_sweep(draws=10)


@pytest.fixture(scope="module")
def scaled_sweep():
    return measure_bandwidth_sweep(draws=10, form="scaled")


def test_the_head_space_readings_fail_theorem_3s_head_at_small_bandwidths(folded_sweep):
    """The defect of issue 26, measured: nw_gain < 0 for an exact NW head, h_eff falling with h."""
    share = folded_sweep.share_negative_gain()
    assert share[BANDWIDTHS.index(0.25)] == 1.0
    assert share[BANDWIDTHS.index(4.0)] == 0.0
    medians = folded_sweep.median_h_eff()
    assert medians[0] > 10 * medians[-1]  # h_eff falls as the true h rises 16-fold
    assert all(slope < -1.0 for slope in folded_sweep.h_eff_slopes())


def test_the_same_attention_in_another_head_space_reads_otherwise(folded_sweep, scaled_sweep):
    """Same logits, other q/k: nw_gain and h_eff change with the representation, logit_scale does not."""
    scaled = scaled_sweep
    assert scaled.share_negative_gain()[0] == 0.0 < folded_sweep.share_negative_gain()[0]
    assert all(slope > 0 for slope in scaled.h_eff_slopes())
    np.testing.assert_allclose(scaled.logit_scale, folded_sweep.logit_scale, rtol=1e-10)


@pytest.mark.parametrize("form", HEAD_FORMS)
@pytest.mark.parametrize("gains", [SUPPORT_GAINS, (1.0,) * 4, tuple(np.linspace(0.2, 3.0, 16))])
def test_logit_scale_follows_the_bandwidth_for_any_support_and_not_at_a_fixed_one(form, gains):
    schedule = tuple(np.geomspace(0.3, 6.0, 8))
    follows = bandwidth_path_slopes(3, schedule, form=form, gains=gains)
    fixed = bandwidth_path_slopes(3, schedule, fixed=1.0, form=form, gains=gains)
    np.testing.assert_allclose(follows, -2.0, atol=1e-9)
    np.testing.assert_allclose(fixed, 0.0, atol=1e-9)


@pytest.mark.parametrize("gain", [0.5, 3.0])
def test_a_constant_gain_on_the_queries_shifts_log_logit_scale_and_keeps_its_slope(gain):
    q, k, scale = exact_nw_head(torch.Generator().manual_seed(1), 1.0, form="scaled")
    plain = compare_attention(q, k, scale=scale)["logit_scale"]
    scaled = compare_attention(gain * q, k, scale=scale)["logit_scale"]
    torch.testing.assert_close(scaled.log() - plain.log(), torch.full_like(plain, math.log(gain)))


def test_log_log_slope_skips_what_is_not_a_positive_number():
    assert log_log_slope([1.0, 2.0, 4.0], [1.0, 0.25, 0.0625]) == pytest.approx(-2.0)
    assert log_log_slope([1.0, 2.0, 4.0], [1.0, math.nan, 0.0625]) == pytest.approx(-2.0)
    assert math.isnan(log_log_slope([1.0, 2.0], [1.0, math.nan]))


def test_the_script_prints_the_tables(capsys):
    import importlib.util

    path = REPO / "scripts" / "head_space_limits.py"
    spec = importlib.util.spec_from_file_location("head_space_limits_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--draws", "2"]) == 0
    out = capsys.readouterr().out
    assert "| folded | draws with nw_gain < 0 | 100% |" in out
    assert "augmented-space identity" in out
    with pytest.raises(SystemExit):
        script.main(["--draws", "1"])


def _row(values: list[float], pattern: str) -> str:
    return " | ".join(pattern.format(v) for v in values)


def test_the_published_numbers_are_the_measured_ones(folded_sweep, scaled_sweep):
    """THEORY.md's table and docs/verdict.md's sentence (the README's until it moved there) state what 10
    draws measure."""
    theory = (REPO / "docs" / "THEORY.md").read_text()
    readme = (REPO / "docs" / "verdict.md").read_text()
    for sweep in (folded_sweep, scaled_sweep):
        shares = _row([100 * v for v in sweep.share_negative_gain()], "{:.0f}%")
        medians = sweep.median_h_eff()
        slope = log_log_slope(sweep.bandwidths, medians)
        assert f"draws with nw_gain < 0 | {shares} |" in theory
        assert f"median h_eff | {_row(medians, '{:.3g}')} | {slope:+.2f} |" in theory
    share = folded_sweep.share_negative_gain()
    medians = folded_sweep.median_h_eff()
    slope = log_log_slope(folded_sweep.bandwidths, medians)
    assert (
        f"`nw_gain < 0` in {100 * share[0]:.0f}% of draws at\n  h = 0.25 and {100 * share[1]:.0f}% at h = 0.5"
        in readme
    )
    assert (
        f"(median {medians[0]:.0f} at\n  h = 0.25, {medians[-1]:.1f} at h = 4, log-log slope {slope:.2f})"
        in readme
    )
