"""One generation conditioned on a support set, observed: the Python API of support sets.

A support set is several reference images for one adapter. diffusers conditions one generation on
them when ``ip_adapter_image`` holds a list per adapter (``[[a, b, c]]``): the adapter's image
tokens become ``[B, m, T, D]`` and its softmax runs over ``m x T`` keys. :func:`observe_support_set`
makes that call under the NW processors (observe: the image is the stock one) and returns

- the records, whose support-set columns (``ref_mass_{r}``, ``ref_mass_nw_{r}``, the entropies;
  :func:`~nw_adapter.integration.schema.support_columns`) say per step, layer, head and CFG half how
  the attention shares its mass among the references, beside the NW weights at the schedule's h;
- :func:`support_steps`: those columns per step, averaged over layers and heads (one CFG half);
- which reference the generation resembles: per-reference CLIP-I, the cosine of the generation's
  and each reference's embedding in the pipeline's own image encoder
  (:func:`~nw_adapter.analysis.consequence.encode_images`), and optionally a class judge's labels.

Example:
    >>> from nw_adapter.models.loaders import load_tiny_digits, tiny_digit_image
    >>> from nw_adapter.models.digits_quality import digit_judge
    >>> pipe = load_tiny_digits()
    >>> run = observe_support_set(pipe, [tiny_digit_image(3), tiny_digit_image(7)], judge=digit_judge(),
    ...                           num_inference_steps=10)  # doctest: +SKIP
    >>> run.clip_nearest, run.winner, run.judged  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nw_adapter.analysis.consequence import encode_images
from nw_adapter.integration.config import NWProcessorConfig
from nw_adapter.integration.mixin import nw_processor
from nw_adapter.integration.schema import SUPPORT_REFERENCES, SUPPORT_SCALARS, support_mass_column

__all__ = ["SupportSetRun", "decided_step", "observe_support_set", "support_steps"]


def _mean(values: Sequence[Any]) -> float:
    kept = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(kept) / len(kept) if kept else math.nan


def support_steps(records: Sequence[dict[str, Any]], half: str | None = None) -> list[dict[str, Any]]:
    """The support-set columns per step (one call), averaged over layers, heads and adapters.

    Args:
        records: records of one support set's generation (those without ``num_refs`` are ignored).
        half: the CFG half (default ``"cond"`` when recorded, else the first half present).

    Returns:
        One dict per step, in step order: ``step``, ``timestep``, ``h_schedule``, ``ref_h_nw``,
        ``num_refs`` (m), ``mass`` and ``mass_nw`` (lists of m NaN-ignoring means), the entropies of
        :data:`~nw_adapter.integration.schema.SUPPORT_SCALARS` and ``cells`` (records averaged).

    Raises:
        ValueError: the records mix support sets of different sizes.
    """
    support = [r for r in records if r.get(SUPPORT_REFERENCES) is not None]
    if not support:
        return []
    halves = {r["half"] for r in support}
    half = half or ("cond" if "cond" in halves else sorted(halves)[0])
    sizes = {int(r[SUPPORT_REFERENCES]) for r in support}
    if len(sizes) > 1:
        raise ValueError(f"records of support sets of {sorted(sizes)} references; pass one set's records")
    m = sizes.pop()
    steps: dict[int, list[dict[str, Any]]] = {}
    for r in support:
        if r["half"] == half:
            steps.setdefault(int(r["step"]), []).append(r)
    rows = []
    for step in sorted(steps):
        cells = steps[step]
        row: dict[str, Any] = {
            "step": step,
            **{key: _mean([c.get(key) for c in cells]) for key in ("timestep", "h_schedule", "ref_h_nw")},
            "num_refs": m,
            "mass": [_mean([c.get(support_mass_column(i)) for c in cells]) for i in range(m)],
            "mass_nw": [_mean([c.get(support_mass_column(i, nw=True)) for c in cells]) for i in range(m)],
            **{key: _mean([c.get(key) for c in cells]) for key in SUPPORT_SCALARS},
            "cells": len(cells),
        }
        rows.append(row)
    return rows


TIE = 1e-6
"""Masses closer than this count as tied: no reference wins (identical references share exactly)."""


def _argmax(values: Sequence[float]) -> int | None:
    """The index of the largest finite value; None when there is none or the top two are tied."""
    finite = sorted(((v, i) for i, v in enumerate(values) if math.isfinite(v)), reverse=True)
    if not finite or (len(finite) > 1 and finite[0][0] - finite[1][0] < TIE):
        return None
    return finite[0][1]


def decided_step(steps: Sequence[dict[str, Any]], key: str = "mass") -> tuple[int | None, int | None]:
    """``(winner, step)``: the reference with the largest ``key`` mass at the last step, and the first
    step from which it keeps the largest mass to the end (None, None without steps or with a tie at
    the last step, :data:`TIE`)."""
    if not steps:
        return None, None
    winner = _argmax(steps[-1][key])
    if winner is None:
        return None, None
    decided = steps[-1]["step"]
    for row in reversed(steps):
        if _argmax(row[key]) != winner:
            break
        decided = row["step"]
    return winner, decided


@dataclass
class SupportSetRun:
    """One observed generation on a support set (see the module docstring).

    Attributes:
        image: the generated image (PIL; the stock pipeline's output, observe changes nothing).
        records: the recorder's records (every statistic, with the support-set columns).
        clip_cosine: per reference, CLIP-I of the generation and that reference.
        clip_embedding: which output of the image encoder was used (``image_embeds``, ...).
        judged: the judge's labels ``[generation, reference 0, ...]`` (None without a judge).
        steps: :func:`support_steps` of the conditional half (empty for one reference).
    """

    image: Any
    records: list[dict[str, Any]]
    clip_cosine: list[float]
    clip_embedding: str
    judged: list[Any] | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)

    @property
    def clip_nearest(self) -> int:
        """The reference of the largest CLIP-I."""
        return max(range(len(self.clip_cosine)), key=self.clip_cosine.__getitem__)

    @property
    def winner(self) -> int | None:
        """The reference with the largest attention mass at the last recorded step (None: m = 1)."""
        return decided_step(self.steps)[0]

    @property
    def decided(self) -> int | None:
        """The first step from which :attr:`winner` keeps the largest attention mass to the end."""
        return decided_step(self.steps)[1]

    @property
    def judged_matches(self) -> list[bool] | None:
        """Per reference, whether the judge gives the generation that reference's label."""
        if self.judged is None:
            return None
        return [label == self.judged[0] for label in self.judged[1:]]


def observe_support_set(
    pipe: Any,
    references: Sequence[Any],
    *,
    config: NWProcessorConfig | None = None,
    judge: Callable[[list[Any]], Sequence[Any]] | None = None,
    seed: int = 0,
    **call: Any,
) -> SupportSetRun:
    """Generate once conditioned on ``references`` (one support set for the pipeline's one adapter),
    with the NW processors observing.

    Args:
        pipe: a diffusers pipeline with one IP-Adapter and its image encoder loaded.
        references: the m >= 1 reference images (PIL), in the order their masses are numbered.
        config: the processors' configuration (default: observe, statistics on).
        judge: optional class judge, list of PIL images -> labels
            (e.g. :func:`nw_adapter.models.digits_quality.digit_judge`).
        seed: the generation's seed (``torch.Generator(pipe.device).manual_seed(seed)``).
        **call: further pipeline arguments (prompt, num_inference_steps, guidance_scale, ...).

    Returns:
        :class:`SupportSetRun`.

    Raises:
        ValueError: no references, ``num_inference_steps`` < 1, a call that passes its own IP-Adapter
            images, or a swap config.
    """
    steps = call.get("num_inference_steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"observe_support_set: num_inference_steps must be a whole number >= 1, got {steps!r}"
        )
    references = list(references)
    if not references:
        raise ValueError("observe_support_set: no reference image; pass a list of one or more images")
    given = {"ip_adapter_image", "ip_adapter_image_embeds", "generator"} & set(call)
    if given:
        raise ValueError(
            f"observe_support_set: {sorted(given)[0]} is set by the function; pass the images as references "
            "and the seed as seed"
        )
    config = config if config is not None else NWProcessorConfig(mode="observe")
    if config.mode != "observe":
        raise ValueError("observe_support_set observes; pass an observe config (mode='observe')")
    generator = torch.Generator(pipe.device).manual_seed(seed)
    with nw_processor(pipe, config) as recorder:
        output = pipe(ip_adapter_image=[references], generator=generator, **call)
    image = output.images[0]
    if not hasattr(image, "convert"):
        raise ValueError("observe_support_set compares images: leave output_type at 'pil'")
    embeddings, used = encode_images(pipe, [image, *references])
    cosine = torch.nn.functional.cosine_similarity(embeddings[:1], embeddings[1:]).clamp(-1.0, 1.0)
    records = recorder.to_records()
    judged = list(judge([image, *references])) if judge is not None else None
    return SupportSetRun(image, records, cosine.tolist(), used, judged, support_steps(records))
