"""The model of a run, for every run of ``correlate.py``: resolved and checked, then loaded.

:func:`prepare_model` resolves ``--model`` / ``--ip-adapter`` / ``--subfolder`` / ``--weight-name`` /
``--image-encoder`` to files (:func:`~nw_adapter.correlate.loading.resolve_spec`), says offline what
cannot be loaded (:func:`~nw_adapter.correlate.loading.check_hub_files`), refuses a model family the
run or an option given does not read (:func:`nw_adapter.correlate.options.family_problem`, and
Flux's ``--true-cfg-scale`` rules), and resolves the device and dtype; all of it before the model
loads. :meth:`RunModel.load` then loads the pipeline and the adapter the standard diffusers way
and sets what every run sets (progress bars, IP-Adapter scale, the family's call arguments).
:meth:`RunModel.resolved` is what the options record (:func:`~nw_adapter.correlate.options.options_record`)
and the resume fingerprint read.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from nw_adapter.correlate.spec import ModelSpec

__all__ = ["RunModel", "check_layers", "check_true_cfg", "join_processes", "prepare_model"]


@dataclass
class RunModel:
    """A run's model.

    Attributes:
        spec: The resolved spec (files and folders).
        shown: The spec as recorded (tiny models' cache paths named ``tiny``).
        family: The name of its row in the family registry (:mod:`nw_adapter.integration.families`).
        device: The torch device string.
        dtype: The torch dtype.
        pipe: The pipeline, once :meth:`load` ran.
        call: The family's arguments of every pipeline call (Flux: ``true_cfg_scale``, ...).
    """

    spec: ModelSpec
    shown: ModelSpec
    family: str
    device: str
    dtype: Any
    pipe: Any = None
    call: dict[str, Any] = field(default_factory=dict)

    def load(self, args: argparse.Namespace, *, bars: bool) -> Any:
        """Load the pipeline and its adapter, set the progress bars and ``--ip-scale``; return it."""
        from nw_adapter.correlate import families
        from nw_adapter.correlate.loading import build_pipeline

        pipe = build_pipeline(
            self.spec, device=self.device, dtype=self.dtype, scheduler=args.scheduler, verbose=args.verbose
        )
        pipe.set_progress_bar_config(disable=not bars, leave=False)
        pipe.set_ip_adapter_scale(args.ip_scale)
        self.call = families.call_kwargs(pipe, args.true_cfg_scale)
        self.pipe = pipe
        return pipe

    def call_arguments(self, args: argparse.Namespace) -> dict[str, Any]:
        """The keyword arguments of every generation of the run: the prompt, steps and guidance
        options, the negative prompt and size when given, and the family's (:attr:`call`).

        Every run calls the pipeline with these (its images and generator added), so an option of
        the generation is read in this one place.
        """
        given = {name: getattr(args, name) for name in ("negative_prompt", "height", "width")}
        return {
            "prompt": args.prompt,
            "num_inference_steps": args.steps,
            "guidance_scale": args.guidance_scale,
            **{name: value for name, value in given.items() if value is not None},
            **({"guidance_rescale": args.guidance_rescale} if args.guidance_rescale else {}),
            **self.call,
        }

    @property
    def dtype_name(self) -> str:
        """The dtype as recorded (``float32``)."""
        return str(self.dtype).removeprefix("torch.")

    def resolved(self, **run: Any) -> Any:
        """The :class:`~nw_adapter.correlate.options.Resolved` of this model (``run``: the run's own
        fields, e.g. ``labels`` and ``judge``)."""
        from nw_adapter.correlate.options import Resolved

        scheduler = type(self.pipe.scheduler).__name__ if self.pipe is not None else None
        return Resolved(
            model=self.shown.to_dict(),
            resolved_model=self.spec.to_dict(),
            device=self.device,
            dtype=self.dtype_name,
            call=dict(self.call),
            scheduler_class=scheduler,
            **run,
        )


def check_true_cfg(args: argparse.Namespace, family: str) -> None:
    """Refuse a ``--true-cfg-scale`` that diffusers would silently ignore, for a family whose row says
    its pipeline takes one (:attr:`~nw_adapter.integration.families.Family.true_cfg`: Flux).

    ``FluxPipeline`` runs true CFG only when ``true_cfg_scale > 1`` AND a negative prompt is
    given; otherwise it logs a warning (hidden by this tool without ``-v``) and generates without
    it, while the record would hold the scale that was asked for. (The other families refuse the
    option while its row is read: :func:`~nw_adapter.correlate.options.family_problem`.)

    Raises:
        CLIError: the one line, before the model loads.
    """
    from nw_adapter.correlate.options import CLIError
    from nw_adapter.integration.families import family_named

    scale = args.true_cfg_scale
    row = family_named(family)
    if not row.true_cfg or scale == 1.0:
        return
    if scale < 1.0:
        raise CLIError(
            f"--true-cfg-scale {scale:g} has no effect: {row.label} runs true classifier-free guidance only "
            "for scales > 1; pass a scale > 1 with --negative-prompt, or drop --true-cfg-scale"
        )
    if args.negative_prompt is None:
        raise CLIError(
            f"--true-cfg-scale {scale:g} needs --negative-prompt: {row.label} runs true classifier-free "
            "guidance only against a negative prompt (without one diffusers ignores the scale); pass "
            "--negative-prompt TEXT ('' for an empty one) or drop --true-cfg-scale"
        )


def prepare_model(args: argparse.Namespace) -> RunModel:
    """Resolve and check the run's model without loading it.

    The model's files and family are checked before torch is imported (offline, a Hub id that is
    not cached is one line at once); then the device and dtype are resolved.

    Args:
        args: The parsed options (:func:`nw_adapter.correlate.options.parse_args`: ``run``, ``given``).

    Raises:
        ModelLoadError: a model or adapter that cannot be found (offline: not in the cache), a device
            this machine does not have.
        CLIError: a family the run does not run on, an option given that the family does not read,
            a Flux ``--true-cfg-scale`` that cannot take effect.
    """
    from nw_adapter.correlate import families
    from nw_adapter.correlate.loading import (
        check_adapter_files,
        check_hub_files,
        check_pipeline_folder,
        resolve_device,
        resolve_dtype,
        resolve_spec,
    )
    from nw_adapter.correlate.options import CLIError, family_problem

    spec = resolve_spec(
        ModelSpec(args.model, args.ip_adapter, args.subfolder, args.weight_name, args.image_encoder)
    )
    check_hub_files(spec)  # offline: what cannot be loaded, in one line, now
    check_pipeline_folder(spec.model)  # a local folder without a component's weights, or damaged ones, now
    check_adapter_files(spec, image_encoder_given=args.image_encoder is not None)  # damaged local weights
    family = families.family_of_model(spec.model)
    problem = family_problem(args, family)
    if problem:
        raise CLIError(problem)
    check_true_cfg(args, family)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    shown = families.shown_spec(args.model, args.ip_adapter, args.image_encoder, spec)
    return RunModel(spec=spec, shown=shown, family=family, device=device, dtype=dtype)


def check_layers(layers: list[str] | None, pipe: Any) -> None:
    """Check the ``--layers`` prefixes against the names of the pipeline's IP-Adapter layers.

    Reads the names from the denoiser's ``attn_processors`` (nothing is installed).

    Raises:
        CLIError: a prefix that matches no IP-Adapter layer; the message names the blocks of the
            loaded family (``down, mid, up`` for UNets, ``transformer_blocks`` for SD3 / Flux) and
            a real layer name.
    """
    if layers is None:
        return
    from nw_adapter.correlate.families import layer_blocks
    from nw_adapter.correlate.option_values import UNET_BLOCKS
    from nw_adapter.correlate.options import CLIError
    from nw_adapter.integration.mixin import ip_adapter_layers

    names = ip_adapter_layers(pipe)
    bad = next((p for p in layers if not any(n.startswith(p) for n in names)), None)
    if bad is None:
        return
    short = next((k for k, v in UNET_BLOCKS.items() if v == bad), None)
    shown = f"'{short}' ({bad})" if short else f"'{bad}'"
    blocks = layer_blocks(names)
    raise CLIError(
        f"--layers: {shown} matches no IP-Adapter layer of this model; use the block"
        f"{'s' if len(blocks) > 1 else ''} {', '.join(blocks)} or a processor-name prefix such as "
        f"'{names[0]}'"
    )


def join_processes(model: RunModel, requested: str) -> Any:
    """Join the other processes of an ``accelerate launch`` (one process: a stand-in); return the state.

    Under a multi-process launch, ``auto`` and a bare accelerator name (``cuda``) become the
    process's own device (``cuda:<local rank>``) from ``PartialState``; an explicit index is kept.
    """
    from nw_adapter.correlate.sweep import is_distributed_launch, process_state

    state = process_state(cpu=model.device == "cpu")
    if is_distributed_launch() and model.device != "cpu" and ":" not in requested:
        model.device = str(state.device)
    return state
