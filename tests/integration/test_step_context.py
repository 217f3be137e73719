"""The processors read one context per denoiser pass (issue 27, item 4): every layer of a pass
sees the same :class:`~nw_adapter.integration.steps.StepContext`, a new pass a new one, and what
a pass resolves for every layer (the bandwidth of a rule that reads no keys, per softmax scale;
the CFG halves of a batch size) is resolved once per pass, not once per layer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.mixin import apply_nw_processor, remove_nw_processor
from nw_adapter.integration.processors import base, is_nw_processor
from nw_adapter.integration.recorder import NWRecorder

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:  # `benchmarks/` is not installed
    sys.path.insert(0, ROOT)

from benchmarks.models import TOY_UNET_CONFIG, build_unet, unet_inputs  # noqa: E402

torch.set_num_threads(1)


def _counting(monkeypatch, name: str) -> list:
    """Patch ``base.<name>`` to record the step state of each call."""
    calls: list = []
    real = getattr(base, name)

    def counted(*args, **kwargs):
        calls.append(args[1])  # the StepState (both functions take it second)
        return real(*args, **kwargs)

    monkeypatch.setattr(base, name, counted)
    return calls


@pytest.mark.parametrize("mode", ["observe", "swap"])
def test_every_layer_of_a_pass_reads_one_context_and_resolves_the_bandwidth_once(mode, monkeypatch):
    unet = build_unet(TOY_UNET_CONFIG)
    kwargs = unet_inputs(unet, latent_size=8, image_embed_dim=1024)
    rec = apply_nw_processor(unet, NWProcessorConfig(mode=mode, cfg=True, deferred_mb=0, nulls=False))
    ip_attns = [m for n, m in unet.named_modules() if n.endswith("attn2")]
    head_dims = {a.to_q.out_features // a.heads for a in ip_attns}
    bandwidths = _counting(monkeypatch, "resolve_bandwidth")
    halves = _counting(monkeypatch, "batch_halves")
    seen: list = []
    for attn in ip_attns:  # the context each layer finds when it runs
        attn.register_forward_pre_hook(lambda m, a: seen.append(rec.context))
    try:
        layers = sum(is_nw_processor(p) for p in unet.attn_processors.values())
        with torch.no_grad():
            for _ in range(2):
                unet(**kwargs)
    finally:
        remove_nw_processor(unet)
    assert layers == len(ip_attns) == 4 and len(head_dims) == 2  # 4 layers, 2 softmax scales
    assert len(seen) == 2 * layers
    first, second = seen[0], seen[layers]
    assert all(c is first for c in seen[:layers]) and all(c is second for c in seen[layers:])
    assert first is not second and first.state.step == 0 and second.state.step == 1
    # once per pass and softmax scale, not once per layer (4 per pass)
    assert [s.step for s in bandwidths] == [0, 0, 1, 1]
    if mode == "observe":
        assert [s.step for s in halves] == [0, 1]  # one batch size: once per pass
        assert {r["half"] for r in rec.to_records()} == {"uncond", "cond"}


def test_the_recorder_facade_reads_the_context():
    config = NWProcessorConfig(steps=[1], cfg=None)
    rec = NWRecorder(config)
    rec.begin_step(step=0, cfg=True)
    first = rec.context
    assert rec.context is first and first.cfg and not first.selected
    rec.begin_step(step=1, cfg=False)
    assert rec.context is not first and rec.context.selected and not rec.context.cfg
    assert NWRecorder(NWProcessorConfig(cfg=True)).context.cfg  # config.cfg wins over the step's value
