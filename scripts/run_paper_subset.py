"""The paper-scale subset for one GPU: mixtures at d = 2 and 16 at the paper's width, batch and lr.

One prepared command for a machine with a CUDA device (not run on the 2-core CPU machine):

    python scripts/run_paper_subset.py --out runs/paper_subset [--steps 100000] [--device cuda]

It runs ``run_experiments.py --scale paper`` (d_model 128 / H 4 / L 3, 256 tasks x 256 targets,
lr 1e-4, 100 evaluation tasks x 500 points) on the dimension sweep's end points (d = 2, 16) with one
training seed, ON and OFF models, the plug-in and the training-free fields: the paper's headline
"+28% at d = 2 falling to 0% at d = 16" and the fair-baseline check of the OFF model. ``--steps``
(default: the paper's 100k) lowers the training length to fit a time budget; the report says how
many steps were run. Rerunning the same command resumes from the checkpoints. The report lands in
``--out``/report.md.
"""

from __future__ import annotations

import sys

from nw_adapter.commands import ScriptParser, output_folder, whole_number
from nw_adapter.experiments.cli import main as run_experiments


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser(prog="run_paper_subset.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=output_folder("--out"), required=True, help="run folder (rerun to resume)")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--steps",
        type=whole_number("--steps", 1),
        default=100000,
        help="training steps per model (paper: 100000)",
    )
    p.add_argument(
        "--workers",
        type=whole_number("--workers", 1),
        default=1,
        help="units at once on the device (1: one model at a time)",
    )
    args = p.parse_args(argv)
    return run_experiments(
        [
            "--out",
            str(args.out),
            "--scale",
            "paper",
            "--device",
            args.device,
            "--regimes",
            "dims",
            "--dims",
            "2,16",
            "--seeds",
            "1",
            "--steps",
            str(args.steps),
            "--workers",
            str(args.workers),
            "--threads",
            "4",
            "--no-progress",
        ]  # fmt: skip
    )


if __name__ == "__main__":
    sys.exit(main())
