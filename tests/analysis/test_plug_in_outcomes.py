"""The outcome study's readings, summaries and figures (analysis/plug_in_outcomes.py), and one real
set on the tiny SD 1.5 digits model: the plug-in copies its references, the smoothed one does not."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_figures import assert_printable

from nw_adapter.analysis.plug_in_outcomes import (
    ARMS,
    OutcomeSet,
    attention_posterior_figure,
    outcome_figure,
    paired_differences,
    run_set,
    set_metrics,
    summarise,
    x0_figure,
    x0_table,
)


def test_set_metrics_of_constructed_latents():
    support = torch.tensor([[0.0, 0.0], [10.0, 0.0]])
    latents = torch.tensor([[0.0, 3.0], [10.0, 4.0], [0.0, 0.0]])
    got = set_metrics(latents, support, [True, False, None])
    pairwise = [math.hypot(10, 1), 3.0, math.hypot(10, 4)]
    assert got["diversity"] == pytest.approx(np.mean(pairwise))
    assert got["nearest"] == pytest.approx((3 + 4 + 0) / 3)
    assert got["class_kept"] == 0.5  # the unjudged seed does not count
    assert math.isnan(set_metrics(latents[:1], support, [None])["diversity"])  # one seed: no diversity


def _result(m: int, kind: str, shift: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    arms = {
        arm: {"class_kept": 0.5, "diversity": 5.0 + i + rng.normal(0, 0.1), "nearest": 10.0 - 3 * i + shift}
        for i, arm in enumerate(ARMS)
    }
    steps = [{"step": s, "h_schedule": 10.0 * 0.5**s, "x0_nw_ratio": 1.0 + 0.01 * s, "x0_nw_distance": 9.0,
              "posterior_entropy_share": max(0.0, 1 - 0.3 * s), "mass": [0.5, 0.5], "posterior": [0.9, 0.1]}
             for s in range(6)]  # fmt: skip
    return {"key": f"m{m}-{kind}-{seed}", "kind": kind, "m": m, "labels": [1] * m, "tau": 0.7, "arms": arms,
            "steps": steps}  # fmt: skip


def test_summaries_are_over_sets_and_differences_paired():
    results = [_result(2, "mixed", shift, seed) for seed, shift in enumerate((0.0, 1.0, 2.0))]
    rows = summarise(results)
    assert [r["arm"] for r in rows] == list(ARMS) and all(r["sets"] == 3 for r in rows)
    learned = rows[0]["nearest"]
    assert learned["mean"] == pytest.approx(11.0) and learned["low"] < 10.0 < 12.0 < learned["high"]
    diffs = paired_differences(results)
    plug_in = next(r for r in diffs if r["arm"] == "plug-in - learned")
    # every set's plug-in is exactly 3 nearer than its learned arm: the paired interval has no width
    assert plug_in["nearest"]["mean"] == pytest.approx(-3.0)
    assert plug_in["nearest"]["low"] == pytest.approx(-3.0) == plug_in["nearest"]["high"]
    table = x0_table(results, bins=(1.0, 5.0))
    assert [(r["h_low"], r["h_high"]) for r in table] == [(0.0, 1.0), (1.0, 5.0), (5.0, math.inf)]
    assert table[0]["x0_nw_ratio"]["mean"] == pytest.approx(1.045)  # steps 4, 5 (h = 0.625, 0.3125)


def test_the_figures_fit_their_page():
    results = [_result(m, kind, 0.1 * seed, seed) for m in (1, 2, 4) for kind in ("same", "mixed")
               for seed in range(3) if m > 1 or kind == "same"]  # fmt: skip
    models = {"tiny SD 1.5 digits": results, "tiny Flux digits": results}
    for fig in (outcome_figure({k: summarise(v) for k, v in models.items()}), x0_figure(models),
                attention_posterior_figure(models)):  # fmt: skip
        assert_printable(fig, max_width=7.0)


@pytest.fixture(scope="module")
def digits():
    from nw_adapter.models.loaders import load_tiny_digits

    return load_tiny_digits()


def test_one_set_on_the_digits_model_the_plug_in_copies_and_the_smoothed_field_does_not(digits):
    from nw_adapter.models.digits_quality import digit_judge
    from nw_adapter.models.loaders import tiny_digit_image

    images = [tiny_digit_image(3), tiny_digit_image(7)]
    outcome = OutcomeSet("pair", "mixed", images, [3, 7], [tiny_digit_image(3), tiny_digit_image(7)])
    result = run_set(digits, outcome, seeds=[0, 1], tau=0.5, judge=digit_judge(),
                     learned_call={"prompt": "a photograph", "num_inference_steps": 4},
                     field_call={"prompt": "", "num_inference_steps": 20, "guidance_scale": 1.0})  # fmt: skip
    arms = result["arms"]
    assert set(arms) == set(ARMS)
    assert arms["plug-in"]["nearest"] < 0.7  # a copy, up to the last step's noise (about 0.47)
    assert arms["plug-in"]["class_kept"] == 1.0  # copies of a 3 or a 7 keep their class
    assert 6.0 < arms["plug-in, tau fitted"]["nearest"] < 10.0  # tau sqrt(D) = 0.5 x 16 from a reference
    assert arms["held-out data"]["nearest"] == 0.0 and math.isnan(arms["held-out data"]["class_kept"])
    assert arms["learned"]["nearest"] > 2.0  # the adapter makes new digits, no copies
    assert {s["seed"] for s in result["steps"]} == {0, 1} and all("posterior" in s for s in result["steps"])
