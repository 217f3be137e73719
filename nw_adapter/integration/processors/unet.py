"""NW attention processors: diffusers' IP-Adapter processors plus a side computation.

The processors subclass :class:`~diffusers.models.attention_processor.IPAdapterAttnProcessor2_0`
and :class:`~diffusers.models.attention_processor.IPAdapterAttnProcessor` and always produce
the layer output by calling ``super().__call__`` (no copy of diffusers' attention code). They
share ``to_k_ip``, ``to_v_ip``, ``scale`` and ``num_tokens`` (the same objects) with the
processor they replace (``scale`` forwarded, see :mod:`~nw_adapter.integration.processors.base`), so
``set_ip_adapter_scale``, IP masks, several adapters and ``unload_ip_adapter`` keep working.

How the side computation gets its inputs, without recomputing the query projection:

- ``q`` [B, H, N, d] is the output of ``attn.to_q`` captured by the processor's taps (a forward
  hook on ``attn.to_q`` registered at the first call, armed during ``super().__call__`` only:
  :class:`~nw_adapter.integration.processors.base.Taps`); it already includes ``spatial_norm``,
  ``group_norm`` and the flattening of 4-D inputs.
- ``k_ip`` [B, H, M, d] is the output of ``to_k_ip[j]`` captured the same way (one forward hook
  per adapter, one output per softmax of the stock branch; M = 4 or 16 tokens per image), or
  ``to_k_ip[j](image tokens)`` computed here when the stock branch skipped the adapter (scale
  0) or in swap mode. Without an IP mask an adapter's images form one softmax over
  M = num_images x num_tokens keys (as in diffusers); with a mask every image is its own softmax.

``observe``: the output of ``super().__call__`` is returned untouched (bit-identical); then
A = softmax(q k^T * s) (s = 1/sqrt(d) for SDPA, ``attn.scale`` for the classic processor) and
W = NW weights(q, k, h) are reduced over query rows to per-(batch row, head) statistics, averaged
within each CFG half, and handed to the recorder as device tensors.

``swap``: ``super().__call__`` runs with every adapter scale set to 0 (so diffusers skips its
image branch) and a forward pre-hook on ``attn.to_out[0]`` adds the NW image branch to the
input of the output projection:

    to_out(text_attn + sum_j sum_i scale_ji * mask_ji * GKA(q, k_ji, v_ji, h)),

GKA(q, k, v, h)_n = sum_i softmax_i(-||q_n - k_i||^2 / 2h^2) v_i (THEORY.md section 3). Dropout,
the reshape of 4-D inputs, ``residual_connection`` and ``rescale_output_factor`` are then applied
by diffusers' own code, exactly as for the stock branch.

Failures: in observe a side computation that raises never fails the layer: the stock output is
returned, the recorder drops what the layer stored at that step, counts the (step, layer) pair
with its reason and warns once (:meth:`~nw_adapter.integration.recorder.NWRecorder.skip`). In
swap the output depends on the NW branch, so its failure raises a RuntimeError naming the layer.
Both, the call sequence, the head selection, the CFG halves and the statistics of each softmax are
the base's (:class:`~nw_adapter.integration.processors.base.NWProcessorBase`); this module finds
q, k and the softmax groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from diffusers.image_processor import IPAdapterMaskProcessor
from diffusers.models.attention_processor import (
    Attention,
    IPAdapterAttnProcessor,
    IPAdapterAttnProcessor2_0,
)

from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.processors.base import (
    BranchSpec,
    NWProcessorBase,
    Softmax,
    element_tap,
    split_heads,
)
from nw_adapter.integration.recorder import NWRecorder
from nw_adapter.integration.steps import StepContext

#: The taps' names of the first adapters' key projections (:meth:`~.base.NWProcessorBase._tap_modules`),
#: made once for the hot path (:func:`~.base.element_tap` for more adapters).
_K_IP_TAPS = tuple(element_tap("to_k_ip", j) for j in range(8))


def _is_zero(scale: float | Sequence[float]) -> bool:
    if isinstance(scale, (list, tuple)):
        return all(s == 0 for s in scale)
    return scale == 0


class _Group:
    """One softmax of the image branch: adapter j, image i (or all images pooled, i = 0).

    ``states`` ``[batch, M, D]``: the image states folded to the latent batch, made from the raw
    ``[B', (images,) T, D]`` states when first read (observe reads the keys its taps captured and
    never needs them)."""

    __slots__ = (
        "adapter", "image", "_raw", "_batch", "_states", "scale", "mask", "key", "value", "references", "h",
    )  # fmt: skip

    def __init__(
        self,
        adapter: int,
        image: int,
        states: torch.Tensor,
        scale: float,
        mask: torch.Tensor | None,
        references: int = 1,
        batch: int | None = None,
    ):
        self.adapter, self.image, self.scale, self.mask = adapter, image, scale, mask
        # folded on first read when ``batch`` is given, else already [batch, M, D]
        self._raw, self._batch, self._states = states, batch, None if batch is not None else states
        self.references = references  # reference images whose tokens are the keys (a support set)
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None
        self.h: float | torch.Tensor | None = None  # swap's bandwidth for this group

    @property
    def states(self) -> torch.Tensor:
        if self._states is None:
            self._states = self._raw.reshape(self._batch, -1, self._raw.shape[-1])
        return self._states


class UNetInputs(NamedTuple):
    """A UNet layer call's image-branch inputs: each adapter's image states ``[B, (images,) T, D]``,
    its IP mask ``[1, images, h, w]`` or None, and its scale (the stock list, copied)."""

    ip_hidden_states: Sequence[torch.Tensor]
    masks: Sequence[Any]
    scales: list[Any]


class _UNetNWProcessor(NWProcessorBase):
    """What the two UNet NW processors share (see the module docstring)."""

    _shared_modules = ("to_k_ip", "to_v_ip")
    spec = BranchSpec(
        observe_taps=("attn.to_q", "to_k_ip"),  # the queries and the stock branch's image keys
        swap_taps=("attn.to_q",),
        swap_site="to_out",
        mute_by="scale",  # diffusers still validates the IP masks of the call
    )
    to_k_ip: torch.nn.ModuleList
    to_v_ip: torch.nn.ModuleList

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        scale: float = 1.0,
        ip_adapter_masks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Stock IP-Adapter attention plus the NW side computation (see the module docstring and
        :meth:`~nw_adapter.integration.processors.base.NWProcessorBase._nw_call`).

        Args: as diffusers' IP-Adapter processors.

        Returns:
            The layer output: identical to the stock processor's in observe mode; with the image
            branch replaced by the Gaussian-kernel head in swap mode.
        """
        return self._nw_call(
            attn, (hidden_states, encoder_hidden_states, attention_mask, temb, scale, ip_adapter_masks)
        )

    # ------------------------------------------------------------------ what the skeleton asks
    def _image_inputs(self, args: tuple) -> UNetInputs | None:
        """The IP states of ``encoder_hidden_states = (text, [states_j])``, the masks per adapter
        and the scales; None without IP states (a tensor: no image branch to look at)."""
        encoder_hidden_states, ip_adapter_masks = args[1], args[5]
        if not isinstance(encoder_hidden_states, tuple):
            return None
        scales = list(self.scale)
        if ip_adapter_masks is None:
            masks: list[Any] = [None] * len(scales)
        elif isinstance(ip_adapter_masks, list):
            masks = ip_adapter_masks
        else:
            masks = list(ip_adapter_masks.unsqueeze(1))
        return UNetInputs(encoder_hidden_states[1], masks, scales)

    def _swap(
        self, ctx: StepContext, attn: Attention, inputs: UNetInputs, captured: dict, hidden: torch.Tensor
    ) -> torch.Tensor:
        """``hidden + sum_g scale_g * mask_g * GKA(q, k_g, v_g, h)``: the NW image branch added to
        the text attention output ``hidden`` [B, N, H*d] (the input of ``to_out[0]``).

        Built to cost what the stock image branch costs. Per softmax group (no IP mask, float32):
        the key and value projections on 2-D token rows (a bare ``mm`` each; diffusers' 3-D call
        adds a reshape copy after each), the head of :meth:`~.base.NWProcessorBase._nw_head` (one
        ``baddbmm`` for the per-key bias and one SDPA call on the untouched queries) and one
        fused ``torch.add(hidden, out, alpha=scale)``, against the stock branch's two projections,
        SDPA, scale multiply and add (``tests/integration/test_swap_cost.py``). Without IP masks
        (one softmax per adapter) no group objects are made (~3 ms less CPU per call of the host-cost
        proxy) and the adapters' keys are kept in ``captured["swap keys"]``; with masks the groups,
        with their keys, in ``captured["groups"]``: the statistics read them there.
        """
        q_raw = captured["attn.to_q"][0]
        batch, rows, inner = q_raw.shape
        heads = attn.heads
        q = q_raw.view(batch, rows, heads, inner // heads).transpose(1, 2)  # split_heads, inline
        s = self.attention_scale(attn, inner // heads)
        if not any(m is not None for m in inputs.masks):  # one softmax per adapter, no group objects
            keys = captured["swap keys"] = {}  # the adapters' keys and bandwidths, for the statistics
            bandwidths = captured["swap h"] = {}
            for j, (states, scale) in enumerate(zip(inputs.ip_hidden_states, inputs.scales, strict=False)):
                if _is_zero(scale):
                    continue
                tokens = states.reshape(-1, states.shape[-1])  # [B*M, cross]
                k = keys[j] = self.to_k_ip[j](tokens).view(batch, -1, heads, inner // heads).transpose(1, 2)
                v = self.to_v_ip[j](tokens).view(batch, -1, heads, inner // heads).transpose(1, 2)
                h = bandwidths[j] = self._bandwidth(q, k, s, ctx)
                out = self._nw_head(q, k, v, h)
                out = out.transpose(1, 2).reshape(batch, rows, inner).to(hidden.dtype)
                hidden = torch.add(hidden, out, alpha=scale)
            return hidden
        groups = self._groups(inputs.ip_hidden_states, inputs.masks, inputs.scales, batch)
        captured["groups"] = groups
        for g in groups:
            if _is_zero(g.scale):
                continue
            tokens = g.states.reshape(-1, g.states.shape[-1])  # [B*M, cross]
            g.key = split_heads(self.to_k_ip[g.adapter](tokens).view(batch, -1, inner), attn.heads)
            g.value = split_heads(self.to_v_ip[g.adapter](tokens).view(batch, -1, inner), attn.heads)
            g.h = self._bandwidth(q, g.key, s, ctx)
            out = self._nw_head(q, g.key, g.value, g.h)
            out = out.transpose(1, 2).reshape(batch, rows, inner).to(hidden.dtype)
            if g.mask is not None:
                out = out * self._mask_factor(g.mask, batch, rows, inner, out)
            hidden = torch.add(hidden, out, alpha=g.scale)
        return hidden

    def _softmaxes(
        self, attn: Attention, inputs: UNetInputs, captured: dict, heads: tuple[int, ...]
    ) -> list[Softmax]:
        """Every softmax group of the image branch (q [B, H, N, d] against its keys), with the
        untrained-adapter control's keys of the same group, per draw, when the control is on."""
        q_raw = captured["attn.to_q"][0]
        batch = q_raw.shape[0]
        q = self._pick(split_heads(q_raw, attn.heads), heads, attn.heads)
        s = self.attention_scale(attn, q.shape[-1])
        masks, scales = inputs.masks, inputs.scales
        control = self._untrained_wanted()
        if control is None and "groups" not in captured and not any(m is not None for m in masks):
            return self._unmasked_softmaxes(attn, inputs, captured, q, s, heads)
        groups = captured.get("groups") or self._groups(inputs.ip_hidden_states, masks, scales, batch)
        # per draw, the untrained states grouped as the trained branch groups its own
        per_draw = [] if control is None else [
            self._groups(control.projected(d).states, masks, scales, batch) for d in range(control.draws)
        ]  # fmt: skip
        softmaxes = []
        for gi, g in enumerate(groups):
            k = self._pick(self._image_key(attn, g, captured, batch), heads, attn.heads)
            keys0 = () if not per_draw else tuple(
                self._pick(control.keys(self.layer_name, draw[gi].states, adapter=draw[gi].adapter, draw=d),
                           heads, attn.heads)
                for d, draw in enumerate(per_draw)
            )  # fmt: skip
            swap_h = g.h
            if swap_h is None and g.mask is None:  # swap without masks: the adapter's branch bandwidth
                swap_h = captured.get("swap h", {}).get(g.adapter)
            softmaxes.append(Softmax(
                q, k, s, g.scale, adapter=g.adapter, image=g.image, maps=True, control_keys=keys0,
                references=g.references, swap_h=swap_h,
            ))  # fmt: skip
        return softmaxes

    def _unmasked_softmaxes(
        self, attn: Attention, inputs: UNetInputs, captured: dict, q: torch.Tensor, s: float,
        heads: tuple[int, ...],
    ) -> list[Softmax]:  # fmt: skip
        """:meth:`_softmaxes` without IP masks and without the control: one softmax per adapter, its
        keys swap's or the stock branch's (the taps'), else (the stock branch skipped an adapter of
        scale 0) projected here; no group objects (the common case, per layer call at the flush)."""
        batch, softmaxes = q.shape[0], []
        swapped, bandwidths = captured.get("swap keys", {}), captured.get("swap h", {})
        for j, (states, scale) in enumerate(zip(inputs.ip_hidden_states, inputs.scales, strict=False)):
            outputs = captured.get(_K_IP_TAPS[j] if j < len(_K_IP_TAPS) else element_tap("to_k_ip", j), ())
            if j in swapped:
                k = swapped[j]
            elif outputs:  # [B', (images,) M', H*d]: folded to [batch, M, H*d]
                key = outputs[0]
                key = key if key.dim() == 3 and key.shape[0] == batch else key.view(batch, -1, key.shape[-1])
                k = split_heads(key, attn.heads)
            else:  # the stock branch skipped this adapter (scale 0): projected here
                k = split_heads(self.to_k_ip[j](states.reshape(batch, -1, states.shape[-1])), attn.heads)
            pooled = states.numel() // (batch * states.shape[-1])  # the folded states' M
            tokens = states.shape[-2] if states.dim() == 4 else pooled
            softmaxes.append(Softmax(
                q, self._pick(k, heads, attn.heads), s, scale, adapter=j, image=0, maps=True,
                references=pooled // tokens, swap_h=bandwidths.get(j),
            ))  # fmt: skip
        return softmaxes

    # ------------------------------------------------------------------ helpers
    def attention_scale(self, attn: Attention, head_dim: int) -> float:
        """The softmax scale s of the stock image branch (1 / sqrt(d) for SDPA)."""
        return 1.0 / math.sqrt(head_dim)

    def _groups(
        self,
        ip_hidden_states: Sequence[torch.Tensor],
        masks: Sequence[Any],
        scales: Sequence[Any],
        batch: int,
    ) -> list[_Group]:
        """One :class:`_Group` per softmax of the image branch, with states ``[batch, M, D]``.

        ``states`` is folded to the latent batch exactly as diffusers' ``ip_key.view(batch_size,
        -1, heads, head_dim)`` does: when the image-embeds batch differs from the latent batch
        (e.g. 2 rows of CFG-layout embeds for a batch of 1 without CFG, as in diffusers'
        ``IPAdapterTesterMixin.test_ip_adapter_masks`` on LCM), the extra rows become extra keys.
        Without a mask an adapter's images are pooled into one softmax; with a mask every image
        is its own softmax (``states[:, i]``).
        """
        groups = []
        for j, (states, scale, mask) in enumerate(zip(ip_hidden_states, scales, masks, strict=False)):
            if mask is not None:
                per_image = scale if isinstance(scale, (list, tuple)) else [scale] * mask.shape[1]
                for i in range(mask.shape[1]):
                    image_states = states[:, i].reshape(batch, -1, states.shape[-1])
                    groups.append(_Group(j, i, image_states, per_image[i], mask[:, i]))
            else:
                # m images of T tokens, reference-major; a folded extra embeds batch (see above)
                # adds its rows as further references of T tokens each
                pooled = states.numel() // (batch * states.shape[-1])  # the folded states' M
                tokens = states.shape[-2] if states.dim() == 4 else pooled
                groups.append(_Group(j, 0, states, scale, None, references=pooled // tokens, batch=batch))
        return groups

    def _mask_factor(self, mask: torch.Tensor, batch: int, rows: int, inner: int, like: torch.Tensor):
        down = IPAdapterMaskProcessor.downsample(mask, batch, rows, inner)
        return down.to(dtype=like.dtype, device=like.device)

    def _image_key(self, attn: Attention, g: _Group, captured: dict, batch: int) -> torch.Tensor:
        """``k`` [B, H, M, d] of one softmax: the stock branch's own projection when it ran (observe;
        captured by the taps), the swap branch's, or ``to_k_ip`` applied here."""
        if g.key is not None:
            return g.key
        swapped = captured.get("swap keys", {}).get(g.adapter) if g.mask is None else None
        if swapped is not None:  # swap's own projection of this adapter (no mask: one softmax)
            return swapped
        tap = _K_IP_TAPS[g.adapter] if g.adapter < len(_K_IP_TAPS) else element_tap("to_k_ip", g.adapter)
        outputs = captured.get(tap, ())
        position = g.image if g.mask is not None else 0
        if position < len(outputs):
            key = outputs[position]  # [B', (images,) M', H*d]: folded to [batch, M, H*d]
            folded = key if key.dim() == 3 and key.shape[0] == batch else key.view(batch, -1, key.shape[-1])
            return split_heads(folded, attn.heads)
        return split_heads(self.to_k_ip[g.adapter](g.states), attn.heads)


class NWIPAdapterAttnProcessor2_0(_UNetNWProcessor, IPAdapterAttnProcessor2_0):
    """NW processor over diffusers' SDPA IP-Adapter processor (see the module docstring).

    A subclass: ``isinstance(p, IPAdapterAttnProcessor2_0)`` holds, so diffusers' loaders
    (``set_ip_adapter_scale``, ``unload_ip_adapter``) treat it as the stock processor, but code
    that compares the class name (``type(p).__name__ == "IPAdapterAttnProcessor2_0"``, as some
    of diffusers' own model tests do) does not recognise it: test with ``isinstance``.

    Args:
        original: the ``IPAdapterAttnProcessor2_0`` being replaced; its ``to_k_ip``, ``to_v_ip``,
            ``scale`` and ``num_tokens`` are shared, not copied.
        layer_name: the attention-processor name (a key of ``unet.attn_processors``).
        config: the :class:`~nw_adapter.integration.config.NWProcessorConfig`.
        recorder: the :class:`~nw_adapter.integration.recorder.NWRecorder` receiving the statistics.

    Example:
        >>> from diffusers.models.attention_processor import Attention, IPAdapterAttnProcessor2_0
        >>> attn = Attention(32, cross_attention_dim=24, heads=2, dim_head=16)
        >>> stock = IPAdapterAttnProcessor2_0(32, 24, num_tokens=(4,))
        >>> rec = NWRecorder(NWProcessorConfig())
        >>> nw = NWIPAdapterAttnProcessor2_0(stock, layer_name="l", config=rec.config, recorder=rec)
        >>> attn.set_processor(nw)
    """

    def __init__(
        self,
        original: IPAdapterAttnProcessor2_0,
        *,
        layer_name: str,
        config: NWProcessorConfig,
        recorder: NWRecorder,
    ) -> None:
        self._adopt(original, layer_name=layer_name, config=config, recorder=recorder)


class NWIPAdapterAttnProcessor(_UNetNWProcessor, IPAdapterAttnProcessor):
    """NW processor over diffusers' classic (non-SDPA) IP-Adapter processor.

    Same arguments as :class:`NWIPAdapterAttnProcessor2_0`; the softmax scale of A is
    ``attn.scale`` (what ``attn.get_attention_scores`` uses). A subclass of
    ``IPAdapterAttnProcessor``: ``isinstance`` holds, a class-name comparison does not.
    """

    def __init__(
        self,
        original: IPAdapterAttnProcessor,
        *,
        layer_name: str,
        config: NWProcessorConfig,
        recorder: NWRecorder,
    ) -> None:
        self._adopt(original, layer_name=layer_name, config=config, recorder=recorder)

    def attention_scale(self, attn: Attention, head_dim: int) -> float:
        """``attn.scale``, the scale of ``attn.get_attention_scores``."""
        return float(attn.scale)


def nw_processor_for(
    original: torch.nn.Module, *, layer_name: str, config: NWProcessorConfig, recorder: NWRecorder
) -> torch.nn.Module:
    """The NW processor that replaces ``original`` (an IP-Adapter processor of diffusers).

    Raises:
        ValueError: if ``original`` is not an ``IPAdapterAttnProcessor(2_0)``.
    """
    if isinstance(original, NWProcessorBase):
        raise ValueError(f"layer {layer_name!r} already has an NW processor; unset it first")
    if isinstance(original, IPAdapterAttnProcessor2_0):
        return NWIPAdapterAttnProcessor2_0(original, layer_name=layer_name, config=config, recorder=recorder)
    if isinstance(original, IPAdapterAttnProcessor):
        return NWIPAdapterAttnProcessor(original, layer_name=layer_name, config=config, recorder=recorder)
    raise ValueError(
        f"layer {layer_name!r} has {type(original).__name__}, not an IP-Adapter processor; "
        "call pipe.load_ip_adapter(...) first"
    )
