"""Train the embedded tiny Flux digits model (Flux + XLabs IP-Adapter layouts) from scikit-learn's digits.

    $ python scripts/train_tiny_flow.py --out runs/tiny_flux            # the shipped weights (seed 0)
    $ python scripts/train_tiny_flow.py --out /tmp/smoke --quick        # every stage for 2 steps (CI)

Writes ``OUT/stages/{parts,transformer,adapter}`` (resumable, each with its ``stage.json``) and the
model folder ``OUT/tiny_flux_digits`` (the layout shipped in
``nw_adapter/models/weights/tiny_flux_digits``). Reuses the VAE, the CLIP text encoder and the CLIP
image encoder of the shipped tiny SD 1.5 digits model, frozen. See
:mod:`nw_adapter.models.training.flux_run` and the model card.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="output folder (stages/ and tiny_flux_digits/)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of every stage (default 0: the shipped weights)"
    )
    parser.add_argument("--quick", action="store_true", help="2 steps per stage on 40 images: a smoke run")
    parser.add_argument("--steps", type=_positive_int, default=None, help="steps of both trained stages")
    parser.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from nw_adapter.models.training.flux_run import FluxTrainingConfig, run_flux_training
    from nw_adapter.models.training.run import StageMismatchError

    config = FluxTrainingConfig.quick(args.seed) if args.quick else FluxTrainingConfig(seed=args.seed)
    if args.steps is not None:
        config = replace(config, transformer_steps=args.steps, adapter_steps=args.steps)
    if args.threads is not None:
        config = replace(config, threads=args.threads)
    if args.out.exists() and not args.out.is_dir():
        print(f"train_tiny_flow.py: error: --out '{args.out}' is a file; pass a folder", file=sys.stderr)
        return 2
    try:
        folder = run_flux_training(args.out, config, progress=not args.no_progress)
    except StageMismatchError as exc:
        print(f"train_tiny_flow.py: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"train_tiny_flow.py: error: cannot write to '{args.out}' ({exc.strerror or exc}); "
            "pass a writable --out",
            file=sys.stderr,
        )
        return 2
    print(f"model folder: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
