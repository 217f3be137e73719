"""Pieces every training stage shares: seeding, batches, the optimiser loop with a progress bar."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["CAPTION_DROPOUT", "adapter_parameters", "draw_caption_batch", "train_loop"]

CAPTION_DROPOUT = 0.15
"""Stage 1: probability that a caption is replaced by the empty prompt (the unconditional model)."""


def train_loop(
    parameters: Iterable[torch.nn.Parameter] | Iterable[dict],
    loss_fn: Callable[[int], torch.Tensor],
    *,
    steps: int,
    lr: float,
    description: str,
    progress: bool = True,
    weight_decay: float = 0.0,
) -> list[float]:
    """Minimise ``loss_fn(step)`` with AdamW and a cosine learning-rate decay.

    Args:
        parameters: The trained parameters (all others must be frozen by the caller), or torch's
            parameter groups (dicts with ``"params"`` and an optional own ``"lr"``, the peak of that
            group; the schedule scales every group alike; gradients are clipped over all of them).
        loss_fn: Builds the scalar loss of one step from its index (it samples its own batch).
        steps: Number of optimiser steps.
        lr: Peak learning rate (100 warm-up steps at most, then cosine decay to 0).
        description: Progress-bar label.
        progress: Whether to show a ``tqdm`` progress bar (on stderr).
        weight_decay: AdamW weight decay.

    Returns:
        The loss of every step (floats, read once per step for the progress bar and the log).
    """
    from tqdm.auto import tqdm

    parameters = list(parameters)
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)
    if parameters and isinstance(parameters[0], dict):  # parameter groups: clip over their union
        parameters = [parameter for group in parameters for parameter in group["params"]]
    warmup = min(100, max(steps // 10, 1))

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (
            1.0 + torch.cos(torch.tensor(torch.pi * (step - warmup) / max(steps - warmup, 1))).item()
        )

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    losses = []
    bar = tqdm(range(steps), desc=description, disable=not progress, leave=True)
    for step in bar:
        loss = loss_fn(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses


def adapter_parameters(denoiser: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Freeze ``denoiser`` except its loaded IP-Adapter, and return the adapter's parameters.

    The adapter is what ``load_ip_adapter`` installed: the image projection
    (``denoiser.encoder_hid_proj``) and every attention processor's ``to_k_ip`` / ``to_v_ip``
    layers, in that order (the UNet's and the Flux transformer's layout alike).

    Args:
        denoiser: A UNet or Flux transformer with one IP-Adapter loaded.

    Returns:
        The adapter's parameters, now requiring gradients (all others do not).
    """
    denoiser.requires_grad_(False)
    parameters = list(denoiser.encoder_hid_proj.parameters())
    for processor in denoiser.attn_processors.values():
        for layers in (getattr(processor, "to_k_ip", None), getattr(processor, "to_v_ip", None)):
            if layers is not None:
                parameters += list(layers.parameters())
    for parameter in parameters:
        parameter.requires_grad_(True)
    return parameters


def draw_caption_batch(
    generator: torch.Generator, images: int, batch_size: int, wordings: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one stage-1 batch: which images, which caption wording, which captions are dropped.

    Drawn from ``generator`` in this order (the order fixes the trained weights):
    ``rows ~ U{0..images-1}``, ``choice ~ U{0..wordings-1}``, ``dropped = u < CAPTION_DROPOUT``
    with ``u ~ U[0, 1)``.

    Returns:
        ``rows``: ``(batch_size,)`` image rows (with replacement); ``choice``: ``(batch_size,)``
        wording of each caption; ``dropped``: ``(batch_size,)`` bool, caption replaced by ``""``.
    """
    rows = torch.randint(0, images, (batch_size,), generator=generator)
    choice = torch.randint(0, wordings, (batch_size,), generator=generator)
    dropped = torch.rand(batch_size, generator=generator) < CAPTION_DROPOUT
    return rows, choice, dropped
