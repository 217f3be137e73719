"""NW processor for Flux IP-Adapter layers (diffusers' ``FluxIPAdapterAttnProcessor``, XLabs adapter).

The stock image branch of a double-stream block, read from diffusers' code:

    q        = norm_q(to_q(x))                      [B, N, H, d]  (RMSNorm per head, before RoPE)
    k_j, v_j = to_k_ip[j](ip_j), to_v_ip[j](ip_j)   [B, M_j, H, d] (no norm on the IP keys)
    ip_out   = sum_j scale_j * SDPA(q, k_j, v_j)     returned as the processor's third output

a separate softmax per adapter over its IP tokens (M_j = images x tokens), with the
RMS-normalised query and un-normalised IP keys; the block adds ``ip_out`` to its hidden states.
Single-stream blocks carry no IP-Adapter.

Observe: the taps' forward hook on ``attn.norm_q`` (called once per processor call; registered at
the first call, armed during ``super().__call__`` only) captures q exactly as the stock branch
uses it; ``super().__call__``'s output is returned untouched. Each adapter's
softmax is compared with the NW weights over its keys (recomputed with the stock ``to_k_ip``).

Swap: ``super().__call__`` runs with an empty list of IP states (its image-branch output is then
zeros) and ``ip_out`` becomes sum_j scale_j GKA(q, k_j, v_j, h),
GKA(q, k, v, h)_n = sum_i softmax_i(-||q_n - k_i||^2 / 2h^2) v_i.

CFG halves: Flux has no [uncond; cond] batch. With true CFG (``true_cfg_scale > 1`` and a negative
prompt) the pipeline runs the transformer twice per step, positive then negative; the recorder
counts both passes as one step and exposes the pass index, and the records of the positive pass
are labelled ``"cond"``, those of the negative pass ``"uncond"`` (a single pass is ``"cond"``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

from nw_adapter.integration import support
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.processors.base import BranchSpec, NWProcessorBase, Softmax
from nw_adapter.integration.recorder import NWRecorder
from nw_adapter.integration.steps import StepContext


class NWFluxIPAdapterAttnProcessor(NWProcessorBase, FluxIPAdapterAttnProcessor):
    """NW processor over diffusers' Flux IP-Adapter processor (see the module docstring).

    Args:
        original: the ``FluxIPAdapterAttnProcessor`` being replaced; ``to_k_ip`` / ``to_v_ip``
            are shared and its ``scale`` is the one read and set.
        layer_name: the processor's name (a key of ``transformer.attn_processors``).
        config: the :class:`~nw_adapter.integration.config.NWProcessorConfig`.
        recorder: the :class:`~nw_adapter.integration.recorder.NWRecorder`.

    Example:
        >>> rec = apply_nw_processor(flux_pipe, mode="observe")  # after flux_pipe.load_ip_adapter(...)
        >>> flux_pipe("a cat", ip_adapter_image=ref, true_cfg_scale=4.0, negative_prompt="blurry")
        >>> {r["half"] for r in rec.to_records()}
        {'cond', 'uncond'}
    """

    _shared_modules = ("to_k_ip", "to_v_ip")
    spec = BranchSpec(
        observe_taps=("attn.norm_q",),  # the image branch's query, RMS-normalised
        swap_taps=("attn.norm_q",),
        swap_site="output",  # the image branch is the processor's third output
        halves_by_pass=True,  # true CFG: the positive pass is "cond", the negative one "uncond"
    )

    def __init__(
        self,
        original: FluxIPAdapterAttnProcessor,
        *,
        layer_name: str,
        config: NWProcessorConfig,
        recorder: NWRecorder,
    ) -> None:
        self._adopt(original, layer_name=layer_name, config=config, recorder=recorder)

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
        ip_hidden_states: list[torch.Tensor] | None = None,
        ip_adapter_masks: torch.Tensor | None = None,
    ) -> Any:
        """Stock Flux IP-Adapter attention plus the NW side computation (module docstring and
        :meth:`~nw_adapter.integration.processors.base.NWProcessorBase._nw_call`).

        Args: as diffusers' ``FluxIPAdapterAttnProcessor``.

        Returns:
            ``(hidden_states, encoder_hidden_states, ip_attn_output)`` as the stock processor;
            in swap mode ``ip_attn_output`` is the Gaussian-kernel head's.
        """
        return self._nw_call(
            attn, (hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, ip_hidden_states,
                   ip_adapter_masks),
        )  # fmt: skip

    # ------------------------------------------------------------------ what the skeleton asks
    def _image_inputs(self, args: tuple) -> tuple[Sequence[torch.Tensor], list[Any]] | None:
        """``(ip_hidden_states, scales)``: each adapter's IP states and scale; None without IP
        states or text stream (a single-stream call: no image branch)."""
        ip_hidden_states = args[4]
        if not ip_hidden_states or args[1] is None:
            return None
        return ip_hidden_states, list(self.scale)

    def _without_branch(self, args: tuple) -> tuple:
        """The stock arguments with an empty list of IP states (the stock image output is zeros)."""
        return (*args[:4], [], args[5])

    def _swap(
        self,
        ctx: StepContext,
        attn: Any,
        inputs: tuple[Sequence[torch.Tensor], list[Any]],
        captured: dict,
        out: tuple,
    ) -> tuple:
        """The stock output with ``sum_j scale_j * GKA(q, k_j, v_j, h)`` ``[B, N, H*d]`` added to its
        (zero) image-branch output."""
        ip_hidden_states, scales = inputs
        text_out, context_out, ip_out = out
        q = self._query(captured)
        keys = self._keys(ip_hidden_states, attn.heads)
        s = 1.0 / math.sqrt(q.shape[-1])
        total = torch.zeros(q.shape[0], q.shape[2], q.shape[1] * q.shape[3], dtype=q.dtype, device=q.device)
        bandwidths = captured["swap h"] = {}  # per adapter: the branch's bandwidth, for the statistics
        for j, (key, states, scale) in enumerate(zip(keys, ip_hidden_states, scales, strict=True)):
            value = self._split(self.to_v_ip[j](states), attn.heads)
            h = bandwidths[j] = self._bandwidth(q, key, s, ctx)
            branch = self._gaussian_head(q, key, value, h)
            total = total + scale * branch.transpose(1, 2).flatten(2).to(q.dtype)
        return text_out, context_out, ip_out + total

    def _softmaxes(
        self,
        attn: Any,
        inputs: tuple[Sequence[torch.Tensor], list[Any]],
        captured: dict,
        heads: tuple[int, ...],
    ) -> list[Softmax]:
        """Each adapter's softmax (q [B, H, N, d] against its keys), with the untrained-adapter
        control's keys (every draw) when the control is on."""
        ip_hidden_states, scales = inputs
        heads_n = attn.heads
        keys = self._keys(ip_hidden_states, heads_n)
        q = self._pick(self._query(captured), heads, heads_n)
        s = 1.0 / math.sqrt(q.shape[-1])
        control = self._untrained_wanted()
        draws = range(control.draws) if control is not None else range(0)
        bandwidths = captured.get("swap h", {})  # swap: each adapter's branch is recorded as itself
        softmaxes = []
        for j, (key, scale, states) in enumerate(zip(keys, scales, ip_hidden_states, strict=False)):
            k = self._pick(key, heads, heads_n)
            keys0 = tuple(
                self._pick(control.keys(self.layer_name, control.projected(d).states[j], adapter=j, draw=d),
                           heads, heads_n)
                for d in draws
            )  # fmt: skip
            softmaxes.append(Softmax(
                q, k, s, scale, adapter=j, maps=True, control_keys=keys0,
                references=support.reference_count(states), swap_h=bandwidths.get(j),
            ))  # fmt: skip
        return softmaxes

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _query(captured: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        """The image branch's query ``[B, H, N, d]`` (``attn.norm_q``'s output is ``[B, N, H, d]``)."""
        return captured["attn.norm_q"][0].transpose(1, 2)

    def _keys(self, ip_hidden_states: Sequence[torch.Tensor], heads: int) -> list[torch.Tensor]:
        """Each adapter's IP keys ``[B, H, M_j, d]``, as the stock branch forms them."""
        return [self._split(self.to_k_ip[j](states), heads) for j, states in enumerate(ip_hidden_states)]

    @staticmethod
    def _split(x: torch.Tensor, heads: int) -> torch.Tensor:
        """``[B, ..., M, H*d]`` (images x tokens flattened, as diffusers' ``view``) -> ``[B, H, M', d]``."""
        return x.reshape(x.shape[0], -1, heads, x.shape[-1] // heads).transpose(1, 2)


def is_flux_ip_processor(processor: Any) -> bool:
    """Whether ``processor`` is diffusers' Flux IP-Adapter processor (stock or NW)."""
    return isinstance(processor, FluxIPAdapterAttnProcessor)
