"""The recorded readings (schema.READING_STATS) tell a key prior from an NW smoother, and h_eff_se
is the spread of h_eff over subsamples of the query rows.

The fast path is compared with the float64 reference column by column in
tests/integration/test_stats_reference.py; here the readings are checked against heads built to
have a known answer: a query-blind head (a key prior: every query prefers the same keys) and the
exact NW head of THEORY.md section 3 in augmented form (its attention IS an NW smoother of the data
at a known bandwidth).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from nw_adapter.core.compare import compare_attention
from nw_adapter.core.specification import H_EFF_REASONS, STAT_ROWS
from nw_adapter.integration.schema import READING_STATS, STAT_NAMES
from nw_adapter.integration.stats import draw_nulls, softmax_statistics
from nw_adapter.integration.stats.reference import reference_statistics

torch.set_num_threads(1)


def _readings(q, k, scale, **options) -> dict[str, torch.Tensor]:
    """``{name: [halves, H]}`` of the readings and rho (one half unless ``halves`` is given)."""
    stats, _, _ = softmax_statistics(q, k, scale=scale, h=1.0, **options)
    return {name: stats[STAT_NAMES.index(name)] for name in (*READING_STATS, "rho", "rho_spread_null")}


def _query_blind_head(rows=128, keys=8, dim=16, noise=0.02, seed=0):
    """A key prior: every query ranks the keys alike (the smallest-norm key first), whatever the
    query, up to ``noise``: ``q_j = [u, z_j]``, ``k_i = [b_i, noise w_i]`` with ``u.b_i`` a fixed
    preference (``q.k`` does not depend on j, so neither does ``G = q.k - ||k||^2 / 2``)."""
    g = torch.Generator().manual_seed(seed)
    half = dim // 2
    radius = torch.linspace(1.0, 4.0, keys, dtype=torch.float64)
    u = torch.zeros(half, dtype=torch.float64)
    u[0] = 1.0
    direction = torch.randn(keys, half, generator=g, dtype=torch.float64)
    direction[:, 0] = 0.0
    direction = direction / direction.norm(dim=-1, keepdim=True)
    preference = torch.cat([torch.ones(1), -torch.rand(keys - 1, generator=g).double()])  # u.b / ||b||
    b = radius[:, None] * (preference[:, None] * u + (1 - preference[:, None] ** 2).sqrt() * direction)
    k = torch.cat([b, noise * torch.randn(keys, dim - half, generator=g, dtype=torch.float64)], -1)
    q = torch.cat([u.expand(rows, half), torch.randn(rows, dim - half, generator=g, dtype=torch.float64)], -1)
    return (4.0 * q)[None, None].float(), k[None, None].float()


def _augmented_nw_head(h, rows=128, keys=8, dim=6, seed=0):
    """The exact NW head of THEORY.md section 3 in augmented form, with the softmax scale ``1/h^2``:
    ``q' = [x, 1, 0]``, ``k'_i = [s_i, -||s_i||^2 / 2, r_i]``, so ``q'.k'_i / h^2`` are the NW logits
    ``-||x - s_i||^2 / 2h^2`` up to a row constant: A = NW(h) of the data. ``r_i`` pads every key
    to one norm (a coordinate no query sees), so that in the head's own space the NW weights at
    ``h`` are A too (without it the key norms of the augmented head add a key prior)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g, dtype=torch.float64)
    s = 1.5 * torch.randn(keys, dim, generator=g, dtype=torch.float64)
    k = torch.cat([s, -0.5 * s.square().sum(-1, keepdim=True)], -1)
    pad = ((k.square().sum(-1).max() + 1.0) - k.square().sum(-1)).sqrt()
    k = torch.cat([k, pad[:, None]], -1)
    one, zero = torch.ones(rows, 1, dtype=torch.float64), torch.zeros(rows, 1, dtype=torch.float64)
    q = torch.cat([x, one, zero], -1)
    return q[None, None].float(), k[None, None].float()


