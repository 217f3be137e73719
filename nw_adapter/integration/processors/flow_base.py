"""What the SD3 and Flux NW processors share: adoption of the stock processor and the record step.

Both flow-matching families replace one diffusers IP-Adapter processor per transformer block.
The NW processor *adopts* the stock one: it registers the stock processor's modules (the same
objects: ``to_k_ip``, ``to_v_ip`` and, for SD3, the norms) so its ``state_dict`` is the stock
one, and it forwards the attribute ``scale`` to the stock processor, because diffusers'
``set_ip_adapter_scale`` of both families *assigns* ``processor.scale`` (it does not edit a
shared list): the scale set while the NW processor is installed is the one the stock processor
has after removal. diffusers' ``unload_ip_adapter`` and ``is_ip_adapter_active`` find the NW
processors through ``isinstance`` (they are subclasses).

The statistics of one softmax are computed by
:func:`~nw_adapter.integration.processors.side.softmax_statistics` (shared with the UNet
family); this module only selects heads, averages each CFG half and hands the result to the
recorder.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nw_adapter.core import kernels
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.processors import side
from nw_adapter.integration.recorder import NWRecorder

HALF_LABELS = {1: ("all",), 2: ("uncond", "cond")}


class FlowNWProcessorBase:
    """Mixin placed before a diffusers IP-Adapter processor class (SD3 or Flux).

    Subclasses call :meth:`_adopt` from ``__init__`` and list the stock modules to share in
    ``_shared_modules``.
    """

    _shared_modules: tuple[str, ...] = ()

    def _adopt(
        self, original: torch.nn.Module, *, layer_name: str, config: NWProcessorConfig, recorder: NWRecorder
    ) -> None:
        torch.nn.Module.__init__(self)  # the parent __init__ would allocate fresh projections
        self.__dict__["_nw_original"] = original  # not a submodule: no duplicate state_dict keys
        for name in self._shared_modules:
            setattr(self, name, getattr(original, name))
        for name in ("hidden_size", "cross_attention_dim"):
            if hasattr(original, name):
                self.__dict__[name] = getattr(original, name)
        self.layer_name = layer_name
        self.nw_config = config
        self.recorder = recorder

    @property
    def original(self) -> torch.nn.Module:
        """The stock processor this one replaced (restored by ``remove_nw_processor``)."""
        return self.__dict__["_nw_original"]

    @property
    def scale(self) -> Any:
        """The stock processor's ``scale`` (a float for SD3, a list per adapter for Flux)."""
        return self.original.scale

    @scale.setter
    def scale(self, value: Any) -> None:
        self.original.scale = value

    # ------------------------------------------------------------------ selection
    def _selection(self) -> tuple[bool, bool]:
        """(record, swap) at the current step."""
        selected = self.recorder.wants_step()
        return self.nw_config.record_statistics and selected, self.nw_config.mode == "swap" and selected

    def _heads(self, num_heads: int) -> tuple[int, ...]:
        wanted = self.nw_config.heads
        return tuple(range(num_heads)) if wanted is None else tuple(h for h in wanted if h < num_heads)

    def _index(self, values: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A cached index tensor on ``device`` (no host-to-device copy after the first step)."""
        cache = self.__dict__.setdefault("_index_cache", {})
        if (values, device) not in cache:
            cache[values, device] = torch.tensor(values, device=device)
        return cache[values, device]

    def _pick(self, x: torch.Tensor, heads: tuple[int, ...], num_heads: int) -> torch.Tensor:
        """The selected heads of ``x`` [B, H, L, d], in float32."""
        if len(heads) == num_heads:
            return x.float()
        return x.index_select(1, self._index(heads, x.device)).float()

    def _pure_noise_schedule(self) -> bool:
        """Whether ``bandwidth="schedule"`` meets flow matching's first step, s = 1 (alpha = 0):
        h = s / (1 - s) is infinite there and the NW weights are uniform."""
        state = self.recorder.state
        return self.nw_config.bandwidth == "schedule" and state.alpha == 0 and state.sigma > 0

    def _bandwidth(
        self, q: torch.Tensor, k: torch.Tensor, attn_weights: torch.Tensor | None, s: float
    ) -> torch.Tensor | float:
        if self._pure_noise_schedule():
            return math.inf
        return side.resolve_bandwidth(self.nw_config, self.recorder.state, q, k, attn_weights, s)

    def _gaussian_head(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor | float
    ) -> torch.Tensor:
        """GKA(q, k, v, h) ``[B, H, N, d_v]``; at h = inf its exact limit, the mean of the values."""
        if isinstance(h, float) and math.isinf(h):
            return v.mean(dim=-2, keepdim=True).expand(*q.shape[:-1], v.shape[-1])
        return kernels.gaussian_kernel_attention(
            q, k, v, h, chunk_size=self.nw_config.chunk_size, validate=False
        )

    # ------------------------------------------------------------------ failures
    def _record_safely(self, record: Callable[[], None]) -> None:
        """Run ``record()``; if it raises, roll back what it stored and count the skipped pair
        (observe never fails a generation that stock completes; see ``NWRecorder.skip``)."""
        mark = self.recorder.mark()
        try:
            with torch.no_grad():
                record()
        except Exception as error:
            self.recorder.skip(self.layer_name, error, rollback=mark)

    def _swap_error(self, error: Exception) -> RuntimeError:
        """The error swap raises (it changes the output, so it may fail), naming layer and step."""
        return RuntimeError(
            f"NW swap failed in layer {self.layer_name!r} at step {self.recorder.state.step}: "
            f"{type(error).__name__}: {error}"
        )

    # ------------------------------------------------------------------ recording
    def _record_softmax(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        scale: float,
        halves: tuple[str, ...],
        heads: tuple[int, ...],
        adapter: int,
        image: int,
        adapter_scale: Any,
        key_set: str = "ip",
        ip_mass: torch.Tensor | None = None,
        maps: bool = False,
    ) -> None:
        """Statistics of one softmax (float32 ``q`` [B, H, N, d], ``k`` [B, H, M, d]) to the recorder.

        With two ``halves`` the batch is [uncond; cond] and every statistic is averaged within
        each half; ``ip_mass`` [B, H] (SD3) is averaged the same way.
        """
        rec, cfg = self.recorder, self.nw_config
        if self._pure_noise_schedule():
            raise ValueError(
                "bandwidth='schedule' is infinite at s = 1 (pure noise): the NW weights are uniform and "
                "their rank statistics undefined; this step is not recorded (pick another bandwidth for it)"
            )
        batch, n = q.shape[0], len(halves)
        stats, attn_w, nw_w = side.softmax_statistics(
            q,
            k,
            scale=scale,
            bandwidth=lambda a: self._bandwidth(q, k, a, scale),
            config=cfg,
            generator=rec.generator(q.device) if cfg.nulls else None,
            halves=n,
        )
        mass = None if ip_mass is None else ip_mass.view(n, batch // n, len(heads)).mean(dim=1)
        rec.add(
            layer=self.layer_name,
            adapter=adapter,
            image=image,
            halves=halves,
            heads=heads,
            scale=adapter_scale if isinstance(adapter_scale, (int, float)) else math.nan,
            num_keys=k.shape[-2],
            stats=stats,
            key_set=key_set,
            ip_mass=mass,
        )
        if maps and rec.wants_maps(self.layer_name):
            side.store_maps(
                rec, self.nw_config, layer=self.layer_name, heads=heads, adapter=adapter, image=image,
                attn_w=attn_w, nw_w=nw_w,
            )


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, L, H*d]`` -> ``[B, H, L, d]``."""
    b, length, inner = x.shape
    return x.view(b, length, heads, inner // heads).transpose(1, 2)


def spread_rows(n: int, limit: int, device: torch.device) -> torch.Tensor | None:
    """``limit`` query-row indices evenly spaced over ``n`` rows (None when ``n <= limit``)."""
    if n <= limit:
        return None
    return torch.linspace(0, n - 1, limit, device=device).round().long()


def capture_outputs(
    modules: Sequence[tuple[str, torch.nn.Module]], into: dict[str, torch.Tensor]
) -> list[Any]:
    """Forward hooks storing each module's output under its name in ``into``; returns the handles."""

    def hook_for(name: str):
        def grab(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
            into[name] = output

        return grab

    return [module.register_forward_hook(hook_for(name)) for name, module in modules]
