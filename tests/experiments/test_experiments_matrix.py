"""The fix x regime matrix: gap shares, their intervals and the per-fix verdicts on built data.

The verdict must fail on data built to have no effect (a field equal to the plug-in up to noise),
and on a field that closes every regime's gap (not specific); it must appear for a field that
closes only its own regime's gap. Also the convergence criterion on built loss curves.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nw_adapter.experiments.fields import TRAINING_FREE, training_free_builders
from nw_adapter.experiments.matrix import aggregate_matrix, share_interval
from nw_adapter.experiments.scale import Scale
from nw_adapter.experiments.training import loss_plateau

TASKS, SEEDS = 40, 2
SCALE = Scale(dims=(2,), shell_dims=(8,), support_sizes=(1, 5, 10))


def _results(closes: dict[str, set[str]], seed: int = 0) -> dict:
    """Unit results where the learned OFF model halves the plug-in's MMD^2 everywhere and field
    ``name`` closes the whole gap in the regimes ``closes[name]`` and none elsewhere (noise only)."""
    rng = np.random.default_rng(seed)

    def noisy(base):
        return (base * (1 + 0.1 * rng.standard_normal(base.shape))).tolist()

    results = {}
    for regime, d in (("dims", 2), ("shells", 8)):
        plug = 0.01 * np.exp(0.3 * rng.standard_normal(TASKS))
        results[f"{regime}-d{d}-plugin"] = {"mmd2_median": plug.tolist()}
        results[f"{regime}-d{d}-fields"] = {
            "fields": {
                n: {"mmd2_median": noisy(plug * (0.5 if regime in closes.get(n, ()) else 1.0))}
                for n in TRAINING_FREE
            },
            "amortised_tau": 0.5,
            "loo_tau_mean": 0.4,
        }
        for s in range(SEEDS):
            results[f"{regime}-d{d}-s{s}-off"] = {"mmd2_median": noisy(plug * 0.5)}
            results[f"{regime}-d{d}-s{s}-on"] = {"mmd2_median": noisy(plug * 0.5)}
    classes = [7] * 10 + [8] * 10 + [9] * 10 + [6] * 10
    per_m_plug, per_m_fields, per_m_off = {}, {}, [{} for _ in range(SEEDS)]
    for m in (1, 5, 10):
        plug = 0.1 / m * np.exp(0.3 * rng.standard_normal(TASKS))
        per_m_plug[str(m)] = {"mmd2_median": plug.tolist()}
        per_m_fields[str(m)] = {
            "fields": {
                n: {"mmd2_median": noisy(plug * (0.5 if "digits" in closes.get(n, ()) else 1.0))}
                for n in TRAINING_FREE
            },
            "amortised_tau": 1.0,
            "loo_tau_mean": 0.8,
        }
        for s in range(SEEDS):
            per_m_off[s][str(m)] = {"mmd2_median": noisy(plug * 0.5)}
    # one cross-validated class fold holding every test class (the folds are concatenated anyway)
    results["digits-f0-plugin"] = {
        "per_m": {
            m: {**v, "mmd2_fixed": v["mmd2_median"], "neff": [1.0] * TASKS} for m, v in per_m_plug.items()
        },
        "task_classes": classes,
        "test_classes": sorted(set(classes)),
        "train_classes": [0, 1, 2],
    }
    results["digits-f0-fields"] = {"per_m": per_m_fields}
    for s in range(SEEDS):
        results[f"digits-f0-s{s}-off"] = {
            "per_m": {m: {**v, "mmd2_fixed": v["mmd2_median"]} for m, v in per_m_off[s].items()}
        }
    return results


def _verdicts(closes: dict[str, set[str]]) -> dict[str, dict]:
    mat = aggregate_matrix(_results(closes), SCALE)
    return {v["trend"].split()[0]: v for v in mat["verdicts"]}, mat


def test_no_effect_fields_do_not_appear_and_their_shares_cover_zero() -> None:
    verdicts, mat = _verdicts({})
    assert all(c["has_gap"] for c in mat["columns"])
    assert not any(v["appeared"] for v in verdicts.values())
    for name in TRAINING_FREE:
        for cell in mat["cells"][name]:
            assert cell["share_ci"][0] < 0.0  # a field equal to the plug-in closes nothing
            assert abs(cell["share"]) < 0.1
            assert not cell["beats_learned"]


def test_a_fix_that_closes_only_its_own_gap_appears() -> None:
    verdicts, mat = _verdicts({"local_cov": {"shells"}, "projected": {"dims"}, "amortised": {"digits"}})
    assert verdicts["local_cov"]["appeared"] and verdicts["projected"]["appeared"]
    assert verdicts["amortised"]["appeared"] and not verdicts["smoothed"]["appeared"]
    shells = [c["regime"] for c in mat["columns"]].index("shells")
    assert mat["cells"]["local_cov"][shells]["share"] == pytest.approx(1.0, abs=0.2)


def test_a_fix_that_closes_every_gap_is_not_specific() -> None:
    verdicts, _ = _verdicts({"smoothed": {"dims", "shells", "digits"}})
    assert verdicts["smoothed"]["closes_own"]
    assert not verdicts["smoothed"]["appeared"]
    assert verdicts["smoothed"]["closes_elsewhere"] == ["dims d=2", "shells d=8"]


def test_no_gap_no_share() -> None:
    results = _results({"projected": {"dims"}})
    results["dims-d2-s0-off"] = dict(results["dims-d2-plugin"])
    results["dims-d2-s1-off"] = dict(results["dims-d2-plugin"])
    mat = aggregate_matrix(results, SCALE)
    assert not mat["columns"][0]["has_gap"]
    assert np.isnan(mat["cells"]["projected"][0]["share"])
    verdict = next(v for v in mat["verdicts"] if v["trend"].startswith("projected"))
    assert not verdict["appeared"] and "no setting of dims has a gap" in verdict["evidence"]


def test_share_interval_of_a_field_better_than_learned_lies_above_one() -> None:
    rng = np.random.default_rng(1)
    plug = np.exp(rng.standard_normal(50))
    learned = (plug * 0.6)[None] * np.exp(0.05 * rng.standard_normal((3, 50)))
    better = plug * 0.2
    lo, hi = share_interval(plug, better, learned)
    assert 1.0 < lo <= 2.0 <= hi


def test_loss_plateau_flat_curve_converges_a_falling_or_too_noisy_one_does_not() -> None:
    """One meaning of converged: the 95% upper bound of the loss drop over the last 20% is < 2%."""
    rng = np.random.default_rng(0)
    flat = (1.0 + 0.03 * rng.standard_normal(2000)).tolist()
    res = loss_plateau(flat)
    assert res["converged"] and res["drop_upper"] < res["tolerance"] == 0.02
    falling = (np.linspace(2.0, 1.0, 2000) + 0.03 * rng.standard_normal(2000)).tolist()
    res = loss_plateau(falling)
    assert not res["converged"] and res["drop"] > 2 * res["drop_se"]
    # flat in expectation but too noisy to tell: not a failure to reject, so NOT converged
    noisy = (1.0 + 0.3 * (-1.0) ** np.arange(2000)).tolist()  # no trend, large scatter
    res = loss_plateau(noisy)
    assert abs(res["drop"]) < 2 * res["drop_se"] and not res["converged"]
    assert not loss_plateau([1.0] * 5)["converged"]


def test_training_free_builders_reject_padded_supports() -> None:
    builders = training_free_builders(0.5)
    support = torch.randn(2, 6, 3)
    field = builders["amortised"](support, None)
    assert torch.isfinite(field(torch.randn(2, 10, 3), torch.tensor(0.5))).all()
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, -1] = False
    with pytest.raises(ValueError, match="equal-size supports"):
        builders["smoothed"](support, mask)
