"""x0 previews: the estimate (x_t - sigma eps) / alpha from a forward hook that changes nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nw_adapter.correlate.previews import X0Previews


class FakeUNet(torch.nn.Module):
    """Returns a fixed prediction for a [uncond; cond] batch, as a tuple (return_dict=False)."""

    def __init__(self, prediction: torch.Tensor, as_tuple: bool = True) -> None:
        super().__init__()
        self.prediction, self.as_tuple = prediction, as_tuple

    def forward(self, sample, timestep):
        return (self.prediction,) if self.as_tuple else "not a prediction"


def fake_pipe(unet, *, kind="epsilon", cfg=True, scale=7.5):
    return SimpleNamespace(
        unet=unet,
        scheduler=SimpleNamespace(config=SimpleNamespace(prediction_type=kind)),
        do_classifier_free_guidance=cfg,
        guidance_scale=scale,
    )


def recorder(step, alpha, sigma):
    return SimpleNamespace(state=SimpleNamespace(step=step, alpha=alpha, sigma=sigma))


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction", "sample"])
def test_x0_estimate_of_the_guided_prediction(kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 8, 8, generator=gen).repeat(2, 1, 1, 1)
    pred = torch.randn(2, 4, 8, 8, generator=gen)
    unet = FakeUNet(pred)
    alpha, sigma, g = 0.6, 0.8, 7.5
    with X0Previews(fake_pipe(unet, kind=kind, scale=g), recorder(3, alpha, sigma), steps=[3]) as previews:
        out = unet(x, 500)
    assert out[0] is pred  # the output is untouched
    guided = pred[0:1] + g * (pred[1:2] - pred[0:1])
    expected = {
        "epsilon": (x[1:] - sigma * guided) / alpha,
        "v_prediction": alpha * x[1:] - sigma * guided,
        "sample": guided,
    }[kind]
    torch.testing.assert_close(previews.latents[3], expected)
    assert unet._forward_hooks == {}  # removed on exit


def test_other_steps_are_not_captured_and_failures_never_reach_the_generation() -> None:
    unet = FakeUNet(torch.zeros(2, 4, 8, 8))
    with X0Previews(fake_pipe(unet), recorder(1, 0.6, 0.8), steps=[3]) as previews:
        unet(torch.zeros(2, 4, 8, 8), 500)
    assert previews.latents == {} and not previews.failed
    broken = FakeUNet(torch.zeros(2, 4, 8, 8), as_tuple=False)
    with X0Previews(fake_pipe(broken), recorder(3, 0.6, 0.8)) as previews:
        assert broken(torch.zeros(2, 4, 8, 8), 500) == "not a prediction"
    assert previews.failed and previews.latents == {}


# ---------------------------------------------------------------- flow matching (SD 3.5, Flux)


def test_unpacking_matches_the_flux_pipeline() -> None:
    from diffusers import FluxPipeline

    from nw_adapter.correlate.previews import unpack_flux_latents

    packed = torch.randn(2, 6 * 4, 4 * 3, generator=torch.Generator().manual_seed(0))  # 6 x 4 tokens, C = 3
    expected = FluxPipeline._unpack_latents(packed, height=96, width=64, vae_scale_factor=8)
    assert torch.equal(unpack_flux_latents(packed, (6, 4)), expected)


class FakeTransformer(torch.nn.Module):
    """Returns the prediction of each forward in turn, as diffusers' transformers do (a tuple)."""

    def __init__(self, *predictions: torch.Tensor) -> None:
        super().__init__()
        self.predictions = list(predictions)

    def forward(self, hidden_states, timestep, img_ids=None):
        return (self.predictions.pop(0),)


def flow_pipe(transformer, *, cfg=False, scale=7.0):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return SimpleNamespace(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        do_classifier_free_guidance=cfg,
        guidance_scale=scale,
    )


def flow_state(step, s, pass_index=0):
    return SimpleNamespace(state=SimpleNamespace(step=step, alpha=1.0 - s, sigma=s, pass_index=pass_index))


