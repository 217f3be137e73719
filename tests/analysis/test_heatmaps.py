"""DAAM-style heat maps per image token, from a recorder in memory (no file written)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nw_adapter import load_tiny_digits, nw_processor, tiny_digit_image
from nw_adapter.analysis.heatmaps import TokenHeatMaps, heat_maps


@pytest.fixture(scope="module")
def recorded():
    """The trained tiny model, 3 steps with maps of steps 0 and 2 kept in memory."""
    torch.set_num_threads(1)
    pipe = load_tiny_digits()
    reference = tiny_digit_image(3)
    with nw_processor(pipe, store_maps=True, map_steps=[0, 2], map_head_mean=False) as rec:
        image = pipe(
            "a photograph",
            ip_adapter_image=reference,
            num_inference_steps=3,
            generator=torch.Generator().manual_seed(0),
        ).images[0]
    return rec, image


def test_attention_maps_per_token_share_each_query_weight(recorded):
    rec, _ = recorded
    maps = rec.heat_maps("attn")  # the recorder's method is the module function
    np.testing.assert_array_equal(maps.values, heat_maps(rec, "attn").values)
    assert isinstance(maps, TokenHeatMaps) and maps.steps == (0, 2)
    tokens = maps.num_tokens
    assert maps.values.ndim == 3 and tokens == 4  # the base adapter's 4 image tokens
    # every query's attention sums to 1 over the image tokens, so the mean over tokens is 1/T
    np.testing.assert_allclose(maps.mean(), 1.0 / tokens, atol=2e-4)  # maps kept in float16
    assert maps.uniform == pytest.approx(1.0 / tokens)
    assert maps.dominant().shape == maps.values.shape[1:]
    normalized = maps.normalized()
    np.testing.assert_allclose(np.abs(normalized).reshape(tokens, -1).max(axis=1), 1.0)


def test_difference_is_attention_minus_nw_and_selection_narrows(recorded):
    rec, _ = recorded
    attn, nw, diff = (heat_maps(rec, k, steps=[2], layers=["up_blocks"]) for k in ("attn", "nw", "diff"))
    np.testing.assert_allclose(diff.values, attn.values - nw.values)
    assert diff.uniform == 0.0 and diff.steps == (2,)
    assert all(layer.startswith("up_blocks") for layer in diff.layers)
    head0 = heat_maps(rec, "attn", steps=[2], heads=[0])
    assert not np.allclose(head0.values, heat_maps(rec, "attn", steps=[2]).values)  # 2 heads differ


def test_an_unknown_step_names_the_stored_ones(recorded):
    rec, _ = recorded
    with pytest.raises(ValueError, match=r"steps=\[1\].*stored steps: 0, 2"):
        heat_maps(rec, "attn", steps=[1])
    with pytest.raises(ValueError, match="kind must be one of attn, nw, diff"):
        heat_maps(rec, "attention")


def test_overlay_draws_one_panel_per_token_over_the_image(recorded, tmp_path):
    rec, image = recorded
    maps = heat_maps(rec, "attn")
    fig = maps.plot_overlay(image, alpha=0.5)
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_title().startswith("token")]
    assert len(panels) == maps.num_tokens
    assert all(len(ax.get_images()) == 2 for ax in panels)  # the image beneath, the map above
    assert panels[0].get_images()[1].get_alpha() == 0.5
    fig.savefig(tmp_path / "overlay.png")
    assert (tmp_path / "overlay.png").stat().st_size > 0
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        maps.plot_overlay(image, alpha=2)
    with pytest.raises(IndexError, match="4 image tokens"):
        maps.plot_overlay(image, tokens=[7])


def test_a_recorder_without_maps_says_how_to_store_them():
    with pytest.raises(ValueError, match="store_maps=True"):
        heat_maps({}, "attn")


def synthetic_maps(heads: int = 2, rows: int = 2) -> dict[str, np.ndarray]:
    """One stored step of one layer: ``[rows, heads, 16 query positions (4 x 4), 4 tokens]``."""
    values = np.random.default_rng(0).dirichlet(np.ones(4), size=(rows, heads, 16))
    return {f"call0/step0/up_blocks.1.a/adapter0/image0/{kind}": values for kind in ("attn", "nw")}


@pytest.mark.parametrize(
    ("selection", "message"),
    [
        (
            {"heads": [5]},
            r"heads=\[5\]: 5 is not a stored head; the stored maps have 2 head\(s\), "
            r"positions 0\.\.1",
        ),
        ({"heads": [-1]}, r"heads=\[-1\]: -1 is not a stored head.*positions 0\.\.1"),  # was the last head
        ({"heads": []}, r"heads=\[\] selects no head; pass positions in 0\.\.1"),  # was NaN maps
        ({"batch_row": 2}, r"batch_row=2 is out of range: the stored maps have 2 batch row\(s\)"),
        ({"batch_row": -3}, r"batch_row=-3 is out of range"),
    ],
)
def test_a_selection_out_of_range_is_one_line_naming_the_parameter(selection, message):
    with pytest.raises(ValueError, match=message) as caught:
        heat_maps(synthetic_maps(), "attn", image_hw=(32, 32), **selection)
    assert "\n" not in str(caught.value)


def test_head_mean_maps_say_they_keep_one_head():
    with pytest.raises(ValueError, match=r"1 head\(s\), positions 0\.\.0 \(maps stored with map_head_mean"):
        heat_maps(synthetic_maps(heads=1), "attn", image_hw=(32, 32), heads=[1])


def test_overlay_tokens_out_of_range_or_empty_name_the_parameter():
    maps = heat_maps(synthetic_maps(), "attn", image_hw=(32, 32))
    image = np.zeros((32, 32))
    with pytest.raises(IndexError, match=r"tokens: token 4 is out of range; these maps have 4 image tokens"):
        maps.plot_overlay(image, tokens=[4])
    with pytest.raises(ValueError, match=r"tokens=\[\] selects no token"):
        maps.plot_overlay(image, tokens=[])


def test_grey_image_reads_chw_and_hwc_tensors_and_arrays_alike():
    from nw_adapter.analysis.heatmaps import grey_image

    rgb = np.random.default_rng(0).random((3, 8, 12))  # CHW, torch's layout: 8 x 12 pixels
    expected = rgb.mean(axis=0)
    np.testing.assert_allclose(grey_image(torch.from_numpy(rgb)), expected)  # was a 3 x 12 image
    np.testing.assert_allclose(grey_image(rgb), expected)
    np.testing.assert_allclose(grey_image(np.moveaxis(rgb, 0, -1)), expected)  # HWC
    np.testing.assert_allclose(grey_image(torch.from_numpy(rgb)[None]), expected)  # a batch of one
    assert grey_image(np.full((8, 12), 255, dtype=np.uint8)).max() == 1.0  # integers are 0-255
    with pytest.raises(ValueError, match=r"image: expected a PIL image or an \[H, W\]"):
        grey_image(np.zeros((5, 8, 12)))


def test_a_float_image_is_zero_to_one_never_guessed_from_its_maximum():
    from nw_adapter.analysis.heatmaps import grey_image

    image = np.full((4, 4), 0.5)
    image[0, 0] = 1.0001  # a decoder's rounding: was read as 0-255 (everything black)
    with pytest.warns(UserWarning, match=r"slightly outside \[0, 1\] were clipped"):
        grey = grey_image(image)
    assert grey[1, 1] == 0.5 and grey[0, 0] == 1.0
    with pytest.raises(ValueError, match=r"float values are read as \[0, 1\], got 0\.5\.\.200; divide"):
        grey_image(np.where(image > 1, 200.0, image))


def test_overlay_of_a_chw_tensor_draws_the_image_at_its_own_shape(recorded):
    rec, image = recorded
    chw = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    fig = heat_maps(rec, "attn").plot_overlay(chw)
    beneath = fig.axes[0].get_images()[0].get_array()
    assert beneath.shape == (image.height, image.width)


@pytest.mark.parametrize(
    ("selection", "message"),
    [
        ({"steps": 0}, r"steps must be a list of whole numbers \(e\.g\. steps=\[0, 5\]\) or None, got 0"),
        ({"steps": [0.5]}, r"steps=\[0\.5\]: 0\.5 is not a step index"),
        ({"heads": 1}, r"heads must be a list of whole numbers"),
        ({"layers": "up"}, r"layers must be a list of layer-name prefixes"),  # was read letter by letter
        ({"adapter": -1}, r"adapter must be a whole number >= 0, got -1"),
    ],
)
def test_a_selection_of_the_wrong_type_is_one_line_naming_the_parameter(selection, message):
    with pytest.raises(ValueError, match=message) as caught:
        heat_maps(synthetic_maps(), "attn", image_hw=(32, 32), **selection)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("image", [np.zeros((0, 0, 3), np.uint8), np.zeros((4, 0)), torch.zeros(3, 0, 8)])
def test_an_overlay_on_an_image_without_pixels_says_so(image):
    maps = heat_maps(synthetic_maps(), "attn", image_hw=(32, 32))
    with pytest.raises(ValueError, match=r"image: has no pixels \(shape"):
        maps.plot_overlay(image)
