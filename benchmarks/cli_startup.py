"""How soon the command lines answer: modules imported and CPU time of ``--help`` and argument errors.

Each command runs in a fresh interpreter, ``--repeats`` times, interleaved (every command once per
round). Reported per command: the number of modules it imports (``python -X importtime`` lines:
deterministic), whether torch / diffusers / transformers are among them, the median CPU time of the
process (user + system, from ``os.wait4``: waiting for a core is not counted) and its ratio to
``python -c pass``. The reference row ``import torch, diffusers`` is what every invocation cost
before the command lines parsed their arguments first. Stdlib only; prints the load average.

Usage::

    python benchmarks/cli_startup.py                 # 5 rounds
    python benchmarks/cli_startup.py --repeats 1 --no-reference
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "diffusers", "transformers")

COMMANDS: dict[str, list[str]] = {
    "python -c pass": ["-c", "pass"],
    "correlate.py --help": [str(ROOT / "scripts" / "correlate.py"), "--help"],
    "correlate.py --stpes 3 (misspelt)": [str(ROOT / "scripts" / "correlate.py"), "--stpes", "3"],
    "correlate.py --untrained-seed -1": [
        str(ROOT / "scripts" / "correlate.py"), "--image", "r.png", "--untrained-seed", "-1"
    ],
    "run_experiments.py --help": [str(ROOT / "scripts" / "run_experiments.py"), "--help"],
    "run_experiments.py --workers 0": [
        str(ROOT / "scripts" / "run_experiments.py"), "--out", "o", "--workers", "0"
    ],
}  # fmt: skip
"""Label -> interpreter arguments of each measured command."""

REFERENCE = {"import torch, diffusers (before)": ["-c", "import torch, diffusers.pipelines"]}


def run_once(args: Sequence[str], cwd: Path) -> tuple[float, list[str]]:
    """CPU seconds (user + system) of one ``python -X importtime ARGS`` and the modules it imported."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    stderr = proc.stderr.read() if proc.stderr else ""
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0  # reaped by wait4
    modules = [line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")]
    return usage.ru_utime + usage.ru_stime, [m for m in modules if m != "imported package"]


def measure(commands: dict[str, list[str]], repeats: int) -> dict[str, dict]:
    """Interleaved rounds; per label the CPU times, the module count and the heavy libraries loaded."""
    results: dict[str, dict] = {label: {"cpu_s": []} for label in commands}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(repeats):
            for label, args in commands.items():
                cpu, modules = run_once(args, Path(folder))
                entry = results[label]
                entry["cpu_s"].append(cpu)
                entry["modules"] = len(modules)
                entry["heavy"] = sorted({m.split(".")[0] for m in modules} & set(HEAVY))
    return results


def format_table(results: dict[str, dict]) -> str:
    """One row per command: modules, heavy libraries, median CPU [min-max] and the ratio to ``pass``."""
    base = statistics.median(results["python -c pass"]["cpu_s"])
    width = max(len(label) for label in results)
    lines = [f"{'command':<{width}}  modules  torch/diffusers/transformers  CPU s (median [min-max])  x pass"]
    for label, entry in results.items():
        times = entry["cpu_s"]
        median = statistics.median(times)
        heavy = ",".join(entry["heavy"]) or "none"
        lines.append(
            f"{label:<{width}}  {entry['modules']:>7}  {heavy:<28}  "
            f"{median:6.3f} [{min(times):.3f}-{max(times):.3f}]       {median / base:6.1f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the machine line and the table."""
    parser = argparse.ArgumentParser(prog="cli_startup.py", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--no-reference", action="store_true", help="skip the import torch, diffusers row")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    commands = dict(COMMANDS) if args.no_reference else {**COMMANDS, **REFERENCE}
    load = os.getloadavg()
    print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, load average "
        f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, {args.repeats} round(s)"
    )
    print(format_table(measure(commands, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
