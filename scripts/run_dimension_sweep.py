"""Nearest-neighbour collapse: Gaussian mixtures at d = 2, 4, 8, 16.

Usage: python scripts/run_dimension_sweep.py --out DIR [--quick] (same options as run_experiments.py)
"""

import sys

from nw_adapter.experiments.cli import main

if __name__ == "__main__":
    sys.exit(
        main(
            regimes=("dims",), description="Nearest-neighbour collapse: Gaussian mixtures at d = 2, 4, 8, 16."
        )
    )
