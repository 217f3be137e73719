"""The host-cost proxy's deterministic counts (issue 27): Python calls into nw_adapter per observed
layer call, counted with ``sys.setprofile`` over one whole call (10 forwards of a UNet with SD 1.5's
block structure, 16 IP layers, plus the recorder's export), divided by the 160 layer calls. No
timed assertion: times live in benchmarks/README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import host_cost  # noqa: E402

#: Issue 27's ceiling of Python calls into nw_adapter per observed layer call.
MAX_CALLS_PER_LAYER_CALL = 150


def test_the_counter_counts_calls_into_the_package_only():
    from nw_adapter.integration.processors.selection import batch_halves
    from nw_adapter.integration.steps import StepState

    state = StepState()
    assert host_cost.count_python_calls(lambda: [batch_halves(2, state, cfg=True) for _ in range(5)]) == 5
    assert host_cost.count_python_calls(lambda: torch.ones(3).sum()) == 0


def test_an_observed_layer_call_makes_at_most_150_python_calls_into_nw_adapter():
    torch.set_num_threads(1)
    proxy = host_cost.Proxy()
    assert proxy.ip_layers == 16
    layer_calls = proxy.ip_layers * host_cost.FORWARDS
    counts = {}
    for name in ("observe", "observe_per_layer"):
        proxy.install(name)
        proxy.call()  # warm-up: one-time set-up (taps, caches) is not a layer call's
        counts[name] = host_cost.count_python_calls(proxy.call) / layer_calls
    proxy.install("stock")
    # measured 85 (42 of them in the layers, the rest the deferred statistics and the export)
    assert counts["observe"] <= MAX_CALLS_PER_LAYER_CALL, counts
    # the control: the statistics computed in each layer cost hundreds of calls per layer call
    # (measured 359 with the keys-major statistics, 538 before)
    assert counts["observe_per_layer"] > 2 * MAX_CALLS_PER_LAYER_CALL, counts
