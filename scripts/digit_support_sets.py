"""Write support sets of held-out digits, one subfolder per set, for ``correlate.py --support-dir``.

$ python scripts/digit_support_sets.py sets/ --sizes 1,2,4 --per-group 10
$ python scripts/correlate.py --model tiny --support-dir sets/ --steps 20 --out support_out

A bad option is one line naming it and the fix (exit status 2): a folder that is empty (the current
folder), a file or inside one; set sizes outside 1..10; a seed outside ``[0, 2**63)``.
"""

from __future__ import annotations

import argparse
import sys

from nw_adapter.commands import ScriptParser, output_folder, seed_number, whole_number

PROG = "digit_support_sets.py"
MAX_SIZE = 10
"""The largest set size m: one digit per class in a mixed set."""


def _sizes(text: str) -> list[int]:
    """``--sizes``: comma-separated whole numbers in 1..:data:`MAX_SIZE`."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(not 1 <= m <= MAX_SIZE for m in sizes):
        raise argparse.ArgumentTypeError(
            f"--sizes must be comma-separated set sizes from 1 to {MAX_SIZE}, got {text!r} "
            "(e.g. --sizes 1,2,4)"
        )
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=output_folder("folder"), help="where the set folders are written")
    parser.add_argument(
        "--sizes", type=_sizes, default=[1, 2, 4], help="comma-separated set sizes m (default 1,2,4)"
    )
    parser.add_argument(
        "--per-group",
        type=whole_number("--per-group", 1),
        default=10,
        help="sets per (m, same/mixed) (default 10)",
    )
    parser.add_argument("--seed", type=seed_number("--seed"), default=0, help="seed of the draws (default 0)")
    args = parser.parse_args(argv)
    from nw_adapter.correlate.digit_sets import write_digit_support_sets

    try:
        folders = write_digit_support_sets(args.folder, args.sizes, args.per_group, args.seed)
    except OSError as exc:
        reason = exc.strerror or exc
        print(
            f"{PROG}: error: cannot write to '{args.folder}' ({reason}); pass a writable folder",
            file=sys.stderr,
        )
        return 2
    print(f"{len(folders)} sets written to {args.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
