"""Reproduce the paper's three failure regimes and write a report.

Usage: python scripts/run_experiments.py --out DIR [--quick] [--workers 2] [--features F.npz]
"""

import sys

from nw_adapter.experiments.cli import main

if __name__ == "__main__":
    sys.exit(main())
