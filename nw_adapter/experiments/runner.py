"""Run the failure-regime experiments into a folder: resumable, optionally in parallel.

Layout of a run folder::

    config.json             the Scale used (a rerun must use the same one)
    results/<unit>.json     one per finished unit (written atomically; finished units are skipped)
    checkpoints/<unit>/     resumable training checkpoints
    report.md, report.json, *.png   written by nw_adapter.experiments.report (atomically)

Units are independent, so the grid is embarrassingly parallel. Two engines dispatch it:

- ``"local"`` (the embedded default, no server): a spawn process pool of ``workers`` processes,
  each with ``threads`` torch threads (on two CPU cores two single-threaded workers are faster
  than one two-threaded process for models this small);
- ``"dask"``: Dask's distributed scheduler (optional extra ``nw-adapter[cluster]``). With
  ``scheduler=None`` a ``LocalCluster`` of ``workers`` single-threaded worker processes is started
  in-process (no server to run); with ``scheduler="tcp://host:8786"`` the units go to an existing
  cluster, whose workers must see ``out_dir`` (a shared file system) and have the package installed.
  Dask was chosen over Ray because it is pure Python (pip-installable anywhere the package is, no
  daemon or object store), its ``LocalCluster`` needs no server, and its futures map one-to-one on
  our units; each unit writes its own result file, so nothing large travels through the scheduler.

Either way, finished units (their ``results/<id>.json``) are skipped and interrupted trainings
resume from their checkpoints; ``device`` ("cpu", "cuda", "cuda:1") is where each unit trains
and evaluates.
"""

from __future__ import annotations

import json
import os
import time
from multiprocessing import get_context
from pathlib import Path

import torch

from nw_adapter.experiments.report import write_report
from nw_adapter.experiments.scale import REGIMES, Scale
from nw_adapter.experiments.units import plan_units, run_unit, write_json_atomic

__all__ = ["run_experiments", "ConfigMismatchError", "ENGINES"]

ENGINES = ("local", "dask")


class ConfigMismatchError(ValueError):
    """The run folder holds results of a different configuration."""


def _worker(unit: dict, scale_dict: dict, out_dir: str, threads: int, device: str = "cpu") -> str:
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    run_unit(unit, Scale(**scale_dict), Path(out_dir), device=device)
    return unit["id"]


def _worker_args(args: tuple[dict, dict, str, int, str]) -> str:
    return _worker(*args)


def check_device(device: str) -> str:
    """``device`` if torch can use it, else ValueError naming the fix (one line)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r}: CUDA is not available on this machine; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: use cpu, cuda or cuda:N")
    return device


def _run_local_pool(jobs: list[tuple], workers: int, bar) -> None:
    pool = get_context("spawn").Pool(processes=min(workers, len(jobs)))
    try:
        for _ in pool.imap_unordered(_worker_args, jobs):
            if bar is not None:
                bar.update(1)
        pool.close()
    except BaseException:
        pool.terminate()  # Ctrl-C or a failed unit: stop the workers now; checkpoints allow resuming
        raise
    finally:
        pool.join()


def _run_dask(jobs: list[tuple], workers: int, scheduler: str | None, bar) -> None:
    try:
        from dask.distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise ValueError(
            "--engine dask needs Dask's distributed scheduler; pip install 'nw-adapter[cluster]'"
        ) from None
    cluster = None
    if scheduler is None:
        cluster = LocalCluster(
            n_workers=min(workers, len(jobs)), threads_per_worker=1, processes=True, dashboard_address=None
        )
    client = Client(cluster if cluster is not None else scheduler)
    futures = [client.submit(_worker, *job, key=f"nw-unit-{job[0]['id']}", pure=False) for job in jobs]
    try:
        for future in as_completed(futures):
            future.result()  # re-raises a unit's exception here
            if bar is not None:
                bar.update(1)
    except BaseException:
        client.cancel(futures)
        raise
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def _check_config(out_dir: Path, scale: Scale) -> None:
    path = out_dir / "config.json"
    current = json.loads(json.dumps(scale.to_dict()))
    if path.exists():
        previous = json.loads(path.read_text())
        if previous != current:
            diff = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
            raise ConfigMismatchError(
                f"{str(out_dir)!r} holds results of a different "
                f"configuration (differs in {', '.join(diff)}); "
                "rerun with the same options or choose a new --out folder."
            )
    else:
        write_json_atomic(path, current)


def run_experiments(
    out_dir: str | Path,
    scale: Scale,
    *,
    regimes: tuple[str, ...] = REGIMES,
    workers: int = 2,
    threads: int = 1,
    progress: bool = True,
    device: str = "cpu",
    engine: str = "local",
    scheduler: str | None = None,
) -> Path:
    """Run (or resume) the chosen regimes and write the report.

    Args:
        out_dir: Run folder (created if needed).
        scale: Experiment scale (must match the folder's ``config.json`` on reruns).
        regimes: Subset of ``("dims", "shells", "digits")``.
        workers: Parallel worker processes (1 = run in this process).
        threads: torch threads per worker.
        progress: Show tqdm bars.
        device: torch device of every unit's training and evaluation.
        engine: ``"local"`` (process pool, the default) or ``"dask"`` (see the module docstring).
        scheduler: Address of a running Dask scheduler (``engine="dask"`` only); None starts a
            ``LocalCluster`` of ``workers`` processes.

    Returns:
        Path of ``report.md``.
    """
    unknown = set(regimes) - set(REGIMES)
    if not regimes or unknown:
        raise ValueError(f"regimes={regimes!r} must be a non-empty subset of {REGIMES}.")
    if workers < 1 or threads < 1:
        raise ValueError(f"workers={workers} and threads={threads} must be >= 1.")
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: use one of {', '.join(ENGINES)}.")
    if scheduler is not None and engine != "dask":
        raise ValueError("a scheduler address needs --engine dask.")
    check_device(device)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_config(out_dir, scale)
    wall0 = time.time()
    units = plan_units(scale, regimes)
    pending = [u for u in units if not (out_dir / "results" / f"{u['id']}.json").exists()]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(units), initial=len(units) - len(pending), desc="experiments", unit="unit")
    if engine == "local" and (workers == 1 or len(pending) <= 1):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        torch.set_flush_denormal(True)
        try:
            for unit in pending:
                run_unit(unit, scale, out_dir, progress=progress, device=device)
                if bar is not None:
                    bar.update(1)
        finally:
            torch.set_num_threads(previous)
    elif pending:
        # Learned units first: they are the long ones, so the workers stay busy to the end.
        pending.sort(key=lambda u: u["method"] in ("plugin", "fields"))
        jobs = [(u, scale.to_dict(), str(out_dir.resolve()), threads, device) for u in pending]
        if engine == "dask":
            _run_dask(jobs, workers, scheduler, bar)
        else:
            _run_local_pool(jobs, workers, bar)
    if bar is not None:
        bar.close()
    timing_path = out_dir / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {"invocations": []}
    timing["invocations"].append(
        {
            "wall_s": time.time() - wall0,
            "units_run": len(pending),
            "workers": workers,
            "threads": threads,
            "cpu_count": os.cpu_count(),
            "engine": engine,
            "device": device,
        }
    )
    write_json_atomic(timing_path, timing)
    return write_report(out_dir, scale, regimes)
