"""What every NW processor family shares: the call, adoption of the stock processor, selection, recording.

Each family module (:mod:`~nw_adapter.integration.processors.unet`,
:mod:`~nw_adapter.integration.processors.sd3`, :mod:`~nw_adapter.integration.processors.flux`)
subclasses :class:`NWProcessorBase` together with diffusers' processor class and only says what
its image branch is: a :class:`BranchSpec` (which module outputs to tap in observe and in swap,
where swap's branch goes, how the stock call skips its own) and four methods (the call's image
inputs, the stock arguments without them, swap's branch, the softmaxes to record as
:class:`Softmax` objects: queries, keys, adapter / image indices, masses). The base does the rest,
once for every family:

- **The call** (:meth:`NWProcessorBase._nw_call`, the hot path, top to bottom): selection, the
  stock call alone when nothing is selected, the taps armed (hooks registered once per attention
  module, :class:`Taps`), the stock call, the taps disarmed in ``finally``, swap, safe recording.

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

import inspect
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from nw_adapter.core import kernels
from nw_adapter.integration import stats
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.control import UntrainedControl
from nw_adapter.integration.maps import reduce_maps
from nw_adapter.integration.processors.deferred import (
    Capture,
    DeferredStatistics,
    LayerCall,
    control_statistics,
    recorded_head,
    statistics_options,
)
from nw_adapter.integration.processors.selection import (
    PASS_HALVES,
    batch_halves,
    pure_noise_schedule,
    resolve_bandwidth,
)
from nw_adapter.integration.recorder import NWRecorder
from nw_adapter.integration.steps import StepContext
from nw_adapter.integration.support import support_values

__all__ = [
    "PASS_HALVES",
    "NWProcessorBase",
    "batch_halves",
    "is_nw_processor",
    "pure_noise_schedule",
    "resolve_bandwidth",
    "split_heads",
]


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, L, H*d]`` -> ``[B, H, L, d]`` (a view)."""
    b, length, inner = x.shape
    return x.view(b, length, heads, inner // heads).transpose(1, 2)


def spread_rows(n: int, limit: int, device: torch.device) -> torch.Tensor | None:
    """``limit`` query-row indices evenly spaced over ``n`` rows (None when ``n <= limit``)."""
    if n <= limit:
        return None
    return torch.linspace(0, n - 1, limit, device=device).round().long()


_ZERO: dict[torch.device, torch.Tensor] = {}


def _key_bias(k: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha ||k_i||^2`` as an attention mask ``[B, H, 1, M]`` of the keys ``k [B, H, M, d]``: one
    ``baddbmm`` (``beta = 0``) of the keys with themselves, in whichever of the two memory orders
    ``[B, H, M, d]`` or ``[B, M, H, d]`` (the projection's) is contiguous; a copy otherwise."""
    zero = _ZERO.get(k.device)
    if zero is None:
        zero = _ZERO[k.device] = torch.zeros((1, 1, 1), dtype=torch.float32, device=k.device)
    tokens_first = k.transpose(1, 2)
    rows = tokens_first if tokens_first.is_contiguous() and not k.is_contiguous() else k
    flat = rows.reshape(-1, 1, k.shape[-1])
    squares = torch.baddbmm(zero, flat, flat.transpose(1, 2), beta=0.0, alpha=alpha)  # [B H M, 1, 1]
    bias = squares.view(rows.shape[:3])
    return (bias if rows is k else bias.transpose(1, 2)).unsqueeze(2)


class Taps:
    """Hooks kept on one attention module while an NW processor serves it.

    Registered once, on the processor's first call (not per call): a forward hook on every module
    of ``outputs`` (``(name, module)`` pairs, the family's choice: ``attn.to_q``, the stock
    branch's key projections or norms ...) that appends the module's output to
    ``captured[name]`` (one entry per forward of the module during the call, in order), and with
    ``branch`` a forward pre-hook on ``attn.to_out[0]`` that replaces the projection's input
    ``hidden`` [B, N, H*d] by ``branch(hidden)`` (swap's NW image branch). Between calls the taps
    are disarmed and do nothing; :meth:`arm` / :meth:`disarm` bracket one call (``disarm`` in
    ``finally``). The recorder removes them when the processors are removed
    (:meth:`~nw_adapter.integration.recorder.NWRecorder.detach`).
    """

    def __init__(
        self,
        attn: torch.nn.Module,
        outputs: Sequence[tuple[Hashable, torch.nn.Module]] = (),
        *,
        branch: bool = False,
    ) -> None:
        self.attn = attn
        self.armed = False
        self.captured: dict[Hashable, list[torch.Tensor]] = {}
        self.branch: Callable[[torch.Tensor], torch.Tensor] | None = None
        # only the hooks the mode uses: a module with hooks takes torch's slower call path
        self.handles = [module.register_forward_hook(self._grabber(name)) for name, module in outputs]
        if branch:
            self.handles.append(attn.to_out[0].register_forward_pre_hook(self._add_branch))

    def _grabber(self, name: Hashable) -> Callable[..., None]:
        def grab(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
            if self.armed:
                self.captured.setdefault(name, []).append(output)

        return grab

    def _add_branch(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        if self.branch is None:
            return None
        return (self.branch(args[0]), *args[1:])

    def arm(self, branch: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[Hashable, list]:
        """Capture the tapped outputs of the next stock call into a fresh :attr:`captured` (returned:
        what the call captured, readable by ``branch`` during the call and after it); replace the
        output projection's input ``hidden`` by ``branch(hidden)``."""
        self.captured, self.branch, self.armed = {}, branch, True
        return self.captured

    def disarm(self) -> None:
        """Stop capturing and adding; drop the taps' reference to what was captured (nothing
        outlives the call but what the caller of :meth:`arm` keeps)."""
        self.armed, self.branch, self.captured = False, None, {}

    def remove(self) -> None:
        """Remove the hooks from the modules."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


@dataclass(frozen=True)
class BranchSpec:
    """What a family's image branch is to the call skeleton (:meth:`NWProcessorBase._nw_call`).

    Attributes:
        observe_taps: the modules whose outputs the taps capture in observe
            (:meth:`NWProcessorBase._tap_modules`: ``"attn.to_q"``, ``"to_k_ip"``, ...).
        swap_taps: the same in swap (what the NW branch reads).
        swap_site: where swap's NW branch goes: ``"to_out"``, it replaces the input ``hidden``
            [B, N, H*d] of ``attn.to_out[0]`` (the taps' pre-hook; UNets, SD3), so dropout,
            residual and rescaling stay diffusers'; ``"output"``, it replaces the processor's output
            after the stock call (Flux, whose image branch is a separate third output).
        mute_by: how the stock call skips its own image branch in swap: ``"scale"``, every adapter's
            scale is 0 for the call and restored in ``finally`` (UNets: diffusers still validates
            the IP masks); ``"inputs"``, the family's :meth:`~NWProcessorBase._without_branch`
            arguments (no IP states: SD3, Flux).
        every_pass: record every denoiser pass of a step; False: the first pass only (SD3, whose
            skip-layer guidance reruns the conditional half with blocks skipped; swap applies to
            every pass either way).
        halves_by_pass: a denoiser pass is one CFG half (Flux's true CFG; :func:`batch_halves`).
    """

    observe_taps: tuple[str, ...]
    swap_taps: tuple[str, ...]
    swap_site: Literal["to_out", "output"] = "to_out"
    mute_by: Literal["scale", "inputs"] = "inputs"
    every_pass: bool = True
    halves_by_pass: bool = False


@dataclass(slots=True)
class Softmax:
    """One softmax of an image branch, to be recorded (:meth:`NWProcessorBase._record_softmax`).

    ``q`` [B, H, N, d] and ``k`` [B, H, M, d] in float32, the recorded heads only; ``scale`` the
    softmax's s (A = softmax(q k^T s)); ``adapter_scale`` the adapter's IP-Adapter scale (a
    per-block list is recorded as NaN); ``adapter`` / ``image`` the softmax's indices (image 0: an
    adapter's images pooled into one softmax); ``key_set`` what the keys are
    (:data:`~nw_adapter.integration.schema.KEY_SETS`); ``ip_mass`` [B, H] the joint softmax's mass
    on the IP keys (SD3); ``maps`` whether its maps may be stored; ``control_keys`` per draw of the
    untrained-adapter control, its keys ``[B, H, M0, d]``; ``references`` the m reference images
    whose tokens make up the keys (a support set when m > 1); ``swap_h`` in swap, the bandwidth
    the swapped branch used for these keys (a float, or ``[B, H_all]`` per batch row and head of
    the layer): the softmax recorded is then the branch's own (:meth:`NWProcessorBase._record_softmax`).
    """

    q: torch.Tensor
    k: torch.Tensor
    scale: float
    adapter_scale: Any
    adapter: int = 0
    image: int = 0
    key_set: str = "ip"
    ip_mass: torch.Tensor | None = None
    maps: bool = False
    control_keys: tuple[torch.Tensor, ...] = ()
    references: int = 1
    swap_h: float | torch.Tensor | None = None


def exact_head_as_dot_product(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact NW head's scores as a dot product that keeps the head's own distances.

    ``q' = [q, c, 0]`` and ``k'_i = [k_i, -||k_i||^2 / 2c, r_i]`` (``c = max_i ||k_i||`` per batch
    row and head, ``r_i = sqrt(C - ||k_i||^2 - ||k_i||^4 / 4c^2)``, ``C`` the largest of those
    norms' sums): ``q'.k'_i = q.k_i - ||k_i||^2 / 2`` (so ``softmax(q'.k'_i / h^2)`` is the NW head
    at h) and ``||k'_i||^2 = C`` for every key, so ``||q' - k'_i||^2 = ||q - k_i||^2 + c^2 + C``:
    NW weights of ``q'``, ``k'`` at any bandwidth are those of ``q``, ``k``. For a function that
    reads a dot-product softmax and NW weights (the support-set masses) to read a swapped branch.

    Args:
        q: ``[B, H, N, d]``. k: ``[B, H, M, d]``.

    Returns:
        ``(q' [B, H, N, d + 2], k' [B, H, M, d + 2])``.
    """
    sq = k.square().sum(-1, keepdim=True)  # [B, H, M, 1]
    c = sq.amax(-2, keepdim=True).sqrt().clamp_min(torch.finfo(k.dtype).tiny)  # [B, H, 1, 1]
    used = sq + sq.square() / (4 * c * c)
    pad = (used.amax(-2, keepdim=True) - used).clamp_min(0.0).sqrt()
    q_aug = torch.cat([q, c.expand(*q.shape[:-1], 1), torch.zeros_like(q[..., :1])], -1)
    k_aug = torch.cat([k, -sq / (2 * c), pad], -1)
    return q_aug, k_aug


def zero_scales(scales: Sequence[Any]) -> list[Any]:
    """Every adapter's scale set to 0, in the same layout (a float, or a list per image or block)."""
    return [[0.0] * len(s) if isinstance(s, (list, tuple)) else 0.0 for s in scales]


def element_tap(path: str, j: int) -> str:
    """The tap name of element ``j`` of a ModuleList tapped at ``path`` (e.g. ``"to_k_ip.0"``)."""
    return f"{path}.{j}"


class NWProcessorBase:
    """Mixin placed before a diffusers IP-Adapter processor class (see the module docstring).

    A family subclasses it with diffusers' processor class, calls :meth:`_adopt` from
    ``__init__``, lists the stock modules to share in ``_shared_modules``, describes its branch in
    ``spec`` (a :class:`BranchSpec`), forwards diffusers' ``__call__`` signature to
    :meth:`_nw_call` and supplies what differs between families:

    - :meth:`_image_inputs`: the call's image-branch inputs (None: the call has none);
    - :meth:`_without_branch`: the stock arguments without the IP states (``mute_by="inputs"``);
    - :meth:`_swap`: swap's NW image branch put in place;
    - :meth:`_softmaxes`: the softmaxes of the branch (queries, keys, indices, masses ...) from
      what the taps captured.
    """

    _shared_modules: tuple[str, ...] = ()
    spec: BranchSpec = BranchSpec(observe_taps=(), swap_taps=())

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A family's ``__call__`` carries its signature, computed once: diffusers' attention
        modules read ``inspect.signature(processor.__call__)`` at every forward (to filter the
        cross-attention kwargs), and a stored ``__signature__`` answers that ~3x faster
        (measured 17 -> 5.5 us per call: ~2 ms per call of a 16-layer UNet at 10 steps)."""
        super().__init_subclass__(**kwargs)
        call = cls.__dict__.get("__call__")
        if inspect.isfunction(call) and "__signature__" not in call.__dict__:
            call.__signature__ = inspect.signature(call)

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

    # ------------------------------------------------------------------ the call
    def _nw_call(self, attn: torch.nn.Module, args: tuple) -> Any:
        """One call of an NW processor of any family: diffusers' stock call with the NW side
        computation around it. ``args``: the stock ``__call__``'s arguments after ``attn``, in its
        order (each family's ``__call__`` keeps diffusers' signature and forwards them here).

        1. Selection: record / swap at the current pass, read from the pass's context (the
           recorder's :attr:`~nw_adapter.integration.recorder.NWRecorder.context`, made once per
           pass: :meth:`_selection`); with neither, or no image branch in this call
           (:meth:`_image_inputs` None), the stock call alone.
        2. The taps (:meth:`_taps`, registered at the first call) are armed: they capture the
           outputs the family's ``spec`` names. In swap the stock call skips its own image branch
           (``spec.mute_by``) and, at ``spec.swap_site="to_out"``, the taps' pre-hook on
           ``attn.to_out[0]`` puts the NW branch in place (:meth:`_swap`).
        3. The stock call (diffusers' code: the output is its own); the taps are disarmed and the
           muted scales restored in ``finally``, whatever the call raises.
        4. Swap at ``spec.swap_site="output"``: :meth:`_swap` on the processor's output. A swap
           failure raises a RuntimeError naming the layer and step (:meth:`_swap_error`).
        5. Record: queued for the flush (:meth:`_queue`, recorded there by :meth:`_record_queued`),
           or in the layer when maps are stored or the untrained control is on: every softmax of
           :meth:`_softmaxes`, safely (:meth:`_record_safely`: a failure rolls the layer back and
           is counted; the output stands).
        """
        stock = super().__call__  # type: ignore[misc]  # diffusers' processor, next in the MRO
        ctx = self.recorder.context  # this pass: its state, CFG layout, step selection, memo
        record, swap = self._selection(ctx)
        inputs = self._image_inputs(args) if record or swap else None
        if inputs is None:
            return stock(attn, *args)
        spec = self.spec
        taps = self._taps(attn)
        branch, stock_args = None, args
        if swap and spec.swap_site == "to_out":

            def branch(hidden: torch.Tensor) -> torch.Tensor:  # run by the taps' pre-hook, mid-call
                return self._swap_safely(ctx, attn, inputs, captured, hidden)

        if swap and spec.mute_by == "inputs":
            stock_args = self._without_branch(args)
        captured = taps.arm(branch)  # what the call's tapped modules output, in order
        muted, original = None, self.__dict__["_nw_original"]
        try:
            if swap and spec.mute_by == "scale":  # the plain attribute set directly (no Module.__setattr__)
                muted = original.scale
                object.__setattr__(original, "scale", zero_scales(muted))  # diffusers skips every branch
            out = stock(attn, *stock_args)
        finally:
            taps.disarm()
            if muted is not None:
                object.__setattr__(original, "scale", muted)
        if swap and spec.swap_site == "output":
            out = self._swap_safely(ctx, attn, inputs, captured, out)
        if record:
            if self._queues_calls():  # recorded at the flush (one append here)
                self._queue(ctx, attn, inputs, captured)
            else:
                self._record_safely(ctx, lambda: self._record(ctx, attn, inputs, captured))
        return out

    def _image_inputs(self, args: tuple) -> Any | None:
        """The call's image-branch inputs (the family's, e.g. IP states, masks, scales) from the
        stock arguments ``args``; None when this call has no image branch (the stock call alone)."""
        raise NotImplementedError

    def _without_branch(self, args: tuple) -> tuple:
        """The stock arguments ``args`` with no IP states: the stock call skips its image branch
        (swap, ``spec.mute_by="inputs"``)."""
        raise NotImplementedError

    def _swap(self, ctx: StepContext, attn: torch.nn.Module, inputs: Any, captured: dict, x: Any) -> Any:
        """Swap's NW image branch in place at the pass ``ctx`` (the bandwidth: :meth:`_bandwidth`):
        ``x`` is ``attn.to_out[0]``'s input ``hidden`` [B, N, H*d] without the stock branch
        (``spec.swap_site="to_out"``) or the processor's output (``"output"``); returns its
        replacement. ``captured``: what the taps captured so far (the branch may add to it for
        :meth:`_softmaxes`)."""
        raise NotImplementedError

    def _softmaxes(
        self, attn: torch.nn.Module, inputs: Any, captured: dict, heads: tuple[int, ...]
    ) -> list[Softmax]:
        """The softmaxes of the call's image branch to record, over the recorded ``heads``, from
        what the taps (and swap's branch) captured."""
        raise NotImplementedError

    def _swap_safely(
        self, ctx: StepContext, attn: torch.nn.Module, inputs: Any, captured: dict, x: Any
    ) -> Any:
        """:meth:`_swap`, its failure raised as :meth:`_swap_error` (swap changes the output)."""
        try:
            return self._swap(ctx, attn, inputs, captured, x)
        except Exception as error:
            raise self._swap_error(error) from error

    def _record(self, ctx: StepContext, attn: torch.nn.Module, inputs: Any, captured: dict) -> None:
        """Record every softmax of :meth:`_softmaxes`, the CFG halves from the batch of the first."""
        heads = self._heads(attn.heads)
        if not heads:
            return
        softmaxes = self._softmaxes(attn, inputs, captured, heads)
        if softmaxes:
            halves = self._halves(ctx, softmaxes[0].q.shape[0])
            for softmax in softmaxes:
                self._record_softmax(softmax, ctx, halves=halves, heads=heads)

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
        control = self.__dict__.get("_nw_untrained_control")
        return control if self.nw_config.untrained_control and control is not None else None

    @property
    def scale(self) -> Any:
        """The stock processor's ``scale`` (the same object: a list per adapter for UNets and Flux,
        a float for SD3); assigning it sets the stock processor's."""
        return self.__dict__["_nw_original"].scale  # read by diffusers' own code too: no further call

    @scale.setter
    def scale(self, value: Any) -> None:
        self.__dict__["_nw_original"].scale = value

    # ------------------------------------------------------------------ selection
    def _selection(self, ctx: StepContext) -> tuple[bool, bool]:
        """(record, swap) at the pass ``ctx``: its step selected (``config.steps``); with
        ``spec.every_pass`` False only the step's first pass is recorded."""
        if not ctx.selected:
            return False, False
        config = self.nw_config
        record = config.record_statistics and (self.spec.every_pass or not ctx.state.pass_index)
        return record, config.mode == "swap"

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
            return x if x.dtype == torch.float32 else x.float()
        return x.index_select(1, self._index(heads, x.device)).float()

    def _halves(self, ctx: StepContext, batch: int) -> tuple[str, ...]:
        """The CFG halves of a batch of ``batch`` rows at the pass ``ctx`` (:func:`batch_halves`),
        resolved once per pass and batch size for every layer (``ctx.memo``)."""
        key = ("halves", batch, self.spec.halves_by_pass)
        labels = ctx.memo.get(key)
        if labels is None:
            labels = ctx.memo[key] = batch_halves(batch, ctx.state, cfg=ctx.cfg, by_pass=key[2])
        return labels

    def _taps(self, attn: torch.nn.Module) -> Taps:
        """This processor's :class:`Taps` on ``attn``, registered on the first call (and again only
        for another attention module, or after the recorder's detach removed them): the outputs
        of the modules named by ``spec.observe_taps`` / ``spec.swap_taps`` (the mode's) and, in
        swap at ``spec.swap_site="to_out"``, the branch pre-hook on ``attn.to_out[0]``."""
        taps = self.__dict__.get("_nw_taps")
        if taps is None or taps.attn is not attn or not taps.handles:
            if taps is not None:
                taps.remove()
            spec, swap = self.spec, self.nw_config.mode == "swap"
            outputs = self._tap_modules(attn, spec.swap_taps if swap else spec.observe_taps)
            taps = Taps(attn, outputs, branch=swap and spec.swap_site == "to_out")
            self.__dict__["_nw_taps"] = taps
            self.recorder.taps.append(taps)
        return taps

    def _tap_modules(self, attn: torch.nn.Module, paths: Sequence[str]) -> list[tuple[str, torch.nn.Module]]:
        """The modules named by ``paths``: ``"attn.<name>"`` an attribute of the attention module,
        ``"<name>"`` one of this processor (the stock processor's shared modules); a ModuleList
        (``"to_k_ip"``, one projection per adapter) is tapped element by element, as
        ``"<path>.<j>"``. Each module's captures are kept under its path."""
        modules = []
        for path in paths:
            owner, _, name = path.rpartition(".")
            module = getattr(attn if owner == "attn" else self, name)
            if isinstance(module, torch.nn.ModuleList):
                modules.extend((element_tap(path, j), m) for j, m in enumerate(module))
            else:
                modules.append((path, module))
        return modules

    def release(self) -> None:
        """Remove this processor's hooks from its attention module (done by the recorder's detach)."""
        taps = self.__dict__.pop("_nw_taps", None)
        if taps is not None:
            taps.remove()

    # ------------------------------------------------------------------ bandwidth and swap
    def _bandwidth(
        self, q: torch.Tensor, k: torch.Tensor, s: float, ctx: StepContext | None = None
    ) -> torch.Tensor | float:
        """h of one softmax at the pass ``ctx`` (default: the current one; :func:`resolve_bandwidth`);
        the rules that read no keys (fixed, matched, schedule) are resolved once per pass and
        softmax scale s for every layer (``ctx.memo``)."""
        cfg = self.nw_config
        if ctx is None:
            ctx = self.recorder.context
        rule = cfg.bandwidth
        if rule == "median" or rule == "fitted":
            return resolve_bandwidth(cfg, ctx.state, q, k, s)
        key = ("h", rule, cfg.schedule_c, s)
        h = ctx.memo.get(key)
        if h is None:
            h = ctx.memo[key] = resolve_bandwidth(cfg, ctx.state, q, k, s)
        return h

    def _nw_head(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor | float
    ) -> torch.Tensor:
        """The NW head GKA(q, k, v, h) ``[B, H, N, d_v]`` for swap (THEORY.md section 3):

            SDPA(q, k, v, attn_mask = b, scale = 1/h^2),   b_i = -||k_i||^2 / 2h^2,

        since ``-||q - k_i||^2 / 2h^2 = q.k_i / h^2 - ||k_i||^2 / 2h^2 + (constant in i)``: one fused
        attention call with its per-key bias, the bias one ``baddbmm`` over the ``[B, H, M, d]``
        keys taken in their memory order (``-||k_i||^2 / 2h^2`` as ``alpha k_i . k_i``, ``alpha =
        -1 / 2h^2``: no copy; 2-5x less CPU time than the ``bilinear`` form ``k^T (-I / 2h^2) k``
        it replaces, measured at SD 1.5's IP-layer shapes). Used for float32 inputs, a float h and
        ``chunk_size=None``; otherwise (half precision: the queries are upcast; a per-head h;
        chunks) :func:`~nw_adapter.core.kernels.gaussian_kernel_head`, which also centres the keys.
        At h = inf its exact limit, the mean of the values."""
        if isinstance(h, float) and math.isinf(h):
            return v.mean(dim=-2, keepdim=True).expand(*q.shape[:-1], v.shape[-1])
        f32 = torch.float32
        lean = isinstance(h, float) and self.nw_config.chunk_size is None
        if not (lean and q.dtype == f32 and k.dtype == f32 and v.dtype == f32):
            return kernels.gaussian_kernel_head(q, k, v, h, chunk_size=self.nw_config.chunk_size)
        inv_h2 = 1.0 / (h * h)
        mask = _key_bias(k, -0.5 * inv_h2)  # [B, H, 1, M]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=inv_h2)

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
            f"NW swap failed in layer {self.layer_name!r} at step {self.recorder.context.state.step}: "
            f"{type(error).__name__}: {error}"
        )

    # ------------------------------------------------------------------ recording
    def _record_safely(self, ctx: StepContext, record: Callable[[], None]) -> None:
        """Run ``record()`` at the pass ``ctx``; if it raises, roll back what it stored and count the
        skipped pair (observe never fails a generation that stock completes; see ``NWRecorder.skip``).

        Pending statistics that are due (over ``config.deferred_mb``, or of an earlier call) are
        computed first, outside the rollback window."""
        rec = self.recorder
        self._settle_due(ctx)
        mark = rec.mark()
        try:
            if torch.is_grad_enabled():  # pipelines call the denoiser under no_grad already
                with torch.no_grad():
                    record()
            else:
                record()
        except Exception as error:
            rec.skip(self.layer_name, error, rollback=mark)

    def _queues_calls(self) -> bool:
        """Whether this processor's layer calls are recorded at the flush rather than in the layer
        (:meth:`~.deferred.DeferredStatistics.queue`): with deferred statistics, no maps to store
        (a step's maps are chosen in the layer) and no untrained-adapter control (its keys belong
        to the call being run)."""
        cfg = self.nw_config
        return cfg.deferred_mb > 0 and not cfg.store_maps and self._untrained_wanted() is None

    def _queue(self, ctx: StepContext, attn: torch.nn.Module, inputs: Any, captured: dict) -> None:
        """Queue this layer call for the flush; pending work that is due (over ``config.deferred_mb``,
        or of an earlier call) is done first, as :meth:`_record_safely` does."""
        rec = self.recorder
        pending = rec.pending
        if pending is None:
            pending = rec.pending = DeferredStatistics(self.nw_config)
        elif pending.due(ctx.state.call):  # as _settle_due
            rec.settle()
        pending.queue(self, ctx, attn, inputs, captured)

    def _settle_due(self, ctx: StepContext) -> None:
        """Compute the pending work first when it is due: over ``config.deferred_mb``, or of a call
        before the pass ``ctx``'s."""
        pending = self.recorder.pending
        if pending is not None and pending.due(ctx.state.call):
            self.recorder.settle()

    def _record_queued(self, layer: LayerCall) -> None:
        """Record a queued layer call at the flush, as :meth:`_record_safely` does in the layer, from
        its pass's context: a failure drops the entries it reserved and is counted as a skipped pair
        of its (call, step)."""
        rec, state = self.recorder, layer.ctx.state
        mark = rec.mark()
        try:
            self._record(layer.ctx, layer.attn, layer.inputs, layer.captured)
        except Exception as error:
            rec.skip(self.layer_name, error, rollback=mark, call=state.call, step=state.step)

    def _record_softmax(
        self, softmax: Softmax, ctx: StepContext, *, halves: tuple[str, ...], heads: tuple[int, ...]
    ) -> None:
        """Record one softmax (:class:`Softmax`: float32 ``q`` [B, H, N, d], ``k`` [B, H, M, d]) of the
        recorded ``heads``, its batch the blocks of ``halves``: reserve its entry and
        capture it for the deferred statistics (:mod:`.deferred`), or compute it here (maps stored
        for this layer, ``deferred_mb=0``).

        With several ``halves`` the batch is their blocks of rows and every statistic is averaged
        within each; the softmax's ``ip_mass`` [B, H] (SD3) is averaged the same way. Its
        ``adapter_scale``: the adapter's scale (NaN in the records when it is a per-block list);
        ``maps``: also store A and W when the recorder wants this layer's maps; ``control_keys``:
        per control draw k, the
        untrained adapter's keys ``k0`` [B, H, M0, d] (float32) of the same softmax. Each is
        rescaled to the trained keys' RMS norm per (batch row, head), ``k0m = k0 key_rms(k) /
        key_rms(k0)`` (:func:`~nw_adapter.integration.control.scale_matched`); the statistics of
        ``k0m`` against the same ``q``, at the same bandwidth rule (applied to ``k0m``) and
        without nulls, are recorded as ``{X}_control_{k}``
        (:data:`~nw_adapter.integration.recorder.CONTROL_COLUMNS`) and the ratio
        ``key_rms(k) / key_rms(k0)``, averaged over the rows of each CFG half, as ``key_scale_{k}``.
        ``references``: the m reference images whose tokens make up the keys (a support set, keys
        reference-major); with m > 1 the per-reference masses and entropies of
        :func:`~nw_adapter.integration.support.support_values` are recorded too, computed in the
        layer (a support set's columns are not deferred).

        Swap (``softmax.swap_h``, the bandwidth the swapped branch used): every attention quantity
        recorded (rho and its nulls, the readings, ``logit_scale``, the support-set masses, the
        maps) is of the branch's own weights, the exact NW head ``softmax((q.k_i - ||k_i||^2 / 2)
        / swap_h^2)`` that produces the output (:func:`~.deferred.recorded_head`), not of the stock
        dot-product softmax the branch replaced; the support masses read it through
        :func:`exact_head_as_dot_product`. The control stays the stock algebra: the same queries
        against the untrained keys through ``softmax(s q.k)`` at the stock scale s (docs/controls.md,
        "A swapped branch").

        Raises:
            ValueError: ``bandwidth="schedule"`` at s = 1 (uniform NW weights, rank statistics
                undefined): the pair is skipped, not recorded as NaN.
        """
        rec, cfg = self.recorder, self.nw_config
        state = ctx.state
        q, k, scale = softmax.q, softmax.k, softmax.scale
        swap_h = softmax.swap_h
        if isinstance(swap_h, torch.Tensor) and swap_h.shape[1] != len(heads):
            swap_h = swap_h.index_select(1, self._index(heads, swap_h.device))
        rule = cfg.bandwidth
        if rule == "schedule" and pure_noise_schedule(cfg, state):
            raise ValueError(
                "bandwidth='schedule' is infinite at s = 1 (pure noise): the NW weights are uniform and "
                "their rank statistics undefined; this step is not recorded (pick another bandwidth for it)"
            )
        batch, n = q.shape[0], len(halves)
        ip_mass, references = softmax.ip_mass, softmax.references
        mass = None if ip_mass is None else ip_mass.view(n, batch // n, len(heads)).mean(dim=1)
        support = None
        if references > 1:  # support sets only: computed here, in the layer, not deferred
            if swap_h is None:
                support = support_values(q, k, scale=scale, references=references, halves=n)
            else:  # the swapped branch's own weights, read as a dot product that keeps the distances
                inv = recorded_head({"scale": scale}, swap_h)["scale"]
                inv = inv[..., None, None] if isinstance(inv, torch.Tensor) else inv
                q_aug, k_aug = exact_head_as_dot_product(q, k)
                support = support_values(q_aug, k_aug, scale=inv, references=references, halves=n)
        entry = rec.reserve(
            layer=self.layer_name, adapter=softmax.adapter, image=softmax.image, halves=halves, heads=heads,
            scale=math.nan if isinstance(softmax.adapter_scale, (list, tuple)) else softmax.adapter_scale,
            num_keys=k.shape[-2], key_set=softmax.key_set, ip_mass=mass, support=support, state=state,
        )  # fmt: skip
        h = None if rule == "median" or rule == "fitted" else self._bandwidth(q, k, scale, ctx)
        capture = Capture(entry, q, k, scale, h, n, softmax.control_keys, swap_h)
        wants_maps = softmax.maps and cfg.store_maps and rec.wants_maps(self.layer_name)
        if not (wants_maps or cfg.deferred_mb == 0):
            if rec.pending is None:
                rec.pending = DeferredStatistics(cfg)
            rec.pending.add(capture)
            return
        self._compute_now(capture, wants_maps, ctx)

    def _compute_now(self, capture: Capture, wants_maps: bool, ctx: StepContext) -> None:
        """The per-layer path: the statistics of ``capture`` now (and its maps when wanted)."""
        rec, cfg, entry = self.recorder, self.nw_config, capture.entry
        q, k, scale, n = capture.q, capture.k, capture.scale, capture.halves
        h = capture.h if capture.h is not None else resolve_bandwidth(cfg, ctx.state, q, k, scale)
        draws = None
        if cfg.nulls:
            draws = stats.draw_nulls(q, k.shape[-2], cfg.null_rows, rec.generator(q.device))
        common = statistics_options(cfg, scale, n)
        head = recorded_head(common, capture.swap_h)
        values, attn_w, nw_w = stats.softmax_statistics(q, k, h=h, draws=draws, **head)
        if capture.control_keys:
            per_draw = [control_statistics(cfg, q, k, k0, h, common) for k0 in capture.control_keys]
            entry.control = torch.stack(per_draw)
        entry.stats = values
        if wants_maps:
            hw = ctx.state.latent_hw
            reduced = reduce_maps(cfg, heads=entry.heads, attn_w=attn_w, nw_w=nw_w, latent_hw=hw)
            if reduced is not None:
                attn_map, nw_map, meta = reduced
                rec.add_maps(
                    layer=self.layer_name, adapter=entry.adapter, image=entry.image, attn=attn_map, nw=nw_map,
                    meta=meta,
                )  # fmt: skip


def is_nw_processor(processor: Any) -> bool:
    """Whether ``processor`` is an NW processor of any family."""
    return isinstance(processor, NWProcessorBase)
