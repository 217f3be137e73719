"""Flow-matching training of :class:`~nw_adapter.experiments.model.ICFMModel` on fresh tasks.

Loss (OT path with sigma_min, THEORY.md section 5): for a task with support S and a target
x1, noise x0 ~ N(0, I) and t ~ U[t_min, 1],

    x_t = t x1 + (1 - (1 - sigma_min) t) x0,     u = x1 - (1 - sigma_min) x0,
    L = E || v_theta(x_t, t, S) - u ||^2  (mean over tasks, targets and coordinates).

Every step draws new tasks from a generator seeded by ``(seed, step)`` only, so a run
resumed from a checkpoint continues exactly as an uninterrupted one (model, AdamW state and
step are restored; the learning rate is a function of the step).

Checkpoint layout (``directory/``): ``model-<step>.safetensors``,
``optimizer-<step>.safetensors`` and ``state.json`` (configs, step, loss history, AdamW
hyper-parameters), which is replaced atomically last and names the current step.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from nw_adapter.atomic import atomic_write, atomic_write_json
from nw_adapter.experiments.model import ICFMConfig, ICFMModel
from nw_adapter.experiments.tasks import TaskBatch, TaskFamily, support_size_range

__all__ = [
    "TrainConfig",
    "TrainResult",
    "build_model",
    "flow_matching_batch",
    "step_generator",
    "learning_rate",
    "train",
    "save_checkpoint",
    "load_checkpoint",
    "loss_plateau",
    "PLATEAU_WINDOW",
]

#: Share of the last training steps over which the convergence criterion looks for a trend.
PLATEAU_WINDOW = 0.2
#: Converged = the fitted decrease over the window is below this share of the loss, with 95% confidence.
PLATEAU_TOLERANCE = 0.02


@dataclass
class TrainConfig:
    """Training hyper-parameters.

    Attributes:
        steps: Optimiser steps.
        tasks_per_batch: Tasks per step (paper 256).
        targets_per_task: Target points per task (paper 256).
        num_support: m, or an inclusive range (lo, hi) for ragged support sets.
        lr: Peak AdamW learning rate (linear warm-up, cosine decay to ``lr * final_lr_ratio``).
        weight_decay: AdamW weight decay.
        warmup_steps: Linear warm-up length.
        final_lr_ratio: Final learning rate as a fraction of ``lr``.
        grad_clip: Gradient-norm clip (0 = none).
        sigma_min: OT path sigma_min.
        t_min: Lower end of t ~ U[t_min, 1].
        seed: Seed of the initialisation and of the task stream.
        checkpoint_every: Save a checkpoint every this many steps (0 = only at the end).
    """

    steps: int = 1000
    tasks_per_batch: int = 32
    targets_per_task: int = 64
    num_support: int | tuple[int, int] = 50
    lr: float = 1e-3
    weight_decay: float = 1e-4
    warmup_steps: int = 50
    final_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    sigma_min: float = 0.01
    t_min: float = 1e-5
    seed: int = 0
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.num_support, list):
            self.num_support = tuple(self.num_support)
        support_size_range(self.num_support)
        for name in ("steps", "tasks_per_batch", "targets_per_task"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.lr <= 0 or self.warmup_steps < 0 or self.checkpoint_every < 0:
            raise ValueError("lr must be > 0, warmup_steps and checkpoint_every >= 0.")
        if not 0.0 <= self.t_min < 1.0 or not 0.0 <= self.sigma_min < 1.0:
            raise ValueError(f"t_min={self.t_min} and sigma_min={self.sigma_min} must be in [0, 1).")


@dataclass
class TrainResult:
    """Outcome of :func:`train`: the model, the per-step losses and the step reached."""

    model: ICFMModel
    losses: list[float] = field(default_factory=list)
    step: int = 0
    resumed_from: int = 0


def build_model(config: ICFMConfig, seed: int) -> ICFMModel:
    """Build a model with weights drawn from ``seed`` (the global RNG state is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ICFMModel(config)


def step_generator(seed: int, step: int) -> torch.Generator:
    """Generator of the tasks, noise and times of one training step: seeded by (seed, step)."""
    return torch.Generator().manual_seed(2_147_483_647 * int(seed) + 104_729 * int(step) + 3)


def learning_rate(config: TrainConfig, step: int) -> float:
    """lr(step) = lr * min(1, (step + 1) / warmup) * (r + (1 - r)(1 + cos(pi step / steps)) / 2)."""
    warm = min(1.0, (step + 1) / config.warmup_steps) if config.warmup_steps else 1.0
    r = config.final_lr_ratio
    cos = 0.5 * (1.0 + math.cos(math.pi * min(step, config.steps) / config.steps))
    return config.lr * warm * (r + (1.0 - r) * cos)


def flow_matching_batch(
    tasks: TaskBatch, generator: torch.Generator, *, sigma_min: float, t_min: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Points on the OT path and their regression targets.

    Args:
        tasks: Batch whose ``target [B, n, d]`` are the x1 samples.
        generator: Source of x0 and t.
        sigma_min: Path sigma_min.
        t_min: t ~ U[t_min, 1].

    Returns:
        ``x_t [B, n, d]``, ``t [B, n]``, ``u [B, n, d]`` with x_t = t x1 + (1 - (1 - sigma_min) t) x0
        and u = x1 - (1 - sigma_min) x0.
    """
    x1 = tasks.target
    x0 = torch.randn(x1.shape, generator=generator)
    t = t_min + (1.0 - t_min) * torch.rand(x1.shape[:-1], generator=generator)
    tt = t[..., None]
    x_t = tt * x1 + (1.0 - (1.0 - sigma_min) * tt) * x0
    return x_t, t, x1 - (1.0 - sigma_min) * x0


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], list[dict]]:
    sd = optimizer.state_dict()
    tensors = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            tensors[f"{idx}.{name}"] = torch.as_tensor(value).detach().cpu().clone().contiguous()
    return tensors, sd["param_groups"]


def save_checkpoint(
    directory: str | Path,
    model: ICFMModel,
    optimizer: torch.optim.Optimizer,
    step: int,
    train_config: TrainConfig,
    losses: list[float],
) -> Path:
    """Save model, AdamW state and progress; ``state.json`` is replaced atomically last.

    Returns:
        The path of ``state.json``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state_path = directory / "state.json"
    previous = json.loads(state_path.read_text())["step"] if state_path.exists() else None
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    for name, tensors in (("model", weights), ("optimizer", _optimizer_tensors(optimizer)[0])):
        atomic_write(directory / f"{name}-{step}.safetensors", lambda tmp, t=tensors: save_file(t, str(tmp)))
    atomic_write_json(
        state_path,
        {
            "step": step,
            "model_config": model.config.to_dict(),
            "train_config": asdict(train_config),
            "param_groups": _optimizer_tensors(optimizer)[1],
            "losses": losses,
        },
    )
    if previous is not None and previous != step:
        for name in ("model", "optimizer"):
            (directory / f"{name}-{previous}.safetensors").unlink(missing_ok=True)
    return state_path


def load_checkpoint(
    directory: str | Path, device: str | torch.device = "cpu"
) -> tuple[ICFMModel, torch.optim.Optimizer, dict]:
    """Load a checkpoint written by :func:`save_checkpoint`.

    Args:
        directory: Checkpoint folder.
        device: Device of the model and of the optimizer state (checkpoints are device-free).

    Returns:
        ``(model, optimizer, state)`` where ``state`` is the parsed ``state.json``.
    """
    directory = Path(directory)
    state_path = directory / "state.json"
    if not state_path.exists():
        raise ValueError(f"{str(directory)!r} has no state.json; pass a folder written by save_checkpoint.")
    state = json.loads(state_path.read_text())
    step = state["step"]
    model = ICFMModel(ICFMConfig(**state["model_config"]))
    model.load_state_dict(load_file(str(directory / f"model-{step}.safetensors")))
    model.to(device)
    optimizer = _make_optimizer(model, TrainConfig(**state["train_config"]))
    flat = load_file(str(directory / f"optimizer-{step}.safetensors"))
    opt_state: dict[int, dict[str, Tensor]] = {}
    for key, value in flat.items():
        idx, name = key.split(".", 1)
        opt_state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": opt_state, "param_groups": state["param_groups"]})
    return model, optimizer, state


def _make_optimizer(model: ICFMModel, config: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)


def train(
    family: TaskFamily,
    model_config: ICFMConfig,
    config: TrainConfig,
    *,
    checkpoint_dir: str | Path | None = None,
    progress: bool = False,
    description: str = "train",
    device: str | torch.device = "cpu",
) -> TrainResult:
    """Train an ICFM model on tasks drawn fresh from ``family`` at every step.

    When ``checkpoint_dir`` holds a checkpoint, training resumes from it (identical
    continuation); checkpoints are written every ``config.checkpoint_every`` steps and at the end.

    Args:
        family: Task family (its ``dim`` must equal ``model_config.dim``).
        model_config: Model hyper-parameters.
        config: Training hyper-parameters.
        checkpoint_dir: Folder for resumable checkpoints, or None.
        progress: Show a tqdm bar.
        description: tqdm label.
        device: Device of the model and of each step's batch. Tasks, noise and times are drawn
            on the CPU from the step's generator and then moved, so the data stream is the same
            on every device (a run may resume on another device).

    Returns:
        The trained model (eval mode), the loss of every step and the step reached.
    """
    if family.dim != model_config.dim:
        raise ValueError(f"family dim {family.dim} != model_config.dim {model_config.dim}; make them equal.")
    start, losses = 0, []
    state_file = None if checkpoint_dir is None else Path(checkpoint_dir) / "state.json"
    if state_file is not None and state_file.exists():
        model, optimizer, state = load_checkpoint(checkpoint_dir, device)
        start, losses = state["step"], list(state["losses"])
    else:
        model = build_model(model_config, config.seed).to(device)
        optimizer = _make_optimizer(model, config)
    resumed_from = start
    model.train()
    steps = range(start, config.steps)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc=description, initial=start, total=config.steps, leave=False)
    for step in steps:
        gen = step_generator(config.seed, step)
        tasks = family.sample(
            config.tasks_per_batch, config.num_support, config.targets_per_task, generator=gen
        )
        x_t, t, u = flow_matching_batch(tasks, gen, sigma_min=config.sigma_min, t_min=config.t_min)
        x_t, t, u = x_t.to(device), t.to(device), u.to(device)
        support = tasks.support.to(device)
        mask = None if tasks.support_mask is None else tasks.support_mask.to(device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        loss = torch.mean((model(x_t, t, support, mask) - u) ** 2)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
        done = step + 1
        if checkpoint_dir is not None and (
            done == config.steps or (config.checkpoint_every and done % config.checkpoint_every == 0)
        ):
            save_checkpoint(checkpoint_dir, model, optimizer, done, config, losses)
    model.eval()
    return TrainResult(model=model, losses=losses, step=max(start, config.steps), resumed_from=resumed_from)


def loss_plateau(losses: list[float], window: float = PLATEAU_WINDOW) -> dict:
    """The one meaning of "converged" in the experiments: the held-out loss has stopped falling.

    Every step draws new tasks, noise and times (:func:`step_generator`), so each step's loss is
    measured on data the model has never seen: the per-step losses are a held-out loss curve.
    Over the last ``window`` share of steps (at least 10) an ordinary least-squares line
    ``loss ~ step`` is fitted; its predicted decrease over the window is ``drop = -slope x length``
    with standard error ``se`` (from the residual scatter; steps are independent draws), both
    relative to the window's mean loss.

    Converged iff the one-sided 95% upper bound of the decrease, ``drop + t_{k-2, 0.95} se``, is
    below :data:`PLATEAU_TOLERANCE` (2% of the loss): with 95% confidence, continuing at this
    schedule for as many steps again would not lower the loss by 2% or more. The criterion can
    fail both ways: a loss still falling, or one too noisy to tell (it is not a failure to reject
    a slope). It is necessary, not sufficient, for a fair baseline (:mod:`~nw_adapter.experiments.baseline`).

    Args:
        losses: per-step training losses (fresh tasks each step).
        window: share of the last steps examined, in (0, 1].

    Returns:
        ``{"converged", "drop", "drop_se", "drop_upper" (relative to the mean loss),
        "tolerance", "steps_examined"}``; ``converged`` is False with NaNs when fewer than 10 steps exist.
    """
    import numpy as np
    from scipy.stats import t as student_t

    if not 0.0 < window <= 1.0:
        raise ValueError(f"window must lie in (0, 1], got {window!r}")
    y = np.asarray(losses, dtype=np.float64)
    k = max(10, int(round(window * y.size)))
    if y.size < 10 or not np.isfinite(y[-k:]).all():
        return {
            "converged": False,
            "drop": math.nan,
            "drop_se": math.nan,
            "drop_upper": math.nan,
            "tolerance": PLATEAU_TOLERANCE,
            "steps_examined": int(min(k, y.size)),
        }
    y = y[-k:]
    x = np.arange(k, dtype=np.float64)
    xc = x - x.mean()
    slope = float(xc @ (y - y.mean()) / (xc @ xc))
    resid = y - y.mean() - slope * xc
    se_slope = math.sqrt(float(resid @ resid) / (k - 2) / float(xc @ xc))
    level = float(y.mean())
    drop, se = -slope * (k - 1) / level, se_slope * (k - 1) / level
    upper = drop + float(student_t.ppf(0.95, k - 2)) * se
    return {
        "converged": bool(upper < PLATEAU_TOLERANCE),
        "drop": drop,
        "drop_se": se,
        "drop_upper": upper,
        "tolerance": PLATEAU_TOLERANCE,
        "steps_examined": k,
    }
