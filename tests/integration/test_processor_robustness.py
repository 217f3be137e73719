"""NW processors on a bare diffusers ``Attention``: image-embeds batch folding, failures, class names.

- Issue 12 item 5: when the image-embeds batch differs from the latent batch (2 rows for a batch
  of 1), diffusers folds the extra rows into the keys (``ip_key.view(batch_size, -1, ...)``), with
  or without an IP mask; the NW processors must fold the same way in observe and swap.
- Issue 12 item 6: observe never fails a layer that stock completes (stock output, the pair
  counted, one warning); swap fails with a message naming the layer.
- Issue 12 item 7: code that checks the class name does not recognise the NW subclasses, but
  ``isinstance`` against diffusers' IP-Adapter processors holds.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from diffusers.models.attention_processor import Attention, IPAdapterAttnProcessor, IPAdapterAttnProcessor2_0

from nw_adapter.integration import stats
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.processors import nw_processor_for
from nw_adapter.integration.recorder import NWRecorder

C, CROSS, HEADS, DIM, TOKENS = 32, 24, 2, 16, 4
LAYER = "up_blocks.1.attentions.0.transformer_blocks.0.attn2.processor"


def _layer(seed: int = 0) -> tuple[Attention, IPAdapterAttnProcessor2_0]:
    torch.manual_seed(seed)
    attn = Attention(C, cross_attention_dim=CROSS, heads=HEADS, dim_head=DIM).eval()
    stock = IPAdapterAttnProcessor2_0(HEADS * DIM, CROSS, num_tokens=(TOKENS,), scale=0.8)
    with torch.no_grad():
        for lin in [*stock.to_k_ip, *stock.to_v_ip]:
            lin.weight.normal_(0, 0.5)
    return attn, stock


def _install(attn, stock, **options) -> NWRecorder:
    rec = NWRecorder(NWProcessorConfig(**options))
    attn.set_processor(nw_processor_for(stock, layer_name=LAYER, config=rec.config, recorder=rec))
    return rec


def _run(attn, processor, x, text, ip, masks):
    attn.set_processor(processor)
    kwargs = {} if masks is None else {"ip_adapter_masks": masks}
    with torch.no_grad():
        return attn(x, (text, ip), **kwargs)


def _lcm_case(masked: bool):
    """Latent batch 1, image embeds of 2 rows (CFG layout, no CFG), optional [1, 1, 16, 24] mask."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 24, C, generator=gen)
    text = torch.randn(1, 7, CROSS, generator=gen)
    ip = [torch.randn(2, 1, TOKENS, CROSS, generator=gen)]
    masks = [(torch.rand(1, 1, 16, 24, generator=gen) > 0.5).float()] if masked else None
    return x, text, ip, masks


