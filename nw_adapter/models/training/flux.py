"""Rectified-flow training of the tiny Flux digits model: the transformer, then the adapter alone.

Both stages minimise Flux's rectified-flow (flow-matching) loss in diffusers' sigma convention,

    L = E_{z0, eps ~ N(0, I), s} || v_theta(z_s, s, c) - (eps - z0) ||^2,   z_s = (1 - s) z0 + s eps,

on the packed latents ``z0`` (``FluxPipeline._pack_latents`` of the VAE posterior mean times
``scaling_factor``: ``(N, 16, 16)``), with ``s = sigmoid(n), n ~ N(0, 1)`` (the logit-normal
timestep density of the SD3 paper, which XLabs' x-flux training scripts use); the transformer
receives ``timestep = s`` as ``FluxPipeline`` passes it, and ``FlowMatchEulerDiscreteScheduler``
integrates ``dz/ds = v`` at sampling time.

Stage 1 trains the transformer on captions that name the digit (15% dropped, each replaced by one
of the null prompts it is given: ``""`` alone, or the class-free prompts of stage 2 as the shipped
weights' run gives), through the frozen CLIP text encoder's pooled output and the frozen T5's
states. Stage 2 trains the adapter (image projection and every double block's ``to_k_ip`` /
``to_v_ip``; the shipped run also the transformer with it, at its own learning rate) on *support
sets*: each step draws a support size ``m`` from 1..4 and, for every target, ``m`` other training
images of its class; their embeddings go in as one adapter's ``(batch, m, 32)`` image embeds, the
list-per-adapter convention of diffusers, so the keys are ``m x 4`` image tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nw_adapter.models.training.common import (
    CAPTION_DROPOUT,
    adapter_parameters,
    draw_caption_batch,
    train_loop,
)

__all__ = [
    "CAPTION_DROPOUT",
    "IMAGE_DROPOUT",
    "MAX_SUPPORT",
    "FluxBatchInputs",
    "flow_matching_loss",
    "load_adapter_for_training",
    "shifted_images",
    "support_sets",
    "train_flux_adapter",
    "train_flux_transformer",
]

IMAGE_DROPOUT = 0.05
"""Stage 2: probability that a support set is replaced by the black image ``FluxPipeline`` feeds as
the negative image of true classifier-free guidance (IP-Adapter's image drop)."""

MAX_SUPPORT = 4
"""Stage 2 draws the support size ``m`` uniformly from ``1..MAX_SUPPORT`` at every step."""


@dataclass(frozen=True)
class FluxBatchInputs:
    """What the transformer needs besides the noisy latents, for a fixed image size.

    Attributes:
        img_ids: ``(16, 3)`` RoPE ids of the packed image tokens (``FluxPipeline``'s).
        txt_ids: ``(TEXT_TOKENS, 3)`` RoPE ids of the text tokens (zeros).
    """

    img_ids: torch.Tensor
    txt_ids: torch.Tensor


def flow_matching_loss(
    transformer,
    latents: torch.Tensor,
    text_states: torch.Tensor,
    pooled: torch.Tensor,
    ids: FluxBatchInputs,
    generator: torch.Generator,
    image_embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Monte-Carlo estimate of the rectified-flow loss (module docstring).

    Args:
        transformer: A ``FluxTransformer2DModel`` (with an adapter loaded if ``image_embeds``).
        latents: ``(B, 16, 16)`` packed clean latents ``z0``.
        text_states: ``(B, TEXT_TOKENS, 32)`` T5 states.
        pooled: ``(B, 32)`` pooled CLIP text embeddings.
        ids: RoPE ids.
        generator: Draws ``eps`` and ``s``.
        image_embeds: ``(B, m, 32)`` image embeddings of one adapter (``m`` references per row).

    Returns:
        The scalar loss ``mean || v - (eps - z0) ||^2``.
    """
    noise = torch.randn(latents.shape, generator=generator)
    sigmas = torch.sigmoid(torch.randn(len(latents), generator=generator))
    noisy = (1.0 - sigmas[:, None, None]) * latents + sigmas[:, None, None] * noise
    kwargs = (
        {}
        if image_embeds is None
        else {"joint_attention_kwargs": {"ip_adapter_image_embeds": [image_embeds]}}
    )
    prediction = transformer(
        hidden_states=noisy,
        timestep=sigmas,
        pooled_projections=pooled,
        encoder_hidden_states=text_states,
        txt_ids=ids.txt_ids,
        img_ids=ids.img_ids,
        **kwargs,
    ).sample
    return torch.nn.functional.mse_loss(prediction, noise - latents)


def train_flux_transformer(
    transformer,
    latents: torch.Tensor,
    labels: torch.Tensor,
    caption_states: torch.Tensor,
    caption_pooled: torch.Tensor,
    null_states: torch.Tensor,
    null_pooled: torch.Tensor,
    ids: FluxBatchInputs,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    progress: bool = True,
) -> list[float]:
    """Stage 1: train the transformer on captions that name the digit.

    Args:
        transformer: The (seeded, untrained) transformer; trained in place.
        latents: ``(N, 16, 16)`` packed latents of the training images.
        labels: ``(N,)`` digit classes.
        caption_states: ``(10, W, TEXT_TOKENS, 32)`` T5 states of ``W`` wordings per class.
        caption_pooled: ``(10, W, 32)`` pooled CLIP embeddings of the same captions.
        null_states: ``(P, TEXT_TOKENS, 32)`` and ``null_pooled``: ``(P, 32)``, of the ``P`` prompts
            a dropped caption is replaced by (``P = 1``: ``""`` only; ``P > 1``: one drawn uniformly
            per dropped caption, after the batch, so ``P = 1`` draws exactly what it always drew).
        ids: RoPE ids.
        steps, batch_size, lr: Optimiser steps, images per step, peak learning rate.
        seed: Seed of the batches, caption choices, drops, noise and timesteps.
        progress: Show a progress bar.

    Returns:
        The per-step losses.
    """
    generator = torch.Generator().manual_seed(seed)
    wordings = caption_states.shape[1]

    def loss_fn(step: int) -> torch.Tensor:
        rows, choice, dropped = draw_caption_batch(generator, len(labels), batch_size, wordings)
        states = caption_states[labels[rows], choice]
        pooled = caption_pooled[labels[rows], choice]
        null = (
            torch.zeros(batch_size, dtype=torch.long)
            if len(null_states) == 1
            else torch.randint(0, len(null_states), (batch_size,), generator=generator)
        )
        states = torch.where(dropped[:, None, None], null_states[null], states)
        pooled = torch.where(dropped[:, None], null_pooled[null], pooled)
        return flow_matching_loss(transformer, latents[rows], states, pooled, ids, generator)

    transformer.train()
    losses = train_loop(
        transformer.parameters(),
        loss_fn,
        steps=steps,
        lr=lr,
        description="transformer (stage 1)",
        progress=progress,
    )
    transformer.eval()
    return losses


def load_adapter_for_training(pipe, state_dict: dict[str, torch.Tensor]) -> list[torch.nn.Parameter]:
    """Load an XLabs-layout adapter into ``pipe.transformer`` through ``load_ip_adapter``.

    The state dict is converted exactly as ``load_ip_adapter`` converts the XLabs file (the
    ``ip_adapter_proj_model.`` / ``double_blocks.<i>.processor.`` prefixes become diffusers'
    ``image_proj`` / ``ip_adapter`` groups). Everything else is frozen.

    Returns:
        The adapter's parameters (image projection, every double block's ``to_k_ip`` / ``to_v_ip``),
        requiring gradients.
    """
    nested: dict[str, dict[str, torch.Tensor]] = {"image_proj": {}, "ip_adapter": {}}
    for key, value in state_dict.items():
        if key.startswith("ip_adapter_proj_model."):
            nested["image_proj"][key.removeprefix("ip_adapter_proj_model.")] = value.clone()
        else:
            name = key.removeprefix("double_blocks.").replace("processor.", "")
            name = name.replace("ip_adapter_double_stream_k_proj", "to_k_ip")
            nested["ip_adapter"][name.replace("ip_adapter_double_stream_v_proj", "to_v_ip")] = value.clone()
    pipe.load_ip_adapter(nested, weight_name="ip_adapter.safetensors", low_cpu_mem_usage=False)
    return adapter_parameters(pipe.transformer)


def shifted_images(images: np.ndarray, max_shift: int) -> np.ndarray:
    """Every translation of each image by ``-max_shift..max_shift`` pixels in x and y, the uncovered
    border filled with black (the digits' background).

    Args:
        images: ``(N, H, W, C)`` images.
        max_shift: Largest shift in pixels (``0 <= max_shift < min(H, W)``).

    Returns:
        ``(N, (2 max_shift + 1)^2, H, W, C)``: view ``v`` shifts by ``(dy, dx)`` in row-major order of
        ``dy, dx = -max_shift..max_shift``; the unshifted image is the middle view.
    """
    height, width = images.shape[1:3]
    if not 0 <= max_shift < min(height, width):
        raise ValueError(f"max_shift must be in [0, {min(height, width) - 1}], got {max_shift}")
    offsets = range(-max_shift, max_shift + 1)
    views = np.zeros((len(images), len(offsets) ** 2, *images.shape[1:]), dtype=images.dtype)
    for view, (dy, dx) in enumerate((dy, dx) for dy in offsets for dx in offsets):
        views[:, view, max(dy, 0) : height + min(dy, 0), max(dx, 0) : width + min(dx, 0)] = images[
            :, max(-dy, 0) : height + min(-dy, 0), max(-dx, 0) : width + min(-dx, 0)
        ]
    return views


def support_sets(
    targets: torch.Tensor, labels: torch.Tensor, size: int, generator: torch.Generator
) -> torch.Tensor:
    """``size`` distinct training images of each target's class, the target itself excluded.

    Args:
        targets: ``(B,)`` row numbers of the targets.
        labels: ``(N,)`` digit classes.
        size: The support size ``m``.
        generator: Draws the supports.

    Returns:
        ``(B, m)`` row numbers.
    """
    rows = []
    for target in targets.tolist():
        pool = torch.nonzero(labels == labels[target]).flatten()
        pool = pool[pool != target]
        rows.append(pool[torch.randperm(len(pool), generator=generator)[:size]])
    return torch.stack(rows)


def train_flux_adapter(
    transformer,
    parameters: list[torch.nn.Parameter],
    latents: torch.Tensor,
    image_embeds: torch.Tensor,
    negative_embed: torch.Tensor,
    labels: torch.Tensor,
    prompt_states: torch.Tensor,
    prompt_pooled: torch.Tensor,
    ids: FluxBatchInputs,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    progress: bool = True,
    image_dropout: float = IMAGE_DROPOUT,
    single_share: float | None = None,
    embed_noise: float = 0.0,
    transformer_lr: float = 0.0,
) -> tuple[list[float], list[int]]:
    """Stage 2: train the adapter (alone or with the transformer) on one class's (support set, target) pairs.

    Args:
        transformer: The stage-1 transformer with the adapter loaded (frozen unless ``transformer_lr``).
        parameters: The adapter's parameters (:func:`load_adapter_for_training`).
        latents: ``(N, 16, 16)`` packed latents of the training images (targets).
        image_embeds: ``(N, 32)`` frozen image-encoder embeddings of the same images (references),
            or ``(N, V, 32)``: ``V`` augmented views of each image, one drawn uniformly per reference.
        negative_embed: ``(32,)`` the embedding of the black image (the pipeline's negative image).
        labels: ``(N,)`` digit classes.
        prompt_states: ``(P, TEXT_TOKENS, 32)`` and ``prompt_pooled``: ``(P, 32)``, of the
            class-free prompts, drawn uniformly.
        ids: RoPE ids.
        steps, batch_size, lr: Optimiser steps, targets per step, peak learning rate.
        seed: Seed of the support sizes, supports, prompts, drops, noise and timesteps.
        progress: Show a progress bar.
        image_dropout: Probability that a support set is replaced by ``negative_embed``.
        single_share: ``None``: ``m ~ U{1..MAX_SUPPORT}``; otherwise ``m = 1`` with this
            probability and ``m ~ U{2..MAX_SUPPORT}`` else (one uniform draw per step, then the size).
        embed_noise: Standard deviation of Gaussian noise added to every reference embedding, as a
            multiple of the embeddings' per-dimension standard deviation over ``image_embeds``
            (0: none); a dropped support's black embedding gets none.
        transformer_lr: 0: the transformer stays frozen; otherwise every transformer parameter
            outside the adapter is trained too, as a second AdamW group with this peak learning rate
            (same schedule; gradients clipped over both groups): full weights, where h94's
            IP-Adapter-FaceID trains a LoRA of the base model with its adapter. Changed in place.

    Returns:
        ``(losses, sizes)``: the per-step loss and support size ``m``.
    """
    if embed_noise < 0:
        raise ValueError(f"embed_noise must be >= 0, got {embed_noise}")
    if transformer_lr < 0:
        raise ValueError(f"transformer_lr must be >= 0, got {transformer_lr}")
    trained: list[torch.nn.Parameter] | list[dict] = parameters
    if transformer_lr > 0:
        adapter = {id(parameter) for parameter in parameters}
        base = [parameter for parameter in transformer.parameters() if id(parameter) not in adapter]
        for parameter in base:
            parameter.requires_grad_(True)
        trained = [{"params": list(parameters)}, {"params": base, "lr": transformer_lr}]
    views = image_embeds if image_embeds.ndim == 3 else image_embeds[:, None]  # (N, V, 32)
    noise_std = embed_noise * views.flatten(0, 1).std(dim=0)  # (32,)
    generator = torch.Generator().manual_seed(seed)
    sizes: list[int] = []

    def references(rows: torch.Tensor) -> torch.Tensor:
        """``(B, m, 32)`` embeddings of the support rows: a drawn view each, noised if asked (the
        extra draws happen only for a non-default option, so a default run draws what it always drew)."""
        if views.shape[1] == 1:
            embeds = views[rows, 0]
        else:
            embeds = views[rows, torch.randint(0, views.shape[1], rows.shape, generator=generator)]
        if embed_noise > 0:
            embeds = embeds + noise_std * torch.randn(embeds.shape, generator=generator)
        return embeds

    def loss_fn(step: int) -> torch.Tensor:
        if single_share is None:
            size = int(torch.randint(1, MAX_SUPPORT + 1, (1,), generator=generator))
        elif float(torch.rand(1, generator=generator)) < single_share:
            size = 1
        else:
            size = int(torch.randint(2, MAX_SUPPORT + 1, (1,), generator=generator))
        sizes.append(size)
        targets = torch.randint(0, len(labels), (batch_size,), generator=generator)
        embeds = references(support_sets(targets, labels, size, generator))  # (B, m, 32)
        dropped = torch.rand(batch_size, generator=generator) < image_dropout
        embeds = torch.where(dropped[:, None, None], negative_embed.expand_as(embeds), embeds)
        prompt = torch.randint(0, len(prompt_states), (batch_size,), generator=generator)
        return flow_matching_loss(
            transformer,
            latents[targets],
            prompt_states[prompt],
            prompt_pooled[prompt],
            ids,
            generator,
            embeds,
        )

    transformer.train()
    losses = train_loop(
        trained, loss_fn, steps=steps, lr=lr, description="adapter (stage 2)", progress=progress
    )
    transformer.eval()
    return losses, sizes
