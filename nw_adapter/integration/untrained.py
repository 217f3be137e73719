"""The untrained-adapter control (THEORY.md section 4): the same queries against an untrained adapter's keys.

An IP-Adapter starts training from: ``to_k_ip`` / ``to_v_ip`` copied from the layer's text
``to_k`` / ``to_v`` where the shapes match (PyTorch's default initialisation otherwise) and a
freshly initialised image projection (PyTorch's default; its LayerNorm at identity). Every reading
minus its value under this initialisation is what adapter training did; readings that are equal
under both (e.g. a per-key bias that comes from the architecture) are not evidence of learning.

:func:`build_untrained_adapter` builds that initialisation once, seeded, from a pipeline with a
loaded IP-Adapter, as new modules (deep copies re-initialised, or new ``nn.Linear``) on the
pipeline's device and dtype; the pipeline's own modules are never touched. Only the key
projections are built (the attention weights need queries and keys, not values).
:func:`untrained_keys` computes one layer's keys ``[B, H, M, d]`` from the image embeddings,
exactly as the trained branch computes its own; :func:`project_images` (once per denoiser
forward) and :func:`keys_from_states` (once per layer) are its two halves.

Supported denoisers:

- UNet2DConditionModel (SD 1.5, SDXL; base and Plus adapters) and FluxTransformer2DModel: both
  project image embeddings with ``encoder_hid_proj`` (``MultiIPAdapterImageProjection``) and hold
  ``to_k_ip`` as a ``ModuleList`` per layer; ``K = split_heads(W_k^0 P^0(e))``.
- SD3Transformer2DModel with the SD 3.5 (InstantX) adapter. Its trained branch forms the image
  keys as (diffusers' ``SD3IPAdapterJointAttnProcessor2_0`` and ``IPAdapterTimeImageProjection``)

      (x, tau) = image_proj(e, t)                    resampler conditioned on the timestep t;
                                                     tau its timestep embedding
      K        = RMSNorm_g(split_heads(W_k norm_ip(x, tau)))   norm_ip: AdaLayerNorm driven by tau

  The recipe used here for the control: ``image_proj`` and every layer's ``norm_ip`` freshly
  initialised with PyTorch's defaults (seeded; the resampler's query tokens as diffusers draws
  them, ``randn / sqrt(width)``); ``to_k_ip`` copied from the layer's text (context) key
  projection ``attn.add_k_proj`` where the shapes match, default-initialised otherwise; the key
  RMSNorm kept as the architecture has it, with its gain g copied from the layer's text key norm
  ``attn.norm_added_k`` where that is an RMSNorm of the same shape (the same rule as ``W_k``),
  else the RMSNorm's default g = 1. *Assumptions* (the InstantX training code is not public):
  that training starts ``to_k_ip`` from the context branch's key projection, as the UNet recipe
  starts it from the text ``to_k``, and the key norm's gain from the context key norm. The
  timestep enters the control through the untrained ``image_proj``'s own timestep embedding.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from nw_adapter.integration.families import FAMILIES as ALL_FAMILIES
from nw_adapter.integration.families import PER_ADAPTER, TIMESTEP_RESAMPLER, Family, family_of_denoiser

__all__ = [
    "ProjectedImages",
    "UntrainedAdapter",
    "build_untrained_adapter",
    "keys_from_states",
    "project_images",
    "projection_module",
    "untrained_keys",
]

_PROCESSOR_SUFFIX = ".processor"

FAMILIES = tuple(family.name for family in ALL_FAMILIES)
"""Denoiser families of the control: every row of :data:`nw_adapter.integration.families.FAMILIES`
(UNet: SD 1.5 / SDXL, SD 3.5, Flux); the recipe follows the row's ``adapter_layout``."""


