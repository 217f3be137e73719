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
