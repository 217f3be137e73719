"""The text encoder, pretrained as a caption classifier before stage 1 (then frozen).

Stable Diffusion conditions on a *pretrained* text encoder (CLIP's text tower), frozen while the
UNet trains. A random tiny ``CLIPTextModel`` is a poor stand-in: with the character-level
tokenizer two captions of different digits differ only from their last characters on, so the
class is a small part of their states (states of one digit's wordings lie further apart than
those of two digits' captions), and a UNet trained on them ignores the text (see the model card).
So, as the image encoder is pretrained as an image classifier, the text encoder is first trained
to name the digit of a caption from its states, then frozen:

    L = - mean_{p, i >= eos_p} log softmax(W s_{p,i} + b)_{y_p},

over the captions ``p`` (token states ``s_{p,i}`` of ``last_hidden_state``, which the pipeline's
cross-attention reads), every position ``i`` from the caption's end-of-text token on (a causal
encoder's states there have seen the whole caption, and they are most of the 77 positions), and
11 classes: the digits, and "no digit" for the class-free prompts (the empty prompt included).
The head ``(W, b)`` is thrown away.
"""

from __future__ import annotations

import torch

from nw_adapter.models.tiny_digits import CROSS_ATTENTION_DIM, build_text_encoder
from nw_adapter.models.training.common import train_loop

__all__ = ["NO_DIGIT", "caption_accuracy", "train_text_encoder"]

NO_DIGIT = 10
"""The class label of a prompt that names no digit (``""``, ``"a photograph"``, ...)."""


def _after_end_of_text(token_ids: torch.Tensor, end_of_text_id: int) -> torch.Tensor:
    """``(P, T)`` bool: the positions from each row's first end-of-text token on."""
    first = (token_ids == end_of_text_id).int().argmax(dim=1)
    return torch.arange(token_ids.shape[1])[None, :] >= first[:, None]


def _position_logits(text_encoder, head: torch.nn.Linear, token_ids: torch.Tensor) -> torch.Tensor:
    """``(P, T, 11)``: the head's class logits at every position of every prompt."""
    return head(text_encoder(token_ids)[0])


def train_text_encoder(
    token_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    end_of_text_id: int,
    steps: int,
    seed: int,
    lr: float = 3e-3,
    progress: bool = True,
):
    """Train a fresh text encoder and a linear head to name each prompt's digit at every late position.

    Args:
        token_ids: ``(P, 77)`` padded token ids of every caption and class-free prompt (one batch).
        labels: ``(P,)`` the digit a prompt names, or :data:`NO_DIGIT`.
        end_of_text_id: The tokenizer's end-of-text (and padding) id.
        steps: Optimiser steps (full batch).
        seed: Seed of the initialisation (the encoder's and the head's).
        lr: Peak learning rate.
        progress: Show a progress bar.

    Returns:
        ``(text_encoder, head, losses)``: the encoder in eval mode, the ``Linear(32, 11)`` head, losses.
    """
    torch.manual_seed(seed)
    text_encoder = build_text_encoder()
    head = torch.nn.Linear(CROSS_ATTENTION_DIM, NO_DIGIT + 1)
    late = _after_end_of_text(token_ids, end_of_text_id)
    targets = labels[:, None].expand_as(late)

    def loss_fn(step: int) -> torch.Tensor:
        logits = _position_logits(text_encoder, head, token_ids)
        return torch.nn.functional.cross_entropy(logits[late], targets[late])

    text_encoder.train()
    losses = train_loop(
        [*text_encoder.parameters(), *head.parameters()],
        loss_fn,
        steps=steps,
        lr=lr,
        description="text encoder",
        progress=progress,
        weight_decay=0.01,
    )
    text_encoder.eval()
    return text_encoder, head, losses


@torch.no_grad()
def caption_accuracy(
    text_encoder, head: torch.nn.Linear, token_ids: torch.Tensor, labels: torch.Tensor, *, end_of_text_id: int
) -> float:
    """Fraction of (prompt, late position) pairs whose argmax class is the prompt's label."""
    late = _after_end_of_text(token_ids, end_of_text_id)
    predicted = _position_logits(text_encoder, head, token_ids).argmax(dim=-1)
    return float((predicted == labels[:, None])[late].float().mean())
