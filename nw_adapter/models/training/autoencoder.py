"""Stage 0: the VAE, trained to reconstruct the training digits through 4 x 8 x 8 latents."""

from __future__ import annotations

import torch

from nw_adapter.models.tiny_digits import build_vae
from nw_adapter.models.training.common import train_loop

__all__ = ["KL_WEIGHT", "train_vae"]

KL_WEIGHT = 1e-4
"""Weight of the KL term (a small one, as in latent diffusion: the latents stay informative)."""


def train_vae(images: torch.Tensor, *, steps: int, batch_size: int, seed: int, progress: bool = True):
    """Train an ``AutoencoderKL`` and set its ``scaling_factor`` to ``1 / std`` of the latents.

    The loss is ``mean |x - D(z)|^2 + KL_WEIGHT * mean KL(q(z|x) || N(0, I))`` with
    ``z ~ q(z|x)`` (the reparameterised sample diffusers' ``latent_dist.sample`` draws).

    Args:
        images: ``(N, 3, 32, 32)`` float training images in ``[-1, 1]``.
        steps: Optimiser steps.
        batch_size: Images per step.
        seed: Seed of the initialisation and of the batches and latent samples.
        progress: Show a progress bar.

    Returns:
        ``(vae, losses)``: the trained VAE in eval mode with ``config.scaling_factor`` set, and
        the per-step losses.
    """
    torch.manual_seed(seed)
    vae = build_vae()
    generator = torch.Generator().manual_seed(seed + 1)

    def loss_fn(step: int) -> torch.Tensor:
        batch = images[torch.randint(0, len(images), (batch_size,), generator=generator)]
        posterior = vae.encode(batch).latent_dist
        recon = vae.decode(posterior.sample(generator=generator)).sample
        return (recon - batch).pow(2).mean() + KL_WEIGHT * posterior.kl().mean() / posterior.mean[0].numel()

    vae.train()
    losses = train_loop(vae.parameters(), loss_fn, steps=steps, lr=2e-3, description="vae", progress=progress)
    vae.eval()
    with torch.no_grad():
        latents = torch.cat([vae.encode(chunk).latent_dist.mean for chunk in images.split(256)])
    vae.register_to_config(scaling_factor=float(1.0 / latents.std()))
    return vae, losses