@dataclass(frozen=True)
class UntrainedAdapter:
    """The untrained initialisation of a pipeline's loaded IP-Adapter(s).

    Attributes:
        image_projection: Fresh copy of the denoiser's ``encoder_hid_proj`` (one projection per
            loaded adapter; SD3: its ``image_proj``), re-initialised with PyTorch's defaults.
        key_projections: Per IP layer (processor name), one ``nn.Linear`` per loaded adapter: the
            layer's text key projection's weights where the shapes match (``to_k``; SD3:
            ``add_k_proj``), else a default-initialised Linear.
        copied: Per IP layer, per adapter: True where the key projection was copied.
        heads: Per IP layer, the attention's number of heads.
        seed: The seed of the re-initialisation.
        family: ``"unet"``, ``"flux"`` or ``"sd3"`` (:data:`FAMILIES`).
        layout: The family's adapter layout
            (:attr:`~nw_adapter.integration.families.Family.adapter_layout`): SD 3.5's
            :data:`~nw_adapter.integration.families.TIMESTEP_RESAMPLER` has the norms below.
        input_norms: SD3 only, per IP layer: the fresh ``norm_ip`` (AdaLayerNorm on the image tokens).
        key_norms: SD3 only, per IP layer: the key RMSNorm (gain from ``attn.norm_added_k`` or 1).
        key_norm_copied: SD3 only, per IP layer: True where the key norm's gain was copied.
    """

    image_projection: nn.Module
    key_projections: dict[str, list[nn.Linear]]
    copied: dict[str, list[bool]]
    heads: dict[str, int]
    seed: int
    family: str = "unet"
    input_norms: dict[str, nn.Module] = field(default_factory=dict)
    key_norms: dict[str, nn.Module] = field(default_factory=dict)
    key_norm_copied: dict[str, bool] = field(default_factory=dict)
    layout: str = PER_ADAPTER


@dataclass(frozen=True)
class ProjectedImages:
    """The untrained image projection's output for one denoiser forward.

    Attributes:
        states: One tensor per loaded adapter, the projected image tokens (``[B, images, tokens,
            D]`` for UNet / Flux as ``MultiIPAdapterImageProjection`` returns them; SD3 ``[B, M, D]``).
        temb: SD3 only: the projection's timestep embedding ``[B, D_t]`` that drives ``norm_ip``.
    """

    states: list[Tensor]
    temb: Tensor | None = None


def _denoiser(pipe) -> nn.Module:
    for name in ("unet", "transformer"):
        module = getattr(pipe, name, None)
        if isinstance(module, nn.Module):
            return module
    if isinstance(pipe, nn.Module) and hasattr(pipe, "attn_processors"):
        return pipe
    raise ValueError(f"{type(pipe).__name__} has no unet or transformer; pass a diffusers pipeline")


def _family(denoiser: nn.Module) -> Family:
    """The denoiser's family (:func:`~nw_adapter.integration.families.family_of_denoiser`).

    Raises:
        ValueError: a denoiser of no known family.
    """
    family = family_of_denoiser(denoiser)
    if family is None:
        known = ", ".join(f.label for f in ALL_FAMILIES)
        raise ValueError(
            f"{type(denoiser).__name__} is no denoiser of a known family ({known}); the untrained "
            "control supports UNet, Flux and SD 3.5 IP-Adapter pipelines"
        )
    return family


def _is_sd3(denoiser: nn.Module) -> bool:
    """Whether the denoiser's adapter is SD 3.5's timestep-conditioned resampler layout."""
    return _family(denoiser).adapter_layout == TIMESTEP_RESAMPLER


def projection_module(denoiser: nn.Module) -> nn.Module:
    """The module that receives the raw image embeddings: ``encoder_hid_proj`` (UNet, Flux) or
    ``image_proj`` (SD3, called as ``image_proj(embeds, timestep)``).

    Raises:
        ValueError: no IP-Adapter loaded.
    """
    if _is_sd3(denoiser):
        return denoiser.image_proj
    projection = getattr(denoiser, "encoder_hid_proj", None)
    if projection is None or not hasattr(projection, "image_projection_layers"):
        raise ValueError("the pipeline has no IP-Adapter loaded; call pipe.load_ip_adapter(...) first")
    return projection


def _reset_(module: nn.Module) -> None:
    """Re-initialise every parameter of ``module`` in place with PyTorch's (or diffusers') default.

    Submodules with ``reset_parameters`` (Linear, LayerNorm, ...) reset their own parameters; the
    learned query tokens of the resamplers (``latents``: the Plus adapter's, SD3's) are redrawn as
    diffusers initialises them, ``randn / sqrt(width)``. Any other parameter is an error.
    """
    reset: set[int] = set()
    for sub in module.modules():
        if callable(getattr(sub, "reset_parameters", None)):
            sub.reset_parameters()
            reset.update(id(p) for p in sub.parameters(recurse=False))
    for name, parameter in module.named_parameters():
        if id(parameter) in reset:
            continue
        if name.split(".")[-1] == "latents":
            with torch.no_grad():
                parameter.copy_(torch.randn_like(parameter) / parameter.shape[-1] ** 0.5)
            continue
        raise ValueError(f"cannot re-initialise parameter {name!r} of the image projection; no default known")


