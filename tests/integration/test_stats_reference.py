"""The fast statistics equal the one specification, statistic by statistic, on the same null draws.

The specification (:mod:`nw_adapter.core.specification`, pooled per CFG half by
:mod:`nw_adapter.integration.stats.reference`) runs in float64 on the float32 inputs the fast
path sees; every column of the fast path (h_eff's reason code included) is compared by name, so
a column moved, swapped or fed by the wrong producer fails here. The structure of the names is
enforced too: one table in core, one fast-path writer per name, compare_attention its names
but the fast-path-only ones.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from nw_adapter.core import compare, specification
from nw_adapter.core.specification import FAST_PATH_ONLY, READING_STATS, SPECIFICATION, STAT_NAMES, STAT_ROWS
from nw_adapter.integration import schema
from nw_adapter.integration.stats import draw_nulls, fast, softmax_statistics
from nw_adapter.integration.stats.layout import Columns
from nw_adapter.integration.stats.reference import reference_statistics

torch.set_num_threads(1)

BATCH, HEADS, ROWS, DIM, NULL_ROWS = 2, 3, 24, 16, 8

EAGER_CASES = list(
    itertools.product(
        (4, 16),  # keys: pairwise ranks (base adapter) and sorted ranks (Plus)
        (False, True),  # key mask
        (1, 2),  # CFG halves
        (NULL_ROWS, ROWS, 0),  # the nulls' rows: a subset, every row (drawn in a random order), none
        ("float", "tensor"),  # bandwidth
        (None, 10),  # the readings' bandwidth fit: all 24 rows (SE 0) or 10 evenly spaced rows
    )
)
#: Compiling costs minutes per graph on 2 shared cores: one graph, the options that
#: tests/integration/test_compile.py does not compile (it has 4 keys, no mask, 2 halves, nulls, 0-d h).
COMPILED_CASES = [(16, True, 1, 0, "tensor", 10)]


def _inputs(keys: int, masked: bool, null_rows: int, bandwidth: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, ROWS, DIM, generator=g) * 1.5
    norms = 1.0 + torch.rand(BATCH, HEADS, keys, 1, generator=g)  # key norms that vary: W differs from A
    k = torch.randn(BATCH, HEADS, keys, DIM, generator=g) * norms
    valid = None
    if masked:  # a different subset of keys per batch row, at least 3 valid
        valid = torch.rand(BATCH, keys, generator=g) < 0.6
        valid[:, :3] = True
        valid = valid[:, torch.randperm(keys, generator=g)]
    draws = draw_nulls(q, keys, null_rows, g) if null_rows else None
    h = 1.3 if bandwidth == "float" else 0.8 + torch.rand(BATCH, HEADS, generator=g)
    return q, k, valid, draws, h


def _assert_equal_to_reference(keys, masked, halves, null_rows, bandwidth, fit_rows, compile):
    q, k, valid, draws, h = _inputs(keys, masked, null_rows, bandwidth)
    scale = 1 / math.sqrt(DIM)
    got, attn, nw = softmax_statistics(
        q, k, scale=scale, h=h, draws=draws, valid=valid, halves=halves, compile=compile, fit_rows=fit_rows
    )
    h64 = h if isinstance(h, float) else h.double()
    want = reference_statistics(
        q.double(),
        k.double(),
        scale=scale,
        h=h64,
        draws=draws,
        valid=valid,
        halves=halves,
        fit_rows=fit_rows,
        codes=True,
    )
    assert got.shape == want.shape == (len(STAT_ROWS), halves, HEADS)
    for i, name in enumerate(STAT_ROWS):
        message = lambda m, n=name: f"{n}: {m}"  # noqa: E731
        torch.testing.assert_close(
            got[i].double(), want[i], rtol=1e-4, atol=2e-5, equal_nan=True, msg=message
        )
    assert bool(got[STAT_NAMES.index("rho_spread_null")].isnan().all()) != bool(null_rows)
    for name in READING_STATS:  # every reading is defined here (3+ valid keys, rows that differ)
        assert bool(got[STAT_NAMES.index(name)].isfinite().all()), name
    se = got[STAT_NAMES.index("h_eff_se")]
    assert bool((se > 0).all()) if fit_rows else bool((se == 0).all())
    assert bool((got[STAT_NAMES.index("fit_rows")] == (fit_rows or ROWS)).all())
    # the returned weights are A and W (padding keys: 0)
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, None, :], -math.inf)
    torch.testing.assert_close(attn.double(), torch.softmax(logits, -1), rtol=1e-5, atol=1e-6)
    assert nw.shape == attn.shape


CASE_NAMES = ("keys", "masked", "halves", "null_rows", "bandwidth", "fit_rows")


@pytest.mark.parametrize(CASE_NAMES, EAGER_CASES)
def test_fast_path_equals_the_reference(keys, masked, halves, null_rows, bandwidth, fit_rows):
    _assert_equal_to_reference(keys, masked, halves, null_rows, bandwidth, fit_rows, compile=False)


@pytest.mark.parametrize(CASE_NAMES, COMPILED_CASES)
def test_compiled_fast_path_equals_the_reference(
    keys, masked, halves, null_rows, bandwidth, fit_rows, recwarn
):
    _assert_equal_to_reference(keys, masked, halves, null_rows, bandwidth, fit_rows, compile=True)
    # a fallback to eager (one warning) would test the eager path twice
    assert not [w for w in recwarn if "torch.compile is unavailable" in str(w.message)]


def test_every_statistic_has_exactly_one_producer(monkeypatch):
    fast._check_table()
    producers = dict(fast.PRODUCERS)
    del producers["kl"]
    monkeypatch.setattr(fast, "PRODUCERS", producers)
    with pytest.raises(AssertionError, match="STAT_NAMES"):
        fast._check_table()


def test_named_columns_refuse_what_a_slice_cannot_select():
    cols = Columns(("a", "b", "c", "d"))
    assert (cols["c"], cols.slice("a", "c"), cols.slice("d")) == (2, slice(0, 3, 2), slice(3, 4, 1))
    with pytest.raises(ValueError, match="not equally spaced"):
        cols.slice("a", "b", "d")
    with pytest.raises(ValueError, match="not equally spaced"):
        cols.slice("b", "a")
    with pytest.raises(KeyError, match="no column 'e'"):
        cols["e"]


def test_one_table_of_names_one_writer_each_and_compare_attention_its_names():
    """Adding a statistic touches the specification and the fast path only: the names are the
    specification's table (schema re-exports that very tuple), the fast path has exactly one
    writer per name (in order), and compare_attention returns the names but the fast-path-only
    ones, each computed by the specification's function (no second list, no second writing)."""
    assert STAT_NAMES == tuple(SPECIFICATION)
    assert schema.STAT_NAMES is STAT_NAMES and schema.READING_STATS is READING_STATS
    assert tuple(fast.PRODUCERS) == STAT_NAMES
    assert fast.HEAD.names[: len(STAT_ROWS)] == STAT_ROWS
    assert set(FAST_PATH_ONLY) == {"h_eff_se", "fit_rows"}
    assert compare.COMPARISON_NAMES == tuple(n for n in STAT_NAMES if n not in FAST_PATH_ONLY)
    assert all(callable(SPECIFICATION[n].function) for n in STAT_NAMES)
    from nw_adapter.integration.stats import reference

    assert reference.SPECIFICATION is specification.SPECIFICATION
    assert not hasattr(reference, "REFERENCE")  # the old second writing is gone
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, 2, 12, 4, generator=g, dtype=torch.float64), torch.randn(1, 2, 5, 4, generator=g)
    k = k.double()
    out = compare.compare_attention(q, k, scale=0.5, bandwidth=0.9, seed=3)
    x = specification.Softmax(
        q, k, 0.5, torch.full((1, 2), 0.9, dtype=torch.float64), None,
        specification.draw_nulls(q, 5, None, torch.Generator().manual_seed(3)),
    )  # fmt: skip
    for name in compare.COMPARISON_NAMES:
        value = SPECIFICATION[name].function(x)
        value = value.nanmean(-1) if SPECIFICATION[name].per_query_row else value
        torch.testing.assert_close(out[name], value, rtol=0, atol=0, equal_nan=True, msg=name)
