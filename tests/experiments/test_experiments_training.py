"""Training: loss decreases, determinism under a seed, exact resume from a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from nw_adapter.experiments.model import ICFMConfig
from nw_adapter.experiments.tasks import GaussianMixtureFamily
from nw_adapter.experiments.training import (
    TrainConfig,
    flow_matching_batch,
    learning_rate,
    load_checkpoint,
    train,
)

MODEL = ICFMConfig(dim=2, d_model=16, num_heads=2, num_layers=1)


def cfg(**kw) -> TrainConfig:
    base = dict(steps=8, tasks_per_batch=4, targets_per_task=8, num_support=(3, 10), lr=3e-3, warmup_steps=2)
    base.update(kw)
    return TrainConfig(**base)


def test_flow_matching_batch_is_the_ot_path():
    fam = GaussianMixtureFamily(2)
    g = torch.Generator().manual_seed(0)
    tasks = fam.sample(3, 5, 6, generator=g)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    x_t, t, u = flow_matching_batch(tasks, g1, sigma_min=0.01, t_min=1e-5)
    x0 = torch.randn(tasks.target.shape, generator=g2)
    tt = t[..., None]
    torch.testing.assert_close(x_t, tt * tasks.target + (1 - 0.99 * tt) * x0)
    torch.testing.assert_close(u, tasks.target - 0.99 * x0)
    assert t.min() >= 1e-5 and t.max() <= 1


def test_loss_decreases():
    result = train(GaussianMixtureFamily(2), MODEL, cfg(steps=60, lr=1e-2, warmup_steps=5, tasks_per_batch=8))
    first, last = sum(result.losses[:10]) / 10, sum(result.losses[-10:]) / 10
    assert last < 0.7 * first


@pytest.mark.parametrize("exact_head", [False, True])
def test_deterministic_under_seed(exact_head):
    mc = ICFMConfig(dim=2, d_model=16, num_heads=2, num_layers=1, exact_head=exact_head)
    a = train(GaussianMixtureFamily(2), mc, cfg())
    b = train(GaussianMixtureFamily(2), mc, cfg())
    c = train(GaussianMixtureFamily(2), mc, cfg(seed=1))
    assert a.losses == b.losses
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert a.losses != c.losses


class Interrupting(GaussianMixtureFamily):
    """Raises on the ``fail_at``-th call of ``sample`` (simulates a killed run)."""

    def __init__(self, dim: int, fail_at: int) -> None:
        super().__init__(dim)
        self.calls, self.fail_at = 0, fail_at

    def sample(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyboardInterrupt
        return super().sample(*args, **kwargs)


def test_resume_gives_identical_continuation(tmp_path):
    fam = GaussianMixtureFamily(2)
    mc = ICFMConfig(dim=2, d_model=16, num_heads=2, num_layers=1, exact_head=True)
    straight = train(fam, mc, cfg(steps=10))
    ck = tmp_path / "ck"
    with pytest.raises(KeyboardInterrupt):
        train(Interrupting(2, fail_at=7), mc, cfg(steps=10, checkpoint_every=4), checkpoint_dir=ck)
    assert json.loads((ck / "state.json").read_text())["step"] == 4
    resumed = train(fam, mc, cfg(steps=10, checkpoint_every=4), checkpoint_dir=ck)
    assert resumed.resumed_from == 4 and resumed.step == 10
    assert resumed.losses == straight.losses
    for pa, pb in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert sorted(p.name for p in ck.glob("*.safetensors")) == [
        "model-10.safetensors",
        "optimizer-10.safetensors",
    ]
    model, opt, st = load_checkpoint(ck)
    assert st["step"] == 10 and len(opt.state) == len(list(model.parameters()))
    again = train(fam, mc, cfg(steps=10, checkpoint_every=4), checkpoint_dir=ck)  # finished: nothing to do
    assert again.resumed_from == 10 and again.losses == straight.losses


def test_learning_rate_schedule_and_validation():
    c = cfg(steps=100, warmup_steps=10, lr=1.0, final_lr_ratio=0.1)
    assert learning_rate(c, 0) == pytest.approx(0.1 * (0.1 + 0.9 * 1.0))
    assert learning_rate(c, 100) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="num_support"):
        cfg(num_support=(5, 2))
    with pytest.raises(ValueError, match="dim"):
        train(GaussianMixtureFamily(3), MODEL, cfg())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_training_and_evaluation_on_cuda_follow_the_cpu_run(tmp_path):
    """--device cuda: the same tasks and noise (drawn on the CPU, then moved), so the losses and the
    MMD^2 match the CPU run's up to float32 kernel differences; a CUDA checkpoint resumes on the CPU."""
    from nw_adapter.experiments.evaluation import EvalConfig, evaluate_methods
    from nw_adapter.experiments.fields import model_field

    fam = GaussianMixtureFamily(2)
    cpu = train(fam, MODEL, cfg(steps=6))
    gpu = train(fam, MODEL, cfg(steps=6), checkpoint_dir=tmp_path, device="cuda")
    assert next(gpu.model.parameters()).is_cuda
    assert gpu.losses == pytest.approx(cpu.losses, rel=1e-3)
    tasks = fam.sample(3, 10, 16, generator=torch.Generator().manual_seed(4))
    scores = {
        device: evaluate_methods(
            {"m": lambda s, mk, r=run: model_field(r.model, s, mk)}, tasks,
            EvalConfig(num_generated=16, grid_points=8, device=device),
        )["m"]["mmd2_median"]
        for device, run in (("cpu", cpu), ("cuda", gpu))
    }  # fmt: skip
    assert scores["cuda"] == pytest.approx(scores["cpu"], rel=1e-2, abs=1e-4)
    resumed = train(fam, MODEL, cfg(steps=8), checkpoint_dir=tmp_path, device="cpu")
    assert resumed.resumed_from == 6 and not next(resumed.model.parameters()).is_cuda
