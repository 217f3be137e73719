"""What the model predicted at a step: the x0 estimate, captured without changing the generation.

At a denoising step the denoiser (SD 1.5 / SDXL's UNet, SD 3.5's or Flux's transformer) sees
x_t and predicts the quantity its scheduler steps with. With classifier-free guidance that is the
guided prediction p = p_uncond + g (p_cond - p_uncond) (UNet and SD 3.5: one [uncond; cond] batch;
Flux's true CFG: a positive pass, then a negative one, p = p_neg + g_true (p_pos - p_neg)). The
estimate of the clean latent is

    x0 = (x_t - sigma_t eps) / alpha_t        (UNet, epsilon prediction; x_t = alpha_t x0 + sigma_t eps)
    x0 = alpha_t x_t - sigma_t v              (UNet, v prediction)
    x0 = the output                           (UNet, sample prediction)
    x0 = x_t - s v                            (flow matching: x_t = (1 - s) x0 + s eps, v = eps - x0)

where for flow matching alpha_t = 1 - s and sigma_t = s, so the last line is x_t - sigma_t v (also
at s = 1, where alpha_t = 0). Flux denoises packed latents ``[B, (H/2)(W/2), 4C]`` (2 x 2 latent
patches); the estimate is unpacked to ``[B, C, H, W]`` on the grid of the transformer's
``img_ids`` before decoding, as the pipeline does with its final latents.

:class:`X0Previews` computes it in a denoiser forward hook (which returns nothing, so the output
and the generation are unchanged, and draws no random numbers) at the steps asked for, keeps it
on the device, and decodes it with the pipeline's VAE after the run (``latents / scaling_factor +
shift_factor``). alpha_t and sigma_t are the recorder's noise level of the step (see
:mod:`nw_adapter.integration.schedules`).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import torch

from nw_adapter.integration.schedules import is_flow_matching


def denoiser_of(pipe: Any) -> torch.nn.Module:
    """The pipeline's denoiser: ``pipe.unet`` (SD 1.5 / SDXL) or ``pipe.transformer`` (SD 3.5, Flux).

    Raises:
        ValueError: The pipeline has neither.
    """
    for name in ("unet", "transformer"):
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise ValueError(
        f"X0Previews: {type(pipe).__name__} has no unet or transformer; pass a diffusers "
        "Stable Diffusion, SD 3.5 or Flux pipeline"
    )


def unpack_flux_latents(packed: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Flux's packed latents ``[B, gh * gw, 4 C]`` as ``[B, C, 2 gh, 2 gw]``.

    Token ``(y, x)`` of the ``gh x gw`` grid (row-major) holds the 2 x 2 latent patch at rows
    ``2y, 2y + 1`` and columns ``2x, 2x + 1``, its features ordered (channel, patch row, patch
    column): ``out[b, c, 2y + i, 2x + j] = packed[b, y * gw + x, 4c + 2i + j]``.
    """
    batch, tokens, features = packed.shape
    gh, gw = grid
    if gh * gw != tokens or features % 4:
        raise ValueError(f"unpack_flux_latents: {tokens} tokens of {features} features do not fill {grid}")
    patches = packed.reshape(batch, gh, gw, features // 4, 2, 2)
    return patches.permute(0, 3, 1, 4, 2, 5).reshape(batch, features // 4, 2 * gh, 2 * gw)


def _token_grid(kwargs: dict, tokens: int) -> tuple[int, int]:
    """``(gh, gw)`` of Flux's image tokens, from ``img_ids`` (columns 1, 2: row, column); square
    when they are not given."""
    ids = kwargs.get("img_ids")
    if isinstance(ids, torch.Tensor) and ids.shape[-1] >= 3 and ids.shape[-2] == tokens:
        rows = ids.reshape(-1, ids.shape[-1])[:tokens]
        return int(rows[:, 1].max()) + 1, int(rows[:, 2].max()) + 1
    side = math.isqrt(tokens)
    return side, tokens // max(side, 1)


class X0Previews:
    """Capture x0 estimates at ``steps`` during a pipeline call (a context manager).

    Args:
        pipe: The diffusers pipeline (its ``unet`` or ``transformer``, ``vae``, ``scheduler``,
            ``image_processor``).
        recorder: The :class:`~nw_adapter.integration.recorder.NWRecorder` attached to the
            denoiser (its ``state`` gives the step index, the pass within the step, alpha_t and
            sigma_t of the current forward).
        steps: Step indices to capture (None: every step).
        true_cfg_scale: Flux's ``true_cfg_scale`` of the call (used when a step has a second,
            negative pass).

    Example:
        >>> with nw_processor(pipe, config) as rec, X0Previews(pipe, rec, steps=[0, 49]) as x0:
        ...     image = pipe(...).images[0]
        >>> previews = x0.images()  # {step: PIL image}
    """

    def __init__(
        self,
        pipe: Any,
        recorder: Any,
        steps: Collection[int] | None = None,
        *,
        true_cfg_scale: float = 1.0,
    ) -> None:
        self.pipe = pipe
        self.recorder = recorder
        self.steps = None if steps is None else set(steps)
        self.true_cfg_scale = float(true_cfg_scale)
        self.latents: dict[int, torch.Tensor] = {}
        self.failed = False  # a capture raised; that step's preview is missing
        self._handle: Any = None
        self._positive: dict[int, torch.Tensor] = {}  # step -> the positive pass's prediction

    def __enter__(self) -> X0Previews:
        self._handle = denoiser_of(self.pipe).register_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._positive.clear()

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
        flow = is_flow_matching(self.pipe.scheduler)
        if not (math.isfinite(alpha) and math.isfinite(sigma) and (flow or alpha > 0)):
            return
        for name in ("sample", "hidden_states"):
            if name in kwargs:
                sample = kwargs[name]
                break
        else:
            sample = args[0]
        prediction = output[0] if isinstance(output, tuple) else output.sample
        with torch.no_grad():
            x_t = sample[-1:].float()
            pred = prediction.float()
            if bool(getattr(self.pipe, "do_classifier_free_guidance", False)) and pred.shape[0] >= 2:
                uncond, cond = pred.chunk(2)
                pred = uncond + float(self.pipe.guidance_scale) * (cond - uncond)
            pred = pred[-1:]
            if flow:
                x0 = self._flow_x0(state, x_t, pred, sigma)
                if x0 is None:
                    return
                if x_t.ndim == 3:  # Flux's packed tokens
                    x0 = unpack_flux_latents(x0, _token_grid(kwargs, x0.shape[1]))
            else:
                kind = getattr(self.pipe.scheduler.config, "prediction_type", "epsilon")
                if kind == "v_prediction":
                    x0 = alpha * x_t - sigma * pred
                elif kind == "sample":
                    x0 = pred
                else:
                    x0 = (x_t - sigma * pred) / alpha
        self.latents[state.step] = x0.detach()

    def _flow_x0(
        self, state: Any, x_t: torch.Tensor, pred: torch.Tensor, sigma: float
    ) -> torch.Tensor | None:
        """x0 = x_t - s v of the step's first pass; with Flux's true CFG (``true_cfg_scale > 1``)
        the negative pass (pass 1) replaces it with v = v_neg + g_true (v_pos - v_neg). Other
        further passes (e.g. SD 3.5's skip-layer guidance) leave it as it is (None)."""
        pass_index = int(getattr(state, "pass_index", 0))
        if pass_index == 0:
            if self.true_cfg_scale > 1:
                self._positive[state.step] = pred
        elif pass_index == 1 and state.step in self._positive:
            positive = self._positive.pop(state.step)
            pred = pred + self.true_cfg_scale * (positive - pred)
        else:
            return None
        return x_t - sigma * pred

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
