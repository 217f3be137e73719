"""Command line of the failure-regime experiments (shared by the scripts in ``scripts/``).

``python scripts/run_experiments.py --out DIR [--quick]`` runs all three regimes; the per-regime
scripts run one. Exit codes: 0 done, 2 bad input (one-line message), 130 interrupted (rerun to resume),
1 unexpected failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from nw_adapter.experiments.scale import FULL, QUICK, REGIMES, Scale

__all__ = ["build_parser", "main"]


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from err
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must list integers >= 1")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from err
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def build_parser(description: str, regimes: tuple[str, ...] | None) -> argparse.ArgumentParser:
    """Parser with the public options and hidden scale overrides (for tests and tuning)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, type=Path, help="run folder (created; rerun to resume)")
    p.add_argument("--quick", action="store_true", help="small scale, under 5 minutes on 2 CPU cores")
    if regimes is None:
        p.add_argument(
            "--regimes", default=",".join(REGIMES), help="comma-separated subset of dims,shells,digits"
        )
    p.add_argument(
        "--workers",
        type=_positive,
        default=min(2, os.cpu_count() or 1),
        help="parallel worker processes (default: min(2, CPUs))",
    )
    p.add_argument("--threads", type=_positive, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--seeds", type=_positive, default=None, help="training seeds per configuration")
    p.add_argument(
        "--features",
        type=Path,
        default=None,
        help="support-size sweep on your features: .npz (features, labels) or .npy (+ --labels)",
    )
    p.add_argument("--labels", type=Path, default=None, help="labels .npy for a .npy --features matrix")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    hidden = argparse.SUPPRESS
    for flag in (
        "--steps",
        "--digits-steps",
        "--eval-tasks",
        "--eval-generated",
        "--eval-targets",
        "--digits-targets",
        "--digits-tasks-per-class",
        "--grid-points",
        "--d-model",
        "--tasks-per-batch",
        "--targets-per-task",
        "--head-tasks",
        "--head-targets",
    ):
        p.add_argument(flag, type=_positive, default=None, help=hidden)
    for flag in ("--dims", "--shell-dims", "--support-sizes"):
        p.add_argument(flag, type=_int_list, default=None, help=hidden)
    return p


def main(
    argv: list[str] | None = None,
    *,
    regimes: tuple[str, ...] | None = None,
    description: str = "Reproduce the paper's three failure regimes.",
) -> int:
    """Parse arguments, run the experiments, print where the report is; returns the exit code."""
    parser = build_parser(description, regimes)
    args = parser.parse_args(argv)
    if regimes is None:
        regimes = tuple(r.strip() for r in args.regimes.split(",") if r.strip())
        bad = set(regimes) - set(REGIMES)
        if not regimes or bad:
            parser.error(f"--regimes {args.regimes!r}: use a comma-separated subset of {','.join(REGIMES)}")
    if args.labels is not None and args.features is None:
        parser.error("--labels needs --features")
    base: Scale = QUICK if args.quick else FULL
    try:
        from nw_adapter.experiments.tasks import load_feature_file

        if args.features is not None:
            load_feature_file(args.features, args.labels)
        scale = base.replace(
            seeds=args.seeds,
            steps=args.steps,
            digits_steps=args.digits_steps,
            eval_tasks=args.eval_tasks,
            eval_generated=args.eval_generated,
            eval_targets=args.eval_targets,
            digits_targets=args.digits_targets,
            digits_tasks_per_class=args.digits_tasks_per_class,
            grid_points=args.grid_points,
            d_model=args.d_model,
            tasks_per_batch=args.tasks_per_batch,
            targets_per_task=args.targets_per_task,
            head_tasks=args.head_tasks,
            head_targets=args.head_targets,
            dims=args.dims,
            shell_dims=args.shell_dims,
            support_sizes=args.support_sizes,
            features=None if args.features is None else str(args.features),
            labels=None if args.labels is None else str(args.labels),
        )
        if (
            args.support_sizes
            and "digits" in regimes
            and max(scale.support_sizes) + scale.digits_targets > 170
        ):
            raise ValueError(
                f"--support-sizes max {max(scale.support_sizes)} + {scale.digits_targets} held-out points "
                "exceeds the smallest digits class (174); use sizes <= 50"
            )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from nw_adapter.experiments.runner import run_experiments

    t0 = time.time()
    try:
        report = run_experiments(
            args.out,
            scale,
            regimes=regimes,
            workers=args.workers,
            threads=args.threads,
            progress=not args.no_progress,
        )
    except ValueError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted; rerun the same command to resume from {args.out}", file=sys.stderr)
        return 130
    matrix = report.parent / "matrix.md"
    if matrix.exists() and matrix.read_text().strip():
        print(matrix.read_text())
    print(f"report: {report} ({time.time() - t0:.0f} s)")
    return 0
