"""The end-to-end untrained-adapter control: a second generation with the untrained adapter in every layer.

The per-layer control (:mod:`nw_adapter.integration.control`) compares each layer's queries with
the keys of the untrained adapter, but those queries come from hidden states that the *trained*
image branch shaped in the earlier layers and steps: it isolates one layer's key algebra, not
"the same pipeline without adapter training". The end-to-end control removes that limit: the
same call (prompt, seed, generator state, latents, scheduler, steps, IP scale) is generated
again with the untrained initialisation swapped into every layer, so every query, key and value
of the control pass is the untrained branch's own, and its statistics are recorded by the same
observe processors.

Per control draw k (seed ``seed + k``), the untrained adapter of the training recipe
(:func:`~nw_adapter.integration.untrained.build_untrained_adapter`: fresh image projection,
``to_k_ip`` copied from the text ``to_k`` where the shapes match) plus, built here the same
way, the values: ``to_v_ip`` copied from the text ``to_v`` where the shapes match, else
PyTorch's default initialisation (seeded with ``seed + VALUE_SEED_OFFSET``; the UNet recipe
copies, so no random numbers are drawn there).

Scale matching (the scale-matched control of issue 26, on by default): per layer, head and
adapter, the untrained ``to_k_ip`` rows (weights and bias) of head h are multiplied by

    s_h = key_rms_h(trained) / key_rms_h(untrained),   key_rms_h(k) = sqrt(mean_{b, i} ||k_bhi||^2)

over this call's image embeddings (the conditional rows under classifier-free guidance, all rows
otherwise; every key of the adapter), and ``to_v_ip`` rows likewise by the values' RMS ratio.
For UNet and Flux the image keys and values are ``W P(e)``, the same at every step, so the row
scale gives the control's keys exactly that RMS norm ``s_h W_h P^0(e) = s_h k^0_h``. The values
are matched too because here, unlike the per-layer control, a change of value scale changes the
next layers' queries: a pure gain c on the image tokens scales both, and only with both matched
is its control the trained pass itself (shape effect 0).

:func:`untrained_adapter_swapped` swaps the modules in (and back exactly, also on error);
:func:`end_to_end_control` runs the trained call and the K control calls observed and merges the
control statistics into the trained records as ``{X}_control_{k}`` and ``key_scale_{k}``.

SD 3.5 is refused: its image keys pass a per-head RMSNorm after ``to_k_ip`` (a weight scale is
undone) and change with the timestep (``image_proj`` and ``norm_ip`` are timestep-conditioned),
so the keys of one call cannot be matched by one weight scale; use the per-layer control there.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.errors import NWConfigError, NWInstallError
from nw_adapter.integration.families import PASSES, family_named
from nw_adapter.integration.mixin import active_recorder, nw_processor
from nw_adapter.integration.schema import CONTROL_OF, H_EFF_REASON_FIELD, control_column, key_scale_column
from nw_adapter.integration.untrained import UntrainedAdapter, build_untrained_adapter, projection_module

__all__ = [
    "MATCH_KEYS",
    "MATCHED",
    "VALUE_SEED_OFFSET",
    "EndToEndResult",
    "RandomStateReplay",
    "UntrainedDraw",
    "build_untrained_draw",
    "end_to_end_control",
    "fresh_call_kwargs",
    "head_scales",
    "observed_call",
    "record_key",
    "untrained_adapter_swapped",
]

VALUE_SEED_OFFSET = 1_000_003
"""The value projections of draw seed s are initialised under seed ``s + VALUE_SEED_OFFSET`` (a
stream apart from the keys' and the projection's, which use s)."""

MATCH_KEYS = ("call", "step", "layer", "head", "half", "adapter", "image", "key_set")
"""The fields a trained record and its control record are matched by."""

MATCHED = (
    "to_k_ip (to_v_ip) rows rescaled per layer and head so the untrained keys (values) have the trained "
    "keys' (values') RMS norm on this call's image embeddings"
)
"""The ``matched`` entry of the ``control`` meta with scale matching on."""

_SUFFIX = ".processor"


@dataclass(frozen=True)
class UntrainedDraw:
    """One draw of the untrained adapter, keys and values.

    Attributes:
        adapter: The image projection and key projections
            (:func:`~nw_adapter.integration.untrained.build_untrained_adapter`).
        value_projections: Per IP layer, one ``nn.Linear`` per loaded adapter: the layer's text
            ``to_v`` where the shapes match, else default-initialised.
        value_copied: Per IP layer, per adapter: True where the value projection was copied.
    """

    adapter: UntrainedAdapter
    value_projections: dict[str, list[nn.Linear]]
    value_copied: dict[str, list[bool]]

    @property
    def seed(self) -> int:
        """The draw's seed."""
        return self.adapter.seed


