"""Support scarcity: real features (digits or yours), m = 1..50.

Usage: python scripts/run_support_sweep.py --out DIR [--quick] (same options as run_experiments.py)
"""

import sys

from nw_adapter.experiments.cli import main

if __name__ == "__main__":
    sys.exit(
        main(regimes=("digits",), description="Support scarcity: real features (digits or yours), m = 1..50.")
    )
