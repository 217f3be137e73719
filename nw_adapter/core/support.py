"""Support sets: the attention mass on each reference image and its entropy, written plainly.

One generation conditioned on a support set of ``m`` reference images through one adapter attends,
in each image-branch softmax, over ``M = m T`` keys: reference r owns the ``T`` consecutive keys
``r T .. (r + 1) T - 1`` (diffusers' list-per-adapter convention: an adapter's image tokens
``[B, m, T, D]`` flattened image by image). For a query row n with logits ``l_n`` over those keys,
the mass on reference r is

    p_nr = sum_{i in r} softmax(l_n)_i = exp(logsumexp_{i in r} l_ni - logsumexp_i l_ni),

computed from the logits (never from weights that underflow). Per (batch row, head) the recorded
quantities are

    mass_r      = mean_n p_nr                          (the attention mass on reference r)
    entropy     = -sum_r mass_r log mass_r              (of the query-averaged mass; 0 .. log m)
    row_entropy = mean_n (-sum_r p_nr log p_nr)         (each query row's spread over references)

``entropy`` can stay high while ``row_entropy`` is 0 when different query rows pick different
references.

What the theory predicts for a support set is not a quantity of the head's q/k space: its posterior
over the references lives in the space of x_t (THEORY.md 4b; :mod:`nw_adapter.core.latent_support`).
NW weights over the image keys at the data-space bandwidth h have no unit (a constant gain on q and k
moves their entropy from 0 to log m while the attention is unchanged), so none are recorded here.

This module is the specification; the recorder pools it per CFG half
(:mod:`nw_adapter.integration.support`) and the tests compare both with an own computation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "SupportStatistics",
    "attention_log_mass",
    "mass_entropy",
    "reference_log_mass",
    "reference_mass",
    "row_entropy",
    "support_statistics",
]


def _check_references(num_keys: int, references: int) -> int:
    """``T = M / m``, the tokens per reference; ValueError when m does not divide M."""
    if isinstance(references, bool) or not isinstance(references, int) or references < 1:
        raise ValueError(f"references must be an int >= 1, got {references!r}")
    if num_keys % references:
        raise ValueError(
            f"{num_keys} keys do not split into {references} references of equal token count; "
            "pass the number of reference images of this softmax"
        )
    return num_keys // references


def reference_log_mass(logits: Tensor, references: int) -> Tensor:
    """``log p_nr = logsumexp_{i in r} l_ni - logsumexp_i l_ni``.

    Args:
        logits: ``[..., N, M]`` logits of a softmax over ``M = m T`` keys, reference-major.
        references: m.

    Returns:
        ``[..., N, m]`` log-masses (each row's ``exp`` sums to 1).
    """
    tokens = _check_references(logits.shape[-1], references)
    # shifted by the row's largest logit first: logsumexp returns max + log(sum), whose rounding
    # at logits of size 1e3 (NW at a small h) would be 1e-4 of every mass; the shifted groups' values
    # are near 0, so a row's masses sum to 1 within float rounding
    shifted = logits - logits.amax(-1, keepdim=True)
    grouped = shifted.unflatten(-1, (references, tokens)).logsumexp(-1)
    return grouped - grouped.logsumexp(-1, keepdim=True)


def reference_mass(log_mass: Tensor) -> Tensor:
    """``mass_r = mean_n p_nr``: ``[..., N, m]`` log-masses -> ``[..., m]``."""
    return log_mass.exp().mean(-2)


def mass_entropy(mass: Tensor) -> Tensor:
    """``-sum_r mass_r log mass_r`` (nats; ``0 log 0 = 0``): ``[..., m]`` -> ``[...]``."""
    return -torch.special.xlogy(mass, mass).sum(-1)


def row_entropy(log_mass: Tensor) -> Tensor:
    """``mean_n (-sum_r p_nr log p_nr)`` from the log-masses ``[..., N, m]`` -> ``[...]``."""
    return -(log_mass.exp() * log_mass).sum(-1).mean(-1)


def attention_log_mass(q: Tensor, k: Tensor, scale: float, references: int) -> Tensor:
    """Log-masses of the attention A = softmax(s q.k_i): ``q [..., N, d]``, ``k [..., M, d]`` ->
    ``[..., N, m]``."""
    return reference_log_mass(scale * (q @ k.transpose(-1, -2)), references)


@dataclass(frozen=True)
class SupportStatistics:
    """The support-set quantities of one softmax, per (batch row, head).

    Attributes:
        mass: ``[B, H, m]`` attention mass on each reference (query-averaged).
        entropy: ``[B, H]`` entropy over references of ``mass`` (nats).
        row_entropy: ``[B, H]`` the query rows' mean entropy over references.
    """

    mass: Tensor
    entropy: Tensor
    row_entropy: Tensor


def support_statistics(q: Tensor, k: Tensor, *, scale: float, references: int) -> SupportStatistics:
    """Every support-set quantity of one softmax (see the module docstring).

    Args:
        q: queries ``[B, H, N, d]``.
        k: keys ``[B, H, M, d]``, ``M = m T``, reference-major.
        scale: s, the attention's softmax scale.
        references: m.

    Returns:
        :class:`SupportStatistics` in the dtype of q (float64 for float64 inputs).

    Example:
        >>> q, k = torch.zeros(1, 2, 5, 8), torch.randn(1, 2, 6, 8)
        >>> out = support_statistics(q, k, scale=8**-0.5, references=2)
        >>> out.mass[0, 0].tolist(), round(out.entropy[0, 0].item(), 4)
        ([0.5, 0.5], 0.6931)
    """
    log_a = attention_log_mass(q, k, scale, references)
    mass = reference_mass(log_a)
    return SupportStatistics(mass=mass, entropy=mass_entropy(mass), row_entropy=row_entropy(log_a))
