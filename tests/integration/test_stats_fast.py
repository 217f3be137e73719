"""The fast statistics on their own: padding keys, halves, workspaces, the returned weights, precision."""

from __future__ import annotations

import math

import torch

from nw_adapter.integration import stats
from nw_adapter.integration.schema import STAT_NAMES
from nw_adapter.integration.stats import NullDraws, layer_statistics

torch.set_num_threads(1)


def _data(seed: int = 0, keys: int = 4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 40, 16, generator=g)
    k = torch.randn(2, 3, keys, 16, generator=g)
    draws = NullDraws(
        torch.randperm(40, generator=g)[:10],
        torch.randn(2, 3, 10, keys, generator=g),
        torch.randn(2, 3, 10, 16, generator=g),
    )
    return q, k, draws


def test_padding_keys_give_the_statistics_of_the_valid_keys_alone():
    """4 valid keys + 8 masked ones: every statistic (nulls included) equals that of the 4 keys."""
    q, k, draws = _data()
    valid = torch.tensor([True, False, False, True, False, True, False, False, False, True, False, False])
    padded = torch.full((2, 3, 12, 16), 3.0)
    padded[:, :, valid] = k
    noise = torch.zeros(2, 3, 10, 12)
    noise[..., valid] = draws.noise
    padded_draws = NullDraws(draws.rows, noise, draws.directions)
    alone, w_alone = layer_statistics(q, k, 1.3, 0.25, None, draws, halves=2)
    masked, w_masked = layer_statistics(q, padded, 1.3, 0.25, valid.expand(2, 12), padded_draws, halves=2)
    torch.testing.assert_close(masked, alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w_masked[..., valid], w_alone)
    assert bool((w_masked[..., ~valid] == 0).all())
    # without the mask the padding keys (equal, so tied) take part and change every rank statistic
    unmasked, _ = layer_statistics(
        q, padded, 1.3, 0.25, None, NullDraws(draws.rows, noise, draws.directions), 2
    )
    rho = STAT_NAMES.index("rho")
    assert not torch.allclose(unmasked[rho], alone[rho], atol=1e-3)


def test_halves_pool_the_batch_rows_of_each_half():
    q, k, draws = _data(1)
    both, _ = layer_statistics(q, k, 2.0, 0.25, None, None, halves=2)
    for half in range(2):
        one, _ = layer_statistics(q[half : half + 1], k[half : half + 1], 2.0, 0.25, None, None, halves=1)
        torch.testing.assert_close(both[:, half], one[:, 0], equal_nan=True)
    nulls = [STAT_NAMES.index(n) for n in ("rho_perm_null", "rho_norm_matched_null", "rho_spread_null")]
    assert bool(both[nulls].isnan().all())  # no draws: nulls recorded as NaN, not as 0
    assert all(math.isfinite(v) for v in both[STAT_NAMES.index("rho")].flatten().tolist())


def test_a_float_bandwidth_is_not_polluted_by_an_earlier_tensor_bandwidth():
    """The workspace is reused per shape: a NaN h of one call must not reach the next call's h."""
    q, k, draws = _data()
    h_row = STAT_NAMES.index("bandwidth")
    layer_statistics(q, k, torch.full((2, 3), float("nan")), 0.25, None, draws)
    stats, _ = layer_statistics(q, k, 1.5, 0.25, None, draws)
    assert torch.all(stats[h_row] == 1.5)


def test_statistics_do_not_depend_on_the_default_dtype():
    q, k, draws = _data()
    reference, _ = layer_statistics(q, k, 1.0, 0.25, None, draws)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        stats, _ = layer_statistics(q, k, 1.0, 0.25, None, draws)
    finally:
        torch.set_default_dtype(previous)
    assert torch.allclose(stats, reference, equal_nan=True)


def test_returned_weights_are_not_overwritten_by_the_next_call():
    """A and W belong to their call: a second call of the same shape leaves the first call's weights."""
    q, k, draws = _data()
    _, first = layer_statistics(q, k, 1.0, 0.25, None, draws, 2)
    kept = first.clone()
    _, second = layer_statistics(q.flip(2), k * 2.0, 0.5, 0.25, None, draws, 2)
    assert not torch.equal(second, kept)
    assert torch.equal(first, kept)
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()