def _ip_layers(denoiser: nn.Module, sd3: bool) -> dict[str, tuple[nn.Module, nn.Module]]:
    """``{processor name: (attention module, processor)}`` for the layers with an IP branch."""
    layers = {}
    for name, processor in denoiser.attn_processors.items():
        to_k_ip = getattr(processor, "to_k_ip", None)
        if to_k_ip is None:
            continue
        expected = nn.Linear if sd3 else nn.ModuleList
        if not isinstance(to_k_ip, expected):
            raise ValueError(
                f"{name}: {type(processor).__name__} is not supported by the untrained control "
                f"(to_k_ip is a {type(to_k_ip).__name__}, expected {expected.__name__}); "
                "use a UNet, Flux or SD 3.5 IP-Adapter pipeline"
            )
        layers[name] = (denoiser.get_submodule(name.removesuffix(_PROCESSOR_SUFFIX)), processor)
    if not layers:
        raise ValueError("the pipeline has no IP-Adapter layers; call pipe.load_ip_adapter(...) first")
    return layers


def _untrained_key_projection(trained: nn.Linear, text_key: nn.Linear | None) -> tuple[nn.Linear, bool]:
    """A CPU float32 ``nn.Linear`` shaped like ``trained``: ``text_key``'s weights if the shapes match."""
    fresh = nn.Linear(trained.in_features, trained.out_features, bias=trained.bias is not None)
    same = text_key is not None and text_key.weight.shape == trained.weight.shape
    if same:
        with torch.no_grad():
            fresh.weight.copy_(text_key.weight)
            if fresh.bias is not None:
                if text_key.bias is None:
                    fresh.bias.zero_()
                else:
                    fresh.bias.copy_(text_key.bias)
    return fresh, same


def _untrained_key_norm(trained: nn.Module, text_norm: nn.Module | None) -> tuple[nn.Module, bool]:
    """SD3's key RMSNorm (a CPU float32 copy of ``trained``'s architecture) with its gain from
    ``text_norm`` where that is a norm of the same class and gain shape, else the default g = 1."""
    fresh = copy.deepcopy(trained).to("cpu", torch.float32)
    weight = getattr(fresh, "weight", None)
    text_weight = getattr(text_norm, "weight", None)
    same = (
        weight is not None
        and isinstance(text_norm, type(trained))
        and text_weight is not None
        and text_weight.shape == weight.shape
    )
    if weight is not None:
        with torch.no_grad():
            if same:
                weight.copy_(text_weight)
            else:
                weight.fill_(1.0)
    bias = getattr(fresh, "bias", None)
    if isinstance(bias, nn.Parameter):
        with torch.no_grad():
            bias.zero_()
    return fresh, same


