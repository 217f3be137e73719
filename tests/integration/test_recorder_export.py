"""NWRecorder.to_records of entries of several layouts (ip_mass, control draws, support sets)
recorded in one run, interleaved: each record read back cell by cell from the entry's tensors."""

from __future__ import annotations

import math

import torch

from nw_adapter.core.specification import H_EFF_REASONS, STAT_ROWS
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.recorder import CONTROL_ROWS, NWRecorder, block_of
from nw_adapter.integration.schema import (
    CONTROL_RECORDED,
    H_EFF_REASON_FIELD,
    STAT_NAMES,
    SUPPORT_REFERENCES,
    control_column,
    key_scale_column,
    support_columns,
)

CODES = torch.tensor([0.0, 1.0, 2.0, 3.0, math.nan])  # identified, each reason, NaN (no reason)


def _text(code: float) -> str | None:
    return H_EFF_REASONS[int(code) - 1] if code >= 1 else None


def _layouts(gen: torch.Generator) -> list[dict]:
    """The add() arguments of one entry per layout: plain, ip_mass, control draws, a support set,
    everything; one or two halves, different heads."""
    out = []
    for halves, heads, mass, draws, refs in [
        (("uncond", "cond"), (0, 3), False, 0, 0),
        (("all",), (1,), True, 0, 0),
        (("uncond", "cond"), (2, 0, 1), False, 2, 0),
        (("all",), (0, 1), False, 0, 3),
        (("uncond", "cond"), (4, 5), True, 1, 2),
    ]:
        n_h, n_k = len(halves), len(heads)
        stats = torch.randn(len(STAT_ROWS), n_h, n_k, generator=gen)
        stats[-1] = CODES[torch.randint(0, len(CODES), (n_h, n_k), generator=gen)]
        control = None
        if draws:
            control = torch.randn(draws, CONTROL_ROWS, n_h, n_k, generator=gen)
            control[:, -1] = CODES[torch.randint(0, len(CODES), (draws, n_h, n_k), generator=gen)]
        out.append(
            {
                "halves": halves,
                "heads": heads,
                "stats": stats,
                "ip_mass": torch.rand(n_h, n_k, generator=gen) if mass else None,
                "control": control,
                "support": torch.rand(refs + 2, n_h, n_k, generator=gen) if refs else None,
            }
        )
    return out


def _expected(rec: NWRecorder, call: int, step: int, layer: str, a: dict) -> list[dict]:
    """The records of one entry, read cell by cell in (half, head) order."""
    out = []
    for hi, half in enumerate(a["halves"]):
        for ki, head in enumerate(a["heads"]):
            r = {"call": call, "step": step, **rec.tracker.step_info(call, step)}
            r.update(layer=layer, block=block_of(layer), head=head, half=half)
            r.update(adapter=0, image=0, scale=0.5, num_keys=4, key_set="ip", **rec.run_fields(call))
            cell = a["stats"][:, hi, ki].tolist()
            r.update(zip(STAT_NAMES, cell[:-1], strict=True))
            r[H_EFF_REASON_FIELD] = _text(cell[-1])
            if a["ip_mass"] is not None:
                r["ip_mass"] = a["ip_mass"][hi, ki].item()
            for d, rows in enumerate([] if a["control"] is None else a["control"][:, :, hi, ki].tolist()):
                names = [*(control_column(n, d) for n in CONTROL_RECORDED), key_scale_column(d)]
                r.update(zip(names, rows[:-1], strict=True))
                r[f"{control_column('h_eff', d)}_reason"] = _text(rows[-1])
            if a["support"] is not None:
                rows = a["support"][:, hi, ki].tolist()
                r[SUPPORT_REFERENCES] = len(rows) - 2
                r.update(zip(support_columns(r[SUPPORT_REFERENCES])[1:], rows, strict=True))
            out.append(r)
    return out


def _same(got: dict, want: dict) -> bool:
    """Same keys in the same order, same types, same values (NaN equal to NaN)."""
    return list(got) == list(want) and all(
        type(got[k]) is type(want[k])
        and (got[k] == want[k] or (isinstance(want[k], float) and math.isnan(want[k]) and math.isnan(got[k])))
        for k in want
    )


def test_records_of_interleaved_layouts_are_each_entrys_cells_in_order():
    gen = torch.Generator().manual_seed(0)
    rec = NWRecorder(NWProcessorConfig())
    added = []
    for call in range(2):
        for step in range(2):
            rec.begin_step(call=call, step=step, timestep=900 - step, alpha=0.6, sigma=0.8)
            for i, a in enumerate(_layouts(gen)):  # every layout at every step: the groups interleave
                layer = ("down_blocks.0", "mid_block", "up_blocks.1")[i % 3] + f".attentions.{i}.attn2"
                rec.add(layer=layer, adapter=0, image=0, scale=0.5, num_keys=4, **a)
                added.append((call, step, layer, a))
    records = rec.to_records()
    expected = [r for args in added for r in _expected(rec, *args)]
    assert len(records) == len(expected) == 2 * 2 * (4 + 1 + 6 + 2 + 4)
    bad = [i for i, (got, want) in enumerate(zip(records, expected, strict=True)) if not _same(got, want)]
    assert not bad, (records[bad[0]], expected[bad[0]])
    reasons = {r[H_EFF_REASON_FIELD] for r in records}
    assert None in reasons and len(reasons) > 2  # codes 0 and NaN, and some reasons, all read
