"""The image encoder, pretrained as a digit classifier before the adapter is trained (then frozen).

IP-Adapter relies on a pretrained CLIP image encoder whose embedding carries the image's content.
A random encoder's embedding does not, so the tiny ``CLIPVisionModelWithProjection`` is first
trained to classify the training digits from its projected embedding ``image_embeds`` (the input
of the base IP-Adapter) with a linear head, which is then thrown away.
"""

from __future__ import annotations

import torch

from nw_adapter.models.tiny_digits import IMAGE_EMBED_DIM, build_image_encoder
from nw_adapter.models.training.common import train_loop

__all__ = ["classifier_accuracy", "train_image_encoder"]

_MAX_SHIFT = 2  # pixels; random translations keep the embedding from memorising positions


def _shift(pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Roll each ``(3, H, W)`` image by a random ``(dy, dx)`` in ``[-2, 2]^2`` (data augmentation)."""
    shifts = torch.randint(-_MAX_SHIFT, _MAX_SHIFT + 1, (len(pixels), 2), generator=generator).tolist()
    return torch.stack(
        [
            torch.roll(image, shifts=(dy, dx), dims=(1, 2))
            for image, (dy, dx) in zip(pixels, shifts, strict=True)
        ]
    )


def train_image_encoder(
    pixel_values: torch.Tensor,
    labels: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    seed: int,
    progress: bool = True,
):
    """Train the encoder and a linear head on ``image_embeds`` with cross-entropy.

    Args:
        pixel_values: ``(N, 3, 32, 32)`` images as the pipeline's ``feature_extractor`` returns them.
        labels: ``(N,)`` digit classes.
        steps: Optimiser steps.
        batch_size: Images per step.
        seed: Seed of the initialisation, the batches and the shifts.
        progress: Show a progress bar.

    Returns:
        ``(encoder, head, losses)``: the encoder in eval mode, the ``Linear(32, 10)`` head, losses.
    """
    torch.manual_seed(seed)
    encoder = build_image_encoder()
    head = torch.nn.Linear(IMAGE_EMBED_DIM, 10)
    generator = torch.Generator().manual_seed(seed + 1)

    def loss_fn(step: int) -> torch.Tensor:
        rows = torch.randint(0, len(labels), (batch_size,), generator=generator)
        embeds = encoder(pixel_values=_shift(pixel_values[rows], generator)).image_embeds
        return torch.nn.functional.cross_entropy(head(embeds), labels[rows])

    encoder.train()
    parameters = [*encoder.parameters(), *head.parameters()]
    losses = train_loop(
        parameters,
        loss_fn,
        steps=steps,
        lr=2e-3,
        description="image encoder",
        progress=progress,
        weight_decay=0.01,
    )
    encoder.eval()
    return encoder, head, losses


@torch.no_grad()
def classifier_accuracy(encoder, head, pixel_values: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of ``labels`` the encoder + head predict (argmax of the logits)."""
    logits = head(encoder(pixel_values=pixel_values).image_embeds)
    return float((logits.argmax(dim=-1) == labels).float().mean())
