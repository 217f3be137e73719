"""Step tracking: which call, step and pass of the sampling loop a denoiser forward belongs to.

:class:`StepTracker` is a forward pre-hook on the denoiser (a UNet or a transformer; the step is
not passed through ``cross_attention_kwargs``) that keeps :attr:`StepTracker.state`, a
:class:`StepState`, for the processors and the recorder to read. It records nothing itself.

How (see :meth:`StepTracker.attach`):

- **Calls.** A new pipeline call is detected when ``pipe.scheduler.timesteps`` is a different
  tensor object than at the previous denoiser forward (``set_timesteps`` creates a new tensor
  at the start of every call). Without a pipeline (a bare UNet) call
  :meth:`StepTracker.new_call` (``NWRecorder.new_call``) before each sampling loop; the mixin
  pipelines also call it.
- **Steps.** The step label is the index ``i`` of the step in ``scheduler.timesteps``, never a
  count of denoiser forwards, so that ``timestep == scheduler.timesteps[i]`` and the noise level
  is row ``i`` of the scheduler's own table, also on truncated schedules (img2img and
  inpainting with ``strength < 1``, SDXL ``denoising_start`` / ``denoising_end``: the first
  recorded step is then not 0). ``i`` is the scheduler's own ``step_index`` when it has one
  (Euler, DPM-Solver, LCM, flow matching ...; before the first ``scheduler.step`` its
  ``begin_index``), else the position of the received timestep in ``scheduler.timesteps``
  (DDIM, DDPM, PNDM: one host read of the timestep per forward), searched after the previous
  step of the call, so PNDM's repeated timestep is a step of its own and the labels equal
  ``scheduler.timesteps`` entry by entry. Without a scheduler (a bare UNet), or for a
  timestep off its table, every forward is the next step and the level is NaN (or
  interpolated from ``alphas_cumprod`` at the timestep).
- **Passes.** A denoiser forward that does not advance the scheduler (same ``step_index`` /
  PNDM ``counter``; for a scheduler without either, the same timestep again with no later
  entry equal to it) is a further pass of the same step: Flux's true CFG runs the transformer
  twice per step (positive, then negative). The step is recorded once and
  :attr:`StepState.pass_index` counts the passes (0, 1, ...), for the processors to label.
- **Reference content.** At the first forward of every call the IP-Adapter image embeddings
  the denoiser receives (UNets: ``added_cond_kwargs["image_embeds"]``; SD3 / Flux:
  ``joint_attention_kwargs["ip_adapter_image_embeds"]``) are kept by reference and hashed once,
  when the records are read after the call (no host copy during a call):
  :meth:`StepTracker.input_digest_of`, the records'
  ``input_digest``, by which the verdict counts one reference content once.
- **Call settings.** At the same forward, the call's number of steps, scheduler, guidance scale,
  latent size and first step (its step index: > 0 for ``strength < 1``) are read
  (:func:`~nw_adapter.integration.settings.call_settings`, :meth:`StepTracker.call_settings_of`):
  part of the records' settings digest.
- **Timestep conventions.** The timestep is read from the keyword ``timestep`` or the
  forward's positional parameter of that name, times ``timestep_scale`` (1000 for Flux, whose
  pipeline passes ``timestep / 1000``), so labels are in ``scheduler.timesteps`` units.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from nw_adapter.integration.schedules import noise_level, schedule_table
from nw_adapter.integration.settings import call_settings


@dataclass
class StepState:
    """Where the current denoiser forward sits: call, step, pass within the step, noise level.

    Attributes:
        call: index of the pipeline call (0-based).
        step: index of the step in ``scheduler.timesteps`` (or a forward count without a
            scheduler / off its table).
        timestep: the step's timestep, in ``scheduler.timesteps`` units.
        alpha, sigma, h: the noise level x_t = alpha x_0 + sigma eps, h = sigma / alpha.
        cfg: whether the batch is [uncond; cond].
        perturbed: whether the batch ends with perturbed-attention-guidance rows (PAG:
            [uncond; cond; perturbed] with CFG, [cond; perturbed] without).
        latent_hw: spatial size of the denoiser input.
        pass_index: 0 for the first denoiser forward of the step, 1 for the second (Flux's
            true-CFG negative pass) ...
    """

    call: int = 0
    step: int = 0
    timestep: Any = math.nan
    alpha: float = math.nan
    sigma: float = math.nan
    h: float = math.nan
    cfg: bool = False
    latent_hw: tuple[int, int] | None = None
    pass_index: int = 0
    perturbed: bool = False


@dataclass(eq=False)
class StepContext:
    """One denoiser pass as the NW processors read it, made once per pass by the recorder
    (:attr:`~nw_adapter.integration.recorder.NWRecorder.context`): every layer of the pass reads
    this one object instead of asking the recorder and its tracker.

    Attributes:
        state: the pass's :class:`StepState` (call, step, pass index, noise level).
        cfg: whether the batch is [uncond; cond]: ``config.cfg`` when set, else ``state.cfg``.
        selected: whether the step is one of ``config.steps`` (all when None).
        memo: what the processors resolve once per pass for every layer (the CFG halves of a
            batch size, the bandwidth of a rule that reads no keys per softmax scale); a new pass
            starts with an empty one.
    """

    state: StepState
    cfg: bool = False
    selected: bool = True
    memo: dict[Any, Any] = field(default_factory=dict)


_NO_MARKER = object()


def _progress_marker(scheduler: Any) -> Any:
    """What changes when ``scheduler.step`` runs: ``step_index``, PNDM's ``counter``, or nothing."""
    if scheduler is None:
        return _NO_MARKER
    if hasattr(type(scheduler), "step_index") or hasattr(scheduler, "_step_index"):
        return getattr(scheduler, "step_index", None)
    counter = getattr(scheduler, "counter", None)
    return counter if isinstance(counter, int) else _NO_MARKER


