"""Search for the cheapest scale at which the learned OFF model beats the plug-in on mixtures at d = 2.

A learned model is a fair baseline only where it is at least as good as the training-free plug-in
on its own training distribution (docs/experiments.md, "fair baseline"). This script trains OFF
models on Gaussian mixtures at d = 2 at a list of scales, cheapest first, and scores each against
the plug-in on the same held-out tasks (fresh draws of the training family's test split) and the
same initial noise (a paired design; tasks are the independent units of the Fieller interval).

Evaluation size: ``--tasks`` held-out tasks x ``--points`` points per task (generated points and
held-out targets alike). The default, 32 x 400, is the experiments' full-scale evaluation; the
per-task MMD^2 at 400 points is too noisy for 32 tasks to decide the non-inferiority test
(docs/experiments.md, "The fair-baseline search"), so a decisive search passes more tasks and/or
points. ``--scales`` picks scales by their index in :data:`SCALES` (default all, cheapest first).

Output: one JSON line per (scale, tasks, points) appended to ``--out``; rows already there are
skipped on a rerun. Each row holds the excess ``mean(OFF) / mean(plug-in) - 1`` with its 95%
Fieller interval (``fair``: :func:`nw_adapter.experiments.baseline.fair_baseline`), ``beats``
(the interval's upper end below 0: OFF strictly better), ``plateau``
(:func:`nw_adapter.experiments.training.loss_plateau`), the training CPU time (measured when the
model was trained; a finished checkpoint under ``--checkpoints`` is reused, not retrained), the
evaluation CPU time of OFF and of the plug-in, and the per-task MMD^2 of both.

Usage: python scripts/run_fair_baseline_search.py --out runs/fair_search.jsonl
           [--tasks 32] [--points 400] [--scales 0,3] [--threads 1] [--eval-batch 25]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from nw_adapter.commands import ScriptParser, dead_link_on, output_folder, whole_number
from nw_adapter.experiments.baseline import fair_baseline
from nw_adapter.experiments.evaluation import EvalConfig, evaluate_methods
from nw_adapter.experiments.fields import model_field, plugin_field
from nw_adapter.experiments.model import ICFMConfig
from nw_adapter.experiments.tasks import GaussianMixtureFamily, split_generator
from nw_adapter.experiments.training import TrainConfig, TrainResult, loss_plateau, train

#: (d_model, layers, steps, tasks per batch, targets per task, lr), cheapest first.
SCALES = (
    (32, 2, 1500, 16, 32, 2e-3),
    (32, 2, 3000, 16, 32, 2e-3),
    (32, 2, 1500, 32, 64, 1e-3),
    (32, 2, 3000, 32, 64, 1e-3),
    (64, 2, 3000, 32, 64, 1e-3),
    (64, 2, 6000, 32, 64, 5e-4),
    (128, 3, 6000, 64, 64, 3e-4),
)

#: Support points per task and sigma_min of the OT path (the experiments' values).
NUM_SUPPORT, SIGMA_MIN = 50, 0.01


def scale_name(scale: tuple) -> str:
    """``d{d_model}-L{layers}-{steps}-{tasks}x{targets}-lr{lr}``, the checkpoint folder of a scale."""
    d_model, layers, steps, tasks_per_batch, targets, lr = scale
    return f"d{d_model}-L{layers}-{steps}-{tasks_per_batch}x{targets}-lr{lr:g}"


def parse_scales(text: str | None, num: int | None = None) -> list[int]:
    """Indices from ``"0,2,3"`` into :data:`SCALES`; None: all. In order, once each."""
    num = len(SCALES) if num is None else num
    if text is None:
        return list(range(num))
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) >= num:
            raise ValueError(f"--scales {text!r}: each entry must be an index 0..{num - 1} of SCALES.")
        if int(part) not in out:
            out.append(int(part))
    return out


def eval_tasks(num_tasks: int, num_points: int, family: GaussianMixtureFamily | None = None):
    """The held-out tasks: ``num_tasks`` draws of the family's test split, ``num_points`` targets each."""
    family = family or GaussianMixtureFamily(2)
    return family.sample(num_tasks, NUM_SUPPORT, num_points, generator=split_generator(0, "test"))


