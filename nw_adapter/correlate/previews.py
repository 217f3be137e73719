"""What the model predicted at a step: the x0 estimate, captured without changing the generation.

At a denoising step the UNet sees x_t = alpha_t x0 + sigma_t eps (VP convention; for Euler-type
schedulers the UNet's input is already the VP-scaled latent) and predicts eps (or v, or x0).
With classifier-free guidance the prediction the scheduler uses is
eps = eps_uncond + g (eps_cond - eps_uncond). The estimate of the clean latent is

    x0 = (x_t - sigma_t eps) / alpha_t        (epsilon prediction)
    x0 = alpha_t x_t - sigma_t v              (v prediction)
    x0 = the output                           (sample prediction)

:class:`X0Previews` computes it in a UNet forward hook (which returns nothing, so the output and
the generation are unchanged, and draws no random numbers) at the steps asked for, keeps it on the
device, and decodes it with the pipeline's VAE after the run. alpha_t and sigma_t are the
recorder's noise level of the step (see :mod:`nw_adapter.integration.schedules`).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import torch


class X0Previews:
    """Capture x0 estimates at ``steps`` during a pipeline call (a context manager).

    Args:
        pipe: The diffusers pipeline (its ``unet``, ``vae``, ``scheduler``, ``image_processor``).
        recorder: The :class:`~nw_adapter.integration.recorder.NWRecorder` attached to the UNet
            (its ``state`` gives the step index, alpha_t and sigma_t of the current UNet call).
        steps: Step indices to capture (None: every step).

    Example:
        >>> with nw_processor(pipe, config) as rec, X0Previews(pipe, rec, steps=[0, 49]) as x0:
        ...     image = pipe(...).images[0]
        >>> previews = x0.images()  # {step: PIL image}
    """

    def __init__(self, pipe: Any, recorder: Any, steps: Collection[int] | None = None) -> None:
        self.pipe = pipe
        self.recorder = recorder
        self.steps = None if steps is None else set(steps)
        self.latents: dict[int, torch.Tensor] = {}
        self.failed = False  # a capture raised; that step's preview is missing
        self._handle: Any = None

    def __enter__(self) -> X0Previews:
        self._handle = self.pipe.unet.register_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        try:
            self._capture(args, kwargs, output)
        except Exception:  # noqa: BLE001 - a preview must never fail a generation; it is just missing
            self.failed = True

    def _capture(self, args: tuple, kwargs: dict, output: Any) -> None:
        state = self.recorder.state
        if self.steps is not None and state.step not in self.steps:
            return
        alpha, sigma = float(state.alpha), float(state.sigma)
        if not (math.isfinite(alpha) and math.isfinite(sigma) and alpha > 0):
            return
        sample = kwargs["sample"] if "sample" in kwargs else args[0]
        prediction = output[0] if isinstance(output, tuple) else output.sample
        with torch.no_grad():
            x_t = sample[-1:].float()
            pred = prediction.float()
            if bool(getattr(self.pipe, "do_classifier_free_guidance", False)) and pred.shape[0] >= 2:
                uncond, cond = pred.chunk(2)
                pred = uncond + float(self.pipe.guidance_scale) * (cond - uncond)
            pred = pred[-1:]
            kind = getattr(self.pipe.scheduler.config, "prediction_type", "epsilon")
            if kind == "v_prediction":
                x0 = alpha * x_t - sigma * pred
            elif kind == "sample":
                x0 = pred
            else:
                x0 = (x_t - sigma * pred) / alpha
        self.latents[state.step] = x0.detach()

    @torch.no_grad()
    def images(self) -> dict[int, Any]:
        """Decode the captured latents with the pipeline's VAE: ``{step: PIL image}``."""
        vae = self.pipe.vae
        scaling = getattr(vae.config, "scaling_factor", 1.0) or 1.0
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        out = {}
        for step, x0 in sorted(self.latents.items()):
            latents = (x0 / scaling + shift).to(dtype=vae.dtype, device=vae.device)
            decoded = vae.decode(latents, return_dict=False)[0]
            out[step] = self.pipe.image_processor.postprocess(decoded, output_type="pil")[0]
        return out
