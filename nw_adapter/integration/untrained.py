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
exactly as the trained branch computes its own.

Supported denoisers: UNet2DConditionModel (SD 1.5, SDXL; base and Plus adapters) and
FluxTransformer2DModel: both project image embeddings with ``encoder_hid_proj``
(``MultiIPAdapterImageProjection``) and hold ``to_k_ip`` as a ``ModuleList`` per layer. SD 3.5's
adapter (a timestep-conditioned projection and per-layer AdaLayerNorm / RMSNorm on the image
keys) is not supported yet: it raises a ValueError.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["UntrainedAdapter", "build_untrained_adapter", "untrained_keys"]

_PROCESSOR_SUFFIX = ".processor"


@dataclass(frozen=True)
class UntrainedAdapter:
    """The untrained initialisation of a pipeline's loaded IP-Adapter(s).

    Attributes:
        image_projection: Fresh copy of the denoiser's ``encoder_hid_proj`` (one projection per
            loaded adapter), re-initialised with PyTorch's defaults.
        key_projections: Per IP layer (processor name), one ``nn.Linear`` per loaded adapter: the
            layer's ``to_k`` weights where the shapes match, else a default-initialised Linear.
        copied: Per IP layer, per adapter: True where the key projection was copied from ``to_k``.
        heads: Per IP layer, the attention's number of heads.
        seed: The seed of the re-initialisation.
    """

    image_projection: nn.Module
    key_projections: dict[str, list[nn.Linear]]
    copied: dict[str, list[bool]]
    heads: dict[str, int]
    seed: int


def _denoiser(pipe) -> nn.Module:
    for name in ("unet", "transformer"):
        module = getattr(pipe, name, None)
        if isinstance(module, nn.Module):
            return module
    raise ValueError(f"{type(pipe).__name__} has no unet or transformer; pass a diffusers pipeline")


def _image_projection(denoiser: nn.Module) -> nn.Module:
    projection = getattr(denoiser, "encoder_hid_proj", None)
    if projection is None or not hasattr(projection, "image_projection_layers"):
        if getattr(denoiser, "image_proj", None) is not None:
            raise ValueError(
                f"{type(denoiser).__name__}'s IP-Adapter (timestep-conditioned image projection, "
                "normalised image keys) is not supported by the untrained control yet; "
                "use a UNet or Flux pipeline"
            )
        raise ValueError("the pipeline has no IP-Adapter loaded; call pipe.load_ip_adapter(...) first")
    return projection


def _reset_(module: nn.Module) -> None:
    """Re-initialise every parameter of ``module`` in place with PyTorch's (or diffusers') default.

    Submodules with ``reset_parameters`` (Linear, LayerNorm, ...) reset their own parameters; the
    learned query tokens of the Plus adapter's resampler (``latents``) are redrawn as diffusers
    initialises them, ``randn / sqrt(width)``. Any other parameter is an error.
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


def _ip_layers(denoiser: nn.Module) -> dict[str, tuple[nn.Module, nn.Module]]:
    """``{processor name: (attention module, processor)}`` for the layers with an IP branch."""
    layers = {}
    for name, processor in denoiser.attn_processors.items():
        to_k_ip = getattr(processor, "to_k_ip", None)
        if to_k_ip is None:
            continue
        if not isinstance(to_k_ip, nn.ModuleList):
            raise ValueError(
                f"{name}: {type(processor).__name__} is not supported by the untrained control yet "
                "(one to_k_ip per layer with normalised keys); use a UNet or Flux pipeline"
            )
        layers[name] = (denoiser.get_submodule(name.removesuffix(_PROCESSOR_SUFFIX)), processor)
    if not layers:
        raise ValueError("the pipeline has no IP-Adapter layers; call pipe.load_ip_adapter(...) first")
    return layers


def _untrained_key_projection(trained: nn.Linear, text_key: nn.Linear) -> tuple[nn.Linear, bool]:
    """A CPU float32 ``nn.Linear`` shaped like ``trained``: ``text_key``'s weights if the shapes match."""
    fresh = nn.Linear(trained.in_features, trained.out_features, bias=trained.bias is not None)
    same = text_key.weight.shape == trained.weight.shape
    if same:
        with torch.no_grad():
            fresh.weight.copy_(text_key.weight)
            if fresh.bias is not None:
                if text_key.bias is None:
                    fresh.bias.zero_()
                else:
                    fresh.bias.copy_(text_key.bias)
    return fresh, same


