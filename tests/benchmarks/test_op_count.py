"""Dispatched-operation counts of the NW processor stay under their targets (issue 13).

Counts are deterministic (unlike times). Per layer: one attn2 layer at a small shape (the count
does not depend on the widths or the number of query tokens). Per UNet forward: a UNet with
SD 1.5's block structure (same modules, so the same operations) at small widths.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.models import SD15_UNET_CONFIG  # noqa: E402
from benchmarks.op_count import OpCounter, count_ops, layer_counts, unet_counts  # noqa: E402

#: SD 1.5's UNet structure at toy widths: the same 16 IP-Adapter layers and the same op sequence.
SD15_STRUCTURE = {
    **SD15_UNET_CONFIG,
    "sample_size": 8,
    "block_out_channels": (32, 32, 64, 64),
    "cross_attention_dim": 32,
}

#: Extra dispatched ops per IP-Adapter layer (one softmax, its deferred statistics computed right
#: after the call), measured on this code; a regression fails. Without the readings
#: (``readings=False``) the ceilings of issue 13 hold; the readings (issue 19) add ~217 ops per
#: layer, 168 of them the 12 Newton steps of the bandwidth fit. Issue 26 adds the scale readings and
#: h_eff's reason code (11 ops); issue 27 computes the fit keys-major (one more op per Newton step:
#: a CPU softmax along the last dim of 4-16 keys is ~20x slower), the ranks one reference key at a
#: time (7 more ops at 4 keys) and the row std as a centred mean square (3 more): measured 302 / 290
#: with the readings, 63 / 52 without. Then every pass went keys-major (the keys on a leading
#: dimension: each op over the keys runs along the rows, 1.7-1.9x less CPU time for the statistics
#: of the proxy's largest group): the per-row products over the keys as three ``vecdot`` groups
#: instead of one ``baddbmm``, the ranks one shift of keys at a time, the first peak from two
#: ``amax`` (an ``argmax`` over a non-last dim is ~15x slower): measured 317 / 304 / 76 / 63
#: (the Plus adapter: 315 / 302 / 74 / 61). Then the rank Gram as its three distinct products (two
#: ``vecdot``s, +2 ops), the nulls' query rows selected before the product (+1) and the fit's
#: least-squares start (+4): measured 324 / 310 / 79 / 65 (Plus: 322 / 308 / 77 / 63), every
#: Newton step counted as a GPU runs them (:class:`~benchmarks.op_count.OpCounter` turns the CPU's
#: early stop off). Then the spread and permutation nulls ranked from the observed rows' ranks
#: (their rows are no longer scored and ranked twice; 3 small Gram products, a gather and the
#: row order of the key noise: +7 ops, ~10% less CPU time for the largest proxy group), the key
#: norms' spread as a two-pass mean square (+4: ``std_mean`` over 4 keys costs ~8x the CPU), the
#: fit's moments at the final beta only for the standard error of a subset fit (-4 here, all rows
#: fitted): measured 331 / 310 / 90 / 69 (Plus: 329 / 308 / 88 / 67); ceilings ~3% above.
#: Issue 42 identifies h_eff by the NW scores' query-dependent share (their column sums ride on the
#: attention's, +2 ops for the share, +3 for its reason code) and records a swapped head through the
#: pairs' shift constant (no op): measured 337 / 316 / 91 / 70 (Plus: 335 / 314), on main 332 / 311
#: / 91 / 70 in the same run; after the core tests in one process the observe count read 8 more on
#: both (345, main 340: the inputs are drawn from the global generator), so its ceiling is 350.
MAX_EXTRA_PER_LAYER = {
    "observe": 350,
    "observe_no_nulls": 326,
    "observe_no_readings": 93,
    "observe_no_nulls_no_readings": 71,
    "swap": 0,
}
#: The same with the Plus adapter's 16 image tokens (ranks by one sort).
MAX_EXTRA_PER_LAYER_PLUS = {
    "observe": 348,
    "observe_no_nulls": 324,
    "observe_no_readings": 91,
    "observe_no_nulls_no_readings": 69,
}
#: Forwards of one counted call for the per-forward ratios (the issue's proxy: 10 timesteps).
FORWARDS = 10


def test_counter_counts_non_view_ops_only():
    x = torch.randn(4, 6)
    with OpCounter() as counter:
        y = x.view(6, 4).t()  # views: nothing launched
        (y * 2).sum()
    assert dict(counter.ops) == {"mul": 1, "sum": 1}


def test_layer_op_counts_stay_under_their_ceilings():
    counts = layer_counts(64, 64, heads=2, variants=tuple(MAX_EXTRA_PER_LAYER))
    for name, ceiling in MAX_EXTRA_PER_LAYER.items():
        assert counts[name] - counts["stock"] <= ceiling, (name, counts)
    assert counts["observe_no_nulls"] < counts["observe"]
    assert counts["observe_no_readings"] < counts["observe"]
    plus = layer_counts(64, 64, heads=2, image_tokens=16, variants=tuple(MAX_EXTRA_PER_LAYER_PLUS))
    for name, ceiling in MAX_EXTRA_PER_LAYER_PLUS.items():
        assert plus[name] - plus["stock"] <= ceiling, (name, plus)


def test_unet_forward_op_ratios():
    """Per UNet forward (SD 1.5 structure, CFG batch 2), a call of 10 forwards and its deferred
    statistics: observe and swap against stock (issue 27's targets: 1.25 and 1.02)."""
    variants = ("observe", "observe_no_readings", "swap")
    counts = unet_counts(latent_size=8, variants=variants, config=SD15_STRUCTURE, forwards=FORWARDS)
    assert counts["ip_layers"] == 16
    # measured 807 stock, 934.2 observe (1.16), 837.8 without the readings (1.04), 807 swap (1.00):
    # the layers only capture (no aten op), the statistics run once per layer shape and call
    assert counts["observe"] / counts["stock"] <= 1.25, counts
    assert counts["observe_no_readings"] / counts["stock"] <= 1.05, counts
    assert counts["swap"] / counts["stock"] <= 1.02, counts


def test_deferred_statistics_are_what_makes_observe_cheap_per_forward():
    """The control: the same call computing each layer's statistics in the layer (deferred_mb=0)
    dispatches the per-layer ops of every softmax, far above the target."""
    from benchmarks import op_count

    per_layer = {**op_count.VARIANTS["observe"], "deferred_mb": 0}
    saved = dict(op_count.VARIANTS)
    op_count.VARIANTS["observe_per_layer"] = per_layer
    try:
        counts = unet_counts(
            latent_size=8, variants=("observe_per_layer",), config=SD15_STRUCTURE, forwards=FORWARDS
        )
    finally:
        op_count.VARIANTS.clear()
        op_count.VARIANTS.update(saved)
    assert counts["observe_per_layer"] / counts["stock"] > 5.0, counts  # measured 6.5


def test_count_ops_runs_a_warmup_first():
    calls = []
    count_ops(lambda: calls.append(torch.ones(1) + 1), warmup=2)
    assert len(calls) == 3


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])


def test_counter_counts_every_newton_step_as_a_gpu_runs_them():
    """Eager on the CPU the bandwidth fit stops once settled; the counter counts all its steps (what
    a GPU dispatches) unless told to count the CPU's, and restores the early stop afterwards."""
    from nw_adapter.integration.stats import softmax_statistics
    from nw_adapter.integration.stats.workspace import EagerWriter

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, 32, 8, generator=g), torch.randn(2, 2, 4, 8, generator=g)
    early = EagerWriter.__dict__["settled"]
    counts = {}
    for as_gpu in (True, False):
        with OpCounter(as_gpu=as_gpu) as counter:
            softmax_statistics(q, k, scale=0.35, h=1.0)
        counts[as_gpu] = counter.total
        assert EagerWriter.__dict__["settled"] is early
    # the CPU stopped the fit early; the default count has the missing steps' ops (>= 10 a step)
    assert counts[True] >= counts[False] + 10
