"""NW processor for SD 3 / 3.5 IP-Adapter layers (diffusers' ``SD3IPAdapterJointAttnProcessor2_0``).

The stock image branch of a block (InstantX SD3.5 IP-Adapter), read from diffusers' code:

    q   = norm_q(to_q(x))                               [B, H, N, d]  (RMSNorm per head)
    k   = [norm_k(to_k(x)) ; norm_ip_k(to_k_ip(ip))]    [B, H, N + M, d]
    v   = [to_v(x) ; to_v_ip(ip)]                       ip = norm_ip(ip_hidden_states, temb)
    out = to_out(text_joint_attention + scale * SDPA(q, k, v))

so it is ONE softmax over the image's own N keys concatenated with the M IP keys, not a softmax
over the IP tokens alone (the UNet and Flux image branches are). The NW processor records two
comparisons per (layer, head, CFG half):

- ``key_set="ip"``: the joint attention restricted to the IP keys and renormalised, which is
  exactly softmax(q k_ip^T / sqrt(d)) over the IP keys, against the NW weights over the IP keys
  (the comparison every family shares; the report's default);
- ``key_set="joint"``: the joint attention over all N + M keys against the NW weights over the
  same keys, on :attr:`NWSD3IPAdapterJointAttnProcessor2_0.joint_rows` query rows evenly spaced
  over the image (the joint key set grows with the image: N = 4096 at 1024 px);

and ``ip_mass``, the joint softmax's mass on the IP keys, sum_{i in IP} A_ni averaged over the
same rows, beside both. q, k and k_ip are the very tensors the stock processor forms: the taps'
forward hooks on its ``norm_q``, ``norm_k`` and ``norm_ip_k`` (called only in the image branch;
registered at the first call, armed during ``super().__call__`` only) capture them, and the
stock output is returned untouched (observe is bit-identical).

A further transformer pass of the same step (skip-layer guidance, ``skip_guidance_layers``, runs
the conditional half again with some blocks skipped) is not recorded; swap applies to it too.

Swap: ``super().__call__`` runs without ``ip_hidden_states`` (diffusers then skips the image
branch) and a forward pre-hook on ``attn.to_out[0]`` adds ``scale * GKA(q, k, v, h)`` over the same
joint keys and values, GKA(q, k, v, h)_n = sum_i softmax_i(-||q_n - k_i||^2 / 2h^2) v_i; q, k and v
are formed with the stock modules from the outputs of ``to_q``, ``to_k``, ``to_v`` (hooked).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from diffusers.models.attention_processor import Attention, SD3IPAdapterJointAttnProcessor2_0

from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.processors.base import (
    BranchSpec,
    NWProcessorBase,
    Softmax,
    split_heads,
    spread_rows,
)
from nw_adapter.integration.recorder import NWRecorder
from nw_adapter.integration.steps import StepContext


class NWSD3IPAdapterJointAttnProcessor2_0(NWProcessorBase, SD3IPAdapterJointAttnProcessor2_0):
    """NW processor over diffusers' SD3 IP-Adapter processor (see the module docstring).

    Args:
        original: the ``SD3IPAdapterJointAttnProcessor2_0`` being replaced; its modules are
            shared and its ``scale`` is the one read and set.
        layer_name: the processor's name (a key of ``transformer.attn_processors``).
        config: the :class:`~nw_adapter.integration.config.NWProcessorConfig`.
        recorder: the :class:`~nw_adapter.integration.recorder.NWRecorder`.

    Example:
        >>> rec = apply_nw_processor(sd3_pipe, mode="observe")  # after sd3_pipe.load_ip_adapter(...)
        >>> sd3_pipe("a cat", ip_adapter_image=ref).images[0]
        >>> [r for r in rec.to_records(key_set="joint")][0]["ip_mass"]
    """

    _shared_modules = ("norm_ip", "to_k_ip", "to_v_ip", "norm_q", "norm_k", "norm_ip_k")
    spec = BranchSpec(
        observe_taps=("norm_q", "norm_k", "norm_ip_k"),  # q, k_img, k_ip as the stock branch forms them
        swap_taps=("attn.to_q", "attn.to_k", "attn.to_v"),
        swap_site="to_out",
        every_pass=False,  # skip-layer guidance's further pass is not recorded
    )

    joint_rows: int = 256
    """Query rows (evenly spaced) on which the joint-key-set statistics and ``ip_mass`` are taken."""

    def __init__(
        self,
        original: SD3IPAdapterJointAttnProcessor2_0,
        *,
        layer_name: str,
        config: NWProcessorConfig,
        recorder: NWRecorder,
    ) -> None:
        self._adopt(original, layer_name=layer_name, config=config, recorder=recorder)

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.FloatTensor,
        encoder_hidden_states: torch.FloatTensor = None,
        attention_mask: torch.FloatTensor | None = None,
        ip_hidden_states: torch.FloatTensor = None,
        temb: torch.FloatTensor = None,
    ) -> torch.FloatTensor:
        """Stock SD3 IP-Adapter attention plus the NW side computation (module docstring and
        :meth:`~nw_adapter.integration.processors.base.NWProcessorBase._nw_call`).

        Args: as diffusers' ``SD3IPAdapterJointAttnProcessor2_0``.

        Returns:
            As the stock processor: identical in observe mode; in swap mode the image branch is
            the Gaussian-kernel head.
        """
        return self._nw_call(
            attn, (hidden_states, encoder_hidden_states, attention_mask, ip_hidden_states, temb)
        )

    # ------------------------------------------------------------------ what the skeleton asks
    def _image_inputs(self, args: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(ip_hidden_states, temb)``; None when the stock call has no image branch (no IP states,
        or scale 0)."""
        ip_hidden_states = args[3]
        if ip_hidden_states is None or self.scale == 0:
            return None
        return ip_hidden_states, args[4]

    def _without_branch(self, args: tuple) -> tuple:
        """The stock arguments without ``ip_hidden_states``: diffusers skips its image branch."""
        return (*args[:3], None, args[4])

    def _swap(
        self,
        ctx: StepContext,
        attn: Attention,
        inputs: tuple[torch.Tensor, torch.Tensor],
        captured: dict,
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        """``hidden + scale * GKA(q, k, v, h)`` ``[B, N, H*d]``: the stock branch's SDPA over the joint
        keys replaced (q, k, v formed with the stock modules from the captured projections); the
        normalised q, k_img, k_ip are kept in ``captured["swap"]`` for the statistics."""
        ip_hidden_states, temb = inputs
        heads = attn.heads
        ip = self.norm_ip(ip_hidden_states, temb=temb)
        q = self.norm_q(split_heads(captured["attn.to_q"][0], heads))
        k_img = self.norm_k(split_heads(captured["attn.to_k"][0], heads))
        k_ip = self.norm_ip_k(split_heads(self.to_k_ip(ip), heads))
        key = torch.cat([k_img, k_ip], dim=2)
        value = torch.cat(
            [split_heads(captured["attn.to_v"][0], heads), split_heads(self.to_v_ip(ip), heads)], 2
        )
        captured["swap"] = (q, k_img, k_ip)  # the branch's own q and keys, for the statistics
        s = 1.0 / math.sqrt(q.shape[-1])
        h = captured["swap h"] = self._bandwidth(q, key, s, ctx)
        out = self._gaussian_head(q, key, value, h)
        batch, _, rows, head_dim = out.shape
        return hidden + out.transpose(1, 2).reshape(batch, rows, heads * head_dim).to(q.dtype) * self.scale

    def _softmaxes(
        self,
        attn: Attention,
        inputs: tuple[torch.Tensor, torch.Tensor],
        captured: dict,
        heads: tuple[int, ...],
    ) -> list[Softmax]:
        """The "ip" and "joint" comparisons of q [B, H, N, d], k_img [B, H, N, d], k_ip [B, H, M, d]
        (as the stock branch forms them: the observe taps, or swap's own), with ``ip_mass``; the
        "ip" comparison also against the untrained adapters' IP keys (every draw) when the control
        is on. In swap both are the swapped branch's own softmax, the exact NW head over the joint
        keys (restricted to the IP keys and renormalised for "ip": the NW head over them at the
        same h), and ``ip_mass`` is that head's mass on the IP keys."""
        swap_h = None
        if "swap" in captured:
            q_all, k_img_all, k_ip_all = captured["swap"]
            swap_h = captured["swap h"]
        else:
            q_all, k_img_all, k_ip_all = (captured[name][0] for name in self.spec.observe_taps)
        q = self._pick(q_all, heads, attn.heads)
        k_img = self._pick(k_img_all, heads, attn.heads)
        k_ip = self._pick(k_ip_all, heads, attn.heads)
        s = 1.0 / math.sqrt(q.shape[-1])
        rows = spread_rows(q.shape[-2], self.joint_rows, q.device)
        q_rows = q if rows is None else q.index_select(2, rows)
        if swap_h is None:
            logits_img = (q_rows @ k_img.transpose(-1, -2)) * s  # [B, H, R, N]
            logits_ip = (q_rows @ k_ip.transpose(-1, -2)) * s  # [B, H, R, M]
        else:  # the exact head's logits (q.k - ||k||^2 / 2) / h^2
            if isinstance(swap_h, torch.Tensor):
                swap_h = self._pick(swap_h[..., None, None], heads, attn.heads)[..., 0, 0]
            inv = swap_h.float()[..., None, None] ** -2 if isinstance(swap_h, torch.Tensor) else swap_h**-2
            logits_img = (q_rows @ k_img.transpose(-1, -2) - 0.5 * k_img.square().sum(-1)[..., None, :]) * inv
            logits_ip = (q_rows @ k_ip.transpose(-1, -2) - 0.5 * k_ip.square().sum(-1)[..., None, :]) * inv
        lse_ip = logits_ip.logsumexp(dim=-1)
        lse_all = torch.logaddexp(logits_img.logsumexp(dim=-1), lse_ip)
        ip_mass = (lse_ip - lse_all).exp().mean(dim=-1)  # [B, H]: sum_{i in IP} A_ni over the rows
        scale = self.scale
        control = self._untrained_wanted()
        keys0 = []
        for d in range(control.draws if control is not None else 0):
            states0 = control.projected(d).states[0]
            keys0.append(self._pick(control.keys(self.layer_name, states0, draw=d), heads, attn.heads))
        k_joint = torch.cat([k_img, k_ip], dim=2)
        return [
            Softmax(q, k_ip, s, scale, ip_mass=ip_mass, maps=True, control_keys=tuple(keys0), swap_h=swap_h),
            Softmax(q_rows, k_joint, s, scale, key_set="joint", ip_mass=ip_mass, swap_h=swap_h),
        ]


def is_sd3_ip_processor(processor: Any) -> bool:
    """Whether ``processor`` is diffusers' SD3 IP-Adapter processor (stock or NW)."""
    return isinstance(processor, SD3IPAdapterJointAttnProcessor2_0)
