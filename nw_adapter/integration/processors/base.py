"""What every NW processor family shares: adoption of the stock processor, selection, recording.

Each family module (:mod:`~nw_adapter.integration.processors.unet`,
:mod:`~nw_adapter.integration.processors.sd3`, :mod:`~nw_adapter.integration.processors.flux`)
subclasses :class:`NWProcessorBase` together with diffusers' processor class and only finds the
queries, the keys and the softmax groups of its image branch (hooks, head split, masks,
adapters). The base does the rest, once for every family:

- **Adoption.** The NW processor registers the stock processor's modules (the same objects:
  ``to_k_ip``, ``to_v_ip`` and, for SD3, the norms), so its ``state_dict`` is the stock one, and
  *forwards* the attribute ``scale`` to the stock processor. One convention serves both ways
  diffusers sets it: UNet pipelines' ``set_ip_adapter_scale`` edits the list
  ``processor.scale`` in place (the forwarded list is the stock one), SD3 / Flux pipelines'
  assigns ``processor.scale`` (the assignment reaches the stock processor). Either way the scale
  set while the NW processor is installed is the stock processor's after removal, and diffusers'
  ``unload_ip_adapter`` / ``is_ip_adapter_active`` find the NW processors through ``isinstance``.
- **Selection.** Steps (``config.steps``), heads (``config.heads``), and the CFG halves of a batch
  (:func:`batch_halves`, the one place that rule lives).
- **Bandwidth.** :func:`resolve_bandwidth`: h under ``config.bandwidth``; ``"schedule"`` at flow
  matching's first step (s = 1, alpha = 0) is h = inf, whose NW weights are uniform.
- **Recording one softmax** (:meth:`NWProcessorBase._record_softmax`) through
  :func:`nw_adapter.integration.stats.softmax_statistics`, with the nulls' random numbers from the
  recorder's seeded generator, and **safely** (:meth:`NWProcessorBase._record_safely`): a side
  computation that raises rolls back what it stored and is counted as skipped; observe never fails
  a generation that stock completes. Swap changes the output, so its failure raises a
  RuntimeError naming the layer and step (:meth:`NWProcessorBase._swap_error`).
- **The untrained-adapter control** (``config.untrained_control``): the installer hands every
  processor the installation's :class:`~nw_adapter.integration.control.UntrainedControl`
  (:meth:`NWProcessorBase.set_untrained_control`; held outside the module tree, so the
  state_dict is unchanged); each family passes the same queries' untrained keys of every draw
  to :meth:`NWProcessorBase._record_softmax`, which rescales them per (batch row, head) to the
  trained keys' RMS norm and records their statistics (same bandwidth rule, no nulls) as the
  ``{X}_control_{k}`` columns with the change of scale ``key_scale_{k}``, inside the same safe
  side computation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nw_adapter.core import bandwidth as bw
from nw_adapter.core import kernels
from nw_adapter.integration import stats
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.control import UntrainedControl, scale_matched
from nw_adapter.integration.maps import reduce_maps
from nw_adapter.integration.recorder import CONTROL_COLUMNS, NWRecorder
from nw_adapter.integration.steps import StepState
from nw_adapter.integration.support import support_bandwidth, support_values

PASS_HALVES = ("cond", "uncond")
"""Half label of the denoiser pass with index 0 (positive prompt) and 1 (negative; Flux's true CFG)."""


def batch_halves(batch: int, state: StepState, *, cfg: bool, by_pass: bool = False) -> tuple[str, ...]:
    """Labels of the equal blocks of rows of a batch of ``batch`` rows, in batch order.

    - ``by_pass`` (Flux, whose batch is never [uncond; cond]): the whole batch is the half of its
      pass, ``("cond",)`` for the first (positive) pass of the step, ``("uncond",)`` for the
      second (true CFG's negative pass).
    - Otherwise ``("uncond", "cond")`` under classifier-free guidance (``cfg``), with
      perturbed-attention guidance's rows (``state.perturbed``) ``("uncond", "cond", "perturbed")``
      or ``("cond", "perturbed")``; ``("all",)`` for one block or when ``batch`` does not split
      into that many blocks.
    """
    if by_pass:
        return (PASS_HALVES[min(state.pass_index, 1)],)
    labels = ("uncond",) if cfg else ()
    labels = (*labels, "cond", *(("perturbed",) if state.perturbed else ()))
    return labels if len(labels) > 1 and batch % len(labels) == 0 else ("all",)


def pure_noise_schedule(config: NWProcessorConfig, state: StepState) -> bool:
    """Whether ``bandwidth="schedule"`` meets flow matching's first step, s = 1 (alpha = 0, sigma > 0):
    h = sigma / alpha is infinite there and the NW weights are uniform."""
    return config.bandwidth == "schedule" and state.alpha == 0 and state.sigma > 0


def resolve_bandwidth(
    config: NWProcessorConfig, state: StepState, q: torch.Tensor, k: torch.Tensor, s: float
) -> torch.Tensor | float:
    """h per (batch, head) ``[B, H]`` (or a float) under ``config.bandwidth``.

    Only the data-dependent rules (median, fitted) read ``q`` [B, H, N, d] and ``k`` [B, H, M, d];
    they upcast to float32 themselves, so the other rules never copy a half-precision query.
    ``"fitted"`` fits h to A = softmax(q k^T s).

    Args:
        config: ``bandwidth`` and ``schedule_c`` are read.
        state: the step's noise level (``alpha``, ``sigma``) for ``"schedule"``.
        q: queries ``[B, H, N, d]``. k: image keys ``[B, H, M, d]``.
        s: the softmax scale of the stock attention (1/sqrt(d) for SDPA).

    Returns:
        A float (fixed, matched, schedule; ``math.inf`` at s = 1, see :func:`pure_noise_schedule`)
        or a ``[B, H]`` tensor (median, fitted).

    Raises:
        RuntimeError: ``"schedule"`` without the step's noise level (outside a pipeline call).
    """
    rule = config.bandwidth
    if isinstance(rule, float):
        return rule
    if rule == "matched":
        return bw.matched_bandwidth(scale=s)
    if rule == "schedule":
        if pure_noise_schedule(config, state):
            return math.inf
        if not (math.isfinite(state.sigma) and math.isfinite(state.alpha) and state.alpha > 0):
            raise RuntimeError(
                "bandwidth='schedule' needs the scheduler's sigma_t/alpha_t of the current "
                "step; run the processor inside a pipeline call (or call "
                "recorder.begin_step(alpha=..., sigma=...)), or pick another bandwidth"
            )
        return float(bw.schedule_bandwidth(state.sigma, state.alpha, config.schedule_c))
    q, k = q.float(), k.float()
    if rule == "median":
        return bw.median_bandwidth(q, k)
    return bw.fitted_bandwidth(torch.softmax((q @ k.transpose(-1, -2)) * s, dim=-1), q, k)[0]


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, L, H*d]`` -> ``[B, H, L, d]`` (a view)."""
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

    def hook_for(name: str) -> Callable[..., None]:
        def grab(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
            into[name] = output

        return grab

    return [module.register_forward_hook(hook_for(name)) for name, module in modules]


class NWProcessorBase:
    """Mixin placed before a diffusers IP-Adapter processor class (see the module docstring).

    Subclasses call :meth:`_adopt` from ``__init__``, list the stock modules to share in
    ``_shared_modules`` and set ``halves_by_pass`` when a pass of the denoiser is one CFG half.
    """

    _shared_modules: tuple[str, ...] = ()
    halves_by_pass: bool = False

    def _adopt(
        self, original: torch.nn.Module, *, layer_name: str, config: NWProcessorConfig, recorder: NWRecorder
    ) -> None:
        torch.nn.Module.__init__(self)  # the parent __init__ would allocate fresh projections
        self.__dict__["_nw_original"] = original  # not a submodule: no duplicate state_dict keys
        for name in self._shared_modules:
            setattr(self, name, getattr(original, name))
        for name in ("hidden_size", "cross_attention_dim", "num_tokens"):
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
    def untrained_control(self) -> UntrainedControl | None:
        """The installation's untrained-adapter control (None when ``config.untrained_control`` is off)."""
        return self.__dict__.get("_nw_untrained_control")

    def set_untrained_control(self, control: UntrainedControl | None) -> None:
        """Hand the processor the installation's control (None drops it); not a submodule."""
        self.__dict__["_nw_untrained_control"] = control

    def _untrained_wanted(self) -> UntrainedControl | None:
        """The control when it is on for this processor (config and an attached control)."""
        control = self.untrained_control
        return control if self.nw_config.untrained_control and control is not None else None

    @property
    def scale(self) -> Any:
        """The stock processor's ``scale`` (the same object: a list per adapter for UNets and Flux,
        a float for SD3); assigning it sets the stock processor's."""
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
        """The recorded head indices of a layer with ``num_heads`` heads (``config.heads``)."""
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

    def _halves(self, batch: int) -> tuple[str, ...]:
        """The CFG halves of this layer's batch at the current step (:func:`batch_halves`)."""
        return batch_halves(batch, self.recorder.state, cfg=self.recorder.cfg, by_pass=self.halves_by_pass)

    # ------------------------------------------------------------------ bandwidth and swap
    def _bandwidth(self, q: torch.Tensor, k: torch.Tensor, s: float) -> torch.Tensor | float:
        """h of one softmax at the current step (:func:`resolve_bandwidth`)."""
        return resolve_bandwidth(self.nw_config, self.recorder.state, q, k, s)

    def _gaussian_head(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor | float
    ) -> torch.Tensor:
        """GKA(q, k, v, h) ``[B, H, N, d_v]``; at h = inf its exact limit, the mean of the values."""
        if isinstance(h, float) and math.isinf(h):
            return v.mean(dim=-2, keepdim=True).expand(*q.shape[:-1], v.shape[-1])
        return kernels.gaussian_kernel_attention(
            q, k, v, h, chunk_size=self.nw_config.chunk_size, validate=False
        )

    def _swap_error(self, error: Exception) -> RuntimeError:
        """The error swap raises (it changes the output, so it may fail), naming layer and step."""
        return RuntimeError(
            f"NW swap failed in layer {self.layer_name!r} at step {self.recorder.state.step}: "
            f"{type(error).__name__}: {error}"
        )

    # ------------------------------------------------------------------ recording
    def _record_safely(self, record: Callable[[], None]) -> None:
        """Run ``record()``; if it raises, roll back what it stored and count the skipped pair
        (observe never fails a generation that stock completes; see ``NWRecorder.skip``)."""
        mark = self.recorder.mark()
        try:
            with torch.no_grad():
                record()
        except Exception as error:
            self.recorder.skip(self.layer_name, error, rollback=mark)

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
        control_keys: Sequence[torch.Tensor] = (),
        references: int = 1,
    ) -> None:
        """Statistics of one softmax (float32 ``q`` [B, H, N, d], ``k`` [B, H, M, d]) to the recorder.

        With several ``halves`` the batch is their blocks of rows and every statistic is averaged
        within each; ``ip_mass`` [B, H] (SD3) is averaged the same way. ``adapter_scale``: the
        adapter's scale (NaN in the records when it is a per-block list). ``maps``: also store A
        and W when the recorder wants this layer's maps. ``control_keys``: per control draw k, the
        untrained adapter's keys ``k0`` [B, H, M0, d] (float32) of the same softmax. Each is
        rescaled to the trained keys' RMS norm per (batch row, head), ``k0m = k0 key_rms(k) /
        key_rms(k0)`` (:func:`~nw_adapter.integration.control.scale_matched`); the statistics of
        ``k0m`` against the same ``q``, at the same bandwidth rule (applied to ``k0m``) and
        without nulls, are recorded as ``{X}_control_{k}``
        (:data:`~nw_adapter.integration.recorder.CONTROL_COLUMNS`) and the ratio
        ``key_rms(k) / key_rms(k0)``, averaged over the rows of each CFG half, as ``key_scale_{k}``.
        ``references``: the m reference images whose tokens make up the keys (a support set, keys
        reference-major); with m > 1 the per-reference masses and entropies of
        :func:`~nw_adapter.integration.support.support_values` are recorded too, at the schedule's
        bandwidth (:func:`~nw_adapter.integration.support.support_bandwidth`).

        Raises:
            ValueError: ``bandwidth="schedule"`` at s = 1 (uniform NW weights, rank statistics
                undefined): the pair is skipped, not recorded as NaN.
        """
        rec, cfg = self.recorder, self.nw_config
        if pure_noise_schedule(cfg, rec.state):
            raise ValueError(
                "bandwidth='schedule' is infinite at s = 1 (pure noise): the NW weights are uniform and "
                "their rank statistics undefined; this step is not recorded (pick another bandwidth for it)"
            )
        batch, n = q.shape[0], len(halves)
        h = self._bandwidth(q, k, scale)
        draws = None
        if cfg.nulls:
            draws = stats.draw_nulls(q, k.shape[-2], cfg.null_rows, rec.generator(q.device))
        # the same computation for the adapter's keys and for the untrained control's (no nulls)
        common: dict[str, Any] = {
            "scale": scale,
            "halves": n,
            "compile": cfg.compile,
            "readings": cfg.readings,
            "fit_rows": cfg.fit_rows,
        }
        values, attn_w, nw_w = stats.softmax_statistics(q, k, h=h, draws=draws, **common)
        mass = None if ip_mass is None else ip_mass.view(n, batch // n, len(heads)).mean(dim=1)
        control = None
        if control_keys:
            per_draw = [self._control_values(q, k, k0, scale, n, common) for k0 in control_keys]
            control = torch.stack(per_draw)
        support = None
        if references > 1:
            h_nw = support_bandwidth(cfg, rec.state)
            support = support_values(q, k, scale=scale, h=h_nw, references=references, halves=n)
        rec.add(
            layer=self.layer_name,
            adapter=adapter,
            image=image,
            halves=halves,
            heads=heads,
            scale=math.nan if isinstance(adapter_scale, (list, tuple)) else adapter_scale,
            num_keys=k.shape[-2],
            stats=values,
            key_set=key_set,
            ip_mass=mass,
            control=control,
            support=support,
        )
        if maps and rec.wants_maps(self.layer_name):
            reduced = reduce_maps(cfg, heads=heads, attn_w=attn_w, nw_w=nw_w, latent_hw=rec.state.latent_hw)
            if reduced is not None:
                attn_map, nw_map, meta = reduced
                rec.add_maps(
                    layer=self.layer_name, adapter=adapter, image=image, attn=attn_map, nw=nw_map, meta=meta
                )

    def _control_values(
        self, q: torch.Tensor, k: torch.Tensor, k0: torch.Tensor, scale: float, halves: int, common: dict
    ) -> torch.Tensor:
        """One control draw's rows ``[CONTROL_ROWS, halves, H]``: the statistics of :data:`CONTROL_COLUMNS`
        of ``q`` against the scale-matched keys ``k0m`` (no nulls), the key scale
        ``key_rms(k) / key_rms(k0)`` averaged over each half's rows, then the control's h_eff reason
        code (the last row of the statistics)."""
        matched, ratio = scale_matched(k, k0)  # [B, H, M0, d], [B, H]
        h0 = self._bandwidth(q, matched, scale)
        values0, _, _ = stats.softmax_statistics(q, matched, h=h0, draws=None, **common)
        picked = values0.index_select(0, self._index(CONTROL_COLUMNS, values0.device))
        key_scale = ratio.float().view(halves, ratio.shape[0] // halves, ratio.shape[1]).mean(dim=1)
        return torch.cat([picked, key_scale.to(picked.device)[None], values0[-1:]], dim=0)


def is_nw_processor(processor: Any) -> bool:
    """Whether ``processor`` is an NW processor of any family."""
    return isinstance(processor, NWProcessorBase)