@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("mode", ["observe", "swap"])
def test_extra_embed_rows_fold_into_keys_like_stock(mode, masked):
    attn, stock = _layer()
    x, text, ip, masks = _lcm_case(masked)
    folded = [ip[0].reshape(1, 1, 2 * TOKENS, CROSS)]  # the same keys, already one row
    stock_out = _run(attn, stock, x, text, ip, masks)
    assert torch.equal(stock_out, _run(attn, stock, x, text, folded, masks))  # stock folds
    rec = _install(attn, stock, mode=mode, bandwidth=2.0, statistics=True, nulls=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may be skipped
        out = _run(attn, attn.processor, x, text, ip, masks)
        rec_folded = _install(attn, stock, mode=mode, bandwidth=2.0, statistics=True, nulls=False)
        out_folded = _run(attn, attn.processor, x, text, folded, masks)
    if mode == "observe":
        assert torch.equal(out, stock_out)
    else:
        assert not torch.allclose(out, stock_out, atol=1e-3)
    assert torch.equal(out, out_folded)
    records, records_folded = rec.to_records(), rec_folded.to_records()
    assert records and {r["num_keys"] for r in records} == {2 * TOKENS}
    assert [r["rho"] for r in records] == [r["rho"] for r in records_folded]
    assert rec.skipped()["count"] == 0


def _two_layer_inputs():
    gen = torch.Generator().manual_seed(4)
    return (
        torch.randn(2, 24, C, generator=gen),
        torch.randn(2, 7, CROSS, generator=gen),
        [torch.randn(2, 1, TOKENS, CROSS, generator=gen)],
    )


def test_observe_returns_stock_output_when_the_side_computation_fails(monkeypatch, tmp_path):
    attn, stock = _layer()
    x, text, ip = _two_layer_inputs()
    stock_out = _run(attn, stock, x, text, ip, None)
    rec = _install(attn, stock, store_maps=True)

    def broken(*args, **kwargs):
        raise FloatingPointError("injected failure")

    monkeypatch.setattr(stats, "softmax_statistics", broken)
    with pytest.warns(RuntimeWarning, match="injected failure") as caught:
        outs = []
        for step in range(3):
            rec.begin_step(step=step)
            outs.append(_run(attn, attn.processor, x, text, ip, None))
    assert len([w for w in caught if "NW side computation failed" in str(w.message)]) == 1
    assert all(torch.equal(o, stock_out) for o in outs)
    skipped = rec.skipped()
    assert skipped["count"] == 3
    assert skipped["by_reason"] == {"FloatingPointError: injected failure": 3}
    assert [(p["step"], p["layer"]) for p in skipped["pairs"]] == [(s, LAYER) for s in range(3)]
    assert rec.to_records() == [] and rec.maps() == {}
    payload = json.loads(rec.to_json(tmp_path / "rho.json").read_text())
    assert payload["skipped"]["count"] == 3


def test_a_failure_after_some_groups_rolls_the_layer_back(monkeypatch):
    """Two adapters: the second softmax fails, so the first one's entries of that layer are dropped."""
    attn, _ = _layer()
    stock = IPAdapterAttnProcessor2_0(HEADS * DIM, CROSS, num_tokens=(TOKENS, TOKENS), scale=[0.8, 0.5])
    gen = torch.Generator().manual_seed(5)
    x, text = torch.randn(2, 24, C, generator=gen), torch.randn(2, 7, CROSS, generator=gen)
    ip = [torch.randn(2, 1, TOKENS, CROSS, generator=gen), torch.randn(2, 2, TOKENS, CROSS, generator=gen)]
    rec = _install(attn, stock, store_maps=True, nulls=False)
    real = stats.softmax_statistics

    def fails_on_eight_keys(q, k, **kwargs):
        if k.shape[-2] == 2 * TOKENS:
            raise ValueError("second adapter")
        return real(q, k, **kwargs)

    monkeypatch.setattr(stats, "softmax_statistics", fails_on_eight_keys)
    with pytest.warns(RuntimeWarning, match="second adapter"):
        _run(attn, attn.processor, x, text, ip, None)
    assert rec.to_records() == [] and rec.maps() == {}
    assert rec.skipped()["count"] == 1
    monkeypatch.setattr(stats, "softmax_statistics", real)
    rec.begin_step(step=1)
    _run(attn, attn.processor, x, text, ip, None)
    assert {(r["step"], r["adapter"]) for r in rec.to_records()} == {(1, 0), (1, 1)}


def test_swap_failure_names_the_layer(monkeypatch):
    attn, stock = _layer()
    x, text, ip = _two_layer_inputs()
    _install(attn, stock, mode="swap", bandwidth=1.0)
    from nw_adapter.integration.processors.base import NWProcessorBase

    def broken(*args, **kwargs):
        raise ValueError("kernel exploded")

    monkeypatch.setattr(NWProcessorBase, "_nw_head", broken)  # the NW head of every family
    with pytest.raises(RuntimeError, match=f"NW swap failed in layer '{LAYER}'.*kernel exploded"):
        _run(attn, attn.processor, x, text, ip, None)
    assert stock.scale == [0.8]  # the temporarily zeroed scales are back


def test_schedule_bandwidth_without_a_level_skips_in_observe_and_raises_in_swap():
    attn, stock = _layer()
    x, text, ip = _two_layer_inputs()
    stock_out = _run(attn, stock, x, text, ip, None)
    rec = _install(attn, stock, bandwidth="schedule")
    assert torch.equal(_run(attn, attn.processor, x, text, ip, None), stock_out)
    with pytest.warns(RuntimeWarning, match="schedule"):  # the layer call is recorded at the flush
        assert rec.skipped()["count"] == 1
    _install(attn, stock, mode="swap", bandwidth="schedule")
    with pytest.raises(RuntimeError, match=f"layer '{LAYER}'.*schedule"):
        _run(attn, attn.processor, x, text, ip, None)


@pytest.mark.parametrize("stock_cls", [IPAdapterAttnProcessor2_0, IPAdapterAttnProcessor])
def test_nw_processors_are_instances_not_class_names_of_the_stock_ones(stock_cls):
    stock = stock_cls(HEADS * DIM, CROSS, num_tokens=(TOKENS,))
    rec = NWRecorder()
    nw = nw_processor_for(stock, layer_name=LAYER, config=rec.config, recorder=rec)
    assert isinstance(nw, stock_cls)  # what diffusers' loaders (set_ip_adapter_scale ...) check
    assert type(nw).__name__ != stock_cls.__name__  # an equality test on the name does not match
    assert "IPAdapter" in type(nw).__name__  # a substring test (diffusers' ComponentsManager) does
