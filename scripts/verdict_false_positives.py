"""How often the verdict says "evidence" on random-weight models (nothing learned): counts per model.

Example:
    python scripts/verdict_false_positives.py --seeds 10 --out fp_runs

See :mod:`nw_adapter.correlate.false_positives`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from nw_adapter.commands import ScriptParser, output_folder, whole_number
from nw_adapter.correlate.false_positives import MODELS, count_verdicts


def main(argv: Sequence[str] | None = None) -> int:
    parser = ScriptParser(prog="verdict_false_positives.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=MODELS, help="(repeatable; default: all of them)")
    parser.add_argument(
        "--seeds",
        type=whole_number("--seeds", 1),
        default=10,
        help="runs per model, seeds 0..N-1 (default 10)",
    )
    parser.add_argument("--images", type=int, default=3, choices=(2, 3, 4), help="references per run")
    parser.add_argument(
        "--steps",
        type=whole_number("--steps", 1, 1000),
        default=3,
        help="denoising steps per run (default 3)",
    )
    parser.add_argument("--out", type=output_folder("--out"), required=True, help="folder for the runs")
    args = parser.parse_args(argv)
    for model in args.model or MODELS:
        counts = count_verdicts(model, seeds=args.seeds, images=args.images, steps=args.steps, out=args.out)
        print(f"{model}: " + ", ".join(f"{key} {value}" for key, value in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
