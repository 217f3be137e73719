"""Train the embedded tiny Flux digits model (Flux + XLabs IP-Adapter layouts) from scikit-learn's digits.

    $ python scripts/train_tiny_flow.py --out runs/tiny_flux            # the shipped weights (seed 0)
    $ python scripts/train_tiny_flow.py --out /tmp/smoke --quick        # every stage for 2 steps (CI)
    $ python scripts/train_tiny_flow.py --out runs/a --adapter-transformer-lr 0   # stage 2: the adapter alone
    $ python scripts/train_tiny_flow.py --out runs/f --no-class-free-drop --adapter-transformer-lr 0 \
          --adapter-steps 2500                             # the first shipped weights' recipe (model card)
    $ python scripts/train_tiny_flow.py --out runs/n --embed-noise 0.2   # a variant

Writes ``OUT/stages/{parts,transformer,adapter}`` (resumable, each with its ``stage.json``) and the
model folder ``OUT/tiny_flux_digits`` (the layout shipped in
``nw_adapter/models/weights/tiny_flux_digits``). Reuses the VAE, the CLIP text encoder and the CLIP
image encoder of the shipped tiny SD 1.5 digits model, frozen. See
:mod:`nw_adapter.models.training.flux_run` and the model card.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from nw_adapter.commands import whole_number

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import run_and_report, training_parser  # noqa: E402  (the SD 1.5 model's training CLI)


def _number(text: str, wanted: str, holds: Callable[[float], bool]) -> float:
    """``text`` as a finite float for which ``holds`` is true, else argparse's error saying ``wanted``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and holds(value)):
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
    return value


def _probability(text: str) -> float:
    return _number(text, "a probability in [0, 1]", lambda value: 0.0 <= value <= 1.0)


def _non_negative(text: str) -> float:
    return _number(text, "a finite number >= 0", lambda value: value >= 0.0)


def _positive(text: str) -> float:
    return _number(text, "a finite number > 0", lambda value: value > 0.0)


#: The command-line options that set one training setting each (``None``: the default).
OPTION_SETTINGS = {
    "threads": "threads",
    "class_free_drop": "transformer_class_free_drop",
    "double_blocks": "transformer_double_blocks",
    "image_dropout": "image_dropout",
    "single_share": "single_share",
    "embed_noise": "embed_noise",
    "shift_augment": "shift_augment",
    "adapter_steps": "adapter_steps",
    "adapter_lr": "adapter_lr",
    "adapter_transformer_lr": "adapter_transformer_lr",
}


def main(argv: list[str] | None = None) -> int:
    parser = training_parser(
        __doc__.splitlines()[0], "tiny_flux_digits", "steps of both trained stages", prog="train_tiny_flow.py"
    )
    parser.add_argument(
        "--class-free-drop",
        action=argparse.BooleanOptionalAction,
        default=None,
        help='stage 1: a dropped caption becomes "", "a photograph" or "a handwritten digit" (default); '
        '--no-class-free-drop: "" only',
    )
    parser.add_argument(
        "--double-blocks",
        type=int,
        choices=range(1, 9),
        metavar="N",
        default=None,
        help="stage 1: double-stream blocks of the transformer, each with adapter layers (1-8, default 2)",
    )
    parser.add_argument(
        "--image-dropout", type=_probability, default=None, help="stage 2: black-image drop (default 0.05)"
    )
    parser.add_argument(
        "--single-share",
        type=_probability,
        default=None,
        help="stage 2: share of steps with m = 1, the rest m ~ U{2..4} (default: m ~ U{1..4})",
    )
    parser.add_argument(
        "--embed-noise",
        type=_non_negative,
        default=None,
        help="stage 2: Gaussian noise on the reference embeddings, in per-dimension standard deviations "
        "of the training embeddings (default 0)",
    )
    parser.add_argument(
        "--shift-augment",
        type=int,
        choices=range(0, 5),
        metavar="PIXELS",
        default=None,
        help="stage 2: references translated by up to this many pixels (0-4) before the image encoder "
        "(default 0)",
    )
    parser.add_argument(
        "--adapter-steps",
        type=whole_number("--adapter-steps", 1),
        default=None,
        help="stage 2's steps only (default 5000)",
    )
    parser.add_argument(
        "--adapter-lr", type=_positive, default=None, help="stage 2's peak learning rate (default 0.005)"
    )
    parser.add_argument(
        "--adapter-transformer-lr",
        type=_non_negative,
        default=None,
        help="stage 2: train the transformer with the adapter, at this peak learning rate "
        "(default 0.001; 0: frozen, the adapter alone)",
    )
    args = parser.parse_args(argv)
    from nw_adapter.models.training.flux_run import FluxTrainingConfig, run_flux_training

    config = FluxTrainingConfig.quick(args.seed) if args.quick else FluxTrainingConfig(seed=args.seed)
    if args.steps is not None:
        config = replace(config, transformer_steps=args.steps, adapter_steps=args.steps)
    for option, setting in OPTION_SETTINGS.items():  # the options given, each to its setting
        if getattr(args, option) is not None:
            config = replace(config, **{setting: getattr(args, option)})
    return run_and_report(
        "train_tiny_flow.py",
        args.out,
        lambda: run_flux_training(args.out, config, progress=not args.no_progress),
    )


if __name__ == "__main__":
    sys.exit(main())