def test_query_blind_head_is_a_key_prior_and_nw_loses():
    q, k = _query_blind_head()
    draws = draw_nulls(q, k.shape[-2], 64, torch.Generator().manual_seed(0))
    got = _readings(q, k, 0.25, draws=draws)
    assert float(got["r2_key"]) > 0.99  # the logits are a per-key bias
    # every row is close to the average row; the NW smoother of the query does worse than that
    assert float(got["kl_key_prior"]) < 0.1 * float(got["kl_nw_fit"])
    assert float(got["nw_gain"]) < -0.01
    assert float(got["r2_nw"]) < float(got["r2_key"])
    # ... which rho does not see: it clears its q.k-spread null (the false positive of issue 19)
    assert float(got["rho"]) > float(got["rho_spread_null"]) + 0.1


@pytest.mark.parametrize("h", [0.5, 1.0, 3.0])
def test_exact_nw_head_in_augmented_form_recovers_its_bandwidth(h):
    q, k = _augmented_nw_head(h)
    got = _readings(q, k, h**-2, fit_rows=None)
    assert float(got["h_eff"]) == pytest.approx(h, rel=1e-3)
    assert float(got["kl_nw_fit"]) < 1e-4  # the NW weights at h_eff are the attention
    assert float(got["nw_gain"]) > 0.05 and float(got["nw_gain"]) == pytest.approx(
        float(got["kl_key_prior"]), abs=1e-4
    )
    assert float(got["r2_nw"]) == pytest.approx(1.0, abs=1e-4)
    assert float(got["r2_nw"]) > float(got["r2_key"])


def test_readings_off_are_nan_and_leave_the_other_statistics_alone():
    q, k = _augmented_nw_head(1.0)
    on, _, _ = softmax_statistics(q, k, scale=1.0, h=1.0)
    off, _, _ = softmax_statistics(q, k, scale=1.0, h=1.0, readings=False)
    for i, name in enumerate(STAT_NAMES):
        if name in READING_STATS:
            assert bool(off[i].isnan().all()), name
        else:
            torch.testing.assert_close(off[i], on[i], equal_nan=True, msg=name)


def test_fit_rows_is_the_number_of_rows_used_and_the_fit_is_exact_on_all_rows():
    q, k = _query_blind_head(rows=40, noise=1.0)
    some = _readings(q, k, 0.25, fit_rows=16)
    every = _readings(q, k, 0.25, fit_rows=None)
    also_every = _readings(q, k, 0.25, fit_rows=40)
    assert float(some["fit_rows"]) == 16 and float(every["fit_rows"]) == 40
    assert float(some["h_eff_se"]) > 0 and float(every["h_eff_se"]) == 0
    torch.testing.assert_close(every["h_eff"], also_every["h_eff"])
    assert float(some["h_eff"]) != float(every["h_eff"])  # a subsample: another estimate


def _varied_head(rows, seed=0):
    """A head whose rows differ in how NW-like they are (query norms from 0.5x to 3x)."""
    g = torch.Generator().manual_seed(seed)
    dim, keys = 16, 8
    q = torch.randn(1, 4, rows, dim, generator=g) * torch.linspace(0.5, 3.0, rows)[:, None]
    k = torch.randn(1, 4, keys, dim, generator=g) * (0.5 + torch.rand(1, 4, keys, 1, generator=g))
    return q, k


def test_h_eff_standard_error_matches_the_spread_over_random_subsamples():
    """SE from one subsample of n = 64 of N = 512 rows against the standard deviation of h_eff over
    200 random subsamples (rows drawn without replacement: the finite-population correction)."""
    rows, fit, draws = 512, 64, 200
    q, k = _varied_head(rows)
    g = torch.Generator().manual_seed(1)
    order = torch.stack([torch.randperm(rows, generator=g) for _ in range(draws)])  # [draws, N]
    shuffled = q[0][None].expand(draws, -1, -1, -1).gather(2, order[:, None, :, None].expand(-1, 4, -1, 16))
    keys = k.expand(draws, -1, -1, -1)
    got = _readings(shuffled, keys, 0.25, fit_rows=fit, halves=draws)  # each draw its own "half"
    spread = got["h_eff"].std(0)  # [H]
    se = got["h_eff_se"].mean(0)
    ratio = se / spread
    assert bool(((ratio > 0.7) & (ratio < 1.4)).all()), ratio
    # and the subsample's error is real: h_eff over all rows lies within a few SE of each estimate
    full = _readings(q, k, 0.25, fit_rows=None)["h_eff"][0]
    z = (got["h_eff"] - full) / got["h_eff_se"]
    assert float(z.abs().mean()) < 1.5 and math.isfinite(float(z.abs().max()))


