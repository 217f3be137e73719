#!/usr/bin/env python
"""rho between IP-Adapter's image-branch attention and NW weights, per timestep.

Thin wrapper around :func:`nw_adapter.correlate.cli.main`; run ``python scripts/correlate.py --help``.
The repository root is put first on ``sys.path`` so the script also runs from a clone that
is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nw_adapter.correlate.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
