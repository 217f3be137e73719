"""Smoke tests of the end-to-end control's benchmark scripts (toy sizes, no timed assertions)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:  # `benchmarks/` is not installed: make it importable under plain `pytest` too
    sys.path.insert(0, ROOT)

from benchmarks import end_to_end_control, end_to_end_readings  # noqa: E402

torch.set_num_threads(1)


def test_cost_harness_runs_every_variant() -> None:
    results = end_to_end_control.measure(steps=1, repeats=1)
    assert set(end_to_end_control.VARIANTS) <= set(results)
    assert results["observe"]["ratio"] == 1.0
    assert "e2e_k3" in end_to_end_control.table(results, 1)


def test_readings_per_layer_and_end_to_end_agree_where_the_queries_are_the_same() -> None:
    """One step: the first IP layer's queries are the same in both controls (no branch has acted),
    the keys too in every layer (same seed), so its rho and every layer's key-norm CV agree."""
    result = end_to_end_readings.measure(steps=1, digits=2)
    first_layer = next(iter(result["rho_e2e_minus_per_layer_by_layer"].values()))
    assert first_layer == pytest.approx([0.0, 0.0], abs=1e-6)
    for row in result["per_reference"]:
        assert row["key_norm_cv_e2e"] == pytest.approx(row["key_norm_cv_per_layer"], rel=1e-6)
        assert math.isfinite(row["log_key_scale"])
    later = list(result["rho_e2e_minus_per_layer_by_layer"].values())[1:]
    assert any(abs(g) > 1e-4 for gaps in later for g in gaps)  # later layers: the queries differ
    assert "key scale" in end_to_end_readings.table(result)


def test_calibration_cost_harness_runs_both_variants() -> None:
    from benchmarks import calibration_cost

    results = {"tiny": calibration_cost.measure("tiny", steps=1, repeats=1)}
    assert (
        set(calibration_cost.VARIANTS) <= set(results["tiny"]) and results["tiny"]["observe"]["ratio"] == 1.0
    )
    assert "calibrate" in calibration_cost.table(results, 1)
