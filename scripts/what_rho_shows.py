"""The table of docs/THEORY.md "What rho can and cannot show": synthetic heads, 10 seeds each.

Usage: python scripts/what_rho_shows.py [--seeds 10]

Prints, per head of nw_adapter.experiments.synthetic_heads.HEADS, the mean over seeds (one draw
per seed, the independent unit) and a Student t 95% interval of rho, its nulls and the readings.
"""

import sys

from nw_adapter.commands import ScriptParser, whole_number
from nw_adapter.core.intervals import t_interval
from nw_adapter.experiments.synthetic_heads import measure_heads

COLUMNS = (
    "rho",
    "rho_norm_matched_null",
    "rho_spread_null",
    "r2_key",
    "r2_nw",
    "kl_nw_fit",
    "kl_key_prior",
    "nw_gain",
    "two_term_share",
)


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(prog="what_rho_shows.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seeds", type=whole_number("--seeds", 2), default=10, help="draws per head, >= 2 (default 10)"
    )
    args = parser.parse_args(argv)
    table = measure_heads(args.seeds)
    print("| head | " + " | ".join(COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for name, values in table.items():
        cells = []
        for column in COLUMNS:
            mean, low, high = t_interval(values[column])
            cells.append(f"{mean:.3f} [{low:.3f}, {high:.3f}]")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
