"""The hot path of the attention processor never reads a tensor value on the host.

A host read (``bool(t)``, ``t.item()``, ``float(t)``, ``t.tolist()``) stalls a GPU every layer of
every step. On CPU we detect it by making those methods raise while the functions run with
``validate=False`` (the processor's setting).
"""

from __future__ import annotations

import math

import pytest
import torch

from nw_adapter.core import bandwidth, kernels, metrics


class HostRead(AssertionError):
    pass


@pytest.fixture
def no_host_reads(monkeypatch: pytest.MonkeyPatch):
    def raiser(*args, **kwargs):
        raise HostRead("a tensor value was read on the host")

    for name in ("__bool__", "item", "__float__", "__int__", "__index__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, raiser)
    yield


def test_detector_catches_a_host_read(no_host_reads) -> None:
    with pytest.raises(HostRead):
        bool(torch.ones(()) > 0)
    with pytest.raises(HostRead):
        kernels.nw_weights(torch.randn(3, 2), torch.randn(4, 2), torch.tensor(1.0), validate=True)


def test_processor_hot_path_has_no_host_reads(no_host_reads) -> None:
    g = torch.Generator().manual_seed(0)
    b, h, n, m, d = 2, 3, 16, 4, 8
    q = torch.randn(b, h, n, d, generator=g)
    k = torch.randn(b, h, m, d, generator=g)
    v = torch.randn(b, h, m, d, generator=g)
    mask = torch.ones(b, h, m, dtype=torch.bool)
    s = d**-0.5
    attn = torch.softmax(q @ k.transpose(-1, -2) * s, -1)

    h_fit, kl = bandwidth.fitted_bandwidth(attn, q, k)
    h_med = bandwidth.median_bandwidth(q, k, key_mask=mask)
    h_mat = bandwidth.matched_bandwidth(scale=s)
    for hh in (h_fit, h_med, h_mat):
        w = kernels.nw_weights(q, k, hh, support_mask=mask, validate=False)
        logits = kernels.nw_logits(q, k, hh, validate=False)
        for form in ("bias", "augmented"):
            kernels.gaussian_kernel_attention(q, k, v, hh, key_mask=mask, form=form, validate=False)
        kernels.effective_sample_size(w)
        metrics.spearman_rho(attn, w)
        metrics.pearson_raveled(attn, w)
        metrics.kl_from_logits(q @ k.transpose(-1, -2) * s, logits, mask[0, 0])
        metrics.js_from_logits(q @ k.transpose(-1, -2) * s, logits)
        metrics.top1_agreement(attn, w, mask[0, 0])
        metrics.permutation_null_rho(attn, w, mask[0, 0], generator=g)
        metrics.norm_matched_null_rho(q, k, mask[0, 0], generator=g)
        metrics.qk_spread_null_rho(q, k, mask[0, 0], generator=g)
        metrics.qk_spread_ratio(q, k, mask[0, 0])
    assert kl.shape == (b, h) and not math.isnan(kl.sum().numpy())