def _denoiser(pipe: Any) -> nn.Module:
    for name in ("unet", "transformer"):
        module = getattr(pipe, name, None)
        if isinstance(module, nn.Module):
            return module
    raise NWInstallError(f"{type(pipe).__name__} has no unet or transformer; pass a diffusers pipeline")


def _attention(denoiser: nn.Module, layer: str) -> nn.Module:
    return denoiser.get_submodule(layer.removesuffix(_SUFFIX))


def _value_projection(trained: nn.Linear, text: nn.Linear | None) -> tuple[nn.Linear, bool]:
    """A CPU float32 Linear shaped like ``trained``: ``text``'s weights (its bias, or 0) where the
    shapes match, else PyTorch's default initialisation (the global random state)."""
    fresh = nn.Linear(trained.in_features, trained.out_features, bias=trained.bias is not None)
    same = isinstance(text, nn.Linear) and text.weight.shape == trained.weight.shape
    if same:
        with torch.no_grad():
            fresh.weight.copy_(text.weight)
            if fresh.bias is not None:
                fresh.bias.copy_(text.bias) if text.bias is not None else fresh.bias.zero_()
    return fresh, same


def _check_family(adapter: UntrainedAdapter) -> None:
    """Refuse a family whose row says the end-to-end control cannot run on it
    (:attr:`~nw_adapter.integration.families.Family.end_to_end`)."""
    family = family_named(adapter.family)
    if family.end_to_end is not None:
        raise NWInstallError(
            f"end-to-end control: cannot run on {family.label}: {family.end_to_end}; use the per-layer "
            "control (untrained_control=True)"
        )


def build_untrained_draw(pipe: Any, *, seed: int = 0) -> UntrainedDraw:
    """The untrained adapter of ``pipe`` (keys: :func:`build_untrained_adapter`; values built here).

    Args:
        pipe: A UNet or Flux pipeline with ``load_ip_adapter`` done.
        seed: The draw's seed (projection and keys: ``seed``; values: ``seed + VALUE_SEED_OFFSET``).

    Returns:
        The :class:`UntrainedDraw`, on the denoiser's device and dtype, eval mode, no gradients.

    Raises:
        NWInstallError: no adapter loaded, an unsupported processor, or SD 3.5.
    """
    denoiser = _denoiser(pipe)
    try:
        adapter = build_untrained_adapter(denoiser, seed=seed)
    except NWInstallError:
        raise
    except ValueError as error:
        raise NWInstallError(f"end-to-end control: {error}") from error
    _check_family(adapter)
    weight = next(projection_module(denoiser).parameters())
    values: dict[str, list[nn.Linear]] = {}
    copied: dict[str, list[bool]] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + VALUE_SEED_OFFSET)
        for layer in adapter.key_projections:
            attn, processor = _attention(denoiser, layer), denoiser.attn_processors[layer]
            built = [_value_projection(linear, getattr(attn, "to_v", None)) for linear in processor.to_v_ip]
            values[layer] = [
                lin.to(weight.device, weight.dtype).eval().requires_grad_(False) for lin, _ in built
            ]
            copied[layer] = [same for _, same in built]
    return UntrainedDraw(adapter, values, copied)


