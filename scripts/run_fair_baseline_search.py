"""Search for the cheapest scale at which the learned OFF model beats the plug-in on mixtures at d = 2.

A learned model is a fair baseline only where it is at least as good as the training-free plug-in
on its own training distribution (docs/experiments.md, "fair baseline"). This script trains OFF
models on Gaussian mixtures at d = 2 at a list of scales, cheapest first, and scores each against
the plug-in on the same held-out tasks and initial noise as the experiments (32 tasks x 400 points),
appending one JSON line per scale to ``--out`` (finished scales are skipped on a rerun).

Usage: python scripts/run_fair_baseline_search.py --out runs/fair_search.jsonl [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from nw_adapter.experiments.baseline import fair_baseline
from nw_adapter.experiments.evaluation import EvalConfig, evaluate_methods
from nw_adapter.experiments.fields import model_field, plugin_field
from nw_adapter.experiments.model import ICFMConfig
from nw_adapter.experiments.tasks import GaussianMixtureFamily, split_generator
from nw_adapter.experiments.training import TrainConfig, loss_plateau, train

#: (d_model, layers, steps, tasks per batch, targets per task, lr), cheapest first.
SCALES = (
    (32, 2, 1500, 16, 32, 2e-3),
    (32, 2, 3000, 32, 64, 1e-3),
    (64, 2, 3000, 32, 64, 1e-3),
    (64, 2, 6000, 32, 64, 5e-4),
    (128, 3, 6000, 64, 64, 3e-4),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--checkpoints", type=Path, default=Path("runs/fair_search_ckpt"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    done = set()
    if args.out.exists():
        done = {tuple(json.loads(line)["scale"]) for line in args.out.read_text().splitlines() if line}
    family = GaussianMixtureFamily(2)
    tasks = family.sample(32, 50, 400, generator=split_generator(0, "test"))
    ecfg = EvalConfig(num_generated=400, grid_points=100, sigma_min=0.01, seed=0)
    plug = evaluate_methods({"plugin": lambda s, mk: plugin_field(s, mk, sigma_min=0.01)}, tasks, ecfg)
    for scale in SCALES:
        if tuple(scale) in done:
            continue
        d_model, layers, steps, tasks_per_batch, targets, lr = scale
        name = f"d{d_model}-L{layers}-{steps}-{tasks_per_batch}x{targets}-lr{lr:g}"
        t0, w0 = time.process_time(), time.time()
        result = train(
            family,
            ICFMConfig(dim=2, d_model=d_model, num_heads=4, num_layers=layers, sigma_min=0.01),
            TrainConfig(
                steps=steps,
                tasks_per_batch=tasks_per_batch,
                targets_per_task=targets,
                num_support=50,
                lr=lr,
                warmup_steps=min(50, max(1, steps // 10)),
                sigma_min=0.01,
                seed=0,
                checkpoint_every=max(1, steps // 4),
            ),
            checkpoint_dir=args.checkpoints / name,
        )
        train_cpu = time.process_time() - t0
        res = evaluate_methods({"off": lambda s, mk, m=result.model: model_field(m, s, mk)}, tasks, ecfg)
        off, plugin = res["off"]["mmd2_median"], plug["plugin"]["mmd2_median"]
        row = {
            "scale": list(scale),
            "name": name,
            "train_cpu_s": train_cpu,
            "wall_s": time.time() - w0,
            "mmd2_off": float(off.mean()),
            "mmd2_plugin": float(plugin.mean()),
            "fair": fair_baseline(plugin, off[None]),
            "plateau": loss_plateau(result.losses),
            "off_tasks": off.tolist(),
            "plugin_tasks": plugin.tolist(),
        }
        with args.out.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(name, f"OFF {row['mmd2_off']:.4f} plug-in {row['mmd2_plugin']:.4f}",
              f"fair={row['fair']['fair']}", f"{train_cpu:.0f} s CPU", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