@pytest.mark.parametrize("s", [1.0, 0.4])  # s = 1 (alpha = 0) too: x0 = x_t - v needs no division
def test_flow_x0_is_x_minus_s_v_of_the_guided_velocity(s: float) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 8, 8, generator=gen).repeat(2, 1, 1, 1)
    v = torch.randn(2, 4, 8, 8, generator=gen)
    model = FakeTransformer(v)
    with X0Previews(flow_pipe(model, cfg=True, scale=5.0), flow_state(0, s)) as previews:
        model(hidden_states=x, timestep=s)
    guided = v[0:1] + 5.0 * (v[1:2] - v[0:1])
    torch.testing.assert_close(previews.latents[0], x[1:] - s * guided)


def test_flux_true_cfg_combines_the_positive_and_negative_passes_and_unpacks() -> None:
    from nw_adapter.correlate.previews import unpack_flux_latents

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 3 * 2, 8, generator=gen)  # 3 x 2 tokens of 2 x 2 patches, C = 2
    positive, negative = torch.randn(2, 1, 6, 8, generator=gen)
    ids = torch.stack(torch.meshgrid(torch.arange(3), torch.arange(2), indexing="ij"), -1).reshape(6, 2)
    ids = torch.cat([torch.zeros(6, 1), ids.float()], dim=1)  # Flux's img_ids: (0, row, column)
    model = FakeTransformer(positive, negative)
    state = flow_state(1, 0.5)
    with X0Previews(flow_pipe(model), state, true_cfg_scale=4.0) as previews:
        model(hidden_states=x, timestep=0.5, img_ids=ids)
        first = previews.latents[1].clone()
        state.state.pass_index = 1
        model(hidden_states=x, timestep=0.5, img_ids=ids)
    torch.testing.assert_close(first, unpack_flux_latents(x - 0.5 * positive, (3, 2)))
    guided = negative + 4.0 * (positive - negative)
    torch.testing.assert_close(previews.latents[1], unpack_flux_latents(x - 0.5 * guided, (3, 2)))
    assert previews.latents[1].shape == (1, 2, 6, 4) and not previews.failed


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_last_step_estimate_is_the_pipelines_final_latent(family, request) -> None:
    """Flow-matching Euler's last step goes to s = 0: x_next = x_t - s v is exactly the x0 estimate,
    so the captured estimate must equal the latents the pipeline returns (guidance included)."""
    from diffusers import FluxPipeline, StableDiffusion3Pipeline
    from flow_helpers import SIZE, load_flux, load_sd3
    from tiny_helpers import random_image

    from nw_adapter.integration.config import NWProcessorConfig
    from nw_adapter.integration.mixin import nw_processor

    model, adapter = (request.getfixturevalue(f"tiny_{family}{s}_dir") for s in ("", "_ip_adapter"))
    if family == "flux":
        pipe = load_flux(FluxPipeline, model, adapter)
        extra = {"true_cfg_scale": 3.0, "negative_prompt": "blurry", "max_sequence_length": 16}
    else:
        pipe = load_sd3(StableDiffusion3Pipeline, model, adapter)
        extra = {"guidance_scale": 4.0}
    with (
        nw_processor(pipe, NWProcessorConfig()) as rec,
        X0Previews(pipe, rec, true_cfg_scale=extra.get("true_cfg_scale", 1.0)) as previews,
    ):
        out = pipe(
            "a cat", ip_adapter_image=random_image(1, SIZE), num_inference_steps=2, height=SIZE, width=SIZE,
            output_type="latent", generator=torch.Generator().manual_seed(0), **extra,
        ).images  # fmt: skip
    if family == "flux":
        out = FluxPipeline._unpack_latents(out, SIZE, SIZE, pipe.vae_scale_factor)
    assert sorted(previews.latents) == [0, 1] and not previews.failed
    torch.testing.assert_close(previews.latents[1], out.float(), rtol=1e-5, atol=1e-5)
    assert (previews.latents[0] - out).abs().max() > 1e-3  # step 0's estimate differs (> 100 x tol)
