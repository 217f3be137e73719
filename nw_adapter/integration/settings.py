"""The settings of a run that change what its readings mean, and their digest in every record.

Two runs' records pool into one sample (the verdict's reference images) only when every reading
means the same thing in both: the same NW weights compared with, the same layers, heads and steps
averaged, the same noise schedule, the same controls. Each record carries the digest of these
settings (the record field :data:`SETTINGS_FIELD`), so the verdict can refuse records of different
settings and name the settings that differ.

The digest is :data:`FIELD_HEX` hex digits of SHA-256 per setting, in :data:`SETTINGS` order
(``len(SETTINGS) * FIELD_HEX`` characters): comparing two digests chunk by chunk names the
settings that differ without storing their values in every record. A setting that is not known
(a recorder driven without a pipeline) digests as unknown (``None``); two runs that both do not
know it agree on it.

Left out, with the reason: ``mode`` (a record field of its own, which the verdict checks first);
``seed`` (the nulls' random numbers: another draw of the same null, not another null); maps
(``store_maps`` and ``map_*``: stored beside the readings, which they do not change);
``chunk_size``, ``compile`` and how the statistics are scheduled (the same readings within float32
rounding); the prompt, the generator and the reference image (what a reference image is, its unit
of the sample, not a setting of the run).

Plain Python (no torch): the verdict reads the digests of a saved ``rho.json``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SETTINGS_FIELD = "settings"
"""The record field holding the digest of :func:`settings_digest`."""

SETTINGS: dict[str, str] = {
    "bandwidth": "the rule or value of h (and schedule_c): the NW weights every reading is compared with",
    "layers": "the layers whose readings the means over layers average",
    "heads": "the heads whose readings the means over heads average",
    "recorded_steps": "the steps recorded: the means over steps and the slopes over log h",
    "cfg": "whether the batch is [uncond; cond]: which rows are the cond half",
    "nulls": "whether the nulls are computed, and on how many query rows",
    "readings": "whether the readings are computed, and on how many rows h_eff is fitted",
    "control": "the scale-matched control: on or off, its draws K and their seed (draw k is one "
    "untrained adapter for every reference only with the same seed)",
    "num_inference_steps": "the number of denoising steps: the noise level of each step index",
    "start_step": "the step the call's loop began at (img2img and inpainting strength, SDXL "
    "denoising_start): the latents of every later step come from a noised input, not pure noise, "
    "and the means over steps average the steps from there",
    "scheduler": "the scheduler's class and configuration: its timesteps and noise levels",
    "guidance_scale": "the classifier-free guidance scale: the latents the queries come from",
    "ip_adapter_scale": "the IP-Adapter scale(s) of the recorded layers: the image branch's weight",
    "resolution": "the latent height and width: the query rows every reading averages",
}
"""The settings digested, in digest order, each with why it changes what a reading means."""

FIELD_HEX = 4
"""Hex digits of SHA-256 per setting (16 bits: two different values of one setting share them with
probability 1/65536)."""

DIGEST_LENGTH = len(SETTINGS) * FIELD_HEX
"""Characters of a digest of this version."""


def _canonical(value: Any) -> str:
    """One text per value: JSON with sorted keys, tuples as lists, anything else by ``str``."""
    return json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))


def settings_digest(values: Mapping[str, Any]) -> str:
    """The digest of ``values``: per setting of :data:`SETTINGS`, ``FIELD_HEX`` hex digits of
    ``SHA-256("<name>=<canonical JSON of the value>")`` (a missing setting counts as None).

    Example:
        >>> len(settings_digest({"bandwidth": ["matched", 1.0]})) == DIGEST_LENGTH
        True
    """
    chunks = []
    for name in SETTINGS:
        text = f"{name}={_canonical(values.get(name))}"
        chunks.append(hashlib.sha256(text.encode()).hexdigest()[:FIELD_HEX])
    return "".join(chunks)


def differing_settings(digests: Sequence[str]) -> list[str]:
    """The settings whose chunks differ among ``digests`` (in :data:`SETTINGS` order).

    A digest of another length (another version's list of settings) cannot be compared chunk by
    chunk: the answer is then ``["the list of settings (recorded by different versions)"]``.
    """
    if len({len(d) for d in digests}) > 1 or any(len(d) != DIGEST_LENGTH for d in digests):
        return ["the list of settings (recorded by different versions)"]
    found = []
    for index, name in enumerate(SETTINGS):
        chunk = slice(index * FIELD_HEX, (index + 1) * FIELD_HEX)
        if len({d[chunk] for d in digests}) > 1:
            found.append(name)
    return found


def config_settings(config: Any) -> dict[str, Any]:
    """The settings of :data:`SETTINGS` an :class:`~nw_adapter.integration.config.NWProcessorConfig`
    fixes (validated values: tuples, floats)."""
    return {
        "bandwidth": [config.bandwidth, config.schedule_c],
        "layers": config.layers,
        "heads": config.heads,
        "recorded_steps": config.steps,
        "cfg": config.cfg,
        "nulls": [config.nulls, config.null_rows],
        "readings": [config.readings, config.fit_rows],
        "control": [config.untrained_control, config.untrained_draws, config.untrained_seed]
        if config.untrained_control
        else [False],
    }


def _number(value: Any) -> float | int | None:
    """A plain number from ``value`` (a Python or 0-d tensor number); None when it is not one."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = value.item() if hasattr(value, "item") else value
    except Exception:  # noqa: BLE001 - a value that cannot be read is unknown
        return None
    return number if isinstance(number, int | float) and not isinstance(number, bool) else None


def call_settings(
    pipe: Any, latent_hw: Sequence[int] | None, start_step: int | None = None
) -> dict[str, Any]:
    """The settings of :data:`SETTINGS` a pipeline call fixes, read once when the call begins.

    Args:
        pipe: the pipeline (its ``scheduler`` after ``set_timesteps``, its ``guidance_scale``
            while the call runs); None: nothing is known.
        latent_hw: the latents' height and width at the call's first denoiser forward.
        start_step: the step index of that forward in ``scheduler.timesteps`` (> 0 for
            ``strength < 1``); None where the scheduler's table does not give it.

    Returns:
        ``num_inference_steps`` (the scheduler's, else the length of its timesteps),
        ``scheduler`` (class name and public configuration), ``guidance_scale`` and
        ``resolution`` and ``start_step``; each None where the pipeline does not say.
    """
    scheduler = getattr(pipe, "scheduler", None)
    steps = _number(getattr(scheduler, "num_inference_steps", None))
    if steps is None and getattr(scheduler, "timesteps", None) is not None:
        try:
            steps = len(scheduler.timesteps)
        except TypeError:
            steps = None
    described = None
    if scheduler is not None:
        config = getattr(scheduler, "config", None) or {}
        public = {str(k): v for k, v in dict(config).items() if not str(k).startswith("_")}
        described = [type(scheduler).__name__, public]
    try:
        guidance = _number(getattr(pipe, "guidance_scale", None)) if pipe is not None else None
    except Exception:  # noqa: BLE001 - a property that needs a running call: unknown
        guidance = None
    return {
        "num_inference_steps": steps,
        "scheduler": described,
        "guidance_scale": guidance,
        "resolution": None if latent_hw is None else [int(x) for x in latent_hw],
        "start_step": start_step,
    }


def scale_settings(scales: Iterable[float]) -> dict[str, Any]:
    """``ip_adapter_scale``: the distinct scales of a call's recorded layers, sorted (None: none)."""
    found = sorted({float(s) for s in scales})
    return {"ip_adapter_scale": found or None}
