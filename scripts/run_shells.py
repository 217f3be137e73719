"""Geometry mismatch: concentric shells at d = 8, 16, 32.

Usage: python scripts/run_shells.py --out DIR [--quick] (same options as run_experiments.py)
"""

import sys

from nw_adapter.experiments.cli import main

if __name__ == "__main__":
    sys.exit(main(regimes=("shells",), description="Geometry mismatch: concentric shells at d = 8, 16, 32."))
