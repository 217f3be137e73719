"""observe_support_set: the attention per reference beside the theory's latent posterior, the learned
x0 against the plug-in's, the generated latent's nearest reference; refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nw_adapter.analysis.support_sets import observe_support_set


@pytest.fixture(scope="module")
def digits():
    from nw_adapter.models.loaders import load_tiny_digits

    return load_tiny_digits()


@pytest.fixture(scope="module")
def three_seven():
    from nw_adapter.models.loaders import tiny_digit_image

    return [tiny_digit_image(3), tiny_digit_image(7)]


CALL = {"prompt": "a photograph", "num_inference_steps": 6}


def test_the_run_is_stock_and_reads_the_posterior_per_step_and_half(digits, three_seven):
    seen = []

    def own(pipe, step, timestep, tensors):
        seen.append(step)
        return {}

    run = observe_support_set(digits, three_seven, seed=3, callback_on_step_end=own, **CALL)
    stock = digits(ip_adapter_image=[three_seven], generator=torch.Generator().manual_seed(3), **CALL).images[
        0
    ]
    assert np.array_equal(np.asarray(run.image), np.asarray(stock))  # observe and probe change nothing
    assert seen == list(range(len(seen))) and seen  # the caller's callback still runs, after the probe's
    assert run.probe_errors == 0
    halves = {r["half"] for r in run.latent_steps}
    assert halves == {"uncond", "cond"}
    by_step: dict[int, dict[str, list[float]]] = {}
    for r in run.latent_steps:
        assert sum(r["posterior"]) == pytest.approx(1.0) and 1.0 <= r["posterior_n_eff"] <= 2.0 + 1e-12
        by_step.setdefault(r["step"], {})[r["half"]] = r["posterior"]
    for halves_of_step in by_step.values():  # both halves see the same x_t: the same posterior
        assert halves_of_step["uncond"] == halves_of_step["cond"]
    assert [s["step"] for s in run.steps] == sorted(by_step)
    assert {s["step"] for s in run.steps} == {r["step"] for r in run.records if r["half"] == "cond"}
    last = run.steps[-1]
    assert max(last["posterior"]) > 1 - 1e-6  # h_t -> 0: one reference
    assert run.posterior_winner == last["posterior_favoured"] is not None
    assert len(run.final_distances) == 2 and run.final_nearest in (0, 1)
    assert all(math.isfinite(s["x0_nw_ratio"]) and s["x0_nw_ratio"] > 0.05 for s in run.steps[2:])  # learned


def test_identical_references_share_the_posterior_exactly(digits, three_seven):
    run = observe_support_set(digits, [three_seven[0], three_seven[0]], seed=0, **CALL)
    assert all(r["posterior"] == [0.5, 0.5] for r in run.latent_steps)
    assert run.posterior_winner is None and run.final_distances[0] == run.final_distances[1]


def test_the_flux_posterior_is_even_at_pure_noise(three_seven):
    from nw_adapter.models.loaders import TINY_FLUX_DIGITS_CALL, load_tiny_flux_digits

    call = {"prompt": "a photograph", "num_inference_steps": 3, **TINY_FLUX_DIGITS_CALL}
    run = observe_support_set(load_tiny_flux_digits(), three_seven, **call)
    first = run.steps[0]
    assert first["posterior"] == [0.5, 0.5] and first["posterior_entropy_share"] == pytest.approx(1.0)
    assert {r["half"] for r in run.latent_steps} == {"cond"}  # one pass per step without true CFG


def test_zero_steps_and_a_judge_with_the_wrong_count_are_refused(digits, three_seven):
    with pytest.raises(ValueError, match="num_inference_steps must be a whole number >= 1, got 0"):
        observe_support_set(digits, three_seven, num_inference_steps=0)
    with pytest.raises(ValueError, match="reference 1 is NoneType; pass a PIL image"):
        observe_support_set(digits, [three_seven[0], None], prompt="a", num_inference_steps=1)
    with pytest.raises(ValueError, match="the judge returned 1 labels for 3 images"):
        observe_support_set(digits, three_seven, judge=lambda images: [0], prompt="a", num_inference_steps=1)


def test_an_exception_in_the_call_removes_every_hook_and_processor(digits, three_seven):
    processors = dict(digits.unet.attn_processors)
    hooks = (len(digits.unet._forward_pre_hooks), len(digits.unet._forward_hooks))

    def boom(pipe, step, timestep, tensors):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        observe_support_set(digits, three_seven, callback_on_step_end=boom, **CALL)
    assert (len(digits.unet._forward_pre_hooks), len(digits.unet._forward_hooks)) == hooks
    assert all(digits.unet.attn_processors[name] is p for name, p in processors.items())


def test_a_report_of_runs_from_python_shows_their_sets_images_and_settings(digits, three_seven, tmp_path):
    """nw_adapter.report of observe_support_set's runs: the command line's support-set page, the
    references and generations from memory; runs of other settings are refused in one line."""
    import base64
    import io
    import re

    from PIL import Image

    import nw_adapter

    runs = [observe_support_set(digits, three_seven, seed=seed, **CALL) for seed in (0, 1)]
    assert runs[0].references == three_seven and runs[0].settings["num_inference_steps"] == 6
    page = nw_adapter.report(runs)
    html = page.save(tmp_path / "report.html").read_text(encoding="utf-8")
    assert "support sets:" in html and "2 sets" in html
    assert "6 steps (PNDMScheduler), seed 0, 1" in html
    assert html.count('<div class="card support">') == 2
    pictures = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    decoded = [Image.open(io.BytesIO(base64.b64decode(p))) for p in pictures]
    assert (
        len([picture for picture in decoded if picture.size[0] > 1]) == 6
    )  # per set: 2 references, 1 generation
    assert "reference 0" in html and "reference 1" in html and "reference reference" not in html
    assert nw_adapter.report(runs[0]).title.endswith("1 set")
    other = observe_support_set(digits, three_seven, seed=0, prompt="a photograph", num_inference_steps=2)
    with pytest.raises(ValueError, match="support-set run 1 ran with other settings than run 0"):
        nw_adapter.report([runs[0], other])