def _frozen(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    return module.to(device, dtype).eval().requires_grad_(False)


def build_untrained_adapter(pipe, *, seed: int = 0) -> UntrainedAdapter:
    """Build the IP-Adapter training recipe's initialisation for ``pipe``'s loaded adapter(s).

    Built on the CPU in float32 under a forked, seeded random state (the global RNG is left as it
    was; the same seed gives the same modules on any device), then moved to the denoiser's device
    and dtype. The image projection is re-initialised first, then the IP layers in
    ``attn_processors`` order (per layer: the key projection of each adapter; SD3: then
    ``norm_ip``). The recipe per family is the module docstring's.

    Args:
        pipe: A diffusers pipeline (UNet, Flux or SD 3.5 family; or its denoiser) with
            ``load_ip_adapter`` done.
        seed: Seed of the default initialisations.

    Returns:
        The :class:`UntrainedAdapter` (modules in eval mode, gradients off).

    Raises:
        ValueError: no adapter loaded, an unsupported processor, or a bad seed.

    Example:
        >>> untrained = build_untrained_adapter(pipe, seed=0)  # doctest: +SKIP
        >>> k = untrained_keys(untrained, layer, image_embeds)  # [B, H, M, d]  # doctest: +SKIP
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    denoiser = _denoiser(pipe)
    trained_projection = projection_module(denoiser)
    sd3 = _is_sd3(denoiser)
    layers = _ip_layers(denoiser, sd3)
    parameter = next(trained_projection.parameters())
    device, dtype = parameter.device, parameter.dtype
    keys: dict[str, list[nn.Linear]] = {}
    copied: dict[str, list[bool]] = {}
    input_norms: dict[str, nn.Module] = {}
    key_norms: dict[str, nn.Module] = {}
    key_norm_copied: dict[str, bool] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        projection = copy.deepcopy(trained_projection).to("cpu", torch.float32)
        _reset_(projection)
        for name, (attn, processor) in layers.items():
            if sd3:
                built = [_untrained_key_projection(processor.to_k_ip, getattr(attn, "add_k_proj", None))]
                norm_ip = copy.deepcopy(processor.norm_ip).to("cpu", torch.float32)
                _reset_(norm_ip)
                input_norms[name] = _frozen(norm_ip, device, dtype)
                key_norm, key_norm_copied[name] = _untrained_key_norm(
                    processor.norm_ip_k, getattr(attn, "norm_added_k", None)
                )
                key_norms[name] = _frozen(key_norm, device, dtype)
            else:
                built = [_untrained_key_projection(linear, attn.to_k) for linear in processor.to_k_ip]
            keys[name] = [_frozen(linear, device, dtype) for linear, _ in built]
            copied[name] = [same for _, same in built]
    projection = _frozen(projection, device, dtype)
    heads = {name: int(attn.heads) for name, (attn, _) in layers.items()}
    family = _family(denoiser)
    return UntrainedAdapter(
        projection, keys, copied, heads, seed, family.name, input_norms, key_norms, key_norm_copied,
        layout=family.adapter_layout,
    )  # fmt: skip


@torch.no_grad()
def project_images(
    untrained: UntrainedAdapter, image_embeds: list[Tensor] | Tensor, *, timestep: Tensor | None = None
) -> ProjectedImages:
    """The untrained image projection ``P^0`` of the raw image embeddings (once per denoiser forward).

    Args:
        untrained: From :func:`build_untrained_adapter`.
        image_embeds: UNet / Flux: one tensor per loaded adapter, ``[B, num_images, embed_dim]``
            (or with a token axis for the Plus adapter's hidden states), as the denoiser receives
            them; or, with one adapter, a single tensor ``[B, embed_dim]`` (``[B, tokens,
            embed_dim]``), read as diffusers' ``MultiIPAdapterImageProjection`` reads it (one image:
            ``[e.unsqueeze(1)]``). SD3: the tensor ``[B, tokens, embed_dim]`` (or a list holding it).
        timestep: SD3 only: the denoiser's timestep ``[B]`` (its ``image_proj`` is conditioned on it).

    Returns:
        :class:`ProjectedImages` on the projection's device and dtype.

    Raises:
        ValueError: image embeddings of the wrong count, or SD3 without ``timestep``.
    """
    count = len(next(iter(untrained.key_projections.values())))
    weight = next(untrained.image_projection.parameters())
    if untrained.layout == TIMESTEP_RESAMPLER:
        embeds = (
            image_embeds[0]
            if isinstance(image_embeds, list | tuple) and len(image_embeds) == 1
            else image_embeds
        )
        if not isinstance(embeds, Tensor):
            raise ValueError("image_embeds must be the SD3 image embeddings tensor [B, tokens, dim]")
        if timestep is None:
            raise ValueError("SD3's image projection is conditioned on the timestep; pass timestep=")
        latents, temb = untrained.image_projection(
            embeds.to(weight.device, weight.dtype), timestep.to(weight.device)
        )
        return ProjectedImages([latents], temb)
    if isinstance(image_embeds, Tensor):  # as MultiIPAdapterImageProjection reads a tensor
        image_embeds = [image_embeds.unsqueeze(1)]
    if not isinstance(image_embeds, list | tuple) or len(image_embeds) != count:
        got = f"{len(image_embeds)} tensor(s)" if isinstance(image_embeds, list | tuple) else "a tensor"
        raise ValueError(
            f"image_embeds must be a list of {count} tensor(s), one per loaded adapter (or one tensor "
            f"[B, embed_dim] / [B, tokens, embed_dim] with one adapter), got {got}"
        )
    states = untrained.image_projection([e.to(weight.device, weight.dtype) for e in image_embeds])
    return ProjectedImages(list(states))


def _check_layer(untrained: UntrainedAdapter, layer: str, adapter: int) -> None:
    """ValueError unless ``layer`` has an IP branch and ``adapter`` indexes one of its key projections."""
    if layer not in untrained.key_projections:
        raise ValueError(
            f"layer {layer!r} has no IP branch; choose one of {sorted(untrained.key_projections)[:3]}..."
        )
    count = len(untrained.key_projections[layer])
    if isinstance(adapter, bool) or not isinstance(adapter, int) or not 0 <= adapter < count:
        raise ValueError(f"adapter must be an int in [0, {count}), got {adapter!r}")


@torch.no_grad()
def keys_from_states(
    untrained: UntrainedAdapter, layer: str, states: Tensor, *, adapter: int = 0, temb: Tensor | None = None
) -> Tensor:
    """One layer's untrained keys ``[B, H, M, d]`` from projected image tokens ``states``.

    UNet / Flux: ``K = split_heads(W_k^0 x)`` with ``x`` ``[B, ..., D]`` (any middle axes are
    flattened into the keys, images x tokens, as diffusers' ``view(batch, -1, heads, d)`` does).
    SD3: ``K = RMSNorm_g(split_heads(W_k^0 norm_ip^0(x, temb)))``.

    Args:
        untrained: From :func:`build_untrained_adapter`.
        layer: An IP layer's processor name (a key of ``untrained.key_projections``).
        states: The adapter's projected tokens (an entry of :attr:`ProjectedImages.states`, or a
            reshaped part of it).
        adapter: Which loaded adapter's key projection.
        temb: SD3 only: :attr:`ProjectedImages.temb`.

    Raises:
        ValueError: an unknown layer or a bad adapter index.
    """
    _check_layer(untrained, layer, adapter)
    projection = untrained.key_projections[layer][adapter]
    states = states.to(projection.weight.device, projection.weight.dtype)
    if untrained.layout == TIMESTEP_RESAMPLER:
        states = untrained.input_norms[layer](states, temb=temb)
    keys = projection(states)
    heads = untrained.heads[layer]
    keys = keys.reshape(keys.shape[0], -1, heads, keys.shape[-1] // heads).transpose(1, 2)
    if untrained.layout == TIMESTEP_RESAMPLER:
        keys = untrained.key_norms[layer](keys)
    return keys


@torch.no_grad()
def untrained_keys(
    untrained: UntrainedAdapter,
    layer: str,
    image_embeds: list[Tensor] | Tensor,
    *,
    adapter: int = 0,
    timestep: Tensor | None = None,
) -> Tensor:
    """The untrained keys of one IP layer, ``[B, H, M, d]``, from the image embeddings.

    ``K = split_heads(W_k^0 P^0(e))`` (UNet, Flux; SD3 with its norms, :func:`keys_from_states`):
    the untrained image projection ``P^0`` of the adapter's image embeddings (as passed to the
    denoiser, e.g. ``pipe.prepare_ip_adapter_image_embeds``'s output), then the layer's untrained
    key projection ``W_k^0``, split into the layer's H heads: ``M = num_images x tokens``,
    ``d = inner_dim / H``, the same shape as the trained branch's keys.

    Args:
        untrained: From :func:`build_untrained_adapter`.
        layer: An IP layer's processor name (a key of ``untrained.key_projections``).
        image_embeds: One tensor per loaded adapter, or one tensor with one adapter
            (:func:`project_images`).
        adapter: Which loaded adapter's keys.
        timestep: SD3 only: the denoiser's timestep.

    Returns:
        ``[B, H, M, d]`` on the projection's device and dtype.

    Raises:
        ValueError: an unknown layer, a bad adapter index, or image embeddings of the wrong count.
    """
    _check_layer(untrained, layer, adapter)
    projected = project_images(untrained, image_embeds, timestep=timestep)
    return keys_from_states(untrained, layer, projected.states[adapter], adapter=adapter, temb=projected.temb)
