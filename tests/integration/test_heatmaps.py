"""DAAM-style heat maps per image token, from a recorder in memory (no file written)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nw_adapter import load_tiny_digits, nw_processor, tiny_digit_image
from nw_adapter.integration.heatmaps import TokenHeatMaps, heat_maps


@pytest.fixture(scope="module")
def recorded():
    """The trained tiny model, 3 steps with maps of steps 0 and 2 kept in memory."""
    torch.set_num_threads(1)
    pipe = load_tiny_digits()
    reference = tiny_digit_image(3)
    with nw_processor(pipe, store_maps=True, map_steps=[0, 2], map_head_mean=False) as rec:
        image = pipe(
            "a photograph", ip_adapter_image=reference, num_inference_steps=3,
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
