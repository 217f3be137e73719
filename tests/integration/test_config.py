"""NWProcessorConfig: every option is validated with a message naming it and the fix."""

from __future__ import annotations

import pytest

from nw_adapter.integration.config import NWProcessorConfig


def test_defaults():
    cfg = NWProcessorConfig()
    assert cfg.mode == "observe" and cfg.bandwidth == "matched" and cfg.record_statistics
    assert not NWProcessorConfig(mode="swap").record_statistics
    assert NWProcessorConfig(mode="swap", statistics=True).record_statistics
    assert not NWProcessorConfig(statistics=False).record_statistics


def test_normalisation():
    cfg = NWProcessorConfig(
        bandwidth=2,
        layers="up_blocks",
        heads=1,
        steps=[3, 1, 3],
        store_maps=True,
        map_steps=[0],
        map_heads=[1],
        map_layers=["up"],
    )
    assert cfg.bandwidth == 2.0 and isinstance(cfg.bandwidth, float)
    assert cfg.layers == ("up_blocks",) and cfg.heads == (1,) and cfg.steps == (1, 3)
    d = cfg.to_dict()
    assert d["steps"] == [1, 3] and "extra" not in d


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"mode": "watch"}, "mode"),
        ({"bandwidth": "silverman"}, "bandwidth"),
        ({"bandwidth": -1.0}, "bandwidth"),
        ({"bandwidth": float("nan")}, "bandwidth"),
        ({"bandwidth": True}, "bandwidth"),
        ({"schedule_c": 0}, "schedule_c"),
        ({"layers": []}, "layers"),
        ({"layers": [1]}, "layers"),
        ({"heads": [-1]}, "heads"),
        ({"heads": ["0"]}, "heads"),
        ({"steps": "0"}, "steps"),
        ({"steps": []}, "steps"),
        ({"statistics": "yes"}, "statistics"),
        ({"nulls": 1}, "nulls"),
        ({"seed": 1.5}, "seed"),
        ({"null_rows": 0}, "null_rows"),
        ({"cfg": 1}, "cfg"),
        ({"store_maps": "no"}, "store_maps"),
        ({"store_maps": True, "mode": "swap"}, "store_maps"),
        ({"map_layers": ["up"]}, "map_layers"),
        ({"map_steps": [0]}, "map_steps"),
        ({"map_heads": [0]}, "map_heads"),
        ({"store_maps": True, "heads": [0], "map_heads": [1]}, "map_heads"),
        ({"map_head_mean": 1}, "map_head_mean"),
        ({"map_downsample": 0}, "map_downsample"),
        ({"map_dtype": "bfloat16"}, "map_dtype"),
        ({"map_max_mb": 0}, "map_max_mb"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"readings": "yes"}, "readings"),
        ({"fit_rows": 1}, "fit_rows"),
        ({"fit_rows": 2.5}, "fit_rows"),
        ({"fit_rows": True}, "fit_rows"),
    ],
)
def test_invalid_option_names_it(kwargs, option):
    with pytest.raises(ValueError, match=f"`{option}`"):
        NWProcessorConfig(**kwargs)


def test_unknown_keyword_is_named():
    with pytest.raises(ValueError, match="`bandwith`.*is not an option"):
        NWProcessorConfig.from_kwargs(bandwith="matched")


@pytest.mark.parametrize("bandwidth", [1e-30, 1e-200, 1e5, 5e-5])
def test_fixed_bandwidth_outside_the_usable_range_is_refused(bandwidth: float) -> None:
    with pytest.raises(ValueError, match=r"outside the usable range \[0.0001, 10000\]"):
        NWProcessorConfig(bandwidth=bandwidth)
    assert NWProcessorConfig(bandwidth=1e-4).bandwidth == 1e-4


@pytest.mark.parametrize("seed", [2**70, 2**63, -1])
def test_seed_outside_the_generator_range_is_refused(seed: int) -> None:
    with pytest.raises(ValueError, match="`seed` must be between 0 and 2\\*\\*63 - 1"):
        NWProcessorConfig(seed=seed)
