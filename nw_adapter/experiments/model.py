"""The learned in-context flow-matching (ICFM) model of THEORY.md section 5.

Architecture (queries attend to the support; support tokens are never updated)::

    h_0   = W_in [x, emb(t)]                     query tokens   [B, n, D]
    s     = W_s s                                 support tokens [B, m, D]
    h_l+1 = h_l + CrossAttn(LN(h_l), LN_l(s))     multi-head, masked over padding
    h_l+1 = h_l+1 + MLP(LN(h_l+1))               GELU, hidden 4 D
    v     = MLP_out([LN(h_L), W_nw u_NW(x, t)])   u_NW only in variant "ON" (exact head)

u_NW is the frozen exact Nadaraya-Watson velocity of the OT path (THEORY.md section 2),
computed by :func:`nw_adapter.experiments.fields.exact_nw_velocity` from the core library.
Each query token is processed independently of the other queries, and padded support
points (mask False) never receive attention, so padding cannot change any output.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nw_adapter.experiments.fields import exact_nw_velocity

__all__ = ["ICFMConfig", "ICFMModel", "AttentionRecord", "sinusoidal_embedding", "broadcast_time"]


@dataclass
class ICFMConfig:
    """Hyper-parameters of :class:`ICFMModel`.

    Attributes:
        dim: Data dimension d.
        d_model: Token width D (paper 128; 64 on 2 CPU cores).
        num_heads: Attention heads H (d_k = D / H).
        num_layers: Cross-attention blocks L.
        mlp_ratio: Hidden width of the block MLPs, as a multiple of D.
        time_dim: Width of the sinusoidal time embedding (even).
        exact_head: Variant "ON" (True): concatenate the projected exact NW velocity before the
            output MLP; "OFF" (False): no exact head.
        sigma_min: sigma_min of the OT path the exact head uses.
    """

    dim: int
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    mlp_ratio: int = 4
    time_dim: int = 32
    exact_head: bool = False
    sigma_min: float = 0.01

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"dim={self.dim} must be >= 1.")
        if self.d_model < 1 or self.num_heads < 1 or self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} must be a positive multiple of num_heads={self.num_heads}."
            )
        if self.num_layers < 1 or self.mlp_ratio < 1:
            raise ValueError(f"num_layers={self.num_layers} and mlp_ratio={self.mlp_ratio} must be >= 1.")
        if self.time_dim < 2 or self.time_dim % 2:
            raise ValueError(f"time_dim={self.time_dim} must be an even number >= 2.")
        if not 0.0 <= self.sigma_min < 1.0:
            raise ValueError(f"sigma_min={self.sigma_min} must be in [0, 1).")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class AttentionRecord:
    """One block's cross-attention, for the head analysis.

    Attributes:
        query: Per-head queries ``[B, H, n, d_k]``.
        key: Per-head keys ``[B, H, m, d_k]``.
        weights: softmax(q k^T / sqrt(d_k)) over valid keys, ``[B, H, n, m]`` (0 on padding).
        logits: The attention logits q k^T / sqrt(d_k), ``[B, H, n, m]`` (-inf on padding): rank
            these, not ``weights``, whose float32 entries underflow to tied zeros.
    """

    query: Tensor
    key: Tensor
    weights: Tensor
    logits: Tensor


def broadcast_time(t: Tensor | float, x: Tensor) -> Tensor:
    """Broadcast a time (scalar, ``[B]``, ``[B, n]`` or ``[B, n, 1]``) to ``[B, n]`` like ``x [B, n, d]``."""
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
    if t.ndim == 3:
        t = t.squeeze(-1)
    if t.ndim == 1:
        t = t[:, None]
    return t.expand(x.shape[:-1])


def sinusoidal_embedding(t: Tensor, dim: int, max_frequency: float = 1000.0) -> Tensor:
    """Sinusoidal embedding of times in [0, 1].

    emb(t) = [sin(f_1 t), .., sin(f_k t), cos(f_1 t), .., cos(f_k t)], k = dim / 2, with
    frequencies f_j geometric from 1 to ``max_frequency``.

    Args:
        t: Times ``[...]``.
        dim: Even embedding width.
        max_frequency: Largest frequency.

    Returns:
        ``[..., dim]``.
    """
    half = dim // 2
    freqs = torch.exp(torch.linspace(0.0, math.log(max_frequency), half, device=t.device, dtype=t.dtype))
    phase = t[..., None] * freqs
    return torch.cat([torch.sin(phase), torch.cos(phase)], dim=-1)


class CrossAttention(nn.Module):
    """Multi-head cross-attention queries -> support with a key padding mask.

    out = W_o concat_h softmax(q_h k_h^T / sqrt(d_k) + mask) v_h, through
    ``scaled_dot_product_attention`` unless the weights are requested.
    """

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.to_q = nn.Linear(d_model, d_model)
        self.to_k = nn.Linear(d_model, d_model)
        self.to_v = nn.Linear(d_model, d_model)
        self.to_out = nn.Linear(d_model, d_model)

    def _heads(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self, h: Tensor, s: Tensor, mask: Tensor | None, need_weights: bool = False
    ) -> tuple[Tensor, AttentionRecord | None]:
        """Args: h ``[B, n, D]``, s ``[B, m, D]``, mask bool ``[B, m]`` or None.

        Returns:
            ``([B, n, D], record or None)``.
        """
        q, k, v = self._heads(self.to_q(h)), self._heads(self.to_k(s)), self._heads(self.to_v(s))
        key_mask = None if mask is None else mask[:, None, None, :]
        record = None
        if need_weights:
            logits = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
            if key_mask is not None:
                logits = logits.masked_fill(~key_mask, float("-inf"))
            weights = torch.softmax(logits, dim=-1)
            out = weights @ v
            record = AttentionRecord(q.detach(), k.detach(), weights.detach(), logits.detach())
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        b, _, n, _ = out.shape
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1)), record


class Block(nn.Module):
    """Pre-norm block: h + CrossAttn(LN(h), LN(s)); then h + MLP(LN(h))."""

    def __init__(self, d_model: int, num_heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm_q = nn.LayerNorm(d_model)
        self.norm_s = nn.LayerNorm(d_model)
        self.attn = CrossAttention(d_model, num_heads)
        self.norm_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(), nn.Linear(mlp_ratio * d_model, d_model)
        )

    def forward(self, h, s, mask, need_weights=False):
        a, record = self.attn(self.norm_q(h), self.norm_s(s), mask, need_weights)
        h = h + a
        return h + self.mlp(self.norm_mlp(h)), record


class ICFMModel(nn.Module):
    """Learned in-context flow-matching velocity field v_theta(x, t, S).

    Example:
        >>> model = ICFMModel(ICFMConfig(dim=2))
        >>> v = model(torch.randn(3, 10, 2), torch.rand(3, 10), torch.randn(3, 50, 2))
        >>> v.shape
        torch.Size([3, 10, 2])
    """

    def __init__(self, config: ICFMConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.query_in = nn.Linear(c.dim + c.time_dim, c.d_model)
        self.support_in = nn.Linear(c.dim, c.d_model)
        self.blocks = nn.ModuleList(Block(c.d_model, c.num_heads, c.mlp_ratio) for _ in range(c.num_layers))
        self.norm_out = nn.LayerNorm(c.d_model)
        self.nw_in = nn.Linear(c.dim, c.d_model) if c.exact_head else None
        width = 2 * c.d_model if c.exact_head else c.d_model
        self.head = nn.Sequential(nn.Linear(width, c.d_model), nn.GELU(), nn.Linear(c.d_model, c.dim))

    def forward(
        self,
        x: Tensor,
        t: Tensor | float,
        support: Tensor,
        support_mask: Tensor | None = None,
        *,
        return_attention: bool = False,
    ) -> Tensor | tuple[Tensor, list[AttentionRecord]]:
        """Velocity at query points.

        Args:
            x: Query points ``[B, n, d]``.
            t: Times, scalar, ``[B]``, ``[B, n]`` or ``[B, n, 1]``.
            support: Support points ``[B, m, d]``.
            support_mask: Bool ``[B, m]``, True = valid; None = all valid.
            return_attention: Also return one :class:`AttentionRecord` per block (slower path
                that materialises the weights).

        Returns:
            Velocity ``[B, n, d]`` (and the attention records).
        """
        d = self.config.dim
        if x.ndim != 3 or support.ndim != 3 or x.shape[-1] != d or support.shape[-1] != d:
            raise ValueError(
                f"x {tuple(x.shape)} and support {tuple(support.shape)} must be [B, n, {self.config.dim}] "
                f"and [B, m, {self.config.dim}]."
            )
        t = broadcast_time(t, x)
        h = self.query_in(torch.cat([x, sinusoidal_embedding(t, self.config.time_dim)], dim=-1))
        s = self.support_in(support)
        records: list[AttentionRecord] = []
        for block in self.blocks:
            h, record = block(h, s, support_mask, return_attention)
            if record is not None:
                records.append(record)
        feats = self.norm_out(h)
        if self.nw_in is not None:
            with torch.no_grad():
                u = exact_nw_velocity(x, t, support, support_mask, sigma_min=self.config.sigma_min)
            feats = torch.cat([feats, self.nw_in(u)], dim=-1)
        v = self.head(feats)
        return (v, records) if return_attention else v
