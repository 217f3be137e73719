"""Measured quality of the trained tiny model: does a generation keep its reference's digit class?

A scikit-learn classifier (the *judge*, an RBF support-vector machine on the 8 x 8 features of
:func:`~nw_adapter.models.digits_data.digit_features`) is fitted on the ``judge`` split, which no
training stage saw. Each held-out ``reference`` image then prompts one generation (one reference
per pipeline call: ``StableDiffusionPipeline`` repeats ``ip_adapter_image_embeds`` over the batch,
so a batch of different references would mix them), and the judge labels it. The *agreement* is
the fraction of generations labelled with their reference's class; chance is 10% (the references
are balanced over the 10 classes). Its test against chance is the exact one-sided binomial test
over references (independent units: one reference, one seed, one generation each).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from nw_adapter.models.digits_data import DigitSplit, digit_features

__all__ = [
    "AgreementResult",
    "caption_epsilon_losses",
    "digit_judge",
    "fit_judge",
    "generate_from_references",
    "generate_one_per_call",
    "judge_agreement",
    "measure_agreement",
]

CHANCE = 0.1


@dataclass(frozen=True)
class AgreementResult:
    """Class agreement of generations with their references.

    Attributes:
        agreement: Fraction of generations the judge labels with the reference's class.
        agreed: Number of such generations.
        n: Number of references (one generation each).
        ci_low: Lower end of the exact (Clopper-Pearson) 95% interval of the agreement.
        ci_high: Upper end of that interval.
        p_above_chance: One-sided exact binomial test of ``agreement > 0.1`` over references.
        settings: Generation settings (IP scale, guidance, steps, prompt, seed).
        predicted: Judge label of every generation, in reference order.
    """

    agreement: float
    agreed: int
    n: int
    ci_low: float
    ci_high: float
    p_above_chance: float
    settings: dict
    predicted: list[int]

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


def fit_judge(judge: DigitSplit):
    """Fit the judge classifier (standardised features, RBF SVM) on the held-out ``judge`` split.

    Returns:
        A fitted scikit-learn estimator with ``predict(digit_features(images))``.
    """
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC

    return make_pipeline(StandardScaler(), SVC()).fit(digit_features(judge.images), judge.labels)


def digit_judge():
    """The judge as a callable on PIL images (what :func:`nw_adapter.analysis.consequence.compare_swap`
    takes): fitted by :func:`fit_judge` on the held-out ``judge`` split.

    Returns:
        A function: list of ``N`` PIL images (32 x 32, RGB) -> list of ``N`` predicted digits (int).

    Example:
        >>> judge = digit_judge()  # doctest: +SKIP
        >>> judge([tiny_digit_image(3)])  # doctest: +SKIP
        [3]
    """
    from nw_adapter.models.digits_data import load_digit_splits

    classifier = fit_judge(load_digit_splits()["judge"])

    def judge(images) -> list[int]:
        arrays = np.stack([np.asarray(image.convert("RGB"), dtype=np.uint8) for image in images])
        return [int(label) for label in classifier.predict(digit_features(arrays))]

    return judge


def generate_one_per_call(
    pipe,
    ip_adapter_images: Sequence,
    prompts: Sequence[str],
    *,
    steps: int,
    seed: int,
    call_kwargs: Mapping[str, Any] | None = None,
) -> np.ndarray:
    """Call ``pipe`` once per entry of ``ip_adapter_images`` and keep each call's one image.

    Call ``k`` gets ``prompt=prompts[k]``, ``ip_adapter_image=ip_adapter_images[k]`` (one PIL image,
    or a list of them for one adapter), ``num_inference_steps=steps``, the generator
    ``torch.Generator().manual_seed(seed + k)`` and ``call_kwargs``. The IP scale is the caller's.

    Returns:
        ``(len(ip_adapter_images), H, W, 3)`` uint8 generations (``round(255 clip(x, 0, 1))``).
    """
    outputs = []
    for index, (image, text) in enumerate(zip(ip_adapter_images, prompts, strict=True)):
        result = pipe(
            prompt=text,
            ip_adapter_image=image,
            num_inference_steps=steps,
            generator=torch.Generator().manual_seed(seed + index),
            output_type="np",
            **dict(call_kwargs or {}),
        )
        outputs.append((np.clip(result.images[0], 0.0, 1.0) * 255).round().astype(np.uint8))
    return np.stack(outputs)


def judge_agreement(judge, generated: np.ndarray, truth: np.ndarray, settings: dict) -> AgreementResult:
    """Label the generations with the judge and measure their agreement with ``truth``.

    Args:
        judge: The fitted judge (:func:`fit_judge`).
        generated: ``(n, H, W, 3)`` uint8 generations, one per independent unit.
        truth: ``(n,)`` the class each generation should show.
        settings: Generation settings stored with the result.

    Returns:
        The :class:`AgreementResult`: exact (Clopper-Pearson) 95% interval and one-sided exact
        binomial test of ``agreement > CHANCE`` over the ``n`` units.
    """
    from scipy.stats import binomtest

    predicted = judge.predict(digit_features(generated))
    agreed = int((predicted == truth).sum())
    n = len(truth)
    test = binomtest(agreed, n, CHANCE, alternative="greater")
    interval = binomtest(agreed, n).proportion_ci(confidence_level=0.95, method="exact")
    return AgreementResult(
        agreement=agreed / n,
        agreed=agreed,
        n=n,
        ci_low=float(interval.low),
        ci_high=float(interval.high),
        p_above_chance=float(test.pvalue),
        settings=settings,
        predicted=[int(p) for p in predicted],
    )


def generate_from_references(
    pipe,
    images: np.ndarray,
    *,
    ip_scale: float,
    guidance_scale: float,
    steps: int,
    prompt: str | Sequence[str] = "a photograph",
    seed: int = 0,
) -> np.ndarray:
    """One generation per reference image, each in its own pipeline call.

    Args:
        pipe: A ``StableDiffusionPipeline`` with the adapter loaded.
        images: ``(N, 32, 32, 3)`` uint8 reference images.
        ip_scale: IP-Adapter scale (``pipe.set_ip_adapter_scale``).
        guidance_scale: Classifier-free guidance (the negative is the empty prompt with a zero image
            embedding, as diffusers builds it).
        steps: Denoising steps.
        prompt: Text prompt (default: the correlate CLI's ``"a photograph"``), or one per reference.
        seed: Reference ``i`` is generated with ``torch.Generator().manual_seed(seed + i)``.

    Returns:
        ``(N, H, W, 3)`` uint8 generations.
    """
    from PIL import Image

    pipe.set_ip_adapter_scale(ip_scale)
    prompts = [prompt] * len(images) if isinstance(prompt, str) else list(prompt)
    if len(prompts) != len(images):
        raise ValueError(f"got {len(prompts)} prompts for {len(images)} references; pass one per reference")
    return generate_one_per_call(
        pipe,
        [Image.fromarray(image) for image in images],
        prompts,
        steps=steps,
        seed=seed,
        call_kwargs={"guidance_scale": guidance_scale},
    )


def measure_agreement(
    pipe,
    judge,
    references: DigitSplit,
    *,
    ip_scale: float = 1.0,
    guidance_scale: float = 7.5,
    steps: int = 25,
    prompt: str | Sequence[str] = "a photograph",
    seed: int = 0,
) -> AgreementResult:
    """Generate from every reference and measure the class agreement (see the module docstring).

    Returns:
        The :class:`AgreementResult`.
    """
    generated = generate_from_references(
        pipe,
        references.images,
        ip_scale=ip_scale,
        guidance_scale=guidance_scale,
        steps=steps,
        prompt=prompt,
        seed=seed,
    )
    settings = {
        "ip_scale": ip_scale,
        "guidance_scale": guidance_scale,
        "steps": steps,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "seed": seed,
    }
    return judge_agreement(judge, generated, references.labels, settings)


@torch.no_grad()
def caption_epsilon_losses(pipe, split: DigitSplit, *, seed: int = 0) -> dict[str, float]:
    """Stage 1's held-out epsilon loss with the right caption, a wrong digit's caption and ``""``.

    Every image of ``split`` is encoded (VAE posterior mean times ``scaling_factor``), noised once
    with a seeded ``eps`` and timestep ``t ~ U{0..999}``, and the UNet predicts ``eps`` three times
    from the same ``z_t``: conditioned on a caption of its digit (wording ``i mod 3`` for image
    ``i``), on the same wording for the next digit ``(y + 1) mod 10``, and on the empty prompt. A
    UNet that reads the caption has ``right < empty < wrong``; one that ignores it has all three
    equal. Same noise and timesteps for the three, so the differences are paired.

    Args:
        pipe: A ``StableDiffusionPipeline`` without an IP-Adapter loaded.
        split: Held-out digits (never seen in training), e.g. the ``judge`` split.
        seed: Seed of the noise and the timesteps.

    Returns:
        ``{"right": L, "wrong": L, "empty": L}``: mean squared errors over images and latent entries.
    """
    from nw_adapter.models.digits_data import class_captions, to_model_range
    from nw_adapter.models.tiny_digits import noise_scheduler

    device, dtype = pipe.device, pipe.unet.dtype
    images = to_model_range(split.images).to(device, pipe.vae.dtype)
    latents = pipe.vae.encode(images).latent_dist.mean.float().cpu() * pipe.vae.config.scaling_factor
    generator = torch.Generator().manual_seed(seed)  # on the CPU: the same draws on any device
    noise = torch.randn(latents.shape, generator=generator)
    timesteps = torch.randint(0, 1000, (len(latents),), generator=generator)
    noisy = noise_scheduler().add_noise(latents, noise, timesteps).to(device, dtype)
    labels = [int(label) for label in split.labels]
    prompts = {
        "right": [class_captions(label)[i % 3] for i, label in enumerate(labels)],
        "wrong": [class_captions((label + 1) % 10)[i % 3] for i, label in enumerate(labels)],
        "empty": [""] * len(labels),
    }
    losses = {}
    for name, texts in prompts.items():
        states = pipe.encode_prompt(texts, device, 1, False)[0]
        prediction = pipe.unet(noisy, timesteps.to(device), encoder_hidden_states=states).sample
        losses[name] = float(torch.nn.functional.mse_loss(prediction.float().cpu(), noise))
    return losses
