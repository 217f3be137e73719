"""One generation conditioned on a support set, observed: the Python API of support sets.

A support set is several reference images for one adapter. diffusers conditions one generation on
them when ``ip_adapter_image`` holds a list per adapter (``[[a, b, c]]``): the adapter's image
tokens become ``[B, m, T, D]`` and its softmax runs over ``m x T`` keys. :func:`observe_support_set`
makes that call under the NW processors (observe: the image is the stock one) and returns

- the records, whose support-set columns (``ref_mass_{r}``, ``ref_entropy``, ``ref_row_entropy``;
  :func:`~nw_adapter.integration.schema.support_columns`) say per step, layer, head and CFG half how
  the attention shares its mass among the references;
- the theory's prediction for the same references in its own units, per step and CFG half
  (:class:`~nw_adapter.integration.latent_probe.LatentSupportProbe`): the posterior
  ``w_i(x_t) = softmax_i(-||x_t - a_t s_i||^2 / 2 b_t^2)`` over the references' VAE latents ``s_i``
  in the space of x_t (THEORY.md 4b), its entropy share and ``n_eff``, the reference it favours; the
  learned denoiser's x0 estimate against the plug-in field's ``m_h(x_t / a_t)``; the generated
  latent's distance to each reference;
- :func:`support_steps`: those per step (one CFG half), the attention's means over layers and heads
  beside the latent posterior;
- which reference the generation resembles: per-reference CLIP-I, the cosine of the generation's
  and each reference's embedding in the pipeline's own image encoder
  (:func:`~nw_adapter.analysis.consequence.encode_images`), and optionally a class judge's labels.

Example:
    >>> from nw_adapter.models.loaders import load_tiny_digits, tiny_digit_image
    >>> from nw_adapter.models.digits_quality import digit_judge
    >>> pipe = load_tiny_digits()
    >>> run = observe_support_set(pipe, [tiny_digit_image(3), tiny_digit_image(7)], judge=digit_judge(),
    ...                           num_inference_steps=10)  # doctest: +SKIP
    >>> run.clip_nearest, run.winner, run.posterior_winner, run.final_nearest, run.judged  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nw_adapter.analysis.consequence import encode_images
from nw_adapter.integration.config import NWProcessorConfig, step_count_problem
from nw_adapter.integration.families import families_where, family_of_pipeline
from nw_adapter.integration.latent_probe import LatentSupportProbe
from nw_adapter.integration.latent_support import encode_references, latent_space, reference_image
from nw_adapter.integration.mixin import nw_processor
from nw_adapter.integration.schema import SUPPORT_REFERENCES, SUPPORT_SCALARS, support_mass_column

__all__ = ["SupportSetRun", "decided_step", "observe_support_set", "support_steps"]


def _mean(values: Sequence[Any]) -> float:
    kept = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(kept) / len(kept) if kept else math.nan


#: The latent probe's per-step values carried into :func:`support_steps` (besides the posterior).
LATENT_FIELDS = (
    "posterior_entropy_share",
    "posterior_n_eff",
    "posterior_favoured",
    "x0_nw_ratio",
    "x0_nw_distance",
    "x0_mean_distance",
    "x0_nearest",
)


def _half_of(halves: set[str], half: str | None) -> str | None:
    if half is not None or not halves:
        return half
    return "cond" if "cond" in halves else sorted(halves)[0]


def support_steps(
    records: Sequence[dict[str, Any]],
    half: str | None = None,
    latent_rows: Sequence[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The support set's readings per step (one call): the attention's, averaged over layers, heads
    and adapters, beside the latent posterior of the same step.

    Args:
        records: records of one support set's generation (those without ``num_refs`` are ignored).
        half: the CFG half (default ``"cond"`` when recorded, else the first half present).
        latent_rows: :attr:`~nw_adapter.integration.latent_probe.LatentSupportProbe.rows` of the same
            generation (None: attention only).

    Returns:
        One dict per step, in step order: ``step``, ``timestep``, ``h_schedule``, ``num_refs`` (m),
        ``mass`` (the attention's m NaN-ignoring means), the entropies of
        :data:`~nw_adapter.integration.schema.SUPPORT_SCALARS`, ``cells`` (records averaged) and,
        with ``latent_rows``, ``posterior`` (m weights; NaN where the step has no latent reading) and
        :data:`LATENT_FIELDS` (None there). Steps of either source are kept.

    Raises:
        ValueError: the records mix support sets of different sizes.
    """
    support = [r for r in records if r.get(SUPPORT_REFERENCES) is not None]
    latent = list(latent_rows or [])
    if not support and not latent:
        return []
    half = _half_of({r["half"] for r in support} or {r["half"] for r in latent}, half)
    sizes = {int(r[SUPPORT_REFERENCES]) for r in support} | {len(r["posterior"]) for r in latent}
    if len(sizes) > 1:
        raise ValueError(f"records of support sets of {sorted(sizes)} references; pass one set's records")
    m = sizes.pop()
    if m < 2:
        return []
    steps: dict[int, list[dict[str, Any]]] = {}
    for r in support:
        if r["half"] == half:
            steps.setdefault(int(r["step"]), []).append(r)
    by_step = {int(r["step"]): r for r in latent if r["half"] == half}
    rows = []
    for step in sorted(set(steps) | set(by_step)):
        cells, point = steps.get(step, []), by_step.get(step)
        row: dict[str, Any] = {
            "step": step,
            "timestep": _mean([c.get("timestep") for c in cells]) if cells else point["timestep"],
            "h_schedule": _mean([c.get("h_schedule") for c in cells]) if cells else point["h"],
            "num_refs": m,
            "mass": [_mean([c.get(support_mass_column(i)) for c in cells]) for i in range(m)],
            **{key: _mean([c.get(key) for c in cells]) for key in SUPPORT_SCALARS},
            "cells": len(cells),
        }
        if latent_rows is not None:
            row["posterior"] = list(point["posterior"]) if point else [math.nan] * m
            row.update({key: (point or {}).get(key) for key in LATENT_FIELDS})
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
        steps: :func:`support_steps` of the conditional half, with the latent posterior (empty for
            one reference).
        latent_steps: the latent probe's rows, every CFG half
            (:attr:`~nw_adapter.integration.latent_probe.LatentSupportProbe.rows`).
        final_distances: per reference, the distance of the generated latent to its latent.
        final_latent: ``[D]`` float64, the generated latent (flattened; None when not read).
        probe_errors: denoiser forwards the latent probe skipped (0 normally).
        references: the reference images as given (PIL), in set order (for a report).
        settings: what the call ran with: the pipeline's ``model`` (its ``name_or_path``), ``seed``,
            the scheduler's class and the call's plain arguments (``num_inference_steps``,
            ``guidance_scale``, the prompt, ...).
    """

    image: Any
    records: list[dict[str, Any]]
    clip_cosine: list[float]
    clip_embedding: str
    judged: list[Any] | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    latent_steps: list[dict[str, Any]] = field(default_factory=list)
    final_distances: list[float] = field(default_factory=list)
    final_latent: torch.Tensor | None = None
    probe_errors: int = 0
    references: list[Any] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

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
    def posterior_winner(self) -> int | None:
        """The reference the latent posterior favours at the last step (None: m = 1)."""
        return decided_step(self.steps, "posterior")[0]

    @property
    def posterior_decided(self) -> int | None:
        """The first step from which :attr:`posterior_winner` keeps the largest posterior to the end."""
        return decided_step(self.steps, "posterior")[1]

    @property
    def final_nearest(self) -> int | None:
        """The reference whose latent is nearest the generated latent (None when not read)."""
        if not self.final_distances:
            return None
        return min(range(len(self.final_distances)), key=self.final_distances.__getitem__)

    @property
    def judged_matches(self) -> list[bool] | None:
        """Per reference, whether the judge gives the generation that reference's label."""
        if self.judged is None:
            return None
        return [label == self.judged[0] for label in self.judged[1:]]


