"""Command line of the failure-regime experiments (shared by the scripts in ``scripts/``).

``python scripts/run_experiments.py --out DIR [--quick]`` (installed: ``nw-experiments``; also
``python -m nw_adapter.experiments.cli`` and ``python -m nw_adapter experiments``) runs all three
regimes; the per-regime scripts run one. Exit codes: 0 done, 2 bad input (one line on stderr naming
the option), 130 interrupted (rerun to resume), 1 unexpected failure. ``--help`` and the argument
errors answer before torch is imported.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import urllib.parse
from pathlib import Path

from nw_adapter.commands import OneLineParser, invoked_as, output_folder
from nw_adapter.experiments.scale import QUICK, REGIMES, SCALES, Scale

__all__ = ["build_parser", "main"]

PROG = "run_experiments.py"


class ArgumentError(ValueError):
    """A bad option: printed as one line naming it, exit status 2."""


class _Parser(OneLineParser):
    """ArgumentParser whose errors raise :class:`ArgumentError` (one line, no usage block)."""

    error_class = ArgumentError


def _int_list(name: str):
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be a comma-separated list of whole numbers, got {text!r}"
            ) from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{name} must list whole numbers >= 1, got {text!r}")
        return values

    return parse


MAX_PARALLEL = 1024
"""The most ``--workers`` and ``--threads`` accepted (torch aborts far above it: 100000 threads
crash the interpreter)."""


def _positive(name: str, maximum: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a whole number, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{name} must be at most {maximum}, got {text!r}")
        return value

    return parse


HIDDEN_INT_OPTIONS = (
    "--steps",
    "--digits-steps",
    "--eval-tasks",
    "--eval-generated",
    "--eval-targets",
    "--digits-targets",
    "--digits-tasks-per-class",
    "--digits-folds",
    "--grid-points",
    "--d-model",
    "--tasks-per-batch",
    "--targets-per-task",
    "--head-tasks",
    "--head-targets",
)
HIDDEN_LIST_OPTIONS = ("--dims", "--shell-dims", "--support-sizes")
"""Scale overrides (for tests and tuning), not shown by ``--help``; each sets the :class:`Scale` field
of its name (``--eval-generated`` -> ``eval_generated``)."""


def build_parser(
    description: str, regimes: tuple[str, ...] | None, prog: str = PROG
) -> argparse.ArgumentParser:
    """Parser with the public options and hidden scale overrides (for tests and tuning)."""
    p = _Parser(prog=prog, description=description)
    p.add_argument(
        "--out", required=True, type=output_folder("--out"), help="run folder (created; rerun to resume)"
    )
    p.add_argument("--quick", action="store_true", help="same as --scale quick")
    p.add_argument(
        "--scale",
        choices=tuple(SCALES),
        default=None,
        help="quick (minutes on 2 CPU cores), full (default; about an hour) or paper (the paper's width, "
        "steps and batch: a GPU or a cluster)",
    )
    p.add_argument(
        "--device", default="cpu", help="torch device of training and evaluation (cpu, cuda, cuda:N)"
    )
    p.add_argument(
        "--engine",
        choices=("local", "dask"),
        default="local",
        help="local: a process pool (default); dask: Dask distributed (a LocalCluster, or --scheduler)",
    )
    p.add_argument(
        "--scheduler", default=None, help="address of a running Dask scheduler (with --engine dask)"
    )
    if regimes is None:
        p.add_argument(
            "--regimes", default=",".join(REGIMES), help="comma-separated subset of dims,shells,digits"
        )
    p.add_argument(
        "--workers",
        type=_positive("--workers", MAX_PARALLEL),
        default=min(2, os.cpu_count() or 1),
        help="parallel worker processes (default: min(2, CPUs))",
    )
    p.add_argument(
        "--threads",
        type=_positive("--threads", MAX_PARALLEL),
        default=1,
        help="torch threads per worker (default 1)",
    )
    p.add_argument(
        "--seeds", type=_positive("--seeds"), default=None, help="training seeds per configuration"
    )
    p.add_argument(
        "--features",
        type=Path,
        default=None,
        help="support-size sweep on your features: .npz (features, labels) or .npy (+ --labels)",
    )
    p.add_argument("--labels", type=Path, default=None, help="labels .npy for a .npy --features matrix")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    hidden = argparse.SUPPRESS
    for flag in HIDDEN_INT_OPTIONS:
        p.add_argument(flag, type=_positive(flag), default=None, help=hidden)
    for flag in HIDDEN_LIST_OPTIONS:
        p.add_argument(flag, type=_int_list(flag), default=None, help=hidden)
    return p


def _check_feature_options(args: argparse.Namespace) -> None:
    """``--features`` / ``--labels``: what :func:`~nw_adapter.experiments.tasks.load_feature_file` needs.

    Raises:
        ArgumentError: ``--labels`` without ``--features``, a ``.npy`` matrix without ``--labels``, a
            missing ``--labels`` file, or the file's own problem, each naming its option.
    """
    if args.features is None:
        if args.labels is not None:
            raise ArgumentError("--labels needs --features (the labels of a .npy feature matrix)")
        return
    if args.features.suffix == ".npy" and args.labels is None:
        raise ArgumentError(
            f"--features {str(args.features)!r} is a .npy matrix; pass its labels with --labels"
        )
    if args.labels is not None and not args.labels.is_file():
        raise ArgumentError(f"--labels {str(args.labels)!r} does not exist; pass the labels .npy")
    from nw_adapter.experiments.tasks import load_feature_file

    try:
        load_feature_file(args.features, args.labels)
    except ValueError as err:
        raise ArgumentError(f"--features: {err}") from None
    except OSError as err:  # an unreadable file
        raise ArgumentError(f"--features / --labels: cannot read ({err.strerror or err})") from None


SCHEDULER_CONNECT_TIMEOUT_S = 5.0
"""How long the command line waits for a TCP connection to ``--scheduler`` before refusing it."""


def scheduler_problem(address: str, timeout: float = SCHEDULER_CONNECT_TIMEOUT_S) -> str | None:
    """Why ``--scheduler address`` cannot be used (None: a TCP connection to it opens).

    Asked before anything is written, so that an address where nothing listens is one line at once
    instead of Dask's connection retries (30 s) and a traceback. ``tcp://`` and ``tls://`` addresses
    (and a bare ``host:port``) are tried; other transports (``inproc://``, ``ucx://``) are Dask's to
    check.
    """
    parts = urllib.parse.urlsplit(address if "://" in address else f"tcp://{address}")
    if parts.scheme not in ("tcp", "tls"):
        return None
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or port is None:
        return f"--scheduler {address!r} is not a scheduler address; pass tcp://HOST:PORT (e.g. tcp://10.0.0.5:8786)"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as err:
        reason = err.strerror or type(err).__name__
        return (
            f"--scheduler {address}: nothing answers there ({reason}); start a scheduler with "
            "`dask scheduler` and pass its address, or omit --scheduler for a local cluster"
        )


def _scale_error(err: ValueError) -> str:
    """The :class:`Scale` check's message with its field names as the options that set them."""
    text = str(err)
    for flag in (*HIDDEN_INT_OPTIONS, *HIDDEN_LIST_OPTIONS, "--seeds"):
        text = text.replace(f"{flag[2:].replace('-', '_')}=", f"{flag} ")
    return text


def main(
    argv: list[str] | None = None,
    *,
    regimes: tuple[str, ...] | None = None,
    description: str = "Reproduce the paper's three failure regimes.",
    prog: str | None = None,
) -> int:
    """Parse arguments, run the experiments, print where the report is; returns the exit code.

    ``prog``: the command's name in the usage line and the messages (default: as invoked for the
    real command line, :func:`nw_adapter.commands.invoked_as`; ``run_experiments.py`` for an
    ``argv`` passed in).
    """
    if prog is None:
        prog = invoked_as(PROG) if argv is None else PROG
    try:
        args, regimes = _parse(argv, regimes, description, prog)
    except ArgumentError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    return _run(args, regimes, prog)


def _parse(
    argv: list[str] | None, regimes: tuple[str, ...] | None, description: str, prog: str
) -> tuple[argparse.Namespace, tuple[str, ...]]:
    """The options and the regimes to run, checked (features loaded once to check them).

    Raises:
        ArgumentError: the first bad option, naming it.
    """
    args = build_parser(description, regimes, prog).parse_args(argv)
    if regimes is None:
        regimes = tuple(r.strip() for r in args.regimes.split(",") if r.strip())
        bad = set(regimes) - set(REGIMES)
        if not regimes or bad:
            raise ArgumentError(
                f"--regimes {args.regimes!r}: use a comma-separated subset of {','.join(REGIMES)}"
            )
    _check_feature_options(args)
    if args.quick and args.scale not in (None, "quick"):
        raise ArgumentError(f"--quick contradicts --scale {args.scale}; pass one of them")
    if args.scheduler is not None and args.engine != "dask":
        raise ArgumentError("--scheduler needs --engine dask")
    if args.engine == "dask":
        import importlib.util

        if importlib.util.find_spec("distributed") is None:
            raise ArgumentError("--engine dask needs Dask distributed; pip install 'nw-adapter[cluster]'")
        problem = None if args.scheduler is None else scheduler_problem(args.scheduler)
        if problem is not None:
            raise ArgumentError(problem)
    if args.device != "cpu":
        from nw_adapter.experiments.runner import check_device

        try:
            check_device(args.device)
        except ValueError as err:
            raise ArgumentError(str(err)) from None
    return args, regimes


def _run(args: argparse.Namespace, regimes: tuple[str, ...], prog: str) -> int:
    """Build the scale, run the experiments, print the matrix and where the report is."""
    base: Scale = QUICK if args.quick else SCALES[args.scale or "full"]
    try:
        scale = base.replace(
            seeds=args.seeds,
            steps=args.steps,
            digits_steps=args.digits_steps,
            eval_tasks=args.eval_tasks,
            eval_generated=args.eval_generated,
            eval_targets=args.eval_targets,
            digits_targets=args.digits_targets,
            digits_tasks_per_class=args.digits_tasks_per_class,
            digits_folds=args.digits_folds,
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
        if "digits" in regimes and args.features is not None:
            from nw_adapter.experiments.tasks import load_feature_file

            classes = len(set(load_feature_file(args.features, args.labels)[1].tolist()))
            if scale.digits_folds > classes:
                raise ValueError(
                    f"--digits-folds {scale.digits_folds} exceeds the {classes} classes of --features; "
                    f"pass --digits-folds {classes} or fewer"
                )
    except ValueError as err:
        print(f"{prog}: error: {_scale_error(err)}", file=sys.stderr)
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
            device=args.device,
            engine=args.engine,
            scheduler=args.scheduler,
        )
    except ValueError as err:
        print(f"{prog}: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; rerun the same command to resume from {args.out}", file=sys.stderr)
        return 130
    matrix = report.parent / "matrix.md"
    if matrix.exists() and matrix.read_text().strip():
        print(matrix.read_text())
    print(f"report: {report} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
