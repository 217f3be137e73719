"""Stage 1 (caption-conditioned UNet) and stage 2 (the IP-Adapter alone) of the diffusion training.

Both minimise the epsilon-prediction loss of Stable Diffusion,

    L = E_{z0, eps ~ N(0, I), t ~ U{0..999}} || eps - eps_theta(z_t, t, c) ||^2,
    z_t = sqrt(abar_t) z0 + sqrt(1 - abar_t) eps,

with ``abar_t`` from SD 1.5's scaled-linear schedule (``DDPMScheduler.add_noise``) and
``z0 = scaling_factor * mean(q(z | x))`` the VAE latents of the target image.
"""

from __future__ import annotations

import torch

from nw_adapter.models.tiny_digits import ADAPTER_SUBFOLDER, ADAPTER_WEIGHT_NAME, build_unet, noise_scheduler
from nw_adapter.models.training.common import (
    CAPTION_DROPOUT,
    adapter_parameters,
    draw_caption_batch,
    train_loop,
)

__all__ = ["CAPTION_DROPOUT", "IMAGE_DROPOUT", "load_adapter_for_training", "train_adapter", "train_unet"]

IMAGE_DROPOUT = 0.05
"""Stage 2: probability that the image embedding is replaced by zeros (IP-Adapter's training drop)."""


def _epsilon_loss(unet, scheduler, latents, context, generator, added_cond_kwargs=None) -> torch.Tensor:
    noise = torch.randn(latents.shape, generator=generator)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (len(latents),), generator=generator)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    prediction = unet(
        noisy, timesteps, encoder_hidden_states=context, added_cond_kwargs=added_cond_kwargs
    ).sample
    return torch.nn.functional.mse_loss(prediction, noise)


def train_unet(
    latents: torch.Tensor,
    labels: torch.Tensor,
    caption_embeds: torch.Tensor,
    empty_embeds: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    seed: int,
    lr: float = 1e-3,
    progress: bool = True,
):
    """Stage 1: train the UNet on captions that name the digit.

    Args:
        latents: ``(N, 4, 8, 8)`` scaled VAE latents of the training images.
        labels: ``(N,)`` digit classes.
        caption_embeds: ``(10, W, 77, 32)`` text-encoder states of ``W`` wordings per class.
        empty_embeds: ``(1, 77, 32)`` text-encoder states of the empty prompt.
        steps: Optimiser steps.
        batch_size: Images per step.
        seed: Seed of the initialisation, batches, noise, timesteps and caption choices.
        lr: Peak learning rate.
        progress: Show a progress bar.

    Returns:
        ``(unet, losses)`` with the UNet in eval mode.
    """
    torch.manual_seed(seed)
    unet = build_unet()
    scheduler = noise_scheduler()
    generator = torch.Generator().manual_seed(seed + 1)
    wordings = caption_embeds.shape[1]

    def loss_fn(step: int) -> torch.Tensor:
        rows, choice, dropped = draw_caption_batch(generator, len(labels), batch_size, wordings)
        context = caption_embeds[labels[rows], choice]
        context = torch.where(dropped[:, None, None], empty_embeds.expand_as(context), context)
        return _epsilon_loss(unet, scheduler, latents[rows], context, generator)

    unet.train()
    losses = train_loop(
        unet.parameters(), loss_fn, steps=steps, lr=lr, description="unet (stage 1)", progress=progress
    )
    unet.eval()
    return unet, losses


def load_adapter_for_training(pipe, state_dict: dict[str, torch.Tensor]) -> list[torch.nn.Parameter]:
    """Load an original-format adapter into ``pipe.unet`` through ``load_ip_adapter``; return its parameters.

    Everything else in the UNet is frozen; the returned parameters (image projection, and every
    cross-attention layer's ``to_k_ip`` / ``to_v_ip``) require gradients.
    """
    nested: dict[str, dict[str, torch.Tensor]] = {"image_proj": {}, "ip_adapter": {}}
    for key, value in state_dict.items():
        group, name = key.split(".", 1)
        nested[group][name] = value.clone()
    pipe.load_ip_adapter(
        nested,
        subfolder=ADAPTER_SUBFOLDER,
        weight_name=ADAPTER_WEIGHT_NAME,
        low_cpu_mem_usage=False,
    )
    return adapter_parameters(pipe.unet)


def train_adapter(
    unet,
    parameters: list[torch.nn.Parameter],
    latents: torch.Tensor,
    image_embeds: torch.Tensor,
    labels: torch.Tensor,
    prompt_embeds: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    seed: int,
    progress: bool = True,
) -> list[float]:
    """Stage 2: train only the adapter on (reference, target) pairs of the same digit class.

    The reference is another training image of the target's class (never the target itself), so
    the adapter must carry the class, not copy the image; the prompt is class-free.

    Args:
        unet: The frozen stage-1 UNet with the adapter loaded (see :func:`load_adapter_for_training`).
        parameters: The adapter's parameters.
        latents: ``(N, 4, 8, 8)`` scaled VAE latents of the training images (targets).
        image_embeds: ``(N, 32)`` frozen image-encoder embeddings of the same images (references).
        labels: ``(N,)`` digit classes.
        prompt_embeds: ``(P, 77, 32)`` text states of the class-free prompts, drawn uniformly.
        steps: Optimiser steps.
        batch_size: Pairs per step.
        seed: Seed of the pairs, prompts, drops, noise and timesteps.
        progress: Show a progress bar.

    Returns:
        The per-step losses.
    """
    scheduler = noise_scheduler()
    generator = torch.Generator().manual_seed(seed)
    by_class = [torch.nonzero(labels == digit).flatten() for digit in range(10)]

    def loss_fn(step: int) -> torch.Tensor:
        targets = torch.randint(0, len(labels), (batch_size,), generator=generator)
        references = []
        for target in targets.tolist():
            pool = by_class[int(labels[target])]
            pick = pool[torch.randint(0, len(pool) - 1, (1,), generator=generator)]
            references.append(int(pick) if int(pick) != target else int(pool[-1]))
        embeds = image_embeds[references]
        dropped = torch.rand(batch_size, generator=generator) < IMAGE_DROPOUT
        embeds = torch.where(dropped[:, None], torch.zeros_like(embeds), embeds)
        context = prompt_embeds[torch.randint(0, len(prompt_embeds), (batch_size,), generator=generator)]
        added = {"image_embeds": [embeds[:, None, :]]}  # (batch, 1 image, 32), as the pipeline passes them
        return _epsilon_loss(unet, scheduler, latents[targets], context, generator, added)

    unet.train()
    losses = train_loop(
        parameters, loss_fn, steps=steps, lr=5e-3, description="adapter (stage 2)", progress=progress
    )
    unet.eval()
    return losses
