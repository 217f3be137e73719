"""Train the embedded tiny digits model (SD 1.5 + IP-Adapter layouts) from scikit-learn's digits.

    $ python scripts/train_tiny.py --out runs/tiny            # the shipped weights (seed 0)
    $ python scripts/train_tiny.py --out /tmp/smoke --quick   # every stage for a few steps (CI)

Writes ``OUT/stages/{vae,image_encoder,text_encoder,unet,adapter}`` (float32, resumable) and the model folder
``OUT/tiny_digits`` (float16, the layout shipped in ``nw_adapter/models/weights/tiny_digits``).
See :mod:`nw_adapter.models.training` and the model card.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from nw_adapter.commands import ScriptParser, output_folder, seed_number, whole_number

MAX_THREADS = 1024
"""The most torch CPU threads ``--threads`` accepts."""


def training_parser(
    description: str, model_folder: str, steps_help: str, prog: str = "train_tiny.py"
) -> argparse.ArgumentParser:
    """The options of a tiny model's training script (``model_folder``: the folder written under --out).

    A bad option is one line naming it (exit status 2): ``--out`` empty (the current folder), a
    file or inside one; a seed outside ``[0, 2**63)``; steps or threads below 1.
    """
    parser = ScriptParser(prog=prog, description=description)
    parser.add_argument(
        "--out",
        type=output_folder("--out"),
        required=True,
        help=f"output folder (stages/ and {model_folder}/)",
    )
    parser.add_argument(
        "--seed",
        type=seed_number("--seed"),
        default=0,
        help="seed of every stage, 0 <= seed < 2**63 (default 0: the shipped weights)",
    )
    parser.add_argument("--quick", action="store_true", help="2 steps per stage on 40 images: a smoke run")
    parser.add_argument("--steps", type=whole_number("--steps", 1), default=None, help=steps_help)
    parser.add_argument(
        "--threads",
        type=whole_number("--threads", 1, MAX_THREADS),
        default=None,
        help="torch CPU threads (default 1)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def run_and_report(script: str, out: Path, train: Callable[[], Path]) -> int:
    """Run ``train()`` (it writes under ``out``) and print the model folder; exit code 2 and one line
    ``<script>: error: ...`` when ``out`` is a file, a stage cannot be reused or ``out`` is not writable."""
    from nw_adapter.models.training.run import StageMismatchError

    if out.exists() and not out.is_dir():
        print(f"{script}: error: --out '{out}' is a file; pass a folder", file=sys.stderr)
        return 2
    try:
        folder = train()
    except StageMismatchError as exc:
        print(f"{script}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"{script}: error: cannot write to '{out}' ({exc.strerror or exc}); pass a writable --out",
            file=sys.stderr,
        )
        return 2
    print(f"model folder: {folder}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = training_parser(__doc__.splitlines()[0], "tiny_digits", "steps of every stage (overrides)")
    args = parser.parse_args(argv)
    from nw_adapter.models.training.run import TrainingConfig, run_training

    config = TrainingConfig.quick(args.seed) if args.quick else TrainingConfig(seed=args.seed)
    if args.steps is not None:
        config = replace(
            config,
            vae_steps=args.steps,
            encoder_steps=args.steps,
            text_encoder_steps=args.steps,
            unet_steps=args.steps,
            adapter_steps=args.steps,
        )
    if args.threads is not None:
        config = replace(config, threads=args.threads)
    return run_and_report(
        "train_tiny.py", args.out, lambda: run_training(args.out, config, progress=not args.no_progress)
    )


if __name__ == "__main__":
    sys.exit(main())
