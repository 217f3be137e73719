"""Class agreement of generations conditioned on a *support set* of m references of one class.

The measurement of :mod:`~nw_adapter.models.digits_quality` with several reference images per
generation, passed through diffusers' list-per-adapter convention (``ip_adapter_image=[[r_1, ...,
r_m]]``: one adapter, ``m`` images, ``m x tokens`` image keys). The held-out ``reference`` split
(10 digits per class) is cut into *disjoint* support sets of one class each (:func:`support_sets`:
100 sets of 1, 50 of 2, 30 of 3, 20 of 4), so every set, its seed and its generation are one
independent unit; the judge labels each generation and the agreement is the fraction labelled
with the support's class, with its exact (Clopper-Pearson) 95% interval and the one-sided exact
binomial test against chance (10%).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from nw_adapter.models.digits_data import DigitSplit
from nw_adapter.models.digits_quality import AgreementResult, generate_one_per_call, judge_agreement

__all__ = ["generate_from_supports", "measure_support_agreement", "pilot_references", "support_sets"]


def support_sets(references: DigitSplit, size: int) -> list[np.ndarray]:
    """Disjoint support sets of ``size`` references of one class each, class by class.

    Class ``c``'s references (in split order) are cut into ``len // size`` consecutive sets; the
    remainder is left out, so no reference is in two sets.

    Args:
        references: The held-out references (e.g. ``load_digit_splits()["reference"]``).
        size: Support size ``m >= 1``.

    Returns:
        A list of ``(m,)`` arrays of row numbers into ``references``, ordered by class.
    """
    if size < 1:
        raise ValueError(f"a support set has at least one reference, got size {size}")
    sets = []
    for digit in range(10):
        rows = np.flatnonzero(references.labels == digit)
        sets += [rows[start : start + size] for start in range(0, len(rows) - size + 1, size)]
    return sets


def pilot_references(judge_split: DigitSplit, per_class: int = 10) -> DigitSplit:
    """References for choosing a recipe without touching the ``reference`` split: the first
    ``per_class`` digits of each class of the ``judge`` split (split order), ordered by class.

    The judge is fitted on these digits, so generations conditioned on them are scored by a
    classifier that has seen the references (a mild bias: it labels the generated image, not the
    reference); the training never sees them.

    Args:
        judge_split: ``load_digit_splits()["judge"]``.
        per_class: Digits per class (at most the smallest class's count).

    Returns:
        A :class:`~nw_adapter.models.digits_data.DigitSplit` of ``10 * per_class`` digits.
    """
    rows = [np.flatnonzero(judge_split.labels == digit) for digit in range(10)]
    if not 1 <= per_class <= min(len(r) for r in rows):
        raise ValueError(f"per_class must be in [1, {min(len(r) for r in rows)}], got {per_class}")
    chosen = np.concatenate([r[:per_class] for r in rows])
    return DigitSplit(
        images=judge_split.images[chosen],
        labels=judge_split.labels[chosen],
        indices=judge_split.indices[chosen],
    )


def generate_from_supports(
    pipe,
    images: np.ndarray,
    supports: list[np.ndarray],
    *,
    ip_scale: float,
    steps: int,
    prompt: str = "a photograph",
    seed: int = 0,
    call_kwargs: Mapping[str, Any] | None = None,
) -> np.ndarray:
    """One generation per support set, each in its own pipeline call.

    Args:
        pipe: A pipeline with one IP-Adapter loaded.
        images: ``(N, 32, 32, 3)`` uint8 reference images.
        supports: Row numbers into ``images`` of each support set.
        ip_scale: IP-Adapter scale (``pipe.set_ip_adapter_scale``).
        steps: Denoising steps.
        prompt: Text prompt (default: the correlate CLI's ``"a photograph"``).
        seed: Support ``k`` is generated with ``torch.Generator().manual_seed(seed + k)``.
        call_kwargs: Further keyword arguments of the call (guidance, size, sequence length).

    Returns:
        ``(len(supports), H, W, 3)`` uint8 generations.
    """
    from PIL import Image

    pipe.set_ip_adapter_scale(ip_scale)
    return generate_one_per_call(
        pipe,
        [[[Image.fromarray(images[row]) for row in rows]] for rows in supports],
        [prompt] * len(supports),
        steps=steps,
        seed=seed,
        call_kwargs=call_kwargs,
    )


def measure_support_agreement(
    pipe,
    judge,
    references: DigitSplit,
    size: int,
    *,
    ip_scale: float = 1.0,
    steps: int = 25,
    prompt: str = "a photograph",
    seed: int = 0,
    call_kwargs: Mapping[str, Any] | None = None,
    limit: int | None = None,
) -> AgreementResult:
    """Generate from every disjoint support set of ``size`` and measure the class agreement.

    Args:
        pipe, ip_scale, steps, prompt, seed, call_kwargs: As :func:`generate_from_supports`.
        judge: The fitted judge (:func:`~nw_adapter.models.digits_quality.fit_judge`).
        references: The held-out references.
        size: Support size ``m``.
        limit: Use only every ``len // limit``-th set (at most ``limit``, classes balanced as far
            as the order allows); ``None``: all sets.

    Returns:
        The :class:`~nw_adapter.models.digits_quality.AgreementResult` (its ``n`` counts support sets).
    """
    supports = support_sets(references, size)
    if limit is not None and limit < len(supports):
        supports = supports[:: len(supports) // limit][:limit]
    generated = generate_from_supports(
        pipe,
        references.images,
        supports,
        ip_scale=ip_scale,
        steps=steps,
        prompt=prompt,
        seed=seed,
        call_kwargs=call_kwargs,
    )
    truth = np.array([references.labels[rows[0]] for rows in supports])
    settings = {
        "support_size": size,
        "ip_scale": ip_scale,
        "steps": steps,
        "prompt": prompt,
        "seed": seed,
        **{key: value for key, value in (call_kwargs or {}).items()},
    }
    return judge_agreement(judge, generated, truth, settings)
