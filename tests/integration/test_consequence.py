"""compare_swap: stock vs swap generations of the trained tiny model, 2 references, 3 steps."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import binomtest, ttest_1samp

import nw_adapter
from nw_adapter import load_tiny_digits, tiny_digit_image
from nw_adapter.integration.consequence import SwapComparison, compare_swap, encode_images, t_interval
from nw_adapter.models.digits_quality import digit_judge

DIGITS = (3, 7)
RULES = ("matched", "median")
STEPS = 3


@pytest.fixture(scope="module")
def pipe():
    torch.set_num_threads(1)
    return load_tiny_digits()


@pytest.fixture(scope="module")
def references():
    return [tiny_digit_image(digit) for digit in DIGITS]


@pytest.fixture(scope="module")
def judge():
    return digit_judge()


@pytest.fixture(scope="module")
def result(pipe, references, judge):
    before = dict(pipe.unet.attn_processors)
    comparison = compare_swap(
        pipe, references, rules=RULES, num_inference_steps=STEPS, seed=5, judge=judge, labels=list(DIGITS)
    )
    after = dict(pipe.unet.attn_processors)
    assert before.keys() == after.keys() and all(after[name] is before[name] for name in before)
    return comparison


def test_shapes_of_the_result(result):
    assert isinstance(result, SwapComparison) and result.rules == RULES
    assert [(row["reference"], row["rule"]) for row in result.per_reference] == [
        (index, rule) for index in range(len(DIGITS)) for rule in RULES
    ]
    summary = result.summary()
    assert [row["rule"] for row in summary] == list(RULES) and all(row["n"] == len(DIGITS) for row in summary)
    assert result.embedding == "image_embeds"  # the tiny encoder is a CLIPVisionModelWithProjection
    assert result.to_dataframe().shape[0] == len(DIGITS) * len(RULES)
    table = result.table()
    assert all(rule in table for rule in RULES) and "Clopper-Pearson" in table and "Student t" in table
    assert len(result.stock_images) == len(DIGITS) and result.stock_images[0].shape == (32, 32, 3)


def _plain_call(pipe, reference, seed):
    return pipe(
        prompt="a photograph",
        ip_adapter_image=reference,
        num_inference_steps=STEPS,
        guidance_scale=7.5,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    ).images[0]


def test_stock_generation_is_bit_identical_to_a_plain_call(pipe, references, result):
    for index, reference in enumerate(references):
        own = np.clip(_plain_call(pipe, reference, 5 + index), 0.0, 1.0)
        np.testing.assert_array_equal(result.stock_images[index], own)
        # the seed control: the same reference from seed + n + i
        other = np.clip(_plain_call(pipe, reference, 5 + len(references) + index), 0.0, 1.0)
        row = result.per_reference[index * len(RULES)]
        assert row["abs_diff_other_seed"] == pytest.approx(float(np.abs(other - own).mean()))
        assert row["abs_diff_other_seed"] > 0


def test_swap_differs_from_stock_and_the_difference_is_the_stored_one(result):
    for row in result.per_reference:
        swap = result.swap_images[row["rule"]][row["reference"]]
        expected = np.abs(swap - result.stock_images[row["reference"]]).mean()
        assert row["abs_diff"] > 0 and row["abs_diff"] == pytest.approx(float(expected))


def test_clip_i_is_the_cosine_in_the_encoders_space(pipe, references, result):
    from PIL import Image

    for row in result.per_reference:
        assert -1.0 <= row["clip_i_stock"] <= 1.0 and -1.0 <= row["clip_i_swap"] <= 1.0
        assert row["clip_i_change"] == pytest.approx(row["clip_i_swap"] - row["clip_i_stock"])
    stock = Image.fromarray((result.stock_images[1] * 255).round().astype(np.uint8))
    embeds, _ = encode_images(pipe, [references[1], stock])
    cosine = torch.nn.functional.cosine_similarity(embeds[:1], embeds[1:]).item()
    assert result.per_reference[len(RULES)]["clip_i_stock"] == pytest.approx(cosine, abs=1e-6)


def test_agreement_counts_are_integers_within_n(result):
    for row in result.summary():
        for arm in ("stock", "swap"):
            kept = row[f"{arm}_kept"]
            assert isinstance(kept, int) and 0 <= kept <= row["n"]
            expected = sum(r[f"{arm}_keeps"] for r in result.per_reference if r["rule"] == row["rule"])
            assert kept == expected
            interval = binomtest(kept, row["n"]).proportion_ci(method="exact")
            assert (row[f"{arm}_kept_low"], row[f"{arm}_kept_high"]) == pytest.approx(
                (interval.low, interval.high)
            )


def test_a_judge_that_answers_one_class_keeps_only_that_class(pipe, references):
    comparison = compare_swap(
        pipe,
        references,
        rules=(2.0,),
        num_inference_steps=1,
        judge=lambda images: [DIGITS[0]] * len(images),
        labels=list(DIGITS),
        keep_images=False,
    )
    (row,) = comparison.summary()
    assert row["rule"] == 2.0 and row["stock_kept"] == 1 and row["swap_kept"] == 1
    assert comparison.stock_images == [] and comparison.swap_images == {2.0: []}


def test_t_interval_is_scipys_one_sample_interval():
    values = [0.2, 0.5, 0.1, 0.9]
    mean, low, high = t_interval(values)
    expected = ttest_1samp(values, 0.0).confidence_interval(0.95)
    assert mean == pytest.approx(np.mean(values)) and (low, high) == pytest.approx(
        (expected.low, expected.high)
    )
    assert t_interval([0.3, 0.3, 0.3]) == pytest.approx((0.3, 0.3, 0.3))
    assert all(math.isnan(x) for x in t_interval([0.3])[1:])


class _EncoderWithoutProjection(torch.nn.Module):
    """An image encoder whose output has no ``image_embeds`` (like ``CLIPVisionModel``)."""

    def forward(self, pixels: torch.Tensor) -> SimpleNamespace:
        hidden = pixels.flatten(2).transpose(1, 2)  # (N, H * W, 3)
        return SimpleNamespace(image_embeds=None, pooler_output=hidden[:, 0], last_hidden_state=hidden)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32


def test_encoder_without_projection_falls_back_to_pooler_output(pipe, references):
    fake = SimpleNamespace(
        feature_extractor=pipe.feature_extractor, image_encoder=_EncoderWithoutProjection()
    )
    embeds, name = encode_images(fake, references)
    assert name == "pooler_output" and embeds.shape == (len(references), 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"references": []}, "no references"),
        ({"references": [np.zeros((32, 32, 3))]}, "not a PIL image"),
        ({"rules": ("matched", "sharpest")}, "unknown rule 'sharpest'"),
        ({"rules": ("matched", "matched")}, "repeated rule"),
        ({"labels": [3]}, "labels without a judge"),
        ({"judge": lambda images: [0] * len(images)}, "a judge without labels"),
        ({"judge": lambda images: [0] * len(images), "labels": [3, 7, 1]}, "3 labels for 1 references"),
    ],
)
def test_bad_input_raises_one_line(pipe, kwargs, message):
    arguments = {"references": [tiny_digit_image(3)], "num_inference_steps": 1, **kwargs}
    with pytest.raises(ValueError, match=message) as error:
        compare_swap(pipe, **arguments)
    assert "\n" not in str(error.value)


def test_lazy_export():
    assert nw_adapter.compare_swap is compare_swap


def test_installed_processors_are_refused_not_silently_removed():
    from nw_adapter import (
        apply_nw_processor,
        compare_swap,
        load_tiny_digits,
        remove_nw_processor,
        tiny_digit_image,
    )

    pipe = load_tiny_digits()
    rec = apply_nw_processor(pipe, mode="observe")
    try:
        with pytest.raises(ValueError, match="NW processors are installed on this pipeline"):
            compare_swap(pipe, [tiny_digit_image(1)], rules=("matched",), num_inference_steps=1)
        from nw_adapter.integration.mixin import active_recorder

        assert active_recorder(pipe) is rec  # the user's installation is untouched
    finally:
        remove_nw_processor(pipe)