def _plain(call: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments that are plain values (numbers, strings, booleans, None): what a report
    can state of the run."""
    return {
        key: value
        for key, value in call.items()
        if value is None or isinstance(value, bool | int | float | str)
    }


def _check_call(call: dict[str, Any]) -> None:
    given = {"ip_adapter_image", "ip_adapter_image_embeds", "generator"} & set(call)
    if given:
        raise ValueError(
            f"observe_support_set: {sorted(given)[0]} is set by the function; pass the images as references "
            "and the seed as seed"
        )
    problem = step_count_problem(call)
    if problem:
        raise ValueError(f"observe_support_set: {problem}")


def _judged(judge: Callable[[list[Any]], Sequence[Any]], images: list[Any]) -> list[Any]:
    labels = list(judge(images))
    if len(labels) != len(images):
        raise ValueError(
            f"observe_support_set: the judge returned {len(labels)} labels for {len(images)} images (the "
            "generation and each reference); it must return one label per image"
        )
    return labels


def _chained(probe: LatentSupportProbe, call: dict[str, Any]) -> dict[str, Any]:
    """``call`` with the probe's ``callback_on_step_end`` first, then the caller's own (if any)."""
    own = call.pop("callback_on_step_end", None)
    inputs = list(call.pop("callback_on_step_end_tensor_inputs", None) or ["latents"])
    if "latents" not in inputs:
        inputs.append("latents")

    def callback(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        probe.on_step_end(pipe, step, timestep, tensors)
        return own(pipe, step, timestep, tensors) if own is not None else {}

    return {**call, "callback_on_step_end": callback, "callback_on_step_end_tensor_inputs": inputs}


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
    with the NW processors observing and the latent probe reading the posterior.

    Args:
        pipe: a diffusers pipeline with one IP-Adapter and its image encoder loaded.
        references: the m >= 1 reference images (PIL, or image files' paths), in the order their
            masses are numbered.
        config: the processors' configuration (default: observe, statistics on).
        judge: optional class judge, list of PIL images -> one label per image
            (e.g. :func:`nw_adapter.models.digits_quality.digit_judge`).
        seed: the generation's seed (``torch.Generator(pipe.device).manual_seed(seed)``).
        **call: further pipeline arguments (prompt, num_inference_steps, guidance_scale, ...); a
            ``callback_on_step_end`` of the caller's runs after the probe's.

    Returns:
        :class:`SupportSetRun`.

    Raises:
        ValueError: no references, a pipeline of a family whose row says it takes no support set
            (:attr:`~nw_adapter.integration.families.Family.support_sets`: SD 3.5), a call that
            passes its own IP-Adapter images or generator,
            ``num_inference_steps`` < 1, a swap config, a judge that does not return one label per
            image.
    """
    references = list(references)
    if not references:
        raise ValueError("observe_support_set: no reference image; pass a list of one or more images")
    family = family_of_pipeline(pipe)  # the registry's row says whether its pipeline takes a set
    if family.support_sets is not None:
        able = " or ".join(row.label for row in families_where(lambda row: row.support_sets is None))
        raise ValueError(
            f"observe_support_set: cannot run on {family.label}: {family.support_sets}; pass a {able} "
            "pipeline"
        )
    _check_call(call)
    config = config if config is not None else NWProcessorConfig(mode="observe")
    if config.mode != "observe":
        raise ValueError("observe_support_set observes; pass an observe config (mode='observe')")
    references = [reference_image(image, i) for i, image in enumerate(references)]  # a path opened
    space = latent_space(pipe)
    latents = encode_references(pipe, references, height=call.get("height"), width=call.get("width"))
    probe = LatentSupportProbe(pipe, latents, space)
    generator = torch.Generator(pipe.device).manual_seed(seed)
    with nw_processor(pipe, config) as recorder, probe:
        output = pipe(ip_adapter_image=[references], generator=generator, **_chained(probe, call))
    image = output.images[0]
    if not hasattr(image, "convert"):
        raise ValueError("observe_support_set compares images: leave output_type at 'pil'")
    embeddings, used = encode_images(pipe, [image, *references])
    cosine = torch.nn.functional.cosine_similarity(embeddings[:1], embeddings[1:]).clamp(-1.0, 1.0)
    records = recorder.to_records()
    judged = _judged(judge, [image, *references]) if judge is not None else None
    final = probe.final or {"distances": [], "latent": None}
    latent = None if final["latent"] is None else final["latent"][0]
    return SupportSetRun(
        image, records, cosine.tolist(), used, judged, support_steps(records, latent_rows=probe.rows),
        latent_steps=probe.rows, final_distances=final["distances"], final_latent=latent,
        probe_errors=probe.errors, references=references,
        settings={
            "model": getattr(pipe, "name_or_path", None), "seed": seed,
            "scheduler_class": type(pipe.scheduler).__name__, **_plain(call),
        },
    )  # fmt: skip