def test_statistics_run_with_full_float32_matmuls_and_restore_the_setting(monkeypatch):
    """A user's TF32 / "high" matmul precision would cost the KL and JS sums ~1e-3: the statistics
    run at "highest" and the user's setting comes back, after an exception too."""
    seen = []

    def spy(*args):
        seen.append(torch.get_float32_matmul_precision())
        if len(seen) == 2:
            raise RuntimeError("boom")
        return layer_statistics(*args)

    monkeypatch.setattr(stats, "layer_statistics", spy)
    q, k, _ = _data()
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        stats.softmax_statistics(q, k, scale=0.25, h=1.0)
        assert torch.get_float32_matmul_precision() == "high"
        try:
            stats.softmax_statistics(q, k, scale=0.25, h=1.0)
        except RuntimeError:
            pass
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(previous)
    assert seen == ["highest", "highest"]


def test_the_cpu_choices_give_the_statistics_of_the_gpu_ones(monkeypatch):
    """On a CPU the sums over a few keys are accumulated key by key (less memory traffic) and the
    permutation null's keys are shuffled by their noise's places; a GPU takes one ``vecdot`` each
    and the argsort. Both give the same statistics; the control: every sum through the
    accumulation with one key left out changes them."""
    from nw_adapter.integration.stats import workspace

    q, k, draws = _data(3)
    accumulated, _ = layer_statistics(q, k, 1.2, 0.25, None, draws, halves=2)
    monkeypatch.setattr(workspace.EagerWriter, "on_cpu", lambda self, x: False)  # as on a GPU
    one_vecdot, _ = layer_statistics(q, k, 1.2, 0.25, None, draws, halves=2)
    torch.testing.assert_close(accumulated, one_vecdot, rtol=1e-5, atol=1e-6, equal_nan=True)
    monkeypatch.setattr(workspace.EagerWriter, "on_cpu", lambda self, x: True)
    original = workspace.EagerWriter.vecdot

    def short(self, out, x, y, dim):  # the last key left out of every sum
        size = x.shape[dim] - 1
        return original(self, out, x.narrow(dim, 0, size), y.narrow(dim, 0, size), dim)

    monkeypatch.setattr(workspace.EagerWriter, "vecdot", short)
    broken, _ = layer_statistics(q, k, 1.2, 0.25, None, draws, halves=2)
    assert not torch.allclose(broken, accumulated, equal_nan=True)


def test_the_key_shuffle_by_noise_places_is_the_argsort_permutation_ties_included():
    """The permutation null's shuffle by each key's place in the noise order (eager, no mask) moves
    every key where the argsort of the noise sends it; tied noise (which a float draw can give)
    still makes a permutation, the stable argsort's. The control: the places read in the wrong
    direction (descending) do not."""
    from nw_adapter.integration.stats.fast import KeyShuffle, _noise_places
    from nw_adapter.integration.stats.workspace import EagerWriter

    g = torch.Generator().manual_seed(5)
    noise = torch.randn(3, 2, 50, 6, generator=g)  # [B, H, n0, M]
    noise[0, 0, :10, 3] = noise[0, 0, :10, 1]  # ties
    noise[1, 1, :5, :] = 0.25  # a row of equal noise
    x = torch.randn(3, 2, 6, 50, generator=g)  # keys-major [B, H, M, n0]
    places = _noise_places(EagerWriter(), noise.transpose(-1, -2).contiguous())
    by_places = KeyShuffle(places, slots=True).apply(x)
    by_argsort = KeyShuffle(noise.argsort(dim=-1, stable=True).transpose(-1, -2), slots=False).apply(x)
    assert torch.equal(by_places, by_argsort)
    assert torch.equal(by_places.sort(2).values, x.sort(2).values)  # a permutation of each row's keys
    reversed_places = KeyShuffle(places.shape[2] - 1 - places, slots=True).apply(x)
    assert not torch.equal(reversed_places, by_argsort)