def _scheduler_index(scheduler: Any, size: int) -> int | None:
    """The scheduler's own index of the step being denoised, if it keeps one (no host sync)."""
    for name in ("step_index", "begin_index"):  # begin_index: before the first scheduler.step
        index = getattr(scheduler, name, None)
        if isinstance(index, int) and 0 <= index < size:
            return index
    return None


def _nearest_index(timesteps: list[float], t: float, start: int) -> int | None:
    """Index of the entry of ``timesteps`` nearest to ``t``, searched from ``start`` first.

    Ties go to the first entry (PNDM's repeat). None when the nearest entry is further than
    1% of the schedule's range from ``t`` (a timestep off the table, e.g. a custom loop).
    """
    if not timesteps:
        return None
    tolerance = 0.01 * max(1.0, max(abs(v) for v in timesteps))
    for lo in (min(start, len(timesteps)), 0):
        window = range(lo, len(timesteps))
        if not window:
            continue
        best = min(window, key=lambda i: (abs(timesteps[i] - t), i))
        if abs(timesteps[best] - t) <= tolerance:
            return best
    return None


class StepTracker:
    """Tracks the (call, step, pass, noise level) of every denoiser forward (see the module docstring).

    Args:
        pipe: the pipeline whose ``scheduler`` gives the noise level and whose
            ``do_classifier_free_guidance`` / ``do_perturbed_attention_guidance`` tell the batch
            layout. Optional: without it, drive the tracker with :meth:`begin_step`.
        cfg: ``config.cfg``: True / False fixes whether the batch is [uncond; cond]; None asks
            the pipeline at every step.
        on_error: called with ``("step tracking", error)`` when tracking one forward fails (the
            forward then counts as the next step with an unknown noise level; the generation
            goes on).

    Attributes:
        state: the :class:`StepState` of the current forward.
        steps: ``{(call, step): StepState}`` of every step seen (the state of its first pass).
        call_serial: increases whenever a new call begins (the recorder reseeds its nulls then).

    The IP-Adapter image embeddings of each call are kept (references, no copy) and hashed only
    when :meth:`input_digest_of` is first asked, after the call: no host copy during a call.
    """

    def __init__(
        self,
        pipe: Any = None,
        *,
        cfg: bool | None = None,
        on_error: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        self.pipe = pipe
        self.cfg_override = cfg
        self._on_error = on_error or _raise
        self.state = StepState()
        self.steps: dict[tuple[int, int], StepState] = {}
        self.call_serial = 0
        self._input_embeds: dict[int, list[torch.Tensor]] = {}
        self._input_digests: dict[int, str | None] = {}
        self._call_settings: dict[int, dict[str, Any]] = {}
        self._started = False
        self._hook: Any = None
        self._pending_call = False
        self._timestep_scale = 1.0
        self._positions: dict[str, int] = {}
        self._last_timesteps: Any = None
        self._table: list[dict[str, float]] = []
        self._table_timesteps: list[float] = []
        self._marker: Any = _NO_MARKER
        self._host_t: float | None = None
        self._on_table = False

    def attach(self, denoiser: torch.nn.Module, *, timestep_scale: float = 1.0) -> None:
        """Register the denoiser forward pre-hook that tracks the step (idempotent).

        Args:
            denoiser: the UNet or transformer whose forward receives ``timestep``.
            timestep_scale: factor from the received timestep to ``scheduler.timesteps`` units:
                1 for UNets and SD3 (timestep in [0, 1000]), 1000 for Flux (its pipeline passes
                ``timestep / 1000``).
        """
        self.detach()
        valid = isinstance(timestep_scale, (int, float)) and math.isfinite(timestep_scale)
        if not (valid and timestep_scale > 0):
            raise ValueError(f"timestep_scale must be a positive number, got {timestep_scale!r}")
        self._timestep_scale = float(timestep_scale)
        self._positions = _positional_indices(denoiser, ("sample", "hidden_states", "timestep"))
        self._hook = denoiser.register_forward_pre_hook(self._pre_hook, with_kwargs=True)

    def detach(self) -> None:
        """Remove the denoiser forward pre-hook."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _argument(self, names: tuple[str, ...], args: tuple, kwargs: dict) -> Any:
        for name in names:
            if name in kwargs:
                return kwargs[name]
            pos = self._positions.get(name)
            if pos is not None and pos < len(args):
                return args[pos]
        return None

    def _pre_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        try:
            self._track(args, kwargs)
        except Exception as error:  # never fail a generation: next step, unknown noise level
            self.begin_step(call=self.state.call, step=self.state.step + 1, cfg=self.state.cfg)
            self._on_error("step tracking", error)

    def _track(self, args: tuple, kwargs: dict) -> None:
        """Set :attr:`state` for the denoiser forward called with ``args`` / ``kwargs``."""
        timestep = self._argument(("timestep",), args, kwargs)
        timestep = math.nan if timestep is None else _first(timestep)
        if self._timestep_scale != 1.0 and not _is_nan(timestep):
            timestep = timestep * self._timestep_scale
        sample = self._argument(("sample", "hidden_states"), args, kwargs)
        hw = tuple(sample.shape[-2:]) if isinstance(sample, torch.Tensor) and sample.ndim in (4, 5) else None
        scheduler = getattr(self.pipe, "scheduler", None)
        timesteps = getattr(scheduler, "timesteps", None)
        new_call = (
            not self._started
            or self._pending_call
            or (timesteps is not None and timesteps is not self._last_timesteps)
        )
        self._pending_call = False
        if new_call:
            self._last_timesteps = timesteps
            self._table = schedule_table(scheduler) if isinstance(timesteps, torch.Tensor) else []
            self._table_timesteps = [row["timestep"] for row in self._table]
        cfg = self.cfg_override
        if cfg is None:
            cfg = bool(getattr(self.pipe, "do_classifier_free_guidance", False)) if self.pipe else False
        perturbed = bool(getattr(self.pipe, "do_perturbed_attention_guidance", False)) if self.pipe else False
        marker = _progress_marker(scheduler)
        index = _scheduler_index(scheduler, len(self._table))
        # Without the scheduler's own index, the timestep itself decides (one host read); without
        # a scheduler nothing is looked up, so nothing is read (no host sync: bare UNets, benchmarks).
        reads_t = (
            scheduler is not None
            and (marker is _NO_MARKER or marker is None or index is None)
            and not _is_nan(timestep)
        )
        host_t = float(timestep) if reads_t else None
        st = self.state
        if not new_call and scheduler is not None and self._is_same_step(marker, host_t):
            self.begin_step(
                call=st.call,
                step=st.step,
                timestep=st.timestep,
                alpha=st.alpha,
                sigma=st.sigma,
                cfg=cfg,
                latent_hw=hw,
                pass_index=st.pass_index + 1,
                perturbed=perturbed,
            )
            return
        if index is None and self._table and host_t is not None:
            start = 0 if new_call or not self._on_table else st.step + 1
            index = _nearest_index(self._table_timesteps, host_t, start)
        self._marker, self._host_t, self._on_table = marker, host_t, index is not None
        if index is not None:
            row = self._table[index]
            step, label, alpha, sigma = index, row["timestep"], row["alpha"], row["sigma"]
        else:  # no scheduler, or a timestep off its table: count forwards, level from t
            step = 0 if new_call else st.step + 1
            label = timestep
            alpha = sigma = math.nan
            if scheduler is not None and host_t is not None:
                alpha, sigma, _ = noise_level(scheduler, host_t)
        self.begin_step(
            call=st.call + 1 if (new_call and self._started) else st.call,
            step=step,
            timestep=label,
            alpha=alpha,
            sigma=sigma,
            cfg=cfg,
            latent_hw=hw,
            perturbed=perturbed,
        )
        if new_call:  # once per call: the settings that change what its readings mean
            try:
                start = self.state.step if index is not None else None  # from the scheduler's table
                self._call_settings[self.state.call] = call_settings(self.pipe, hw, start)
            except Exception:  # noqa: BLE001 - an unreadable setting only means "settings unknown"
                self._call_settings.pop(self.state.call, None)
        if new_call:  # once per call: the reference's content, for the verdict's units (hashed later)
            try:
                embeds = input_embeds(kwargs)
            except Exception:  # noqa: BLE001 - an unreadable input only means "content unknown"
                embeds = []
            self._input_digests.pop(self.state.call, None)  # a digest is of this call's embeddings only
            if embeds:
                self._input_embeds[self.state.call] = embeds
            else:
                self._input_embeds.pop(self.state.call, None)

    def call_settings_of(self, call: int) -> dict[str, Any]:
        """The settings ``call`` began with (:func:`~nw_adapter.integration.settings.call_settings`:
        steps, scheduler, guidance, resolution; and ``start_step``, the step index of its first
        forward where the scheduler's table gives it, else None); empty when the call was not
        tracked (no pipeline)."""
        return dict(self._call_settings.get(call, {}))

    def input_digest_of(self, call: int) -> str | None:
        """The digest (:func:`embeds_digest`) of ``call``'s IP-Adapter image embeddings; None if unknown."""
        if call not in self._input_digests:
            self._input_digests[call] = embeds_digest(self._input_embeds.pop(call, []))
        return self._input_digests[call]

    def _is_same_step(self, marker: Any, host_t: float | None) -> bool:
        """Whether this forward is a further pass of the current step (the scheduler did not move).

        ``marker`` is the scheduler's progress (``step_index`` / PNDM ``counter``), ``host_t`` the
        received timestep when it was read.
        """
        if marker is _NO_MARKER:  # the same timestep, and no later table entry equal to it
            later = self._table_timesteps[self.state.step + 1 :] if self._on_table else []
            return host_t is not None and host_t == self._host_t and host_t not in later
        if marker is None:  # before the scheduler's first step: the timestep decides
            return host_t is not None and host_t == self._host_t
        return marker == self._marker

    def new_call(self) -> None:
        """Mark the next denoiser forward as the start of a new call (needed only without a pipeline)."""
        self._pending_call = True

    def begin_step(
        self,
        *,
        call: int = 0,
        step: int = 0,
        timestep: Any = math.nan,
        alpha: float = math.nan,
        sigma: float = math.nan,
        cfg: bool = False,
        latent_hw: tuple[int, int] | None = None,
        pass_index: int = 0,
        perturbed: bool = False,
    ) -> None:
        """Set the current step by hand (the denoiser pre-hook calls this for you).

        Args:
            call: index of the pipeline call (a new index advances :attr:`call_serial`).
            step: index of the step in ``scheduler.timesteps``.
            timestep: the step's timestep (a 0-d tensor is kept as is until export).
            alpha: alpha_t (VP convention), sigma: sigma_t; h = sigma / alpha.
            cfg: whether the batch is [uncond; cond].
            latent_hw: spatial size of the denoiser input, used to downsample stored maps.
            pass_index: which denoiser forward within the step this is (0 = the first).
            perturbed: whether the batch ends with PAG's perturbed rows.
        """
        if not self._started or call != self.state.call:
            self.call_serial += 1  # a new call: the recorder reseeds the nulls' generators
        self._started = True
        if math.isfinite(alpha) and alpha > 0:
            h = sigma / alpha
        else:  # alpha = 0 (pure noise, e.g. flow matching's s = 1): h = inf
            h = math.inf if alpha == 0 and sigma > 0 else math.nan
        self.state = StepState(
            call=call,
            step=step,
            timestep=timestep,
            alpha=alpha,
            sigma=sigma,
            h=h,
            cfg=bool(cfg),
            latent_hw=latent_hw,
            pass_index=pass_index,
            perturbed=bool(perturbed),
        )
        self.steps[(call, step)] = self.state

    def step_info(self, call: int, step: int) -> dict[str, float]:
        """``timestep``, ``alpha``, ``sigma``, ``h_schedule`` of a step seen (NaN when unknown)."""
        st = self.steps.get((call, step), StepState())
        return {
            "timestep": float(_first(st.timestep)),
            "alpha": float(st.alpha),
            "sigma": float(st.sigma),
            "h_schedule": float(st.h),
        }


DIGEST_HEX = 16
"""Hex digits kept of an input digest's SHA-256 (64 bits: no collision among a run's references)."""


def input_embeds(kwargs: dict) -> list[torch.Tensor]:
    """The IP-Adapter image embeddings of a denoiser call, detached, on their device (no copy).

    Read from ``added_cond_kwargs["image_embeds"]`` (UNets) or
    ``joint_attention_kwargs["ip_adapter_image_embeds"]`` (SD3, Flux): a tensor or a list of
    them (one per adapter). Empty when there are none.
    """
    added = kwargs.get("added_cond_kwargs")
    joint = kwargs.get("joint_attention_kwargs")
    embeds = added.get("image_embeds") if isinstance(added, dict) else None
    if embeds is None and isinstance(joint, dict):
        embeds = joint.get("ip_adapter_image_embeds")
    listed = embeds if isinstance(embeds, list | tuple) else [embeds]
    return [t.detach() for t in listed if torch.is_tensor(t)]


def input_digest(kwargs: dict) -> str | None:
    """SHA-256 (first :data:`DIGEST_HEX` hex) of the IP-Adapter image embeddings of a denoiser call.

    The embeddings are those of :func:`input_embeds`, each hashed with its shape as float32 on
    the host. The same reference (and the same embeddings passed in) gives the same digest. None
    when there are no such embeddings or they cannot be read (the generation goes on either way).
    """
    try:
        return embeds_digest(input_embeds(kwargs))
    except Exception:  # noqa: BLE001 - an unreadable input only means "content unknown"
        return None


def embeds_digest(tensors: list[torch.Tensor]) -> str | None:
    """SHA-256 (first :data:`DIGEST_HEX` hex) of ``tensors`` (shapes and float32 values); None if empty."""
    try:
        if not tensors:
            return None
        digest = hashlib.sha256()
        for tensor in tensors:
            digest.update(repr(tuple(tensor.shape)).encode())
            digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return digest.hexdigest()[:DIGEST_HEX]
    except Exception:  # noqa: BLE001 - an unreadable input only means "content unknown"
        return None


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _positional_indices(module: torch.nn.Module, names: tuple[str, ...]) -> dict[str, int]:
    """Positions of the named parameters of ``module.forward`` (for positional calls)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return {"sample": 0, "timestep": 1}
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {n: positional.index(n) for n in names if n in positional}


def _first(value: Any) -> Any:
    """First element of a (possibly batched) timestep, kept as a tensor (no host sync)."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1)[0] if value.numel() else math.nan
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return next(iter(value))
    return value


def _raise(where: str, error: BaseException) -> None:
    raise error
