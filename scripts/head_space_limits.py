"""What a head-space reading can and cannot establish (docs/THEORY.md, issue 26 item 1).

Usage: python scripts/head_space_limits.py [--draws 10]

Prints, for Theorem 3's exact data-space NW head (support with unequal norms) at the true bandwidths
h = 0.25 ... 4, in both q/k forms (THEORY section 3's folded form and the form with 1/h^2 in the
softmax scale; the same attention): the share of draws with nw_gain < 0, the median fitted h_eff,
the log-log slope of h_eff on h, and the slope of log logit_scale on log h for several supports
(following the schedule and at a fixed bandwidth); then the largest gap between a random dot-product
head and the NW smoother of its augmented space (float64). The draw (seed) is the unit.
"""

import statistics
import sys

import numpy as np
import torch

from nw_adapter.commands import ScriptParser, whole_number
from nw_adapter.core.intervals import t_interval
from nw_adapter.experiments.head_space_limits import (
    BANDWIDTHS,
    HEAD_FORMS,
    SUPPORT_GAINS,
    augmented_space_gap,
    bandwidth_path_slopes,
    log_log_slope,
    measure_bandwidth_sweep,
)

#: Support geometries of the logit_scale check: name -> norm gains of the support points.
SUPPORTS = {
    "unequal norms 0.8-1.6 (4 keys)": SUPPORT_GAINS,
    "equal norms (4 keys)": (1.0, 1.0, 1.0, 1.0),
    "wide norms 0.2-3 (16 keys)": tuple(np.linspace(0.2, 3.0, 16)),
}


def _interval(values: list[float]) -> str:
    mean, low, high = (f"{v:.3f}".replace("-0.000", "0.000") for v in t_interval(values))
    return f"{mean} [{low}, {high}]"


def _sweep_table(draws: int) -> None:
    print("| form | reading | " + " | ".join(f"h = {h:g}" for h in BANDWIDTHS) + " | log-log slope on h |")
    print("|---|---|" + "---|" * (len(BANDWIDTHS) + 1))
    for form in HEAD_FORMS:
        sweep = measure_bandwidth_sweep(draws, form=form)
        share = " | ".join(f"{100 * v:.0f}%" for v in sweep.share_negative_gain())
        print(f"| {form} | draws with nw_gain < 0 | {share} | |")
        medians = sweep.median_h_eff()
        cells = " | ".join(f"{v:.3g}" for v in medians)
        slope = log_log_slope(sweep.bandwidths, medians)
        per_draw = statistics.median(sweep.h_eff_slopes())
        print(f"| {form} | median h_eff | {cells} | {slope:.2f} (median per draw {per_draw:.2f}) |")
        columns = range(len(BANDWIDTHS))
        scales = " | ".join(f"{statistics.median(row[b] for row in sweep.logit_scale):.3g}" for b in columns)
        scale_slope = statistics.median(sweep.logit_scale_slopes())
        print(f"| {form} | median logit_scale | {scales} | {scale_slope:.3f} |")


def _path_table(draws: int) -> None:
    print("| support | form | slope of log logit_scale on log h: follows h | fixed h = 1 |")
    print("|---|---|---|---|")
    for name, gains in SUPPORTS.items():
        for form in HEAD_FORMS:
            follows = bandwidth_path_slopes(draws, form=form, gains=gains)
            fixed = bandwidth_path_slopes(draws, fixed=1.0, form=form, gains=gains)
            print(f"| {name} | {form} | {_interval(follows)} | {_interval(fixed)} |")


def _identity_line(draws: int) -> None:
    gaps = []
    for seed in range(draws):
        generator = torch.Generator().manual_seed(seed)
        q = 3.0 * torch.randn(2, 4, 64, 16, generator=generator, dtype=torch.float64)
        norms = 0.1 + 4.0 * torch.rand(2, 4, 16, 1, generator=generator, dtype=torch.float64)
        k = norms * torch.randn(2, 4, 16, 16, generator=generator, dtype=torch.float64)
        gaps.append(augmented_space_gap(q, k, scale=16**-0.5))
    print(
        f"augmented-space identity: largest |log A - log NW(u, v)| over {draws} random heads: {max(gaps):.2e}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(prog="head_space_limits.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--draws",
        type=whole_number("--draws", 2),
        default=10,
        help="draws (seeds) per cell, >= 2 (default 10)",
    )
    args = parser.parse_args(argv)
    _sweep_table(args.draws)
    print()
    _path_table(args.draws)
    print()
    _identity_line(args.draws)
    return 0


if __name__ == "__main__":
    sys.exit(main())
