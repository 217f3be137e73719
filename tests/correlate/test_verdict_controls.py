"""The verdict on data built to have no NW-specific effect, and on an exact NW head.

Every case runs through the real NW processor on a diffusers ``Attention`` layer (queries and
image keys set through identity projections) and the real report code (aggregate -> verdict):

- does NOT clear: isotropic random q and k; random queries inside the span of the keys with
  ||q|| = 8 and 32 (they clear the norm-matched null, not the q.k-spread null); keys of equal
  norms (attention and NW weights coincide by algebra: every null is ~1 as well); the tiny
  random-weight SD 1.5 pipeline end to end;
- DOES clear: an attention head that computes the exact NW weights of a support set with
  varying norms (THEORY section 3, augmented q/k): its key norms are paired with q.k in a way
  the nulls do not reproduce.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import Attention, IPAdapterAttnProcessor2_0
from tiny_helpers import generate

from nw_adapter.correlate.report import aggregate, select_steps, verdict
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.processors import nw_processor_for
from nw_adapter.integration.recorder import NWRecorder
from nw_adapter.integration.schema import NULL_STATS

HEADS, DIM, ROWS, KEYS = 2, 32, 256, 4
WIDTH = HEADS * DIM


def _identity_layer() -> tuple[Attention, IPAdapterAttnProcessor2_0]:
    """An attention layer whose queries are its input and whose image keys are the image tokens."""
    attn = Attention(WIDTH, cross_attention_dim=WIDTH, heads=HEADS, dim_head=DIM).eval()
    stock = IPAdapterAttnProcessor2_0(WIDTH, WIDTH, num_tokens=(KEYS,), scale=1.0)
    with torch.no_grad():
        attn.to_q.weight.copy_(torch.eye(WIDTH))
        stock.to_k_ip[0].weight.copy_(torch.eye(WIDTH))
    return attn, stock


def _observe(q: torch.Tensor, k: torch.Tensor) -> dict:
    """Verdict of the processor's records for queries [B, H, N, d] and keys [B, H, M, d] (cfg halves)."""
    attn, stock = _identity_layer()
    rec = NWRecorder(NWProcessorConfig(cfg=True, null_rows=None, seed=0))
    attn.set_processor(
        nw_processor_for(stock, layer_name="up_blocks.1.attn2.processor", config=rec.config, recorder=rec)
    )
    rec.begin_step(call=0, step=0, timestep=torch.tensor(1), cfg=True)
    batch = q.shape[0]
    hidden = q.transpose(1, 2).reshape(batch, -1, WIDTH).float()
    image = k.transpose(1, 2).reshape(batch, 1, -1, WIDTH).float()
    text = torch.zeros(batch, 3, WIDTH)
    with torch.no_grad():
        attn(hidden, (text, [image]))
    return verdict(select_steps(aggregate(rec.to_records()), ()))


def _batch(make, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[uncond; cond] rows x heads of (q [N, d], k [M, d]) from ``make(generator)``."""
    gen = torch.Generator().manual_seed(seed)
    pairs = [[make(gen) for _ in range(HEADS)] for _ in range(2)]
    q = torch.stack([torch.stack([p[0] for p in row]) for row in pairs])
    k = torch.stack([torch.stack([p[1] for p in row]) for row in pairs])
    return q, k


def _isotropic(gen):
    return torch.randn(ROWS, DIM, generator=gen), torch.randn(KEYS, DIM, generator=gen)


def _in_span(norm: float):
    def make(gen):
        k = torch.randn(KEYS, DIM, generator=gen)
        q = torch.randn(ROWS, KEYS, generator=gen) @ k
        return q * (norm / q.norm(dim=-1, keepdim=True)), k

    return make


def _equal_norms(gen):
    k = torch.randn(KEYS, DIM, generator=gen)
    k = 5 * k / k.norm(dim=-1, keepdim=True) * (1 + 0.01 * torch.randn(KEYS, 1, generator=gen))
    return 2 * torch.randn(ROWS, DIM, generator=gen), k


def _exact_nw_head(gen, h: float = 2.0):
    """q = [x/h, 1], k_i = [s_i/h, -||s_i||^2/2h^2]: q.k = NW logits of x over s (THEORY 3)."""
    support = torch.randn(KEYS, DIM - 1, generator=gen)
    x = support[torch.randint(0, KEYS, (ROWS,), generator=gen)] + 0.3 * torch.randn(
        ROWS, DIM - 1, generator=gen
    )
    k = torch.cat([support / h, -support.square().sum(-1, keepdim=True) / (2 * h * h)], -1)
    return torch.cat([x / h, torch.ones(ROWS, 1)], -1), k


@pytest.mark.parametrize(
    "make",
    [_isotropic, _in_span(8.0), _in_span(32.0), _equal_norms],
    ids=["iso", "span8", "span32", "eqnorm"],
)
def test_verdict_does_not_clear_without_nw_specific_structure(make):
    result = _observe(*_batch(make, seed=1))
    assert all(result[name] is not None for name in NULL_STATS)
    assert result["clears_nulls"] is False, result


def test_queries_in_the_span_clear_the_norm_matched_null_but_not_the_spread_null():
    """The issue's counterexample: ||q|| = 32 in the span of the keys beats the norm-matched null."""
    result = _observe(*_batch(_in_span(32.0), seed=2))
    assert result["rho_last"] > result["rho_norm_matched_null"] + 0.02
    assert result["rho_last"] < result["rho_spread_null"] + 0.05


def test_verdict_clears_for_an_exact_nw_head():
    result = _observe(*_batch(_exact_nw_head, seed=3))
    assert result["clears_nulls"] is True, result
    assert result["margin"] > 0.1


def test_verdict_does_not_clear_for_the_random_tiny_pipeline(tiny_sd15_dir, tiny_ip_adapter_dir):
    from nw_adapter.models.tiny import ip_adapter_weight_name
    from nw_adapter.pipelines.pipeline_stable_diffusion_nw import StableDiffusionNWPipeline

    pipe = StableDiffusionNWPipeline.from_pretrained(tiny_sd15_dir)
    pipe.load_ip_adapter(tiny_ip_adapter_dir, subfolder="models", weight_name=ip_adapter_weight_name("base"))
    rec = pipe.set_ip_adapter_nw_processor(null_rows=None)
    try:
        generate(pipe, steps=3, output_type="latent")
    finally:
        pipe.unset_ip_adapter_nw_processor()
    result = verdict(select_steps(aggregate(rec.to_records()), ()))
    assert all(result[name] is not None for name in NULL_STATS)
    assert result["clears_nulls"] is False, result
