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
from nw_adapter.analysis import consequence
from nw_adapter.analysis.consequence import SwapComparison, compare_swap, encode_images, t_interval
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
        np.testing.assert_array_equal(result.seed_images[index], other)  # kept for the report
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


def test_kept_size_keeps_small_images_and_measures_the_full_ones(pipe, references):
    """The command line keeps thumbnails for its report; the numbers are those of the full images."""
    common = {"rules": (2.0,), "num_inference_steps": 1}
    small = compare_swap(pipe, references[:2], kept_size=16, **common)
    full = compare_swap(pipe, references[:2], **common)
    assert small.per_reference == full.per_reference
    for images in (small.stock_images, small.seed_images, small.swap_images[2.0]):
        assert [image.shape for image in images] == [(16, 16, 3)] * 2
        assert all(image.dtype == np.float32 and 0.0 <= image.min() <= image.max() <= 1.0 for image in images)
    assert full.stock_images[0].shape == (32, 32, 3)


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
        (  # one content twice (two PIL objects): the unit would count twice
            {"references": [tiny_digit_image(3), tiny_digit_image(5), tiny_digit_image(3)]},
            r"references 0 and 2 are the same image \(identical RGB pixels\)",
        ),
        (  # the same pixels as RGBA: the image the encoder sees is the same
            {"references": [tiny_digit_image(3), tiny_digit_image(3).convert("RGBA")]},
            "references 0 and 1 are the same image",
        ),
        ({"rules": ("matched", "sharpest")}, "unknown rule 'sharpest'"),
        ({"rules": ("matched", "matched")}, "repeated rule"),
        ({"labels": [3]}, "labels without a judge"),
        ({"judge": lambda images: [0] * len(images)}, "a judge without labels"),
        ({"judge": lambda images: [0] * len(images), "labels": [3, 7, 1]}, "3 labels for 1 references"),
        ({"num_inference_steps": 0}, "num_inference_steps must be 1 or more, got 0"),
        ({"num_inference_steps": 2.5}, "num_inference_steps must be an integer"),
        ({"seed": "1"}, "seed must be an integer"),
        ({"generator": torch.Generator()}, "generator= is not accepted: .* pass seed="),
        ({"latents": torch.zeros(1, 4, 4, 4)}, "latents= is not accepted"),
        ({"output_type": "pil"}, "output_type= is not accepted"),
        ({"ip_adapter_image": tiny_digit_image(1)}, "ip_adapter_image= is not accepted"),
        (  # stock and one swap: two images to judge
            {"judge": lambda images: [3], "labels": [3], "rules": ("matched",)},
            r"judge= returned 1 label\(s\) for 2 images",
        ),
        (
            {"judge": lambda images: 3, "labels": [3]},
            "judge= returned a value of type int, not a list of labels",
        ),
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


# ---- the summary's intervals, conclusion and legend, on constructed rows (no model) ----


def _rows(clip_i_change: list[float], abs_diff: list[float], other_seed: list[float], rule="matched") -> list:
    return [
        {
            "reference": index,
            "rule": rule,
            "abs_diff": diff,
            "abs_diff_other_seed": seed,
            "clip_i_stock": 0.9,
            "clip_i_swap": 0.9 + change,
            "clip_i_change": change,
        }
        for index, (change, diff, seed) in enumerate(zip(clip_i_change, abs_diff, other_seed, strict=True))
    ]


def _comparison(rows: list, rules=("matched",)) -> SwapComparison:
    return SwapComparison(rules=tuple(rules), per_reference=rows, embedding="image_embeds", settings={})


@pytest.mark.parametrize("n", [2, 3])
def test_intervals_stay_inside_what_the_quantity_can_take(n):
    """Two or three spread references: the plain t interval leaves [0, 1] and [-1, 1]; these do not."""
    change = [-0.9, 0.05, 0.0][:n]
    rows = _rows(change, [0.001, 0.4, 0.01][:n], [0.002, 0.3, 0.02][:n])
    for row, value in zip(rows, [0.95, -0.2, 0.9], strict=False):
        row["clip_i_stock"] = value
        row["clip_i_swap"] = value + row["clip_i_change"]
    (summary,) = _comparison(rows).summary()
    for column, (low, high) in consequence.RANGES.items():
        assert low <= summary[f"{column}_low"] <= summary[column] <= summary[f"{column}_high"] <= high, column
    assert summary["abs_diff_low"] >= 0.0 and summary["clip_i_stock_high"] <= 1.0
    _, t_low, _ = t_interval([row["abs_diff"] for row in rows])
    assert t_low < 0.0  # the case the cut is for


def _beta_on(low: float, high: float, a: float, b: float):
    mean = low + (high - low) * a / (a + b)
    return (lambda rng, size: low + (high - low) * rng.beta(a, b, size)), mean, (low, high)


