"""Memory held by the recorder after a run: streaming statistics versus stored attention maps.

One SD 1.5 attn2 layer (hidden 320, 8 heads, CFG batch 2, 4 image tokens) runs in observe mode
for a few steps at several query counts. Afterwards every tensor reachable from the
:class:`~nw_adapter.integration.recorder.NWRecorder` (its lists, dicts and dataclass records; modules and
the pipeline excluded) is collected, each storage counted once, and the bytes summed. Streaming
mode must hold the same number of bytes whatever the number of query tokens; stored maps grow
linearly with it (bounded by ``map_max_mb``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.processors import nw_processor_for
from nw_adapter.integration.recorder import NWRecorder

from .models import attention_inputs, attention_layer

#: Recorder options compared (``nulls`` off: they do not change what is stored, only the time).
MODES: dict[str, dict[str, Any]] = {
    "streaming": {},
    "maps_fp16": {"store_maps": True},
    "maps_headmean_ds2": {"store_maps": True, "map_head_mean": True, "map_downsample": 2},
}


def tensor_bytes(obj: Any) -> int:
    """Bytes of all tensor storages reachable from ``obj`` (each storage counted once).

    Walks lists, tuples, sets, dicts and objects' ``__dict__`` / ``__slots__``; skips
    ``torch.nn.Module`` instances and generators (the recorder's model references and RNG).
    """
    seen_objects: set[int] = set()
    seen_storages: set[tuple[str, int]] = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen_objects or isinstance(
            item, (torch.nn.Module, torch.Generator, str, bytes, int, float)
        ):
            continue
        seen_objects.add(id(item))
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            key = (str(item.device), storage.data_ptr())
            if key not in seen_storages:
                seen_storages.add(key)
                total += storage.nbytes()
            continue
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        else:
            if hasattr(item, "__dict__"):
                stack.extend(vars(item).values())
            for slot in getattr(type(item), "__slots__", ()):
                if hasattr(item, slot):
                    stack.append(getattr(item, slot))
    return total


def bench_recorder_memory(
    queries: Sequence[int], *, steps: int = 2, hidden: int = 320, modes: Sequence[str] = tuple(MODES)
) -> list[dict[str, Any]]:
    """Recorder tensor bytes after ``steps`` observe calls, per mode and query count.

    Args:
        queries: query-token counts (square numbers, so maps can be downsampled on a grid).
        steps: recorded steps (one layer call each).
        hidden: layer width (heads = 8).
        modes: names from :data:`MODES`.

    Returns:
        One dict per query count: ``{"queries", "bytes": {mode: int}}``.
    """
    attn, stock = attention_layer(hidden)
    rows = []
    for n in queries:
        inputs = attention_inputs(hidden, n)
        row: dict[str, Any] = {"queries": n, "steps": steps, "bytes": {}}
        for mode in modes:
            config = NWProcessorConfig(mode="observe", cfg=True, nulls=False, **MODES[mode])
            recorder = NWRecorder(config)
            attn.set_processor(
                nw_processor_for(stock, layer_name="attn2.processor", config=config, recorder=recorder)
            )
            with torch.no_grad():
                for step in range(steps):
                    recorder.begin_step(step=step, cfg=True)
                    attn(inputs["hidden_states"], encoder_hidden_states=inputs["encoder_hidden_states"])
            recorder.settle()  # the deferred statistics computed: what the recorder keeps
            row["bytes"][mode] = tensor_bytes(recorder)
            row.setdefault("records", len(recorder))
        attn.set_processor(stock)
        rows.append(row)
    return rows