def train_scale(
    scale: tuple, checkpoint_root: Path, family: GaussianMixtureFamily
) -> tuple[TrainResult, float | None]:
    """Train (or reload the finished checkpoint of) one scale.

    Returns:
        The training result and its CPU seconds: measured now when trained here, read back from
        ``train_cpu.json`` in the checkpoint folder when reloaded (None if that file is missing).
    """
    d_model, layers, steps, tasks_per_batch, targets, lr = scale
    ckpt = checkpoint_root / scale_name(scale)
    t0 = time.process_time()
    result = train(
        family,
        ICFMConfig(dim=family.dim, d_model=d_model, num_heads=4, num_layers=layers, sigma_min=SIGMA_MIN),
        TrainConfig(
            steps=steps,
            tasks_per_batch=tasks_per_batch,
            targets_per_task=targets,
            num_support=NUM_SUPPORT,
            lr=lr,
            warmup_steps=min(50, max(1, steps // 10)),
            sigma_min=SIGMA_MIN,
            seed=0,
            checkpoint_every=max(1, steps // 4),
        ),
        checkpoint_dir=ckpt,
    )
    elapsed = time.process_time() - t0
    record = ckpt / "train_cpu.json"
    if result.resumed_from == 0:
        _write_atomic(record, json.dumps({"train_cpu_s": elapsed}))
        return result, elapsed
    if result.resumed_from >= steps and record.exists():
        return result, float(json.loads(record.read_text())["train_cpu_s"])
    return result, None  # resumed part-way: the CPU time of the earlier part is unknown


def compare(off: np.ndarray, plugin: np.ndarray) -> dict:
    """Fair-baseline test of OFF against the plug-in on the same tasks, plus ``beats``.

    ``beats``: the upper end of the excess's 95% Fieller interval lies below 0 (OFF strictly
    better than the plug-in), which implies ``fair``.
    """
    fair = fair_baseline(plugin, off[None])
    hi = fair["excess_ci"][1]
    return {**fair, "beats": bool(math.isfinite(hi) and hi < 0.0)}


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _append_line(path: Path, row: dict) -> None:
    """Append one JSON line (rewrites the file atomically so a crash never leaves half a line)."""
    old = path.read_text() if path.exists() else ""
    _write_atomic(path, old + json.dumps(row) + "\n")


def _done(path: Path) -> set[tuple]:
    """(scale, tasks, points) of the rows in ``path``; rows without an evaluation size are 32 x 400.

    Raises:
        ValueError: ``path`` is not a file of this script's rows (one line naming the line and the fix).
    """
    if not path.exists():
        return set()
    done = set()
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"--out '{path}': cannot be read ({exc}); pass this script's JSON-lines file"
        ) from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            done.add((tuple(row["scale"]), row.get("eval_tasks", 32), row.get("eval_points", 400)))
        except (ValueError, TypeError, KeyError, AttributeError):
            raise ValueError(
                f"--out '{path}': line {number} is not a row of this script (JSON with a 'scale'); pass "
                "its JSON-lines file or a new one"
            ) from None
    return done


def _output_file(text: str) -> Path:
    """``--out``: the JSON-lines file the rows are appended to: not empty, not a folder, not below a file."""
    wanted = "pass the JSON-lines file to append to, e.g. --out runs/fair_search.jsonl"
    path = Path(text).expanduser()
    if not text.strip():
        raise argparse.ArgumentTypeError(f"--out is empty; {wanted}")
    broken = dead_link_on(path)
    if broken is not None:  # a loop or a missing target: the rows could not be appended, after the search
        raise argparse.ArgumentTypeError(
            f"--out '{text}': '{broken}' is a symbolic link that leads nowhere; {wanted}"
        )
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"--out '{text}' is a folder; {wanted}")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise argparse.ArgumentTypeError(f"--out '{text}' lies inside the file '{parent}'; {wanted}")
    return path


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser(prog="run_fair_baseline_search.py", description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", type=_output_file, required=True, help="JSON-lines file of the results (appended)"
    )
    p.add_argument("--threads", type=whole_number("--threads", 1, 1024), default=1, help="torch CPU threads")
    p.add_argument(
        "--checkpoints", type=output_folder("--checkpoints"), default=Path("runs/fair_search_ckpt")
    )
    p.add_argument(
        "--tasks", type=whole_number("--tasks", 2), default=32, help="held-out evaluation tasks (default 32)"
    )
    p.add_argument(
        "--points",
        type=whole_number("--points", 4),
        default=400,
        help="generated = target points per task (default 400)",
    )
    p.add_argument("--scales", default=None, help="comma-separated indices into SCALES (default: all)")
    p.add_argument(
        "--eval-batch",
        type=whole_number("--eval-batch", 1),
        default=25,
        help="tasks integrated together (memory)",
    )
    args = p.parse_args(argv)
    try:
        scales = parse_scales(args.scales)
    except ValueError as exc:
        p.error(str(exc))
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    try:
        done = _done(args.out)
    except ValueError as exc:
        p.error(str(exc))
    todo = [i for i in scales if (SCALES[i], args.tasks, args.points) not in done]
    if not todo:
        return 0
    family = GaussianMixtureFamily(2)
    tasks = eval_tasks(args.tasks, args.points, family)
    ecfg = EvalConfig(
        num_generated=args.points, grid_points=100, sigma_min=SIGMA_MIN, seed=0, batch_tasks=args.eval_batch
    )
    t0 = time.process_time()
    plug = evaluate_methods({"plugin": lambda s, mk: plugin_field(s, mk, sigma_min=SIGMA_MIN)}, tasks, ecfg)
    plugin_cpu = time.process_time() - t0
    plugin = plug["plugin"]["mmd2_median"]
    for i in todo:
        scale = SCALES[i]
        w0 = time.time()
        result, train_cpu = train_scale(scale, args.checkpoints, family)
        t0 = time.process_time()
        res = evaluate_methods({"off": lambda s, mk, m=result.model: model_field(m, s, mk)}, tasks, ecfg)
        eval_cpu = time.process_time() - t0
        off = res["off"]["mmd2_median"]
        row = {
            "scale": list(scale),
            "name": scale_name(scale),
            "eval_tasks": args.tasks,
            "eval_points": args.points,
            "train_cpu_s": train_cpu,
            "eval_cpu_off_s": eval_cpu,
            "eval_cpu_plugin_s": plugin_cpu,
            "wall_s": time.time() - w0,
            "load_avg": os.getloadavg()[0],
            "mmd2_off": float(off.mean()),
            "mmd2_plugin": float(plugin.mean()),
            "fair": compare(off, plugin),
            "plateau": loss_plateau(result.losses),
            "off_tasks": off.tolist(),
            "plugin_tasks": plugin.tolist(),
        }
        _append_line(args.out, row)
        f, train_s = row["fair"], "?" if train_cpu is None else f"{train_cpu:.0f}"
        print(
            row["name"],
            f"{args.tasks}x{args.points}",
            f"OFF {row['mmd2_off']:.5f} plug-in {row['mmd2_plugin']:.5f}",
            f"excess {f['excess']:+.1%} [{f['excess_ci'][0]:+.1%}, {f['excess_ci'][1]:+.1%}]",
            f"fair={f['fair']} beats={f['beats']} converged={row['plateau']['converged']}",
            f"train {train_s} s, eval {eval_cpu:.0f} + {plugin_cpu:.0f} s CPU",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