# Shapes like the measurements (README: mean |diff| 0.05 with sd 0.04, CLIP-I 0.88 with sd 0.085),
# the uniform as an unskewed one, and changes: two alike arms, or a drop in one arm only.
SHAPES = {
    "log": {
        "mean |diff| beta(1.4, 24)": _beta_on(0, 1, 1.37, 24),
        "mean |diff| beta(5, 40)": _beta_on(0, 1, 5, 40),
        "uniform": _beta_on(0, 1, 1, 1),
        "CLIP-I beta(28.5, 1.8) on [-1, 1]": _beta_on(-1, 1, 28.5, 1.8),
        "CLIP-I beta(20, 2) on [-1, 1]": _beta_on(-1, 1, 20, 2),
    },
    "t": {
        "swap - seed, alike arms": (
            lambda rng, size: rng.beta(1.37, 24, size) - rng.beta(5, 40, size),
            1.37 / 25.37 - 5 / 45,
            (-1.0, 1.0),
        ),
        "CLIP-I change, alike arms": (
            lambda rng, size: 2 * rng.beta(28.5, 1.8, size) - 2 * rng.beta(40, 3, size),
            2 * 28.5 / 30.3 - 2 * 40 / 43,
            (-2.0, 2.0),
        ),
    },
}
CASES = [(method, shape) for method, shapes in SHAPES.items() for shape in shapes]


@pytest.mark.parametrize("n", [2, 3, 10])
@pytest.mark.parametrize(("method", "shape"), CASES)
def test_bounded_interval_covers_at_least_93_percent(method, shape, n):
    """Coverage by simulation (20000 samples of n references, fixed seed) at nominal 95%."""
    sampler, true_mean, bounds = SHAPES[method][shape]
    samples = sampler(np.random.default_rng(n), (20000, n))
    mean, low, high = consequence.bounded_interval(samples, bounds, method)
    assert np.all((bounds[0] <= low) & (low <= mean) & (mean <= high) & (high <= bounds[1]))
    assert np.mean((low <= true_mean) & (true_mean <= high)) >= 0.93
    one = consequence.bounded_interval(samples[0], bounds, method)  # a 1-D sample gives the same floats
    assert one == pytest.approx((mean[0], low[0], high[0])) and isinstance(one[1], float)


def test_plain_t_interval_would_not_cover_the_skewed_shapes():
    """Why the log scale: the Student t interval covers a mean |diff| shaped like the README's less
    often than it claims (under 93% at 3 references)."""
    sampler, true_mean, _ = SHAPES["log"]["mean |diff| beta(1.4, 24)"]
    samples = sampler(np.random.default_rng(3), (20000, 3))
    _, low, high = consequence.bounded_interval(samples, (0.0, 1.0), "t")
    assert np.mean((low <= true_mean) & (true_mean <= high)) < 0.93


def test_bounded_interval_on_the_bound_falls_back_to_t_and_stays_inside():
    mean, low, high = consequence.bounded_interval([0.0, 0.02, 0.04], (0.0, 1.0), "log")
    t_mean, t_low, t_high = t_interval([0.0, 0.02, 0.04])
    assert (mean, low, high) == pytest.approx((t_mean, 0.0, t_high))
    assert consequence.bounded_interval([0.3, 0.3, 0.3], (0.0, 1.0), "log") == pytest.approx((0.3, 0.3, 0.3))


def test_one_reference_has_no_interval_and_says_too_few():
    comparison = _comparison(_rows([-0.2], [0.05], [0.1]))
    (summary,) = comparison.summary()
    assert math.isnan(summary["abs_diff_low"]) and summary["change_vs_seed"] == "too few"
    table = comparison.table()
    assert "[too few]" in table and "nan" not in table
    assert "conclusion: too few references for intervals (fewer than 2)" in table


def test_conclusion_follows_from_the_intervals():
    rng = np.random.default_rng(0)
    noise = list(rng.normal(0.0, 0.01, 10))
    clear = _rows(
        [-0.2 + e for e in noise], [0.03 + abs(e) for e in noise], [0.10 + abs(e) for e in noise[::-1]]
    )
    none = _rows(
        [e * 5 for e in noise],
        [0.10 + abs(e) for e in noise],
        [0.10 + abs(e) for e in noise[::-1]],
        rule="fitted",
    )
    comparison = _comparison(clear + none, rules=("matched", "fitted"))
    matched, fitted = comparison.summary()
    assert (matched["change_vs_seed"], matched["clip_i_effect"]) == ("less", "lower")
    assert (fitted["change_vs_seed"], fitted["clip_i_effect"]) == ("unclear", "unclear")
    line = comparison.conclusion()
    assert "\n" not in line and line.startswith("conclusion (95% intervals over 10 references)")
    assert "moves the image less than a new seed does under matched" in line
    assert "cannot be told apart from a new seed's under fitted" in line
    assert "CLIP-I lower than stock under matched" in line and "no CLIP-I change shown under fitted" in line
    assert line in comparison.table()
    (only_clear,) = _comparison(clear).summary()
    assert "less than a new seed does under every rule" in consequence.conclusion([only_clear])
    more = _rows([0.2 + e for e in noise], [0.3 + abs(e) for e in noise], [0.1 + abs(e) for e in noise])
    assert "more than a new seed does" in _comparison(more).conclusion()
    assert "CLIP-I higher than stock" in _comparison(more).conclusion()


def test_table_names_its_units_and_explains_every_column(result):
    table = result.table()
    assert " px" not in table and "(0-1)" in table
    header = table.splitlines()[0]
    legend = table[table.index("columns:") :]
    for name in [*consequence.HEADERS.values(), "rule", "n", "stock keeps class", "swap keeps class"]:
        assert name in header
    for name in [
        "rule:",
        "n:",
        "|swap-stock| (0-1):",
        "|seed-stock| (0-1):",
        "swap - seed:",
        "CLIP-I stock / swap:",
        "CLIP-I change:",
        "stock / swap keeps class:",
    ]:
        assert name in legend, name