def _collinear_keys_head(rows=96, keys=6, dim=8, seed=0):
    """An anti-NW head: keys ``c_i u`` along one direction with c_i in [1, 3], queries ``a_j u``
    (a_j in [0.2, 0.8]) plus directions no key sees. The attention prefers the long keys (``q.k_i
    = a_j c_i``) and the NW scores ``a_j c_i - c_i^2 / 2`` the short ones, so the cross-entropy
    falls towards beta -> 0: the fit ends at the lower end of its range."""
    g = torch.Generator().manual_seed(seed)
    u = torch.zeros(dim, dtype=torch.float64)
    u[0] = 1.0
    c = torch.linspace(1.0, 3.0, keys, dtype=torch.float64)
    a = 0.2 + 0.6 * torch.rand(rows, generator=g, dtype=torch.float64)
    q = (
        a[:, None] * u
        + torch.cat([torch.zeros(rows, 1), torch.randn(rows, dim - 1, generator=g)], -1).double()
    )
    return q[None, None], (c[:, None] * u)[None, None]


NOT_IDENTIFIED = {
    # queries that differ only in directions orthogonal to every key: one attention row for all
    "query-blind": (lambda: _query_blind_head(noise=0.0), 0.25, H_EFF_REASONS[1]),
    "fit at the edge of its range": (_collinear_keys_head, 0.5, H_EFF_REASONS[2]),
}


@pytest.mark.parametrize("case", list(NOT_IDENTIFIED))
def test_h_eff_not_identified_is_nan_with_its_reason_in_the_spec_compare_and_the_fast_path(case):
    make, scale, reason = NOT_IDENTIFIED[case]
    q, k = make()
    code = float(H_EFF_REASONS.index(reason) + 1)
    with pytest.warns(RuntimeWarning, match="h_eff: " + re.escape(reason.split(" (")[0])):
        out = compare_attention(q.double(), k.double(), scale=scale)
    assert math.isnan(float(out["h_eff"])) and out.nan_reasons["h_eff"] == {reason: 1}
    assert math.isfinite(float(out["kl_nw_fit"]))  # the best NW weights of the range: a number
    stats, _, _ = softmax_statistics(q.float(), k.float(), scale=scale, h=1.0, fit_rows=None)
    assert math.isnan(float(stats[STAT_ROWS.index("h_eff")])) and math.isnan(
        float(stats[STAT_ROWS.index("h_eff_se")])
    )
    assert float(stats[STAT_ROWS.index("h_eff_reason")]) == code
    want = reference_statistics(q.double(), k.double(), scale=scale, h=1.0, fit_rows=None, codes=True)
    assert float(want[STAT_ROWS.index("h_eff_reason")]) == code


def test_an_identified_head_keeps_its_bandwidth_and_reason_code_0():
    q, k = _augmented_nw_head(0.7)
    stats, _, _ = softmax_statistics(q, k, scale=0.7**-2, h=1.0, fit_rows=None)
    assert float(stats[STAT_ROWS.index("h_eff")]) == pytest.approx(0.7, rel=1e-3)
    assert float(stats[STAT_ROWS.index("h_eff_reason")]) == 0.0