def build_untrained_adapter(pipe, *, seed: int = 0) -> UntrainedAdapter:
    """Build the IP-Adapter training recipe's initialisation for ``pipe``'s loaded adapter(s).

    Built on the CPU in float32 under a forked, seeded random state (the global RNG is left as it
    was; the same seed gives the same modules on any device), then moved to the denoiser's device
    and dtype. The image projection is re-initialised first, then the key projections of the IP
    layers in ``attn_processors`` order, adapter by adapter.

    Args:
        pipe: A diffusers pipeline (UNet or Flux family) with ``load_ip_adapter`` done.
        seed: Seed of the default initialisations.

    Returns:
        The :class:`UntrainedAdapter` (modules in eval mode, gradients off).

    Raises:
        ValueError: no adapter loaded, an unsupported family (SD 3.5), or a bad seed.

    Example:
        >>> untrained = build_untrained_adapter(pipe, seed=0)  # doctest: +SKIP
        >>> k = untrained_keys(untrained, layer, image_embeds)  # [B, H, M, d]  # doctest: +SKIP
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    denoiser = _denoiser(pipe)
    trained_projection = _image_projection(denoiser)
    layers = _ip_layers(denoiser)
    parameter = next(trained_projection.parameters())
    device, dtype = parameter.device, parameter.dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        projection = copy.deepcopy(trained_projection).to("cpu", torch.float32)
        _reset_(projection)
        keys: dict[str, list[nn.Linear]] = {}
        copied: dict[str, list[bool]] = {}
        for name, (attn, processor) in layers.items():
            built = [_untrained_key_projection(linear, attn.to_k) for linear in processor.to_k_ip]
            keys[name] = [linear.to(device, dtype).eval().requires_grad_(False) for linear, _ in built]
            copied[name] = [same for _, same in built]
    projection = projection.to(device, dtype).eval().requires_grad_(False)
    heads = {name: int(attn.heads) for name, (attn, _) in layers.items()}
    return UntrainedAdapter(projection, keys, copied, heads, seed)


@torch.no_grad()
def untrained_keys(
    untrained: UntrainedAdapter, layer: str, image_embeds: list[Tensor], *, adapter: int = 0
) -> Tensor:
    """The untrained keys of one IP layer, ``[B, H, M, d]``, from the image embeddings.

    ``K = split_heads(W_k^0 P^0(e))``: the untrained image projection ``P^0`` of the adapter's image
    embeddings (``[B, num_images, ...]``, as passed to the denoiser, e.g.
    ``pipe.prepare_ip_adapter_image_embeds``'s output), then the layer's untrained key projection
    ``W_k^0``, split into the layer's H heads: ``M = num_images x tokens``, ``d = inner_dim / H``, the
    same shape as the trained branch's keys.

    Args:
        untrained: From :func:`build_untrained_adapter`.
        layer: An IP layer's processor name (a key of ``untrained.key_projections``).
        image_embeds: One tensor per loaded adapter, ``[B, num_images, embed_dim]`` (or with a
            token axis for the Plus adapter's hidden states).
        adapter: Which loaded adapter's keys.

    Returns:
        ``[B, H, M, d]`` on the projection's device and dtype.

    Raises:
        ValueError: an unknown layer, a bad adapter index, or image embeddings of the wrong count.
    """
    if layer not in untrained.key_projections:
        raise ValueError(
            f"layer {layer!r} has no IP branch; choose one of {sorted(untrained.key_projections)[:3]}..."
        )
    count = len(untrained.key_projections[layer])
    if isinstance(adapter, bool) or not isinstance(adapter, int) or not 0 <= adapter < count:
        raise ValueError(f"adapter must be an int in [0, {count}), got {adapter!r}")
    if not isinstance(image_embeds, list | tuple) or len(image_embeds) != count:
        raise ValueError(f"image_embeds must be a list of {count} tensor(s), one per loaded adapter")
    weight = untrained.key_projections[layer][adapter].weight
    states = untrained.image_projection([e.to(weight.device, weight.dtype) for e in image_embeds])[adapter]
    keys = untrained.key_projections[layer][adapter](states)  # [B, num_images, tokens, inner]
    heads = untrained.heads[layer]
    return keys.reshape(keys.shape[0], -1, heads, keys.shape[-1] // heads).transpose(1, 2)