def _split_heads(x: Tensor, heads: int) -> Tensor:
    """``[B, ..., H*d]`` -> ``[B, H, M, d]`` (middle axes flattened into M, as diffusers' view does)."""
    return x.reshape(x.shape[0], -1, heads, x.shape[-1] // heads).transpose(1, 2)


def _head_ms(x: Tensor, rows: slice) -> Tensor:
    """Mean squared norm per head over ``rows`` and keys: ``mean_{b, i} ||x_bhi||^2`` ``[H]`` (float64)."""
    return x[rows].double().pow(2).sum(-1).mean(dim=(0, 2))


@torch.no_grad()
def _branch_ms(
    denoiser: nn.Module, draw: UntrainedDraw | None, image_embeds: Any, blocks: Mapping[str, slice]
) -> dict[tuple[str, int, str], tuple[Tensor, Tensor]]:
    """Per (layer, adapter, block): the keys' and values' mean squared norms per head ``[H]``.

    ``draw`` None: the pipeline's (trained) modules; else the draw's untrained ones.
    """
    projection = projection_module(denoiser) if draw is None else draw.adapter.image_projection
    weight = next(projection.parameters())
    embeds = [image_embeds.unsqueeze(1)] if isinstance(image_embeds, Tensor) else list(image_embeds)
    states = projection([e.to(weight.device, weight.dtype) for e in embeds])
    out = {}
    for layer, processor in denoiser.attn_processors.items():
        if getattr(processor, "to_k_ip", None) is None:
            continue
        heads = int(_attention(denoiser, layer).heads)
        for j, x in enumerate(states):
            if draw is None:
                key_proj, value_proj = processor.to_k_ip[j], processor.to_v_ip[j]
            else:
                key_proj, value_proj = (
                    draw.adapter.key_projections[layer][j],
                    draw.value_projections[layer][j],
                )
            k, v = _split_heads(key_proj(x), heads), _split_heads(value_proj(x), heads)
            for name, rows in blocks.items():
                out[layer, j, name] = (_head_ms(k, rows), _head_ms(v, rows))
    return out


def _blocks(batch: int, cfg: bool, family: str) -> dict[str, slice]:
    """The CFG halves of the captured embeddings' rows, labelled as the records label them."""
    if family_named(family).cfg == PASSES:  # the batch is never [uncond; cond]: the captured pass
        return {"cond": slice(None)}  # is the positive one
    if cfg and batch % 2 == 0:
        return {"uncond": slice(0, batch // 2), "cond": slice(batch // 2, None)}
    return {"all": slice(None)}


def _ratio(trained_ms: Tensor, untrained_ms: Tensor) -> Tensor:
    """sqrt(trained / untrained) per head, 1 where the untrained RMS is 0 (nothing to match)."""
    ratio = (trained_ms / untrained_ms).sqrt()
    return torch.where(untrained_ms > 0, ratio, torch.ones_like(ratio))


def head_scales(
    pipe: Any, draw: UntrainedDraw, image_embeds: Any, *, cfg: bool
) -> tuple[dict[str, list[Tensor]], dict[str, list[Tensor]], dict[tuple[str, int, str], Tensor]]:
    """The scale-matching row scales of one draw and the per-half key scale ratios.

    For layer l, adapter j and head h (RMS over the matching rows: the conditional half under
    CFG, else all rows, and every key of the adapter):
    ``key_scale[l][j][h] = key_rms_h(trained) / key_rms_h(untrained)``, and the same for values.

    Args:
        pipe: The pipeline (its trained modules are read, nothing changed).
        draw: The untrained draw.
        image_embeds: The raw image embeddings the denoiser's image projection receives (one tensor
            per adapter, ``[B, images, embed_dim]`` or with a token axis).
        cfg: Whether the batch is ``[uncond; cond]``.

    Returns:
        ``(key_scales, value_scales, key_scale_by_half)``: per layer a list over adapters of
        ``[H]`` float64 tensors, and per ``(layer, adapter, half)`` the unmatched key scale ratio
        ``[H]`` (the records' ``key_scale_{k}``).
    """
    denoiser = _denoiser(pipe)
    first = image_embeds if isinstance(image_embeds, Tensor) else image_embeds[0]
    blocks = _blocks(int(first.shape[0]), cfg, draw.adapter.family)
    trained = _branch_ms(denoiser, None, image_embeds, blocks)
    untrained = _branch_ms(denoiser, draw, image_embeds, blocks)
    match = "cond" if "cond" in blocks else "all"
    key_scales: dict[str, list[Tensor]] = {}
    value_scales: dict[str, list[Tensor]] = {}
    for layer, projections in draw.adapter.key_projections.items():
        key_scales[layer] = [_ratio(trained[layer, j, match][0], untrained[layer, j, match][0])
                             for j in range(len(projections))]  # fmt: skip
        value_scales[layer] = [_ratio(trained[layer, j, match][1], untrained[layer, j, match][1])
                               for j in range(len(projections))]  # fmt: skip
    by_half = {
        (layer, j, half): (trained[layer, j, half][0] / untrained[layer, j, half][0]).sqrt()
        for (layer, j, half) in trained
    }
    return key_scales, value_scales, by_half


def _scaled(linear: nn.Linear, scales: Tensor | None, heads: int) -> nn.Linear:
    """``linear`` with the output rows of head h (weight and bias) multiplied by ``scales[h]``."""
    if scales is None:
        return linear
    scaled = copy.deepcopy(linear)
    factor = scales.to(torch.float64).repeat_interleave(linear.out_features // heads)
    with torch.no_grad():
        scaled.weight.copy_((scaled.weight.double() * factor[:, None]).to(scaled.weight.dtype))
        if scaled.bias is not None:
            scaled.bias.copy_((scaled.bias.double() * factor).to(scaled.bias.dtype))
    return scaled


@contextlib.contextmanager
def untrained_adapter_swapped(
    pipe: Any,
    seed: int = 0,
    *,
    key_scales: Mapping[str, list[Tensor]] | None = None,
    value_scales: Mapping[str, list[Tensor]] | None = None,
    draw: UntrainedDraw | None = None,
) -> Iterator[UntrainedDraw]:
    """Inside, every IP layer of ``pipe``'s denoiser runs the untrained adapter (draw ``seed``).

    Swapped in: the denoiser's ``encoder_hid_proj`` (the fresh image projection) and, per IP
    layer and adapter, ``to_k_ip[j]`` / ``to_v_ip[j]`` (the copied or default-initialised
    projections, their head rows multiplied by ``key_scales[layer][j]`` /
    ``value_scales[layer][j]`` when given). The pipeline's own module objects are put back on
    exit, also after an exception: their parameters are never written, so ``state_dict`` bytes,
    ``attn_processors`` and ``set_ip_adapter_scale`` are as before.

    Args:
        pipe: A UNet or Flux pipeline with ``load_ip_adapter`` done and no NW processors installed.
        seed: The draw's seed (ignored when ``draw`` is given).
        key_scales: Per IP layer, per adapter, ``[H]`` row scales of ``to_k_ip``, or None.
        value_scales: The same for ``to_v_ip``, or None.
        draw: A prebuilt :class:`UntrainedDraw`.

    Yields:
        The :class:`UntrainedDraw` swapped in.

    Raises:
        NWInstallError: NW processors installed (swap first, then install), no adapter, or SD 3.5.

    Example:
        >>> with untrained_adapter_swapped(pipe, seed=0):  # doctest: +SKIP
        ...     control_image = pipe("a cat", ip_adapter_image=ref, generator=g).images[0]
    """
    if active_recorder(pipe) is not None:
        raise NWInstallError(
            "untrained_adapter_swapped: NW processors are installed; swap the adapter first, then "
            "install them (end_to_end_control does both)"
        )
    draw = build_untrained_draw(pipe, seed=seed) if draw is None else draw
    denoiser = _denoiser(pipe)
    original_projection = denoiser.encoder_hid_proj
    saved: list[tuple[nn.ModuleList, int, nn.Module]] = []
    try:
        denoiser.encoder_hid_proj = draw.adapter.image_projection
        for layer, keys in draw.adapter.key_projections.items():
            processor = denoiser.attn_processors[layer]
            heads = draw.adapter.heads[layer]
            for j in range(len(keys)):
                k_scale = None if key_scales is None else key_scales[layer][j]
                v_scale = None if value_scales is None else value_scales[layer][j]
                for modules, fresh in (
                    (processor.to_k_ip, _scaled(keys[j], k_scale, heads)),
                    (processor.to_v_ip, _scaled(draw.value_projections[layer][j], v_scale, heads)),
                ):
                    saved.append((modules, j, modules[j]))
                    modules[j] = fresh
        yield draw
    finally:
        for modules, j, module in reversed(saved):
            modules[j] = module
        denoiser.encoder_hid_proj = original_projection


# ---------------------------------------------------------------------- the runs


@dataclass
class EndToEndResult:
    """The trained call's records with the end-to-end control merged in.

    Attributes:
        records: One dict per trained record (every key set), plus ``{X}_control_{k}`` for X in
            ``CONTROL_OF`` the records have and ``key_scale_{k}``, for k = 0..K-1.
        control: The ``control`` meta: ``{"kind": "end-to-end", "draws", "seeds", "matched", ...}``.
        trained_output: The trained call's pipeline output.
        control_outputs: The K control calls' outputs.
        unmatched: Per draw, trained records without a control record (a skipped side computation).
        recorder: The trained call's :class:`~nw_adapter.integration.recorder.NWRecorder` (its
            skipped pairs and failed steps; its own records lack the control columns).
    """

    records: list[dict[str, Any]]
    control: dict[str, Any]
    trained_output: Any
    control_outputs: list[Any]
    unmatched: list[int] = dataclasses.field(default_factory=list)
    recorder: Any = None


def _config(recorder_config: NWProcessorConfig | Mapping[str, Any] | None) -> NWProcessorConfig:
    if recorder_config is None:
        return NWProcessorConfig(mode="observe")
    if isinstance(recorder_config, NWProcessorConfig):
        config = recorder_config
    else:
        config = NWProcessorConfig(**dict(recorder_config))
    if config.mode != "observe":
        raise NWConfigError(
            f"end_to_end_control: recorder_config.mode must be 'observe', got {config.mode!r}; the "
            "control compares the recorded statistics of two generations"
        )
    if config.untrained_control:
        raise NWConfigError(
            "end_to_end_control: recorder_config.untrained_control must be False (the per-layer and the "
            "end-to-end control write the same control columns); record them in separate runs"
        )
    return config


class RandomStateReplay:
    """The global and the call's generators' random states before the trained call, to replay it."""

    def __init__(self, call_kwargs: Mapping[str, Any]) -> None:
        generator = call_kwargs.get("generator")
        self.generators = [g for g in (generator if isinstance(generator, list) else [generator])
                           if isinstance(g, torch.Generator)]  # fmt: skip
        self.states = self._capture()

    def _capture(self) -> tuple[Any, ...]:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return torch.get_rng_state(), cuda, [g.get_state() for g in self.generators]

    def _restore(self, states: tuple[Any, ...]) -> None:
        cpu, cuda, generators = states
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        for g, state in zip(self.generators, generators, strict=True):
            g.set_state(state)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Inside: the states before the trained call; after: the states the trained call left."""
        after = self._capture()
        self._restore(self.states)
        try:
            yield
        finally:
            self._restore(after)


def fresh_call_kwargs(call_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments, tensors (latents, embeddings) cloned so no call can change another's."""
    return {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in call_kwargs.items()}


@contextlib.contextmanager
def _capture_embeds(denoiser: nn.Module) -> Iterator[list[Any]]:
    """Keeps the first image embeddings entering the denoiser's image projection."""
    seen: list[Any] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not seen:
            embeds = args[0] if args else kwargs.get("image_embeds")
            seen.append([e.detach() for e in embeds] if isinstance(embeds, list | tuple) else embeds.detach())

    handle = projection_module(denoiser).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def record_key(record: Mapping[str, Any]) -> tuple:
    """The fields (:data:`MATCH_KEYS`) by which a record of one pass is matched with another's."""
    return tuple(record.get(k, "ip" if k == "key_set" else None) for k in MATCH_KEYS)


def observed_call(
    pipe: Any, config: NWProcessorConfig, call_kwargs: Mapping[str, Any]
) -> tuple[Any, list[dict], Any]:
    """``pipe(**call_kwargs)`` (tensors cloned) with NW processors of ``config`` installed for the
    call: ``(output, records of every key set, the recorder)``."""
    with nw_processor(pipe, config) as recorder:
        output = pipe(**fresh_call_kwargs(call_kwargs))
    return output, recorder.to_records(key_set=None), recorder


def _layer_name(record_layer: str, layers: set[str]) -> str | None:
    for candidate in (record_layer, record_layer + _SUFFIX):
        if candidate in layers:
            return candidate
    return None


def _merge(
    records: list[dict[str, Any]],
    control: list[dict[str, Any]],
    draw: int,
    key_scale: Mapping[tuple[str, int, str], Tensor],
) -> int:
    """Adds draw ``draw``'s columns to ``records`` in place; returns the records left without a match."""
    by_key = {record_key(r): r for r in control}
    layers = {layer for layer, _, _ in key_scale}
    missing = 0
    for record in records:
        match = by_key.get(record_key(record))
        missing += match is None
        for stat in CONTROL_OF:
            if stat in record:
                record[control_column(stat, draw)] = math.nan if match is None else match.get(stat, math.nan)
        if H_EFF_REASON_FIELD in record:  # why the control pass's h_eff is NaN (as the per-layer control)
            reason = None if match is None else match.get(H_EFF_REASON_FIELD)
            record[f"{control_column('h_eff', draw)}_reason"] = reason
        layer = _layer_name(str(record["layer"]), layers)
        ratio = key_scale.get((layer, int(record["adapter"]), record["half"])) if layer else None
        head = int(record["head"])
        record[key_scale_column(draw)] = (
            float(ratio[head]) if ratio is not None and head < ratio.numel() else math.nan
        )
    return missing


def _cfg(pipe: Any) -> bool:
    try:
        return bool(getattr(pipe, "do_classifier_free_guidance", False))
    except (AttributeError, TypeError):
        return False


def end_to_end_control(
    pipe: Any,
    call_kwargs: Mapping[str, Any],
    *,
    draws: int = 1,
    seed: int = 0,
    scale_match: bool = True,
    recorder_config: NWProcessorConfig | Mapping[str, Any] | None = None,
) -> EndToEndResult:
    """Run ``pipe(**call_kwargs)`` observed, then K control generations of the same call, observed.

    Control call k swaps the untrained adapter of seed ``seed + k`` into every layer
    (:func:`untrained_adapter_swapped`; with ``scale_match`` its key and value rows rescaled per
    layer and head to the trained RMS norms, :func:`head_scales`) and replays the random state
    the trained call started from: the global torch generators and every ``torch.Generator`` in
    ``call_kwargs["generator"]``, so the prompt, latents, noise, scheduler, steps and IP scale are
    the trained call's. Afterwards the random states are those the trained call left (as after
    one plain call), the adapter and processors as before.

    Each trained record (``call``, ``step``, ``layer``, ``head``, ``half``, ``adapter``,
    ``image``, ``key_set``) gets, per draw k, ``{X}_control_{k}`` = the control pass's X for every
    X in ``CONTROL_OF`` the records have, and ``key_scale_{k}`` = key_rms(trained) /
    key_rms(draw k, unmatched) of its (layer, head, half, adapter) on the call's embeddings.

    Args:
        pipe: A UNet or Flux IP-Adapter pipeline without NW processors installed.
        call_kwargs: The call's keyword arguments (``prompt``, ``ip_adapter_image``,
            ``generator``, ...); pass ``generator`` (or ``latents``) for a reproducible call.
        draws: K, the number of control draws (>= 1).
        seed: Seed of draw 0 (draw k: ``seed + k``).
        scale_match: Rescale the untrained keys and values to the trained RMS norms.
        recorder_config: The observe configuration (``NWProcessorConfig`` or its fields), the
            same for every pass; its per-layer control must be off.

    Returns:
        The :class:`EndToEndResult`.

    Raises:
        NWConfigError: bad ``draws`` / ``seed`` / ``recorder_config`` (not observe, or with the
            per-layer control on).
        NWInstallError: no adapter, NW processors already installed, SD 3.5, or a call that
            passes no image embeddings through the image projection.
    """
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise NWConfigError(f"end_to_end_control: draws must be an int >= 1, got {draws!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise NWConfigError(f"end_to_end_control: seed must be an int >= 0, got {seed!r}")
    config = _config(recorder_config)
    denoiser = _denoiser(pipe)
    if active_recorder(pipe) is not None:
        raise NWInstallError("end_to_end_control: remove the installed NW processors first")
    built = [build_untrained_draw(pipe, seed=seed + k) for k in range(draws)]  # fails before generating
    random_state = RandomStateReplay(call_kwargs)
    with _capture_embeds(denoiser) as seen:
        trained_output, records, recorder = observed_call(pipe, config, call_kwargs)
    if not seen:
        raise NWInstallError(
            "end_to_end_control: no image embeddings entered the image projection; pass ip_adapter_image "
            "or ip_adapter_image_embeds in call_kwargs"
        )
    cfg = _cfg(pipe)
    outputs, unmatched = [], []
    for k, draw in enumerate(built):
        key_scales, value_scales, by_half = head_scales(pipe, draw, seen[0], cfg=cfg)
        with (
            untrained_adapter_swapped(
                pipe,
                draw=draw,
                key_scales=key_scales if scale_match else None,
                value_scales=value_scales if scale_match else None,
            ),
            random_state.replay(),
        ):
            output, control_records, _ = observed_call(pipe, config, call_kwargs)
        outputs.append(output)
        unmatched.append(_merge(records, control_records, k, by_half))
    meta = {
        "kind": "end-to-end",
        "draws": draws,
        "seeds": [seed + k for k in range(draws)],
        "matched": MATCHED if scale_match else None,
        "values_copied": all(all(v) for v in built[0].value_copied.values()),
        "keys_copied": all(all(v) for v in built[0].adapter.copied.values()),
    }
    return EndToEndResult(records, meta, trained_output, outputs, unmatched, recorder)
