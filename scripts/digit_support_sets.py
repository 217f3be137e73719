"""Write support sets of held-out digits, one subfolder per set, for ``correlate.py --support-dir``.

$ python scripts/digit_support_sets.py sets/ --sizes 1,2,4 --per-group 10
$ python scripts/correlate.py --model tiny --support-dir sets/ --steps 20 --out support_out
"""

from __future__ import annotations

import argparse

from nw_adapter.correlate.digit_sets import write_digit_support_sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--sizes", default="1,2,4", help="comma-separated set sizes m (default 1,2,4)")
    parser.add_argument("--per-group", type=int, default=10, help="sets per (m, same/mixed) (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        folders = write_digit_support_sets(args.folder, sizes, args.per_group, args.seed)
    except ValueError as error:
        parser.error(str(error))
    print(f"{len(folders)} sets written to {args.folder}")


if __name__ == "__main__":
    main()
