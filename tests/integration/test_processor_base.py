"""processors/base.py: the CFG-halves rule, the bandwidth, the scale convention; maps.py's store."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0

from nw_adapter.core import bandwidth as bw
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.maps import MapStore, pool_query_rows, reduce_maps
from nw_adapter.integration.processors import is_nw_processor, nw_processor_for
from nw_adapter.integration.processors.base import batch_halves, resolve_bandwidth
from nw_adapter.integration.recorder import NWRecorder
from nw_adapter.integration.steps import StepState

torch.set_num_threads(1)


@pytest.mark.parametrize(
    ("batch", "cfg", "perturbed", "pass_index", "by_pass", "expected"),
    [
        (2, True, False, 0, False, ("uncond", "cond")),
        (4, True, False, 0, False, ("uncond", "cond")),
        (3, True, False, 0, False, ("all",)),  # does not split into two halves
        (1, False, False, 0, False, ("all",)),
        (3, True, True, 0, False, ("uncond", "cond", "perturbed")),  # PAG with CFG
        (2, False, True, 0, False, ("cond", "perturbed")),  # PAG without CFG
        (1, False, False, 0, True, ("cond",)),  # Flux: the positive pass
        (1, True, False, 1, True, ("uncond",)),  # Flux true CFG: the negative pass
        (1, False, False, 2, True, ("uncond",)),
    ],
)
def test_batch_halves_is_the_one_rule_of_every_family(batch, cfg, perturbed, pass_index, by_pass, expected):
    state = StepState(perturbed=perturbed, pass_index=pass_index)
    assert batch_halves(batch, state, cfg=cfg, by_pass=by_pass) == expected


def test_resolve_bandwidth_rules():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=gen), torch.randn(2, 3, 4, 8, generator=gen)
    s = 1 / math.sqrt(8)
    level = StepState(alpha=0.6, sigma=0.8)
    assert resolve_bandwidth(NWProcessorConfig(bandwidth=2.5), level, q, k, s) == 2.5
    assert resolve_bandwidth(NWProcessorConfig(bandwidth="matched"), level, q, k, s) == bw.matched_bandwidth(
        scale=s
    )
    schedule = NWProcessorConfig(bandwidth="schedule", schedule_c=0.5)
    assert resolve_bandwidth(schedule, level, q, k, s) == pytest.approx(
        float(bw.schedule_bandwidth(0.8, 0.6, 0.5))
    )
    assert resolve_bandwidth(schedule, StepState(alpha=0.0, sigma=1.0), q, k, s) == math.inf  # s = 1
    with pytest.raises(RuntimeError, match="sigma_t/alpha_t"):
        resolve_bandwidth(schedule, StepState(), q, k, s)
    fitted = resolve_bandwidth(NWProcessorConfig(bandwidth="fitted"), level, q, k, s)
    expected = bw.fitted_bandwidth(torch.softmax(q @ k.transpose(-1, -2) * s, -1), q, k)[0]
    assert fitted.shape == (2, 3) and torch.allclose(fitted, expected)
    median = resolve_bandwidth(NWProcessorConfig(bandwidth="median"), level, q.half(), k.half(), s)
    assert median.dtype == torch.float32 and median.shape == (2, 3)


def test_scale_is_the_stock_processors_whether_edited_in_place_or_assigned():
    stock = IPAdapterAttnProcessor2_0(32, 24, num_tokens=(4, 4), scale=[0.5, 0.7])
    rec = NWRecorder()
    nw = nw_processor_for(stock, layer_name="l", config=rec.config, recorder=rec)
    assert is_nw_processor(nw) and not is_nw_processor(stock)
    assert nw.scale is stock.scale  # UNet set_ip_adapter_scale edits the list in place
    nw.scale[1] = 0.2
    assert stock.scale == [0.5, 0.2]
    nw.scale = [1.0, 0.0]  # SD3 / Flux set_ip_adapter_scale assigns
    assert stock.scale == [1.0, 0.0]
    assert nw.to_k_ip is stock.to_k_ip and set(nw.state_dict()) == set(stock.state_dict())


def test_reduce_maps_and_the_store_budget():
    config = NWProcessorConfig(store_maps=True, map_head_mean=True, map_downsample=2, map_dtype="float32")
    attn = torch.softmax(torch.randn(1, 2, 16, 4), -1)
    reduced = reduce_maps(config, heads=(0, 1), attn_w=attn, nw_w=attn, latent_hw=(4, 4))
    assert reduced is not None
    a, w, meta = reduced
    assert a.shape == (1, 1, 4, 4) and meta == {"heads": "mean", "downsample": "2", "grid": "2x2"}
    assert torch.allclose(a.sum(-1), torch.ones(1, 1, 4))  # pooled rows of a softmax still sum to 1
    pooled, grid = pool_query_rows(attn, 2, None)
    assert grid == (2, 2) and torch.allclose(pooled[0, 0, 0], attn[0, 0, [0, 1, 4, 5]].mean(0))
    none = NWProcessorConfig(store_maps=True, heads=[1], map_heads=[1])
    assert reduce_maps(none, heads=(0,), attn_w=attn, nw_w=attn, latent_hw=None) is None

    pair_mb = 2 * a.numel() * 4 / 2**20
    store = MapStore(NWProcessorConfig(store_maps=True, map_max_mb=2.5 * pair_mb))
    store.add("one", a, w, meta)
    store.add("two", a, w, meta)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store.add("three", a, w, meta)  # over the budget: dropped, one warning
    assert len(store) == 2 and len(caught) == 1 and "map_max_mb" in str(caught[0].message)
    store.truncate(1)  # a rollback frees its bytes
    store.add("three", a, w, meta)
    assert sorted(store.tensors()) == ["one/attn", "one/nw", "three/attn", "three/nw"]
