"""Run the failure-regime experiments into a folder: resumable, optionally in parallel.

Layout of a run folder::

    config.json             the Scale used (a rerun must use the same one)
    results/<unit>.json     one per finished unit (written atomically; finished units are skipped)
    checkpoints/<unit>/     resumable training checkpoints
    report.md, report.json, *.png   written by nw_adapter.experiments.report (atomically)

Units run in ``workers`` processes, each with ``threads`` torch threads; on two CPU cores two
single-threaded workers are faster than one two-threaded process for models this small.
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

__all__ = ["run_experiments", "ConfigMismatchError"]


class ConfigMismatchError(ValueError):
    """The run folder holds results of a different configuration."""


def _worker(unit: dict, scale_dict: dict, out_dir: str, threads: int) -> str:
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    run_unit(unit, Scale(**scale_dict), Path(out_dir))
    return unit["id"]


def _worker_args(args: tuple[dict, dict, str, int]) -> str:
    return _worker(*args)


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
) -> Path:
    """Run (or resume) the chosen regimes and write the report.

    Args:
        out_dir: Run folder (created if needed).
        scale: Experiment scale (must match the folder's ``config.json`` on reruns).
        regimes: Subset of ``("dims", "shells", "digits")``.
        workers: Parallel worker processes (1 = run in this process).
        threads: torch threads per worker.
        progress: Show tqdm bars.

    Returns:
        Path of ``report.md``.
    """
    unknown = set(regimes) - set(REGIMES)
    if not regimes or unknown:
        raise ValueError(f"regimes={regimes!r} must be a non-empty subset of {REGIMES}.")
    if workers < 1 or threads < 1:
        raise ValueError(f"workers={workers} and threads={threads} must be >= 1.")
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
    if workers == 1 or len(pending) <= 1:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        torch.set_flush_denormal(True)
        try:
            for unit in pending:
                run_unit(unit, scale, out_dir, progress=progress)
                if bar is not None:
                    bar.update(1)
        finally:
            torch.set_num_threads(previous)
    else:
        # Learned units first: they are the long ones, so the pool stays busy to the end.
        pending.sort(key=lambda u: u["method"] == "plugin")
        pool = get_context("spawn").Pool(processes=min(workers, len(pending)))
        try:
            jobs = [(u, scale.to_dict(), str(out_dir), threads) for u in pending]
            for _ in pool.imap_unordered(_worker_args, jobs):
                if bar is not None:
                    bar.update(1)
            pool.close()
        except BaseException:
            pool.terminate()  # Ctrl-C or a failed unit: stop the workers now; checkpoints allow resuming
            raise
        finally:
            pool.join()
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
        }
    )
    write_json_atomic(timing_path, timing)
    return write_report(out_dir, scale, regimes)