def test_a_half_of_several_batch_rows_takes_the_first_reason_among_them():
    """CFG half of 3 batch rows: identified, query-blind, identified -> the half's h_eff is NaN with
    the query-blind code, in the fast path as in the specification; the other half keeps a number."""
    blind_q, blind_k = _query_blind_head(rows=64, keys=8, dim=16, noise=0.0)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 1, 64, 16, generator=g)
    k = torch.randn(6, 1, 8, 16, generator=g) * (1.0 + torch.rand(6, 1, 8, 1, generator=g))
    q[1], k[1] = blind_q[0], blind_k[0]
    stats, _, _ = softmax_statistics(q, k, scale=0.25, h=1.0, halves=2, fit_rows=None)
    want = reference_statistics(
        q.double(), k.double(), scale=0.25, h=1.0, halves=2, fit_rows=None, codes=True
    )
    code = STAT_ROWS.index("h_eff_reason")
    assert stats[code, :, 0].tolist() == want[code, :, 0].tolist() == [2.0, 0.0]
    h_eff = stats[STAT_ROWS.index("h_eff"), :, 0]
    assert math.isnan(float(h_eff[0])) and math.isfinite(float(h_eff[1]))


def _fit_steps(monkeypatch, q, k, scale, settled=None):
    """(h_eff, Newton steps) of the fast path's bandwidth fit, ``settled`` patched when given."""
    from nw_adapter.integration.stats import readings
    from nw_adapter.integration.stats.workspace import EagerWriter

    calls = []
    moments = readings._moments
    monkeypatch.setattr(readings, "_moments", lambda *a: calls.append(1) or moments(*a))
    if settled is not None:
        monkeypatch.setattr(EagerWriter, "settled", settled)
    h_eff = _readings(q, k, scale, fit_rows=None)["h_eff"]
    monkeypatch.undo()
    return h_eff, len(calls)  # fit on every row: no evaluation at the fitted beta (only the SE reads it)


def test_the_cpu_fit_stops_once_settled_at_the_fixed_step_answer(monkeypatch):
    """Eager on the CPU the bandwidth fit stops when no beta moves by more than FIT_SETTLED; it
    answers what all FIT_STEPS steps answer, on heads whose answer is far from the start (random
    queries and keys of several scales; the exact NW head starts at its answer, float32 rounding
    aside: at most 2 steps)."""
    from nw_adapter.integration.stats.readings import FIT_STEPS

    g = torch.Generator().manual_seed(3)
    for heads, scale in ((1, 1.0), (4, 0.05), (4, 20.0)):
        q, k = torch.randn(2, heads, 64, 8, generator=g), torch.randn(2, heads, 6, 8, generator=g)
        early, steps = _fit_steps(monkeypatch, q, k, scale)
        full, all_steps = _fit_steps(monkeypatch, q, k, scale, settled=lambda *a: False)
        assert all_steps == FIT_STEPS
        assert 2 <= steps < FIT_STEPS  # stopped early ...
        torch.testing.assert_close(early, full, rtol=2e-5, atol=0.0)  # ... at the same answer (FIT_SETTLED)
    q, k = _augmented_nw_head(0.7)
    nw, steps = _fit_steps(monkeypatch, q, k, 1.0 / 0.7**2)
    assert steps <= 2 and float(nw) == pytest.approx(0.7, rel=1e-3)  # starts at its answer


def test_settled_reads_the_host_only_eager_on_the_cpu():
    """A GPU (here the meta device: no values to read) or a compiled graph runs every step."""
    from nw_adapter.integration.stats.workspace import CompiledWriter, EagerWriter

    same = torch.ones(3)
    moved = torch.tensor([1.0, 1.0, 1.1])
    assert EagerWriter().settled(same, same.clone(), 1e-5)
    assert not EagerWriter().settled(moved, same, 1e-5)  # one element moved by 10%
    assert not EagerWriter().settled(torch.tensor([math.nan]), torch.tensor([math.nan]), 1e-5)
    meta = torch.ones(3, device="meta")
    assert not EagerWriter().settled(meta, meta, 1e-5)  # would raise if it read the values
    assert not CompiledWriter().settled(same, same.clone(), 1e-5)
