"""Install / remove the NW processors on a diffusers pipeline (mixin, functions, context manager).

Three equivalent entry points:

- :class:`NWIPAdapterMixin` for pipeline classes (:mod:`nw_adapter.pipelines`):
  ``pipe.set_ip_adapter_nw_processor(...)`` / ``pipe.unset_ip_adapter_nw_processor()``;
- :func:`apply_nw_processor` / :func:`remove_nw_processor` for any stock pipeline;
- :func:`nw_processor`, a context manager that removes the processors on exit.

Restoring: at install time ``dict(unet.attn_processors)`` is snapshotted; removal puts back the
very same processor objects in every layer that still holds an NW processor (layers replaced
since, e.g. by ``unload_ip_adapter``, are left as they are). ``set_attn_processor`` is always
given a copy, because it empties the dict it receives.

Exceptions and interrupts: processors stay where the user put them. An exception or Ctrl-C
inside a pipeline call removes only that call's own hooks (the processors remove theirs in
``finally``); processors installed with ``set_ip_adapter_nw_processor()`` /
:func:`apply_nw_processor` stay installed, and the companion pipelines (which wrap ``__call__``)
drop the interrupted call's partial records and maps, with one warning per recorder. With a
stock pipeline and :func:`apply_nw_processor` nothing wraps the call: a partial call's records
stay and :meth:`NWRecorder.discard_call` drops them. The :func:`nw_processor` context manager
restores the original processors on exit, exceptions included.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.control import UntrainedControl
from nw_adapter.integration.errors import NWConfigError, NWInstallError
from nw_adapter.integration.families import family_of_denoiser
from nw_adapter.integration.processors import is_ip_processor, is_nw_processor, nw_processor_for
from nw_adapter.integration.recorder import NWRecorder

_STATE_ATTR = "_nw_adapter_state"


@dataclass
class _NWState:
    originals: dict[str, Any]
    layers: tuple[str, ...]
    recorder: NWRecorder
    control: UntrainedControl | None = None


def _build_control(unet: torch.nn.Module, config: NWProcessorConfig) -> UntrainedControl | None:
    """The untrained-adapter control of ``config`` (its ``untrained_draws`` draws built once, draw k
    seeded ``untrained_seed + k``), or None when it is off."""
    if not config.untrained_control:
        return None
    try:
        return UntrainedControl.build(unet, seed=config.untrained_seed, draws=config.untrained_draws)
    except ValueError as error:
        raise NWInstallError(
            f"untrained_control: {error}; or pass untrained_control=False (command line: "
            "--no-untrained-control) to run without the control"
        ) from None


def _unet_of(pipe: Any) -> torch.nn.Module:
    """The denoiser whose attention processors are replaced: ``pipe.unet`` (SD 1.5, SDXL ...),
    ``pipe.transformer`` (SD3, Flux), or ``pipe`` itself when it is such a model."""
    unet = getattr(pipe, "unet", None)
    if unet is None:
        unet = getattr(pipe, "transformer", None)
    if unet is None and isinstance(pipe, torch.nn.Module) and hasattr(pipe, "attn_processors"):
        unet = pipe
    if unet is None or not hasattr(unet, "set_attn_processor"):
        raise NWInstallError(
            f"pipe: {type(pipe).__name__} has no `unet` or `transformer` with attention processors; "
            "pass a Stable Diffusion / SDXL / SD3 / Flux pipeline (or its denoiser)"
        )
    return unet


def _timestep_scale(denoiser: torch.nn.Module) -> float:
    """Factor from the timestep the denoiser receives to ``scheduler.timesteps`` units: its family's
    :attr:`~nw_adapter.integration.families.Family.timestep_scale` (1000 for Flux transformers, whose
    pipelines pass ``timestep / 1000``), 1 for a denoiser of no known family."""
    family = family_of_denoiser(denoiser)
    return 1.0 if family is None else family.timestep_scale


def _check_noise_levels(pipe: Any, config: NWProcessorConfig) -> None:
    """Refuse an option that needs the scheduler's noise level where there is no scheduler.

    ``bandwidth="schedule"`` (h = c sigma_t / alpha_t) reads sigma_t / alpha_t of the current step
    from ``pipe.scheduler`` through the step hook. Installed on a bare denoiser (or a pipeline without
    a scheduler), every step's level is unknown: swap would fail at the first forward and observe
    would record nothing. The other rules (matched, fitted, median, a fixed h) need no scheduler.

    Raises:
        NWInstallError: the one line, with the fix.
    """
    if config.bandwidth == "schedule" and getattr(pipe, "scheduler", None) is None:
        raise NWInstallError(
            f"bandwidth='schedule' needs the scheduler's sigma_t / alpha_t of every step, and "
            f"{type(pipe).__name__} has no scheduler; install on the pipeline (apply_nw_processor(pipe, "
            "...), not its denoiser) or pick a rule that needs none (matched, fitted, median or a number)"
        )


def _make_config(config: NWProcessorConfig | None, options: dict[str, Any]) -> NWProcessorConfig:
    if config is not None and options:
        raise NWConfigError(
            f"pass either `config` or keyword options, not both (got config and {sorted(options)}); "
            "put the options into the NWProcessorConfig"
        )
    if config is None:
        return NWProcessorConfig.from_kwargs(**options)
    if not isinstance(config, NWProcessorConfig):
        raise NWConfigError(
            f"config must be an NWProcessorConfig, got {type(config).__name__}; "
            "build one with NWProcessorConfig(...) or pass keyword options"
        )
    return config


def ip_adapter_layers(pipe: Any) -> list[str]:
    """Names of the attention processors that are IP-Adapter processors (diffusers' or NW)."""
    unet = _unet_of(pipe)
    return [n for n, p in unet.attn_processors.items() if is_ip_processor(p)]


def apply_nw_processor(pipe: Any, config: NWProcessorConfig | None = None, **options: Any) -> NWRecorder:
    """Replace the IP-Adapter processors of ``pipe.unet`` (or ``pipe.transformer``) by NW processors.

    Families: UNet pipelines (diffusers' ``IPAdapterAttnProcessor(2_0)``), SD 3 / 3.5
    (``SD3IPAdapterJointAttnProcessor2_0``) and Flux (``FluxIPAdapterAttnProcessor``); the step
    hook sits on the same denoiser.

    Calling it again first removes the previous NW processors (no double wrapping) and then
    installs the new configuration with a fresh recorder.

    With ``untrained_control=True`` the untrained-adapter control
    (:class:`~nw_adapter.integration.control.UntrainedControl`) is built once here, its
    ``untrained_draws`` draws seeded ``untrained_seed + k``, and its two forward pre-hooks
    (denoiser, image projection) registered;
    :func:`remove_nw_processor` removes them and drops the control.

    Args:
        pipe: a diffusers pipeline with ``unet`` or ``transformer`` and a loaded IP-Adapter (or
            the denoiser itself; then CFG halves are only reported with ``cfg=True``).
        config: an :class:`~nw_adapter.integration.config.NWProcessorConfig`, or None to build one from
            ``options``.
        **options: the fields of :class:`~nw_adapter.integration.config.NWProcessorConfig`.

    Returns:
        The :class:`~nw_adapter.integration.recorder.NWRecorder` receiving the statistics.

    Raises:
        NWInstallError: before ``load_ip_adapter`` (or with xFormers processors), an adapter
            the untrained control does not support (with ``untrained_control=True``), or
            ``bandwidth="schedule"`` without a scheduler (``pipe`` a bare denoiser).
        NWConfigError: an invalid option, or a ``layers`` prefix that matches no IP-Adapter layer.
        (Both are ``ValueError`` subclasses, :mod:`nw_adapter.integration.errors`.)

    Example:
        >>> rec = apply_nw_processor(pipe, mode="observe", bandwidth="matched")
        >>> image = pipe("a cat", ip_adapter_image=ref, num_inference_steps=30).images[0]
        >>> remove_nw_processor(pipe)
        >>> rec.to_csv("rho.csv")
    """
    config = _make_config(config, options)
    unet = _unet_of(pipe)
    _check_noise_levels(pipe, config)
    remove_nw_processor(pipe)
    originals = dict(unet.attn_processors)
    ip_layers = [n for n, p in originals.items() if is_ip_processor(p)]
    if not ip_layers and any(
        type(p).__name__ == "IPAdapterXFormersAttnProcessor" for p in originals.values()
    ):
        raise NWInstallError(
            "set_ip_adapter_nw_processor: xFormers IP-Adapter processors are not supported; call "
            "pipe.disable_xformers_memory_efficient_attention() and reload the IP-Adapter"
        )
    if not ip_layers:
        raise NWInstallError(
            "set_ip_adapter_nw_processor: the denoiser has no IP-Adapter attention processors; call "
            "pipe.load_ip_adapter(...) first"
        )
    if config.layers is None:
        selected = ip_layers
    else:
        for prefix in config.layers:
            if not any(n.startswith(prefix) for n in ip_layers):
                raise NWConfigError(
                    f"NWProcessorConfig: `layers` entry {prefix!r} matches no IP-Adapter layer; use "
                    f"a prefix of one of {ip_layers[:3]}... "
                    "(see nw_adapter.integration.mixin.ip_adapter_layers)"
                )
        selected = [n for n in ip_layers if any(n.startswith(p) for p in config.layers)]
    control = _build_control(unet, config)  # before anything changes: a failure installs nothing
    recorder = NWRecorder(config, pipe if not isinstance(pipe, torch.nn.Module) else None)
    new = dict(originals)
    for name in selected:
        new[name] = nw_processor_for(originals[name], layer_name=name, config=config, recorder=recorder)
        new[name].set_untrained_control(control)
    state = _NWState(originals=originals, layers=tuple(selected), recorder=recorder, control=control)
    setattr(unet, _STATE_ATTR, state)
    try:
        unet.set_attn_processor(dict(new))
        recorder.tracker.attach(unet, timestep_scale=_timestep_scale(unet))
        if control is not None:
            control.attach(unet)
    except BaseException:
        remove_nw_processor(pipe)  # processors and hooks back as they were
        raise
    return recorder


def remove_nw_processor(pipe: Any) -> NWRecorder | None:
    """Put back the exact processor objects replaced by :func:`apply_nw_processor`.

    Layers whose NW processor was replaced meanwhile (``unload_ip_adapter``, a new
    ``load_ip_adapter``) keep their current processor. A no-op when nothing is installed.

    Returns:
        The recorder of the removed installation (its data stay readable), or None.
    """
    unet = _unet_of(pipe)
    state: _NWState | None = getattr(unet, _STATE_ATTR, None)
    if state is None:
        return None
    state.recorder.detach()
    if state.control is not None:
        state.control.detach()
    current = dict(unet.attn_processors)
    for processor in current.values():
        if is_nw_processor(processor):
            processor.set_untrained_control(None)  # removing the processors drops the control
    restored = {
        n: (state.originals[n] if is_nw_processor(p) and n in state.originals else p)
        for n, p in current.items()
    }
    if any(restored[n] is not current[n] for n in current):
        unet.set_attn_processor(dict(restored))
    delattr(unet, _STATE_ATTR)
    return state.recorder


def active_recorder(pipe: Any) -> NWRecorder | None:
    """The recorder of the installed NW processors, or None."""
    state = getattr(_unet_of(pipe), _STATE_ATTR, None)
    return None if state is None else state.recorder


@contextlib.contextmanager
def nw_processor(pipe: Any, config: NWProcessorConfig | None = None, **options: Any) -> Iterator[NWRecorder]:
    """Context manager: NW processors installed inside, originals restored on exit (also on error).

    Example:
        >>> with nw_processor(pipe, mode="swap", bandwidth="matched", layers=["up_blocks"]) as rec:
        ...     image = pipe("a cat", ip_adapter_image=ref).images[0]
    """
    recorder = apply_nw_processor(pipe, config, **options)
    try:
        yield recorder
    finally:
        remove_nw_processor(pipe)


_WARNED_ABOUT_INTERRUPTS: weakref.WeakSet[NWRecorder] = weakref.WeakSet()


def _discard_interrupted_call(recorder: NWRecorder, error: BaseException, *, where: str) -> int:
    """Drop the current call's partial records after ``error`` stopped it; the first time per
    recorder a RuntimeWarning says so (``where``: who saw it, e.g. the pipeline class)."""
    dropped = recorder.discard_call()
    if recorder not in _WARNED_ABOUT_INTERRUPTS:
        _WARNED_ABOUT_INTERRUPTS.add(recorder)
        warnings.warn(
            f"{where}: the pipeline call raised {type(error).__name__}; its {dropped} partial record(s) "
            "were dropped and the NW processors stay installed (pipe.unset_ip_adapter_nw_processor() "
            "removes them)",
            RuntimeWarning,
            stacklevel=4,
        )
    return dropped


class NWIPAdapterMixin:
    """Pipeline mixin: ``set_ip_adapter_nw_processor`` / ``unset_ip_adapter_nw_processor``.

    Put it before the diffusers pipeline class, e.g.
    ``class StableDiffusionNWPipeline(NWIPAdapterMixin, StableDiffusionPipeline)``, and route the
    pipeline's ``__call__`` through :meth:`_nw_call` so that a call that raises (or is
    interrupted) leaves the processors installed and drops its partial records.

    Example:
        >>> pipe = StableDiffusionNWPipeline.from_pretrained(folder)
        >>> pipe.load_ip_adapter(ip_folder, subfolder="models", weight_name="ip-adapter_sd15.safetensors")
        >>> rec = pipe.set_ip_adapter_nw_processor(mode="observe", bandwidth="fitted")
        >>> pipe("a cat", ip_adapter_image=ref, num_inference_steps=30)
        >>> rec.summary()
        >>> pipe.unset_ip_adapter_nw_processor()
    """

    def set_ip_adapter_nw_processor(
        self, config: NWProcessorConfig | None = None, **options: Any
    ) -> NWRecorder:
        """Install NW processors on every (or the selected) IP-Adapter layer; see :func:`apply_nw_processor`.

        Args:
            config: an NWProcessorConfig, or None to build one from ``options``.
            **options: ``mode``, ``bandwidth``, ``layers``, ``heads``, ``steps``, ``store_maps`` ... (the
                fields of :class:`~nw_adapter.integration.config.NWProcessorConfig`).

        Returns:
            The recorder.
        """
        return apply_nw_processor(self, config, **options)

    def unset_ip_adapter_nw_processor(self) -> NWRecorder | None:
        """Restore the original IP-Adapter processors (exact objects); returns the old recorder."""
        return remove_nw_processor(self)

    @property
    def nw_recorder(self) -> NWRecorder | None:
        """The recorder of the installed NW processors (None when not installed)."""
        return active_recorder(self)

    def _nw_call(self, parent_call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``parent_call``. On any exception or interrupt the NW processors stay installed and
        the call's partial records are dropped (one warning per recorder), then it re-raises."""
        recorder = active_recorder(self)
        if recorder is not None:
            recorder.new_call()
        try:
            return parent_call(*args, **kwargs)
        except BaseException as error:
            recorder = active_recorder(self)
            if recorder is not None:
                _discard_interrupted_call(recorder, error, where=type(self).__name__)
            raise
